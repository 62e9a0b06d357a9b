"""Waking a task whose slot is freed meanwhile (fixtures/kernel/sched.c, wake_up_process and task_off_cpu).

Callers such as de_thread's kill_other_threads and exit's wake_waiters walk tasks[] without the woken task's
run-queue lock: between their look at a thread (cpu >= 0) and wake_up_process's, that thread may end on its own CPU
and its slot be freed (release_task: cpu -1). wake_up_process used to read the CPU again and lock
cpu_data[-1].rq.lock: a page fault in spin_trylock and a kernel panic (about 1 run in 74 of test_fork's
thread-exec tests beside a busy host). Here the freeing is placed exactly in that window: a hook on
wake_up_process's first instruction frees the slot as release_task does on the other CPU, on a booted machine
that runs the call on this thread, so every run takes the window.
"""

from __future__ import annotations

import struct

import pytest
from unicorn import UC_HOOK_CODE
from unicorn import x86_const as X

from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.cpu import Stop
from kgtp_sim.machine.dwarf import KernelDwarf

from ..conftest import VMLINUX

TASK_RUNNING = 0
TASK_INTERRUPTIBLE = 1
TASK_DEAD = 0x80


@pytest.fixture(scope="module")
def machine() -> Machine:
    machine = Machine(KernelImage.load(VMLINUX))
    for _ in range(100):
        if machine.cpu.run() is Stop.HALT:
            return machine
    raise AssertionError("the kernel did not reach its idle loop")


class Slot:
    """The last of tasks[] (free on a machine that runs no program), its state and cpu as the kernel lays them."""

    def __init__(self, machine: Machine) -> None:
        dwarf = KernelDwarf(VMLINUX)
        found = dwarf.global_variable("tasks")
        assert found is not None
        base, array = found
        task = array.target
        count = array.size // task.size
        self.machine = machine
        self.address = base + (count - 1) * task.size
        self.state_at = self.address + task.member("state")[0]
        self.cpu_at = self.address + task.member("cpu")[0]

    @property
    def state(self) -> int:
        return int.from_bytes(self.machine.read_memory(self.state_at, 8), "little")

    @property
    def cpu(self) -> int:
        return struct.unpack("<i", self.machine.read_memory(self.cpu_at, 4))[0]

    def set(self, state: int, cpu: int) -> None:
        self.machine.write_memory(self.state_at, state.to_bytes(8, "little"))
        self.machine.write_memory(self.cpu_at, struct.pack("<i", cpu))


@pytest.fixture
def slot(machine):
    slot = Slot(machine)
    assert (slot.state, slot.cpu) == (TASK_DEAD, -1)  # free, as the kernel leaves it
    yield slot
    slot.set(TASK_DEAD, -1)


def _freed_at_entry(machine: Machine, slot: Slot):
    """A hook that frees `slot` (release_task on its CPU: cpu -1, then TASK_DEAD) as wake_up_process starts."""
    entry = machine.image.address_of("wake_up_process")
    seen = []

    def on_entry(uc, address, size, data) -> None:
        if uc.reg_read(X.UC_X86_REG_RDI) == slot.address:
            machine.kernel_space.write(slot.cpu_at, struct.pack("<i", -1))
            machine.kernel_space.write(slot.state_at, TASK_DEAD.to_bytes(8, "little"))
            seen.append(address)

    return machine.uc.hook_add(UC_HOOK_CODE, on_entry, None, entry, entry), seen


def test_waking_a_free_slot_does_nothing(machine, slot):
    machine.call("wake_up_process", slot.address, max_instructions=10_000)
    assert (slot.state, slot.cpu) == (TASK_DEAD, -1)


def test_a_sleeping_task_on_this_cpu_is_woken(machine, slot):
    slot.set(TASK_INTERRUPTIBLE, 0)
    machine.call("wake_up_process", slot.address, max_instructions=10_000)
    assert (slot.state, slot.cpu) == (TASK_RUNNING, 0)


def test_a_slot_freed_between_the_callers_look_and_the_wake_is_left_alone(machine, slot):
    # signal_wake_up sees a sleeping thread on CPU 0; its slot is freed as wake_up_process begins
    slot.set(TASK_INTERRUPTIBLE, 0)
    hook, seen = _freed_at_entry(machine, slot)
    try:
        machine.call("signal_wake_up", slot.address, max_instructions=10_000)
    finally:
        machine.uc.hook_del(hook)
    assert seen, "signal_wake_up did not call wake_up_process"
    assert (slot.state, slot.cpu) == (TASK_DEAD, -1)  # not made runnable again, and no panic
    assert "panic" not in machine.console_text().lower()
