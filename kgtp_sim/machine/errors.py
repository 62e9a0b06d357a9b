"""Errors the machine layer raises; each message is one line a user can act on.

No thread of its own: each error is raised on the thread that meets it; one raised inside a request to the CPU
thread is raised again on the requester's (`Machine.run_on_cpu`).
"""

from __future__ import annotations


class KernelImageError(Exception):
    """The kernel ELF cannot be used: missing, not an ELF, not x86_64, or a malformed marker table."""


class MachineError(Exception):
    """The simulated machine cannot go on: an exception with no IDT gate, a failed emulation, a bad request."""


class MemoryFault(Exception):
    """An access by the debugger (not the kernel) to memory that is not mapped."""

    def __init__(self, address: int, length: int, write: bool = False) -> None:
        self.address = address
        self.length = length
        self.write = write
        verb = "write" if write else "read"
        super().__init__(f"cannot {verb} {length} bytes at {address:#x}: not mapped")
