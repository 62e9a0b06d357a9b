"""Errors of agent expressions: refused bytecode (define time) and failed evaluations (hit time).

The two never mix. `BytecodeError` is raised by the verifier when a tracepoint is defined or tracing starts, so
GDB hears about bad bytecode from `QTDP`/`QTStart`. At hit time nothing raises: every engine (interpreter,
naive and optimized native code) reports the same `EvalError` (code + bytecode offset + message), which the
tracing layer turns into `terror` on the tracepoint.

Pure values and exceptions, made on the thread that verifies bytecode (verify.py says where) or evaluates it (the
CPU thread, at a hit); the message reaches GDB on the server thread, in an error reply (QTStart, or a tracepoint
armed during a run) or as the run's stop note (qTStatus).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from .disasm import describe_at


class BytecodeError(ValueError):
    """Bytecode refused by the verifier. `offset` is where the problem is, `insn` its disassembly."""

    def __init__(self, reason: str, code: bytes, offset: int | None) -> None:
        self.reason = reason
        self.offset = offset
        self.insn = describe_at(code, offset) if offset is not None else None
        where = f"at offset {offset} ({self.insn}): " if offset is not None else ""
        super().__init__(f"bad agent expression: {where}{reason}")


class ErrorCode(IntEnum):
    """Evaluation error codes. The numbers are the ABI: compiled code stores them in `agent_ctx.error`."""

    NONE = 0
    DIVIDE_BY_ZERO = 1
    #: INT64_MIN / -1 or INT64_MIN % -1. GDB 13 itself dies of SIGFPE on `print` of that (x86 `idiv` traps),
    #: gdbserver's interpreter would too; a kernel stub cannot, so it is an error like a division by zero.
    DIVIDE_OVERFLOW = 2
    MEMORY_FAULT = 3
    TRACE_BUFFER_FULL = 4
    LOOP_BUDGET = 5


_TEXT = {
    ErrorCode.DIVIDE_BY_ZERO: "division by zero",
    ErrorCode.DIVIDE_OVERFLOW: "division overflow (INT64_MIN / -1)",
    ErrorCode.MEMORY_FAULT: "memory fault",
    ErrorCode.TRACE_BUFFER_FULL: "trace buffer full",
    ErrorCode.LOOP_BUDGET: "loop budget exhausted (backward jumps)",
}


@dataclass(frozen=True)
class EvalError:
    """A failed evaluation. Equality ignores `message` and `address`: engines agree on code and offset."""

    code: ErrorCode
    offset: int
    message: str = field(compare=False)
    address: int | None = field(default=None, compare=False)  # faulting address, when known

    @classmethod
    def make(cls, code: ErrorCode, offset: int, bytecode: bytes, address: int | None = None) -> EvalError:
        text = f"{_TEXT.get(code, f'error {int(code)}')} at bytecode offset {offset} ({describe_at(bytecode, offset)})"
        if address is not None:
            text += f", address 0x{address:x}"
        return cls(code, offset, text, address)

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class EvalResult:
    """Outcome of one evaluation.

    `value` is the top of the stack as an unsigned 64-bit integer (0 when `end` found an empty stack), or None
    after an error. `steps` is engine-specific work: bytecode ops executed for the interpreter, nothing otherwise.
    """

    value: int | None
    error: EvalError | None = None
    steps: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None


class UnreadableMemory(Exception):
    """Unreadable memory, raised by an `AgentContext.read_memory`. The machine's own MemoryFault may derive from
    this class (then the interpreter needs no `fault_types`)."""

    def __init__(self, address: int, size: int = 1) -> None:
        super().__init__(f"cannot read {size} byte(s) at 0x{address:x}")
        self.address = address
        self.size = size
