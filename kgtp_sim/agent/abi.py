"""The calling convention of compiled agent expressions, and the `agent_ctx` structure they share with the stub.

A compiled expression is a SysV x86_64 function `u64 expr(const u8 *regs, struct agent_ctx *ctx)`:

- `%rdi` = the probe's saved register block in `g` layout (`kgtp_sim.arch.amd64`): rax rbx rcx rdx rsi rdi rbp
  rsp r8..r15 rip as 8-byte slots (GDB regnums 0..16), then eflags cs ss ds es fs gs as 4-byte slots (17..23).
  `reg N` reads slot N (zero-extended). The optimizing compiler may instead read a register that still holds
  its probe-site value at entry (callee-saved ones only, see `LIVE_CANDIDATES`), when the caller says so.
- `%rsi` = an `agent_ctx` in emulated memory (below). Both pointers stay in `%rdi`/`%rsi` for the whole call:
  `fault_fixup` relies on `%rsi` to find the context.
- returns the top of the stack in `%rax` (0 if `end` found the stack empty, 0 after an error).
- clobbers only caller-saved registers (rax rcx rdx rsi rdi r8-r11, flags); never writes rbx rbp r12-r15.
- uses at most `CompiledExpr.stack_bytes` of stack below the return address.

Errors are stored in `ctx.error`/`ctx.error_pc` and the function returns; the caller reads them back and records
`terror`. Trace blocks are written at `ctx.trace_ptr`, which is advanced after each complete block, and never past
`ctx.trace_limit` (a block that does not fit is TRACE_BUFFER_FULL); so after any error the bytes in
[start, trace_ptr) are exactly the blocks recorded before the failing op.

Pure layout and packing: the tracer packs an `AgentCtx` when a compiled run starts (on the CPU thread,
kgtp_sim/tracing/engines/native.py) and reads one back on the CPU thread after a detour's hypercall
(tracing/engines/installer.py); compiled code uses the context inside emulation, on the CPU thread; a `Sandbox`
packs one on its test's thread.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields

from ..arch import amd64

# struct agent_ctx: nine little-endian u64 fields, 8-byte aligned.
CTX_TSV_BASE = 0x00  # i64 tsv[]: trace state variable N lives at tsv_base + 8*N
CTX_TRACE_PTR = 0x08  # next free byte for trace blocks (advanced after each complete block)
CTX_TRACE_LIMIT = 0x10  # first byte past the trace area
CTX_ERROR = 0x18  # ErrorCode, 0 = none (written by the code, or by fault_fixup)
CTX_ERROR_PC = 0x20  # bytecode offset of the failing op
CTX_SAVED_RSP = 0x28  # %rsp at entry (it points at the return address); every exit path restores it
CTX_LOOP_BUDGET = 0x30  # backward jumps still allowed; each taken backward jump decrements it, 0 = error
CTX_PRINTF_FN = 0x38  # address of the printf trap, 0 = printf only pops its operands
CTX_FAULT_ADDR = 0x40  # faulting address (written by fault_fixup when it knows it), else 0
CTX_SIZE = 0x48

#: Registers the optimizing compiler may read live instead of from the block (callee-saved: it never writes them).
LIVE_CANDIDATES: dict[int, str] = {1: "rbx", 6: "rbp", 12: "r12", 13: "r13", 14: "r14", 15: "r15"}
#: ... and, for code that takes neither pointer (`compile_opt(..., pointerless=True)`: no register block, no
#: context), also %rsi and %rdi, which the compiled code never writes: the false-condition fast path calls such a
#: condition with the site's own %rdi and %rsi still in place.
POINTERLESS_LIVE_CANDIDATES: dict[int, str] = {**LIVE_CANDIDATES, 4: "rsi", 5: "rdi"}

#: Where register N (GDB amd64 numbering, 0..23) sits in the register block, and its size.
REG_OFFSET: tuple[int, ...] = amd64.OFFSETS[:24]
REG_SIZE: tuple[int, ...] = tuple(r.size for r in amd64.REGISTERS[:24])
#: Bytes of register block the compiled code may read (rax..gs).
REG_BLOCK_BYTES = REG_OFFSET[-1] + REG_SIZE[-1]

# The printf trap, called (not jumped to) with:
#   %rdi = ctx, %rsi = the format (NUL-terminated, stored in the compiled code's data),
#   %rdx = the arguments as u64, first argument at the lowest address, %rcx = their count,
#   %r8  = the printf op's bytecode offset.
# It may clobber caller-saved registers; the stack is not 16-byte aligned (it is a trap, not a C function).


@dataclass
class AgentCtx:
    """Python view of `struct agent_ctx` (pack it into emulated memory, read it back after the call)."""

    tsv_base: int = 0
    trace_ptr: int = 0
    trace_limit: int = 0
    error: int = 0
    error_pc: int = 0
    saved_rsp: int = 0
    loop_budget: int = 0
    printf_fn: int = 0
    fault_addr: int = 0

    _FORMAT = struct.Struct("<9Q")

    def pack(self) -> bytes:
        return self._FORMAT.pack(*(getattr(self, f.name) & (2**64 - 1) for f in fields(self)))

    @classmethod
    def unpack(cls, data: bytes) -> AgentCtx:
        return cls(*cls._FORMAT.unpack(bytes(data[:CTX_SIZE])))


assert AgentCtx._FORMAT.size == CTX_SIZE
assert [f.name for f in fields(AgentCtx)][CTX_LOOP_BUDGET // 8] == "loop_budget"
