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

from kgtp_sim.client import VMLINUX
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.programs import install_program
from kgtp_sim.stub.process import ProcessTarget
from kgtp_sim.stub.target import ResumeAction, Running, Signal
from kgtp_sim.tools.combinations.process import build_program, program_symbols

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
