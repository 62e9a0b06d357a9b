"""Timestamps for trace frames: the emulated CPU's TSC, readable from Python too.

Native frame commits stamp `rdtsc`. The machine's clock (machine/clock.py) gives Python-side writers (the
interpreter engine, while-stepping, watch tracepoints, `$kret`) the same TSC: the host's, read by `rdtsc` in host
code, less the time the machine spent stopped by a debugger (the emulated CPUs' `tsc_offset` takes the same out of
their `rdtsc`). One clock, read (never extrapolated) at every frame of every path, so each CPU's frames are in time
order and the merged frames too; converted to nanoseconds with a rate measured once against the host's monotonic
clock (for `$clock`, the `$xtime` variables and the views).

Readable from any thread (the CPU thread at hits, the server thread for GDB's `print $rdtsc`).
"""

from __future__ import annotations

import time
from functools import cached_property

from ...machine.clock import MachineClock


class Tsc:
    """The TSC of `clock`'s machine (a clock of its own, never stopped, when none is given)."""

    def __init__(self, clock: MachineClock | None = None) -> None:
        self.clock = clock if clock is not None else MachineClock()

    def read(self) -> int:
        """The machine's TSC now: what a CPU's `rdtsc` reads at this instant (the frame stamp of every path)."""
        return self.clock.tsc()

    @cached_property
    def ticks_per_ns(self) -> float:
        host = self.clock.host
        t0, c0 = time.perf_counter_ns(), host.read()
        time.sleep(0.02)
        t1, c1 = time.perf_counter_ns(), host.read()
        return max((c1 - c0) / max(t1 - t0, 1), 1e-9)

    def to_ns(self, ticks: int) -> int:
        return int(ticks / self.ticks_per_ns)
