"""kgtp-sim: a GDB remote stub emulating KGTP over a simulated x86_64 kernel."""
