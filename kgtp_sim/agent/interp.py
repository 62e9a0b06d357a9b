"""The reference interpreter: runs a verified `Program` against a context, with GDB's 64-bit semantics.

It is the specification the two compilers are tested against (same value, same trace blocks, same TSV values,
same error code and offset), and the engine used when native code is not wanted. It never raises on bad input:
the verifier already refused malformed bytecode, and run-time failures (division by zero, unreadable memory, a
full trace buffer, an exhausted loop budget) come back as an `EvalError` in the result.

Pure: all it changes is the context it is given. The tracer runs it at a hit, on the CPU thread
(kgtp_sim/tracing/engines/hits.py, kgtp/printk.py); kgtp/watch.py runs it to find a variable's constant value
where a location is prepared (verify.py says where); tests and `agent.measure` run it on their own thread.
"""

from __future__ import annotations

from typing import Protocol

from . import semantics as sem
from .blocks import MAX_BLOCK, memory_block, tsv_block
from .errors import ErrorCode, EvalError, EvalResult, UnreadableMemory
from .printf_format import format_printf, read_escapes
from .verify import Program

#: Backward jumps one evaluation may take before it is stopped (also the default for compiled code).
DEFAULT_LOOP_BUDGET = 10_000


class AgentContext(Protocol):
    """What an evaluation may touch. Tracing provides one per hit; tests use `SimpleContext`."""

    def read_memory(self, addr: int, n: int) -> bytes:
        """n bytes at addr; raises UnreadableMemory (or a type passed in `fault_types`) if any byte is unreadable."""
        ...

    def register(self, n: int) -> int:
        """Register n of the probe's register block (GDB amd64 numbering), zero-extended."""
        ...

    def tsv_get(self, n: int) -> int: ...

    def tsv_set(self, n: int, value: int) -> None: ...

    def trace_room(self) -> int | None:
        """Bytes still free for trace blocks in this frame (None: unlimited)."""
        ...

    def trace_block(self, block: bytes) -> None:
        """Receives one complete block (`M…` or `V…`, GDB trace-frame format); only called if it fits."""
        ...

    def printf(self, text: str) -> None: ...


def evaluate(
    program: Program,
    ctx: AgentContext,
    *,
    loop_budget: int = DEFAULT_LOOP_BUDGET,
    fault_types: tuple[type[BaseException], ...] = (UnreadableMemory,),
    escapes: bool = False,
) -> EvalResult:
    """Run `program`; `EvalResult.steps` counts the bytecode ops executed (not machine instructions). `escapes`:
    printf reads its format's C escapes first, as gdbserver's agent printf (printf_format.read_escapes; the caller
    checked the formats read so when it took the program)."""
    code = program.code
    insns = program.insns
    index = program.index
    stack: list[int] = []
    pc = 0
    steps = 0
    budget = loop_budget

    def fail(kind: ErrorCode, offset: int, address: int | None = None) -> EvalResult:
        return EvalResult(None, EvalError.make(kind, offset, code, address), steps)

    while True:
        insn = insns[index[pc]]
        steps += 1
        name = insn.name
        nxt = insn.next_offset
        if name in sem.BINARY_OPS:
            b = stack.pop()
            a = stack.pop()
            out = sem.binary(name, a, b)
            if isinstance(out, ErrorCode):
                return fail(out, pc)
            stack.append(out)
        elif name in sem.UNARY_OPS:
            stack.append(sem.unary(name, stack.pop(), insn.arg if insn.operands else 0))
        elif name.startswith("const"):
            stack.append(insn.arg)
        elif name.startswith("ref"):
            size = insn.op.data_bits // 8
            addr = stack.pop()
            try:
                data = ctx.read_memory(addr, size)
            except fault_types as exc:
                return fail(ErrorCode.MEMORY_FAULT, pc, getattr(exc, "address", addr))
            stack.append(int.from_bytes(data, "little"))
        elif name == "reg":
            stack.append(ctx.register(insn.arg) & sem.MASK)
        elif name == "end":
            return EvalResult(stack[-1] if stack else 0, None, steps)
        elif name == "goto" or name == "if_goto":
            taken = True if name == "goto" else stack.pop() != 0
            if taken:
                if insn.arg <= pc:
                    if budget <= 0:
                        return fail(ErrorCode.LOOP_BUDGET, pc)
                    budget -= 1
                nxt = insn.arg
        elif name == "dup":
            stack.append(stack[-1])
        elif name == "pop":
            stack.pop()
        elif name == "swap":
            stack[-1], stack[-2] = stack[-2], stack[-1]
        elif name == "pick":
            stack.append(stack[-1 - insn.arg])
        elif name == "rot":
            a, b, c = stack[-3:]
            stack[-3:] = [c, a, b]
        elif name == "getv":
            stack.append(ctx.tsv_get(insn.arg) & sem.MASK)
        elif name == "setv":
            ctx.tsv_set(insn.arg, stack[-1])
        elif name == "tracev":
            block = tsv_block(insn.arg, ctx.tsv_get(insn.arg))
            room = ctx.trace_room()
            if room is not None and len(block) > room:
                return fail(ErrorCode.TRACE_BUFFER_FULL, pc)
            ctx.trace_block(block)
        elif name in ("trace", "trace_quick", "trace16", "tracenz"):
            if name in ("trace", "tracenz"):
                size = stack.pop()
                addr = stack.pop()
            else:
                size = insn.arg
                addr = stack[-1]
            error = (_trace_string if name == "tracenz" else _trace_memory)(ctx, addr, size, fault_types)
            if error is not None:
                kind, address = error
                return fail(kind, pc, address)
        elif name == "printf":
            stack.pop()  # function: the target may ignore it (agentexpr.texi); we always use our own printf
            stack.pop()  # channel
            args = [stack.pop() for _ in range(insn.arg)]
            text = read_escapes(insn.format) if escapes else insn.format
            ctx.printf(format_printf(text, args, ctx.read_memory))
        else:  # pragma: no cover - the verifier refuses everything else
            raise AssertionError(f"unverified opcode {name}")
        pc = nxt


def _trace_memory(
    ctx: AgentContext, addr: int, size: int, fault_types: tuple[type[BaseException], ...]
) -> tuple[ErrorCode, int | None] | None:
    """Record [addr, addr+size) as `M` blocks of at most 65535 bytes; room is checked before each read."""
    while size > 0:
        n = min(size, MAX_BLOCK)
        room = ctx.trace_room()
        if room is not None and 11 + n > room:
            return ErrorCode.TRACE_BUFFER_FULL, None
        try:
            data = ctx.read_memory(addr, n)
        except fault_types as exc:
            return ErrorCode.MEMORY_FAULT, getattr(exc, "address", addr)
        ctx.trace_block(memory_block(addr, data))
        addr = (addr + n) & sem.MASK
        size -= n
    return None


def _trace_string(
    ctx: AgentContext, addr: int, size: int, fault_types: tuple[type[BaseException], ...]
) -> tuple[ErrorCode, int | None] | None:
    """`tracenz`: like trace, but stop after the first NUL (which is recorded). Reads a byte at a time, so a
    string that ends just before unreadable memory is fine."""
    while size > 0:
        limit = min(size, MAX_BLOCK)
        data = bytearray()
        while len(data) < limit:
            try:
                byte = ctx.read_memory((addr + len(data)) & sem.MASK, 1)
            except fault_types as exc:
                return ErrorCode.MEMORY_FAULT, getattr(exc, "address", addr + len(data))
            data += byte
            if byte == b"\0":
                break
        room = ctx.trace_room()
        if room is not None and 11 + len(data) > room:
            return ErrorCode.TRACE_BUFFER_FULL, None
        ctx.trace_block(memory_block(addr, bytes(data)))
        if data[-1] == 0:
            return None
        addr = (addr + len(data)) & sem.MASK
        size -= len(data)
    return None
