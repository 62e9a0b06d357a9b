"""Unmodified Linux programs as processes on the simulated kernel (`kgtp-sim run`), static and dynamically linked,
each compared with the same program run natively: same output, same exit status; and what the kernel does with
one it cannot run."""

from __future__ import annotations

import os
import subprocess

import pytest

from kgtp_sim.client.paths import ROOT
from kgtp_sim.client.stub import kgtp_command

from ..programs import DYNAMIC_MODES, LIBRARY, MODES, compile_program, compile_with_library

ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "KGTP_TEST": "from the host", "LC_ALL": "C"}


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("programs")
    return lambda name, mode: compile_program(name, mode, out_dir)


def _native(program, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([str(program), *args], capture_output=True, env=ENV, timeout=30)
    if done.returncode < 0:  # a signal, as a shell reports it
        done.returncode = 128 - done.returncode
    return done


def _simulated(program, *args: str, cpus: int = 1) -> subprocess.CompletedProcess:
    return subprocess.run(kgtp_command("run", "--cpus", str(cpus), str(program), *args), capture_output=True,
                          env={**os.environ, **ENV}, timeout=120, cwd=ROOT)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_hello_world_as_natively(build, mode):
    program = build("hello", mode)
    native, simulated = _native(program), _simulated(program)
    assert simulated.stdout == native.stdout == b"hello, world\n", simulated
    assert simulated.returncode == native.returncode == 3, simulated
    assert simulated.stderr == b"", simulated


@pytest.mark.parametrize("mode", sorted(MODES))
def test_arguments_environment_heap_and_doubles(build, mode):
    program = build("args", mode)
    native = _native(program, "one", "two words", "", "7")
    simulated = _simulated(program, "one", "two words", "", "7", cpus=2)
    # argv[0] is the path as given to each: the same here
    assert simulated.stdout == native.stdout, (simulated, native)
    assert b'argv[2] = "two words"' in simulated.stdout and b"KGTP_TEST=from the host" in simulated.stdout
    assert simulated.stderr == native.stderr == b"to stderr\n", simulated
    assert simulated.returncode == native.returncode == 7


@pytest.mark.parametrize("name, signal_name, status", [("segv", "SIGSEGV", 139), ("trap", "SIGILL", 132)])
@pytest.mark.parametrize("mode", ["musl-static", "glibc-static", *DYNAMIC_MODES])
def test_a_fault_ends_the_process_with_its_signal(build, mode, name, signal_name, status):
    program = build(name, mode)
    native, simulated = _native(program), _simulated(program)
    assert simulated.returncode == native.returncode == status, simulated
    assert simulated.stdout == native.stdout, simulated
    assert simulated.stderr.decode().strip() == f"kgtp-sim: {program}: killed by {signal_name}", simulated


@pytest.mark.parametrize("cpus", [1, 2])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_signal_handlers_masks_and_default_actions_as_natively(build, mode, cpus):
    program = build("signals", mode)
    native, simulated = _native(program), _simulated(program, cpus=cpus)
    assert simulated.stdout == native.stdout, (simulated, native)
    assert b"raised: got 10 code -6\n" in native.stdout and b"segv at 0x1234\n" in native.stdout
    assert simulated.returncode == native.returncode == 128 + 15, simulated


@pytest.mark.parametrize("mode", sorted(MODES))
def test_interval_timers_and_pause_as_natively(build, mode):
    program = build("timers", mode)
    native, simulated = _native(program), _simulated(program)
    assert simulated.stdout == native.stdout == b"alarm 1 left 0\nvt 1\nalarms 4\n", (simulated, native)
    assert simulated.returncode == native.returncode == 0, simulated


@pytest.mark.parametrize("mode", ["glibc-static", "glibc-dynamic", "musl-static"])
def test_standard_input_reaches_the_program_to_its_end(build, mode):
    """The host's standard input, more than the kernel's 4 KiB ring at once, read to end of file."""
    program = build("cat", mode)
    text = b"".join(b"line %d of the input\n" % i for i in range(2000))
    native = subprocess.run([str(program)], input=text, capture_output=True, timeout=60)
    simulated = subprocess.run(kgtp_command("run", str(program)), input=text, capture_output=True,
                               env={**os.environ, **ENV}, timeout=120, cwd=ROOT)
    assert simulated.stdout == native.stdout == text, simulated.stderr
    assert simulated.stderr == native.stderr == b"read %d tty 0\n" % len(text), simulated.stderr
    assert simulated.returncode == native.returncode == 0


def test_a_terminal_on_the_host_is_one_inside(build):
    """stdout a terminal here: TCGETS succeeds inside too (the C library line-buffers it, as at a terminal)."""
    import pty

    program = build("cat", "glibc-static")
    leader, follower = pty.openpty()
    try:
        simulated = subprocess.run(kgtp_command("run", str(program)), input=b"", stdout=follower,
                                   stderr=subprocess.PIPE, env={**os.environ, **ENV}, timeout=120, cwd=ROOT)
    finally:
        os.close(follower)
        os.close(leader)
    assert simulated.stderr == b"read 0 tty 1\n", simulated.stderr
    assert simulated.returncode == 0


def test_a_file_that_is_no_program_is_refused_with_a_message(tmp_path):
    data = tmp_path / "notes.txt"
    data.write_text("not a program\n")
    simulated = _simulated(data)
    assert simulated.returncode == 126, simulated
    assert simulated.stderr.decode() == f"{data}: cannot execute: not an ELF file\n", simulated


@pytest.mark.parametrize("mode", sorted(MODES))
def test_file_system_calls_on_its_own_file(build, mode):
    program = build("files", mode)
    native, simulated = _native(program), _simulated(program)
    assert simulated.stdout == native.stdout, (simulated, native)
    assert b"mmap matches" in simulated.stdout and b"a missing file: ENOENT" in simulated.stdout, simulated
    assert simulated.returncode == native.returncode == 0, simulated


@pytest.mark.parametrize("cpus", [1, 2])
@pytest.mark.parametrize("mode", DYNAMIC_MODES)
def test_a_program_with_a_library_of_its_own(tmp_path, mode, cpus):
    program = compile_with_library(mode, tmp_path)
    native, simulated = _native(program), _simulated(program, cpus=cpus)
    assert simulated.stdout == native.stdout == b"hello from a library, counter 42\n", simulated
    assert simulated.returncode == native.returncode == 5, simulated
    assert simulated.stderr == b"", simulated


def test_a_library_that_is_not_found_is_named_before_boot(tmp_path):
    program = compile_with_library("glibc-dynamic", tmp_path)
    (program.parent / "lib" / LIBRARY).unlink()
    simulated = _simulated(program)
    assert simulated.returncode == 127 and simulated.stdout == b"", simulated
    assert simulated.stderr.decode().startswith(f"kgtp-sim: {program}: needs the library {LIBRARY} ("), simulated


def test_a_program_of_the_host_system(tmp_path):
    printf = "/usr/bin/printf"
    if not os.path.exists(printf):
        pytest.skip(f"no {printf}")
    native, simulated = _native(printf, "%s-%d\\n", "x", "42"), _simulated(printf, "%s-%d\\n", "x", "42")
    assert simulated.stdout == native.stdout == b"x-42\n", simulated
    assert simulated.returncode == native.returncode == 0, simulated


def test_a_missing_program(tmp_path):
    simulated = _simulated(tmp_path / "absent")
    assert simulated.returncode == 127 and b"absent" in simulated.stderr, simulated


@pytest.mark.parametrize("cpus", [1, 2])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_threads_as_natively(build, mode, cpus):
    """pthreads: a mutex, a condition variable, thread-local storage, tids, pthread_exit's value, a timed wait and a
    measured nanosleep (clone/clone3, futex, the clocks), on one CPU and on two."""
    program = build("threads", mode)
    native, simulated = _native(program), _simulated(program, cpus=cpus)
    assert simulated.stdout == native.stdout, (simulated, native)
    assert b"thread 3 returned 103\ncounter 12000 (expected 12000)\n" in native.stdout
    assert b": no" not in native.stdout and b"ETIMEDOUT" in native.stdout
    assert simulated.returncode == native.returncode == 4, simulated
    assert simulated.stderr == b"", simulated


@pytest.mark.parametrize("cpus", [1, 2])
@pytest.mark.parametrize("mode", ["glibc-dynamic", "musl-static"])
def test_a_thread_waiting_in_short_sleeps_lets_its_new_thread_run(build, mode, cpus):
    """The creator spins in usleep(1) until its new thread has run (GDB's in-process agent does so at load, in
    every program that links it). Each sleep of the kernel returns at once (its deadline passed on the way in),
    so the new thread runs at the creator's next tick on its CPU, or on the other; a tick that comes while the
    creator's kernel has interrupts off must be taken when they are on again, not at some later retry (the creator
    spent seconds, its reads of the clock with interrupts off dominating the host's time)."""
    program = build("handoff", mode)
    native, simulated = _native(program), _simulated(program, cpus=cpus)
    assert simulated.stdout == native.stdout, (simulated, native)
    assert native.stdout.count(b"with a tid of its own yes\n") == 5 and native.stdout.endswith(b": yes\n")
    assert simulated.returncode == native.returncode == 0, simulated


@pytest.mark.parametrize("cpus", [1, 2])
@pytest.mark.parametrize("mode", ["glibc-static", "glibc-dynamic", "musl-static"])
def test_exit_from_a_thread_ends_the_process_with_its_status(build, mode, cpus):
    program = build("threads", mode)
    native, simulated = _native(program, "exit"), _simulated(program, "exit", cpus=cpus)
    assert simulated.stdout == native.stdout == b"main waits for a thread that exits\n", simulated
    assert simulated.returncode == native.returncode == 42, simulated
    assert simulated.stderr == b"", simulated


@pytest.mark.parametrize("cpus", [1, 2])
@pytest.mark.parametrize("mode", ["glibc-static", "musl-dynamic"])
def test_a_fault_in_a_thread_ends_the_whole_process(build, mode, cpus):
    program = build("threads", mode)
    native, simulated = _native(program, "segv"), _simulated(program, "segv", cpus=cpus)
    assert simulated.stdout == native.stdout == b"main waits for a thread that faults\n", simulated
    assert simulated.returncode == native.returncode == 139, simulated
    assert simulated.stderr.decode().strip() == f"kgtp-sim: {program}: killed by SIGSEGV", simulated


@pytest.mark.parametrize("cpus", [1, 2])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_pipes_and_descriptors_as_natively(build, mode, cpus):
    """A thread writes 200,000 bytes into a pipe (more than it holds) while main reads them to end of file; stdout
    onto a pipe with dup2 and back; dup, dup3's O_CLOEXEC, F_DUPFD; EAGAIN, EPIPE with SIGPIPE; statx against stat;
    sysinfo's figures."""
    program = build("pipes", mode)
    native, simulated = _native(program), _simulated(program, cpus=cpus)
    assert simulated.stdout == native.stdout, (simulated, native)
    assert b"read 200000 bytes, 0 wrong, end of file yes, writer yes\n" in native.stdout
    assert b"through the pipe: dup2 gives 1\n" in native.stdout
    assert b"write with no reader: -1 Broken pipe, SIGPIPE 1\n" in native.stdout
    assert b"statx: 0, size as stat's yes, a regular file yes, basic stats yes, inode as stat's yes" in native.stdout
    assert b"sysinfo: 0, uptime yes, RAM yes, free yes, tasks yes\n" in native.stdout
    assert b": no" not in native.stdout
    assert simulated.returncode == native.returncode == 0, simulated
    assert simulated.stderr == b"", simulated


@pytest.mark.parametrize("mode", ["glibc-static", "musl-dynamic"])
def test_a_write_nobody_reads_ends_the_program_with_sigpipe(build, mode):
    program = build("pipes", mode)
    native, simulated = _native(program, "sigpipe"), _simulated(program, "sigpipe")
    assert simulated.stdout == native.stdout == b"writing to a pipe nobody reads\n", simulated
    assert simulated.returncode == native.returncode == 128 + 13, simulated
    assert simulated.stderr.decode().strip() == f"kgtp-sim: {program}: killed by SIGPIPE", simulated


@pytest.mark.parametrize("mode", sorted(MODES))
def test_qsort_of_heap_records_as_natively(build, mode):
    program = build("sort", mode)
    native, simulated = _native(program), _simulated(program)
    assert simulated.stdout == native.stdout, (simulated, native)
    assert b"records sorted: 20000, out of order 0" in native.stdout
    assert b"numbers sorted: 200000, out of order 0" in native.stdout
    assert simulated.returncode == native.returncode == 0, simulated


@pytest.mark.parametrize("mode", sorted(MODES))
def test_sleeps_last_at_least_what_was_asked(build, mode):
    """nanosleep of 50 ms, usleep, clock_nanosleep to an absolute time: at least that long on CLOCK_MONOTONIC, and
    not beyond a plausible bound (not a tight one: the machine is emulated)."""
    program = build("sleep", mode)
    native, simulated = _native(program), _simulated(program)
    assert simulated.stdout == native.stdout, (simulated, native)
    assert native.stdout.count(b"returned 0, at least that long yes, under 5 s yes\n") == 3, native
    assert simulated.returncode == native.returncode == 0, simulated


@pytest.mark.parametrize("mode", sorted(MODES))
def test_mremap_grows_moves_and_shrinks_as_natively(build, mode):
    program = build("mremap", mode)
    native, simulated = _native(program), _simulated(program)
    assert simulated.stdout == native.stdout, (simulated, native)
    assert b"grown in place to 32 pages, same address and bytes kept: yes\n" in native.stdout
    assert b"moved: yes, bytes kept yes, new part usable yes\n" in native.stdout
    assert b": no" not in native.stdout and b", no" not in native.stdout
    assert simulated.returncode == native.returncode == 0, simulated
