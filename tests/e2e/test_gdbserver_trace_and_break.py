"""A tracepoint and a breakpoint at one address of a threaded program, under `kgtp-sim gdbserver` with real GDB (13
and 18), beside Debian's gdbserver (gdb.trace/trace-mt.exp's case): each call collects once, however many threads
stop at the breakpoint before GDB lets one go on.

The machine remembers which task was reported at that breakpoint, so that its going on from the stop (the int3
run again) collects nothing more; it remembered one task per address, so when two threads hit the breakpoint
before either went on, the first one's going on collected a second frame (tests/programs/workers.c: three threads,
three calls of work() each)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from kgtp_sim.client import GDB_CLIENTS

from ..programs import SOURCES
from .test_gdbserver_role import debug, servers  # noqa: F401 - a fixture, used by name

pytestmark = pytest.mark.gdb

#: to main, then the breakpoint and the tracepoint at work(), a run over its nine calls, the run's count
SESSION = ["break main", "continue", "break work", "trace work", "tstart", *["continue"] * 9, "tstop", "tstatus",
           "info tracepoints", "kill"]


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("workers") / "workers"
    subprocess.run(["gcc", "-g", "-O0", "-pthread", str(SOURCES / "workers.c"), "-o", str(out)], check=True,
                   capture_output=True)
    return out


@pytest.mark.parametrize("kind, cpus", [("kgtp-sim", 1), ("kgtp-sim", 2), ("gdbserver", None)])
@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_each_call_is_collected_once_however_many_threads_wait_at_the_breakpoint(workers, servers, gdb, kind, cpus):
    out, _ = debug(servers, kind, gdb, workers, (), SESSION, cpus=cpus)
    assert len(re.findall(r"hit Breakpoint 2, work \(", out)) + len(re.findall(r"^Breakpoint 2, work \(", out, re.M)) \
        == 9, out
    assert "Collected 9 trace frames." in out, out
    assert re.search(r"tracepoint already hit 9 times", out), out
