"""The GDB binaries of this host, and GDB in batch mode with the bundled kernel's symbols, attached to a stub.

Two ways to pass commands: a command file (`run_gdb`: multi-line commands such as `actions` ... `end` and GDB
Python work; the first failing command ends the file) or one `-ex` per command (`gdb_each`: every command runs,
even after an earlier one failed). GDB runs with TERM=dumb so its output has no terminal escapes.

Runs on the caller's thread (tests, tools, the benchmark); GDB is a child process, waited for with no thread of its
own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .paths import VMLINUX
from .stub import StubProcess


@dataclass(frozen=True)
class GdbClient:
    """A GDB binary the suite drives: Debian's GDB 13 or the 18.1 of the `gdb-for-pwndbg` wheel."""

    version: str
    path: str


Gdb = GdbClient | str  # a GdbClient, or the path of a GDB binary


def system_gdb() -> str | None:
    """The distribution's GDB (not one a virtual environment put first on PATH)."""
    return shutil.which("gdb", path="/usr/bin:/bin:/usr/local/bin")


def gdb_clients() -> list[GdbClient]:
    """Every GDB this host has of the two the project supports."""
    clients = []
    system = system_gdb()
    if system:
        clients.append(GdbClient("13", system))
    wheel = Path(sys.executable).parent / "gdb"
    if wheel.exists():
        clients.append(GdbClient("18", str(wheel)))
    return clients


GDB_CLIENTS = gdb_clients()


def gdb_path(gdb: Gdb) -> str:
    return gdb.path if isinstance(gdb, GdbClient) else gdb


def gdb_environment() -> dict[str, str]:
    return dict(os.environ, TERM="dumb")


def gdb_version(gdb: Gdb) -> str:
    """The first line of `gdb --version`, e.g. `GNU gdb (Debian 13.1-3) 13.1`."""
    result = subprocess.run([gdb_path(gdb), "--version"], capture_output=True, text=True, check=True)
    return result.stdout.splitlines()[0]


def batch_argv(gdb: Gdb, *arguments: str, program: Path = VMLINUX) -> list[str]:
    """`gdb -nx -batch PROGRAM ARGUMENTS...`: no init files, exit after the arguments' commands."""
    return [gdb_path(gdb), "-nx", "-batch", str(program), *arguments]


def session_lines(address: str | None, commands: Iterable[str]) -> list[str]:
    """A batch session's commands: no paging or confirmation, `target remote ADDRESS` (unless None), `commands`."""
    lines = ["set pagination off", "set confirm off"]
    if address is not None:
        lines.append(f"target remote {address}")
    return [*lines, *commands]


def gdb_batch(gdb: Gdb, *arguments: str, timeout: float = 90) -> subprocess.CompletedProcess:
    """Run `batch_argv(gdb, *arguments)` to its end; its exit status and output (stdout and stderr apart)."""
    return subprocess.run(batch_argv(gdb, *arguments), capture_output=True, text=True, timeout=timeout,
                          env=gdb_environment())


def start_gdb(gdb: Gdb, *arguments: str, **popen: object) -> subprocess.Popen:
    """`batch_argv(gdb, *arguments)` as a process of its own (to be killed, or to run beside another client)."""
    return subprocess.Popen(batch_argv(gdb, *arguments), env=gdb_environment(), **popen)  # type: ignore[call-overload]


@contextmanager
def command_file(lines: Iterable[str]) -> Iterator[Path]:
    """A temporary GDB command file holding `lines`, removed afterwards."""
    with tempfile.NamedTemporaryFile("w", suffix=".gdb", delete=False) as script:
        script.write("\n".join(lines) + "\n")
    try:
        yield Path(script.name)
    finally:
        os.unlink(script.name)


def run_gdb(gdb: Gdb, stub: StubProcess | None, *commands: str, timeout: float = 90, attach: bool = True) -> str:
    """Run GDB in batch mode with the kernel's symbols, attached to the stub, executing `commands` from a command
    file (so multi-line commands such as `actions` ... `end` work); returns everything it printed."""
    address = None
    if attach:
        if stub is None:
            raise ValueError("run_gdb: attaching needs a stub")
        address = stub.address
    with command_file(session_lines(address, commands)) as script:
        result = gdb_batch(gdb, "-x", str(script), timeout=timeout)
    return result.stdout + result.stderr


def gdb_each(gdb: Gdb, stub: StubProcess, *commands: str, timeout: float = 60) -> str:
    """Run GDB in batch mode with one `-ex` per command, so every command runs even after an earlier one failed
    (a command file stops at the first error); returns everything it printed."""
    arguments = [word for command in session_lines(stub.address, commands) for word in ("-ex", command)]
    result = gdb_batch(gdb, *arguments, timeout=timeout)
    return result.stdout + result.stderr
