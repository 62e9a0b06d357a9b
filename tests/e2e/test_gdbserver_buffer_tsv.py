"""`set trace-buffer-size` and `$trace_timestamp` through `kgtp-sim gdbserver`, with real GDB (13 and 18), held to
what Debian's gdbserver makes the same GDB print for the same session on the same program
(tests/programs/traceme.c: five rounds of add(), a write() per round).

gdbserver/tracepoint.cc is the reference: the buffer is one buffer of the size GDB sets (tstatus reports it, `-1` is
5 MiB; too small for a frame, the run stops full at the first hit; a small linear buffer stops full, a circular one
wraps), and `$trace_timestamp` is a variable gdbserver defines itself (GDB lists it once connected; collected, it
is the clock at each hit; an assignment to it does not stick). Frames take more room in the stub's buffer than in
gdbserver's (each carries its time, CPU and sequence: ring.py), so how many a small buffer holds differs: the
tests compare what does not depend on it.
"""

from __future__ import annotations

import re
import shutil

import pytest

from kgtp_sim.client import GDB_CLIENTS

from .test_gdbserver_tracing import GDB13, debian_session, programs, session  # noqa: F401 (programs: a fixture)

pytestmark = [pytest.mark.skipif(not GDB_CLIENTS, reason="no GDB"),
              pytest.mark.skipif(shutil.which("gdbserver") is None, reason="needs Debian's gdbserver")]


def both(gdb, program, commands: list[str]) -> tuple[str, str]:
    """GDB's output for the session with the stub's gdbserver role, then with Debian's gdbserver."""
    ours, _, _ = session(gdb, program, commands)
    return ours, debian_session(gdb, program, commands)


def buffer_lines(text: str) -> list[str]:
    return re.findall(r"^Trace buffer has \d+ bytes of \d+ bytes free.*$", text, re.M)


def timestamps(text: str) -> list[int | None]:
    """Each frame's $trace_timestamp in TIMESTAMPS' listing (None: `none`)."""
    return [None if value == "none" else int(value) for value in re.findall(r"^frame \d+ ts (\d+|none)$", text, re.M)]


#: every frame's $trace_timestamp (`none`: the frame has none, as gdbserver's last frame in a full buffer may be its
#: header alone, its blocks having found no room)
TIMESTAMPS = ["tfind start", "while $trace_frame != -1", "if $_isvoid($trace_timestamp)",
              'printf "frame %d ts none\\n", $trace_frame', "else",
              'printf "frame %d ts %lu\\n", $trace_frame, $trace_timestamp', "end", "tfind", "end", "tfind none"]


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda g: f"gdb{g.version}")
def test_set_trace_buffer_size_shows_in_tstatus_and_a_few_bytes_stop_the_run_full(programs, gdb):
    """trace-buffer-size.exp's steps: the default, 4 bytes, back to the default (`unlimited`: -1), then a run in 4
    bytes, which cannot hold a frame: the same tstatus lines, word for word."""
    ours, theirs = both(gdb, programs["static"], [
        "tstatus", "set trace-buffer-size 4", "tstatus", "show trace-buffer-size", "set trace-buffer-size unlimited",
        "tstatus", "set trace-buffer-size 4",
        "trace add", "actions", "collect $trace_timestamp", "end", "break 29", "tstart", "continue", "tstatus", "kill",
    ])
    assert buffer_lines(ours) == buffer_lines(theirs) == [
        "Trace buffer has 5242880 bytes of 5242880 bytes free (0% full).",
        "Trace buffer has 4 bytes of 4 bytes free (0% full).",
        "Trace buffer has 5242880 bytes of 5242880 bytes free (0% full).",
        "Trace buffer has 4 bytes of 4 bytes free (0% full).",
    ], (ours, theirs)
    for text in (ours, theirs):
        assert "Requested size of trace buffer is 4." in text, text
        assert "Trace stopped because the buffer was full.\nCollected 0 trace frames." in text, text
        assert "Bogus reply" not in text and "error code" not in text, text


@pytest.mark.parametrize("circular", [False, True], ids=["linear", "circular"])
def test_a_small_buffer_stops_full_or_wraps_as_gdbservers(programs, circular):
    """150 bytes for ten frames (two tracepoints, five rounds): linear, the run stops full with some of them;
    circular, it runs on and keeps the latest of the ten; each frame's $trace_timestamp later than the one
    before. (gdbserver allocates a frame block by block, so the last one of its full buffer may have lost its
    block; the stub's frames are whole or not there.)"""
    ours, theirs = both(GDB13, programs["static"], [
        f"set circular-trace-buffer {'on' if circular else 'off'}", "set trace-buffer-size 150",
        "trace add", "actions", "collect $trace_timestamp", "end",
        "trace 27", "actions", "collect $trace_timestamp", "end",
        "break 29", "tstart", "continue", "tstatus", *(["tstop"] if circular else []), *TIMESTAMPS, "kill",
    ])
    for text in (ours, theirs):
        assert re.search(r"^Trace buffer has \d+ bytes of 150 bytes free", text, re.M), text
        if circular:
            kept = re.search(r"^Trace is running on the target\.\nBuffer contains (\d+) trace frames "
                             r"\(of 10 created total\)\.", text, re.M)
        else:
            kept = re.search(r"^Trace stopped because the buffer was full\.\nCollected (\d+) trace frames\.", text,
                             re.M)
        assert kept and 0 < int(kept.group(1)) < 10, text
        listed = timestamps(text)
        stamps = [stamp for stamp in listed if stamp is not None]
        assert len(listed) == int(kept.group(1)) and stamps and stamps == sorted(set(stamps)), text
        assert text is theirs or len(stamps) == len(listed), text  # the stub keeps whole frames only


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda g: f"gdb{g.version}")
def test_trace_timestamp_is_listed_once_connected_and_collected_growing_at_each_hit(programs, gdb):
    """`info tvariables` first thing (tsv.exp: `predefined tsvs are uploaded`), a condition on it
    (trace-condition.exp), `teval $trace_timestamp = 7` before collecting it (the clock, not 7), its value live
    after the run, and GDB's own refusal of an assignment: the same in both."""
    ours, theirs = both(gdb, programs["static"], [
        "info tvariables", "print $trace_timestamp",
        "trace add if $trace_timestamp > 0", "actions", "teval $trace_timestamp = 7", "collect $trace_timestamp",
        "end", "break 29", "tstart", "continue", "tstop", "tstatus", *TIMESTAMPS,
        "print $trace_timestamp > 1000000", "print $trace_timestamp = 9",  # an error: the command file ends
    ])
    for text in (ours, theirs):
        assert re.search(r"^\$trace_timestamp\s+0\s+<undefined>", text, re.M), text  # before any run
        assert re.search(r"^\$1 = void$", text, re.M), text
        assert "Collected 5 trace frames." in text, text
        stamps = timestamps(text)
        assert len(stamps) == 5 and None not in stamps and stamps == sorted(set(stamps)) and 7 not in stamps, text
        assert stamps[-1] - stamps[0] < 60_000_000, text  # microseconds of one run, not nanoseconds or seconds
        assert re.search(r"^\$2 = 1$", text, re.M), text
        assert "Left operand of assignment is not an lvalue." in text, text
