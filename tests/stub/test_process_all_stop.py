"""The gdbserver role's all-stop (stub/process.py: ProcessTarget) on the machine, without GDB: a stop reported while
threads the process just made have not stopped at their start yet (the machine hears of a new thread only then)
stops them too, as gdbserver's stop_all_lwps stops a clone child it knows from its parent's clone event.

Met only later, such a thread went on under whatever GDB resumed next: GDB's step of one thread over a breakpoint,
lifted from memory meanwhile, let it run past the breakpoint unseen (tests/e2e/test_gdbserver_threads.py's lost
hits). The machine has one CPU: a new thread runs only once its parent leaves the CPU, so main's stop at
pthread_join comes before the first stops of the three threads it made, and the CPU thread is held at main's stop
notice until the target has looked at the stops there are, so that none of theirs is among them."""

from __future__ import annotations

import threading

import pytest

from kgtp_sim.arch import signals
from kgtp_sim.programs import install_program
from kgtp_sim.stub.process import ProcessTarget
from kgtp_sim.stub.target import BreakpointType, Exited, ResumeAction, Running, Signal

from ..programs import compile_program
from .processes import next_stop, started_machine, symbol

WAIT_S = 60
SIGTRAP = 5
SIGUSR1 = 10  #: Linux's number


@pytest.fixture(scope="module")
def machine():
    yield from started_machine(cpus=1)


def _wait_stop(target: ProcessTarget):
    """The target's next stop, polled as the server does when the machine hears of one."""
    return next_stop(target.machine, target.poll_stop)


def test_a_stop_waits_for_the_threads_the_process_made_that_have_not_stopped_at_their_start(machine, tmp_path):
    program = compile_program("workers", "glibc-static", tmp_path)  # not PIE: pthread_join where its symbol says
    join = symbol(program, "pthread_join")
    inside = install_program(machine, program)
    del machine.written[:]
    ptrace = machine.ptrace
    target = ProcessTarget(ptrace.spawn(inside, [inside]), exec_path=inside)
    looked, held = threading.Event(), threading.Event()
    stopped_tids = ptrace.stopped_tids

    def at_join(stop) -> bool:  # main's stop at pthread_join (its stops while GDB's int3 goes in come before)
        after = target.threads_by_tid[target.pid].after
        return stop is not None and after is not None and stop.serial > after

    def looking() -> dict:  # the target looks at the stops there are
        stops = stopped_tids()
        if at_join(stops.get(target.pid)):
            looked.set()
        return stops

    def hold(pid: int) -> None:  # the CPU thread, at a stop's notice: the one of main's stop at pthread_join
        if pid == target.pid and at_join(ptrace.stop_of(pid)) and not held.is_set():
            held.set()
            looked.wait(WAIT_S)

    ptrace.stopped_tids = looking
    ptrace.listeners.append(hold)
    try:
        target.insert_breakpoint(BreakpointType.SOFTWARE, join, 1)
        assert isinstance(target.resume([ResumeAction(thread=-1)]), Running)
        stop = _wait_stop(target)
    finally:
        ptrace.listeners.remove(hold)
        del ptrace.stopped_tids
        looked.set()
    assert held.is_set()
    assert isinstance(stop, Signal) and stop.signal == SIGTRAP and stop.thread == target.pid, stop
    assert target.read_registers(target.pid)["rip"] == join
    made = ptrace.threads_of(target.pid)
    assert len(made) == 4, made  # main and the three workers
    assert sorted(target.threads()) == sorted(made)  # every one met ...
    for tid in made:  # ... and stopped, none left to go on under the next resumption
        assert ptrace.stop_of(tid) is not None, tid
    target.remove_breakpoint(BreakpointType.SOFTWARE, join, 1)
    assert isinstance(target.resume([ResumeAction(thread=-1)]), Running)
    ended = _wait_stop(target)
    assert isinstance(ended, Exited) and ended.code == 0, ended
    assert bytes(machine.written) == b"counter 18\n"


def test_a_thread_that_stops_with_a_passed_signal_while_every_thread_is_stopped_is_asked_again(machine, tmp_path):
    """All-stop's stop of every thread asks each running one to stop quietly; a thread that stops with a signal GDB
    passes instead (the kernel takes the signal's stop for the quiet one) gets its signal and runs on. Its stop came
    before the wait for the next stop, so that wait found nothing (sigthread.exp's Ctrl-C: 10 s, then the report of
    a process still running). Here main's breakpoint stop is reported while the thread's SIGUSR1 stop is seen only
    once every thread is being stopped, as a busy host orders them."""
    program = compile_program("passed", "glibc-static", tmp_path)
    stop_here = symbol(program, "stop_here")
    inside = install_program(machine, program)
    ptrace = machine.ptrace
    target = ProcessTarget(ptrace.spawn(inside, [inside]), exec_path=inside)
    target.pass_signals = frozenset({signals.to_gdb(SIGUSR1)})
    stopped_tids = ptrace.stopped_tids

    def looking() -> dict:  # the thread's signal stop shown only while every thread is being stopped
        stops = stopped_tids()
        if not target._stopping:
            stops = {tid: stop for tid, stop in stops.items() if tid == target.pid or stop.signal != SIGUSR1}
        return stops

    ptrace.stopped_tids = looking
    try:
        target.insert_breakpoint(BreakpointType.SOFTWARE, stop_here, 1)
        assert isinstance(target.resume([ResumeAction(thread=-1)]), Running)
        stop = _wait_stop(target)
    finally:
        del ptrace.stopped_tids
    assert isinstance(stop, Signal) and stop.signal == SIGTRAP and stop.thread == target.pid, stop
    made = ptrace.threads_of(target.pid)
    assert len(made) == 2 and sorted(target.threads()) == sorted(made), made
    for tid in made:  # every thread stopped: none left running after the report
        assert ptrace.stop_of(tid) is not None, tid
    target.kill()
