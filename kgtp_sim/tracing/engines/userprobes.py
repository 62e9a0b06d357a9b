"""Tracepoints in a program (the gdbserver role's process): an int3 in the program's own memory, its hit on the
Python path, and the probed instruction run in place.

The int3 is written into the program's page (its private copy: another process running the same code at the
same address has no int3 there), so only the program hits it; the handler still checks the address space the
CPU has loaded, and an int3 of another space at that address (that program's own) goes to the kernel as the #BP
it is. At a hit the location's condition and actions run as any int3 location's (hits.interpreted_hit, reading
memory through the program's space); then the probed instruction runs where it is: the original byte goes back,
the CPU steps that one instruction (EFLAGS.TF: the scheduler neither switches CPUs nor takes interrupts while it
is set, and no other CPU runs meanwhile, as the machine runs one CPU at a time), and the #DB after it puts the int3
back. The kernel's compiled detours live in supervisor-only module space, which ring 3 cannot run: a program's
tracepoints always take this path, whatever the engine.

Owns the program's int3 sites (address -> the byte they replace, the locations sharing them). Runs on the CPU
thread: install and remove under the tracer's run changes, the handlers inside the int3 and #DB hooks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from unicorn import Uc
from unicorn import x86_const as X

from ..core.model import TraceError
from ..core.run import Run
from ..patching.placement import Installed
from ..patching.probes import INT3
from .hits import EFLAGS_TF, interpreted_hit


@dataclass
class _Site:
    original: bytes
    items: list[Installed] = field(default_factory=list)


class ProgramProbes:
    """The int3s of the run's tracepoints in its program (`Run.user_space`)."""

    def __init__(self, tracer: Run) -> None:
        self.tracer = tracer
        self.machine = tracer.machine
        self.sites: dict[int, _Site] = {}
        self._stepping: tuple[int, Any] | None = None  # (the site being stepped over, the debug trap before ours)
        self._stepped_by_debugger = False  # TF was the debugger's when the int3 trapped

    def install(self, item: Installed) -> None:
        address = item.site.address
        site = self.sites.get(address)
        if site is None:
            original = self._swap(item.space, address, INT3)
            if original is None:
                raise TraceError(f"tracepoint {item.tracepoint.number} at {address:#x}: no memory of the program there")
            site = self.sites[address] = _Site(original)
            self.machine.breakpoints[address] = lambda uc, site=site, address=address: self._hit(uc, address, site)
        item.out_of_line = address  # the instruction runs in place
        site.items.append(item)

    def remove(self, item: Installed) -> None:
        address = item.site.address
        site = self.sites.get(address)
        if site is None or item not in site.items:
            return
        site.items.remove(item)
        if site.items:
            return
        del self.sites[address]
        self.machine.breakpoints.pop(address, None)
        if self._stepping is None or self._stepping[0] != address:  # else the step's end leaves the byte back
            self._swap(item.space, address, site.original)

    # ---- the CPU thread, inside emulation ---------------------------------------------------------------

    @staticmethod
    def _swap(space: Any, address: int, data: bytes) -> bytes | None:
        """Write `data` at `address` of the program's space (present pages only); what was there, or None."""
        physical = space.translate(address, len(data))
        if physical is None:
            return None
        old = bytes(Uc.mem_read(space.uc, physical, len(data)))
        Uc.mem_write(space.uc, physical, data)
        return old

    def _hit(self, uc: Uc, address: int, site: _Site) -> None:
        space = site.items[0].space if site.items else None
        if space is None or uc.reg_read(X.UC_X86_REG_CR3) & ~0xFFF != space.root:
            # not the program's int3 (another space has its own byte here): the kernel's #BP, as without us
            uc.reg_write(X.UC_X86_REG_RIP, address + len(INT3))
            self.machine.cpu.deliver(3)
            return
        for item in list(site.items):
            interpreted_hit(self.tracer, uc, item)
        uc.reg_write(X.UC_X86_REG_RIP, address)
        # the probed instruction, in place: the original byte for one step, the int3 again at its #DB
        self._swap(space, address, site.original)
        uc.ctl_remove_cache(address, address + len(INT3))  # the program's space is loaded: its code is found
        cpu = self.machine.cpu
        self._stepped_by_debugger = bool(uc.reg_read(X.UC_X86_REG_EFLAGS) & EFLAGS_TF)  # a ptrace single step
        self._stepping = (address, cpu.debug_trap)
        cpu.debug_trap = lambda uc, space=space: self._stepped(uc, space)
        uc.reg_write(X.UC_X86_REG_EFLAGS, uc.reg_read(X.UC_X86_REG_EFLAGS) | EFLAGS_TF)

    def _stepped(self, uc: Uc, space: Any) -> None:
        assert self._stepping is not None
        address, previous = self._stepping
        self._stepping = None
        self.machine.cpu.debug_trap = previous
        uc.reg_write(X.UC_X86_REG_EFLAGS, uc.reg_read(X.UC_X86_REG_EFLAGS) & ~EFLAGS_TF)
        if address in self.sites:
            self._swap(space, address, INT3)
        if uc.reg_read(X.UC_X86_REG_CS) & 3 and uc.reg_read(X.UC_X86_REG_CR3) & ~0xFFF == space.root:
            uc.ctl_remove_cache(address, address + len(INT3))
        else:
            self.machine.cpu.remove_cache(address, len(INT3), space)
        if self._stepped_by_debugger:  # the program was being single-stepped: this #DB ends its step too
            uc.reg_write(X.UC_X86_REG_EFLAGS, uc.reg_read(X.UC_X86_REG_EFLAGS) | EFLAGS_TF)
            self.machine.cpu.deliver(1)
