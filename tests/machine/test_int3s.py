"""The one record of the bytes under a process's int3s (machine/int3s.py): the debugger's breakpoints and the
tracer's tracepoints at one address, set and removed in any order, over a bare unicorn memory (no machine)."""

from __future__ import annotations

import pytest
from unicorn import UC_ARCH_X86, UC_MODE_64, Uc

from kgtp_sim.machine.int3s import DEBUGGER, INT3, TRACER, Int3s

CODE = bytes(range(0x40, 0x60))
AT = 0x1004


class Space:
    """An address space of one present page at 0x1000 (physical 0), as uc_paging.AddressSpace answers."""

    def __init__(self, uc: Uc, root: int = 0x5000) -> None:
        self.uc, self.root = uc, root

    def translate(self, address: int, length: int = 1) -> int | None:
        return address - 0x1000 if 0x1000 <= address and address + length <= 0x2000 else None


@pytest.fixture
def space() -> Space:
    uc = Uc(UC_ARCH_X86, UC_MODE_64)
    uc.mem_map(0, 0x1000)
    uc.mem_write(0, CODE)
    return Space(uc)


def byte(space: Space, address: int = AT) -> int:
    return space.uc.mem_read(address - 0x1000, 1)[0]


@pytest.mark.parametrize("first, second", [(DEBUGGER, TRACER), (TRACER, DEBUGGER)])
@pytest.mark.parametrize("leaves_first", [True, False])
def test_two_holders_in_any_order_leave_the_programs_byte(space, first, second, leaves_first):
    int3s = Int3s()
    assert int3s.hold(space, AT, first) == CODE[4]
    assert int3s.hold(space, AT, second) == CODE[4]  # the byte under, never the other's int3
    assert byte(space) == INT3[0]
    leaving, staying = (first, second) if leaves_first else (second, first)
    assert not int3s.release(space, AT, leaving)
    assert byte(space) == INT3[0] and int3s.holders(space, AT) == {staying}  # the other's int3 stays
    assert int3s.release(space, AT, staying)
    assert byte(space) == CODE[4] and not int3s.holders(space, AT)  # no stray int3


def test_a_write_over_an_int3_changes_the_byte_under_it_and_reads_hide_it(space):
    int3s = Int3s()
    int3s.hold(space, AT, DEBUGGER)
    assert int3s.write(space, AT - 1, b"\x90\x91\x92")
    assert space.uc.mem_read(AT - 1 - 0x1000, 3) == b"\x90" + INT3 + b"\x92"
    assert int3s.hide(space, AT - 1, bytes(space.uc.mem_read(AT - 1 - 0x1000, 3))) == b"\x90\x91\x92"
    assert int3s.release(space, AT, DEBUGGER) and byte(space) == 0x91
    assert not int3s.write(space, 0x3000, b"\x00")  # no page there


def test_a_lifted_int3_is_stepped_over_and_goes_back_only_while_held(space):
    int3s = Int3s()
    int3s.hold(space, AT, TRACER)
    int3s.hold(space, AT, DEBUGGER)
    assert int3s.lift(space, AT) and byte(space) == CODE[4]  # the instruction runs in place
    assert not int3s.release(space, AT, TRACER)  # the tracepoint leaves during the step
    assert int3s.lower(space, AT) and byte(space) == INT3[0]  # the breakpoint's int3 back after it
    assert int3s.release(space, AT, DEBUGGER) and byte(space) == CODE[4]
    assert not int3s.lower(space, AT) and byte(space) == CODE[4]  # nobody holds it: no int3 back


def test_a_record_whose_int3_is_gone_is_stale(space):
    """Another process got the page tables (same root): its byte there is its own, the old record is dropped."""
    int3s = Int3s()
    int3s.hold(space, AT, DEBUGGER)
    space.uc.mem_write(AT - 0x1000, b"\x55")
    assert int3s.hold(space, AT, TRACER) == 0x55 and int3s.holders(space, AT) == {TRACER}
    assert int3s.release(space, AT, TRACER) and byte(space) == 0x55
