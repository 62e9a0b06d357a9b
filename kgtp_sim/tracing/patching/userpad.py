"""The jump pad of a compiled hit in a program: what the program runs, in ring 3, at a tracepoint whose condition and
actions run compiled (tracing/engines/userprobes.py).

    [opt engine, a condition on registers only (fastpath.py's inline branch):]
    lea -0x80(%rsp), %rsp          past the red zone the program's code may be using
    pushfq; push <what the branch clobbers>
    <the condition, a branch on the program's registers: to `slow` when true>
    incq <the pad's fired counter>     (a data page of the pad area: a write there drops no translated code)
    pop ...; popfq; lea 0x80(%rsp), %rsp; jmp tail
  slow:
    pop ...; popfq; lea 0x80(%rsp), %rsp
  gate:
    lcall *operand(%rip)           through the location's call gate (machine/gates.py) into its detour (ring 0:
                                   the condition again, the actions, the frame; back by lretq)
  tail:
    <the instruction the tracepoint replaced, relocated>; jmp <after it>
  operand: .quad 0; .word <the gate's selector>

A false condition so costs no privilege change at all, as gdbserver's fast tracepoint evaluates its compiled
condition in the program itself; the ring is written only in ring 0, through the gate. The program reaches the pad
by the jump over its instruction (`ftrace`) or by the int3 at the tracepoint, which the machine's native int3
table sends to the pad (`trace`; cpu.py, dispatch.py).

Pure code generation (a plan in, bytes out): called on the CPU thread when a location is installed.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from .detour import assemble
from .probes import Instruction, jump, relocate

RED_ZONE = 0x80
#: `lcall *0x0(%rip)` with a 64-bit operand (REX.W FF /3): the operand (offset, selector) follows the pad's code
_LCALL = bytes.fromhex("48ff1d")
LCALL_SIZE = len(_LCALL) + 4


@dataclass(frozen=True)
class PadCondition:
    """The condition's ring-3 branch: `code(at, true_exit)` places it at `at`, jumping to `true_exit` when true and
    falling through when false; `clobbers` are the registers that code writes."""

    code: Callable[[int, int], bytes]
    clobbers: tuple[str, ...]


@dataclass(frozen=True)
class Pad:
    code: bytes
    gate: int  #: where the `lcall` is (a hit taken on the Python path goes on at `tail`)
    tail: int  #: the relocated instruction


def build_pad(base: int, insn: Instruction, selector: int, fired: int, condition: PadCondition | None) -> Pad:
    """The pad at `base` for the instruction `insn`, its hits counted at `fired` (when the condition is false in
    the pad) and sent through the gate `selector`."""
    code = b""
    if condition is not None:
        push = [f"push %{name}" for name in condition.clobbers]
        pop = [f"pop %{name}" for name in reversed(condition.clobbers)]
        enter = assemble("\n".join([f"lea -{RED_ZONE:#x}(%rsp), %rsp", "pushfq", *push]), base)
        leave = pop + ["popfq", f"lea {RED_ZONE:#x}(%rsp), %rsp"]

        def after(branch_at: int, branch: bytes) -> tuple[bytes, bytes]:
            here = branch_at + len(branch)
            counted = b"\x48\xff\x05" + struct.pack("<i", fired - (here + 7))  # incq fired(%rip): in the pad area
            false = counted + assemble("\n".join(leave), here + len(counted))
            false += b"\xe9" + bytes(4)  # jmp tail, patched below
            slow = assemble("\n".join(leave), here + len(false))
            return false, slow

        branch_at = base + len(enter)
        trial = condition.code(branch_at, branch_at)
        false, slow = after(branch_at, trial)
        gate_at = branch_at + len(trial) + len(false) + len(slow)
        branch = condition.code(branch_at, branch_at + len(trial) + len(false))
        assert len(branch) == len(trial)
        false, slow = after(branch_at, branch)
        tail_at = gate_at + LCALL_SIZE
        false = false[:-5] + jump(branch_at + len(branch) + len(false) - 5, tail_at)
        code = enter + branch + false + slow
    gate_at = base + len(code)
    tail_at = gate_at + LCALL_SIZE
    tail = relocate((insn,), tail_at)
    tail += jump(tail_at + len(tail), insn.end)
    operand_at = tail_at + len(tail)
    code += _LCALL + struct.pack("<i", operand_at - tail_at) + tail + struct.pack("<QH", 0, selector)
    return Pad(code, gate_at, tail_at)


def pad_size_bound(insn_bound: int, condition: PadCondition | None, trial_at: int) -> int:
    """Bytes a pad may take: its instruction relocated in at most `insn_bound` bytes (probes.relocated_size_bound)."""
    extra = 0
    if condition is not None:
        extra = len(condition.code(trial_at, trial_at)) + 32 + 4 * len(condition.clobbers) + 24
    return extra + LCALL_SIZE + insn_bound + 5 + 10
