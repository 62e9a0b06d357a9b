"""Processes that make processes (fixtures/kernel/fork.c, exit.c; execve in process.c), on the machine: the test
program tests/programs/forks.c in every link mode against its native run (fork, exec across a pipe, wait4 and waitid
statuses, vfork, posix_spawn, SIGCHLD, an orphan, execve's and wait4's errors); the kernel's state after many forks
(every frame of RAM back, no zombie left); its limits, the machine going on past them (a fork bomb stops at the
process slots with EAGAIN, a fork with no RAM for the copy fails with ENOMEM); a zombie kept until its parent's
wait; execve while other threads run; a traced process whose fork child runs through the parent's breakpoint
(the int3 taken out of the child's copy: machine/int3s.py, tracee.py); and the ptrace events a debugger asks for
(fork, vfork and its end, exec: the stops, their messages, the traced child keeping the debugger's int3, an exec's
old int3s forgotten)."""

from __future__ import annotations

import re
import struct
import subprocess
import time

import pytest
from elftools.elf.elffile import ELFFile

from kgtp_sim.client import VMLINUX
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine import tracee as ptrace
from kgtp_sim.machine.int3s import DEBUGGER
from kgtp_sim.machine.process import EXIT_ZOMBIE, TASK_DEAD
from kgtp_sim.programs import install_program

from ..programs import MODES, compile_program

WAIT_S = 120
SIGTRAP, SIGCHLD = 5, 17


@pytest.fixture(scope="module")
def machine():
    """One machine of two CPUs for the module's programs; what they write on fd 1 is kept in `machine.written`."""
    machine = Machine(KernelImage.load(VMLINUX), cpus=2)
    machine.written = bytearray()
    machine.processes.sink = lambda fd, data: machine.written.extend(data) if fd == 1 else None
    machine.start()
    yield machine
    machine.shutdown()


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("forks")
    return lambda mode, name="forks": compile_program(name, mode, out_dir)


def run(machine, program, *args: str) -> tuple[int, bytes, int]:
    """The program run on the machine with `args`: its wait status, what it wrote on stdout, its pid."""
    inside = install_program(machine, program)
    del machine.written[:]
    pid = machine.processes.spawn(inside, [inside, *args], [])
    ended = machine.processes.wait(pid, WAIT_S)
    assert ended is not None, f"{program} {args} did not end: {machine.console_text()[-2000:]}"
    return ended.status, bytes(machine.written), pid


def process_slots(machine) -> list[tuple[int, int, int]]:
    """(pid, state, cpu) of each process slot of the kernel's tasks[] that is not free."""
    layout = machine.ptrace.layout
    tasks = machine.image.symbols["tasks"]
    first = struct.unpack("<Q", machine.read_memory(machine.image.address_of("signal_abi") + 24, 8))[0]
    raw = machine.read_memory(tasks.address, tasks.size)
    found = []
    for index in range(first, tasks.size // layout.size):
        base = index * layout.size
        state = struct.unpack_from("<q", raw, base + layout.state)[0]
        if state != TASK_DEAD:
            found.append((struct.unpack_from("<i", raw, base + layout.pid)[0], state,
                          struct.unpack_from("<i", raw, base + layout.cpu)[0]))
    return found


def settled(machine) -> list[tuple[int, int, int]]:
    """The process slots once every one that ended is off its CPU (a slot is freed after the switch that follows
    a process's end): none is expected to stay."""
    deadline = time.monotonic() + 10
    while (slots := process_slots(machine)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return slots


@pytest.mark.parametrize("mode", sorted(MODES))
def test_fork_exec_and_wait_as_natively(machine, build, mode):
    program = build(mode)
    native = subprocess.run([str(program)], capture_output=True, timeout=60)
    status, out, _ = run(machine, program)
    assert native.returncode == 0, native
    assert out == native.stdout, out.decode()
    assert status == 0
    assert b"exec'd child: exited 7\n" in out and b"FORKS=yes" in out and b"close-on-exec closed" in out
    assert b"child that raised SIGTERM: killed by signal 15\n" in out
    assert b"execve with a bad argument: -1 EFAULT\n" in out
    assert settled(machine) == []  # every child reaped, the orphan's slot freed at its end


def test_many_forks_give_every_frame_back_and_leave_no_zombie(machine, build):
    program = build("glibc-dynamic")
    install_program(machine, program)
    free, forks, reaped = (machine.read_symbol(name) for name in ("nr_free_pages", "nr_forks", "nr_reaped"))
    status, out, _ = run(machine, program, "many", "200")
    assert (status, out) == (0, b"200 children ended as they were told\n")
    assert machine.read_symbol("nr_forks") - forks == 200
    assert machine.read_symbol("nr_reaped") - reaped == 200
    assert settled(machine) == []
    assert machine.read_symbol("nr_free_pages") == free  # copies, page tables, pipes: all given back


def test_a_fork_bomb_stops_at_the_process_slots_and_the_machine_goes_on(machine, build):
    program = build("musl-static")
    install_program(machine, program)
    free = machine.read_symbol("nr_free_pages")
    status, out, _ = run(machine, program, "bomb")
    found = re.search(rb"fork failed with EAGAIN after (\d+) children; (\d+) reaped\n", out)
    assert found and found.group(1) == found.group(2) and int(found.group(1)) > 10, out
    assert b"a fork after them: exited 9\n" in out and status == 0, out
    assert settled(machine) == []
    assert machine.read_symbol("nr_free_pages") == free


def test_a_fork_with_no_ram_for_the_copy_fails_with_enomem(machine, build):
    program = build("glibc-static")
    install_program(machine, program)
    free = machine.read_symbol("nr_free_pages")
    assert free * 4096 < 2 * (40 << 20)  # the machine cannot hold the process and its copy
    status, out, _ = run(machine, program, "hog", "40")
    assert (status, out) == (0, b"fork with 40 MiB: ENOMEM\n")
    status, out, _ = run(machine, program, "hog", "4")  # one that fits
    assert (status, out) == (0, b"fork with all that memory: exited 1\n")
    assert settled(machine) == []
    assert machine.read_symbol("nr_free_pages") == free  # the failed copy's frames too


def test_a_child_is_a_zombie_until_its_parent_waits(machine, build):
    program = build("glibc-static")
    inside = install_program(machine, program)
    del machine.written[:]
    pid = machine.processes.spawn(inside, [inside, "zombie"], [])
    deadline = time.monotonic() + WAIT_S
    while not (found := re.search(rb"child (\d+)\n", bytes(machine.written))):
        assert time.monotonic() < deadline, machine.written
        time.sleep(0.01)
    child = int(found.group(1))
    seen = set()
    while machine.processes.wait(pid, 0) is None:  # the parent sleeps half a second before its wait
        seen.update(state for slot_pid, state, cpu in process_slots(machine) if slot_pid == child and cpu < 0)
        time.sleep(0.005)
    assert seen == {EXIT_ZOMBIE}, seen  # ended and off its CPU: kept for the parent, and for nothing else
    assert machine.processes.wait(pid).status == 0
    assert machine.processes.exited()[child] == 3 << 8  # the machine heard of its end as of any process's
    assert bytes(machine.written).endswith(b"the zombie: exited 3\n")
    assert settled(machine) == []


@pytest.mark.parametrize("caller", ["main", "thread"])
@pytest.mark.parametrize("mode", ["glibc-dynamic", "musl-static"])
def test_execve_ends_the_other_threads_and_keeps_the_pid(machine, build, mode, caller):
    program = build(mode)
    status, out, _ = run(machine, program, "thread-exec", caller)  # the status of the pid it was started with
    assert (status, out) == (8 << 8, b"argc 5, exec-child, close-on-exec closed, FORKS=(unset)\n")
    assert settled(machine) == []


def _symbol(program, name: str) -> int:
    with open(program, "rb") as f:
        return ELFFile(f).get_section_by_name(".symtab").get_symbol_by_name(name)[0]["st_value"]


def test_a_traced_process_fork_child_runs_through_its_parents_breakpoint(machine, build):
    """The debugger's int3 at work(), in the parent's memory before the fork: the parent stops there, the child
    (untraced, its memory a copy) runs work() and ends as it should, the int3 taken out of its copy."""
    program = build("glibc-static")  # not PIE: work() where its symbol says
    work = _symbol(program, "work")
    inside = install_program(machine, program)
    del machine.written[:]
    forks, taken = machine.ptrace.forks, machine.ptrace.int3s_taken
    tracee = machine.ptrace.spawn(inside, [inside, "work"])
    assert tracee.debugger_int3s([work], []) == [True]
    hits, after = 0, tracee.resume()
    while (stop := machine.ptrace.wait(tracee.pid, after, WAIT_S)) is not None:
        signal = stop.signal
        if signal != SIGCHLD:  # SIGCHLD, the child's end, is shown to the debugger first: passed on, as GDB does
            assert signal == SIGTRAP and tracee.pc() == work + 1, stop
            hits += 1
            tracee.debugger_int3s([], [work])
            tracee.set_pc(work)
            signal = 0
        after = tracee.resume(signal=signal)
    assert hits == 1
    ended = machine.processes.wait(tracee.pid, WAIT_S)
    assert ended is not None and ended.status == 0, (ended, machine.written)
    assert bytes(machine.written) == b"parent work 1\nchild that ran work(): exited 7\n"
    assert (machine.ptrace.forks - forks, machine.ptrace.int3s_taken - taken) == (1, 1)
    assert settled(machine) == []


EVENTS = (ptrace.PTRACE_O_TRACEFORK | ptrace.PTRACE_O_TRACEVFORK | ptrace.PTRACE_O_TRACEVFORKDONE
          | ptrace.PTRACE_O_TRACEEXEC)


def _next_stop(machine, tracee, after):
    """`tracee`'s next stop after serial `after` (None: it ended); SIGCHLD, the end of a child, passed on."""
    while True:
        stop = machine.ptrace.wait(tracee.pid, after, WAIT_S)
        if stop is None or stop.event or stop.signal != SIGCHLD:
            return stop
        after = tracee.resume(signal=SIGCHLD)


def test_with_fork_events_the_child_is_traced_stopped_and_keeps_the_debuggers_int3(machine, build):
    """PTRACE_O_TRACEFORK: the parent stops at its fork (PTRACE_EVENT_FORK, the child's pid the message); the child
    is traced, stopped quietly before its first instruction, with its parent's options; its copy keeps the
    debugger's int3 at work(), held in its own space (the debugger takes it out or keeps it), none taken out; once
    the debugger took it out and let the child go, it runs work() and ends as it should."""
    program = build("glibc-static")
    work = _symbol(program, "work")
    inside = install_program(machine, program)
    del machine.written[:]
    taken = machine.ptrace.int3s_taken
    tracee = machine.ptrace.spawn(inside, [inside, "work"])
    assert tracee.set_options(EVENTS)
    assert tracee.debugger_int3s([work], []) == [True]
    stop = _next_stop(machine, tracee, tracee.resume())
    assert (stop.signal, stop.event) == (SIGTRAP, ptrace.PTRACE_EVENT_FORK), stop
    child_pid = tracee.event_message()
    first = machine.ptrace.wait(child_pid, 0, WAIT_S)
    assert first is not None and (first.signal, first.event) == (0, 0), first
    child = ptrace.Tracee(machine.ptrace, child_pid, first.task)
    assert child.registers()["rip"] == tracee.registers()["rip"]  # both after the fork's `syscall`
    assert child.set_options(EVENTS)  # traced, as its parent
    space = child.space()
    assert machine.int3s.holders(space, work) == {DEBUGGER}
    assert child.read_memory(work, 1) == b"\xcc" and child.read_memory(work, 1, hide_int3s=True) != b"\xcc"
    assert machine.ptrace.int3s_taken == taken
    child.debugger_int3s([], [work])
    assert child.read_memory(work, 1) != b"\xcc"
    child.detach()
    tracee.debugger_int3s([], [work])
    assert _next_stop(machine, tracee, tracee.resume()) is None
    assert machine.processes.wait(tracee.pid, WAIT_S).status == 0
    assert bytes(machine.written) == b"parent work 1\nchild that ran work(): exited 7\n"
    assert settled(machine) == []


def test_a_vfork_stops_its_parent_twice_and_an_exec_is_an_event(machine, build):
    """PTRACE_EVENT_VFORK, then (the child detached, it execs) PTRACE_EVENT_VFORK_DONE of the waiting parent; a
    traced child's exec is PTRACE_EVENT_EXEC at the new program's first instruction, its former tid the message,
    and the int3s held in the old image's space are forgotten with it (that space is no longer the child's)."""
    program = build("glibc-static", "execs")
    image = _symbol(program, "image")
    with open(program, "rb") as f:
        entry = ELFFile(f).header["e_entry"]
    inside = install_program(machine, program)
    del machine.written[:]
    tracee = machine.ptrace.spawn(inside, [inside, "vfork"])
    assert tracee.set_options(EVENTS)
    stop = _next_stop(machine, tracee, tracee.resume())
    assert (stop.signal, stop.event) == (SIGTRAP, ptrace.PTRACE_EVENT_VFORK), stop
    child_pid = tracee.event_message()
    first = machine.ptrace.wait(child_pid, 0, WAIT_S)
    child = ptrace.Tracee(machine.ptrace, child_pid, first.task)
    assert child.debugger_int3s([image], []) == [True]
    old = child.space()
    after = child.resume()
    exec_stop = machine.ptrace.wait(child_pid, after, WAIT_S)
    assert (exec_stop.signal, exec_stop.event) == (SIGTRAP, ptrace.PTRACE_EVENT_EXEC), exec_stop
    child = ptrace.Tracee(machine.ptrace, child_pid, exec_stop.task)
    assert child.event_message() == child_pid
    assert child.registers()["rip"] == entry
    assert machine.int3s.holders(old, image) == frozenset()
    assert child.space().root != old.root
    child.detach()
    stop = _next_stop(machine, tracee, tracee.resume())
    assert (stop.signal, stop.event) == (SIGTRAP, ptrace.PTRACE_EVENT_VFORK_DONE), stop
    assert tracee.event_message() == child_pid
    assert _next_stop(machine, tracee, tracee.resume()) is None
    assert machine.processes.wait(tracee.pid, WAIT_S).status == 0
    assert bytes(machine.written) == b"image 0\nvfork child: exited 0\n"
    assert settled(machine) == []
