"""Timestamps for trace frames: the emulated CPU's TSC, readable from Python too.

Native frame commits stamp `rdtsc`. Unicorn's `rdtsc` returns the host's TSC, so Python-side writers (the
interpreter engine) read the same clock by running `rdtsc` in a tiny private CPU: one time base for every frame,
converted to nanoseconds with a rate measured once against the host's monotonic clock.

Readable from any thread (the CPU thread at hits, the server thread for GDB's `print $rdtsc`): the private CPU
runs under a lock, as one unicorn instance cannot run on two threads at once.
"""

from __future__ import annotations

import threading
import time
from functools import cached_property

from unicorn import UC_ARCH_X86, UC_MODE_64, Uc
from unicorn.x86_const import UC_X86_REG_RAX, UC_X86_REG_RDX

_CODE = 0x1000
#: rdtsc; hlt. The hlt ends the run: ending it with an `until` address made unicorn translate the block afresh at
#: every read (measured: 36 MiB more translated code per 100,000 reads).
_RDTSC_HLT = b"\x0f\x31\xf4"
_NO_EXIT = 0xFFFF_FFFF_FFFF_FFFF


class Tsc:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._uc = Uc(UC_ARCH_X86, UC_MODE_64)
        self._uc.mem_map(_CODE, 0x1000)
        self._uc.mem_write(_CODE, _RDTSC_HLT)

    def read(self) -> int:
        with self._lock:
            self._uc.emu_start(_CODE, _NO_EXIT)
            return (self._uc.reg_read(UC_X86_REG_RDX) << 32) | (self._uc.reg_read(UC_X86_REG_RAX) & 0xFFFFFFFF)

    @cached_property
    def ticks_per_ns(self) -> float:
        t0, c0 = time.perf_counter_ns(), self.read()
        time.sleep(0.02)
        t1, c1 = time.perf_counter_ns(), self.read()
        return max((c1 - c0) / max(t1 - t0, 1), 1e-9)

    def to_ns(self, ticks: int) -> int:
        return int(ticks / self.ticks_per_ns)

    @cached_property
    def _origin(self) -> tuple[int, int]:
        return time.perf_counter_ns(), self.read()

    def anchor(self) -> int:
        """Read the TSC and make it `now()`'s starting point: `now()` is exact at this instant and never below
        this reading afterwards (the tracer anchors at tstart, so no frame of a run predates its start)."""
        reading = time.perf_counter_ns(), self.read()
        self.__dict__["_origin"] = reading
        return reading[1]

    def now(self) -> int:
        """The TSC now, from the host clock and the measured rate: a few hundred ns instead of an emulation."""
        ns0, tsc0 = self._origin
        return tsc0 + int((time.perf_counter_ns() - ns0) * self.ticks_per_ns)
