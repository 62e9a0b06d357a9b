"""A debugger's stop never shows the program (fixtures/kernel/signal.c, exit_to_user_mode): a thread asked to stop
while it sleeps or is about to sleep stops on its way back to user mode, and its sleep starts again once it goes
on, as Linux restarts it; the program never sees a sleep cut short (EINTR).

The host asks a thread to stop by writing its ptrace_interrupt, then a reschedule IPI flags the thread's way back
(TIF_SIGPENDING). The IPI may come late: behind the tick, or while its CPU has interrupts off (the combination suite
saw Ctrl-C take a second on a busy host). Meanwhile a sleep that ends sees the request pending (signal_pending) and
ends with -EINTR; the way back used to look at the flag only, so the -EINTR went to the program, again at every sleep
until the IPI came: thousands of calls of a loop meant to sleep between rounds, and a program that sees EINTR from
nanosleep under a debugger. Here every IPI to the machine comes 50 ms late, as on a slow host, and the program
(fixtures/combinations/callers.c: threads sleeping a tick between rounds, counting the sleeps that end early)
is stopped and resumed many times."""

from __future__ import annotations

import threading
import time

import pytest
from unicorn import UC_HOOK_MEM_READ
from unicorn import x86_const as X

from kgtp_sim.client import VMLINUX
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.tracee import INTERRUPT_QUIET
from kgtp_sim.programs import install_program
from kgtp_sim.stub.process import ProcessTarget
from kgtp_sim.stub.target import ResumeAction, Running, Signal
from kgtp_sim.tools.combinations.process import build_program, program_symbols

from ..programs import compile_program

WAIT_S = 60
LATE_S = 0.05


@pytest.fixture(scope="module")
def machine():
    machine = Machine(KernelImage.load(VMLINUX), cpus=2)
    machine.processes.sink = lambda fd, data: None
    machine.start()
    yield machine
    machine.shutdown()


def _wait_stop(target: ProcessTarget):
    ptrace = target.machine.ptrace
    while True:
        serial = ptrace.serial
        stop = target.poll_stop()
        if stop is not None:
            return stop
        ptrace.wait_serial(serial, WAIT_S)


def test_a_stop_asked_while_the_threads_sleep_never_ends_a_sleep_early(machine, tmp_path):
    program = build_program(tmp_path)
    symbols = program_symbols(program)
    inside = install_program(machine, program)
    target = ProcessTarget(machine.ptrace.spawn(inside, [inside, "2"]), exec_path=inside)
    send = machine.send_interrupt

    def late(cpu: int, vector: int) -> None:  # the IPI comes late, from another thread, as on a busy host
        threading.Timer(LATE_S, send, (cpu, vector)).start()

    def read(name: str) -> int:
        return int.from_bytes(target.read_memory(symbols[name], 4, target.pid), "little")

    try:
        deadline = time.monotonic() + WAIT_S
        while len(target.threads()) < 3 or read("rounds") < 4:  # main and two callers, each past its first sleep
            assert time.monotonic() < deadline, "the program's threads did not start"
            assert isinstance(target.resume([ResumeAction(thread=-1)]), Running)
            time.sleep(0.05)
            assert isinstance(target.interrupt(), Signal)
        before = read("rounds")
        machine.send_interrupt = late
        stops = 0
        for _ in range(12):
            stop = target.interrupt()
            assert isinstance(stop, Signal), stop
            stops += 1
            assert isinstance(target.resume([ResumeAction(thread=-1)]), Running)
            time.sleep(0.03)
        stop = target.interrupt()
        machine.send_interrupt = send
        assert isinstance(stop, Signal)
        assert read("rounds") > before and stops == 12  # the threads went on between the stops
        assert read("interrupted_sleeps") == 0, "the program saw a sleep cut short by the debugger's stop"
    finally:
        machine.send_interrupt = send
        target.kill()


def test_a_quiet_stop_asked_while_the_way_back_looks_is_never_a_sigint(machine, tmp_path):
    """The host's quiet stop (gdbserver's stop of the other threads: a step over a breakpoint whose condition is false
    stops every thread many times) may be written into ptrace_interrupt at any instruction boundary, also while the
    thread is in do_signal on its way back to user mode for another reason (a signal of its own, or the flag a
    request it met while stopped left behind). The kernel must read the request once: read twice, the first read saw
    none and the second the quiet one, which it took for the debugger's Ctrl-C and sent SIGINT (GDB heard a SIGINT
    nobody sent). Here the host's write lands at the worst moment: right after each read do_signal makes of the field
    that sees no request; the program (tests/programs/raises.c: three SIGUSR1 of its own, each through do_signal) is
    resumed with the signal it stopped with until it exits."""
    inside = install_program(machine, compile_program("raises", "glibc-static", tmp_path))
    tracee = machine.ptrace.spawn(inside, [inside])
    field = tracee.task + tracee.layout.interrupt
    do_signal = machine.image.symbols["do_signal"]
    late = {"armed": False, "landed": 0}

    def on_read(uc, access, address, size, value, data) -> None:
        """Before each read of the field (unicorn's memory hooks fire before the access lands)."""
        if late["armed"]:  # the host's write, after do_signal's read and before whatever reads the field next
            uc.mem_write(field, INTERRUPT_QUIET.to_bytes(8, "little"))
            late["armed"] = False
            late["landed"] += 1
        elif (do_signal.address <= uc.reg_read(X.UC_X86_REG_RIP) < do_signal.address + do_signal.size
              and not int.from_bytes(uc.mem_read(field, 8), "little")):
            late["armed"] = True

    def hooked(uc) -> int:  # memory hooks see physical addresses; code translated from now on calls them
        physical = machine.cpu.tables.translate(field, 8)
        hook = uc.hook_add(UC_HOOK_MEM_READ, on_read, None, physical, physical + 7)
        uc.ctl_flush_tb()
        return hook

    def unhooked(uc) -> None:
        uc.hook_del(hook)
        uc.ctl_flush_tb()

    hook = machine.run_on_cpu(hooked)
    signals = []
    try:
        stop = machine.ptrace.stop_of(tracee.pid)
        while stop is not None:
            signals.append(stop.signal)
            assert len(signals) < 64, signals
            after = tracee.resume(signal=0 if stop.signal in (0, 5) else stop.signal)
            stop = machine.ptrace.wait(tracee.pid, after, WAIT_S)
    finally:
        machine.run_on_cpu(unhooked)
    assert 2 not in signals, f"a quiet stop came as SIGINT: {signals}"
    assert late["landed"] >= 3, (late, signals)  # at each SIGUSR1's way back at least
    assert signals.count(10) == 3, signals
    assert machine.processes.exited()[tracee.pid] == 3 << 8
