"""What the stub claims before the kernel's IDT sees an exception: the int3 jump table and the fault fixups.

- `InterruptDispatch`: the CPU's one UC_HOOK_INTR callback, in machine code; an int3 at an address of its table
  goes on at that address's target without any Python (the compiled engines' probes), anything else goes to the
  CPU's Python handler (cpu.py); either way it then clears unicorn's "PC written by a hook" flag, which an
  interrupt hook's RIP write would leave set (uc_native.pc_sync_flag_offset);
- `FaultFixups`: ranges of stub-generated code whose memory faults the tracer resolves (like Linux's exception
  tables), never the kernel's #PF handler.

No thread of its own: both tables change on the CPU thread, never while one of its lookups runs, and are read
on it inside emulation.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Callable

from unicorn import UC_HOOK_INTR, Uc
from unicorn import x86_const as X
from unicorn.unicorn_py3.unicorn import HOOK_INTR_CFUNC

from ..uc_native import add_native_hook, clear_pc_sync_flag, lib, pc_sync_flag_address, pc_sync_flag_offset
from .errors import MachineError

FaultHandler = Callable[[Uc, int], None]


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


class _JumpCell(ctypes.Structure):
    _fields_ = [("python", ctypes.c_uint64), ("reg_read", ctypes.c_uint64), ("reg_write", ctypes.c_uint64),
                ("hits", ctypes.c_uint64), ("mask", ctypes.c_uint64)]


_SLOT_WORDS = 4  #: a table slot: the int3's address, its target, the address space it is for (0: any), unused


class InterruptDispatch:
    """The CPU's one UC_HOOK_INTR callback, in machine code: an int3 at an address of the jump table goes on at that
    address's target without any Python (the compiled engines' int3 probes enter their detours this way, as the
    jump probes do); anything else is handed to the Python handler, with the same arguments.

    An entry may name an address space (its page-table root): a program's int3 (a compiled hit of a tracepoint in a
    program, tracing/engines/userprobes.py) goes on natively only when the CPU has that space loaded and is not
    single-stepping (EFLAGS.TF: a debugger's step, which the Python handler finishes); another space's int3 at that
    address, or a stepped one, goes to the Python handler.

    The table is open addressing with linear probing in host memory (address 0: empty slot), indexed by the int3's
    address modulo its size; entries change only on the CPU thread between runs (`set`, `remove`), when no
    callback can be reading it. Without W+X host pages the Python handler is the hook and looks the table up
    itself.
    """

    SLOTS = 0x2000  # a power of two: ten thousand probes stay well under half full
    #: the registers SOURCE names by unicorn's numbers
    REGISTERS = ("RIP", "CR3", "EFLAGS")
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
        shl $0x5, %r13
        lea 0x28(%r12,%r13), %r13
        mov (%r13), %rdx
        test %rdx, %rdx
        je miss
        cmp %rax, %rdx
        je found
        inc %rcx
        and 0x20(%r12), %rcx
        jmp probe
    found:
        cmpq $0x0, 0x10(%r13)
        je hit
        mov %rbx, %rdi
        mov $CR3, %esi
        lea 0x8(%rsp), %rdx
        call *0x8(%r12)
        mov 0x8(%rsp), %rax
        and $-0x1000, %rax
        cmp 0x10(%r13), %rax
        jne miss
        movq $0x0, 0x8(%rsp)
        mov %rbx, %rdi
        mov $EFLAGS, %esi
        lea 0x8(%rsp), %rdx
        call *0x8(%r12)
        testl $0x100, 0x8(%rsp)
        jne miss
    hit:
        mov 0x8(%r13), %rax
        mov %rax, (%rsp)
        incq 0x18(%r12)
        mov %rbx, %rdi
        mov $RIP, %esi
        mov %rsp, %rdx
        call *0x10(%r12)
        CLEAR_PC_SYNC_FLAG
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
    #: SOURCE assembled (`hook_source(SOURCE, REGISTERS)`; tests/machine/test_interrupt_dispatch.py checks them)
    CODE = bytes.fromhex(
        "83fe030f85e400000053415441554883ec104889fb4989d4be290000004889e241ff542408488b042448ffc84889c149234c"
        "24204989cd49c1e5054f8d6c2c28498b55004885d20f848c0000004839c2740a48ffc149234c2420ebd849837d1000744848"
        "89dfbe35000000488d54240841ff542408488b442408482500f0ffff493b4510755348c7442408000000004889dfbe190000"
        "00488d54240841ff542408f744240800010000752e498b45084889042449ff4424184889dfbe290000004889e241ff542410"
        "c683ffffff7f004883c410415d415c5bc34889dfbe030000004c89e24883c410415d415c5bff22"
    )

    def __init__(self, uc: Uc, handler: Callable[[Uc, int, object], None]) -> None:
        self.table: dict[int, int] = {}
        memory = (ctypes.c_uint64 * (5 + _SLOT_WORDS * self.SLOTS))()
        self._memory = memory
        self._cell = _JumpCell.from_buffer(memory)
        self._slots = ctypes.cast(ctypes.addressof(memory) + ctypes.sizeof(_JumpCell),
                                  ctypes.POINTER(ctypes.c_uint64))
        flag = pc_sync_flag_address(uc)

        def python(_uc: object, intno: int, _data: object) -> None:
            handler(uc, intno, None)
            clear_pc_sync_flag(flag)  # the handler may have written RIP (uc_native: memory hooks then see it)

        self._python = HOOK_INTR_CFUNC(python)
        self._cell.python = ctypes.cast(self._python, ctypes.c_void_p).value
        self._cell.reg_read = ctypes.cast(lib.uc_reg_read, ctypes.c_void_p).value
        self._cell.reg_write = ctypes.cast(lib.uc_reg_write, ctypes.c_void_p).value
        self._cell.mask = self.SLOTS - 1
        # the flag cleared after its RIP write, as `python` does
        self.native = add_native_hook(uc, UC_HOOK_INTR, fill_pc_sync_slot(self.CODE),
                                      ctypes.addressof(memory)) is not None
        if not self.native:
            uc.hook_add(UC_HOOK_INTR, python)

    @property
    def hits(self) -> int:
        """int3s sent on natively."""
        return self._cell.hits

    def target(self, address: int) -> int | None:
        return self.table.get(address)

    def set(self, address: int, target: int, space: int = 0) -> None:
        """An int3 at `address` goes on at `target`; with `space` (a page-table root), only in that address space
        and not under single-stepping (else to the Python handler)."""
        if address not in self.table and len(self.table) >= self.SLOTS // 2:
            raise MachineError(f"more than {self.SLOTS // 2} int3 probes")
        self.table[address] = target
        at = _SLOT_WORDS * self._find(address)
        self._slots[at], self._slots[at + 1], self._slots[at + 2] = address, target, space

    def remove(self, address: int) -> None:
        if self.table.pop(address, None) is None:
            return
        # backward-shift deletion keeps every other entry reachable from its home slot
        mask = self.SLOTS - 1
        hole = self._find(address)
        index = hole
        while True:
            index = (index + 1) & mask
            key = self._slots[_SLOT_WORDS * index]
            if key == 0:
                break
            home = key & mask
            if (index - home) & mask >= (index - hole) & mask:
                for word in range(_SLOT_WORDS):
                    self._slots[_SLOT_WORDS * hole + word] = self._slots[_SLOT_WORDS * index + word]
                hole = index
        for word in range(_SLOT_WORDS):
            self._slots[_SLOT_WORDS * hole + word] = 0

    def _find(self, address: int) -> int:
        """The slot holding `address`, or the empty slot where it goes."""
        index = address & (self.SLOTS - 1)
        while self._slots[_SLOT_WORDS * index] not in (0, address):
            index = (index + 1) & (self.SLOTS - 1)
        return index


#: A native hook's source says CLEAR_PC_SYNC_FLAG where it stores 0 in unicorn's PC-sync flag after writing RIP
#: (uc_native.pc_sync_flag_offset, an offset in the engine, which the hook holds in %rbx): its committed bytes hold
#: this slot there, the store with a 32-bit displacement whatever the offset, filled when the hook is installed.
PC_SYNC_SLOT_SOURCE = "movb $0x0, 0x7fffffff(%rbx)"
PC_SYNC_SLOT = bytes.fromhex("c683ffffff7f00")
_NOP7 = bytes.fromhex("0f1f8000000000")  # nopl 0x0(%rax): the slot where the flag was not found


def hook_source(source: str, registers: tuple[str, ...]) -> str:
    """A native hook's AT&T source as its committed bytes are assembled from it: each `$NAME,` of `registers` as
    unicorn's number for register NAME, CLEAR_PC_SYNC_FLAG as the slot."""
    for name in registers:
        source = source.replace(f"${name},", f"${getattr(X, f'UC_X86_REG_{name}'):#x},")
    return source.replace("CLEAR_PC_SYNC_FLAG", PC_SYNC_SLOT_SOURCE)


def fill_pc_sync_slot(code: bytes) -> bytes:
    """A native hook's committed bytes with the slot filled: the store at the flag's offset, or a 7-byte nop where
    the flag was not found. The bytes are committed, not assembled at each start: keystone's import and library
    took more of `kgtp-sim run` than the rest of building the CPU."""
    if code.count(PC_SYNC_SLOT) != 1:
        raise MachineError("native hook code without exactly one PC-sync slot")
    offset = pc_sync_flag_offset()
    return code.replace(PC_SYNC_SLOT, _NOP7 if offset is None else PC_SYNC_SLOT[:2] + struct.pack("<i", offset) + b"\0")


def assemble(source: str) -> bytes:
    """AT&T text to x86_64 code at address 0: the native hooks' sources, which tests check their committed bytes
    against, and the tests' own snippets."""
    from keystone import KS_ARCH_X86, KS_MODE_64, KS_OPT_SYNTAX_ATT, Ks

    ks = Ks(KS_ARCH_X86, KS_MODE_64)
    ks.syntax = KS_OPT_SYNTAX_ATT
    encoding, _ = ks.asm(source, 0)
    return bytes(encoding)
