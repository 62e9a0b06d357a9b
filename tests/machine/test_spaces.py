"""Address spaces: the kernel's is the default of every access; a new one shares the kernel half (the upper PML4
entries), has a user half of its own and a page-table window of its own, and is read, written and patched
through its own tables whichever space the CPU has loaded."""

from __future__ import annotations

import pytest
from unicorn import UcError
from unicorn import x86_const as X

from kgtp_sim import uc_paging as paging
from kgtp_sim.machine import DEMAND_BASE, AddressSpace, KernelImage, Machine, MemoryFault

from ..conftest import VMLINUX
from .test_machine import assemble
from .test_paging import booted

USER = 0x40_0000  #: a user-half page, mapped in no space until a test maps it
PAGE = 0x1000


@pytest.fixture(scope="module")
def image() -> KernelImage:
    return KernelImage.load(VMLINUX)


def _map(machine: Machine, space: AddressSpace, address: int, flags: int) -> int:
    """Map a fresh frame at `address` in `space`; returns the frame."""
    def map_page(_uc) -> int:
        frame = machine.cpu.memory.alloc_frame()
        assert frame
        space.map(address, frame, PAGE, flags)
        return frame

    return machine.run_on_cpu(map_page)


def _window(address: int) -> int:
    """Where the kernel reaches the leaf entry of `address` through the page-table window."""
    return paging.PTE_WINDOW + (address >> 9 & 0x7F_FFFF_FFF8)


def test_a_new_space_reads_the_kernel_half_as_the_kernels_space_does(image):
    machine = booted(image)
    space = machine.new_space()
    assert space.root != machine.kernel_space.root and machine.kernel_space.root == machine.uc.reg_read(
        X.UC_X86_REG_CR3)
    # made after the space: vmalloc space's first page needs a PML4 entry of its own, handed on to the space
    data = machine.alloc_data(64)
    code = machine.alloc_code(32)
    machine.write_memory(code, assemble("mov qword ptr [rdi], rsi; ret", code))
    demand = DEMAND_BASE + 0x3000
    machine.call(code, demand + 8, 0x5A5A)  # the kernel's #PF handler fills the entry after the space was made
    for address, length in ((image.address_of("kgtp_test_function"), 16), (image.address_of("jiffies"), 8),
                            (code, 16), (data, 64), (demand, 16)):
        assert machine.read_memory(address, length, space=space) == machine.read_memory(address, length)
        assert space.walk(address) == machine.kernel_space.walk(address) is not None  # through its own tables
    assert machine.read_memory(demand + 8, 8, space=space) == (0x5A5A).to_bytes(8, "little")
    machine.write_memory(data, b"shared", space=space)
    assert machine.read_memory(data, 6) == b"shared"
    with pytest.raises(ValueError, match="kernel half"):  # the shared half's tables are the kernel's to change
        machine.run_on_cpu(lambda uc: space.map(0xFFFF_C900_1000_0000, 0x200_0000, PAGE, paging.DATA))


def test_the_user_half_of_a_space_is_its_own(image):
    machine = booted(image)
    space, other = machine.new_space(), machine.new_space()
    cr2, faults = machine.uc.reg_read(X.UC_X86_REG_CR2), machine.stats().page_faults
    for where in (space, None):
        with pytest.raises(MemoryFault):
            machine.read_memory(USER, 8, space=where)
    with pytest.raises(MemoryFault):
        machine.write_memory(USER, b"x", space=space)
    assert space.walk(USER) is None  # nothing was mapped by the attempts
    frame = _map(machine, space, USER, paging.USER_DATA)
    machine.write_memory(USER + 0x10, b"process data", space=space)
    assert bytes(machine.uc.phys_read(frame + 0x10, 12)) == b"process data"  # into the space's frame
    assert machine.read_memory(USER + 0x10, 12, space=space) == b"process data"
    assert space.translate(USER + 0x10) == frame + 0x10
    for where in (None, machine.kernel_space, other):  # not in the kernel's space, nor in another process's
        with pytest.raises(MemoryFault):
            machine.read_memory(USER + 0x10, 12, space=where)
    with pytest.raises(MemoryFault):  # a read running off the mapped page
        machine.read_memory(USER + PAGE - 4, 8, space=space)
    # the CPU was left alone: no CR2, no fault delivered
    assert machine.uc.reg_read(X.UC_X86_REG_CR2) == cr2 and machine.stats().page_faults == faults


def test_each_space_sees_its_own_entries_through_the_page_table_window(image):
    machine = booted(image)
    space = machine.new_space()
    frame = _map(machine, space, USER, paging.USER_DATA)
    entry = int.from_bytes(machine.read_memory(_window(USER), 8, space=space), "little")
    assert entry == frame | paging.USER_DATA
    with pytest.raises(MemoryFault):  # the kernel's window shows the kernel's tables, which map nothing there
        machine.read_memory(_window(USER), 8)
    jiffies = image.address_of("jiffies")  # the kernel half's entries are the same through either window
    assert machine.read_memory(_window(jiffies), 8, space=space) == machine.read_memory(_window(jiffies), 8)


def test_the_cpu_reads_runs_and_sees_patches_of_the_space_cr3_holds(image):
    machine = booted(image)
    space = machine.new_space()
    _map(machine, space, USER, paging.USER_TEXT)
    machine.write_memory(USER, assemble("mov eax, 0x1; ret", USER), space=space)
    kernel_cr3 = machine.uc.reg_read(X.UC_X86_REG_CR3)

    def in_space(uc) -> tuple[int, bytes]:
        """On the CPU thread: the space loaded, as a context switch to its process would."""
        uc.reg_write(X.UC_X86_REG_CR3, space.root)
        try:
            return machine.call(USER), bytes(uc.mem_read(USER, 1))  # the host's reads follow CR3 too
        finally:
            uc.reg_write(X.UC_X86_REG_CR3, kernel_cr3)

    assert machine.run_on_cpu(in_space) == (1, b"\xb8")
    with pytest.raises(UcError):  # with the kernel's space loaded, the address means nothing
        machine.uc.mem_read(USER, 1)
    # patched while another space is loaded: the code translated when the space ran must not run again
    machine.write_memory(USER, assemble("mov eax, 0x2; ret", USER), space=space)
    assert machine.run_on_cpu(in_space) == (2, b"\xb8")
