"""The machine under a debugger (machine/runcontrol.py): every CPU stops at an instruction boundary and resumes,
breakpoints stop the whole machine before the instruction (memory untouched), one CPU steps (alone, or with the
others running) or steps through a range, watchpoints trap after the access, time does not run while the machine
is stopped (no tick, the clock port and the TSC stand still), and nothing the kernel computes changes: the SMP
stress comes out exact through stops, breakpoints and steps.

Every wait is for an event of the machine (a stop, a counter the kernel or the ticker moves), never a time window.
"""

from __future__ import annotations

import time

import pytest

from kgtp_sim.machine import MODULE_BASE, MODULE_SIZE, KernelImage, Machine, MachineError
from kgtp_sim.machine.runcontrol import Reason
from kgtp_sim.machine.watchpoints import aligned_pieces
from kgtp_sim.machine.watchpoints import COUNT, EXECUTE, WRITE, WatchpointError
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import Tracer
from kgtp_sim.tracing.patching.probes import decode

from ..conftest import VMLINUX, wait_until
from .test_smp import Kernel, _run_generations

IMAGE = KernelImage.load(VMLINUX)
DO_SYSCALL = IMAGE.symbols["do_syscall"]
TEST_FUNCTION = IMAGE.address_of("kgtp_test_function")
JIFFIES = IMAGE.address_of("jiffies")
WAIT_S = 60


@pytest.fixture(scope="module")
def dwarf():
    from kgtp_sim.machine.dwarf import KernelDwarf

    kernel = KernelDwarf(VMLINUX)
    yield kernel
    kernel.close()


@pytest.fixture
def machine():
    """Two CPUs, both online, running."""
    machine = Machine(IMAGE, hz=100, cpus=2)
    machine.start()
    wait_until(lambda: machine.stats(count=False).cpus_online == 2, "CPU 1 online")
    yield machine
    machine.shutdown()


def _stopped_at_breakpoint(machine: Machine, address: int):
    control = machine.control
    control.insert_breakpoint(address)
    event = control.wait(control.resume() if control.stopped else control.serial, WAIT_S)
    assert event is not None and event.reason is Reason.BREAKPOINT and event.address == address, event
    return event


def _next_instruction(address: int) -> int:
    bounds = IMAGE.function_bounds(address)
    assert bounds is not None
    return next(i.end for i in decode(IMAGE.read_code(bounds[1], bounds[2] - bounds[1]), bounds[1])
                if i.address == address)


def _rdtsc_function(machine: Machine) -> int:
    """A function in module space returning the CPU's `rdtsc`."""
    code = machine.alloc_code(16)
    machine.write_memory(code, bytes.fromhex("0f31" "48c1e220" "4809d0" "c3"))  # rdtsc; shl $32,%rdx; or; ret
    return code


def test_a_stop_holds_every_cpu_and_the_kernels_time(machine):
    control = machine.control
    event = control.stop()
    assert control.stopped and event.reason is Reason.REQUEST and machine.stats(count=False).state == \
        "stopped by the debugger"
    for rip in machine.cpu_rips():  # every CPU at an instruction boundary of the kernel's code
        assert not MODULE_BASE <= rip < MODULE_BASE + MODULE_SIZE
    before = (machine.cpu_rips(), machine.read_symbol("jiffies"), machine.read_symbol("kgtp_counter"),
              machine.clock.ns(), machine.clock.tsc())
    held = machine.stats(count=False).ticks_held
    wait_until(lambda: machine.stats(count=False).ticks_held >= held + 5, "the ticker to hold 5 ticks")
    after = (machine.cpu_rips(), machine.read_symbol("jiffies"), machine.read_symbol("kgtp_counter"),
             machine.clock.ns(), machine.clock.tsc())
    assert after == before  # no instruction ran, no tick came, neither clock moved
    rdtsc = _rdtsc_function(machine)

    ticks = machine.stats(count=False).ticks
    serial = control.resume()
    assert not control.stopped
    jiffies = before[1]
    wait_until(lambda: machine.read_symbol("jiffies") >= jiffies + 3, "jiffies to move on")
    # the time stood still while stopped: the clocks go on from where they stopped (the 5 held ticks' worth of
    # time is not in them), and the CPUs' rdtsc agrees with the clock
    assert machine.clock.ns() - before[3] < machine.clock.stopped_ns + 10**9
    assert abs(machine.call(rdtsc) - machine.clock.tsc()) < machine.clock.stopped_ticks
    assert machine.stats(count=False).ticks >= ticks
    assert control.wait(serial, 0) is None  # no stop since


def test_a_breakpoint_stops_the_machine_before_its_instruction_and_leaves_memory_alone(machine):
    original = machine.read_memory(DO_SYSCALL.address, 8)
    event = _stopped_at_breakpoint(machine, DO_SYSCALL.address)
    assert machine.registers(event.cpu)["rip"] == DO_SYSCALL.address
    assert machine.read_memory(DO_SYSCALL.address, 8) == original
    calls = machine.read_symbol("nr_syscalls")
    # resumed, the other CPU (or this one, later) stops there again; removed, the kernel runs past it
    again = machine.control.wait(machine.control.resume(), WAIT_S)
    assert again is not None and again.reason is Reason.BREAKPOINT
    machine.control.remove_breakpoint(DO_SYSCALL.address)
    machine.control.resume()
    wait_until(lambda: machine.read_symbol("nr_syscalls") >= calls + 10, "system calls past the removed breakpoint")
    assert not machine.control.stopped and machine.control.breakpoints == frozenset()


def test_step_runs_one_instruction_of_one_cpu(machine):
    control = machine.control
    event = _stopped_at_breakpoint(machine, DO_SYSCALL.address)
    control.remove_breakpoint(DO_SYSCALL.address)
    cpu, other = event.cpu, 1 - event.cpu
    rip = DO_SYSCALL.address
    for _ in range(4):  # scheduler-locking on: only the stepped CPU runs
        others = machine.registers(other)
        step = control.wait(control.resume(cpus=[cpu], step=cpu), WAIT_S)
        assert step is not None and step.reason is Reason.STEP and step.cpu == cpu
        rip = _next_instruction(rip)
        assert machine.registers(cpu)["rip"] == rip
        assert machine.registers(other) == others
    step = control.wait(control.resume(step=cpu), WAIT_S)  # the others may run meanwhile
    assert step is not None and step.reason is Reason.STEP and machine.registers(cpu)["rip"] == _next_instruction(rip)
    # a range step: on until the CPU leaves do_syscall (its return)
    within = (DO_SYSCALL.address, DO_SYSCALL.end)
    step = control.wait(control.resume(step=cpu, within=within), WAIT_S)
    assert step is not None and step.reason is Reason.STEP
    assert not within[0] <= machine.registers(cpu)["rip"] < within[1]
    control.resume()


def test_a_stepped_instruction_runs_a_probe_at_it_whole(machine):
    """A breakpoint and a tracepoint's jump probe at one address: the machine stops before the probe; stepped (the
    breakpoint lifted, as GDB steps over one), the CPU runs the probe's detour as part of the instruction, lands on
    the next kernel instruction, never in module space, and the tracepoint collected exactly once (only that CPU
    ran); the breakpoint back in, the machine runs on to the next hit, again and again."""
    tracer = Tracer(machine, "opt")
    tracer.definitions.define(t.DefineTracepoint.parse(b"1:%x:E:0:0-" % TEST_FUNCTION))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"1:%x:R01" % TEST_FUNCTION))  # collect $rax
    event = _stopped_at_breakpoint(machine, TEST_FUNCTION)
    tracer.start()
    assert [row.kind for row in tracer.probe_rows()] == ["jump"]
    assert tracer.refuses_breakpoint(TEST_FUNCTION) is None
    control = machine.control
    try:
        for _ in range(3):
            frames = tracer.status().frames
            control.remove_breakpoint(TEST_FUNCTION)
            step = control.wait(control.resume(cpus=[event.cpu], step=event.cpu), WAIT_S)
            assert step is not None and step.reason is Reason.STEP and step.cpu == event.cpu
            assert machine.registers(event.cpu)["rip"] == _next_instruction(TEST_FUNCTION)
            assert tracer.status().frames == frames + 1
            control.insert_breakpoint(TEST_FUNCTION)
            event = control.wait(control.resume(), WAIT_S)
            assert event is not None and event.reason is Reason.BREAKPOINT
            assert machine.registers(event.cpu)["rip"] == TEST_FUNCTION
    finally:
        control.clear()
        control.resume()
        tracer.stop(t.StopReason.STOP_COMMAND)


def _stopped_with_an_idle_cpu(machine: Machine) -> int:
    """Stop the machine until a stop finds a CPU halted in the idle loop; that CPU."""
    deadline = time.monotonic() + WAIT_S
    while True:
        machine.control.stop()
        idle = [state.index for state in machine.cpu_states() if state.state == "idle"]
        if idle:
            return idle[0]
        assert time.monotonic() < deadline, "no CPU ever idle"
        machine.control.resume()


def test_a_halted_cpu_steps_into_the_interrupt_that_wakes_it(machine):
    """A stepped CPU takes no interrupt (QEMU's SSTEP_NOIRQ), but a halted one can only go on through one: the
    step ends at the handler's first instruction."""
    control = machine.control
    cpu = _stopped_with_an_idle_cpu(machine)
    step = control.wait(control.resume(cpus=[cpu], step=cpu), WAIT_S)
    assert step is not None and step.reason is Reason.STEP and step.cpu == cpu
    rip = machine.registers(cpu)["rip"]
    assert IMAGE.function_at(rip).name.startswith("asm_")  # an interrupt entry of boot.S
    control.resume()


def test_a_watchpoint_traps_after_the_write_on_the_cpu_that_wrote(machine):
    control = machine.control
    control.stop()
    jiffies = machine.read_symbol("jiffies")
    control.insert_hardware(WRITE, JIFFIES, 8)
    event = control.wait(control.resume(), WAIT_S)
    assert event is not None and event.reason is Reason.WATCHPOINT and event.cpu == 0  # CPU 0 keeps time
    assert event.address == JIFFIES and event.kind == WRITE
    assert machine.read_symbol("jiffies") == jiffies + 1  # the write is done
    rip = machine.registers(0)["rip"]
    assert IMAGE.function_at(rip).name == "timer_interrupt"
    control.remove_hardware(WRITE, JIFFIES, 8)
    assert machine.debug_registers.in_use == 0
    control.resume()


def test_a_hardware_breakpoint_takes_a_debug_register(machine):
    control = machine.control
    control.stop()
    control.insert_hardware(EXECUTE, DO_SYSCALL.address, 1)
    assert machine.debug_registers.in_use == 1
    event = control.wait(control.resume(), WAIT_S)
    assert event is not None and event.reason is Reason.HARDWARE_BREAKPOINT
    assert machine.registers(event.cpu)["rip"] == DO_SYSCALL.address
    control.clear()
    assert machine.debug_registers.in_use == 0
    control.resume()


def test_where_breakpoints_cannot_go(machine):
    control = machine.control
    with pytest.raises(MachineError, match="module space"):
        control.insert_breakpoint(MODULE_BASE + 0x100)
    with pytest.raises(MachineError, match="no process maps it"):
        control.insert_breakpoint(0x400000)
    with pytest.raises(MachineError, match="no process maps it"):
        control.insert_hardware(EXECUTE, IMAGE.address_of("jiffies"), 1)  # data, not code
    with pytest.raises(WatchpointError):
        control.insert_hardware(WRITE, 0x400000, 8)
    with pytest.raises(WatchpointError, match="debug registers"):
        control.insert_hardware(WRITE, JIFFIES + 1, 24)  # 1 + 2 + 4 + 8 + 8 + 1: six pieces
    for slot in range(COUNT):
        control.insert_hardware(WRITE, JIFFIES + 8 * slot, 8)
    with pytest.raises(WatchpointError, match="no free debug register"):
        control.insert_hardware(EXECUTE, DO_SYSCALL.address, 1)
    control.clear()
    assert machine.debug_registers.in_use == 0 and not control.hardware


def test_watched_ranges_split_as_x86_debuggers_split_them():
    assert aligned_pieces(0x1000, 8) == [(0x1000, 8)]
    assert aligned_pieces(0x1001, 8) == [(0x1001, 1), (0x1002, 2), (0x1004, 4), (0x1008, 1)]
    assert aligned_pieces(0x1004, 12) == [(0x1004, 4), (0x1008, 8)]
    with pytest.raises(WatchpointError):
        aligned_pieces(0x1000, 0)


def test_the_stress_is_exact_through_stops_breakpoints_and_steps(machine, dwarf):
    """A stress generation run while the machine is stopped again and again: by request, at a breakpoint in the
    locked read-modify-write on each CPU, then stepped with the other CPU stopped and running; every total exact."""
    kernel = Kernel(machine, IMAGE, dwarf)
    control = machine.control
    step_function = IMAGE.address_of("stress_step.constprop.0")  # in the locked read-modify-write
    kernel.write("stress_iterations", 20_000)
    generation = kernel.snapshot()["stress_completed"] + 1
    kernel.write("stress_generation", generation)
    seen: set[int] = set()
    deadline = time.monotonic() + WAIT_S
    while len(seen) < 2:
        assert time.monotonic() < deadline, f"stress_step hit only on CPUs {seen}"
        event = _stopped_at_breakpoint(machine, step_function)
        seen.add(event.cpu)
        control.remove_breakpoint(step_function)
        for locked in (True, False, True):
            step = control.wait(control.resume(cpus=[event.cpu] if locked else None, step=event.cpu), WAIT_S)
            assert step is not None and step.reason is Reason.STEP and step.cpu == event.cpu
        control.resume()
        control.stop()
    control.resume()
    for _ in range(20):  # stops by request in the middle of the rounds
        control.stop()
        control.resume()
    state = kernel.wait(lambda s: s["stress_completed"] == generation, "the stress generation to complete",
                        timeout=WAIT_S)
    assert state["stress_counter"] == state["stress_expected"] == state["stress_done"]
    assert state["stress_a"] == state["stress_expected"] and state["stress_b"] == 2 * state["stress_expected"]
    assert state["stress_errors"] == 0
    _run_generations(kernel, 2, iterations=5_000, generations=1)  # and the next generation too


def test_a_stop_waits_for_the_tracers_own_steps_and_detours_to_end(machine):
    """A stop asked while a CPU runs a detour or is single-stepped by the tracer (while-stepping) comes once it is
    back in the kernel's own code, TF clear: never inside what the tracer runs for the kernel."""
    tracer = Tracer(machine, "opt")
    tracer.definitions.define(t.DefineTracepoint.parse(b"1:%x:E:8:0-" % TEST_FUNCTION))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"1:%x:SR01" % TEST_FUNCTION))
    tracer.definitions.define(t.DefineTracepoint.parse(b"2:%x:E:0:0-" % DO_SYSCALL.address))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"2:%x:R01" % DO_SYSCALL.address))
    tracer.start()
    try:
        wait_until(lambda: tracer.status().frames >= 20, "frames of both tracepoints")
        for _ in range(40):
            machine.control.stop()
            for cpu in range(machine.cpu_count):
                registers = machine.registers(cpu)
                assert not MODULE_BASE <= registers["rip"] < MODULE_BASE + MODULE_SIZE, hex(registers["rip"])
                assert not registers["eflags"] & 0x100  # TF
            machine.control.resume()
    finally:
        tracer.stop(t.StopReason.STOP_COMMAND)
    frames = tracer.status().frames
    assert frames >= 20
