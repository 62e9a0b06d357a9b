"""The verifier: bytecode in, a `Program` (decoded, checked, annotated) out, or a `BytecodeError`.

It runs when a tracepoint is defined or tracing starts, never at hit time, so that every later stage can trust
its input: the interpreter does no bounds or underflow checks, the compilers size the native stack from
`max_depth` and place code for every jump target.

Checks: empty expression; unknown opcodes; floating-point opcodes (unsupported); operands running past the end;
printf formats (NUL-terminated, supported directives, argument count); jump targets outside the expression or
off an instruction boundary; execution running past the last byte without `end`; stack underflow and overflow.
Depths come from abstract interpretation over every path: each reachable instruction gets exactly one depth
(a join reached with two depths is refused, as GDB's own `ax_reqs` does), so underflow is exact, and the
maximum over all paths is checked against `max_depth`. GDB refuses to send anything deeper than 20; the hard
limit here is 64 (`HARD_MAX_DEPTH`), which bounds the native stack a compiled expression may use.

Pure: a `Program` is immutable once built. It runs where the tracer prepares a location: on the CPU thread at tstart
(inside `Tracer._between_hits`), and on the thread that arms one during a run: the server thread for a tracepoint
GDB downloads or enables then (InstallInTrace, QTEnable), the CPU thread for a hit's `$enable`. Tests call it on
their own thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..arch import amd64
from .errors import BytecodeError
from .opcodes import DecodeError, Insn, OpClass, decode_all
from .printf_format import FormatError, count_args

#: GDB refuses expressions deeper than this (tracepoint.c); any depth up to it must be accepted.
GDB_MAX_DEPTH = 20
#: Our hard limit: deeper bytecode is refused. 64 entries = 512 bytes of native stack.
HARD_MAX_DEPTH = 64
#: GDB sends at most 184 bytes per action expression; longer bytecode is accepted up to the u16 jump range.
GDB_MAX_LENGTH = 184
MAX_LENGTH = 0x10000
#: `reg N` may name the registers of the trace register block: rax..r15, rip (8 bytes), eflags..gs (4 bytes).
REGISTER_COUNT = amd64.REGISTER_INDEX["gs"] + 1


@dataclass(frozen=True)
class Program:
    """Verified bytecode. `depth[offset]` is the stack depth before each reachable instruction."""

    code: bytes
    insns: tuple[Insn, ...]
    index: dict[int, int] = field(repr=False)  # offset -> position in insns
    depth: dict[int, int] = field(repr=False)
    max_depth: int
    jump_targets: frozenset[int]
    backward_jumps: frozenset[int]  # offsets of goto/if_goto whose target is at or before themselves

    def at(self, offset: int) -> Insn:
        return self.insns[self.index[offset]]

    def reachable(self, offset: int) -> bool:
        return offset in self.depth

    @property
    def has_printf(self) -> bool:
        return any(i.name == "printf" for i in self.insns)


def verify(
    code: bytes,
    *,
    max_depth: int = HARD_MAX_DEPTH,
    tsv_slots: int | None = None,
    require_value: bool = False,
) -> Program:
    """Check `code` and return its `Program`.

    `tsv_slots`: when given, getv/setv/tracev numbers must be below it (the TSV array the caller allocates).
    `require_value`: refuse an `end` that can be reached with an empty stack (conditions need a value).
    """
    code = bytes(code)
    if not code:
        raise BytecodeError("empty expression", code, None)
    if len(code) > MAX_LENGTH:
        raise BytecodeError(f"expression of {len(code)} bytes, the limit is {MAX_LENGTH}", code, None)
    try:
        insns = decode_all(code)
    except DecodeError as exc:
        raise BytecodeError(str(exc), code, exc.offset) from None
    index = {insn.offset: i for i, insn in enumerate(insns)}

    targets: set[int] = set()
    backward: set[int] = set()
    for insn in insns:
        _check_static(insn, code, index, tsv_slots)
        if insn.op.cls is OpClass.JUMP:
            targets.add(insn.arg)
            if insn.arg <= insn.offset:
                backward.add(insn.offset)

    depth: dict[int, int] = {0: 0}
    deepest = 0
    work = [0]
    while work:
        offset = work.pop()
        insn = insns[index[offset]]
        before = depth[offset]
        needs, pops, pushes = insn.stack_effect()
        if before < needs:
            raise BytecodeError(
                f"stack underflow: {insn.name} needs {needs} entr{'y' if needs == 1 else 'ies'}, the stack holds"
                f" {before} here",
                code,
                offset,
            )
        after = before - pops + pushes
        if after > max_depth:
            raise BytecodeError(f"stack overflow: depth {after} exceeds the limit of {max_depth}", code, offset)
        deepest = max(deepest, after)
        name = insn.name
        if name == "end":
            if require_value and before == 0:
                raise BytecodeError("`end` with an empty stack: a condition needs a value", code, offset)
            successors: tuple[int, ...] = ()
        elif name == "goto":
            successors = (insn.arg,)
        elif name == "if_goto":
            successors = (insn.arg, insn.next_offset)
        else:
            successors = (insn.next_offset,)
        for succ in successors:
            if succ >= len(code):
                raise BytecodeError("execution can run past the last instruction without `end`", code, offset)
            seen = depth.get(succ)
            if seen is None:
                depth[succ] = after
                work.append(succ)
            elif seen != after:
                raise BytecodeError(
                    f"stack depth {after} on one path and {seen} on another where they join at offset {succ}",
                    code,
                    offset,
                )
    return Program(code, insns, index, depth, deepest, frozenset(targets), frozenset(backward))


def _check_static(insn: Insn, code: bytes, index: dict[int, int], tsv_slots: int | None) -> None:
    """Checks that need only the instruction itself (and the instruction boundaries for jumps)."""
    op = insn.op
    if op.cls is OpClass.FLOAT:
        raise BytecodeError(f"floating-point opcode {op.name} is unsupported", code, insn.offset)
    if op.cls is OpClass.JUMP:
        target = insn.arg
        if target >= len(code):
            raise BytecodeError(f"jump target {target} is outside the expression ({len(code)} bytes)", code, insn.offset)
        if target not in index:
            raise BytecodeError(f"jump target {target} is not on an instruction boundary", code, insn.offset)
    elif op.name == "reg":
        if insn.arg >= REGISTER_COUNT:
            raise BytecodeError(
                f"register {insn.arg} is not in the trace register block (0..{REGISTER_COUNT - 1})", code, insn.offset
            )
    elif op.cls is OpClass.TSV or op.name == "tracev":
        if tsv_slots is not None and insn.arg >= tsv_slots:
            raise BytecodeError(f"trace state variable {insn.arg} does not exist", code, insn.offset)
    elif op.name == "printf":
        data = insn.data
        if not data or data[-1] != 0:
            raise BytecodeError("printf format is not NUL-terminated", code, insn.offset)
        try:
            wanted = count_args(insn.format)
        except FormatError as exc:
            raise BytecodeError(str(exc), code, insn.offset) from None
        if wanted != insn.arg:
            raise BytecodeError(f"printf format takes {wanted} argument(s), the bytecode passes {insn.arg}", code, insn.offset)
