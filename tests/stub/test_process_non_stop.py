"""The gdbserver role's non-stop run control (stub/nonstop.py, in ProcessTarget) on the machine, without GDB: a
thread's breakpoint stop leaves the others running, a running thread's registers are unavailable while its memory
is read and written, `t` stops a running thread with signal 0, `?` lists every stopped thread with its last stop,
and the process's end is told once (tests/programs/workers.c: three threads calling work() three times each)."""

from __future__ import annotations

import pytest

from kgtp_sim.programs import install_program
from kgtp_sim.stub.process import ProcessTarget
from kgtp_sim.stub.target import BreakpointType, Exited, ResumeAction, Signal

from ..programs import compile_program
from .processes import started_machine, symbol

WAIT_S = 60
SIGTRAP = 5


@pytest.fixture(scope="module")
def machine():
    yield from started_machine(cpus=2)


def _next_events(target: ProcessTarget) -> list:
    """The target's next stop events, polled as the server does when the machine hears of a stop."""
    ptrace = target.machine.ptrace
    while True:
        serial = ptrace.serial
        events = target.stop_events()
        if events:
            return events
        ptrace.wait_serial(serial, WAIT_S)


def test_each_thread_stops_on_its_own(machine, tmp_path):
    program = compile_program("workers", "glibc-static", tmp_path)  # not PIE: work() where its symbol says
    work, counter = symbol(program, "work"), symbol(program, "counter")
    inside = install_program(machine, program)
    del machine.written[:]
    target = ProcessTarget(machine.ptrace.spawn(inside, [inside]), exec_path=inside)
    target.set_non_stop(True)
    assert target.stopped_threads() == [Signal(SIGTRAP, target.pid)]  # its stop at the first instruction
    target.insert_breakpoint(BreakpointType.SOFTWARE, work, 1)
    target.resume_threads([ResumeAction(-1)])
    hit = next(e for e in _next_events(target))
    assert isinstance(hit, Signal) and hit.signal == SIGTRAP and hit.swbreak and hit.thread != target.pid, hit
    assert target.read_registers(hit.thread)["rip"] == work
    # main waits in pthread_join meanwhile: running, not stopped with the thread that hit (no all-stop)
    assert target.threads_by_tid[target.pid].after is not None
    assert machine.ptrace.stop_of(target.pid) is None
    assert target.read_registers(target.pid) == {}  # a running thread's registers: unavailable, as gdbserver's
    assert len(target.read_memory(counter, 4, target.pid)) == 4  # memory is read while threads run ...
    target.write_memory(counter, b"\0\0\0\0", target.pid)  # ... and written (the workers add 18 from here)
    target.resume_threads([ResumeAction(target.pid, stop=True)])  # vCont;t of main
    stopped: list = []
    while not any(e.thread == target.pid for e in stopped):
        stopped += _next_events(target)
    assert Signal(0, target.pid) in stopped, stopped  # a stop GDB asked for: signal 0
    status = target.stopped_threads()
    assert hit in status and Signal(0, target.pid) in status, status
    target.remove_breakpoint(BreakpointType.SOFTWARE, work, 1)
    target.resume_threads([ResumeAction(-1)])  # every stopped thread goes; one that runs goes on
    events = []
    while not any(isinstance(e, Exited) for e in events):
        events += _next_events(target)
    assert events[-1] == Exited(0) and all(isinstance(e, Signal) and e.swbreak for e in events[:-1]), events
    assert target.stop_events() == [] and target.stopped_threads() == []  # told once
    assert bytes(machine.written) == b"counter 18\n"


def test_a_thread_whose_stop_gdb_has_not_taken_stays_stopped(machine, tmp_path):
    """A resumption of every thread that holds a thread whose stop was told but not taken yet (stub/run.py passes
    the queue's threads): that thread stays at its breakpoint, its registers there, and its stop is not told again;
    the next resumption runs it."""
    program = compile_program("workers", "glibc-static", tmp_path)
    work = symbol(program, "work")
    inside = install_program(machine, program)
    del machine.written[:]
    target = ProcessTarget(machine.ptrace.spawn(inside, [inside]), exec_path=inside)
    target.set_non_stop(True)
    target.insert_breakpoint(BreakpointType.SOFTWARE, work, 1)
    target.resume_threads([ResumeAction(-1)])
    hit = _next_events(target)[0]
    assert isinstance(hit, Signal) and hit.swbreak, hit
    target.resume_threads([ResumeAction(-1)], held={hit.thread})
    assert target.threads_by_tid[hit.thread].after is None
    assert target.read_registers(hit.thread)["rip"] == work
    assert all(e.thread != hit.thread for e in target.stop_events())  # told once
    target.remove_breakpoint(BreakpointType.SOFTWARE, work, 1)
    target.resume_threads([ResumeAction(-1)])
    events = []
    while not any(isinstance(e, Exited) for e in events):
        events += _next_events(target)
    assert events[-1] == Exited(0), events
    assert bytes(machine.written) == b"counter 18\n"



def test_a_trap_on_a_breakpoint_removed_before_its_stop_was_taken_in_is_not_an_event(machine, tmp_path):
    """Threads trap on work()'s int3; GDB removes the breakpoint (non-stop: while threads run) before the server has
    taken their stops in: each goes back on work()'s first instruction and on, GDB told nothing (gdbserver discards
    such a stop). Before, the stop was a plain SIGTRAP with the PC inside work()'s first instruction, and the
    thread, once resumed, ran from there."""
    program = compile_program("workers", "glibc-static", tmp_path)
    work, stop_all = symbol(program, "work"), symbol(program, "stop_all")
    inside = install_program(machine, program)
    del machine.written[:]
    target = ProcessTarget(machine.ptrace.spawn(inside, [inside, "forever"]), exec_path=inside)
    target.set_non_stop(True)
    target.resume_threads([ResumeAction(-1)])
    ptrace = machine.ptrace
    while len(target.threads_by_tid) < 4:  # the workers met at their start (and resumed) as the server does
        serial = ptrace.serial
        assert target.stop_events() == []
        if len(target.threads_by_tid) < 4:
            ptrace.wait_serial(serial, WAIT_S)
    target.insert_breakpoint(BreakpointType.SOFTWARE, work, 1)

    def trapped() -> list[int]:
        return [tid for tid, stop in ptrace.stopped_tids().items()
                if stop.signal == SIGTRAP and target.threads_by_tid[tid].after is not None]

    while not trapped():  # a worker's trap, heard by the machine and not taken in by the target
        serial = ptrace.serial
        if not trapped():
            ptrace.wait_serial(serial, WAIT_S)
    target.remove_breakpoint(BreakpointType.SOFTWARE, work, 1)
    assert target._lifted == {work}
    assert target.stop_events() == []
    target.write_memory(stop_all, b"\1\0\0\0", target.pid)
    events = []
    while not any(isinstance(e, Exited) for e in events):
        events += _next_events(target)
    assert events == [Exited(0)], events
    assert bytes(machine.written) == b"started\ncounter -1\n"
