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

Memory goes through the kernel's page tables (kgtp_sim/uc_paging.py): the machine builds them as a bootloader would and
hands the CPU CR3 with paging on, so a not-present page or a protection violation is a real #PF raised by the
MMU. Unicorn gives that to UC_HOOK_INTR with RIP at the faulting instruction and CR2 set; QEMU keeps the error
code in a field the API does not reach, read from the saved context (offset found by experiment, as for the
"exception in flight" below). The kernel's #PF handler fills the entry of a demand page itself and drops pages
by clearing their entries and running `invlpg`, so the machine never flushes the TLB.

Why this module is long: it is everything that happens between unicorn and the kernel at one instruction
boundary (delivery, the probe and fixup tables, the #DB trap, page faults, block stops, counting), and those
hooks share one piece of state, the CPU's, which splitting would pass around.
"""

from __future__ import annotations

import ctypes
import enum
import struct

from collections import Counter
from typing import Callable

from unicorn import (
    UC_ARCH_X86,
    UC_HOOK_BLOCK,
    UC_HOOK_INSN,
    UC_HOOK_INSN_INVALID,
    UC_HOOK_INTR,
    UC_HOOK_MEM_INVALID,
    UC_MEM_FETCH_PROT,
    UC_MEM_FETCH_UNMAPPED,
    UC_MEM_READ_PROT,
    UC_MEM_WRITE_PROT,
    UC_MEM_WRITE_UNMAPPED,
    UC_MODE_64,
    UC_PROT_ALL,
    Uc,
    UcError,
)
from unicorn import x86_const as X
from unicorn.unicorn_const import UC_CTL_IO_WRITE, UC_CTL_TLB_FLUSH
from unicorn.unicorn_py3.unicorn import HOOK_INTR_CFUNC

from .. import uc_paging as paging
from . import process
from .errors import MachineError
from .image import KernelImage
from .syscall_entry import SyscallEntry
from .layout import (
    BOOT_BASE,
    BOOT_SIZE,
    DEMAND_BASE,
    DEMAND_SIZE,
    MODULE_BASE,
    MODULE_SIZE,
    PAGE_SIZE,
    PHYS_BOOT,
    PHYS_DEMAND,
    PHYS_DEMAND_SIZE,
    PHYS_KERNEL,
    PHYS_KERNEL_SIZE,
    PHYS_MODULE,
    PHYS_TABLES,
    PHYS_TABLES_SIZE,
    PHYS_VMALLOC,
    VMALLOC_BASE,
    VMALLOC_SIZE,
    page_ceil,
    page_floor,
)
from ..uc_native import (
    InstructionCounter,
    Registers,
    add_native_hook,
    emu_stop_address,
    lib,
    old_exception_offset,
)
from ..uc_paging import memory_operand_address, page_fault_error_offset

TRANSLATION_CACHE = 32 << 20  #: bytes of host code the emulator keeps translated (see Cpu.__init__)
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


GENERAL_PROTECTION = 13
PAGE_FAULT = 14

#: exceptions QEMU calls "contributory": a second one before the first is delivered makes a #DF
CONTRIBUTORY_VECTORS = frozenset({0, 10, 11, 12, 13})



def _gaps(regions) -> list[tuple[int, int]]:
    """The physical addresses no region backs, as inclusive (begin, end) ranges, from unicorn's inclusive
    (begin, end, perms) regions."""
    gaps, cursor = [], 0
    for begin, end, _ in sorted(regions):
        if begin > cursor:
            gaps.append((cursor, begin - 1))
        cursor = end + 1
    if cursor <= 2**64 - 1:
        gaps.append((cursor, 2**64 - 1))
    return gaps

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


class _StopCell(ctypes.Structure):
    _fields_ = [("requested", ctypes.c_uint64), ("emu_stop", ctypes.c_void_p), ("lo", ctypes.c_uint64),
                ("hi", ctypes.c_uint64)]


class _JumpCell(ctypes.Structure):
    _fields_ = [("python", ctypes.c_uint64), ("reg_read", ctypes.c_uint64), ("reg_write", ctypes.c_uint64),
                ("hits", ctypes.c_uint64), ("mask", ctypes.c_uint64)]


class InterruptDispatch:
    """The CPU's one UC_HOOK_INTR callback, in machine code: an int3 at an address of the jump table goes on at that
    address's target without any Python (the compiled engines' int3 probes enter their detours this way, as the
    jump probes do); anything else is handed to the Python handler, with the same arguments.

    The table is open addressing with linear probing in host memory (address 0: empty slot), indexed by the int3's
    address modulo its size; entries change only on the CPU thread between runs (`set`, `remove`), when no
    callback can be reading it. Without W+X host pages the Python handler is the hook and looks the table up
    itself.
    """

    SLOTS = 0x2000  # a power of two: ten thousand probes stay well under half full
    #: AT&T, hex only (see docs/DESIGN.md, the assembler trap); rdi = uc, esi = intno, rdx = the cell
    SOURCE = """
        cmp $0x3, %esi
        jne python
        push %rbx
        push %r12
        push %r13
        sub $0x10, %rsp
        mov %rdi, %rbx
        mov %rdx, %r12
        mov $RIP, %esi
        mov %rsp, %rdx
        call *0x8(%r12)
        mov (%rsp), %rax
        dec %rax
        mov %rax, %rcx
        and 0x20(%r12), %rcx
    probe:
        mov %rcx, %r13
        shl $0x4, %r13
        lea 0x28(%r12,%r13), %r13
        mov (%r13), %rdx
        test %rdx, %rdx
        je miss
        cmp %rax, %rdx
        je hit
        inc %rcx
        and 0x20(%r12), %rcx
        jmp probe
    hit:
        mov 0x8(%r13), %rax
        mov %rax, (%rsp)
        incq 0x18(%r12)
        mov %rbx, %rdi
        mov $RIP, %esi
        mov %rsp, %rdx
        call *0x10(%r12)
        add $0x10, %rsp
        pop %r13
        pop %r12
        pop %rbx
        ret
    miss:
        mov %rbx, %rdi
        mov $0x3, %esi
        mov %r12, %rdx
        add $0x10, %rsp
        pop %r13
        pop %r12
        pop %rbx
    python:
        jmp *(%rdx)
    """

    def __init__(self, uc: Uc, handler: Callable[[Uc, int, object], None]) -> None:
        self.table: dict[int, int] = {}
        memory = (ctypes.c_uint64 * (5 + 2 * self.SLOTS))()
        self._memory = memory
        self._cell = _JumpCell.from_buffer(memory)
        self._slots = ctypes.cast(ctypes.addressof(memory) + ctypes.sizeof(_JumpCell),
                                  ctypes.POINTER(ctypes.c_uint64))
        self._python = HOOK_INTR_CFUNC(lambda _uc, intno, _data: handler(uc, intno, None))
        self._cell.python = ctypes.cast(self._python, ctypes.c_void_p).value
        self._cell.reg_read = ctypes.cast(lib.uc_reg_read, ctypes.c_void_p).value
        self._cell.reg_write = ctypes.cast(lib.uc_reg_write, ctypes.c_void_p).value
        self._cell.mask = self.SLOTS - 1
        code = _assemble(self.SOURCE.replace("$RIP", f"${X.UC_X86_REG_RIP:#x}"))
        self.native = add_native_hook(uc, UC_HOOK_INTR, code, ctypes.addressof(memory)) is not None
        if not self.native:
            uc.hook_add(UC_HOOK_INTR, handler)

    @property
    def hits(self) -> int:
        """int3s sent on natively."""
        return self._cell.hits

    def target(self, address: int) -> int | None:
        return self.table.get(address)

    def set(self, address: int, target: int) -> None:
        if address not in self.table and len(self.table) >= self.SLOTS // 2:
            raise MachineError(f"more than {self.SLOTS // 2} int3 probes")
        self.table[address] = target
        slot = self._find(address)
        self._slots[2 * slot], self._slots[2 * slot + 1] = address, target

    def remove(self, address: int) -> None:
        if self.table.pop(address, None) is None:
            return
        # backward-shift deletion keeps every other entry reachable from its home slot
        mask = self.SLOTS - 1
        hole = self._find(address)
        index = hole
        while True:
            index = (index + 1) & mask
            key = self._slots[2 * index]
            if key == 0:
                break
            home = key & mask
            if (index - home) & mask >= (index - hole) & mask:
                self._slots[2 * hole], self._slots[2 * hole + 1] = key, self._slots[2 * index + 1]
                hole = index
        self._slots[2 * hole] = self._slots[2 * hole + 1] = 0

    def _find(self, address: int) -> int:
        """The slot holding `address`, or the empty slot where it goes."""
        index = address & (self.SLOTS - 1)
        while self._slots[2 * index] not in (0, address):
            index = (index + 1) & (self.SLOTS - 1)
        return index


def _assemble(source: str) -> bytes:
    from keystone import KS_ARCH_X86, KS_MODE_64, KS_OPT_SYNTAX_ATT, Ks

    ks = Ks(KS_ARCH_X86, KS_MODE_64)
    ks.syntax = KS_OPT_SYNTAX_ATT
    encoding, _ = ks.asm(source, 0)
    return bytes(encoding)


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
        self._cell = _StopCell(0, emu_stop_address(), 0, 0)
        self._hook = add_native_hook(uc, UC_HOOK_BLOCK, self.CODE, ctypes.addressof(self._cell))
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
        uc = paging.PagedUc(UC_ARCH_X86, UC_MODE_64)
        # The translation cache: when it is full the emulator drops every translated block and starts over (its
        # own policy, a few milliseconds of translating the hot code again). Its default of 1 GiB let a serving
        # machine's host memory grow with translations that are never used again (about 4 MiB a second under
        # compiled tracing at full pace, seen in the soak) before that happened.
        uc.ctl_set_tcg_buffer_size(TRANSLATION_CACHE)
        self.uc = uc
        # physical memory; permissions live in the page tables, so every frame is RWX to unicorn
        uc.mem_map(PHYS_BOOT, PAGE_SIZE, UC_PROT_ALL)
        uc.mem_map(PHYS_TABLES, PHYS_TABLES_SIZE, UC_PROT_ALL)
        uc.mem_map(PHYS_DEMAND, PHYS_DEMAND_SIZE, UC_PROT_ALL)
        uc.mem_map(PHYS_MODULE, MODULE_SIZE, UC_PROT_ALL)
        uc.mem_map(PHYS_VMALLOC, VMALLOC_SIZE, UC_PROT_ALL)
        self.tables = paging.PageTables(uc, PHYS_TABLES, PHYS_TABLES_SIZE)
        self._map_image(image)
        self.tables.prepare(DEMAND_BASE, DEMAND_SIZE)  # entries absent: the kernel's #PF handler fills them
        process.prepare_memory(uc, self.tables)  # RAM for processes, before the hooks on what no memory backs
        #: module and vmalloc pages mapped so far, with their rights (`map_stub_pages`)
        self._stub_pages: dict[int, int] = {}
        #: frames of the demand pool not handed to the kernel (it asks through port 0x80)
        self._free_frames = list(range(PHYS_DEMAND + PHYS_DEMAND_SIZE - PAGE_SIZE, PHYS_DEMAND - 1, -PAGE_SIZE))
        self.frames_in_use = 0

        self.breakpoints: dict[int, BreakpointHandler] = {}
        #: the single-step trap (#DB after an instruction run with EFLAGS.TF): the stub's while-stepping, never the
        #: kernel's (it sets no TF); handler(uc) runs with RIP at the next instruction
        self.debug_trap: BreakpointHandler | None = None
        #: called on the CPU thread when a run ends, outside emulation, before `run` returns (the hardware
        #: breakpoints finish an instruction the stop cut in two there: watchpoints.py)
        self.after_run: BreakpointHandler | None = None
        self.fault_fixups = FaultFixups()
        self.delivered: Counter[int] = Counter()  # vector -> times delivered through the IDT
        self.breakpoint_hits = 0
        self.fixup_hits = 0

        self._fault: tuple[int, int] | None = None  # (access, address) of an access to absent physical memory
        self._in_emulation = False
        self._error: BaseException | None = None  # raised inside a hook; re-raised by run()
        #: int3 -> target without Python (`InterruptDispatch`); other interrupts reach `_on_interrupt`
        self.jumps = InterruptDispatch(uc, self._on_interrupt)
        uc.hook_add(UC_HOOK_INSN_INVALID, self._on_invalid)
        # Only where no frame is: a memory hook whose range covers a frame makes the emulator take its slow path
        # for every store to that frame, forever (it never marks a hooked page's TLB entry dirty).
        for begin, end in _gaps(uc.mem_regions()):
            uc.hook_add(UC_HOOK_MEM_INVALID, self._on_bad_access, None, begin, end)
        uc.hook_add(UC_HOOK_INSN, self._on_out, None, 1, 0, X.UC_X86_INS_OUT)
        uc.hook_add(UC_HOOK_INSN, self._on_in, None, 1, 0, X.UC_X86_INS_IN)
        #: counts only while enabled (Machine.counting): the hook costs about 12 ns per instruction
        self.counter = InstructionCounter(uc)
        self.stopper = BlockStopper(uc)
        self.regs = Registers(uc)
        #: `syscall` made architectural, and the privilege change of interrupts from user mode
        self.syscall_entry = SyscallEntry(uc)
        # Runs end at hlt, a stop or an exit address. Unicorn invalidates the translation at each exit when a run
        # ends, and an `until` of "none" (all ones) is an address that is never mapped: invalidating there walks
        # the tables, fails, and leaves CR2 and a #PF "in flight" behind (the next real #PF became a #DF).
        uc.ctl_exits_enabled(True)
        uc.ctl_set_exits([])
        self._reset(image.entry)

    # ---- memory map --------------------------------------------------------------------------------------

    def _map_image(self, image: KernelImage) -> None:
        """Load each PT_LOAD at PHYS_KERNEL + (vaddr - lowest vaddr) and map its pages with its permissions:
        text read-only and executable, rodata read-only, data no-execute (a kernel write to text is a #PF)."""
        low = page_floor(min(seg.vaddr for seg in image.segments))
        high = page_ceil(max(seg.end for seg in image.segments))
        if high - low > PHYS_KERNEL_SIZE:
            raise MachineError(f"kernel image of {high - low:#x} bytes does not fit {PHYS_KERNEL_SIZE:#x}")
        self.uc.mem_map(PHYS_KERNEL, high - low, UC_PROT_ALL)
        rights: dict[int, tuple[bool, bool]] = {}  # page -> (writable, executable): a shared page gets both's
        for seg in image.segments:
            for page in range(page_floor(seg.vaddr), page_ceil(seg.end), PAGE_SIZE):
                w, x = rights.get(page, (False, False))
                rights[page] = (w or seg.writable, x or seg.executable)
        for page, (w, x) in sorted(rights.items()):
            self.tables.map(page, PHYS_KERNEL + page - low, PAGE_SIZE, paging.leaf_flags(True, w, x))
        for seg in image.segments:
            self.uc.phys_write(PHYS_KERNEL + seg.vaddr - low, seg.data)

    def map_stub_pages(self, address: int, length: int, data: bool = False) -> None:
        """Map the pages of module or vmalloc space under [address, address + length) as their space wants them
        (module space read-write-execute, vmalloc space no-execute), each to its own frame; `data` maps module
        pages no-execute (data that code in module space keeps beside itself: see `Machine.alloc_code`).
        A page mapped before with other rights is mapped again."""
        if MODULE_BASE <= address < MODULE_BASE + MODULE_SIZE:
            base, physical, flags = MODULE_BASE, PHYS_MODULE, paging.DATA if data else paging.CODE
        elif VMALLOC_BASE <= address < VMALLOC_BASE + VMALLOC_SIZE:
            base, physical, flags = VMALLOC_BASE, PHYS_VMALLOC, paging.DATA
        else:
            raise ValueError(f"{address:#x} is neither in module space nor in vmalloc space")
        first = page_floor(address)
        last = page_ceil(address + length)
        remapped = False
        run_start = None
        for page in list(range(first, last, PAGE_SIZE)) + [None]:
            if page is not None and self._stub_pages.get(page) != flags:
                remapped |= page in self._stub_pages
                run_start = page if run_start is None else run_start
                continue
            if run_start is not None:
                end = page if page is not None else last
                self.tables.map(run_start, physical + run_start - base, end - run_start, flags)
                self._stub_pages.update(dict.fromkeys(range(run_start, end, PAGE_SIZE), flags))
                run_start = None
        if remapped:  # the TLB may still hold the old rights
            self.uc.ctl(UC_CTL_TLB_FLUSH, UC_CTL_IO_WRITE)

    def _reset(self, entry: int) -> None:
        """The state a 64-bit bootloader hands over: long mode with paging on the machine's tables, flat
        segments, interrupts off, RIP at entry."""
        uc = self.uc
        self.tables.map(BOOT_BASE, PHYS_BOOT, BOOT_SIZE, paging.RODATA)
        uc.phys_write(PHYS_BOOT, BOOT_GDT)
        self.tables.enable()
        uc.reg_write(X.UC_X86_REG_GDTR, (0, BOOT_BASE, len(BOOT_GDT) - 1, 0))
        uc.reg_write(X.UC_X86_REG_CS, KERNEL_CS)
        for seg in (X.UC_X86_REG_SS, X.UC_X86_REG_DS, X.UC_X86_REG_ES):
            uc.reg_write(seg, KERNEL_DS)
        uc.reg_write(X.UC_X86_REG_EFLAGS, 0x2)
        uc.reg_write(X.UC_X86_REG_RIP, entry)

    # ---- the demand region: frames for the kernel's #PF handler -----------------------------------------------

    def alloc_frame(self) -> int:
        """A zeroed page frame for the kernel to map in its demand region (0 if none is left)."""
        if not self._free_frames:
            return 0
        frame = self._free_frames.pop()
        self.uc.phys_write(frame, bytes(PAGE_SIZE))
        self.frames_in_use += 1
        return frame

    def free_frame(self, frame: int) -> bool:
        """The kernel gives a frame back (after clearing its entry and invalidating its TLB entry)."""
        if not PHYS_DEMAND <= frame < PHYS_DEMAND + PHYS_DEMAND_SIZE or frame & (PAGE_SIZE - 1) or (
                frame in self._free_frames):
            return False
        self._free_frames.append(frame)
        self.frames_in_use -= 1
        return True

    @property
    def demand_pages(self) -> set[int]:
        """Pages of the demand region the kernel has made present (read from its page table)."""
        table = self.tables.entry_address(DEMAND_BASE)
        entries = struct.unpack(f"<{DEMAND_SIZE // PAGE_SIZE}Q", self.uc.phys_read(table, 8 * (DEMAND_SIZE // PAGE_SIZE)))
        return {DEMAND_BASE + i * PAGE_SIZE for i, entry in enumerate(entries) if entry & paging.PTE_PRESENT}

    def page_present(self, address: int) -> bool:
        """Does the page holding `address` translate (as the kernel's tables say)?"""
        return self.tables.translate(address) is not None

    def executable(self, address: int) -> bool:
        """Is the page holding `address` present and executable?"""
        entry = self.tables.walk(page_floor(address))
        return entry is not None and not entry & paging.PTE_NX

    def remove_cache(self, address: int, length: int) -> None:
        """Drop translated code over [address, address + length) after the host changed it. Only for executable
        pages: unicorn finds the code through an instruction fetch, which on any other page fails and leaves a
        #PF in flight."""
        if length > 0 and self.executable(address) and self.executable(address + length - 1):
            self.uc.ctl_remove_cache(address, address + length)

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
            low, selector, _ist, attr, middle, high, _ = struct.unpack("<HHBBHII", uc.mem_read(base + vector * 16, 16))
        except UcError:
            raise MachineError(f"vector {vector} at rip {rip:#x}: IDT at {base:#x} is not mapped") from None
        if not attr & 0x80:
            raise MachineError(f"vector {vector} at rip {rip:#x}: no handler (IDT gate not present)")
        rsp = regs.read(X.UC_X86_REG_RSP)
        rflags = regs.read(X.UC_X86_REG_EFLAGS)
        cs = regs.read(X.UC_X86_REG_CS)
        frame = struct.pack("<5Q", rip, cs, rflags, rsp, regs.read(X.UC_X86_REG_SS))
        if error_code is not None:
            frame = struct.pack("<Q", error_code) + frame
        from_user = bool(cs & 3)  # to ring 0 on the stack in the TSS's rsp0 (syscall_entry.py)
        stack = self.syscall_entry.ring0_stack() if from_user else rsp
        new_rsp = (stack & ~0xF) - len(frame)  # 64-bit mode aligns the frame to 16 bytes
        try:
            uc.mem_write(new_rsp, frame)
        except UcError:
            raise MachineError(f"vector {vector} at rip {rip:#x}: cannot push the frame at rsp {rsp:#x}") from None
        rflags &= ~(EFLAGS_TF | EFLAGS_NT | EFLAGS_RF)
        if attr & 0xF == 0xE:  # interrupt gate, as opposed to a trap gate
            rflags &= ~EFLAGS_IF
        if from_user:
            self.syscall_entry.enter_ring0(selector, 0)
        regs.write(X.UC_X86_REG_RSP, new_rsp)
        regs.write(X.UC_X86_REG_EFLAGS, rflags)
        regs.write(X.UC_X86_REG_RIP, low | middle << 16 | high << 32)
        self.delivered[vector] += 1

    # ---- hooks (run on the CPU thread, inside emu_start) ---------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self.uc.emu_stop()

    def _on_interrupt(self, uc: Uc, intno: int, _data: object) -> None:
        try:
            if intno == 1 and self.debug_trap is not None:
                self.debug_trap(uc)
                return
            if intno == 3:
                address = self.regs.read(X.UC_X86_REG_RIP) - 1
                handler = self.breakpoints.get(address)
                if handler is not None:
                    self.breakpoint_hits += 1
                    uc.reg_write(X.UC_X86_REG_RIP, address)
                    handler(uc)
                    return
                target = self.jumps.target(address)
                if target is not None:  # the native dispatch is off (no W+X pages): same effect, in Python
                    self.breakpoint_hits += 1
                    uc.reg_write(X.UC_X86_REG_RIP, target)
                    return
            if intno in (PAGE_FAULT, GENERAL_PROTECTION):
                self._memory_fault(intno)
                return
            self.deliver(intno, 0 if intno in ERROR_CODE_VECTORS else None)
            if intno in CONTRIBUTORY_VECTORS:
                self._forget_exception_in_flight()
        except BaseException as error:  # noqa: BLE001 - surfaced by run()
            self._fail(error)

    def _memory_fault(self, vector: int) -> None:
        """A #PF from the MMU (RIP at the faulting instruction, CR2 set) or a #GP (a non-canonical address):
        the fault-fixup table for stub code, else the kernel's handler through the IDT."""
        error_code = self._forget_exception_in_flight(read_error_code=vector == PAGE_FAULT)
        rip = self.regs.read(X.UC_X86_REG_RIP)
        handler = self.fault_fixups.find(rip)
        if handler is not None:
            self.fixup_hits += 1
            if vector == PAGE_FAULT:
                address = self.regs.read(X.UC_X86_REG_CR2)
            else:
                address = memory_operand_address(self.uc, rip)
            handler(self.uc, address)
            return
        self.deliver(vector, error_code if vector == PAGE_FAULT else 0)

    def _forget_exception_in_flight(self, read_error_code: bool = False) -> int:
        """We delivered the exception, so QEMU must stop treating it as in flight (see uc_native.old_exception_offset).
        With read_error_code, also returns the #PF error code QEMU computed (same context trip)."""
        offset = old_exception_offset()
        code_offset = page_fault_error_offset() if read_error_code else None
        if offset is None and code_offset is None:
            return 0
        context = self.uc.context_save()
        address = ctypes.cast(context.context, ctypes.c_void_p).value
        error_code = ctypes.c_uint32.from_address(address + code_offset).value if code_offset is not None else 0
        if offset is not None:
            ctypes.c_int32.from_address(address + offset).value = -1
            self.uc.context_restore(context)
        return error_code

    def _on_invalid(self, uc: Uc, _data: object) -> bool:
        try:
            self.deliver(6)
            return True
        except BaseException as error:  # noqa: BLE001
            self._fail(error)
            return False

    def _on_bad_access(self, uc: Uc, access: int, address: int, size: int, value: int, _data: object) -> bool:
        """An access the page tables allowed but no physical memory backs (a bad entry): stops emulation."""
        self._fault = (access, address)
        return False

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
        """Run from RIP until hlt, a stop request, `until`, `count` instructions, or a bad physical access.

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
        if until != NO_EXIT:
            if not self.executable(until - 1):
                # when the run ends, unicorn looks up the code at until - 1 by an instruction fetch: anywhere
                # else that fetch faults, and the fault is taken as a #PF by the next run
                raise MachineError(f"exit address {until:#x}: the byte before it is not executable code")
            uc.ctl_set_exits([until])
        self._in_emulation = True
        try:
            uc.emu_start(begin, until, 0, count)
        except UcError as error:
            failure = error
        finally:
            self._in_emulation = False
            if until != NO_EXIT:
                uc.ctl_set_exits([])
        if self.after_run is not None and failure is None and self._error is None and self._fault is None:
            try:
                self.after_run(uc)
            except BaseException as error:  # noqa: BLE001 - surfaced below, as a hook's
                self._error = error
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
        """An access to unbacked physical memory stopped emulation with RIP at the faulting instruction: the
        fixup table, else a #PF (present: the entry exists) for the kernel."""
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
        self.deliver(PAGE_FAULT, int(present) | int(write) << 1 | int(fetch) << 4)

    def read_byte(self, address: int) -> int | None:
        try:
            return self.uc.mem_read(address, 1)[0]
        except UcError:
            return None
