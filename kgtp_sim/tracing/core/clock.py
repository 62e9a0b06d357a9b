"""Timestamps for trace frames: the emulated CPU's TSC, readable from Python too.

Native frame commits stamp `rdtsc`. The machine's clock (machine/clock.py) gives Python-side writers (the
interpreter engine) the same TSC: the host's, read by a tiny private CPU, less the time the machine spent stopped
by a debugger (the emulated CPUs' `tsc_offset` takes the same out of their `rdtsc`). One time base for every frame,
converted to nanoseconds with a rate measured once against the host's monotonic clock.

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

    @cached_property
    def _origin(self) -> tuple[int, int]:
        return time.perf_counter_ns(), self.clock.host.read()

    def anchor(self) -> int:
        """Read the TSC and make it `now()`'s starting point: `now()` is exact at this instant and never below
        this reading afterwards (the tracer anchors at tstart, so no frame of a run predates its start)."""
        reading = time.perf_counter_ns(), self.read()
        self.__dict__["_origin"] = reading
        return reading[1]

    def now(self) -> int:
        """The TSC now, from the host clock and the measured rate: a few hundred ns instead of an emulation."""
        ns0, tsc0 = self._origin
        return self.clock.guest_tsc(tsc0 + int((time.perf_counter_ns() - ns0) * self.ticks_per_ns))
