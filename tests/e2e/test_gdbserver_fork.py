"""Programs that fork, vfork and exec, debugged through `kgtp-sim gdbserver` with real GDB (13.1 and 18.1), and the
same sessions under Debian's gdbserver: GDB asks for fork, vfork and exec events and gets them as gdbserver gives
them (stub/process.py, stub/extended.py), so that it does what it does with gdbserver.

- A breakpoint set in the parent before the fork, at a function the child runs too (tests/programs/forks.c,
  "work"): the parent stops there; the child, whose memory is a copy of the parent's with the breakpoint's int3 in
  it, does not die of it: GDB takes its breakpoints out of the child and detaches it (follow-fork-mode parent,
  detach-on-fork on), the child exits with the code the parent's wait4 checks, and the program ends normally.
- `catch fork` stops at the fork with the child's pid; `set follow-fork-mode child` follows the child (the parent
  detached), whose breakpoint hits; `set detach-on-fork off` keeps both (`info inferiors` lists two, `inferior 2`,
  each continued); all in non-stop too (MI, the fork's stop a notification).
- `catch vfork` (tests/programs/execs.c, "vfork": the child execs while its parent waits, vforkdone after);
  `catch exec` and an exec without a catchpoint (execs.c, "2": the process runs itself twice more): GDB reloads the
  new image, its breakpoints hit again, its libraries listed.
- A trace run over a fork: the child gets no tracepoint (int3 or fast tracepoint jump), the parent goes on
  collecting (gdbserver stops the trace run when GDB detaches the child: this server does not, see the test).

GDB's output under both servers is compared line for line once the pids, ports and stack addresses are made equal.
"""

from __future__ import annotations

import difflib
import re
import subprocess
from pathlib import Path

import pytest

from kgtp_sim.client import GDB_CLIENTS
from kgtp_sim.client.mi import GdbMi

from ..programs import MODES, SOURCES, compile_program
from .test_gdbserver_role import KINDS, MAIN_MODE, QUIET, assert_in_order, debug, normalized
from .test_gdbserver_role import servers  # noqa: F401 - a fixture, used by name

pytestmark = pytest.mark.gdb

SESSION = ["break work", "continue", "print who", "bt 1", "continue"]


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """forks.c (or execs.c) with its debugging information, unoptimized, in a link mode (tests/programs.py's
    compilers)."""
    out_dir = tmp_path_factory.mktemp("forks-debug")

    def build(mode: str, name: str = "forks") -> Path:
        compile_program(name, mode, out_dir)  # skips as that does when the mode cannot be built here
        out = out_dir / f"{name}-g-{mode}"
        if not out.exists():
            subprocess.run([*MODES[mode], "-pthread", "-g", "-O0", str(SOURCES / f"{name}.c"), "-o", str(out)],
                           check=True, capture_output=True)
        return out

    return build


@pytest.mark.parametrize("kind, cpus, mode", [("kgtp-sim", 2, "glibc-dynamic"), ("kgtp-sim", 1, "musl-static"),
                                              ("gdbserver", None, "glibc-dynamic")])
@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_the_parent_stops_at_a_breakpoint_its_fork_child_runs_through(build, servers, gdb, kind, cpus, mode):
    program = build(mode)
    out, server = debug(servers, kind, gdb, program, ("work",), SESSION, cpus=cpus)
    assert re.search(r"^Breakpoint 1, work \(who=0\) at \S*forks\.c:\d+$", out, re.M), out
    assert re.search(r"^\$1 = 0$", out, re.M), out  # the parent's call: the child's (who=3) never stops
    assert len(re.findall(r"^Breakpoint 1, ", out, re.M)) == 1, out
    assert re.search(r"^\[Inferior 1 \(.*\) exited normally\]$", out, re.M), out
    assert server.out["stdout"] == ["parent work 1", "child that ran work(): exited 7"], server.out


@pytest.mark.parametrize("kind", ["kgtp-sim", "gdbserver"])
def test_a_program_that_forks_execs_and_waits_runs_under_gdb_as_natively(build, servers, kind):
    """The whole of forks.c under GDB 13: each child's SIGCHLD stops the traced parent and GDB passes it on, and
    what it cut short (a nanosleep, a pipe's read, a wait) starts again, as on Linux: the output is the native
    run's. musl's: its posix_spawn tells an exec's failure through a pipe, where glibc's writes it in memory it
    shares with the child, which the kernel copies for a traced parent (the child's int3s taken out)."""
    program = build("musl-static")
    native = subprocess.run([str(program)], capture_output=True, text=True, timeout=60)
    out, server = debug(servers, kind, GDB_CLIENTS[0], program, (), ["continue"], cpus=2 if kind == "kgtp-sim" else None)
    assert re.search(r"^\[Inferior 1 \(.*\) exited normally\]$", out, re.M), out
    assert server.out["stdout"] == native.stdout.splitlines(), server.out


# ---- fork, vfork and exec events, beside gdbserver -------------------------------------------------------------------


def same(out: str) -> list[str]:
    """GDB's output as `normalized` makes it, and the processes' and threads' ids and the connection's port made
    equal (gdbserver's pids are the host's), with the spaces of the tables they widen."""
    lines = []
    for line in normalized(out):
        line = re.sub(r"\b(process|Thread) \d+(\.\d+)?", lambda m: f"{m.group(1)} N" + (".N" if m.group(2) else ""),
                      line)
        line = re.sub(r"\(remote 127\.0\.0\.1:\d+\)", "(remote …)", line)
        lines.append(re.sub(r" {2,}", " ", line).rstrip())
    return lines


def both(servers, gdb, program: Path, args: tuple[str, ...], commands: list[str]) -> dict[str, tuple[str, object]]:
    """The session under each server: kind -> (GDB's output, the server); GDB's output the same under both."""
    runs = {kind: debug(servers, kind, gdb, program, args, commands) for kind in KINDS}
    ours, theirs = same(runs["kgtp-sim"][0]), same(runs["gdbserver"][0])
    assert ours == theirs, "\n".join(difflib.unified_diff(theirs, ours, "gdbserver", "kgtp-sim gdbserver",
                                                          lineterm=""))
    return runs


CATCH_FORK = ["catch fork", "break work", "continue", "info inferiors", "continue", "print who", "continue"]
FOLLOW_CHILD = ["set follow-fork-mode child", "break work", "continue", "print who", "info inferiors", "continue"]
KEEP_BOTH = ["set detach-on-fork off", "break work", "continue", "print who", "info inferiors", "inferior 2",
             "continue", "print who", "continue", "inferior 1", "continue"]


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_catch_fork_stops_with_the_childs_pid_and_the_child_is_detached(build, servers, gdb):
    program = build(MAIN_MODE)
    runs = both(servers, gdb, program, ("work",), CATCH_FORK)
    out, server = runs["kgtp-sim"]
    forked = re.search(r"^Catchpoint 1 \(forked process (\d+)\), ", out, re.M)
    assert forked, out
    child = forked.group(1)
    assert_in_order(out, rf"^\[Detaching after fork from child process {child}\]$",
                    r"^Breakpoint 2, work \(who=0\) at ", r"^\$1 = 0$", r"^\[Inferior 1 \(process \d+\) exited normally\]$")
    assert f"Detaching from process {child}" in server.out["stderr"], server.out
    assert server.out["stdout"] == ["parent work 1", "child that ran work(): exited 7"], server.out


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_follow_fork_mode_child_follows_the_child_and_detaches_the_parent(build, servers, gdb):
    program = build(MAIN_MODE)
    runs = both(servers, gdb, program, ("work",), FOLLOW_CHILD)
    out, server = runs["kgtp-sim"]
    parent = re.search(r"^Process \S+ created; pid = (\d+)$", "\n".join(server.out["stderr"]), re.M).group(1)
    assert_in_order(out, rf"^\[Detaching after fork from parent process {parent}\]$",
                    r"hit Breakpoint 1, work \(who=3\) at ", r"^\$1 = 3$", r"^\* 2\s+process (\d+)\s",
                    r"^\[Inferior 2 \(process \d+\) exited with code 07\]$")
    assert f"Detaching from process {parent}" in server.out["stderr"], server.out
    # the parent goes on untraced; it may not have written its last line when the server's machine ends with the
    # session (a detached process lives as long as the machine does)
    assert server.out["stdout"][:1] == ["parent work 1"], server.out


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_detach_on_fork_off_keeps_both_processes_each_continued_on_its_own(build, servers, gdb):
    program = build(MAIN_MODE)
    runs = both(servers, gdb, program, ("work",), KEEP_BOTH)
    out, server = runs["kgtp-sim"]
    inferiors = re.findall(r"^\*?\s+(\d)\s+process (\d+)\s", out, re.M)
    assert [number for number, _ in inferiors] == ["1", "2"], out
    assert_in_order(out, r"hit Breakpoint 1\.1, work \(who=0\) at ", r"^\$1 = 0$", r"hit Breakpoint 1\.2, work \(who=3\) at ",
                    r"^\$2 = 3$", rf"^\[Inferior 2 \(process {inferiors[1][1]}\) exited with code 07\]$",
                    rf"^\[Inferior 1 \(process {inferiors[0][1]}\) exited normally\]$")
    assert server.out["stdout"] == ["parent work 1", "child that ran work(): exited 7"], server.out


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_catch_vfork_and_the_parent_waits_for_vforkdone(build, servers, gdb):
    program = build(MAIN_MODE, "execs")
    runs = both(servers, gdb, program, ("vfork",), ["catch vfork", "continue", "info inferiors", "continue"])
    out, server = runs["kgtp-sim"]
    vforked = re.search(r"^Catchpoint 1 \(vforked process (\d+)\), ", out, re.M)
    assert vforked, out
    assert_in_order(out, rf"^\[Detaching after vfork from child process {vforked.group(1)}\]$",
                    r"^\[Inferior 1 \(process \d+\) exited normally\]$")
    assert server.out["stdout"] == ["image 0", "vfork child: exited 0"], server.out


CATCH_EXEC = ["catch exec", "break image", "continue", "continue", "info inferiors", "continue", "print n",
              "info sharedlibrary", "continue", "continue", "continue"]


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_catch_exec_and_the_new_images_breakpoints(build, servers, gdb):
    """Each image stops at its image(): GDB read the new program (its path from the exec event, its libraries from
    the new image's list), set its breakpoint there again, and the old image's int3 is gone with it."""
    program = build(MAIN_MODE, "execs")
    commands = [line for line in CATCH_EXEC if line != "info sharedlibrary"]  # the libraries' addresses differ
    runs = both(servers, gdb, program, ("2",), commands)
    out, server = runs["kgtp-sim"]
    path = re.escape(str(program))
    assert_in_order(out, r"^Breakpoint 2, image \(n=2\) at ", rf"^process \d+ is executing new program: {path}$",
                    rf"^Catchpoint 1 \(exec'd {path}\), ", r"^Breakpoint 2, image \(n=1\) at ", r"^\$1 = 1$",
                    rf"^Catchpoint 1 \(exec'd {path}\), ", r"^Breakpoint 2, image \(n=0\) at ",
                    r"^\[Inferior 1 \(process \d+\) exited normally\]$")
    assert server.out["stdout"] == ["image 2", "image 1", "image 0"], server.out
    listed, _ = debug(servers, "kgtp-sim", gdb, program, ("2",), CATCH_EXEC)
    assert re.search(r"^\$1 = 1\n(.*\n)*0x[0-9a-f]+\s+0x[0-9a-f]+\s+Yes\s+\S*/libc\.so\.6$", listed, re.M), listed


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_an_exec_without_a_catchpoint_reloads_the_program_and_goes_on(build, servers, gdb):
    program = build("musl-static", "execs")
    runs = both(servers, gdb, program, ("2",), ["break image", "continue", "continue", "continue", "continue"])
    out, server = runs["kgtp-sim"]
    assert_in_order(out, r"^Breakpoint 1, image \(n=2\) at ", r"^process \d+ is executing new program: ",
                    r"^Breakpoint 1, image \(n=1\) at ", r"^Breakpoint 1, image \(n=0\) at ",
                    r"^\[Inferior 1 \(process \d+\) exited normally\]$")
    assert server.out["stdout"] == ["image 2", "image 1", "image 0"], server.out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_a_fork_in_non_stop_mode_is_a_notification(build, servers, gdb, kind):
    """Non-stop (MI): the fork's stop comes as GDB's `*stopped,reason="fork"` with the child's pid (a `%Stop`
    notification), the child is detached, the breakpoint in the parent hits after it, the program ends."""
    program = build(MAIN_MODE)
    server = servers(kind, program, "work")
    with GdbMi(gdb, program=program, mi_async=True) as mi:
        for setting in (*QUIET, "set non-stop on"):
            mi.command(f"-gdb-{setting}")
        assert mi.attach(f"127.0.0.1:{server.listening()}").klass == "connected"
        mi.console("catch fork")
        mi.command("-break-insert work")
        mi.command("-exec-continue --all")
        stop = mi.wait_stopped()
        assert stop.get("reason") == "fork" and stop.get("newpid", "").isdigit(), stop
        mi.command("-exec-continue --all")
        stop = mi.wait_stopped()
        assert stop.get("reason") == "breakpoint-hit" and stop["frame"]["func"] == "work", stop  # type: ignore[index]
        assert mi.evaluate("who") == "0"
        mi.command("-break-delete")
        mi.command("-exec-continue --all")
        assert mi.wait_stopped().get("reason") == "exited-normally"
    assert server.wait() == 0, server.text()
    assert server.out["stdout"] == ["parent work 1", "child that ran work(): exited 7"], server.out


def _line(name: str) -> int:
    """forks.c's line marked `line:NAME`."""
    return next(number for number, text in enumerate((SOURCES / "forks.c").read_text().splitlines(), 1)
                if f"line:{name} " in text + " ")


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_a_fork_child_gets_no_tracepoint_and_the_parent_goes_on_collecting(build, servers, gdb):
    """A tracepoint and a fast tracepoint in work(), which parent and child both run after the fork: the child's
    copy has neither (no int3, no jump into a pad: it runs work() and exits 7, nothing of it collected); the
    parent's two hits are the run's two frames. GDB detaches the child (`D;PID`): gdbserver stops the trace run
    there (server.cc: handle_detach's stop_tracing, the frames before it kept, "Trace stopped by a tstop command");
    this server goes on tracing the process GDB still debugs."""
    program = build(MAIN_MODE)
    commands = [f"trace forks.c:{_line('work')}", "actions", "collect who", "end",
                f"ftrace forks.c:{_line('works')}", "actions", "collect works", "end", "break describe", "tstart",
                "continue", "tstop", "tstatus", "tfind start", "print works", "tfind", "print who", "tfind",
                "tfind none", "delete", "continue"]
    out, server = debug(servers, "kgtp-sim", gdb, program, ("work",), commands)
    assert_in_order(out, r"^\[Detaching after fork from child process \d+\]$", r"^Breakpoint 3, describe \(",
                    r"^Collected 2 trace frames\.$", r"^Found trace frame 0, tracepoint 2$", r"^\$1 = 0$",
                    r"^Found trace frame 1, tracepoint 1$", r"^\$2 = 0$", r"^Target failed to find requested trace "
                    r"frame\.$|^No trace frame found$", r"^\[Inferior 1 \(process \d+\) exited normally\]$")
    assert server.out["stdout"] == ["parent work 1", "child that ran work(): exited 7"], server.out
