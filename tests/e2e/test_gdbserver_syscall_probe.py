"""Tracepoints on a program's `syscall` instruction and on the instruction after it, under `kgtp-sim gdbserver`,
with real GDB (13 and 18), beside Debian's gdbserver (gdb.trace/signal.exp's case: the call raises a signal whose
handler runs before the instruction after it).

A probed instruction is stepped in place after its hit, with TF; `syscall` cannot be: the kernel took the step's TF
for a debugger's (a traced task gets SIGTRAP after the call, which GDB then reported: "Program received signal
SIGTRAP" at the instruction after), and the handler ran with the int3 lifted. It runs out of line now, from a pad
beside the program (tracing/engines/userprobes.py), as Linux's uprobes run every probed instruction
(tests/programs/raises.c)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from kgtp_sim.client import GDB_CLIENTS

from ..programs import SOURCES
from .test_gdbserver_tracing import GDB13, debian_session, session

pytestmark = pytest.mark.skipif(not GDB_CLIENTS, reason="no GDB")

COMMANDS = ["break main", "continue", "handle SIGUSR1 nostop noprint pass", "trace *at_syscall", "trace *after_syscall",
            "break _exit", "tstart", "continue", "tstop", "tstatus", "info tracepoints", "tfind tracepoint 3",
            "print $pc == &after_syscall", "tfind none", "delete 4", "continue"]


@pytest.fixture(scope="module", params=["dynamic", "static"])
def program(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("raises") / f"raises-{request.param}"
    flags = ["-static"] if request.param == "static" else []
    subprocess.run(["gcc", "-g", "-O0", *flags, str(SOURCES / "raises.c"), "-o", str(out)], check=True,
                   capture_output=True)
    return out


def _checked(out: str, spurious: bool = False) -> None:
    """Each tracepoint hit at each of the 3 calls; `spurious`: the one after the call may count more (gdbserver
    delivers the signal while it steps over the first, and collects the second twice: signal.exp accepts it as
    "spurious collection")."""
    hits = [int(n) for n in re.findall(r"tracepoint already hit (\d+) times?", out)]
    assert len(hits) == 2 and hits[0] == 3 and (hits[1] >= 3 if spurious else hits[1] == 3), out
    assert re.search(r"^\$1 = 1$", out, re.M), out
    assert re.search(r"^\[Inferior 1 \(process \d+\) exited with code 03\]$", out, re.M), out
    assert "SIGTRAP" not in out, out


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda g: f"gdb{g.version}")
def test_both_tracepoints_hit_at_each_call_and_the_handler_runs(program, gdb):
    out, _, _ = session(gdb, program, COMMANDS)
    _checked(out)


@pytest.mark.skipif(shutil.which("gdbserver") is None, reason="needs Debian's gdbserver")
def test_the_same_session_under_debians_gdbserver(program):
    _checked(debian_session(GDB13, program, COMMANDS), spurious=True)
