"""A compiled expression (native code placed at a fixed base) and its memory-fault fixup.

A read of unmapped memory inside compiled code (a `ref`, a `trace` copy) makes unicorn stop with an unmapped-memory
error at the faulting instruction. `fault_fixup` is the entry of the machine's fault-fixup table for that code,
like a kernel exception-table entry: it finds the bytecode op that faulted, records MEMORY_FAULT in the
`agent_ctx`, and redirects RIP to the code's fault exit, which restores %rsp from the context and returns 0.
The caller then resumes emulation at the new RIP.

Thread: a `CompiledExpr` is immutable, built where a location is compiled (compile_naive.py says where);
`fault_fixup` runs on the CPU thread inside emulation, from the machine's fault-fixup table (in a `Sandbox`, on the
test's thread).
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass, field

from unicorn.x86_const import UC_X86_REG_R10, UC_X86_REG_RIP, UC_X86_REG_RSI

from . import abi
from .errors import ErrorCode
from .verify import Program


@dataclass(frozen=True)
class CompiledExpr:
    """Native code for one verified program. All addresses are absolute (the code is linked at `base`)."""

    engine: str  # "naive" or "opt"
    program: Program = field(repr=False)
    base: int
    code: bytes = field(repr=False)
    fault_exit: int
    ranges: tuple[tuple[int, int, int], ...] = field(repr=False)  # (start, end, bytecode offset), sorted
    helpers: tuple[int, int] | None  # [start, end) of trace helpers: the bytecode offset is in %r10d there
    stack_bytes: int  # stack used below the return address, at most
    live_registers: frozenset[int] = frozenset()
    pointerless: bool = False  # called without the block and context pointers (%rdi, %rsi are site registers)

    @property
    def entry(self) -> int:
        return self.base

    @property
    def end(self) -> int:
        return self.base + len(self.code)

    def contains(self, address: int) -> bool:
        return self.base <= address < self.end

    def bytecode_offset_at(self, address: int) -> int | None:
        """The bytecode op whose native code covers `address` (None outside any op)."""
        starts = [r[0] for r in self.ranges]
        i = bisect.bisect_right(starts, address) - 1
        if i >= 0 and self.ranges[i][0] <= address < self.ranges[i][1]:
            return self.ranges[i][2]
        return None


def fault_fixup(uc, compiled: CompiledExpr, ctx_addr: int | None = None, fault_address: int | None = None) -> bool:
    """Turn a memory fault at the current RIP into MEMORY_FAULT and resume at the fault exit.

    Returns False (and changes nothing) when RIP is not inside `compiled`. `ctx_addr` defaults to %rsi, which
    compiled code never changes. `fault_address` (if the caller's memory hook saw it) is stored in
    `ctx.fault_addr`.
    """
    rip = uc.reg_read(UC_X86_REG_RIP)
    if not compiled.contains(rip):
        return False
    if compiled.helpers is not None and compiled.helpers[0] <= rip < compiled.helpers[1]:
        pc = uc.reg_read(UC_X86_REG_R10) & 0xFFFFFFFF
    else:
        found = compiled.bytecode_offset_at(rip)
        pc = found if found is not None else 0
    if ctx_addr is None:
        ctx_addr = uc.reg_read(UC_X86_REG_RSI)
    uc.mem_write(ctx_addr + abi.CTX_ERROR, struct.pack("<QQ", int(ErrorCode.MEMORY_FAULT), pc))
    uc.mem_write(ctx_addr + abi.CTX_FAULT_ADDR, struct.pack("<Q", (fault_address or 0) & (2**64 - 1)))
    uc.reg_write(UC_X86_REG_RSI, ctx_addr)
    uc.reg_write(UC_X86_REG_RIP, compiled.fault_exit)
    return True
