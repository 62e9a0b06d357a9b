"""`syscall` made architectural by the machine's native hook (kgtp_sim/machine/syscall_entry.py), on a scratch CPU
with a GDT of Linux's shape: ring 3 code calls, ring 0 code at LSTAR sees what the CPU hands a kernel, and
`sysretq` goes back."""

from __future__ import annotations

import struct

import pytest
from unicorn import UC_ARCH_X86, UC_MODE_64, Uc
from unicorn import x86_const as X

from kgtp_sim.machine.dispatch import assemble as _assemble
from kgtp_sim.machine.syscall_entry import (
    MSR_EFER,
    MSR_LSTAR,
    MSR_STAR,
    MSR_SYSCALL_MASK,
    SyscallEntry,
    cpu_state_address,
    hflags_offset,
)

GDT = struct.pack("<7Q", 0, 0x00AF9B000000FFFF, 0x00CF93000000FFFF, 0, 0x00CFFB000000FFFF, 0x00CFF3000000FFFF,
                  0x00AFFB000000FFFF)
USER, KERNEL, START = 0x3000, 0x4000, 0x2000


def _cpu(kernel: str, rounds: int) -> tuple[Uc, SyscallEntry]:
    uc = Uc(UC_ARCH_X86, UC_MODE_64)
    uc.mem_map(0, 0x10000)
    uc.mem_write(0x1000, GDT)
    uc.reg_write(X.UC_X86_REG_GDTR, (0, 0x1000, len(GDT) - 1, 0))
    uc.reg_write(X.UC_X86_REG_CS, 0x08)
    uc.reg_write(X.UC_X86_REG_SS, 0x10)
    uc.msr_write(MSR_EFER, uc.msr_read(MSR_EFER) | 1)
    uc.msr_write(MSR_STAR, 0x23 << 48 | 0x08 << 32)
    uc.msr_write(MSR_LSTAR, KERNEL)
    uc.msr_write(MSR_SYSCALL_MASK, 0x47700)
    entry = SyscallEntry(uc)
    # ring 3: count down r12 with a system call each round; ring 0: whatever `kernel` does, then sysretq
    uc.mem_write(USER, _assemble("top: mov $0x27, %eax\n syscall\n dec %r12\n jnz top\n nop\n nop"))
    uc.mem_write(KERNEL, _assemble(kernel + "\n sysretq"))
    uc.mem_write(START, _assemble("sysretq"))  # from ring 0 into the user code
    uc.reg_write(X.UC_X86_REG_RCX, USER)
    uc.reg_write(X.UC_X86_REG_R11, 0x202)
    uc.reg_write(X.UC_X86_REG_R12, rounds)
    return uc, entry


def test_the_cpu_state_is_found():
    uc = Uc(UC_ARCH_X86, UC_MODE_64)
    assert cpu_state_address(uc) is not None and hflags_offset() is not None


def test_the_cpu_state_of_every_engine_is_found_beside_the_others():
    """A machine has an engine per CPU, and a process may hold several machines: the other engines' states lie in
    the host's heap beside the new one's, holding what an earlier search wrote into their registers, and the
    search behind a new handle must still find the live state (with one pattern for every call and only the first
    copy behind each pointer tried, about one engine in 600 went unfound, and its CPU could never run a process:
    this test's 600 engines then missed one in each of six runs)."""
    engines, missed = [], 0
    for index in range(600):
        uc = Uc(UC_ARCH_X86, UC_MODE_64)
        uc.mem_map(0, 0x100000 * (1 + index % 7))
        engines.append(uc)
        missed += cpu_state_address(uc) is None
    assert missed == 0


def test_a_system_call_enters_ring_0_at_lstar_as_the_cpu_does():
    uc, entry = _cpu("nop", 1)
    assert entry.available and entry.native
    uc.emu_start(START, KERNEL)  # stops at the kernel's first instruction
    assert uc.reg_read(X.UC_X86_REG_CS) == 0x08 and uc.reg_read(X.UC_X86_REG_SS) == 0x10
    assert uc.reg_read(X.UC_X86_REG_RCX) == USER + 7  # the instruction after `syscall`
    assert uc.reg_read(X.UC_X86_REG_R11) & 0x200  # the user's RFLAGS, IF set
    assert not uc.reg_read(X.UC_X86_REG_EFLAGS) & 0x200  # masked by MSR_SYSCALL_MASK
    assert uc.reg_read(X.UC_X86_REG_RAX) == 0x27 and entry.count == 1


@pytest.mark.parametrize("rounds", [1, 1000])
def test_round_trips_come_back_to_ring_3(rounds):
    uc, entry = _cpu("add $1, %r13", rounds)
    uc.emu_start(START, USER + len(_assemble("top: mov $0x27, %eax\n syscall\n dec %r12\n jnz top")))
    assert uc.reg_read(X.UC_X86_REG_R13) == rounds == entry.count  # the kernel side ran once per call
    assert uc.reg_read(X.UC_X86_REG_CS) == 0x33 and uc.reg_read(X.UC_X86_REG_SS) == 0x2B  # sysretq: ring 3


def test_the_committed_hook_is_its_source_assembled():
    """The syscall hook's committed bytes are its source as keystone assembles it, unicorn's register numbers in
    (building a CPU loads no assembler)."""
    from kgtp_sim.machine import syscall_entry
    from kgtp_sim.machine.dispatch import PC_SYNC_SLOT, fill_pc_sync_slot, hook_source

    assert syscall_entry._CODE == _assemble(hook_source(syscall_entry._SOURCE, syscall_entry._REGISTERS))
    assert syscall_entry._CODE.count(PC_SYNC_SLOT) == 1
    assert syscall_entry._hook_code() == fill_pc_sync_slot(syscall_entry._CODE)
