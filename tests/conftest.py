"""Shared fixtures: the bundled kernel, a running stub subprocess, and the real GDB clients.

Starting the stub, speaking RSP to it and running GDB are kgtp_sim.client's; the names the test modules import
from here come from there.
"""

from __future__ import annotations

import socket
import time

import pytest

from kgtp_sim.client import (
    GDB_CLIENTS,
    ROOT,
    VMLINUX,
    GdbClient,
    RspClient,
    StubProcess,
    run_gdb,
    start_stub,
)

__all__ = ["GDB_CLIENTS", "ROOT", "VMLINUX", "GdbClient", "StubProcess", "assert_kernel_ticks", "connect_when_free",
           "run_gdb", "start_stub", "wait_for_hits", "wait_for_trace_stop"]


def connect_when_free(stub: StubProcess, timeout: float = 10) -> socket.socket:
    """The socket of `RspClient.connect_when_free`, for tests that write and read the raw bytes themselves (the
    qSupported reply is not yet acknowledged)."""
    return RspClient.connect_when_free(stub, timeout).sock


def assert_kernel_ticks(client: RspClient, jiffies_address: int, timeout: float = 5) -> None:
    """The kernel is still alive: jiffies moves on within `timeout` seconds."""
    start = client.read_u64(jiffies_address)
    deadline = time.monotonic() + timeout
    while client.read_u64(jiffies_address) == start:
        assert time.monotonic() < deadline, "jiffies stopped: the kernel is no longer running"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def stub():
    server = start_stub()
    yield server
    server.stop()


@pytest.fixture
def fresh_stub():
    """A stub of its own: tracepoints a test leaves on the target are uploaded by the next GDB that attaches."""
    server = start_stub()
    yield server
    server.stop()


@pytest.fixture
def one_cpu_stub():
    """A stub of its own with one CPU: one workload thread, so consecutive frames of kgtp_test_function are
    consecutive calls of one loop (on more CPUs each CPU's kgtp_bench/N calls it with its own counters, and
    kgtp_counter counts them all)."""
    server = start_stub(cpus=1)
    yield server
    server.stop()


def _gdb_wait(setup: tuple[str, ...], done: str, failure: str, timeout: float) -> tuple[str, ...]:
    """GDB Python that polls until the expression `done` holds (the trace status text is `status`), or fails the
    script with `failure` after `timeout` seconds. `tstatus` also refreshes GDB's hit counts from the target."""
    return (
        "python",
        "import re, time",
        f"deadline = time.monotonic() + {timeout}",
        "def _hits(number):",
        "    shown = gdb.execute(f'info tracepoints {number}', to_string=True)",
        r"    found = re.search(r'already hit (\d+) time', shown)",
        "    return int(found.group(1)) if found else 0",
        "status = gdb.execute('tstatus', to_string=True)",
        *setup,
        f"while not ({done}):",
        "    if time.monotonic() > deadline:",
        f"        raise gdb.GdbError({failure!r})",
        "    time.sleep(0.02)",
        "    status = gdb.execute('tstatus', to_string=True)",
        "end",
    )


def wait_for_hits(number: int | str, hits: int = 1, *, more: bool = False, timeout: float = 30) -> tuple[str, ...]:
    """GDB commands that let the kernel run until tracepoint `number` was hit `hits` times (with `more`: `hits`
    times more than when the wait began). `number` may be "$tpnum", the tracepoint created last (GDB numbers
    on from the tracepoints it found on the target).

    Used instead of a fixed `shell sleep`: how much the kernel does in a second depends on the host's load, and a
    rarely called function (load_module) may not run at all in a short window.
    """
    hits_now = f"_hits({str(number)!r})"
    base = hits_now if more else "0"
    return _gdb_wait((f"base = {base}",), f"{hits_now} >= base + {hits}",
                     f"tracepoint {number} was not hit {hits} times in {timeout} s", timeout)


def wait_until(condition, what: str, timeout: float = 60.0):
    """Poll `condition()` (in this process) until it is true, and return its value; fail naming `what` after
    `timeout` seconds. For tests that wait for an event of the running machine, never for a time window."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def wait_for_trace_stop(timeout: float = 30) -> tuple[str, ...]:
    """GDB commands that wait until the trace run stopped by itself (an error, a pass count, a full buffer)."""
    return _gdb_wait((), "'Trace is running' not in status", f"the trace run did not stop in {timeout} s", timeout)


@pytest.fixture(params=GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def gdb(request) -> GdbClient:
    return request.param
