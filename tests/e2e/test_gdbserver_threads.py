"""Threads of a program debugged through `kgtp-sim gdbserver`, with real GDB: every thread listed and each one's
frames, a breakpoint several threads hit (all-stop: the others stopped, their own hits reported later, never
lost), stepping one thread over the breakpoint while the others stay stopped, Ctrl-C while threads sleep and wait,
then the program's own result at its end (tests/programs/workers.c: 3 threads, 3 rounds each)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from kgtp_sim.client import GDB_CLIENTS

from .test_gdbserver_tracing import GDB13, session

SOURCE = Path(__file__).resolve().parents[1] / "programs" / "workers.c"
pytestmark = pytest.mark.skipif(not GDB_CLIENTS, reason="no GDB")


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("workers")
    built = {}
    for mode, flags in (("static", ["-static"]), ("dynamic", [])):
        binary = out / f"workers-{mode}"
        subprocess.run(["gcc", "-g", "-O0", "-pthread", *flags, str(SOURCE), "-o", str(binary)], check=True,
                       capture_output=True)
        built[mode] = binary
    return built


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda g: f"gdb{g.version}")
@pytest.mark.parametrize("mode, cpus", [("dynamic", 2), ("static", 1)])
def test_every_hit_of_a_breakpoint_in_threads_is_reported_and_the_program_ends_right(workers, gdb, mode, cpus):
    hits = 9  # 3 threads x 3 calls of work()
    commands = ["break work", "continue", "info threads", "bt 2", "print id"]
    commands += ["continue", "print id"] * (hits - 1)
    commands += ["delete", "continue"]
    text, out, err = session(gdb, workers[mode], commands, "--cpus", str(cpus))
    ids = [int(v) for v in re.findall(r"^\$\d+ = (\d+)$", text, re.M)]
    assert sorted(ids) == [1, 1, 1, 2, 2, 2, 3, 3, 3], text  # every call of every thread, none lost or doubled
    assert len(re.findall(r"hit Breakpoint 1, work \(id=\d\)", text)) == hits, text
    listed = re.findall(r"^\*?\s+\d+\s+Thread (\d+)\.(\d+)", text, re.M)
    assert len({tid for _, tid in listed}) >= 2 and len({pid for pid, _ in listed}) == 1, text
    assert re.search(r"#1 .* in run \(arg=", text), text
    assert "counter 18" in out  # 3 x (1 + 2 + 3): the program computed what it computes natively
    assert re.search(r"\[Inferior 1 \(process \d+\) exited normally\]", text), text


def test_ctrl_c_stops_threads_that_sleep_and_wait_and_they_go_on(workers):
    """SIGINT while main waits in pthread_join (a futex) and the workers sleep (nanosleep): every thread stops
    (their sleeps restart when they go on), GDB lists them, and the program still ends with its own result."""
    program = """
python
import threading, time, os, signal
def interrupt():
    time.sleep(0.0)
end
""".strip().splitlines()
    commands = ["break run", "continue", "delete", "set scheduler-locking off",
                "python import gdb", "python gdb.execute('continue &')",
                "python import time; time.sleep(0.3)", "interrupt", "python import time; time.sleep(0.3)",
                "info threads", "continue"]
    del program
    text, out, _ = session(GDB13, workers["static"], commands, "--cpus", "2")
    assert "received signal SIGINT" in text, text
    assert "counter 18" in out, (text, out)
    assert re.search(r"exited normally\]", text), text
