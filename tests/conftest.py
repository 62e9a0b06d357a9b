"""Shared fixtures: the bundled kernel, a running stub subprocess, and the real GDB clients."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VMLINUX = ROOT / "fixtures" / "vmlinux"


@dataclass(frozen=True)
class GdbClient:
    version: str
    path: str


def _gdb_clients() -> list[GdbClient]:
    clients = []
    system = shutil.which("gdb", path="/usr/bin:/bin:/usr/local/bin")
    if system:
        clients.append(GdbClient("13", system))
    wheel = Path(sys.executable).parent / "gdb"
    if wheel.exists():
        clients.append(GdbClient("18", str(wheel)))
    return clients


GDB_CLIENTS = _gdb_clients()


@dataclass
class StubProcess:
    proc: subprocess.Popen
    port: int
    output: list[str]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def connect_when_free(stub: StubProcess, timeout: float = 10) -> socket.socket:
    """A raw RSP connection that got past qSupported, retrying while the stub's one debugger slot is still held
    (often by the GDB of the previous test, which has quit but not yet been let go)."""
    from kgtp_sim.rsp.codec import Decoder, EventKind, encode_packet

    deadline = time.monotonic() + timeout
    while True:
        sock = socket.create_connection(("127.0.0.1", stub.port), timeout=timeout)
        sock.sendall(b"+" + encode_packet(b"qSupported"))
        decoder, replies = Decoder(), []
        while not replies and (data := sock.recv(4096)):
            replies = [e.payload for e in decoder.feed(data) if e.kind is EventKind.PACKET]
        if replies and b"PacketSize=" in replies[0]:
            return sock
        sock.close()
        assert time.monotonic() < deadline, f"the stub kept refusing a debugger: {replies!r}"
        time.sleep(0.05)


def start_stub(*extra: str, timeout: float = 30) -> StubProcess:
    """`kgtp-sim serve --port 0` as a user runs it; returns once it prints the port it listens on."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kgtp_sim", "serve", "--port", "0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    output: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        output.append(line)
        match = re.search(r"listening on [\d.]+:(\d+)", line)
        if match:
            stub = StubProcess(proc, int(match.group(1)), output)
            # keep draining output so the stub never blocks on a full pipe
            import threading

            threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True).start()
            return stub
    proc.kill()
    raise RuntimeError("stub did not start:\n" + "".join(output))


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


def run_gdb(client: GdbClient, stub: StubProcess | None, *commands: str, timeout: float = 90,
            attach: bool = True) -> str:
    """Run GDB in batch mode with the kernel's symbols, attached to the stub, executing `commands` from a command
    file (so multi-line commands such as `actions` ... `end` work); returns everything it printed."""
    import tempfile

    lines = ["set pagination off", "set confirm off"]
    if attach:
        assert stub is not None
        lines.append(f"target remote {stub.address}")
    lines += commands
    with tempfile.NamedTemporaryFile("w", suffix=".gdb", delete=False) as script:
        script.write("\n".join(lines) + "\n")
    argv = [client.path, "-nx", "-batch", str(VMLINUX), "-x", script.name]
    env = dict(os.environ, TERM="dumb")
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    finally:
        os.unlink(script.name)
    return result.stdout + result.stderr


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


def wait_for_trace_stop(timeout: float = 30) -> tuple[str, ...]:
    """GDB commands that wait until the trace run stopped by itself (an error, a pass count, a full buffer)."""
    return _gdb_wait((), "'Trace is running' not in status", f"the trace run did not stop in {timeout} s", timeout)


@pytest.fixture(params=GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def gdb(request) -> GdbClient:
    return request.param
