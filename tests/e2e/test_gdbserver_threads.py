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

from kgtp_sim.client.mi import GdbMi

from .test_gdbserver_role import QUIET, servers  # noqa: F401 - a fixture, used by name
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
    listed = re.findall(r"^\*?\s+\d+\s+Thread (\d+)\.(\d+) \"workers-(?:static|dynamic)\"", text, re.M)
    assert len({tid for _, tid in listed}) >= 2 and len({pid for pid, _ in listed}) == 1, text
    assert re.search(r"#1 .* in run \(arg=", text), text
    assert "counter 18" in out  # 3 x (1 + 2 + 3): the program computed what it computes natively
    assert re.search(r"\[Inferior 1 \(process \d+\) exited normally\]", text), text


@pytest.mark.parametrize("cpus", [1, 2])
def test_ctrl_c_stops_threads_that_sleep_and_wait_and_they_go_on(workers, servers, cpus):
    """SIGINT while main waits in pthread_join (a futex) and the workers sleep between calls (nanosleep): every
    thread stops (their sleeps restart when they go on: none returns early), GDB lists them all, the program
    resumes and ends when told to."""
    server = servers("kgtp-sim", workers["dynamic"], "forever", options=("--once", "--cpus", str(cpus)))
    with GdbMi(GDB13, program=workers["dynamic"], mi_async=True) as mi:
        for setting in QUIET:
            mi.command(f"-gdb-{setting}")
        assert mi.attach(f"127.0.0.1:{server.listening()}").klass == "connected"
        mi.command("-exec-continue")
        server.wait_line(r"^started$", stream="stdout")
        for _ in range(2):
            mi.command("-exec-interrupt")
            stop = mi.wait_stopped()
            assert stop.get("reason") == "signal-received" and stop.get("signal-name") == "SIGINT", stop
            listed = mi.command("-thread-info")
            assert len(listed.get("threads")) == 4, listed  # main and its three workers
            mi.command("-exec-continue")
        mi.command("-exec-interrupt")
        mi.wait_stopped()
        mi.console("set var stop_all = 1")
        mi.command("-exec-continue")
        stop = mi.wait_stopped()
        assert stop.get("reason") == "exited-normally", stop
    assert server.wait() == 0, server.text()
    assert server.out["stdout"] == ["started", "counter -1"], server.out


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_an_inferior_call_in_a_thread_waiting_in_the_kernel(workers, mode):
    """GDB calls a function in main's thread while it waits in pthread_join (a futex in the kernel): the call runs
    from GDB's registers (the wait is not restarted over them) and the program goes on to its own result, the call's
    work included (3 x (1 + 2 + 3) + 5)."""
    text, out, _ = session(GDB13, workers[mode], ["break work", "continue", "delete", "thread 1", "call work(5)",
                                                  "continue"], "--cpus", "2")
    assert "received signal" not in text, text
    assert "counter 23" in out, (text, out)
