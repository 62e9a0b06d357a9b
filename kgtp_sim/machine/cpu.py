"""The unicorn CPU: memory map, hooks, and x86 interrupt/exception delivery through the kernel's IDT.

Unicorn runs instructions but has no notion of an IDT: software interrupts, #DE, #UD and bad memory accesses
come back to us as hooks. This module turns each into what the hardware would do (push the 64-bit interrupt
frame, set CR2, clear IF for an interrupt gate, jump to the gate's handler), so the kernel handles its own
exceptions and returns with `iretq`. Two tables get a look first, for the tracer's sake:

- `breakpoints`: an int3 at one of these addresses is the stub's probe, not the kernel's business;
- `fault_fixups`: a memory fault whose RIP is in one of these ranges (stub-generated code) is resolved by the
  tracer (like Linux's exception tables), never by the kernel's #PF handler.

Measured on unicorn 2.1.4: writing RIP inside an INTR or INSN_INVALID hook redirects execution; #DE reports RIP
at the faulting instruction, `int N` and int3 report RIP after it; an unmapped access stops emu_start with RIP
at the faulting instruction (so we stop, then deliver #PF from the run loop); `hlt` ends emu_start with RIP after
it.

Demand paging does not use mem_map/mem_unmap at run time: each of those flushes unicorn's TLB, and the flush
cost grows with the TLB (measured: 15 us on a fresh CPU, 5 ms after a second of busy kernel, up to 1.4 s in a
burst), which stalled the CPU thread. Instead the whole demand region is mapped once and a UC_HOOK_TLB_FILL hook
limited to that region refuses the pages the kernel has not asked for: a refused fill ends emu_start with
UC_ERR_EXCEPTION and RIP at the faulting instruction, and we deliver #PF. Making a page present needs nothing
(the refused fill left no TLB entry); making it absent again needs its TLB entries gone. A full flush
(UC_CTL_TLB_FLUSH, and mem_protect, which flushes all) lets QEMU resize its TLB tables upwards at every flush of a
busy CPU: the soak saw the stub grow from 53 to 229 MiB that way. So the CPU drops just those pages' entries itself:
it runs `invlpg` on each, from a page of its own code, between two emulation runs, as the kernel would.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import mmap
import struct

from capstone import CS_ARCH_X86, CS_MODE_64, CS_OP_MEM, Cs
from capstone import x86_const as CX
from collections import Counter
from typing import Callable

from unicorn import (
    UC_ARCH_X86,
    UC_CTL_IO_WRITE,
    UC_CTL_TLB_FLUSH,
    UC_HOOK_BLOCK,
    UC_HOOK_CODE,
    UC_HOOK_INSN,
    UC_HOOK_INSN_INVALID,
    UC_HOOK_INTR,
    UC_HOOK_MEM_INVALID,
    UC_HOOK_TLB_FILL,
    UC_MEM_FETCH,
    UC_MEM_FETCH_PROT,
    UC_MEM_FETCH_UNMAPPED,
    UC_MEM_READ_PROT,
    UC_MEM_READ_UNMAPPED,
    UC_MEM_WRITE,
    UC_MEM_WRITE_PROT,
    UC_MEM_WRITE_UNMAPPED,
    UC_MODE_64,
    UC_PROT_ALL,
    UC_PROT_EXEC,
    UC_PROT_READ,
    UC_PROT_WRITE,
    UC_TLB_VIRTUAL,
    Uc,
    UcError,
)
from unicorn import x86_const as X

from .errors import MachineError
from .image import KernelImage
from .layout import (
    BOOT_BASE,
    BOOT_SIZE,
    DEMAND_BASE,
    DEMAND_SIZE,
    MODULE_BASE,
    MODULE_SIZE,
    PAGE_SIZE,
    SERVICE_BASE,
    SERVICE_SIZE,
    VMALLOC_BASE,
    VMALLOC_SIZE,
    page_ceil,
    page_floor,
)

NO_EXIT = 0xFFFF_FFFF_FFFF_FFFF  #: `until` for emu_start when only a stop request should end it
ERROR_CODE_VECTORS = frozenset({8, 10, 11, 12, 13, 14, 17, 21, 29, 30})
EFLAGS_TF = 1 << 8
EFLAGS_IF = 1 << 9
EFLAGS_NT = 1 << 14
EFLAGS_RF = 1 << 16
KERNEL_CS = 0x08
KERNEL_DS = 0x10
#: the bootloader's GDT: null, 64-bit code (0x08), data (0x10); the kernel installs its own equivalent
BOOT_GDT = struct.pack("<3Q", 0, 0x00AF9B000000FFFF, 0x00CF93000000FFFF)

#: register name (kgtp_sim/arch/amd64.py order) -> unicorn id
REGISTER_IDS: dict[str, int] = {
    name: getattr(X, f"UC_X86_REG_{name.upper()}")
    for name in (
        "rax rbx rcx rdx rsi rdi rbp rsp r8 r9 r10 r11 r12 r13 r14 r15 rip eflags cs ss ds es fs gs".split()
    )
}
ARGUMENT_REGISTERS = (X.UC_X86_REG_RDI, X.UC_X86_REG_RSI, X.UC_X86_REG_RDX, X.UC_X86_REG_RCX, X.UC_X86_REG_R8,
                      X.UC_X86_REG_R9)

BreakpointHandler = Callable[[Uc], None]
FaultHandler = Callable[[Uc, int], None]


#: exceptions QEMU calls "contributory": a second one before the first is delivered makes a #DF
CONTRIBUTORY_VECTORS = frozenset({0, 10, 11, 12, 13})


@functools.cache
def _disassembler() -> Cs:
    cs = Cs(CS_ARCH_X86, CS_MODE_64)
    cs.detail = True
    return cs


@functools.cache
def _old_exception_offset() -> int | None:
    """Offset of QEMU's CPUX86State.old_exception in a unicorn context blob, found by experiment.

    QEMU remembers the exception "in flight" and resets it only when it delivers the exception itself. Unicorn
    hands exceptions to our hook instead, so the memory stays set: after one #DE, the next #DE is promoted to a
    double fault (vector 8). We cannot reach the field through the API, so we find it once: run a #DE on a
    scratch CPU and look for the only int that went from -1 to 0 in the saved context.
    """
    uc = Uc(UC_ARCH_X86, UC_MODE_64)
    uc.mem_map(0x1000, PAGE_SIZE)
    uc.mem_write(0x1000, bytes.fromhex("31c9" "31d2" "48f7f1" "f4"))  # xor ecx,ecx; xor edx,edx; div rcx; hlt
    uc.hook_add(UC_HOOK_INTR, lambda uc, intno, _: uc.reg_write(X.UC_X86_REG_RIP, uc.reg_read(X.UC_X86_REG_RIP) + 3))
    before = bytes(uc.context_save())
    uc.emu_start(0x1000, 0x1007)
    after = bytes(uc.context_save())
    found = [i for i in range(0, len(before) - 3)
             if before[i : i + 4] == b"\xff\xff\xff\xff" and after[i : i + 4] == b"\0\0\0\0"]
    return found[0] if len(found) == 1 else None


class Stop(enum.Enum):
    """Why `Cpu.run` returned."""

    HALT = "hlt executed"
    STOPPED = "stop requested (or instruction budget spent)"
    UNTIL = "reached the requested address"
    EXCEPTION = "a memory fault was delivered (IDT or fixup); resume"


class FaultFixups:
    """Address ranges of stub-generated code -> handler(uc, fault_address) for memory faults raised there.

    The handler must leave RIP (and whatever else) where execution continues, typically the generated code's
    fault exit, after recording the error. Ranges must not overlap.
    """

    def __init__(self) -> None:
        self._ranges: dict[int, tuple[int, FaultHandler]] = {}

    def add(self, start: int, end: int, handler: FaultHandler) -> None:
        """Cover [start, end)."""
        if end <= start:
            raise ValueError(f"empty range {start:#x}..{end:#x}")
        for lo, (hi, _) in self._ranges.items():
            if start < hi and lo < end:
                raise ValueError(f"range {start:#x}..{end:#x} overlaps {lo:#x}..{hi:#x}")
        self._ranges[start] = (end, handler)

    def remove(self, start: int) -> None:
        del self._ranges[start]

    def find(self, address: int) -> FaultHandler | None:
        for lo, (hi, handler) in list(self._ranges.items()):
            if lo <= address < hi:
                return handler
        return None

    def __len__(self) -> int:
        return len(self._ranges)

    def clear(self) -> None:
        self._ranges.clear()


class FastRegisters:
    """Register access straight through libunicorn, about 3x cheaper than the binding's reg_read/reg_write.

    Used on the per-interrupt path. Only for registers that fit 64 bits; the buffer is cleared before each
    read because unicorn writes just the register's width (2 bytes for a selector).
    """

    def __init__(self, uc: Uc) -> None:
        from unicorn.unicorn_py3.unicorn import uclib

        self._handle = uc._uch
        self._value = ctypes.c_uint64(0)
        self._ref = ctypes.byref(self._value)
        self._read = uclib.uc_reg_read
        self._write = uclib.uc_reg_write

    def read(self, reg: int) -> int:
        self._value.value = 0
        if self._read(self._handle, reg, self._ref):
            raise MachineError(f"cannot read register {reg}")
        return self._value.value

    def write(self, reg: int, value: int) -> None:
        self._value.value = value & 0xFFFF_FFFF_FFFF_FFFF
        if self._write(self._handle, reg, self._ref):
            raise MachineError(f"cannot write register {reg}")


def _native_hook(uc: Uc, kind: int, code: bytes, user_data: ctypes.c_void_p) -> tuple[object, mmap.mmap] | None:
    """Add a hook whose callback is machine code (no Python per call): `code` is placed in an executable page
    and called with the callback's C arguments, user_data in rcx. None where W+X mappings are refused."""
    try:
        from unicorn.unicorn_py3.arch.types import uc_hook_h
        from unicorn.unicorn_py3.unicorn import HOOK_CODE_CFUNC, uclib

        page = mmap.mmap(-1, PAGE_SIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        page.write(code)
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        handle = uc_hook_h()
        status = uclib.uc_hook_add(
            uc._uch, ctypes.byref(handle), kind, ctypes.cast(address, HOOK_CODE_CFUNC), user_data,
            ctypes.c_uint64(1), ctypes.c_uint64(0),
        )
    except (OSError, ValueError, ImportError, AttributeError):
        return None
    return (handle, page) if status == 0 else None


class InstructionCounter:
    """Counts every executed instruction with a native UC_HOOK_CODE callback: `inc qword [rcx]; ret`.

    The callback's 4th argument (rcx) is the user_data pointer, here a c_uint64, so no Python runs per
    instruction (about 12 ns each, measured). Falls back to `available = False` where W+X mappings are refused.
    """

    CODE = bytes.fromhex("48ff01c3")

    def __init__(self, uc: Uc) -> None:
        self.value_cell = ctypes.c_uint64(0)
        self._hook = _native_hook(uc, UC_HOOK_CODE, self.CODE, ctypes.cast(ctypes.byref(self.value_cell), ctypes.c_void_p))
        self.available = self._hook is not None

    @property
    def value(self) -> int:
        return self.value_cell.value


class _StopCell(ctypes.Structure):
    _fields_ = [("requested", ctypes.c_uint64), ("emu_stop", ctypes.c_void_p), ("lo", ctypes.c_uint64),
                ("hi", ctypes.c_uint64)]


class BlockStopper:
    """Ends emulation at the next block boundary on behalf of other threads.

    `uc.emu_stop()` called from another thread is not safe: it can end a translation block in the middle
    while QEMU resumes from the block's first instruction, so the instructions already run execute twice (an
    `inc` counted twice, a `push` doubled; measured with two counters in one block). A stop requested from
    inside a hook on the CPU thread is exact. So other threads only raise a flag; a native UC_HOOK_BLOCK
    callback (`cmp [rcx], 0; jne; ret; jmp *uc_emu_stop`) sees it at the next block's start, before any of
    its instructions ran, and calls uc_emu_stop from the CPU thread. Without W+X pages, a Python block hook
    does the same, slower.

    A second kind of request, `stop_outside(lo, hi)`, ends emulation at the first block that starts outside
    [lo, hi): the CPU thread asks it when a timer tick waits while the stub's own code (a detour, interrupts
    off) runs, so the tick is taken as soon as the kernel's code resumes instead of whenever a periodic stop
    happens to land outside a detour (at full tracing pace, almost never).
    """

    # cmp qword [rcx], 0; jne +1; ret
    # cmp qword [rcx], 1; je stop                      (1: stop at any block)
    # cmp rsi, [rcx+16]; jb stop; cmp rsi, [rcx+24]; jae stop; ret    (2: only outside [lo, hi))
    # stop: jmp qword [rcx+8]                          (uc_emu_stop(uc): rdi is still the hook's uc)
    CODE = bytes.fromhex(
        "48833900" "7501" "c3"
        "48833901" "740d"
        "483b7110" "7207" "483b7118" "7301" "c3"
        "ff6108"
    )
    ANY_BLOCK, OUTSIDE_RANGE = 1, 2

    def __init__(self, uc: Uc) -> None:
        from unicorn.unicorn_py3.unicorn import uclib

        self._cell = _StopCell(0, ctypes.cast(uclib.uc_emu_stop, ctypes.c_void_p).value, 0, 0)
        self._hook = _native_hook(uc, UC_HOOK_BLOCK, self.CODE, ctypes.cast(ctypes.byref(self._cell), ctypes.c_void_p))
        if self._hook is None:
            uc.hook_add(UC_HOOK_BLOCK, self._python_check)

    def request(self) -> None:
        """From any thread: end emulation at the next block boundary (kept until `clear`)."""
        self._cell.requested = self.ANY_BLOCK

    def stop_outside(self, lo: int, hi: int) -> None:
        """On the CPU thread, before emulation starts: end it at the first block starting outside [lo, hi).
        A later `request` from any thread widens this to any block."""
        self._cell.lo, self._cell.hi = lo, hi
        self._cell.requested = self.OUTSIDE_RANGE

    def clear(self) -> None:
        """On the CPU thread, before emulation starts: forget requests already served."""
        self._cell.requested = 0

    def take(self) -> int:
        """On the CPU thread: the pending request (0 if none), cleared; `request()` puts a stop back."""
        requested, self._cell.requested = self._cell.requested, 0
        return requested

    def _python_check(self, uc: Uc, address: int, _size: int, _data: object) -> None:
        cell = self._cell
        if cell.requested == self.ANY_BLOCK or (
                cell.requested == self.OUTSIDE_RANGE and not cell.lo <= address < cell.hi):
            uc.emu_stop()


class Cpu:
    """One x86_64 CPU running the kernel image. Not thread-safe: the Machine serialises access."""

    def __init__(self, image: KernelImage, port_out: Callable[[int, int, int, int], None],
                 port_in: Callable[[int, int], int]) -> None:
        self.image = image
        self._port_out = port_out
        self._port_in = port_in
        uc = Uc(UC_ARCH_X86, UC_MODE_64)
        # no page tables: guest virtual == unicorn address; needed for addresses like 0xffffffff81000000
        uc.ctl_set_tlb_mode(UC_TLB_VIRTUAL)
        self.uc = uc
        self._map_image(image)
        uc.mem_map(MODULE_BASE, MODULE_SIZE, UC_PROT_ALL)
        uc.mem_map(VMALLOC_BASE, VMALLOC_SIZE, UC_PROT_READ | UC_PROT_WRITE)
        uc.mem_map(DEMAND_BASE, DEMAND_SIZE, UC_PROT_READ | UC_PROT_WRITE)
        #: demand-region pages the kernel has asked for; the others fault (see the module docstring)
        self.demand_pages: set[int] = set()
        self._stale_pages: set[int] = set()  #: dropped demand pages whose TLB entries are still to go

        self.breakpoints: dict[int, BreakpointHandler] = {}
        #: called as listener(vector, interrupted_rip, interrupted_rsp) after each delivery through the IDT
        self.delivery_listeners: list[Callable[[int, int, int], None]] = []
        self.fault_fixups = FaultFixups()
        self.delivered: Counter[int] = Counter()  # vector -> times delivered through the IDT
        self.breakpoint_hits = 0
        self.fixup_hits = 0

        self._fault: tuple[int, int] | None = None  # (access, address) of the access that stopped emulation
        self._in_emulation = False
        self._error: BaseException | None = None  # raised inside a hook; re-raised by run()
        uc.hook_add(UC_HOOK_INTR, self._on_interrupt)
        uc.hook_add(UC_HOOK_INSN_INVALID, self._on_invalid)
        uc.hook_add(UC_HOOK_MEM_INVALID, self._on_bad_access)
        uc.hook_add(UC_HOOK_TLB_FILL, self._on_demand_tlb_fill, None, DEMAND_BASE, DEMAND_BASE + DEMAND_SIZE - 1)
        uc.hook_add(UC_HOOK_INSN, self._on_out, None, 1, 0, X.UC_X86_INS_OUT)
        uc.hook_add(UC_HOOK_INSN, self._on_in, None, 1, 0, X.UC_X86_INS_IN)
        self.counter = InstructionCounter(uc)
        self.stopper = BlockStopper(uc)
        self.regs = FastRegisters(uc)
        self._reset(image.entry)

    # ---- memory map --------------------------------------------------------------------------------------

    def _map_image(self, image: KernelImage) -> None:
        """Map each PT_LOAD with its own permissions (text R-X: a kernel write to it is a real #PF)."""
        perms: dict[int, int] = {}
        for seg in image.segments:
            p = (UC_PROT_READ if seg.readable else 0) | (UC_PROT_WRITE if seg.writable else 0) | (
                UC_PROT_EXEC if seg.executable else 0)
            for page in range(page_floor(seg.vaddr), page_ceil(seg.end), PAGE_SIZE):
                perms[page] = perms.get(page, 0) | p
        run_start, run_perm, previous = None, None, None
        for page in sorted(perms) + [None]:
            if page is None or page != (previous or 0) + PAGE_SIZE or perms[page] != run_perm:
                if run_start is not None:
                    self.uc.mem_map(run_start, previous + PAGE_SIZE - run_start, run_perm)
                if page is not None:
                    run_start, run_perm = page, perms[page]
            previous = page
        for seg in image.segments:
            self.uc.mem_write(seg.vaddr, seg.data)

    def _reset(self, entry: int) -> None:
        """The state a 64-bit bootloader hands over: long mode, flat segments, interrupts off, RIP at entry."""
        uc = self.uc
        uc.mem_map(BOOT_BASE, BOOT_SIZE, UC_PROT_READ)
        uc.mem_map(SERVICE_BASE, SERVICE_SIZE, UC_PROT_READ | UC_PROT_EXEC)
        uc.mem_write(SERVICE_BASE, self.INVLPG_RDI_HLT)
        uc.mem_write(BOOT_BASE, BOOT_GDT)
        uc.reg_write(X.UC_X86_REG_GDTR, (0, BOOT_BASE, len(BOOT_GDT) - 1, 0))
        uc.reg_write(X.UC_X86_REG_CS, KERNEL_CS)
        for seg in (X.UC_X86_REG_SS, X.UC_X86_REG_DS, X.UC_X86_REG_ES):
            uc.reg_write(seg, KERNEL_DS)
        uc.reg_write(X.UC_X86_REG_EFLAGS, 0x2)
        uc.reg_write(X.UC_X86_REG_RIP, entry)

    def map_demand_page(self, address: int) -> bool:
        """Make the demand-region page holding `address` present (the kernel's #PF handler asks via port 0x80)."""
        page = page_floor(address)
        if not DEMAND_BASE <= page < DEMAND_BASE + DEMAND_SIZE or page in self.demand_pages:
            return False
        self.demand_pages.add(page)
        return True

    def unmap_demand_pages(self, address: int | None = None) -> bool:
        """Make one page (or, with None, every page) absent again, zeroed. Costs one `invlpg` per page."""
        pages = set(self.demand_pages) if address is None else {page_floor(address)} & self.demand_pages
        if not pages:
            return False
        for page in pages:
            self.uc.mem_write(page, bytes(PAGE_SIZE))
        self.demand_pages -= pages
        self._stale_pages |= pages
        if self._in_emulation:
            self.uc.emu_stop()  # invalidated by run() when emu_start returns: not from inside a hook
        else:
            self._invalidate_stale_pages()
        return True

    #: invlpg (%rdi); hlt. The hlt ends the run: with an `until` of its own, unicorn translated this block afresh
    #: for every page (measured: 176 KiB more translated code at each drop of the idle kernel's pages).
    INVLPG_RDI_HLT = bytes.fromhex("0f013ff4")

    def _invalidate_stale_pages(self) -> None:
        """Drop the TLB entries of the pages made absent, one `invlpg` each, run at the CPU's service page.

        Runs between emulation runs on the CPU thread. The kernel's registers, the instruction count and any
        stop request pending for the caller are as they were afterwards. Outside ring 0 (never, for this kernel)
        it falls back to a full flush.
        """
        pages, self._stale_pages = sorted(self._stale_pages), set()
        regs, uc = self.regs, self.uc
        if regs.read(X.UC_X86_REG_CS) & 3:
            uc.ctl(UC_CTL_TLB_FLUSH, UC_CTL_IO_WRITE)
            return
        saved = {reg: regs.read(reg) for reg in (X.UC_X86_REG_RIP, X.UC_X86_REG_RDI, X.UC_X86_REG_EFLAGS)}
        counted = self.counter.value
        asked = self.stopper.take()
        end = SERVICE_BASE + len(self.INVLPG_RDI_HLT)
        try:
            for page in pages:
                regs.write(X.UC_X86_REG_RDI, page)
                for _attempt in range(100):
                    uc.emu_start(SERVICE_BASE, NO_EXIT)
                    if regs.read(X.UC_X86_REG_RIP) == end:
                        break
                    asked |= self.stopper.take()  # another thread's stop landed before the block ran
                else:
                    raise MachineError(f"could not invalidate the TLB entry of page {page:#x}")
        finally:
            for reg, value in saved.items():
                regs.write(reg, value)
            self.counter.value_cell.value = counted
            if asked:
                self.stopper.request()

    def page_present(self, address: int) -> bool:
        """False for a demand-region page the kernel has not mapped (unicorn has it, the kernel does not)."""
        page = page_floor(address)
        return not DEMAND_BASE <= page < DEMAND_BASE + DEMAND_SIZE or page in self.demand_pages

    # ---- registers ---------------------------------------------------------------------------------------

    def registers(self) -> dict[str, int]:
        return {name: self.regs.read(reg) for name, reg in REGISTER_IDS.items()}

    def interrupts_enabled(self) -> bool:
        return bool(self.regs.read(X.UC_X86_REG_EFLAGS) & EFLAGS_IF)

    @property
    def rip(self) -> int:
        return self.regs.read(X.UC_X86_REG_RIP)

    @property
    def in_emulation(self) -> bool:
        """Inside emu_start (a hook is running): the CPU cannot be stepped from here."""
        return self._in_emulation

    # ---- interrupt delivery ------------------------------------------------------------------------------

    def deliver(self, vector: int, error_code: int | None = None) -> None:
        """Enter the kernel's handler for `vector` the way an x86_64 CPU does (same privilege level, no IST)."""
        uc, regs = self.uc, self.regs
        _, base, limit, _ = uc.reg_read(X.UC_X86_REG_IDTR)
        rip = regs.read(X.UC_X86_REG_RIP)
        if vector * 16 + 15 > limit:
            raise MachineError(f"vector {vector} at rip {rip:#x}: outside the IDT (limit {limit:#x}); is it loaded?")
        try:
            low, _selector, _ist, attr, middle, high, _ = struct.unpack("<HHBBHII", uc.mem_read(base + vector * 16, 16))
        except UcError:
            raise MachineError(f"vector {vector} at rip {rip:#x}: IDT at {base:#x} is not mapped") from None
        if not attr & 0x80:
            raise MachineError(f"vector {vector} at rip {rip:#x}: no handler (IDT gate not present)")
        rsp = regs.read(X.UC_X86_REG_RSP)
        rflags = regs.read(X.UC_X86_REG_EFLAGS)
        frame = struct.pack("<5Q", rip, regs.read(X.UC_X86_REG_CS), rflags, rsp, regs.read(X.UC_X86_REG_SS))
        if error_code is not None:
            frame = struct.pack("<Q", error_code) + frame
        new_rsp = (rsp & ~0xF) - len(frame)  # 64-bit mode aligns the frame to 16 bytes
        try:
            uc.mem_write(new_rsp, frame)
        except UcError:
            raise MachineError(f"vector {vector} at rip {rip:#x}: cannot push the frame at rsp {rsp:#x}") from None
        rflags &= ~(EFLAGS_TF | EFLAGS_NT | EFLAGS_RF)
        if attr & 0xF == 0xE:  # interrupt gate, as opposed to a trap gate
            rflags &= ~EFLAGS_IF
        regs.write(X.UC_X86_REG_RSP, new_rsp)
        regs.write(X.UC_X86_REG_EFLAGS, rflags)
        regs.write(X.UC_X86_REG_RIP, low | middle << 16 | high << 32)
        self.delivered[vector] += 1
        for listener in self.delivery_listeners:  # e.g. single-stepping, which must not step into handlers
            listener(vector, rip, rsp)

    # ---- hooks (run on the CPU thread, inside emu_start) ---------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self.uc.emu_stop()

    def _on_interrupt(self, uc: Uc, intno: int, _data: object) -> None:
        try:
            if intno == 3:
                address = self.regs.read(X.UC_X86_REG_RIP) - 1
                handler = self.breakpoints.get(address)
                if handler is not None:
                    self.breakpoint_hits += 1
                    uc.reg_write(X.UC_X86_REG_RIP, address)
                    handler(uc)
                    return
            self.deliver(intno, 0 if intno in ERROR_CODE_VECTORS else None)
            if intno in CONTRIBUTORY_VECTORS:
                self._forget_exception_in_flight()
        except BaseException as error:  # noqa: BLE001 - surfaced by run()
            self._fail(error)

    def _forget_exception_in_flight(self) -> None:
        """We delivered the exception, so QEMU must stop treating it as in flight (see _old_exception_offset)."""
        offset = _old_exception_offset()
        if offset is None:
            return
        context = self.uc.context_save()
        address = ctypes.cast(context.context, ctypes.c_void_p).value
        ctypes.memmove(address + offset, b"\xff\xff\xff\xff", 4)
        self.uc.context_restore(context)

    def _on_invalid(self, uc: Uc, _data: object) -> bool:
        try:
            self.deliver(6)
            return True
        except BaseException as error:  # noqa: BLE001
            self._fail(error)
            return False

    def _on_bad_access(self, uc: Uc, access: int, address: int, size: int, value: int, _data: object) -> bool:
        self._fault = (access, address)
        return False

    def _on_demand_tlb_fill(self, uc: Uc, page: int, access: int, entry: object, _data: object) -> bool:
        """TLB miss in the demand region: present pages map 1:1; absent ones fault (emu_start then fails)."""
        if page in self.demand_pages:
            entry.paddr = page
            entry.perms = UC_PROT_READ | UC_PROT_WRITE
            return True
        kind = {UC_MEM_WRITE: UC_MEM_WRITE_UNMAPPED, UC_MEM_FETCH: UC_MEM_FETCH_UNMAPPED}.get(access, UC_MEM_READ_UNMAPPED)
        self._fault = (kind, self._fault_address(page, kind))
        return False

    def _fault_address(self, page: int, kind: int) -> int:
        """The exact faulting address for CR2: unicorn only tells the page, so decode the faulting instruction.

        Plain base + index * scale + disp operands (all this kernel uses there) resolve exactly; anything else
        reports the page address, which is still the right page.
        """
        if kind == UC_MEM_FETCH_UNMAPPED:
            return self.uc.reg_read(X.UC_X86_REG_RIP)
        rip = self.uc.reg_read(X.UC_X86_REG_RIP)
        try:
            insn = next(_disassembler().disasm(bytes(self.uc.mem_read(rip, 16)), rip, 1))
        except (UcError, StopIteration):
            return page
        for op in insn.operands:
            if op.type != CS_OP_MEM:
                continue
            mem = op.mem
            base = insn.address + insn.size if mem.base == CX.X86_REG_RIP else self._cs_reg(mem.base)
            address = (base + self._cs_reg(mem.index) * mem.scale + mem.disp) & ((1 << 64) - 1)
            if page_floor(address) == page:
                return address
        return page

    def _cs_reg(self, cs_reg: int) -> int:
        if cs_reg == CX.X86_REG_INVALID:
            return 0
        name = _disassembler().reg_name(cs_reg)
        return self.uc.reg_read(getattr(X, f"UC_X86_REG_{name.upper()}"))

    def _on_out(self, uc: Uc, port: int, size: int, value: int, _data: object) -> None:
        try:
            self._port_out(port, size, value, self.regs.read(X.UC_X86_REG_RDI))
        except BaseException as error:  # noqa: BLE001
            self._fail(error)

    def _on_in(self, uc: Uc, port: int, size: int, _data: object) -> int:
        try:
            return self._port_in(port, size)
        except BaseException as error:  # noqa: BLE001
            self._fail(error)
            return 0

    # ---- running -----------------------------------------------------------------------------------------

    def run(self, until: int = NO_EXIT, count: int = 0, keep_stop_request: bool = False) -> Stop:
        """Run from RIP until hlt, a stop request, `until`, `count` instructions, or a memory fault (handled).

        A stop requested before the run began is forgotten: it was for whoever called run (a run nested in a
        posted request would otherwise end at once, forever). The machine's loop, which clears it under its
        lock so no request is lost, passes keep_stop_request.
        """
        uc = self.uc
        if not keep_stop_request:
            self.stopper.clear()
        self._fault = None
        self._error = None
        begin = self.regs.read(X.UC_X86_REG_RIP)
        failure: UcError | None = None
        self._in_emulation = True
        try:
            uc.emu_start(begin, until, 0, count)
        except UcError as error:
            failure = error
        finally:
            self._in_emulation = False
        if self._stale_pages:
            self._invalidate_stale_pages()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self._fault is not None:
            self._handle_fault(*self._fault)
            return Stop.EXCEPTION
        rip = self.regs.read(X.UC_X86_REG_RIP)
        if failure is not None:
            raise MachineError(f"emulation failed at rip {rip:#x}: {failure}")
        if rip == until:
            return Stop.UNTIL
        try:
            if uc.mem_read(rip - 1, 1) == b"\xf4":
                return Stop.HALT
        except UcError:
            pass
        return Stop.STOPPED

    def _handle_fault(self, access: int, address: int) -> None:
        """A bad access stopped emulation with RIP at the faulting instruction: fixup table, else #PF."""
        self._fault = None
        rip = self.uc.reg_read(X.UC_X86_REG_RIP)
        handler = self.fault_fixups.find(rip)
        if handler is not None:
            self.fixup_hits += 1
            handler(self.uc, address)
            return
        present = access in (UC_MEM_READ_PROT, UC_MEM_WRITE_PROT, UC_MEM_FETCH_PROT)
        write = access in (UC_MEM_WRITE_UNMAPPED, UC_MEM_WRITE_PROT)
        fetch = access in (UC_MEM_FETCH_UNMAPPED, UC_MEM_FETCH_PROT)
        self.uc.reg_write(X.UC_X86_REG_CR2, address)
        self.deliver(14, int(present) | int(write) << 1 | int(fetch) << 4)
        self._forget_exception_in_flight()  # in case unicorn counted the refused TLB fill as a #PF in flight

    def read_byte(self, address: int) -> int | None:
        try:
            return self.uc.mem_read(address, 1)[0]
        except UcError:
            return None
