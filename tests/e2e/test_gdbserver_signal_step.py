"""A signal GDB passes (SIGALRM: `handle SIGALRM nostop noprint pass`, GDB's default) arriving while GDB steps a
thread is reported to GDB, never passed by the
server on its own: GDB then runs the handler with a step-resume
breakpoint where the step was, not single-stepped, so `step` on a line that spins until the handler ran stops at a
breakpoint in the handler (gdb.base/sigstep.exp's "step to handler"), as under Debian's gdbserver, whose
linux-low passes a signal itself only to a thread that is not being stepped. Passed on its own, the signal was
delivered into a single step, which ended at the handler's first instruction: GDB stopped there, in a new
function, with no breakpoint. The step starts where no breakpoint is (a `tbreak` took the program there), so GDB
range-steps the loop from its first instruction (vCont;r), as after sigstep.exp's `advance`. Both GDBs, the same session under Debian's gdbserver."""

from __future__ import annotations

import re
import subprocess

import pytest

from kgtp_sim.client import GDB_CLIENTS

from ..programs import MODES, SOURCES
from .test_gdbserver_role import KINDS, debug, servers  # noqa: F401 - a fixture, used by name

pytestmark = pytest.mark.skipif(not GDB_CLIENTS, reason="no GDB")

SOURCE = SOURCES / "sigstep.c"
LINE = {name: number for number, text in enumerate(SOURCE.read_text().splitlines(), 1)
        for name in re.findall(r"line:(\w+)", text)}


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    out = tmp_path_factory.mktemp("sigstep") / "sigstep"
    subprocess.run([*MODES["glibc-dynamic"], "-g", "-O0", str(SOURCE), "-o", str(out)], check=True,
                   capture_output=True)
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda g: f"gdb{g.version}")
def test_step_over_a_line_a_signal_interrupts_stops_at_the_handlers_breakpoint(program, servers, gdb, kind):
    out, _server = debug(servers, kind, gdb, program, (), [
        f"tbreak sigstep.c:{LINE['loop']}", "continue", "break handler", "step", "print done", "kill"])
    assert re.search(rf"^Breakpoint 2, handler \(sig=14\) at \S*sigstep\.c:{LINE['handler']}$", out, re.M), out
    assert re.search(r"^\$1 = 0$", out, re.M), out  # stopped before the handler's store


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda g: f"gdb{g.version}")
def test_step_out_of_a_handler_comes_back_to_the_interrupted_code(program, servers, gdb, kind):
    """`step` through the handler's return: its `rt_sigreturn` (a `syscall` GDB single-steps) goes back to main
    and the step goes on there (gdb.base/siginfo.exp's "step out of handler"): the kernel keeps the debugger's
    TF through the frame's flags, as Linux's single step is reported at the system call's exit. It once ran the
    program to its end."""
    out, _server = debug(servers, kind, gdb, program, ("raise",), [
        "break handler", "continue", "next", "next", "step", "kill"])
    assert re.search(rf"^Breakpoint 1, handler \(sig=14\) at \S*sigstep\.c:{LINE['handler']}$", out, re.M), out
    assert re.search(rf"^main \(argc=2, .*\) at \S*sigstep\.c:{LINE['return']}$", out, re.M), out
    assert "exited normally" not in out, out
