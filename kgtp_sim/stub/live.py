"""The live view: registers and memory of the running kernel, read coherently through the machine.

Registers are those of one CPU (the thread GDB selected with `Hg` names it: stub/kernel.py); memory is the
kernel's, shared by every CPU, or a process's (the space the caller names: stub/kernel.py reads a user address
through the thread's CPU's). Runs on the server thread; the machine runs each read on the CPU thread."""

from __future__ import annotations

from dataclasses import dataclass

from ..machine import Machine, MemoryFault
from ..uc_paging import AddressSpace
from ..tracing.core.frames import ViewError

_PAGE = 0x1000


@dataclass
class LiveView:
    machine: Machine

    def registers(self, cpu: int = 0) -> dict[str, int | None]:
        """The registers of CPU `cpu`."""
        return dict(self.machine.registers(cpu=cpu))

    def read_memory(self, address: int, length: int, space: AddressSpace | None = None) -> bytes:
        """Read `length` bytes (as `space` maps them; None: the kernel's), or the readable prefix when the range
        runs into unmapped memory."""
        try:
            return self.machine.read_memory(address, length, space)
        except MemoryFault:
            pass
        # Partial read: page by page up to the first hole, so `x/…` at the end of a mapping still works.
        out = bytearray()
        cursor = address
        end = address + length
        while cursor < end:
            step = min(end, (cursor | (_PAGE - 1)) + 1) - cursor
            try:
                out += self.machine.read_memory(cursor, step, space)
            except MemoryFault:
                break
            cursor += step
        if not out:
            raise ViewError(f"cannot access memory at {address:#x}")
        return bytes(out)

    def write_memory(self, address: int, data: bytes, space: AddressSpace | None = None) -> None:
        try:
            self.machine.write_memory(address, data, space)
        except MemoryFault as fault:
            raise ViewError(str(fault)) from None
