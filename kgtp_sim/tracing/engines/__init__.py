"""Tracing's third layer: the hit paths of the three engines, and putting a run's probes into the kernel.

The interpreted hit and while-stepping (`hits`), the compiled engines' per-run state and patching (`native`),
the registers of a hit (`fastregs`), and the probe set that installs, chains and removes locations on either
path (`installer`). Imports `patching` and `core`.
"""
