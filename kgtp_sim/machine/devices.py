"""The machine's I/O ports: what the kernel's `in`/`out` instructions reach.

| port  | access     | meaning |
|-------|------------|---------|
| 0xe9  | outb       | console: one character, kept in a ring (`monitor console`) and logged line by line |
| 0x80  | outl       | page-frame command in %eax: 4 = allocate a zeroed frame for the demand region, 5 = free the frame |
|       |            | at physical address %rdi. The kernel maps and unmaps its pages itself (page-table entry, invlpg) |
| 0x80  | inl        | result of the last command: after 4 the frame's physical address (0: none left); after 5 0 done, |
|       |            | 1 refused (not a frame the kernel holds); any other command is refused (1)                       |
| 0x70  | inl        | clock: nanoseconds since the machine started (less the time it was stopped by a debugger: |
|       |            | clock.py), low 32 bits; latches the high half for the calling CPU                          |
| 0x71  | inl        | clock: the high 32 bits the calling CPU latched |
| 0xf4  | outl       | power: the kernel stopped for good (panic); the value is kept as `Devices.power_off_code` |

Reads of any other port return all ones, like an empty ISA bus; writes to them are ignored.

Owns the console ring, the page-frame command's status and the clock's latched high halves, one per CPU (each
CPU reads the pair with interrupts off and no lock: another CPU's read between its two cannot change its latch;
a machine-wide latch made every clock read take a lock, and a CPU whose turn ended inside that lock, between two
port reads, kept the others spinning). Thread: the CPU thread,
where unicorn's IN/OUT hooks reach the ports and the host's console writes arrive (`Machine.console_write`, through
`run_on_cpu`); `console_text` returns a copy of the ring to the server thread (`monitor console`).
"""

from __future__ import annotations

import logging
from typing import Callable

from .clock import MachineClock

log = logging.getLogger(__name__)

PORT_CONSOLE = 0xE9
PORT_PAGING = 0x80
PAGING_ALLOC_FRAME = 4
PAGING_FREE_FRAME = 5
PORT_CLOCK_LO = 0x70
PORT_CLOCK_HI = 0x71
PORT_POWER = 0xF4

CONSOLE_RING = 64 * 1024


class Devices:
    """Port handlers. `alloc_frame`/`free_frame` come from the CPU (its pool of demand frames), `clock` from the
    machine (a clock of its own, never stopped, when none is given)."""

    def __init__(self, alloc_frame: Callable[[], int], free_frame: Callable[[int], bool],
                 clock: MachineClock | None = None, current_cpu: Callable[[], int] = lambda: 0) -> None:
        self._alloc_frame = alloc_frame
        self._free_frame = free_frame
        self._console = bytearray()
        self._line = bytearray()
        self._paging_status = 0
        self._clock = clock if clock is not None else MachineClock()
        self._current_cpu = current_cpu
        self._clock_high: dict[int, int] = {}  #: each CPU's latched high half
        self.power_off_code: int | None = None
        self.frames_allocated = 0
        self.frames_freed = 0

    # ---- port dispatch (called from unicorn's IN/OUT hooks, on the CPU thread) -------------------------------

    def port_out(self, port: int, size: int, value: int, rdi: int) -> None:
        if port == PORT_CONSOLE:
            self._console_byte(value & 0xFF)
        elif port == PORT_PAGING:
            if value == PAGING_ALLOC_FRAME:
                frame = self._alloc_frame()
                self.frames_allocated += frame != 0
                self._paging_status = frame
            elif value == PAGING_FREE_FRAME:
                ok = self._free_frame(rdi)
                self.frames_freed += ok
                self._paging_status = 0 if ok else 1
            else:
                self._paging_status = 1
        elif port == PORT_POWER:
            self.power_off_code = value
            log.warning("kernel powered off (code %d)", value)

    def port_in(self, port: int, size: int) -> int:
        if port == PORT_PAGING:
            return self._paging_status
        if port == PORT_CLOCK_LO:
            now = self._clock.ns()
            self._clock_high[self._current_cpu()] = now >> 32
            return now & 0xFFFF_FFFF
        if port == PORT_CLOCK_HI:
            return self._clock_high.get(self._current_cpu(), 0)
        return (1 << (8 * size)) - 1

    # ---- console ---------------------------------------------------------------------------------------------

    def _console_byte(self, byte: int) -> None:
        self._console.append(byte)
        if len(self._console) > CONSOLE_RING:
            del self._console[: len(self._console) - CONSOLE_RING]
        if byte == 0x0A:
            log.info("console: %s", self._line.decode("utf-8", "replace"))
            self._line.clear()
        else:
            self._line.append(byte)

    def console_write(self, data: bytes) -> None:
        """Text the host side prints on the kernel's console (KGTP's printk from a tracepoint), as if the kernel
        wrote it to the port byte by byte."""
        for byte in data:
            self._console_byte(byte)

    def console_text(self) -> str:
        """The most recent console output (up to 64 KiB)."""
        return bytes(self._console).decode("utf-8", "replace")
