"""The machine's four hardware breakpoints (machine/watchpoints.py): data breakpoints trap after the accessing
instruction with every register and byte as it left them, instruction breakpoints fault before it, the accessing
instruction runs exactly once, and nothing stays behind once they are cleared.

`kgtp_test_function` is `addl $1, kgtp_counter(%rip); nop5; ret`: `kgtp_bench_loop(n)` writes kgtp_counter n
times, deterministically (`Machine.call`, no timer).
"""

from __future__ import annotations

import threading
import time

import pytest
from unicorn import x86_const as X

from kgtp_sim import uc_paging as paging
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.cpu import EFLAGS_TF, REGISTER_IDS
from kgtp_sim.machine.watchpoints import COUNT, EXECUTE, READ_WRITE, WRITE, DebugRegisters, WatchpointError

from ..conftest import VMLINUX
from .test_machine import assemble
from .test_paging import booted
from .test_spaces import USER, _map

IMAGE = KernelImage.load(VMLINUX)
COUNTER = IMAGE.address_of("kgtp_counter")
FUNCTION = IMAGE.address_of("kgtp_test_function")
AFTER_ADD = FUNCTION + 7  # the nop5 after `addl $1, kgtp_counter(%rip)`
JIFFIES = IMAGE.address_of("jiffies")


def _machine() -> Machine:
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 2)  # translated before any breakpoint: arming must make that code trap too
    return machine


def _recorder(machine: Machine, seen: list):
    def handler(uc, slot):
        registers = {name: uc.reg_read(reg) for name, reg in REGISTER_IDS.items()}
        seen.append((slot, registers, machine.read_symbol("kgtp_counter", 4)))
    return handler


def test_a_write_traps_after_the_instruction_as_it_left_everything():
    machine, seen = _machine(), []
    registers = DebugRegisters(machine.cpu)
    registers.set(0, COUNTER, 4, WRITE, _recorder(machine, seen))
    before = machine.read_symbol("kgtp_counter", 4)
    machine.call("kgtp_bench_loop", 5)
    assert machine.read_symbol("kgtp_counter", 4) == before + 5  # the instruction ran once per call
    assert [s[2] for s in seen] == [before + 1 + i for i in range(5)]  # the new value is in memory
    assert {s[0] for s in seen} == {0} and {s[1]["rip"] for s in seen} == {AFTER_ADD}
    assert [s[1]["rdi"] for s in seen] == [1, 2, 3, 4, 5]  # kgtp_test_function(counter1, counter2)
    assert all(not s[1]["eflags"] & EFLAGS_TF for s in seen)
    assert registers.replays == registers.traps == 5

    # the same registers as an instruction breakpoint on the next instruction sees, flags included
    other, faults = _machine(), []
    DebugRegisters(other.cpu).set(0, AFTER_ADD, 1, EXECUTE, _recorder(other, faults))
    other.call("kgtp_bench_loop", 5)
    assert [s[1] for s in faults] == [s[1] for s in seen]


def test_a_read_and_write_instruction_traps_once():
    machine, seen = _machine(), []
    DebugRegisters(machine.cpu).set(3, COUNTER, 4, READ_WRITE, _recorder(machine, seen))
    machine.call("kgtp_bench_loop", 3)
    assert [(s[0], s[1]["rip"]) for s in seen] == [(3, AFTER_ADD)] * 3  # one #DB for the instruction, as DR6


@pytest.mark.parametrize("address, size, traps", [
    (COUNTER + 1, 1, True),  # one byte of the 4-byte write
    (COUNTER + 3, 1, True),
    (COUNTER + 2, 2, True),
    (COUNTER, 8, True),  # a wider range
    (COUNTER + 4, 4, False),  # next to it
    (COUNTER + 5, 2, False),  # aligned down to COUNTER + 4: still next to it
])
def test_any_byte_of_an_access_in_the_range_traps(address, size, traps):
    machine, seen = _machine(), []
    DebugRegisters(machine.cpu).set(1, address, size, WRITE, _recorder(machine, seen))
    machine.call("kgtp_bench_loop", 2)
    assert len(seen) == (2 if traps else 0)


def test_an_instruction_breakpoint_is_a_fault():
    machine, seen = _machine(), []
    DebugRegisters(machine.cpu).set(0, FUNCTION, 1, EXECUTE, _recorder(machine, seen))
    before = machine.read_symbol("kgtp_counter", 4)
    machine.call("kgtp_bench_loop", 3)
    assert [(s[1]["rip"], s[2]) for s in seen] == [(FUNCTION, before + i) for i in range(3)]  # not yet added


def test_four_registers_and_what_one_takes():
    machine = _machine()
    registers = DebugRegisters(machine.cpu)
    for slot in range(COUNT):
        registers.set(slot, COUNTER, 4, WRITE, lambda uc, slot: None)
    assert registers.free_slot() is None and registers.in_use == 4
    with pytest.raises(WatchpointError, match="in use"):
        registers.set(0, COUNTER, 4, WRITE, lambda uc, slot: None)
    registers.clear(2)
    assert registers.free_slot() == 2
    with pytest.raises(WatchpointError, match="1, 2, 4 or 8"):
        registers.set(2, COUNTER, 3, WRITE, lambda uc, slot: None)
    with pytest.raises(WatchpointError, match="not mapped"):
        registers.set(2, 0xFFFF_8880_0000_0000, 8, WRITE, lambda uc, slot: None)  # a demand page, not present
    registers.clear_all()


def test_every_slot_that_matched_traps_in_order():
    machine, seen = _machine(), []
    registers = DebugRegisters(machine.cpu)
    registers.set(2, COUNTER, 4, WRITE, _recorder(machine, seen))
    registers.set(0, COUNTER + 1, 1, READ_WRITE, _recorder(machine, seen))
    machine.call("kgtp_bench_loop", 2)
    assert [s[0] for s in seen] == [0, 2, 0, 2]


def test_a_stop_between_the_first_pass_and_the_replay_is_finished_before_the_run_returns():
    machine, seen = _machine(), []
    registers = DebugRegisters(machine.cpu)
    first_pass = registers._on_access

    def stop_after_first_pass(uc, access, address, size, value, slot):
        first_pass(uc, access, address, size, value, slot)
        if registers._replay is not None and not registers._replay.replaying:
            uc.emu_stop()  # as a stop request at the next block boundary would end it

    registers._on_access = stop_after_first_pass
    registers.set(0, COUNTER, 4, WRITE, _recorder(machine, seen))
    before = machine.read_symbol("kgtp_counter", 4)
    machine.call("kgtp_bench_loop", 3)
    assert machine.read_symbol("kgtp_counter", 4) == before + 3
    assert [(s[1]["rip"], s[2]) for s in seen] == [(AFTER_ADD, before + 1 + i) for i in range(3)]


def test_clearing_leaves_no_hook_and_the_cpu_as_it_was():
    machine = _machine()
    uc = machine.cpu.uc
    hooks = len(uc._callbacks)
    registers = DebugRegisters(machine.cpu)
    for _ in range(2):
        registers.set(0, COUNTER, 4, WRITE, lambda uc, slot: None)
        registers.set(1, JIFFIES, 8, READ_WRITE, lambda uc, slot: None)
        registers.set(2, FUNCTION, 1, EXECUTE, lambda uc, slot: None)
        machine.call("kgtp_bench_loop", 3)
        assert registers.traps == 6 and machine.cpu.after_run is not None
        registers.clear_all()
        registers.traps = 0
        assert len(uc._callbacks) == hooks and not registers._gates and not registers._retire_due
        assert machine.cpu.debug_trap is None and machine.cpu.after_run is None
        before = machine.read_symbol("kgtp_counter", 4)
        machine.call("kgtp_bench_loop", 3)
        assert registers.traps == 0 and machine.read_symbol("kgtp_counter", 4) == before + 3


def test_jiffies_on_a_running_machine_under_stop_requests():
    """The timer interrupt writes jiffies; another thread keeps stopping the CPU (as GDB's reads do): no trap is
    lost or doubled, each one sees jiffies one higher, inside the timer interrupt."""
    machine = Machine(IMAGE, hz=500)
    seen: list[tuple[int, int]] = []

    def handler(uc, slot):
        seen.append((uc.reg_read(X.UC_X86_REG_RIP), int.from_bytes(uc.mem_read(JIFFIES, 8), "little")))

    registers = DebugRegisters(machine.cpu)
    machine.start()
    try:
        first = machine.run_on_cpu(lambda uc: (registers.set(0, JIFFIES, 8, WRITE, handler),
                                               machine.read_symbol("jiffies"))[1])
        done = threading.Event()

        def poke():
            while not done.is_set():
                machine.read_symbol("kgtp_counter", 4)
        pokers = [threading.Thread(target=poke) for _ in range(2)]
        for thread in pokers:
            thread.start()
        deadline = time.monotonic() + 60
        while len(seen) < 200:
            assert time.monotonic() < deadline, len(seen)
            time.sleep(0.01)
        done.set()
        for thread in pokers:
            thread.join()
        last = machine.run_on_cpu(lambda uc: (registers.clear_all(), machine.read_symbol("jiffies"))[1])
    finally:
        machine.shutdown()
    assert [value for _, value in seen] == list(range(first + 1, last + 1))
    function = {IMAGE.function_at(rip).name for rip, _ in seen}
    assert function == {"timer_interrupt"}, function


def test_an_instruction_qemu_runs_in_a_helper_traps_at_the_access():
    """iretq pops its frame in a QEMU helper: no exit is possible after one of its loads, so its access traps at
    once, RIP at the iretq, and the instruction completes as if nothing happened."""
    machine, seen = _machine(), []
    frame = machine.alloc_data(0x40)
    code = machine.alloc_code(0x40)
    # mov %rsp,%rdx; movabs $frame,%rsp; iretq; back: mov %rdx,%rsp; mov $0x2a,%eax; ret
    body = bytes.fromhex("4889e2") + b"\x48\xbc" + frame.to_bytes(8, "little") + bytes.fromhex("48cf")
    back = code + len(body)
    body += bytes.fromhex("4889d4" "b82a000000" "c3")
    machine.write_memory(code, body)
    machine.write_memory(frame, b"".join(v.to_bytes(8, "little") for v in (back, 0x08, 0x2, frame + 0x28, 0x10)))
    DebugRegisters(machine.cpu).set(0, frame, 8, READ_WRITE, _recorder(machine, seen))
    assert machine.call(code) == 0x2A
    assert [(s[0], s[1]["rip"]) for s in seen] == [(0, back - 2)]


def test_clearing_under_a_later_single_step_handler_keeps_that_handler():
    """The tracer puts its #DB handler over the machine's while it steps an instruction in place (a program's int3
    tracepoint), keeping ours to pass other traps to. A tstop that clears the watches while that step is under way
    (the run stopped between the int3 and its step) must not take the chain back under it: the step's #DB would
    reach the kernel, which gives a traced program a SIGTRAP nobody asked for."""
    machine = _machine()
    registers = DebugRegisters(machine.cpu)
    registers.set(0, COUNTER, 4, WRITE, lambda uc, slot: None)
    ours = machine.cpu.debug_trap
    stepped = []
    machine.cpu.debug_trap = lambda uc: stepped.append(uc)  # the step in place's handler, over ours
    registers.clear_all()
    assert machine.cpu.debug_trap is not ours and machine.cpu.debug_trap is not None
    machine.cpu.debug_trap(machine.cpu.uc)
    assert len(stepped) == 1
    machine.cpu.debug_trap = ours  # that handler leaves, putting back the one it kept
    registers.set(1, JIFFIES, 8, WRITE, lambda uc, slot: None)  # watches again: no cycle in the chain
    assert machine.cpu.debug_trap == ours and registers._previous_trap is None
    registers.clear_all()
    assert machine.cpu.debug_trap is None


def test_an_instruction_breakpoint_cleared_with_another_space_loaded_leaves_no_code_calling_it():
    """Unicorn compiles the only code hook into translated blocks as a direct call of its callback, and drops
    a deleted hook's blocks through the loaded CPU's page tables only. An instruction breakpoint at a process's
    address, cleared while the kernel's space is loaded (the process stopped, another task running), left its
    block behind calling the freed callback: the server died of a segmentation fault when the process ran
    there again (GDB's hbreak2.exp). Here the callback is kept alive and counted instead."""
    machine = booted(IMAGE)
    uc = machine.uc
    space = machine.new_space()
    _map(machine, space, USER, paging.USER_TEXT)
    machine.write_memory(USER, assemble("mov eax, 0x1; ret", USER), space=space)
    kernel_cr3 = uc.reg_read(X.UC_X86_REG_CR3)

    def in_space(uc) -> int:
        uc.reg_write(X.UC_X86_REG_CR3, space.root)
        try:
            return machine.call(USER)
        finally:
            uc.reg_write(X.UC_X86_REG_CR3, kernel_cr3)

    registers = machine.debug_registers
    called: list[int] = []
    on_execute = registers._on_execute
    registers._on_execute = lambda *args: (called.append(args[1]), on_execute(*args))[1]
    hits: list[int] = []
    machine.run_on_cpu(lambda uc: registers.set(0, USER, 1, EXECUTE, lambda uc, slot: hits.append(slot),
                                                space=space))
    assert machine.run_on_cpu(in_space) == 1 and hits == [0] and called == [USER]
    alive = dict(uc._callbacks)  # the callback stays callable, so that a block left behind shows as a call
    machine.run_on_cpu(lambda uc: registers.release([0]))  # the kernel's space loaded
    assert machine.run_on_cpu(in_space) == 1
    assert hits == [0] and called == [USER], "translated code still calls the cleared breakpoint's hook"
    del alive
