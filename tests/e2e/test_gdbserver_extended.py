"""`kgtp-sim gdbserver --multi` under GDB's `target extended-remote`, with real GDB 13.1 and 18.1, beside Debian's
gdbserver (/usr/bin/gdbserver) given the same commands: a server started without a program, `run` of a host
program (vRun: the file and its libraries go into the running machine), a breakpoint, the exit, `run` again, `kill`,
`detach` and `attach` to the process left running, `info os processes`, and the errors of a bad vRun and vAttach.
The same GDB session against both servers must print the same (normalized as test_gdbserver_role.py does).

Every wait is for an event (a line a server prints, GDB's end); each test stops the servers it started.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from kgtp_sim.client import ROOT, GdbClient, batch_argv, command_file, kgtp_command
from kgtp_sim.client.gdb import gdb_environment

from .test_gdbserver_role import GDBSERVER, KINDS, LINE, MAIN_MODE, QUIET, WAIT_S, Server, _gdb, build, normalized

pytestmark = pytest.mark.gdb

__all__ = ["build"]  # the fixture, shared with the role's tests


@pytest.fixture
def multi():
    """Start a server with no program: `multi(kind, *options)` -> a Server listening; stopped at the end."""
    started: list[Server] = []

    def start(kind: str, *options: str) -> Server:
        if kind == "kgtp-sim":
            argv = kgtp_command("gdbserver", "--multi", *options, ":0")
        else:
            if not Path(GDBSERVER).exists():
                pytest.skip(f"no {GDBSERVER} on this host (Debian's gdbserver package)")
            argv = [GDBSERVER, "--multi", *options, ":0"]
        server = Server(argv)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


#: a command GDB may refuse, run without ending the command file (GDB stops a sourced file at its first error)
TRY = ["python", "def attempt(command):", "    try:", "        gdb.execute(command)",
       "    except gdb.error as error:", "        print(error)", "end"]


def attempt(command: str) -> str:
    return f"python attempt({command!r})"


def extended_session(gdb: GdbClient, program: Path | None, port: int, commands: list[str],
                     before: tuple[str, ...] = ()) -> str:
    """GDB in batch mode (on `program`'s symbols), `target extended-remote` to `port` (after the settings
    `before`), running `commands`."""
    lines = ["set pagination off", "set confirm off", "set width 0", *QUIET, *TRY, *before,
             f"target extended-remote 127.0.0.1:{port}", *commands]
    with command_file(lines) as script:
        process = subprocess.Popen(batch_argv(gdb, "-x", str(script), program=program), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, env=gdb_environment(), cwd=ROOT)
        try:
            return process.communicate(timeout=WAIT_S * 2)[0]
        except subprocess.TimeoutExpired:
            process.kill()
            raise AssertionError("GDB did not end its session; it printed:\n" + process.communicate()[0]) from None


def _session(multi, kind: str, gdb: GdbClient, program: Path | None, commands: list[str],
             before: tuple[str, ...] = ()) -> tuple[str, Server]:
    server = multi(kind)
    try:
        out = extended_session(gdb, program, server.listening(), [*commands, "monitor exit"], before)
    except AssertionError as error:
        raise AssertionError(f"{error}\n---- the server printed:\n{server.text()}") from None
    try:
        status = server.wait()
    except AssertionError as error:  # GDB's session is what tells why it left without `monitor exit`
        raise AssertionError(f"{error}\n---- GDB printed:\n{out}") from None
    assert status == 0, server.text()
    return out, server


def assert_in_order(out: str, *patterns: str) -> None:
    at = 0
    for pattern in patterns:
        found = re.compile(pattern, re.M).search(out, at)
        assert found, f"{pattern!r} not found after offset {at} in:\n{out}"
        at = found.end()


RUN_AGAIN = ["break main", "run", "continue", "run", "info breakpoints", "kill", "run", "next", "kill"]


@pytest.mark.parametrize("version", ["13", "18"])
def test_run_break_exit_run_again_and_kill_as_under_gdbserver(build, multi, version):
    """`run` starts the program at main's breakpoint; it exits with its code and GDB stays connected; `run` again
    and `kill` twice, and the server, still up, ends at `monitor exit`; the same session under Debian's
    gdbserver prints the same."""
    gdb = _gdb(version)
    program = build(MAIN_MODE)
    outs = {}
    for kind in KINDS:
        out, server = _session(multi, kind, gdb, program, [f"set remote exec-file {program}", *RUN_AGAIN])
        assert_in_order(out, rf"Breakpoint 1, main \(.*debugme\.c:{LINE['main']}",
                        r"\[Inferior 1 \(process \d+\) exited with code 012\]",
                        rf"Breakpoint 1, main \(", r"breakpoint already hit 1 time",
                        r"\[Inferior 1 \(process \d+\) killed\]", rf"Breakpoint 1, main \(",
                        r"\[Inferior 1 \(process \d+\) killed\]")
        assert_in_order(server.text(), r"^Process .*debugme.* created; pid = \d+$", r"^Child exited with status 10$",
                        r"^Process .* created; pid = \d+$", r"^Process .* created; pid = \d+$")
        outs[kind] = normalized(out)
    assert outs["kgtp-sim"] == outs["gdbserver"]


@pytest.fixture
def workers(tmp_path):
    program = tmp_path / "workers"
    subprocess.run(["gcc", "-g", "-O0", "-pthread", str(Path(__file__).parents[1] / "programs" / "workers.c"), "-o",
                    str(program)], check=True, capture_output=True)
    return program


ATTACH = ["break work", "run forever", "delete", "python pid = gdb.selected_inferior().pid", "detach",
          "python gdb.execute(f'attach {pid}')", "break work", "continue", "print counter > 0",
          "set var stop_all = 1", "delete", "continue"]


#: the same in non-stop mode: the attach stops every thread, and each thread's stop is reported once it is resumed
#: (as gdbserver does: the attach's SIGSTOPs, `Thread N stopped`), so GDB goes on until work()'s breakpoint and
#: then until the end
NS_ATTACH = ["break work", "run forever", "delete", "python pid = gdb.selected_inferior().pid", "detach",
             "python gdb.execute(f'attach {pid}')", "break work",
             "python", "hits, ends = [], []",
             "gdb.events.stop.connect(lambda e: hits.append(e.inferior_thread.num) "
             "if isinstance(e, gdb.BreakpointEvent) else None)",
             "gdb.events.exited.connect(ends.append)",
             "while not hits:", "    gdb.execute('continue -a')", "gdb.execute(f'thread {hits[0]}')", "end",
             "print counter > 0", "set var stop_all = 1", "delete",
             "python", "while not ends:", "    gdb.execute('continue -a')", "end"]


@pytest.mark.parametrize("non_stop", [False, True], ids=["all-stop", "non-stop"])
@pytest.mark.parametrize("version", ["13", "18"])
def test_detach_leaves_the_program_running_and_attach_takes_it_again(workers, multi, version, non_stop):
    """A threaded program run, then detached (it goes on), then attached by pid: every thread stopped, a breakpoint
    in the threads hit, and it runs to its end once told to; as under gdbserver. In non-stop mode the detach finds
    the other threads running and the attach stops every thread without a stop GDB waits for (`continue -a`
    resumes them all)."""
    gdb = _gdb(version)
    outs = {}
    before = ("set non-stop on",) if non_stop else ()
    commands = NS_ATTACH if non_stop else ATTACH
    for kind in KINDS:
        out, server = _session(multi, kind, gdb, workers, [f"set remote exec-file {workers}", *commands], before)
        assert_in_order(out, r"hit Breakpoint 1, work \(id=\d\)", r"\[Inferior 1 \(process \d+\) detached\]",
                        r"hit Breakpoint 2, work \(id=\d\)", r"^\$1 = 1$",
                        r"\[Inferior 1 \(process \d+\) exited normally\]")
        assert_in_order(server.text(), r"^Detaching from process \d+$", r"^Attached; pid = \d+$")
        outs[kind] = [line for line in normalized(out) if "futex" not in line and "nanosleep" not in line]
    # where each thread is when attached, and which one hits work() first, differ with the timing: the stops and
    # the ends do not
    def events(lines: list[str]) -> list[str]:
        return [re.sub(r"Thread \d+|id=\d", "…", line) for line in lines if "Breakpoint" in line or "Inferior" in line]

    assert events(outs["kgtp-sim"]) == events(outs["gdbserver"])


def _inferiors(out: str) -> list[str]:
    """GDB's lines about processes and stops, process ids and stack addresses made equal (each server numbers its
    own; the environment's size differs)."""
    keep = re.compile(r"^(\[Inferior|\[Switching to inferior|Thread \S+ .*hit Breakpoint|Breakpoint \d|\*? +\d+ +"
                      r"(process|<null>)|\$\d+ = )")
    return [re.sub(r"process \d+|Thread \d+\.\d+|id=\d|0x0*7ff[0-9a-f]{9}\b", "…", line).split(" 1 (extended-remote")[0]
            .rstrip() for line in out.splitlines() if keep.match(line)]


@pytest.mark.parametrize("version", ["13", "18"])
def test_a_second_inferior_is_run_beside_the_first_as_under_gdbserver(build, multi, version):
    """`add-inferior` and `run` while the first process is stopped at main (vRun in multiprocess mode): both are
    GDB's, each stops at main's breakpoint, runs to its end on its own `continue` and exits with its code; as under
    gdbserver, whose lines (a process created, a child exited) the server prints for each."""
    gdb = _gdb(version)
    program = build(MAIN_MODE)
    commands = [f"set remote exec-file {program}", "break main", "run", f"add-inferior -exec {program}",
                "inferior 2", "run", "info inferiors", "continue", "info inferiors", "inferior 1", "continue",
                "info inferiors"]
    outs = {}
    for kind in KINDS:
        out, server = _session(multi, kind, gdb, program, commands)
        assert_in_order(out, rf"^Breakpoint 1, main \(.*debugme\.c:{LINE['main']}",
                        rf"hit Breakpoint 1\.2, main \(.*debugme\.c:{LINE['main']}",
                        r"^  1 +process \d+ ", r"^\* 2 +process \d+ ",
                        r"\[Inferior 2 \(process \d+\) exited with code 012\]",
                        r"\[Inferior 1 \(process \d+\) exited with code 012\]", r"^\* 1 +<null> ")
        assert_in_order(server.text(), r"^Process .*debugme.* created; pid = \d+$",
                        r"^Process .*debugme.* created; pid = \d+$", r"^Child exited with status 10$",
                        r"^Child exited with status 10$")
        outs[kind] = _inferiors(out)
    assert outs["kgtp-sim"] == outs["gdbserver"]


@pytest.mark.parametrize("version", ["13", "18"])
def test_a_second_inferior_attaches_beside_the_first_as_under_gdbserver(build, workers, multi, version):
    """A threaded program run, detached (it goes on), then another run to main; `add-inferior` and `attach` to the
    first (vAttach in multiprocess mode): its breakpoint hit in its threads, it ends once told to, and the other
    inferior then runs to its end; as under gdbserver."""
    gdb = _gdb(version)
    program = build(MAIN_MODE)
    commands = [f"set remote exec-file {workers}", "break work", "run forever", "delete",
                "python pid = gdb.selected_inferior().pid", "detach", f"set remote exec-file {program}",
                f"file {program}", "break main", "run", "add-inferior", "inferior 2", f"file {workers}",
                "python gdb.execute(f'attach {pid}')", "break work", "continue", "print counter > 0",
                "set var stop_all = 1", "delete", "continue", "inferior 1", "continue", "info inferiors"]
    outs = {}
    for kind in KINDS:
        out, server = _session(multi, kind, gdb, workers, commands)
        assert_in_order(out, r"\[Inferior 1 \(process \d+\) detached\]", r"^Breakpoint 2, main \(",
                        r"hit Breakpoint 3(\.\d)?, work \(id=\d\)", r"^\$1 = 1$",
                        r"\[Inferior 2 \(process \d+\) exited normally\]",
                        r"\[Inferior 1 \(process \d+\) exited with code 012\]")
        assert_in_order(server.text(), r"^Detaching from process \d+$", r"^Process .*debugme.* created",
                        r"^Attached; pid = \d+$")
        outs[kind] = _inferiors(out)
    assert outs["kgtp-sim"] == outs["gdbserver"]


def test_info_os_processes_lists_the_machines_processes(build, multi):
    """gdbserver's table (pid, user, command, cores): the kernel's threads as [comm], the program with its
    arguments."""
    program = build(MAIN_MODE)
    out, _server = _session(multi, "kgtp-sim", _gdb("13"), program,
                            [f"set remote exec-file {program}", "break main", "run", "info os processes"])
    assert re.search(r"^0\s+root\s+\[swapper/0\]\s+0\s*$", out, re.M), out
    assert re.search(rf"^100\s+root\s+{re.escape(str(program))}\s+\d\s*$", out, re.M), out


def test_a_bad_vrun_and_a_bad_vattach_are_errors_and_the_server_goes_on(tmp_path, build, multi):
    """A file that is not there, one that is no program, a pid no process has, a kernel thread's: GDB says the run
    or the attach failed (as with Debian's gdbserver, which prints the same first failure but then crashes when GDB
    goes on: not compared), and the server then runs a good program."""
    program = build(MAIN_MODE)
    text = tmp_path / "notes.txt"
    text.write_text("no program\n")
    commands = ["set remote exec-file /nonexistent/prog", attempt("run"), f"set remote exec-file {text}",
                attempt("run"), attempt("attach 999999"), attempt("attach 2"), f"set remote exec-file {program}",
                "break main", "run"]
    out, server = _session(multi, "kgtp-sim", _gdb("13"), program, commands)
    assert_in_order(out, r'Running "/nonexistent/prog" on the remote target failed',
                    rf'Running "{re.escape(str(text))}" on the remote target failed',
                    r"Attaching to process 999999 failed", r"Attaching to process 2 failed", r"Breakpoint 1, main \(")
    assert_in_order(server.text(), r"cannot run /nonexistent/prog: No such file or directory",
                    r"cannot run .*notes\.txt: not an ELF file", r"Cannot attach to process 999999: No such process",
                    r"Cannot attach to process 2: Operation not permitted")


def test_attach_on_the_command_line_to_no_such_process_is_refused(tmp_path):
    """`--attach COMM PID` with no process PID on the machine: gdbserver's message, status 1."""
    result = subprocess.run(kgtp_command("gdbserver", "--attach", ":0", "4242"), capture_output=True, text=True,
                            cwd=ROOT, timeout=WAIT_S)
    assert result.returncode == 1
    assert "Cannot attach to process 4242: No such process" in result.stderr, result.stderr
