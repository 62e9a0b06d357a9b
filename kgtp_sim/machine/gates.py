"""Call gates: the way a program's code enters supervisor-only code of the stub's without an exception.

A compiled hit of a tracepoint in a program (tracing/engines/userprobes.py) runs its detour in module space, which
ring 3 cannot execute, and writes the trace ring, which ring 3 cannot write. The program's pad reaches the detour
with `lcall` through a 64-bit call gate of DPL 3: the CPU itself checks the gate, switches to ring 0 on the stack
in the TSS's rsp0 (the running task's kernel stack top, empty while the task is in user mode) and pushes the
program's RIP, CS, RSP and SS there; the detour goes back with `lretq`. QEMU implements long-mode call gates in its
translator's helpers (seg_helper.c: helper_lcall_protected, helper_lret_protected), so no hook and no Python runs
on either crossing (measured against an `int $N` to a hooked interrupt gate, which unicorn always hands to a hook,
and the `syscall` hook: see the report in tracing/engines/userprobes.py). The gate's target is its own descriptor's
(the offset in the lcall's operand is ignored), so the program can enter the stub only at a gate's detour: it
cannot write the ring any other way.

The gates live in a local descriptor table of their own, in the stub's data pages (the kernel's GDT has no two free
consecutive entries for a 16-byte gate, and the kernel never loads an LDT): LDTR is written into every CPU's
registers the first time a gate is made (unicorn's LDTR write fills the descriptor cache directly). A gate is
never freed: a thread preempted in a pad before its `lcall` (user code, where the scheduler may switch) calls it
later, so a location that goes sends its gate to `RETURN_ONLY` (a bare `lretq`) instead, and the same pad made
again (the same instruction at the same address) takes its gate back (`retarget`).

A debugger's single step of the `lcall` (a task it stopped inside a pad) keeps TF through the gate, as the CPU's far
call does: the #DB comes in ring 0 at the gate's target, before its first instruction, with the program's GS base
still loaded. The CPU's #DB goes to `step_through` before any other handler, whether a run has the pad or the run
ended and the gate is a bare return: the code behind the gate runs on, each of its #DBs let go, back to the pad in
ring 3, where the step ends as after any instruction (or, in a pad a run still has, goes on through it:
tracing/engines/userprobes.py). Handed to the kernel, the #DB ran its handler with the program's GS and the machine
stopped.

Owns the LDT, its gates and a step through them. Runs on the CPU thread (through `Machine.run_on_cpu`, and inside
the #DB hook).
"""

from __future__ import annotations

import struct
from typing import Callable

from unicorn import Uc, UcError
from unicorn import x86_const as X

from .cpu import EFLAGS_TF
from .errors import MachineError

GATE_SIZE = 16  #: a long-mode call gate: two descriptor slots
LDT_SIZE = 0x10000  #: the largest LDT: 4096 gates
KERNEL_CS = 0x08
#: `lretq`: where a gate of a location that went leads (back to the pad, which runs its instruction)
RETURN_ONLY = bytes.fromhex("48cb")
_TI_RPL3 = 0x4 | 0x3  #: a selector's table indicator (LDT) and requested privilege level 3
_LDT_FLAGS = 0x8200  #: the descriptor cache's flags of a present LDT (QEMU's layout: type 2, P)


def gate_descriptor(target: int) -> bytes:
    """A present 64-bit call gate of DPL 3 to `target` in the kernel's code segment."""
    low = (target & 0xFFFF) | KERNEL_CS << 16 | (0x80 | 3 << 5 | 0xC) << 40 | (target >> 16 & 0xFFFF) << 48
    return struct.pack("<QQ", low, target >> 32 & 0xFFFFFFFF)


class CallGates:
    """The machine's call gates (one LDT for every CPU and every address space: module space is in all of them)."""

    def __init__(self, alloc_data: Callable[[int], int], alloc_code: Callable[[int], int],
                 every_cpu: Callable[[Callable[[Uc], None]], None]) -> None:
        self._alloc_data = alloc_data
        self._alloc_code = alloc_code
        self._every_cpu = every_cpu
        self._ldt = 0
        self._count = 0
        self.return_only = 0  #: the `lretq` a gate of a location that went leads to
        self._targets: dict[int, int] = {}  #: selector -> where its gate leads now
        self._stepping = False  #: a single step is inside the code behind a gate (`step_through`)

    def add(self, uc: Uc, target: int) -> int:
        """A new gate to `target` (on the CPU thread); its selector, for the program's `lcall`."""
        if not self._ldt:
            self._ldt = self._alloc_data(LDT_SIZE)
            self.return_only = self._alloc_code(len(RETURN_ONLY))
            uc.mem_write(self.return_only, RETURN_ONLY)
            self._every_cpu(lambda uc: uc.reg_write(X.UC_X86_REG_LDTR, (0, self._ldt, LDT_SIZE - 1, _LDT_FLAGS)))
        if (self._count + 1) * GATE_SIZE > LDT_SIZE:
            raise MachineError(f"more than {LDT_SIZE // GATE_SIZE} call gates")
        selector = self._count * GATE_SIZE | _TI_RPL3
        self._count += 1
        self.retarget(uc, selector, target)
        return selector

    def retarget(self, uc: Uc, selector: int, target: int | None) -> None:
        """The gate now leads to `target` (None: back to its caller, `RETURN_ONLY`). The CPU reads the descriptor at
        each `lcall`: nothing is cached to drop."""
        target = self.return_only if target is None else target
        self._targets[selector] = target
        uc.mem_write(self._ldt + (selector & ~7), gate_descriptor(target))

    def step_through(self, uc: Uc) -> bool:
        """Is this #DB a single step inside the code behind a gate (then let go: True)? The first comes at a gate's
        target in ring 0, TF set, the gate's frame on the stack (the return into ring 3); the code runs on from
        there, each #DB of it let go, until the first #DB back in ring 3, which is the step's own."""
        if not self._targets:  # (no gate yet: every #DB goes on to the others)
            return False
        if uc.reg_read(X.UC_X86_REG_CS) & 3:
            self._stepping = False
            return False
        if self._stepping:
            return True
        if not uc.reg_read(X.UC_X86_REG_EFLAGS) & EFLAGS_TF or \
                uc.reg_read(X.UC_X86_REG_RIP) not in self._targets.values():
            return False
        try:
            _, cs = struct.unpack("<QQ", bytes(uc.mem_read(uc.reg_read(X.UC_X86_REG_RSP), 16)))
        except UcError:
            return False
        self._stepping = cs & 3 == 3
        return self._stepping
