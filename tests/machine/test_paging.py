"""The machine on its own page tables: unicorn's default TLB, CR0.PG, permissions in the entries, demand paging
through the MMU and the kernel's handler, the debugger's view through the tables, and counting on request."""

from __future__ import annotations

import struct

import pytest
from unicorn import x86_const as X

from kgtp_sim.machine import DEMAND_BASE, KernelImage, Machine, MachineError, MemoryFault
from kgtp_sim import uc_paging as paging
from kgtp_sim.machine.cpu import Stop
from kgtp_sim.machine.layout import MODULE_BASE, VMALLOC_BASE

from ..conftest import VMLINUX
from .test_machine import assemble, eventually


@pytest.fixture(scope="module")
def image() -> KernelImage:
    return KernelImage.load(VMLINUX)


def booted(image: KernelImage) -> Machine:
    machine = Machine(image)
    for _ in range(100):
        if machine.cpu.run() is Stop.HALT:
            return machine
    raise AssertionError("the kernel did not reach its idle loop")


def test_the_kernel_runs_with_paging_on_and_no_memory_at_its_virtual_addresses(image):
    machine = booted(image)
    uc = machine.uc
    assert uc.reg_read(X.UC_X86_REG_CR0) & paging.CR0_PG and uc.reg_read(X.UC_X86_REG_CR0) & paging.CR0_WP
    assert uc.reg_read(X.UC_X86_REG_CR4) & paging.CR4_PAE
    efer = uc.msr_read(paging.MSR_EFER)
    assert efer & paging.EFER_LME and efer & paging.EFER_LMA and efer & paging.EFER_NXE
    assert uc.reg_read(X.UC_X86_REG_CR3) == machine.cpu.tables.pml4
    # unicorn's memory is physical and low: the kernel at 0xffffffff81000000 runs only through the tables
    assert all(end < 1 << 32 for _begin, end, _perms in uc.mem_regions())
    assert machine.read_symbol("jiffies") == 0 and "41 tasks, 1 CPUs" in machine.console_text()


def test_entries_give_text_read_execute_data_no_execute(image):
    machine = Machine(image)
    tables = machine.cpu.tables
    text = tables.walk(image.address_of("kgtp_test_function"))
    data = tables.walk(image.address_of("kgtp_counter"))
    rodata = tables.walk(image.address_of("__start_kgtp_markers"))
    assert text & paging.PTE_PRESENT and not text & paging.PTE_RW and not text & paging.PTE_NX
    assert data & paging.PTE_RW and data & paging.PTE_NX
    assert not rodata & paging.PTE_RW and rodata & paging.PTE_NX
    code, buffer = machine.alloc_code(16), machine.alloc_data(16)
    assert not tables.walk(code) & paging.PTE_NX and tables.walk(buffer) & paging.PTE_NX
    # module and vmalloc space are mapped as the stub allocates them
    assert tables.walk(MODULE_BASE + (32 << 20)) is None and tables.walk(VMALLOC_BASE + (128 << 20)) is None
    assert tables.walk(DEMAND_BASE) is None  # not present until the kernel touches it


def test_a_kernel_write_to_its_text_is_a_protection_fault(image):
    machine = booted(image)
    code = machine.alloc_code(32)
    target = image.address_of("kgtp_test_function")
    machine.write_memory(code, assemble(f"mov rax, {target:#x}; mov byte ptr [rax], 0x90; ret", code))
    with pytest.raises(MachineError, match="hlt"):  # the kernel panics: not a page it can fix
        machine.call(code)
    assert f"page fault at {target:x}" in machine.console_text() and "error 3" in machine.console_text()


def test_a_not_present_page_faults_through_the_kernel_handler_which_fills_its_entry(image):
    machine = booted(image)
    page = DEMAND_BASE + 0x5000
    code = machine.alloc_code(32)
    machine.write_memory(code, assemble("mov qword ptr [rdi + 0x10], rsi; mov rax, qword ptr [rdi + 0x10]; ret", code))
    entry = machine.cpu.tables.entry_address(page)
    assert machine.uc.phys_read(entry, 8) == bytes(8)
    faults = machine.read_symbol("nr_page_faults")
    assert machine.call(code, page, 0x1234) == 0x1234
    assert machine.read_symbol("nr_page_faults") == faults + 1 == machine.stats().page_faults
    pte = int.from_bytes(machine.uc.phys_read(entry, 8), "little")
    assert pte & paging.PTE_PRESENT and pte & paging.PTE_RW and pte & paging.PTE_NX  # written by do_anonymous_page
    assert machine.stats().demand_pages_mapped == 1
    assert struct.unpack("<Q", machine.read_memory(page + 0x10, 8))[0] == 0x1234


def test_a_debugger_read_of_a_not_present_page_is_an_error_and_maps_nothing(image):
    machine = booted(image)
    page = DEMAND_BASE + 0x7000
    cr2 = machine.uc.reg_read(X.UC_X86_REG_CR2)
    for access in (lambda: machine.read_memory(page, 8), lambda: machine.write_memory(page, b"x"),
                   lambda: machine.read_memory(page - 4, 8)):  # also a read straddling into it
        with pytest.raises(MemoryFault):
            access()
    assert machine.cpu.tables.walk(page) is None and machine.stats().demand_pages_mapped == 0
    assert machine.stats().page_faults == 0 and machine.uc.reg_read(X.UC_X86_REG_CR2) == cr2
    with pytest.raises(MemoryFault):  # and no address outside the tables either
        machine.read_memory(0x1000, 8)


def test_counting_is_off_in_a_serving_machine_and_exact_when_asked(image):
    machine = Machine(image)
    machine.start()
    try:
        eventually(lambda: machine.stats(count=False).jiffies >= 20, "the kernel never reached 20 jiffies")
        assert not machine.counting and machine.stats(count=False).instructions == 0
        assert machine.stats().instructions == 0 and machine.counting  # `monitor stats` asks: counting from now
        eventually(lambda: machine.stats().instructions > 0, "nothing was counted")

        def counted_call(_uc):  # on the CPU thread: the kernel runs nothing else between the two readings
            start = machine.instructions()
            assert machine.call("kgtp_bench_loop", 1000) == 1000
            return machine.instructions() - start

        # kgtp_bench_loop(N): 9 per kgtp_test_function call and 6 of its own (the counts the benchmark pins)
        assert machine.run_on_cpu(counted_call) == 9 * 1000 + 6
        machine.set_counting(False)
        frozen = machine.instructions()
        eventually(lambda: machine.stats(count=False).jiffies >= 40, "the kernel stopped")
        assert machine.instructions() == frozen
    finally:
        machine.shutdown()


@pytest.mark.parametrize("access", ["mov rax, qword ptr [rdi]", "mov qword ptr [rdi], rsi"])
def test_an_entry_to_a_frame_no_memory_backs_is_still_caught(image, access):
    """The hook for accesses to absent physical memory covers only the gaps between frames (a memory hook over
    a frame would send every store to it down the emulator's slow path): an access there still stops the
    instruction and reaches the fault fixups, with the frame's address."""
    machine = booted(image)
    last_frame_end = max(end for _begin, end, _perms in machine.uc.mem_regions())
    absent = (last_frame_end + 1 + 0xFFFF) & ~0xFFFF  # a physical page above every frame
    page = VMALLOC_BASE + (200 << 20)
    machine.cpu.tables.map(page, absent, 0x1000, paging.DATA)
    code = machine.alloc_code(32)
    machine.write_memory(code, assemble(f"{access}; mov rax, 7; ret", code))
    seen = []
    machine.cpu.fault_fixups.add(code, code + 32, lambda uc, address: (seen.append(address),
                                                                       uc.reg_write(X.UC_X86_REG_RIP, code + 3)))
    assert machine.call(code, page + 0x10, 5) == 7
    assert seen == [absent + 0x10]


def test_a_detours_counters_page_is_data_and_reused_pages_are_code_again(image):
    machine = Machine(image)
    tables = machine.cpu.tables
    address = machine.alloc_code(0x80, data_pages=1)
    assert address % 0x1000 == 0
    assert tables.walk(address) & paging.PTE_NX and not tables.walk(address + 0x1000) & paging.PTE_NX
    machine.free_code(address)
    again = machine.alloc_code(0x3000)  # the same space, all of it code now
    assert again <= address < again + 0x3000
    assert not tables.walk(address) & paging.PTE_NX


def test_the_absent_memory_hook_covers_exactly_the_gaps_between_frames():
    from kgtp_sim.machine.cpu import _gaps

    regions = [(0x1000, 0x1FFF, 7), (0x100000, 0x2FFFFF, 7), (0x300000, 0x3FFFFF, 7)]
    assert _gaps(regions) == [(0, 0xFFF), (0x2000, 0xFFFFF), (0x400000, 2**64 - 1)]
