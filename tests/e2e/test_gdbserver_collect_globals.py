"""A global the program has not touched yet, collected by a tracepoint in the program under `kgtp-sim gdbserver`,
with real GDB (13 and 18), beside Debian's gdbserver: its pages are the program's (zeros) though no page of them is
present when the run starts, so the frames hold them, and a buffer fills with them as gdbserver's does
(gdb.trace/status-stop.exp's buffer_full_tstart: `collect buf` of an untouched array read back as
`<unavailable>`, 32 bytes a frame, and the buffer never filled). The hit reads memory as it is, inside emulation;
the pages of globals the actions collect are faulted in by the process at tstart, as gdbserver's ptrace reads
fault them in at each hit (tests/programs/untouched.c)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from kgtp_sim.client import GDB_CLIENTS

from ..programs import SOURCES
from .test_gdbserver_tracing import GDB13, debian_session, session

pytestmark = pytest.mark.skipif(not GDB_CLIENTS, reason="no GDB")

COMMANDS = ["break main", "continue", "trace hit", "actions", "collect untouched", "end", "tstart",
            "break 14", "continue", "tstop", "tstatus", "tfind 2", "print untouched[4095]", "print untouched[0]",
            "print sizeof(untouched)", "tfind none", "kill"]


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    """untouched.c with its debugging information, unoptimized, dynamically linked (a PIE)."""
    out = tmp_path_factory.mktemp("untouched") / "untouched"
    subprocess.run(["gcc", "-g", "-O0", str(SOURCES / "untouched.c"), "-o", str(out)], check=True, capture_output=True)
    return out


def _values(out: str) -> list[str]:
    return re.findall(r"^\$\d+ = (.*)$", out, re.M)


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda g: f"gdb{g.version}")
def test_an_untouched_global_is_collected_as_zeros(program, gdb):
    out, _, _ = session(gdb, program, COMMANDS)
    assert "Collected 3 trace frames." in out, out
    assert re.search(r"^Found trace frame 2, tracepoint 2$", out, re.M), out
    assert _values(out) == ["0", "0", "16384"], out


@pytest.mark.skipif(shutil.which("gdbserver") is None, reason="needs Debian's gdbserver")
def test_the_same_session_under_debians_gdbserver(program):
    theirs = debian_session(GDB13, program, COMMANDS)
    ours, _, _ = session(GDB13, program, COMMANDS)
    assert _values(ours) == _values(theirs) == ["0", "0", "16384"], (ours, theirs)


def test_a_buffer_fills_with_an_untouched_global(program):
    """16 KiB a frame in a 48 KiB buffer: two frames, then the third hit finds no room and the run stops full.
    (Debian's gdbserver reports 3 frames in 32,808 bytes of that buffer, not full: its accounting is its own.)"""
    commands = ["set trace-buffer-size 49152", *COMMANDS[:8], "continue", "tstatus", "kill"]
    out, _, _ = session(GDB13, program, commands)
    assert "Trace stopped because the buffer was full." in out, out
    assert "Collected 2 trace frames." in out, out
