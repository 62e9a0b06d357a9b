"""The stub: packet handlers that serve GDB from the machine and the tracing engine, grouped by family."""
