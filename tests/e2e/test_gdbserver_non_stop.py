"""Non-stop mode (`set non-stop on`) of a program debugged through `kgtp-sim gdbserver`, with real GDB 13.1 and 18.1
under MI, and the same sessions under Debian's gdbserver (/usr/bin/gdbserver): a breakpoint in a thread function
stops each thread that hits it on its own while main runs on, `info threads` shows both, one thread continued alone
stops again by itself, `interrupt -a` stops the rest (signal 0), `continue -a &` runs the program to its end; the
same in extended-remote, started with `run`; and a trace run over threads that are never stopped (`continue -a &`
while tracing, `tstop`, `tfind` among the frames while they run on). tests/programs/workers.c is the program: three
threads calling work() (3 times each, or until `stop_all` is set with "forever"), main waiting in pthread_join.

Every wait is for an event: a stop GDB reports (`*stopped`), a line a server prints, the frames `tstatus` counts."""

from __future__ import annotations

import re

import pytest

from kgtp_sim.client import GDB_CLIENTS
from kgtp_sim.client.mi import GdbMi, MiValue

from ..conftest import wait_until
from .test_gdbserver_extended import multi  # noqa: F401 - a fixture, used by name
from .test_gdbserver_role import KINDS, QUIET, servers  # noqa: F401 - a fixture, used by name
from .test_gdbserver_threads import workers  # noqa: F401 - a fixture, used by name

pytestmark = [pytest.mark.gdb, pytest.mark.skipif(not GDB_CLIENTS, reason="no GDB")]


def _mi(gdb, program) -> GdbMi:
    return GdbMi(gdb, program=program, mi_async=True)


def _non_stop(mi: GdbMi) -> None:
    for setting in (*QUIET, "set non-stop on"):
        mi.command(f"-gdb-{setting}")


def _stop_of(mi: GdbMi, thread: str | None = None, reason: str | None = None) -> dict[str, MiValue]:
    """The next stop GDB reports (of `thread`, for `reason`, when given; others it reports meanwhile are passed)."""
    while True:
        stop = mi.wait_stopped()
        if (thread is None or stop.get("thread-id") == thread) and (reason is None or stop.get("reason") == reason):
            return stop


def _states(mi: GdbMi) -> dict[str, str]:
    """Each thread's state as GDB keeps it (`-thread-info`): GDB id -> running or stopped."""
    return {t["id"]: t["state"] for t in mi.command("-thread-info").get("threads")}  # type: ignore[index, union-attr]


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda g: f"gdb{g.version}")
@pytest.mark.parametrize("kind", KINDS)
def test_threads_stop_and_go_each_on_their_own(workers, servers, kind, gdb):
    server = servers(kind, workers["dynamic"])
    with _mi(gdb, workers["dynamic"]) as mi:
        _non_stop(mi)
        assert mi.attach(f"127.0.0.1:{server.listening()}").klass == "connected"
        assert _states(mi) == {"1": "stopped"}  # at its first instruction, the one thread there is
        mi.command("-break-insert work")
        mi.command("-exec-continue --all")  # continue -a &
        first = _stop_of(mi, reason="breakpoint-hit")
        hit = first["thread-id"]
        assert hit != "1" and first["frame"]["func"] == "work", first  # type: ignore[index]
        listed = mi.console("info threads").console
        # main waits in pthread_join: still running while a worker is stopped at the breakpoint (no all-stop)
        assert re.search(r"^\*?\s+1\s+Thread \S+ \"workers-dynamic\" \(running\)$", listed, re.M), listed
        assert re.search(rf"^\*?\s+{hit}\s+Thread \S+ \"workers-dynamic\" work \(id=\d\) at ", listed, re.M), listed
        mi.console(f"thread {hit}")
        ident = mi.evaluate("id")
        assert mi.console("continue &").klass == "running"  # this thread alone, over the breakpoint and on
        again = _stop_of(mi, thread=hit, reason="breakpoint-hit")
        assert again["frame"]["args"] == [{"name": "id", "value": ident}], again  # type: ignore[index]
        assert mi.console("interrupt -a").klass == "done"
        while "running" in _states(mi).values():  # each running thread's stop, as it comes
            mi.wait_stopped()
        stops = [s for s in mi.transcript if s.startswith("*stopped") and 'thread-id="1"' in s]
        assert stops and 'signal-name="0"' in stops[-1], stops  # a stop GDB asked for: signal 0
        assert len(_states(mi)) == 4, _states(mi)  # main and its three workers
        mi.command("-break-delete")
        mi.command("-exec-continue --all")
        assert _stop_of(mi, reason="exited-normally")
    assert server.wait() == 0, server.text()
    assert "counter 18" in server.out["stdout"], server.out  # every call of every thread, as natively


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda g: f"gdb{g.version}")
@pytest.mark.parametrize("kind", KINDS)
def test_extended_remote_runs_the_program_in_non_stop(workers, multi, kind, gdb):  # noqa: F811
    server = multi(kind, "--once")
    with _mi(gdb, workers["static"]) as mi:
        _non_stop(mi)
        result = mi.command(f"-target-select extended-remote 127.0.0.1:{server.listening()}", check=False)
        assert result.klass == "connected", result
        mi.console(f"set remote exec-file {workers['static']}")
        mi.command("-break-insert work")
        mi.command("-exec-run")
        stop = _stop_of(mi, reason="breakpoint-hit")
        assert stop["frame"]["func"] == "work" and "1" in _states(mi), stop  # type: ignore[index]
        assert _states(mi)["1"] == "running", _states(mi)
        mi.command("-break-delete")
        mi.command("-exec-continue --all")
        assert _stop_of(mi, reason="exited-normally")
    server.wait_line(r"^counter 18$", stream="stdout")


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda g: f"gdb{g.version}")
@pytest.mark.parametrize("kind", KINDS)
def test_a_trace_run_over_threads_that_never_stop(workers, servers, kind, gdb):
    """`continue -a &` while tracing: the frames are collected while every thread runs, `tstop` and `tfind` need
    no stop, and the program is ended by a variable set while it runs."""
    server = servers(kind, workers["static"], "forever")
    with _mi(gdb, workers["static"]) as mi:
        _non_stop(mi)
        assert mi.attach(f"127.0.0.1:{server.listening()}").klass == "connected"
        mi.command("-break-insert -a work")  # a tracepoint
        mi.command('-break-commands 1 "collect id"')
        assert mi.console("tstart").klass == "done"
        mi.command("-exec-continue --all")
        server.wait_line(r"^started$", stream="stdout")

        def frames() -> int:
            found = re.search(r"Collected (\d+) trace frames", mi.console("tstatus").console)
            return int(found.group(1)) if found else 0

        wait_until(lambda: frames() >= 9, "9 trace frames")
        assert set(_states(mi).values()) == {"running"}, _states(mi)  # nothing was stopped to collect them
        assert mi.console("tstop").klass == "done"
        found = mi.console("tfind start").console
        assert "Found trace frame 0, tracepoint 1" in found, found
        ids = {mi.evaluate("id")}
        for _ in range(8):
            assert re.search(r"Found trace frame \d+, tracepoint 1", mi.console("tfind").console)
            ids.add(mi.evaluate("id"))
        assert ids <= {"1", "2", "3"} and len(ids) >= 2, ids  # the threads' own arguments, collected
        mi.console("tfind none")
        assert set(_states(mi).values()) == {"running"}, _states(mi)
        assert mi.console("set var stop_all = 1").klass == "done"  # memory written while the threads run
        assert _stop_of(mi, reason="exited-normally")
    assert server.wait() == 0, server.text()
    assert server.out["stdout"] == ["started", "counter -1"], server.out

