"""A self-contained unicorn machine for running compiled expressions: tests, differential checks, instruction counts.

It is not the simulated kernel: just module space for code, vmalloc space for the agent context, register block,
TSV array, trace area and a stack, plus whatever memory a test maps. It calls a compiled expression the way a
probe's detour does (SysV, %rdi/%rsi), handles memory faults with `fault_fixup` (the machine does the same from its
fault-fixup table), serves the printf trap, and counts the instructions executed with a native code hook
(`inc qword [rcx]; ret` in an executable host page: no Python per instruction). Like the machine, it runs on page
tables (kgtp_sim/uc_paging.py): a read of an unmapped address is a #PF raised by the MMU.

Thread: the caller's (tests and `agent.measure`); each `Sandbox` owns its own unicorn instance, apart from the
machine's.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from unicorn import UC_ARCH_X86, UC_ERR_EXCEPTION, UC_HOOK_CODE, UC_HOOK_INTR, UC_HOOK_MEM_WRITE, UC_MODE_64, UcError
from unicorn import UC_PROT_ALL
from unicorn.x86_const import (
    UC_X86_REG_CR2,
    UC_X86_REG_R8,
    UC_X86_REG_RAX,
    UC_X86_REG_RCX,
    UC_X86_REG_RDI,
    UC_X86_REG_RDX,
    UC_X86_REG_RIP,
    UC_X86_REG_RSI,
    UC_X86_REG_RSP,
)
from unicorn import x86_const

from ..arch import amd64
from .. import uc_paging as paging
from ..uc_native import InstructionCounter, clear_exception_in_flight
from ..uc_paging import memory_operand_address
from . import abi
from .blocks import split_blocks
from .compiled import CompiledExpr, fault_fixup
from .errors import ErrorCode, EvalError, EvalResult, UnreadableMemory
from .interp import DEFAULT_LOOP_BUDGET
from .opcodes import OpClass
from .printf_format import format_printf

CODE_BASE = 0xFFFFFFFFA0000000  # module space
CODE_SIZE = 0x100000
DATA_BASE = 0xFFFFC90000000000  # vmalloc space
CTX_ADDR = DATA_BASE
REGS_ADDR = DATA_BASE + 0x1000
TSV_ADDR = DATA_BASE + 0x10000
TSV_SLOTS = 0x10000  # every u16 TSV number has a slot
TRACE_ADDR = DATA_BASE + 0x100000
TRACE_SIZE = 0x200000
STACK_TOP = DATA_BASE + 0x320000
DATA_SIZE = 0x320000
TRAP_ADDR = CODE_BASE + CODE_SIZE - 0x1000  # printf trap: a `ret` with a Python hook on it
RETURN_ADDR = TRAP_ADDR + 0x10  # the caller's return address: emulation stops there
PAGE = 0x1000

PHYS_TABLES = 0x10_0000  # physical memory: page tables, then code, data, and the pages tests map
PHYS_CODE = 0x100_0000
PHYS_DATA = 0x200_0000
PHYS_EXTRA = 0x1000_0000
EXTRA_SIZE = 64 << 20


def paging_ceil(size: int) -> int:
    return (size + PAGE - 1) & ~(PAGE - 1)


@dataclass
class SandboxResult:
    """What one call of compiled code produced."""

    result: EvalResult
    trace: bytes  # the bytes of [trace start, ctx.trace_ptr)
    tsvs: dict[int, int]  # the TSVs the program names, read back
    output: list[str] = field(default_factory=list)  # printf texts
    instructions: int = 0  # emulated instructions, entry to return inclusive

    @property
    def blocks(self) -> list[bytes]:
        return split_blocks(self.trace)


_LIVE_UC = {1: x86_const.UC_X86_REG_RBX, 6: x86_const.UC_X86_REG_RBP, 12: x86_const.UC_X86_REG_R12,
            13: x86_const.UC_X86_REG_R13, 14: x86_const.UC_X86_REG_R14, 15: x86_const.UC_X86_REG_R15}


class Sandbox:
    def __init__(self) -> None:
        uc = paging.PagedUc(UC_ARCH_X86, UC_MODE_64)
        for base, size in ((PHYS_TABLES, 0x10_0000), (PHYS_CODE, CODE_SIZE), (PHYS_DATA, paging_ceil(DATA_SIZE)),
                           (PHYS_EXTRA, EXTRA_SIZE)):
            uc.mem_map(base, size, UC_PROT_ALL)
        self.tables = paging.PageTables(uc, PHYS_TABLES, 0x10_0000)
        self.tables.map(CODE_BASE, PHYS_CODE, CODE_SIZE, paging.CODE)
        self.tables.map(DATA_BASE, PHYS_DATA, paging_ceil(DATA_SIZE), paging.CODE)
        self.tables.enable()
        self._next_extra = PHYS_EXTRA
        uc.mem_write(TRAP_ADDR, b"\xc3")
        self.uc = uc
        self._pages: set[int] = set()
        self._output: list[str] = []
        self._fault: tuple[int, int] | None = None  # (vector, address) of the exception that stopped a run
        self._counter = InstructionCounter(uc)
        if not self._counter.enable():
            raise UcError(UC_ERR_EXCEPTION)
        uc.hook_add(UC_HOOK_INTR, self._on_exception)
        uc.hook_add(UC_HOOK_CODE, self._on_printf, begin=TRAP_ADDR, end=TRAP_ADDR)
        # every stack write is seen, so `run` can check the code stays within its declared stack_bytes
        uc.hook_add(UC_HOOK_MEM_WRITE, self._on_stack_write, begin=STACK_TOP - 0x10000, end=STACK_TOP)
        self._lowest_rsp = STACK_TOP
        self._loaded: dict[int, bytes] = {}

    # memory -------------------------------------------------------------------------------------------------
    def map_memory(self, address: int, data: bytes) -> None:
        """Map the pages covering [address, address+len) (if needed) and write `data` there."""
        first = address & ~(PAGE - 1)
        last = (address + max(len(data), 1) + PAGE - 1) & ~(PAGE - 1)
        for page in range(first, last, PAGE):
            if page not in self._pages and self.tables.translate(page) is None:
                if self._next_extra >= PHYS_EXTRA + EXTRA_SIZE:
                    raise MemoryError("sandbox memory exhausted")
                self.tables.map(page, self._next_extra, PAGE, paging.CODE)
                self._next_extra += PAGE
                self._pages.add(page)
        self.uc.mem_write(address, bytes(data))

    def read_memory(self, address: int, n: int) -> bytes:
        try:
            return bytes(self.uc.mem_read(address, n))
        except UcError:
            raise UnreadableMemory(address, n) from None

    def load(self, compiled: CompiledExpr) -> None:
        if not (CODE_BASE <= compiled.base and compiled.end <= TRAP_ADDR):
            raise ValueError("compiled code outside the sandbox's module space")
        if self._loaded.get(compiled.base) != compiled.code:
            self.uc.mem_write(compiled.base, compiled.code)
            self.uc.ctl_remove_cache(compiled.base, compiled.end)
            self._loaded[compiled.base] = compiled.code

    # hooks --------------------------------------------------------------------------------------------------
    def _on_exception(self, uc, intno, user_data) -> None:
        """A #PF (CR2 has the address) or a #GP (a non-canonical address) in compiled code, or anything else:
        the run stops with RIP at the faulting instruction."""
        rip = uc.reg_read(UC_X86_REG_RIP)
        address = uc.reg_read(UC_X86_REG_CR2) if intno == 14 else memory_operand_address(uc, rip)
        self._fault = (intno, address)
        clear_exception_in_flight(uc)
        uc.emu_stop()

    def _on_stack_write(self, uc, access, address, size, value, user_data) -> None:
        self._lowest_rsp = min(self._lowest_rsp, address)

    def _on_printf(self, uc, address, size, user_data) -> None:
        fmt_addr = uc.reg_read(UC_X86_REG_RSI)
        fmt = bytearray()
        while True:
            byte = bytes(uc.mem_read(fmt_addr + len(fmt), 1))
            if byte == b"\0":
                break
            fmt += byte
        nargs = uc.reg_read(UC_X86_REG_RCX)
        args = struct.unpack(f"<{nargs}Q", bytes(uc.mem_read(uc.reg_read(UC_X86_REG_RDX), 8 * nargs))) if nargs else ()
        self._output.append(format_printf(bytes(fmt), args, self.read_memory))

    # calls --------------------------------------------------------------------------------------------------
    def run(
        self,
        compiled: CompiledExpr,
        registers: Sequence[int] | Mapping[int, int] = (),
        tsvs: Mapping[int, int] | None = None,
        *,
        trace_limit: int = TRACE_SIZE,
        loop_budget: int = DEFAULT_LOOP_BUDGET,
        printf: bool = True,
        live: Mapping[int, int] | None = None,
    ) -> SandboxResult:
        """Call `compiled` once. `registers`: values of GDB regnums 0..23 (missing ones are 0). The callee-saved
        registers hold the same values at entry (as at a probe site), unless `live` says otherwise."""
        uc = self.uc
        self.load(compiled)
        regs = dict(enumerate(registers)) if not isinstance(registers, Mapping) else dict(registers)
        block = amd64.encode_registers({amd64.REGISTERS[n].name: v for n, v in regs.items()})
        uc.mem_write(REGS_ADDR, block)
        numbers = sorted(
            {i.arg for i in compiled.program.insns if i.op.cls is OpClass.TSV or i.name == "tracev"}
        )
        for n in numbers:
            uc.mem_write(TSV_ADDR + 8 * n, struct.pack("<Q", (tsvs or {}).get(n, 0) & (2**64 - 1)))
        ctx = abi.AgentCtx(
            tsv_base=TSV_ADDR,
            trace_ptr=TRACE_ADDR,
            trace_limit=TRACE_ADDR + min(trace_limit, TRACE_SIZE),
            loop_budget=loop_budget,
            printf_fn=TRAP_ADDR if printf else 0,
        )
        uc.mem_write(CTX_ADDR, ctx.pack())
        rsp = STACK_TOP - 8
        uc.mem_write(rsp, struct.pack("<Q", RETURN_ADDR))
        uc.reg_write(UC_X86_REG_RSP, rsp)
        # a pointerless compile (compile_opt) reads %rdi/%rsi as the site's registers, not as the two pointers
        pointerless = compiled.pointerless
        uc.reg_write(UC_X86_REG_RDI, regs.get(5, 0) & (2**64 - 1) if pointerless else REGS_ADDR)
        uc.reg_write(UC_X86_REG_RSI, regs.get(4, 0) & (2**64 - 1) if pointerless else CTX_ADDR)
        entry = {n: (live or {}).get(n, regs.get(n, 0)) & (2**64 - 1) for n in _LIVE_UC}
        for n, reg in _LIVE_UC.items():
            uc.reg_write(reg, entry[n])
        for reg in (UC_X86_REG_RAX, UC_X86_REG_RCX, UC_X86_REG_RDX, UC_X86_REG_R8):
            uc.reg_write(reg, 0xDEAD_BEEF_DEAD_BEEF)  # garbage: compiled code must not depend on it
        self._output = []
        self._lowest_rsp = rsp
        self._counter.value_cell.value = 0
        pc = compiled.entry
        while True:
            self._fault = None
            uc.emu_start(pc, RETURN_ADDR)
            if self._fault is None:
                break
            vector, address = self._fault
            if vector not in (13, 14) or not fault_fixup(uc, compiled, CTX_ADDR, address):
                raise UcError(UC_ERR_EXCEPTION)
            pc = uc.reg_read(UC_X86_REG_RIP)
        if uc.reg_read(UC_X86_REG_RSP) != rsp + 8:
            raise AssertionError("compiled code returned with an unbalanced stack")
        for n, reg in _LIVE_UC.items():
            if uc.reg_read(reg) != entry[n]:
                raise AssertionError(f"compiled code changed callee-saved {abi.LIVE_CANDIDATES[n]}")
        lowest = min(self._lowest_rsp, rsp)
        if rsp - lowest > compiled.stack_bytes:
            raise AssertionError(f"compiled code used {rsp - lowest} bytes of stack, declared {compiled.stack_bytes}")
        out = abi.AgentCtx.unpack(bytes(uc.mem_read(CTX_ADDR, abi.CTX_SIZE)))
        trace = bytes(uc.mem_read(TRACE_ADDR, out.trace_ptr - TRACE_ADDR))
        values = {n: struct.unpack("<Q", bytes(uc.mem_read(TSV_ADDR + 8 * n, 8)))[0] for n in numbers}
        if out.error:
            address = out.fault_addr if out.error == ErrorCode.MEMORY_FAULT and out.fault_addr else None
            error = EvalError.make(ErrorCode(out.error), out.error_pc, compiled.program.code, address)
            result = EvalResult(None, error)
        else:
            result = EvalResult(uc.reg_read(UC_X86_REG_RAX))
        return SandboxResult(result, trace, values, list(self._output), self._counter.value)
