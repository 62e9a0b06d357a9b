"""The `syscall` instruction made architectural, and the privilege change of an interrupt from user mode.

Owns the two places where the machine moves a CPU from ring 3 to ring 0, which unicorn 2.1 does not do itself:

- `syscall`: unicorn runs it as a no-op unless a UC_HOOK_INSN hook takes it (RIP moves on; RCX and R11 are left
  alone), then adds the instruction's length to whatever RIP the hook wrote. `SyscallEntry` installs a hook whose
  callback is machine code (no Python per call, like the machine's native interrupt hook) doing what the CPU
  does: RCX = the next instruction, R11 = RFLAGS, RFLAGS &= ~MSR_SYSCALL_MASK, CS = STAR[47:32] and SS = CS + 8
  (descriptors from the GDT, CPL 0), RIP = MSR_LSTAR (written as LSTAR - 2; then unicorn's "PC written by a
  hook" flag cleared: uc_native.pc_sync_flag_offset). `swapgs` stays the kernel entry's own instruction (unicorn
  runs it). `sysretq` needs nothing: unicorn runs it architecturally.
- an interrupt or exception delivered while the CPU is in user mode (cpu.py `deliver`): the frame goes on the
  stack in the TSS's rsp0, CS comes from the gate, SS is the null selector (`ring0_stack`, `enter_ring0`).

Unicorn's register API refuses to load a DPL-0 CS or SS while the CPU is at CPL 3 (its own privilege checks), and
nothing else in its API sets the CPL, which QEMU keeps in the low two bits of CPUX86State.hflags. So the CPL is
cleared in the CPU's state itself, then CS and SS are loaded through the API, which then passes its checks and
fills the descriptor caches (and the CPL again, from SS) as a real segment load. Where that field lives is found
by experiment, as uc_native finds QEMU's other unreachable fields: `cpu_state_address` looks for the live
registers (set to a pattern of that call) behind the pointers of the engine's handle, `hflags_offset` runs
`sysretq` on a scratch CPU and takes the one field whose low two bits went from 0 to 3.

Runs on the CPU thread (the hook inside emulation; `enter_ring0` from the interrupt hook).
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import os
import struct

from unicorn import UC_ARCH_X86, UC_HOOK_INSN, UC_MODE_64, Uc
from unicorn import x86_const as X
from unicorn.unicorn_py3.arch.types import uc_hook_h
from unicorn.unicorn_py3.unicorn import HOOK_CODE_CFUNC

from ..uc_native import (
    clear_pc_sync_flag,
    handle,
    lib,
    native_function,
    pc_sync_flag_address,
    readable_ranges,
)

MSR_EFER = 0xC000_0080
MSR_STAR = 0xC000_0081
MSR_LSTAR = 0xC000_0082
MSR_SYSCALL_MASK = 0xC000_0084
MSR_KERNEL_GS_BASE = 0xC000_0102
EFER_SCE = 1 << 0
CPL_MASK = 0x3
#: the general registers in CPUX86State.regs order (rax rcx rdx rbx rsp rbp rsi rdi r8..r15)
_GPRS = (X.UC_X86_REG_RAX, X.UC_X86_REG_RCX, X.UC_X86_REG_RDX, X.UC_X86_REG_RBX, X.UC_X86_REG_RSP,
         X.UC_X86_REG_RBP, X.UC_X86_REG_RSI, X.UC_X86_REG_RDI) + tuple(
    getattr(X, f"UC_X86_REG_R{i}") for i in range(8, 16))
_SEARCH = 0x40000  #: bytes searched behind each pointer of the handle for the CPU's state


def cpu_state_address(uc: Uc) -> int | None:
    """Host address of the CPU's CPUX86State (its first field: the 16 general registers), None if not found.
    Searches only readable host memory (/proc/self/maps) behind the pointers in the engine's handle, and checks
    the find by changing a register."""
    saved = [uc.reg_read(reg) for reg in _GPRS]
    # a pattern of this call only: a freed engine's state, still in the host's heap, holds an earlier call's
    nonce = int.from_bytes(os.urandom(6), "little") << 16
    pattern = [nonce | i * 0x1111 for i in range(len(_GPRS))]
    try:
        for reg, value in zip(_GPRS, pattern):
            uc.reg_write(reg, value)
        wanted = struct.pack(f"<{len(pattern)}Q", *pattern)
        ranges = sorted(readable_ranges())
        starts = [lo for lo, _ in ranges]

        def within(address: int) -> tuple[int, int] | None:
            i = bisect.bisect_right(starts, address) - 1  # the host has hundreds of mappings, the handle 512 words
            return ranges[i] if i >= 0 and address < ranges[i][1] else None

        base = ctypes.cast(handle(uc), ctypes.c_void_p).value
        span = within(base)
        if span is None:
            return None
        words = ctypes.string_at(base, min(4096, span[1] - base))
        for (pointer,) in struct.iter_unpack("<Q", words[: len(words) // 8 * 8]):
            span = within(pointer)
            if span is None:
                continue
            blob = ctypes.string_at(pointer, min(span[1], pointer + _SEARCH) - pointer)
            at = blob.find(wanted)
            while at >= 0:  # every aligned copy: the live one is the one that follows a register write
                if at % 8 == 0:
                    found = pointer + at
                    uc.reg_write(X.UC_X86_REG_RAX, ~nonce & 0xFFFF_FFFF_FFFF_FFFF)
                    live = ctypes.c_uint64.from_address(found).value == ~nonce & 0xFFFF_FFFF_FFFF_FFFF
                    uc.reg_write(X.UC_X86_REG_RAX, pattern[0])
                    if live:
                        return found
                at = blob.find(wanted, at + 1)
    finally:
        for reg, value in zip(_GPRS, saved):
            uc.reg_write(reg, value)
    return None


@functools.cache
def hflags_offset() -> int | None:
    """Offset of CPUX86State.hflags: the one 32-bit field whose low bits (the CPL) go from 0 to 3, the rest kept,
    when a scratch CPU leaves ring 0 by `sysretq`, in two runs from different addresses and registers (one run can
    show another field changing that way by chance: the host's memory beside the state, an address ending in 0
    that became one ending in 3), so the find does not depend on the host's memory layout."""
    for attempt in range(5):  # fresh scratch CPUs each time: another host layout around them
        found: set[int] | None = None
        for entry, seed in ((0x2000 + 0x40 * attempt, 0x1111 + attempt), (0x2A40, 0x7777 * (attempt + 1))):
            candidates = _cpl_candidates(entry, seed)
            found = set() if candidates is None else candidates if found is None else found & candidates
        if found is not None and len(found) == 1:
            return min(found)
    return None


def _cpl_candidates(entry: int, seed: int) -> set[int] | None:
    """The offsets in the CPU state of the 32-bit fields that went from CPL 0 to CPL 3 (low two bits) when a
    scratch CPU ran `sysretq` at `entry` with general registers derived from `seed`; None if the state or the
    transition could not be seen."""
    uc = Uc(UC_ARCH_X86, UC_MODE_64)
    uc.mem_map(0, 0x4000)
    gdt = struct.pack("<7Q", 0, 0x00AF9B000000FFFF, 0x00CF93000000FFFF, 0, 0x00CFFB000000FFFF,
                      0x00CFF3000000FFFF, 0x00AFFB000000FFFF)
    uc.mem_write(0x1000, gdt)
    uc.reg_write(X.UC_X86_REG_GDTR, (0, 0x1000, len(gdt) - 1, 0))
    uc.reg_write(X.UC_X86_REG_CS, 0x08)
    uc.reg_write(X.UC_X86_REG_SS, 0x10)
    uc.msr_write(MSR_EFER, uc.msr_read(MSR_EFER) | EFER_SCE)
    uc.msr_write(MSR_STAR, 0x23 << 48 | 0x08 << 32)
    state = cpu_state_address(uc)
    if state is None:
        return None
    for index, reg in enumerate((X.UC_X86_REG_RBX, X.UC_X86_REG_RSI, X.UC_X86_REG_RDI, X.UC_X86_REG_R12)):
        uc.reg_write(reg, seed * (index + 1))
    size = 0x4000
    before = ctypes.string_at(state, size)
    uc.mem_write(entry, bytes.fromhex("480f07") + bytes.fromhex("90" * 8))  # sysretq to entry + 3: nops
    uc.reg_write(X.UC_X86_REG_RCX, entry + 3)
    uc.reg_write(X.UC_X86_REG_R11, 0x2)
    uc.emu_start(entry, entry + 5)
    if uc.reg_read(X.UC_X86_REG_CS) & CPL_MASK != 3:
        return None
    after = ctypes.string_at(state, size)
    return {4 * i for i, (old, new) in enumerate(zip(struct.unpack(f"<{size // 4}I", before),
                                                     struct.unpack(f"<{size // 4}I", after)))
            if old & CPL_MASK == 0 and new == old | CPL_MASK}


class _Cell(ctypes.Structure):
    """What the native hook reads: libunicorn's register functions, the CPL field, a count, and scratch."""

    _fields_ = [("reg_read", ctypes.c_uint64), ("reg_write", ctypes.c_uint64), ("hflags", ctypes.c_uint64),
                ("count", ctypes.c_uint64), ("value", ctypes.c_uint64), ("msr_id", ctypes.c_uint64),
                ("msr_value", ctypes.c_uint64)]


#: The hook: void cb(uc_engine *uc /* rdi */, _Cell *cell /* rsi */). AT&T, numbers in hex (see cpu.py).
_SOURCE = """
    push %rbx
    push %r12
    push %r13
    push %r14
    push %r15
    mov %rdi, %rbx
    mov %rsi, %r12
    incq 0x18(%r12)
    mov $RIP, %esi
    call get
    lea 0x2(%rax), %r13
    mov $EFLAGS, %esi
    call get
    mov %rax, %r14
    mov %r13, %rax
    mov $RCX, %esi
    call set
    mov %r14, %rax
    mov $R11, %esi
    call set
    mov $0xc0000084, %eax
    call msr
    not %rax
    and %r14, %rax
    mov $EFLAGS, %esi
    call set
    mov 0x10(%r12), %rax
    andl $0xfffffffc, (%rax)
    mov $0xc0000081, %eax
    call msr
    shr $0x20, %rax
    and $0xfffc, %eax
    mov %rax, %r15
    mov $CS, %esi
    call set
    lea 0x8(%r15), %rax
    mov $SS, %esi
    call set
    mov $0xc0000082, %eax
    call msr
    sub $0x2, %rax
    mov $RIP, %esi
    call set
    CLEAR_PC_SYNC_FLAG
    pop %r15
    pop %r14
    pop %r13
    pop %r12
    pop %rbx
    ret
get:
    sub $0x8, %rsp
    mov %rbx, %rdi
    lea 0x20(%r12), %rdx
    call *(%r12)
    mov 0x20(%r12), %rax
    add $0x8, %rsp
    ret
set:
    sub $0x8, %rsp
    mov %rax, 0x20(%r12)
    mov %rbx, %rdi
    lea 0x20(%r12), %rdx
    call *0x8(%r12)
    add $0x8, %rsp
    ret
msr:
    sub $0x8, %rsp
    mov %rax, 0x28(%r12)
    mov %rbx, %rdi
    mov $MSR, %esi
    lea 0x28(%r12), %rdx
    call *(%r12)
    mov 0x30(%r12), %rax
    add $0x8, %rsp
    ret
"""


#: the registers _SOURCE names by unicorn's numbers
_REGISTERS = ("RIP", "EFLAGS", "RCX", "R11", "MSR", "CS", "SS")
#: _SOURCE assembled (`dispatch.hook_source(_SOURCE, _REGISTERS)`; tests/machine/test_syscall_entry.py checks them)
_CODE = bytes.fromhex(
    "5341544155415641574889fb4989f449ff442418be29000000e8a40000004c8d6802be19000000e8960000004989c64c89e8"
    "be26000000e8a00000004c89f0be6d000000e893000000b8840000c0e8a400000048f7d04c21f0be19000000e87900000049"
    "8b4424108320fcb8810000c0e88200000048c1e82025fcff00004989c7be0b000000e851000000498d4708be31000000e843"
    "000000b8820000c0e8540000004883e802be29000000e82b000000c683ffffff7f00415f415e415d415c5bc34883ec084889"
    "df498d54242041ff1424498b4424204883c408c34883ec0849894424204889df498d54242041ff5424084883c408c34883ec"
    "0849894424284889dfbef8000000498d54242841ff1424498b4424304883c408c3"
)


@functools.cache
def _hook_code() -> bytes:
    from .dispatch import fill_pc_sync_slot

    return fill_pc_sync_slot(_CODE)  # the flag cleared after the RIP write: see uc_native (rbx is the engine)


class PrivilegeUnavailable(RuntimeError):
    """This unicorn's CPU state could not be found: processes cannot run (the kernel's threads still do)."""


class SyscallEntry:
    """The native `syscall` hook of one unicorn instance, and `enter_ring0` for interrupts from user mode."""

    def __init__(self, uc: Uc) -> None:
        self._uc = uc
        state = cpu_state_address(uc)
        offset = hflags_offset()
        self.available = state is not None and offset is not None
        self._hflags = ctypes.c_uint32.from_address(state + offset) if self.available else None
        self._cell = _Cell(ctypes.cast(lib.uc_reg_read, ctypes.c_void_p).value,
                           ctypes.cast(lib.uc_reg_write, ctypes.c_void_p).value,
                           state + offset if self.available else 0)
        self._hook = uc_hook_h()
        self._pc_sync_flag = pc_sync_flag_address(uc)
        self.native = False
        if not self.available:
            return
        address = native_function(_hook_code())
        if address is not None:
            status = lib.uc_hook_add(handle(uc), ctypes.byref(self._hook), UC_HOOK_INSN,
                                     ctypes.cast(address, HOOK_CODE_CFUNC), ctypes.cast(
                                         ctypes.addressof(self._cell), ctypes.c_void_p),
                                     ctypes.c_uint64(1), ctypes.c_uint64(0), ctypes.c_int(X.UC_X86_INS_SYSCALL))
            self.native = status == 0
        if not self.native:  # no W+X host pages: the same steps in Python
            uc.hook_add(UC_HOOK_INSN, self._python_syscall, None, 1, 0, X.UC_X86_INS_SYSCALL)

    @property
    def count(self) -> int:
        """`syscall` instructions taken (the native hook counts them)."""
        return self._cell.count

    def _python_syscall(self, uc: Uc, _data: object) -> None:
        self._cell.count += 1
        rip = uc.reg_read(X.UC_X86_REG_RIP)
        rflags = uc.reg_read(X.UC_X86_REG_EFLAGS)
        uc.reg_write(X.UC_X86_REG_RCX, rip + 2)
        uc.reg_write(X.UC_X86_REG_R11, rflags)
        uc.reg_write(X.UC_X86_REG_EFLAGS, rflags & ~uc.msr_read(MSR_SYSCALL_MASK))
        star = uc.msr_read(MSR_STAR) >> 32 & 0xFFFC
        self.enter_ring0(star, star + 8)
        uc.reg_write(X.UC_X86_REG_RIP, uc.msr_read(MSR_LSTAR) - 2)
        clear_pc_sync_flag(self._pc_sync_flag)

    def enter_ring0(self, cs: int, ss: int) -> None:
        """CPL 0, then CS and SS loaded (descriptors from the GDT; ss 0: the null selector of an interrupt)."""
        if self._hflags is None:
            raise PrivilegeUnavailable("the CPU's privilege level cannot be changed on this unicorn")
        self._hflags.value &= ~CPL_MASK
        self._uc.reg_write(X.UC_X86_REG_CS, cs)
        self._uc.reg_write(X.UC_X86_REG_SS, ss)

    def ring0_stack(self) -> int:
        """The stack an interrupt from user mode switches to: rsp0 of the TSS that TR selects."""
        _selector, base, _limit, _flags = self._uc.reg_read(X.UC_X86_REG_TR)
        return int.from_bytes(self._uc.mem_read(base + 4, 8), "little")
