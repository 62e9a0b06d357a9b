"""RIP inside memory hooks after a hook wrote RIP from an interrupt or `syscall` (uc_native.pc_sync_flag_offset).

Unicorn restores RIP exactly before it calls a memory hook, unless its "PC written by a hook" flag is set; an
interrupt or instruction hook's RIP write sets it and nothing clears it until the next emu_start, so every later
memory hook of the run read the RIP of its translated block's start. The machine's data breakpoints take that RIP
for the accessing instruction and replay from it: the instructions between ran twice (on a running kernel with
watch tracepoints, a spinlock released twice and every CPU spinning). The machine's interrupt dispatch (its
native int3 table and its Python handler) and its `syscall` hook clear the flag after their write. No instruction
budget here: unicorn's counting hook would clear the flag at every instruction and hide the fault.
"""

from __future__ import annotations

import struct

import pytest
from unicorn import UC_ARCH_X86, UC_HOOK_MEM_WRITE, UC_MODE_64, Uc
from unicorn import x86_const as X

from kgtp_sim.machine.dispatch import InterruptDispatch
from kgtp_sim.machine.dispatch import assemble as _assemble
from kgtp_sim.uc_native import pc_sync_flag_offset

from .test_syscall_entry import KERNEL, START, _cpu

CODE, TARGET, DATA = 0x1000, 0x1100, 0x8000
#: at TARGET: two instructions without memory access, then two stores (their RIPs are what the hook must see)
AFTER = "lea (%rax,%rax,2), %rcx\n lea (%rcx,%rax,4), %rcx\n mov %rcx, (%rbx)\n movq $0x7, 0x8(%rbx)\n hlt"


def _store_rips(uc: Uc) -> list[int]:
    seen: list[int] = []
    uc.hook_add(UC_HOOK_MEM_WRITE, lambda uc, *_: seen.append(uc.reg_read(X.UC_X86_REG_RIP)), None, DATA,
                DATA + 0xFFF)
    return seen


def _expected(base: int) -> list[int]:
    lea = len(_assemble("lea (%rax,%rax,2), %rcx\n lea (%rcx,%rax,4), %rcx"))
    return [base + lea, base + lea + len(_assemble("mov %rcx, (%rbx)"))]


def test_the_flag_is_found():
    assert pc_sync_flag_offset() is not None


@pytest.mark.parametrize("path", ["native", "python"])
def test_stores_after_an_int3_sent_elsewhere_see_their_own_rip(path):
    uc = Uc(UC_ARCH_X86, UC_MODE_64)
    uc.mem_map(0, 0x10000)
    uc.reg_write(X.UC_X86_REG_RBX, DATA)
    uc.mem_write(CODE, b"\xcc")
    uc.mem_write(TARGET, _assemble(AFTER))

    def handler(uc: Uc, intno: int, _data: object) -> None:  # what the CPU's Python handler does with an int3
        assert intno == 3
        uc.reg_write(X.UC_X86_REG_RIP, TARGET)

    dispatch = InterruptDispatch(uc, handler)
    if path == "native":
        assert dispatch.native
        dispatch.set(CODE, TARGET)
    seen = _store_rips(uc)
    uc.emu_start(CODE, TARGET + len(_assemble(AFTER)) - 1)
    assert seen == _expected(TARGET)
    assert struct.unpack("<2Q", uc.mem_read(DATA, 16))[1] == 7


def test_stores_in_the_kernel_after_syscall_see_their_own_rip():
    stores = AFTER.rsplit("\n", 1)[0]  # the kernel side: the stores, then test_syscall_entry's sysretq
    uc, entry = _cpu(stores, 1)  # ring 3 code making one system call, LSTAR at KERNEL
    assert entry.native
    uc.reg_write(X.UC_X86_REG_RBX, DATA)
    seen = _store_rips(uc)
    uc.emu_start(START, KERNEL + len(_assemble(stores)))
    assert entry.count == 1
    assert seen == _expected(KERNEL)
