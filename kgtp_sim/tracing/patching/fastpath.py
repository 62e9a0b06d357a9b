"""Deciding whether a probe gets the false-condition fast path, and what it must save (see detour.FastPath).

The fast path is for pure conditions (no trace, setv, printf, no computed built-in variables): evaluating one
twice is harmless, so a true condition simply falls through to the full path. What to store comes from the
bytecode (the `reg` operands it reads) and from the compiled code itself (capstone: every register it writes).

When the condition reads only registers that compiled code never writes (%rdi, %rsi and the callee-saved ones)
and needs neither memory, TSVs nor a division check, it is compiled a second time without pointers, as a branch
(compile_opt's `pointerless` and `true_exit`): the fast path pushes what that code clobbers and runs it inline on
the site's registers, its final compare jumping to the full path (16 emulated instructions for the thesis' false
condition, against 28 with a register block and a call).

Pure analysis of a verified program; called on the CPU thread when a location is installed.
"""

from __future__ import annotations

from functools import cache

from ...agent.compiled import CompiledExpr
from ...agent.verify import Program
from ...arch import amd64
from .probes import X, Instruction, disassembler

_IMPURE = {"setv", "trace", "trace_quick", "trace16", "tracenz", "tracev", "printf"}
_CAN_FAIL = {"div_signed", "div_unsigned", "rem_signed", "rem_unsigned", "ref8", "ref16", "ref32", "ref64"}
_GPR = [r.name for r in amd64.GENERAL_REGISTERS[:16]]
_ALIASES = {}
for _name in _GPR:
    if _name.startswith("r") and _name[1:].isdigit():
        for suffix in ("", "d", "w", "b"):
            _ALIASES[_name + suffix] = _name
    else:
        _ALIASES[_name] = _name
        base = _name[1:]
        _ALIASES["e" + base] = _name
        _ALIASES[base] = _name
for _low, _name in (("al", "rax"), ("bl", "rbx"), ("cl", "rcx"), ("dl", "rdx"), ("ah", "rax"), ("bh", "rbx"),
                    ("ch", "rcx"), ("dh", "rdx"), ("sil", "rsi"), ("dil", "rdi"), ("bpl", "rbp"), ("spl", "rsp")):
    _ALIASES[_low] = _name

@cache
def _status_flags() -> tuple[tuple[int, ...], int]:
    """capstone's eflags bits: what writes each status flag, and what reads any (built at the first use)."""
    writes = (
        (X.X86_EFLAGS_MODIFY_CF | X.X86_EFLAGS_RESET_CF | X.X86_EFLAGS_SET_CF | X.X86_EFLAGS_UNDEFINED_CF),
        (X.X86_EFLAGS_MODIFY_PF | X.X86_EFLAGS_RESET_PF | X.X86_EFLAGS_SET_PF | X.X86_EFLAGS_UNDEFINED_PF),
        (X.X86_EFLAGS_MODIFY_AF | X.X86_EFLAGS_RESET_AF | X.X86_EFLAGS_SET_AF | X.X86_EFLAGS_UNDEFINED_AF),
        (X.X86_EFLAGS_MODIFY_ZF | X.X86_EFLAGS_RESET_ZF | X.X86_EFLAGS_SET_ZF | X.X86_EFLAGS_UNDEFINED_ZF),
        (X.X86_EFLAGS_MODIFY_SF | X.X86_EFLAGS_RESET_SF | X.X86_EFLAGS_SET_SF | X.X86_EFLAGS_UNDEFINED_SF),
        (X.X86_EFLAGS_MODIFY_OF | X.X86_EFLAGS_RESET_OF | X.X86_EFLAGS_SET_OF | X.X86_EFLAGS_UNDEFINED_OF),
    )
    tests = (X.X86_EFLAGS_TEST_CF | X.X86_EFLAGS_TEST_PF | X.X86_EFLAGS_TEST_AF | X.X86_EFLAGS_TEST_ZF
             | X.X86_EFLAGS_TEST_SF | X.X86_EFLAGS_TEST_OF | X.X86_EFLAGS_TEST_DF)
    return writes, tests


def eligible(program: Program, computed_builtins: set[int]) -> bool:
    for insn in program.insns:
        if insn.name in _IMPURE:
            return False
        if insn.name == "getv" and insn.operands[0] in computed_builtins:
            return False
        if insn.name == "reg" and (insn.operands[0] >= 16 or insn.operands[0] == amd64.SP_REGNUM):
            return False  # rsp, rip, eflags and segments are only right in the full save
    return True


def silent(program: Program, computed_builtins: set[int]) -> bool:
    """Does the program leave no trace at all: nothing collected or set, nothing printed, no way to fail or to
    loop, no computed variable read? An action made of it is dropped by the optimizing engine (the interpreter,
    running it, records nothing either): GDB sends one when it collects an expression's value, which it reads
    back from the registers it asks for beside it."""
    return not any(insn.name in _IMPURE or insn.name in _CAN_FAIL or insn.name in ("goto", "if_goto")
                   or (insn.name == "getv" and insn.operands[0] in computed_builtins) for insn in program.insns)


def regnums_read(program: Program) -> set[int]:
    return {insn.operands[0] for insn in program.insns if insn.name == "reg"}


def registers_read(program: Program) -> set[str]:
    return {_GPR[n] for n in regnums_read(program)}


def code_registers(compiled: CompiledExpr) -> tuple[set[str], bool]:
    """(general registers the compiled code writes, whether it reads %rsi)."""
    written: set[str] = set()
    reads_rsi = False
    for insn in disassembler().disasm(compiled.code, compiled.base):
        reads, writes = insn.regs_access()
        written |= {_ALIASES[n] for n in map(insn.reg_name, writes) if n in _ALIASES}
        reads_rsi |= any(_ALIASES.get(insn.reg_name(r)) == "rsi" for r in reads)
    written.discard("rsp")
    return written, reads_rsi


def flags_live_at(displaced: tuple[Instruction, ...]) -> bool:
    """Are the status flags live at the site? Dead when the first displaced instruction overwrites all six
    without reading any (then the fast path needs no pushfq/popfq)."""
    (insn,) = list(disassembler().disasm(displaced[0].code, displaced[0].address))
    eflags = insn.eflags
    writes, tests = _status_flags()
    if eflags & tests:
        return True
    return not all(eflags & bits for bits in writes)


def can_fail(program: Program) -> bool:
    return any(insn.name in _CAN_FAIL for insn in program.insns)
