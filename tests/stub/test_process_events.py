"""The gdbserver role's processes (stub/extended.py: Inferior over stub/process.py's targets) on the machine, without
GDB: the events GDB asks for (qSupported's fork-events+, exec-events+) and several processes under one server.

A fork child GDB keeps (detach-on-fork off) is a process of its own: its threads listed with its pid, GDB's
breakpoint cloned into it (its copy keeps the int3) and taken out of it alone, each process resumed on its own
(`vCont;c:pPID.-1`) while the other stays stopped, each end naming its process; an exec makes the process anew (one
thread, the new program, no breakpoint) and tells the listeners that point tracing at the process
(tests/programs/forks.c "work", execs.c "1")."""

from __future__ import annotations

import pytest
from elftools.elf.elffile import ELFFile

from kgtp_sim.machine.int3s import DEBUGGER
from kgtp_sim.programs import install_program
from kgtp_sim.rsp.dispatch import RspError
from kgtp_sim.stub.extended import Inferior
from kgtp_sim.stub.process import ProcessTarget
from kgtp_sim.stub.target import BreakpointType, Execd, Exited, Forked, ResumeAction, Running, Signal

from ..programs import compile_program
from .processes import started_machine, symbol

WAIT_S = 60
GDB_SIGCHLD = 20  #: GDB's number for SIGCHLD (gdb/signals.def)
EVENTS = ("multiprocess+", "fork-events+", "vfork-events+", "exec-events+")


@pytest.fixture(scope="module")
def machine():
    yield from started_machine(cpus=2)


def _started(machine, program, *args: str) -> Inferior:
    """`program ARGS` spawned traced, GDB's events asked for, as the server's Inferior has it."""
    inside = install_program(machine, program)
    del machine.written[:]
    inferior = Inferior(machine)
    inferior.adopt(ProcessTarget(machine.ptrace.spawn(inside, [inside, *args]), exec_path=inside))
    inferior.gdb_features(EVENTS)
    return inferior


def _resume(inferior: Inferior, action: ResumeAction):
    """`vCont` with `action` (SIGCHLD passed on, as GDB passes it), then the stop, polled as the server does."""
    outcome = inferior.resume([action])
    ptrace = inferior.machine.ptrace
    while isinstance(outcome, Running):
        serial = ptrace.serial
        outcome = inferior.poll_stop()
        if outcome is None:
            ptrace.wait_serial(serial, WAIT_S)
            outcome = Running()
        elif isinstance(outcome, Signal) and outcome.signal == GDB_SIGCHLD:
            outcome = inferior.resume([ResumeAction(action.thread, signal=GDB_SIGCHLD, process=action.process)])
    return outcome


def _continue(inferior: Inferior, process: int):
    """`vCont;c:pPROCESS.-1`, then its stop."""
    return _resume(inferior, ResumeAction(-1, process=process))


def test_a_kept_fork_child_is_a_process_of_its_own(machine, tmp_path):
    program = compile_program("forks", "glibc-static", tmp_path)  # not PIE: work() where its symbol says
    work = symbol(program, "work")
    inferior = _started(machine, program, "work")
    parent = inferior.process.pid
    inferior.insert_breakpoint(BreakpointType.SOFTWARE, work, 1, thread=parent)
    fork = _continue(inferior, parent)
    assert isinstance(fork, Forked) and fork.thread == parent and not fork.vfork, fork
    child = fork.child
    assert inferior.threads() == (parent, child)
    assert (inferior.process_of(parent), inferior.process_of(child)) == (parent, child)
    spaces = {pid: inferior.processes[pid].tracee.space() for pid in (parent, child)}
    assert machine.int3s.holders(spaces[child], work) == {DEBUGGER}  # cloned with the copy of the memory
    with pytest.raises(RspError):
        inferior.detach(child + 1000)

    # the child alone: its breakpoint hits, the parent stays where the fork left it
    parent_rip = inferior.read_registers(parent)["rip"]
    hit = _continue(inferior, child)
    assert isinstance(hit, Signal) and hit.swbreak and hit.thread == child, hit
    assert inferior.read_registers(child)["rip"] == work
    assert inferior.read_registers(parent)["rip"] == parent_rip
    inferior.remove_breakpoint(BreakpointType.SOFTWARE, work, 1, thread=child)
    ended = _continue(inferior, child)
    assert ended == Exited(7) and ended.process == child, ended
    assert child not in inferior.processes and inferior.threads() == (parent,)
    assert machine.int3s.holders(spaces[parent], work) == {DEBUGGER}  # the parent's breakpoint is its own

    hit = _continue(inferior, parent)
    assert isinstance(hit, Signal) and hit.swbreak and hit.thread == parent, hit
    inferior.remove_breakpoint(BreakpointType.SOFTWARE, work, 1, thread=parent)
    ended = _continue(inferior, parent)
    assert ended == Exited(0) and ended.process == parent, ended
    assert bytes(machine.written) == b"parent work 1\nchild that ran work(): exited 7\n"


def test_an_exec_makes_the_process_anew_and_tells_the_listeners(machine, tmp_path):
    program = compile_program("execs", "glibc-static", tmp_path)
    image = symbol(program, "image")
    with open(program, "rb") as f:
        entry = ELFFile(f).header["e_entry"]
    inferior = _started(machine, program, "1")
    process = inferior.process
    told = []
    inferior.listeners.append(told.append)
    inferior.insert_breakpoint(BreakpointType.SOFTWARE, image, 1)
    hit = _continue(inferior, process.pid)
    assert isinstance(hit, Signal) and hit.swbreak, hit
    old_space, old_task = process.tracee.space(), process.leader.task
    inferior.remove_breakpoint(BreakpointType.SOFTWARE, image, 1)  # stepped over, as GDB steps over it
    assert _resume(inferior, ResumeAction(process.pid, step=True)) == Signal(5, process.pid)
    inferior.insert_breakpoint(BreakpointType.SOFTWARE, image, 1)
    execd = _continue(inferior, process.pid)
    assert execd == Execd(process.pid, process.exec_path) and process.exec_path.endswith(program.name), execd
    assert told == [process]  # the server's tracing follows the new image
    assert inferior.threads() == (process.pid,) and inferior.read_registers(process.pid)["rip"] == entry
    assert process.tracee.space().root != old_space.root and process.leader.task == old_task  # one thread: its slot
    assert _continue(inferior, process.pid) == Exited(0)  # the old image's breakpoint is none of the new one's
    assert bytes(machine.written) == b"image 1\nimage 0\n"


@pytest.mark.parametrize("multiprocess", [True, False])
def test_a_second_vrun_and_vattach_join_the_first_only_in_multiprocess(machine, tmp_path, multiprocess):
    """vRun and vAttach while a process lives: beside it when GDB speaks multiprocess (each process then resumed,
    ended or killed on its own, the others untouched), refused otherwise as gdbserver refuses them ("Already
    debugging a process"), the first process going on as GDB's (tests/programs/hello.c run, counted.c attached)."""
    hello = install_program(machine, compile_program("hello", "glibc-static", tmp_path))
    counted = install_program(machine, compile_program("counted", "glibc-static", tmp_path))
    del machine.written[:]
    inferior = Inferior(machine, start=lambda path, args: (machine.ptrace.spawn(hello, [hello, *args]), hello))
    inferior.gdb_features(("multiprocess+",) if multiprocess else ())
    first = inferior.run(hello, [])
    other = machine.processes.spawn(counted, [counted])  # a process of the machine's, running, to attach to
    if not multiprocess:
        with pytest.raises(RspError, match="already debugging"):
            inferior.run(hello, [])
        with pytest.raises(RspError, match="already debugging"):
            inferior.attach(other)
        assert inferior.threads() == (first.thread,)
        assert _continue(inferior, first.thread) == Exited(3)
        assert inferior.attach(other).thread == other  # none lives now: taken
        inferior.kill_process(other)
        return
    second = inferior.run("", [])  # the last program again, as GDB's vRun with no name
    attached = inferior.attach(other)
    with pytest.raises(RspError, match="already debugging"):
        inferior.attach(other)
    pids = (first.thread, second.thread, other)
    assert len(set(pids)) == 3 and attached.thread == other and inferior.process.pid == first.thread
    assert set(inferior.threads()) == set(pids)
    inferior.kill_process(other)
    assert set(inferior.threads()) == set(pids[:2])
    for pid in (second.thread, first.thread):  # each to its end alone, the first last
        ended = _continue(inferior, pid)
        assert ended == Exited(3) and ended.process == pid, ended
        assert pid not in inferior.processes
    assert inferior.process is None
