"""A detach during a trace run, as gdbserver's handle_detach: the run stops (`tstop`, GDB being still connected)
and the frames stay (in extended-remote, where the server outlives the detach, tstatus counts them: GDB looks at no
trace frame without a process); under `set disconnected-tracing on` the server keeps the process instead, traced and
running, says so, and the next GDB finds it (stopped, as any reconnection finds a process) and the run going on.
Each session beside Debian's gdbserver, with real GDB 13 and 18, on debugme.c (four calls of add(), then a
spin while `spinning`)."""

from __future__ import annotations

import re

import pytest

from kgtp_sim.client import GDB_CLIENTS

from .test_gdbserver_role import KINDS, LINE, MAIN_MODE, assert_in_order, build, run_session, servers  # noqa: F401

pytestmark = pytest.mark.gdb

TRACE = ["break main", "continue", "trace add", "actions", "collect step", "end", "break combine", "tstart", "continue", "tstatus"]
#: every frame's `step`, from the first
FRAMES = ["tfind start", "while $trace_frame != -1", 'printf "frame %d step %d\\n", $trace_frame, step', "tfind",
          "end"]


#: tstatus after a stop by tstop: the stop's note (none given) in brackets, as gdbserver sends one always
STOPPED = r"^Trace stopped by a tstop command \(\)\.$"
#: where a process left spinning is found: either line of main's spin loop
SPIN = rf"debugme\.c:({LINE['spin'] - 1}|{LINE['spin']})"


def _frames(out: str) -> list[tuple[int, int]]:
    return [(int(f), int(s)) for f, s in re.findall(r"^frame (\d+) step (\d+)$", out, re.M)]


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda g: f"gdb{g.version}")
@pytest.mark.parametrize("kind", KINDS)
def test_a_detach_stops_the_trace_run_and_keeps_its_frames(build, servers, kind, gdb):
    """Extended-remote (the server outlives the detach): tstatus says the run stopped by a tstop and still counts
    its four frames."""
    program = build(MAIN_MODE)
    server = servers(kind, program, "exit", options=("--multi",))  # detached, it ends on its own
    port = server.listening()
    out = run_session(gdb, program, port, [
        "disconnect", f"target extended-remote 127.0.0.1:{port}", *TRACE, "detach", "tstatus", "monitor exit"])
    assert_in_order(out, r"^Breakpoint 3, combine", r"^Trace is running on the target\.$",
                    r"^Collected 4 trace frames\.$", r"^\[Inferior 1 \(process \d+\) detached\]$",
                    STOPPED, r"^Collected 4 trace frames\.$")
    assert server.wait() == 0, server.text()
    assert re.search(r"^Detaching from process \d+$", server.text(), re.M), server.text()


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda g: f"gdb{g.version}")
@pytest.mark.parametrize("kind", KINDS)
def test_a_detach_under_disconnected_tracing_keeps_the_process_for_the_next_gdb(build, servers, kind, gdb):
    """`target remote` without --once: the detach leaves the process traced and running (the server's line says
    so, and it does not end as it does once it has nothing to debug); a second GDB finds the run still going, the
    program stopped in its spin, and the frames of the first session."""
    program = build(MAIN_MODE)
    server = servers(kind, program, "loop", options=())
    port = server.listening()
    first = run_session(gdb, program, port, ["set disconnected-tracing on", *TRACE, "detach"])
    assert_in_order(first, r"^Breakpoint 3, combine", r"^Trace is running on the target\.$",
                    r"^Collected 4 trace frames\.$", r"^\[Inferior 1 \(process \d+\) detached\]$")
    server.wait_line(r"^Disconnected tracing in effect, leaving gdbserver attached to the process$")
    assert server.proc.poll() is None, server.text()
    second = run_session(gdb, program, port, ["tstatus", "bt 1", "tstop", "tstatus", *FRAMES, "kill"])
    assert_in_order(second, r"^Trace is running on the target\.$", r"^Collected 4 trace frames\.$",
                    rf"^#0  .*main \(.*\) at .*{SPIN}$", STOPPED, r"^Collected 4 trace frames\.$")
    assert _frames(second) == [(0, 1), (1, 2), (2, 3), (3, 4)], second
    assert server.wait() == 0, server.text()
