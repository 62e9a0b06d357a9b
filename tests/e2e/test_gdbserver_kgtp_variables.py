"""KGTP's special trace state variables under `kgtp-sim gdbserver`, with real GDB (13 and 18): as gdbserver, the
role uploads only `$trace_timestamp` (GDB lists nothing else at connection, and numbers the user's variables from 2,
numbers KGTP's table uses too); a KGTP variable exists once the user declares it by name (`tvariable
$current_task_pid`), and `--kgtp-variables` uploads them all (stub/variables.py).

The session (tests/programs/traceme.c: add() called five times) declares a variable of its own first (GDB's 2, the
number of KGTP's `$cpu_id`) and KGTP's `$current_task_pid` and `$cpu_id` after it, counts the hits in its own
variable and collects all three, in every engine: each must be what its name says, live (qTV), in each frame (qTV
on a selected frame) and in a file GDB saved (qTBuffer's `V` blocks); and a tracepoint GDB downloads during the
run, whose condition reads another variable of the user's, hits.
"""

from __future__ import annotations

import re
import shutil

import pytest

from kgtp_sim.client import GDB_CLIENTS

from .test_gdbserver_tracing import Server, programs, session  # noqa: F401 (programs: a fixture)

pytestmark = pytest.mark.skipif(not GDB_CLIENTS, reason="no GDB")

GDBS = pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda g: f"gdb{g.version}")


def tvariables(text: str) -> list[str]:
    """The names `info tvariables` listed."""
    return re.findall(r"^(\$\w+)\s", text, re.M)


@GDBS
def test_at_connection_gdb_sees_gdbserver_s_variable_alone_and_all_of_kgtp_s_with_the_option(programs, gdb):
    plain, _, _ = session(gdb, programs["static"], ["info tvariables", "kill"])
    assert tvariables(plain) == ["$trace_timestamp"], plain
    every, _, _ = session(gdb, programs["static"], ["info tvariables", "kill"], "--kgtp-variables")
    listed = tvariables(every)
    assert {"$trace_timestamp", "$cpu_id", "$current_task_pid", "$gtp_version", "$ignore_error"} <= set(listed), every
    assert len(listed) == 49, every


#: every frame of tracepoint 1 (add), in order: its variables by name
ADD_FRAMES = ["tfind start", "while $trace_frame != -1",
              'printf "hits=%d pid=%d cpu=%d\\n", $hits, $current_task_pid, $cpu_id', "tfind tracepoint 1", "end"]
#: every frame of tracepoint 3 (line 26, downloaded during the run)
LATE_FRAMES = ["tfind start", "tfind tracepoint 3", "while $trace_frame != -1", 'printf "late frame %d\\n", $trace_frame',
               "tfind tracepoint 3", "end"]


@GDBS
@pytest.mark.parametrize("engine", ["interp", "naive", "opt"])
def test_declared_kgtp_variables_and_the_user_s_own_keep_their_meanings_everywhere(programs, gdb, engine, tmp_path):
    saved = tmp_path / "gdb.tf"

    def commands(pid: int) -> list[str]:
        return [
            "tvariable $hits = 100", "tvariable $current_task_pid", "tvariable $cpu_id", "tvariable $late = 7",
            "info tvariables",
            "trace add", "actions", "teval $hits = $hits + 1", "collect $hits, $current_task_pid, $cpu_id", "end",
            "break 27", "tstart", "continue",  # round 1's write(): add hit once
            # a tracepoint GDB downloads during the run (its condition alone: GDB sends actions at tstart), whose
            # condition reads a variable: renumbered then ($late is GDB's 5, KGTP's $cooked_clock's number)
            "trace 26 if $late == 7", "delete 2", "break 29", "continue", "tstop",
            'printf "live hits=%d late=%d\\n", $hits, $late',
            *ADD_FRAMES, *LATE_FRAMES, "tfind none", f"tsave {saved}", "kill",
            f"target tfile {saved}", *ADD_FRAMES, *LATE_FRAMES,
        ]

    server_pid = []

    def recorded(pid: int) -> list[str]:
        server_pid.append(pid)
        return commands(pid)

    text, _, _ = session(gdb, programs["static"], recorded, "--engine", engine)
    assert tvariables(text)[:5] == ["$trace_timestamp", "$hits", "$current_task_pid", "$cpu_id", "$late"], text
    assert re.search(r"^live hits=105 late=7$", text, re.M), text  # add's five hits
    frames = [tuple(map(int, f)) for f in re.findall(r"^hits=(\d+) pid=(\d+) cpu=(\d+)$", text, re.M)]
    assert [hits for hits, _, _ in frames] == [101, 102, 103, 104, 105] * 2, text  # live, then from GDB's file
    assert {pid for _, pid, _ in frames} == set(server_pid), text
    assert {cpu for _, _, cpu in frames} <= {0, 1}, text
    assert len(re.findall(r"^late frame \d+$", text, re.M)) == 2 * 4, text  # rounds 2 to 5, live and saved
