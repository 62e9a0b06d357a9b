"""A program that forks, debugged through `kgtp-sim gdbserver` with real GDB (13.1 and 18.1), and the same session
under Debian's gdbserver: a breakpoint set in the parent before the fork, at a function the child runs too. The
parent stops there; the child, whose memory is a copy of the parent's with the breakpoint's int3 in it, must not
die of it: the machine takes the int3 out of the child's copy (machine/int3s.py, as gdbserver's
detach_breakpoints for a fork child it does not follow), the child exits with the code the parent's wait4 checks,
and the program ends normally (tests/programs/forks.c, "work")."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from kgtp_sim.client import GDB_CLIENTS

from ..programs import MODES, SOURCES, compile_program
from .test_gdbserver_role import debug, servers  # noqa: F401 - a fixture, used by name

pytestmark = pytest.mark.gdb

SESSION = ["break work", "continue", "print who", "bt 1", "continue"]


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """forks.c with its debugging information, unoptimized, in a link mode (tests/programs.py's compilers)."""
    out_dir = tmp_path_factory.mktemp("forks-debug")

    def build(mode: str) -> Path:
        compile_program("forks", mode, out_dir)  # skips as that does when the mode cannot be built here
        out = out_dir / f"forks-g-{mode}"
        if not out.exists():
            subprocess.run([*MODES[mode], "-pthread", "-g", "-O0", str(SOURCES / "forks.c"), "-o", str(out)],
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
