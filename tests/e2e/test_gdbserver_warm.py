"""`kgtp-sim warm` and the warm start of `kgtp-sim gdbserver` (kgtp_sim/warm.py), end to end with real GDB.

A launch through the warm server must be the cold server to everyone who sees it: the same lines on the same
streams, the program's arguments, environment, working directory and exit status, GDB's session, the launcher's
exit status (a code or a signal) and the signals sent to it. A launcher that dies takes its server with it; what
is not a launch is refused and the warm server goes on; its socket's directory must be the user's alone.

Every wait is for an event (a line printed, a process's end, a port closed), bounded by a deadline that fails.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest

from kgtp_sim.client import ROOT, kgtp_command

from ..programs import compile_program
from .test_gdbserver_role import Server, run_session

pytestmark = pytest.mark.gdb

WAIT_S = 60


class Launched(Server):
    """`kgtp-sim gdbserver ...` as a child process (warm when `env` names a warm server), from `cwd`: its lines on
    both streams (test_gdbserver_role's Server)."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        super().__init__(kgtp_command("gdbserver", *argv), {"PYTHONPATH": str(ROOT), **env}, cwd)

    def end(self) -> int:
        """Its exit status once both streams reached their end."""
        return self.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A warm server for the module: (its process, its socket's path)."""
    directory = tmp_path_factory.mktemp("warm")
    directory.chmod(0o700)
    path = directory / "warm.sock"
    proc = subprocess.Popen(kgtp_command("warm", "--socket", str(path)), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stderr.readline().strip() == f"Warm on {path}"
    yield proc, path
    proc.terminate()
    rest = proc.communicate(timeout=WAIT_S)[1]
    assert proc.returncode == 0, rest
    assert re.search(r"\d+ launches", rest), rest


@pytest.fixture
def launches():
    started: list[Launched] = []

    def launch(argv: list[str], env: dict[str, str], cwd: Path) -> Launched:
        started.append(Launched(argv, env, cwd))
        return started[-1]

    yield launch
    for launched in started:
        launched.stop()


@pytest.fixture(scope="module")
def args_program(tmp_path_factory) -> Path:
    return compile_program("args", "glibc-dynamic", tmp_path_factory.mktemp("args"))


def _children_of(pid: int) -> set[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry))
    return found


def _gone(pid: int) -> bool:
    """The process ended and was reaped (or is a zombie its parent has not waited for yet: it runs no more)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _wait_until(condition, what: str) -> None:
    """Wait for an event seen only by looking (a process's end elsewhere), failing after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _session(gdb, launches, program: Path, env: dict[str, str]) -> tuple[str, Launched]:
    """`gdbserver --once :0 ./args one 7` from the program's directory with KGTP_TEST set, GDB's session on it to
    the program's end: GDB's output and the ended launch."""
    launched = launches(["--once", "127.0.0.1:0", f"./{program.name}", "one", "7"],
                        {"KGTP_TEST": "from-the-launcher", **env}, program.parent)
    port = int(launched.wait_line(r"^Listening on port (\d+)$").group(1))
    out = run_session(gdb, program, port, ["break main", "continue", "print $rdi", "continue"])
    assert launched.end() == 0, (launched.out, out)
    return out, launched


def _comparable(lines: list[str]) -> list[str]:
    return [re.sub(r"pid = \d+|port \d+", "N", line) for line in lines]


def test_a_warm_launch_is_the_cold_server_to_gdb_and_to_its_caller(gdb, warm, launches, args_program):
    _proc, path = warm
    cold_out, cold = _session(gdb, launches, args_program, {})
    warm_out, launched = _session(gdb, launches, args_program, {"KGTP_SIM_WARM": str(path)})
    # the program ran with the launcher's arguments, environment and directory, its output on the launcher's streams
    assert 'argv[0] = "./args-glibc-dynamic"' in launched.out["stdout"], (launched.out, warm_out)
    assert 'argv[2] = "7"' in launched.out["stdout"] and "KGTP_TEST=from-the-launcher" in launched.out["stdout"]
    assert "to stderr" in launched.out["stderr"] and "Child exited with status 7" in launched.out["stderr"]
    assert launched.out["stdout"] == cold.out["stdout"]
    assert _comparable(launched.out["stderr"]) == _comparable(cold.out["stderr"])
    for out in (cold_out, warm_out):
        assert re.search(r"Breakpoint 1, .*main \(\)", out), out
        assert re.search(r"\$1 = 3", out) and re.search(r"exited with code 07", out), out
    assert _comparable(warm_out.splitlines()) == _comparable(cold_out.splitlines())


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_to_the_launcher_reaches_its_server_and_ends_both_as_it_ends_a_cold_one(warm, launches, args_program,
                                                                                       number):
    _proc, path = warm
    statuses = []
    for env in ({}, {"KGTP_SIM_WARM": str(path)}):
        launched = launches(["127.0.0.1:0", str(args_program)], env, ROOT)
        launched.wait_line(r"^Listening on port \d+$")
        launched.proc.send_signal(number)
        statuses.append(launched.end())
    # SIGINT: the server's Ctrl-C, a clean end (0); the others end it by the signal, the launcher likewise
    assert statuses[1] == statuses[0] == (0 if number == signal.SIGINT else -number), statuses


def test_a_killed_launcher_takes_its_server_with_it(warm, launches, args_program):
    proc, path = warm
    before = _children_of(proc.pid)
    launched = launches(["127.0.0.1:0", str(args_program)], {"KGTP_SIM_WARM": str(path)}, ROOT)
    port = int(launched.wait_line(r"^Listening on port (\d+)$").group(1))
    server = _children_of(proc.pid) - before
    assert len(server) == 1, server
    launched.proc.kill()
    launched.proc.wait()
    _wait_until(lambda: _gone(next(iter(server))), "the forked server outlived its launcher")
    # its port closes once its last thread is gone (the leader shows as a zombie before that)
    _wait_until(lambda: _refused(port), f"port {port} still accepts connections")


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def _request(path: Path, payload: bytes, fds: list[int]) -> bytes:
    """What the warm server answers a raw request before it closes the connection."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(WAIT_S)
        conn.connect(str(path))
        if fds:
            socket.send_fds(conn, [payload], fds)
        else:
            conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := conn.recv(4096):
            answer += chunk
        return answer


def test_what_is_not_a_launch_is_refused_and_the_warm_server_goes_on(warm, launches, tmp_path):
    proc, path = warm
    request = json.dumps({"argv": ["serve"], "cwd": "/", "env": {}}).encode()
    with open(os.devnull) as null:
        streams = [null.fileno()] * 3
        assert _request(path, b"garbage", []) == b""  # no streams, not a request
        assert _request(path, b"\0\0\0\x05{}", streams) == b""  # not JSON of a request
        assert _request(path, struct.pack("!I", 1 << 30), streams) == b""  # too long
        assert _request(path, struct.pack("!I", len(request)) + request, streams) == b""  # not gdbserver's
    assert proc.poll() is None
    launched = launches(["--help"], {"KGTP_SIM_WARM": str(path)}, tmp_path)
    assert launched.end() == 0
    assert launched.out["stdout"][0].startswith("usage: kgtp-sim gdbserver"), launched.out


def test_without_a_warm_server_the_launch_starts_cold(launches, args_program, tmp_path):
    launched = launches(["--once", "127.0.0.1:0", str(args_program)], {"KGTP_SIM_WARM": str(tmp_path / "none")}, ROOT)
    launched.wait_line(r"^Listening on port \d+$")
    launched.proc.send_signal(signal.SIGINT)
    assert launched.end() == 0, launched.out


def test_the_socket_must_be_in_a_directory_of_the_users_alone(warm, tmp_path):
    _proc, path = warm
    open_directory = tmp_path / "open"
    open_directory.mkdir(mode=0o755)
    open_directory.chmod(0o755)
    for where, message in ((open_directory / "warm.sock", "no one else can open"),
                           (path, "already listens")):
        proc = subprocess.run(kgtp_command("warm", "--socket", str(where)), capture_output=True, text=True,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=WAIT_S)
        assert proc.returncode == 1 and message in proc.stderr, proc.stderr
