"""The machine's CPUs (machine.py, smp.py): a register context and a per-CPU area each, the start port, turns
that let every online CPU run beside the others, the yield port, and what `monitor cpus` shows.

The second CPU runs code written here into module space, so these hold whatever the kernel does with its CPUs;
the kernel's own SMP (fixtures/kernel) is tested in test_smp.py.
"""

from __future__ import annotations

import time

import pytest

from kgtp_sim.agent.asm import assemble_text
from kgtp_sim.machine import KernelImage, Machine, smp
from kgtp_sim.stub.machine_monitor import register_machine_commands
from kgtp_sim.stub.monitor import Monitor

from ..conftest import VMLINUX, wait_until

IMAGE = KernelImage.load(VMLINUX)


def text_slack(image: KernelImage, length: int) -> int:
    """Room in the kernel's last text page after its code: executable, and not module space (where the
    machine never switches a CPU out: that is the stub's code)."""
    end = (image.text_range[1] + 15) & ~15
    assert (end | 0xFFF) + 1 - end >= length, "no room after the kernel's text"
    return end


def spinner(machine: Machine, yields: bool) -> tuple[int, int]:
    """Code for CPU 1, forever, interrupts off: count in a data word (locked), store its CPU number (`%gs:8`)
    beside it, and give up its turn each time round if `yields`. Returns (entry, data)."""
    data = machine.alloc_data(16)
    code = text_slack(machine.image, 64)
    source = [
        f"movabs ${data:#x}, %rbx",
        "again:",
        "lock incq (%rbx)",
        "movl %gs:0x8, %eax",
        "movl %eax, 0x8(%rbx)",
    ]
    if yields:
        source += [f"out %eax, ${smp.PORT_SMP_YIELD:#x}"]
    source += ["jmp again"]
    machine.write_memory(code, assemble_text("\n".join(source), code))
    return code, data


def start_cpu(machine: Machine, cpu: int, entry: int) -> None:
    """What the kernel does to start a CPU: `outl cpu, $0xe1` with the entry in %rdi (run on the loaded CPU)."""
    code = machine.alloc_code(32)
    machine.write_memory(code, assemble_text(
        f"movabs ${entry:#x}, %rdi\nmov ${cpu:#x}, %eax\nout %eax, ${smp.PORT_SMP_START:#x}\nret", code))
    machine.call(code)


def test_each_cpu_has_its_own_registers_and_per_cpu_area():
    machine = Machine(IMAGE, cpus=3)
    for cpu in range(3):
        machine.set_registers({"rax": 0x1000 + cpu, "r15": 0x2000 + cpu}, cpu=cpu)
    for cpu in range(3):
        regs = machine.registers(cpu)
        assert (regs["rax"], regs["r15"]) == (0x1000 + cpu, 0x2000 + cpu)
        assert machine.on_cpu(cpu, smp.cpu_number) == cpu
    assert machine.current_task(0) == IMAGE.address_of("tasks")  # cpu_data[0] is initialised statically
    states = machine.cpu_states()
    assert [s.state for s in states] == ["running", "offline", "offline"]
    with pytest.raises(ValueError):
        machine.registers(3)
    with pytest.raises(ValueError):
        Machine(IMAGE, cpus=smp.MAX_CPUS + 1)


@pytest.mark.parametrize("yields", [False, True], ids=["turns", "yield"])
def test_a_started_cpu_runs_beside_the_kernel(yields):
    """CPU 1 spins with interrupts off and never halts: the kernel on CPU 0 still gets its turns (jiffies
    advance), CPU 1 sees its own per-CPU area, and the machine switched between them. The same code in
    module space would never be switched out (the stub's code is not interleaved)."""
    with Machine(IMAGE, cpus=2) as machine:
        entry, data = spinner(machine, yields)
        # maxcpus=1: the kernel leaves CPU 1 to the test
        machine.write_memory(IMAGE.address_of("setup_max_cpus"), (1).to_bytes(4, "little"))
        machine.start()
        wait_until(lambda: machine.read_symbol("jiffies") >= 2, "the kernel's first ticks")
        start_cpu(machine, 1, entry)
        jiffies = machine.read_symbol("jiffies")
        wait_until(lambda: int.from_bytes(machine.read_memory(data, 8), "little") > 10_000, "CPU 1 counting")
        wait_until(lambda: machine.read_symbol("jiffies") >= jiffies + 5, "CPU 0's ticks meanwhile")
        assert int.from_bytes(machine.read_memory(data + 8, 4), "little") == 1  # %gs:8 on CPU 1
        stats = machine.stats(count=False)
        assert stats.cpus_online == 2 and stats.cpu_switches > 0
        assert (stats.yields > 0) == yields
        states = machine.cpu_states()
        assert states[1].state == "running" and entry <= states[1].rip < entry + 64
        monitor = Monitor()
        register_machine_commands(monitor, machine, time.monotonic())
        lines = monitor.execute("cpus").splitlines()
        assert len(lines) == 2 and lines[1].startswith("CPU 1  running")


def test_the_start_port_is_ignored_for_cpus_the_machine_lacks_or_started():
    machine = Machine(IMAGE, cpus=2)
    entry, _ = spinner(machine, False)
    start_cpu(machine, 5, entry)  # no such CPU
    start_cpu(machine, 0, entry)  # the boot CPU
    assert [s.state for s in machine.cpu_states()] == ["running", "offline"]
    start_cpu(machine, 1, entry)
    start_cpu(machine, 1, entry + 8)  # already started: its entry stays
    assert machine.cpu_rips()[1] == entry


def test_a_fault_left_in_flight_does_not_follow_its_cpu_through_a_switch():
    """A run a stop request ends just as a #PF is raised leaves it "in flight" (QEMU's old_exception) undelivered;
    switching CPUs then drops it (the instruction faults again later), and the CPU must not carry it: its next #PF
    would become a double fault (seen as `vector 8 ... no handler` while a process was debugged on 2 CPUs)."""
    from kgtp_sim.uc_native import old_exception_offset, read_context_int, write_context_int

    offset = old_exception_offset()
    if offset is None:
        pytest.skip("this unicorn build's old_exception could not be located")
    machine = Machine(KernelImage.load(VMLINUX), cpus=2)
    sched = machine._sched
    write_context_int(machine.uc, offset, 14)  # CPU 0: a #PF in flight when its run ended
    sched.load(1)
    assert read_context_int(machine.uc, offset) == -1  # CPU 1 never had one
    sched.load(0)
    assert read_context_int(machine.uc, offset) == -1
