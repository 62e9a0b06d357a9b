"""The machine's I/O ports: what the kernel's `in`/`out` instructions reach.

| port  | access     | meaning |
|-------|------------|---------|
| 0xe9  | outb       | console: one character, kept in a ring (`monitor console`) and logged line by line |
| 0x80  | outl       | paging command in %eax, address in %rdi: 1 = map the page holding it (zeroed, RW), 2 = unmap it, |
|       |            | 3 = unmap every demand page (2 and 3 flush the CPU's TLB: costly, so the kernel uses 3, rarely)   |
| 0x80  | inl        | status of the last paging command: 0 done, 1 refused (outside the demand region / already in that state) |
| 0x70  | inl        | clock: nanoseconds since the machine started, low 32 bits; latches the high half |
| 0x71  | inl        | clock: the latched high 32 bits |
| 0xf4  | outl       | power: the kernel stopped for good (panic); the value is kept as `Devices.power_off_code` |

Reads of any other port return all ones, like an empty ISA bus; writes to them are ignored.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

log = logging.getLogger(__name__)

PORT_CONSOLE = 0xE9
PORT_PAGING = 0x80
PAGING_MAP = 1
PAGING_UNMAP = 2
PAGING_UNMAP_ALL = 3
PORT_CLOCK_LO = 0x70
PORT_CLOCK_HI = 0x71
PORT_POWER = 0xF4

CONSOLE_RING = 64 * 1024


class Devices:
    """Port handlers. `map_page`/`unmap_page` come from the CPU (they change its memory map)."""

    def __init__(self, map_page: Callable[[int], bool], unmap_page: Callable[[int | None], bool]) -> None:
        self._map_page = map_page
        self._unmap_page = unmap_page
        self._console = bytearray()
        self._line = bytearray()
        self._paging_status = 0
        self._clock_base = time.monotonic_ns()
        self._clock_high = 0
        self.power_off_code: int | None = None
        self.pages_mapped = 0
        self.pages_unmapped = 0  #: by PAGING_UNMAP only

    # ---- port dispatch (called from unicorn's IN/OUT hooks, on the CPU thread) -------------------------------

    def port_out(self, port: int, size: int, value: int, rdi: int) -> None:
        if port == PORT_CONSOLE:
            self._console_byte(value & 0xFF)
        elif port == PORT_PAGING:
            if value == PAGING_MAP:
                ok = self._map_page(rdi)
                self.pages_mapped += ok
            elif value == PAGING_UNMAP:
                ok = self._unmap_page(rdi)
                self.pages_unmapped += ok
            elif value == PAGING_UNMAP_ALL:
                ok = self._unmap_page(None)
            else:
                ok = False
            self._paging_status = 0 if ok else 1
        elif port == PORT_POWER:
            self.power_off_code = value
            log.warning("kernel powered off (code %d)", value)

    def port_in(self, port: int, size: int) -> int:
        if port == PORT_PAGING:
            return self._paging_status
        if port == PORT_CLOCK_LO:
            now = time.monotonic_ns() - self._clock_base
            self._clock_high = now >> 32
            return now & 0xFFFF_FFFF
        if port == PORT_CLOCK_HI:
            return self._clock_high
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

    def console_text(self) -> str:
        """The most recent console output (up to 64 KiB)."""
        return bytes(self._console).decode("utf-8", "replace")
