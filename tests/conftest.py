"""Shared fixtures: the bundled kernel, a running stub subprocess, and the real GDB clients."""

from __future__ import annotations

import os
import re
import shutil
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


def run_gdb(client: GdbClient, stub: StubProcess, *commands: str, timeout: float = 90, attach: bool = True) -> str:
    """Run GDB in batch mode against the stub with the kernel's symbols; returns everything it printed."""
    argv = [client.path, "-nx", "-batch", "-ex", "set pagination off", "-ex", "set confirm off", str(VMLINUX)]
    if attach:
        argv += ["-ex", f"target remote {stub.address}"]
    for command in commands:
        argv += ["-ex", command]
    env = dict(os.environ, TERM="dumb")
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    return result.stdout + result.stderr


@pytest.fixture(params=GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def gdb(request) -> GdbClient:
    return request.param
