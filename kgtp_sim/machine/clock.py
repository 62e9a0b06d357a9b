"""The machine's time as its kernel sees it: the host's time less the time the machine spent stopped by a debugger.

The kernel has two clocks (docs/DESIGN.md, Devices): the clock port's nanoseconds since the machine started
(`sched_clock()`, ports 0x70/0x71) and the TSC (`rdtsc`, which unicorn answers with the host's TSC plus the CPU's
`tsc_offset`); the tracer stamps frames with the TSC too (tracing/core/clock.py). The timer ticks (`jiffies`) are the
scheduler's (scheduler.py), which gives none while the machine is stopped. As under QEMU's gdbstub, a stopped
machine's time does not run: `freeze` notes the host's time and TSC when the machine stops, `thaw` adds what passed
to the time spent stopped when it resumes, and every reading subtracts it. A reading while frozen is the one of the
instant the machine stopped. The emulated CPUs get the TSC part through their `tsc_offset` (`tsc_offset`, written
into every CPU's context by the scheduler on resuming), so native code's `rdtsc` and Python's readings agree.

`HostTsc` reads the host's TSC (unicorn's rdtsc is the host's) with `rdtsc` itself, in an executable host page called
through ctypes (`native_rdtsc`, a fraction of a microsecond; the performance counters use it too), or where W+X
pages are refused by running `rdtsc` in a tiny private CPU under a lock (one unicorn instance cannot run on two
threads at once; some microseconds).

Readable from any thread (the CPU thread at hits and port reads, the server thread for GDB's `print $rdtsc`);
`freeze` and `thaw` run on the CPU thread, when the machine stops and resumes.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from typing import Callable

from unicorn import UC_ARCH_X86, UC_MODE_64, Uc
from unicorn.x86_const import UC_X86_REG_RAX, UC_X86_REG_RDX

from ..uc_native import native_function

_CODE = 0x1000
#: rdtsc; hlt. The hlt ends the run: ending it with an `until` address made unicorn translate the block afresh at
#: every read (measured: 36 MiB more translated code per 100,000 reads).
_RDTSC_HLT = b"\x0f\x31\xf4"
_NO_EXIT = 0xFFFF_FFFF_FFFF_FFFF
_MASK64 = (1 << 64) - 1
# rdtsc; shl $32, %rdx; or %rdx, %rax; ret: the host's TSC, which is what the emulated rdtsc returns
_RDTSC_CODE = bytes.fromhex("0f31" "48c1e220" "4809d0" "c3")


@functools.cache
def native_rdtsc() -> Callable[[], int] | None:
    """The host's TSC read by `rdtsc` in host code, callable from any thread; None where W+X pages are refused."""
    address = native_function(_RDTSC_CODE)
    return ctypes.CFUNCTYPE(ctypes.c_uint64)(address) if address is not None else None


class HostTsc:
    """The host's TSC, as unicorn's `rdtsc` gives it to a CPU whose `tsc_offset` is 0."""

    def __init__(self, native: bool = True) -> None:
        self._native = native_rdtsc() if native else None
        self._lock = threading.Lock()
        self._uc: Uc | None = None
        if self._native is None:
            self._uc = Uc(UC_ARCH_X86, UC_MODE_64)
            self._uc.mem_map(_CODE, 0x1000)
            self._uc.mem_write(_CODE, _RDTSC_HLT)

    def read(self) -> int:
        if self._native is not None:
            return self._native()
        assert self._uc is not None
        with self._lock:
            self._uc.emu_start(_CODE, _NO_EXIT)
            return (self._uc.reg_read(UC_X86_REG_RDX) << 32) | (self._uc.reg_read(UC_X86_REG_RAX) & 0xFFFFFFFF)


class MachineClock:
    """The nanoseconds and the TSC of one machine, neither running while it is stopped."""

    def __init__(self) -> None:
        self.host = HostTsc()
        self._lock = threading.Lock()
        self._base_ns = time.monotonic_ns()
        self.stopped_ns = 0  #: host nanoseconds the machine spent stopped, up to its last resume
        self.stopped_ticks = 0  #: host TSC ticks likewise
        self._frozen: tuple[int, int] | None = None  # (monotonic ns, host TSC) when the machine stopped

    @property
    def frozen(self) -> bool:
        return self._frozen is not None

    def restart(self) -> None:
        """Count from now, as a new clock would: for a machine built ahead of its use that has not run yet
        (Machine.prepared)."""
        with self._lock:
            self._base_ns = time.monotonic_ns()
            self.stopped_ns = self.stopped_ticks = 0
            self._frozen = None

    def freeze(self) -> None:
        """The machine stopped: its time stands still from now."""
        with self._lock:
            if self._frozen is None:
                self._frozen = (time.monotonic_ns(), self.host.read())

    def thaw(self) -> None:
        """The machine resumes: the time it stood still is taken out of every later reading."""
        with self._lock:
            if self._frozen is not None:
                ns, ticks = self._frozen
                self.stopped_ns += time.monotonic_ns() - ns
                self.stopped_ticks += self.host.read() - ticks
                self._frozen = None

    def ns(self) -> int:
        """Nanoseconds since the machine started, without the time it was stopped (the clock port's reading)."""
        with self._lock:
            now = self._frozen[0] if self._frozen is not None else time.monotonic_ns()
            return now - self._base_ns - self.stopped_ns

    def guest_tsc(self, host_ticks: int) -> int:
        """The TSC the machine's CPUs read when the host's reads `host_ticks` (while frozen: the TSC of the
        instant it stopped, whatever `host_ticks` is)."""
        with self._lock:
            if self._frozen is not None:
                host_ticks = self._frozen[1]
            return host_ticks - self.stopped_ticks

    def tsc(self) -> int:
        """The machine's TSC now."""
        return self.guest_tsc(self.host.read())

    @property
    def tsc_offset(self) -> int:
        """What each CPU's `tsc_offset` holds, so that its `rdtsc` reads `tsc()`: minus the ticks spent stopped."""
        return -self.stopped_ticks & _MASK64
