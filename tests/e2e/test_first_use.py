"""What a new user meets first, against a real stub: a follower pointed at the RSP port by mistake is told so
at once (whether GDB holds the debugger slot or not), and `tstatus` before any run reports the trace buffer
GDB will get (per-CPU size times the CPUs, as KGTP sums it), with GDB 13.1 and 18.1."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from kgtp_sim.tracing.core.model import DEFAULT_BUFFER_SIZE

from ..conftest import ROOT, RspClient, run_gdb, start_stub

pytestmark = pytest.mark.gdb

#: the follower's run as a user starts it; it must end by itself, well before this
TIMEOUT = 60


@pytest.fixture(scope="module")
def first_stub():
    server = start_stub()
    yield server
    server.stop()


def kgtp(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kgtp_sim", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=TIMEOUT)


def assert_named_the_rsp_port(result: subprocess.CompletedProcess, port: int) -> None:
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    message = result.stderr.strip()
    assert f"127.0.0.1:{port} is a GDB remote protocol (RSP) port" in message, message
    assert f"the RSP port + 1 (here {port + 1})" in message, message
    assert len(message.splitlines()) == 1, message


@pytest.mark.parametrize("command", [("follow",), ("follow", "--from-start", "--count", "1"),
                                     ("export", "--format", "jsonl", "-o", "{tmp}/run.jsonl")])
def test_a_follower_at_the_rsp_port_is_told_so(command, first_stub, tmp_path):
    args = [part.format(tmp=tmp_path) for part in command]
    # the debugger slot free: the RSP server answers the probe packet itself
    assert_named_the_rsp_port(kgtp(*args, "--port", str(first_stub.port)), first_stub.port)
    # the slot held by a debugger: the stub refuses the newcomer's packet, and that answer is recognised too
    with RspClient.connect_when_free(first_stub) as holder:
        assert_named_the_rsp_port(kgtp(*args, "--port", str(first_stub.port)), first_stub.port)
        assert holder.request(b"?").startswith(b"T")  # the debugger holding the slot never noticed
    assert not any(tmp_path.iterdir())


def test_the_probe_leaves_the_stub_serving(first_stub, tmp_path):
    """After a follower probed the RSP port, a debugger attaches as before and the follow channel answers."""
    assert kgtp("follow", "--port", str(first_stub.port)).returncode == 1
    result = kgtp("export", "--port", str(first_stub.follow_port), "--format", "jsonl", "-o", str(tmp_path / "j"))
    assert result.returncode == 0 and "wrote 0 frames" in result.stdout, result.stderr
    with RspClient.connect_when_free(first_stub) as client:
        assert client.request(b"qTStatus").startswith(b"T0;tnotrun")


@pytest.fixture
def three_cpu_stub():
    server = start_stub(cpus=3)
    yield server
    server.stop()


def test_tstatus_before_a_run_reports_the_buffer_gdb_will_get(gdb, three_cpu_stub):
    out = run_gdb(gdb, three_cpu_stub, "tstatus", "set trace-buffer-size 65536", "tstatus")
    assert "No trace has been run on the target." in out, out
    sizes = [(int(free), int(size)) for free, size in
             re.findall(r"^Trace buffer has (\d+) bytes of (\d+) bytes free \(0% full\)\.$", out, re.M)]
    # KGTP's qTStatus: every CPU's ring counted, the size GDB asks for being each CPU's
    assert sizes == [(DEFAULT_BUFFER_SIZE * 3,) * 2, (65536 * 3,) * 2], out
