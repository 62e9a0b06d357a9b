"""The stub: packet handlers that serve GDB, grouped by family, and the targets they serve it from.

The register, memory, thread and run-control families (core.py, threads.py, run.py) speak to one target interface
(target.py) only; KGTP mode's target is the kernel (kernel.py, over live.py and the trace-frame overlay, overlay.py
and replay.py). The tracing (trace.py) and monitor (monitor.py, machine_monitor.py) families are KGTP's own."""
