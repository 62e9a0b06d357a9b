"""GDB agent expressions: one opcode table driving a verifier, an interpreter, a disassembler and two x86_64
compilers (naive one-snippet-per-opcode, and optimizing), all with the same semantics.

Typical use by the tracing layer::

    program = verify(bytecode, require_value=is_condition, tsv_slots=n)   # at QTDP / tstart; BytecodeError
    compiled = compile_opt(program, machine.alloc_code(4096))             # or compile_naive
    machine.write_memory(compiled.base, compiled.code)                    # then call it from the detour
    # on a fault inside it, the machine calls fault_fixup(uc, compiled)
    result = evaluate(program, ctx)                                       # interpreter, same semantics
"""

from .abi import AgentCtx
from .compile_naive import compile_naive
from .compile_opt import compile_opt
from .compiled import CompiledExpr, fault_fixup
from .context import SimpleContext
from .disasm import describe_at, disassemble, format_insn, listing
from .errors import BytecodeError, ErrorCode, EvalError, EvalResult, UnreadableMemory
from .interp import DEFAULT_LOOP_BUDGET, AgentContext, evaluate
from .measure import Cost, instruction_count
from .opcodes import OPCODES, Insn, OpInfo, assemble, decode_all, encode
from .verify import GDB_MAX_DEPTH, GDB_MAX_LENGTH, HARD_MAX_DEPTH, Program, verify

__all__ = [
    "AgentContext", "AgentCtx", "BytecodeError", "CompiledExpr", "Cost", "DEFAULT_LOOP_BUDGET", "ErrorCode",
    "EvalError", "EvalResult", "GDB_MAX_DEPTH", "GDB_MAX_LENGTH", "HARD_MAX_DEPTH", "Insn", "UnreadableMemory",
    "OPCODES", "OpInfo", "Program", "SimpleContext", "assemble", "compile_naive", "compile_opt", "decode_all",
    "describe_at", "disassemble", "encode", "evaluate", "fault_fixup", "format_insn", "instruction_count",
    "listing", "verify",
]
