"""What a trace frame holds under `kgtp-sim gdbserver`, as gdbserver's does, with real GDB (13 and 18), beside
Debian's gdbserver (tests/programs/untouched.c, its hit()):

- a register collection (`R`) records every register, whatever its mask names, as gdbserver's tracepoint.cc does:
  GDB's unwinder needs %rbp to walk up from the frame (gdb.trace/entry-values.exp: `collect` of a register and of
  the stack gave "Backtrace stopped: not enough registers or memory available to unwind further");
- a saved frame (`tsave`) holds what was collected and nothing more: KGTP mode's `$cpu_id` and `$clock` carriers of
  each frame's CPU and time are not the role's (gdb.trace/mi-trace-frame-collected.exp lists a frame's variables
  after `target tfile` and wants none)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from kgtp_sim.client import GDB_CLIENTS

from ..programs import SOURCES
from .test_gdbserver_tracing import GDB13, debian_session, session

pytestmark = pytest.mark.skipif(not GDB_CLIENTS, reason="no GDB")


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    out = tmp_path_factory.mktemp("frames") / "untouched"
    subprocess.run(["gcc", "-g", "-O0", str(SOURCES / "untouched.c"), "-o", str(out)], check=True, capture_output=True)
    return out


def _commands(saved) -> list[str]:
    return ["break main", "continue", "trace hit", "actions", "collect $rax, (*(void **) ($rsp)) @ 16", "end", "tstart", "break 14", "continue",
            "tstop", "tfind 1", "bt", "print $rbx == $rbx", "tfind none", f"tsave {saved}", "kill",
            f"target tfile {saved}", "tfind 1", 'interpreter-exec mi "-trace-frame-collected"', "bt"]


def _checked(out: str) -> None:
    assert len(re.findall(r"^#1 +0x[0-9a-f]+ in main \(\) at .*untouched\.c:\d+$", out, re.M)) == 2, out
    assert re.search(r"^\$1 = 1$", out, re.M), out  # %rbx recorded: not <unavailable>
    collected = re.search(r"\^done,explicit-variables=.*", out)
    assert collected is not None and ",tvars=[]," in collected.group(0), out[-3000:]


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda g: f"gdb{g.version}")
def test_a_frame_holds_every_register_and_a_saved_one_nothing_it_did_not_collect(program, gdb, tmp_path):
    out, _, _ = session(gdb, program, _commands(tmp_path / "saved"))
    _checked(out)


@pytest.mark.skipif(shutil.which("gdbserver") is None, reason="needs Debian's gdbserver")
def test_the_same_session_under_debians_gdbserver(program, tmp_path):
    _checked(debian_session(GDB13, program, _commands(tmp_path / "saved")))
