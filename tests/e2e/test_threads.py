"""CPUs as GDB threads, with real GDB 13.1 and 18.1 against a 2-CPU stub: `info threads` lists one thread per CPU
with what it runs, `thread 2` shows CPU 1's live registers and backtrace, `thread 1` goes back; `--cpus` on the
command line.

Holds for a kernel that starts only CPU 0 (CPU 1 is listed `[offline]`, at the bootloader's entry) and for one that
starts every CPU: a kernel with Linux's `start_secondary` brings CPU 1 up, and the test waits, in GDB, until CPU 1 is
online (an event, not a time window); of another kernel CPU 1 may be shown either way.
"""

from __future__ import annotations

import re

import pytest

from kgtp_sim.client import kgtp_command, serve_until_exit
from kgtp_sim.machine import KernelImage

from ..conftest import VMLINUX, RspClient, run_gdb, start_stub

pytestmark = pytest.mark.gdb

IMAGE = KernelImage.load(VMLINUX)
#: A kernel that brings up the other CPUs (Linux's name for where a started CPU enters C) starts every CPU it has.
SMP_BOOT = "start_secondary" in IMAGE.symbols
ONLINE = r"CPU#{} \[(running|idle)\] \S+"


@pytest.fixture(scope="module")
def stub2():
    server = start_stub(cpus=2)
    yield server
    server.stop()


def _wait_for_cpu1_online(timeout: float = 60) -> tuple[str, ...]:
    """GDB Python that polls `info threads` until CPU 1 is no longer offline (only asked of an SMP kernel)."""
    return (
        "python",
        "import time",
        f"deadline = time.monotonic() + {timeout}",
        "while 'CPU#1 [offline]' in gdb.execute('info threads', to_string=True):",
        "    if time.monotonic() > deadline:",
        f"        raise gdb.GdbError('CPU 1 did not come online in {timeout} s')",
        "    time.sleep(0.05)",
        "end",
    )


def _register(out: str, name: str) -> list[int]:
    return [int(v, 16) for v in re.findall(rf"^{name}\s+0x([0-9a-f]+)", out, re.M)]


def test_two_cpus_are_two_threads(gdb, stub2):
    wait = _wait_for_cpu1_online() if SMP_BOOT else ()
    out = run_gdb(gdb, stub2, *wait, "echo ==threads\\n", "info threads",
                  "thread 2", "echo ==cpu1\\n", "info registers rip rsp", "bt 5",
                  "thread 1", "echo ==cpu0\\n", "info registers rip rsp", "bt 5", "echo ==end\\n", timeout=120)
    assert "==end" in out, out
    threads = out.split("==threads", 1)[1].split("==cpu1", 1)[0]
    rows = re.findall(r"^[* ] (\d+)\s+Thread (\d+) \((CPU#\d+ \[\w+\][^)]*)\)", threads, re.M)
    assert [(row[0], row[1]) for row in rows] == [("1", "1"), ("2", "2")], out
    cpu0, cpu1 = rows[0][2], rows[1][2]
    assert re.fullmatch(ONLINE.format(0), cpu0), out  # CPU 0 runs a task with a name
    offline = cpu1 == "CPU#1 [offline]"
    assert re.fullmatch(ONLINE.format(1), cpu1) or (offline and not SMP_BOOT), out
    assert re.search(r"^\* 1 ", threads, re.M), out  # thread 1 (CPU 0) is the one GDB looks at after attaching

    on_cpu1 = out.split("==cpu1", 1)[1].split("==cpu0", 1)[0]
    on_cpu0 = out.split("==cpu0", 1)[1].split("==end", 1)[0]
    assert "[Switching to thread 2 (Thread 2)]" in out and "[Switching to thread 1 (Thread 1)]" in out, out
    for shown in (on_cpu1, on_cpu0):
        assert re.search(r"^#0\s+.*\bin\b|^#0\s+\w+ \(", shown, re.M), out  # bt names a function
    rip1, rsp1 = _register(on_cpu1, "rip") + _register(on_cpu1, "rsp")
    rip0, rsp0 = _register(on_cpu0, "rip") + _register(on_cpu0, "rsp")
    text = IMAGE.symbols["_start"].address
    assert rip0 >= text and rip1 >= text, out
    assert rsp0 != rsp1, out  # each CPU has its own stack (an offline CPU none yet)
    if offline:
        assert rip1 == IMAGE.entry and rsp1 == 0, out  # where the bootloader left it


def test_thread_packets_over_the_wire(stub2):
    with RspClient.connect_when_free(stub2) as client:
        assert client.request(b"qfThreadInfo") == b"m1,2"
        assert client.request(b"qsThreadInfo") == b"l"
        assert client.request(b"Hg2") == b"OK"
        assert client.request(b"qC") == b"QC2"
        assert client.request(b"?") == b"T05thread:2;"
        assert client.request(b"T2") == b"OK"
        assert client.request(b"T3").startswith(b"E")
        assert client.request(b"Hg9").startswith(b"E")
        assert client.request(b"qThreadExtraInfo,9").startswith(b"E")
        assert client.request(b"qThreadExtraInfozz") == b""
        assert client.request(b"P0=" + b"00" * 8) == b"E03"  # no --allow-writes
        assert client.request(b"qC") == b"QC2"
    with RspClient.connect_when_free(stub2) as client:  # the next debugger starts on CPU 0 again
        assert client.request(b"qC") == b"QC1"


def test_one_cpu_is_one_thread():
    server = start_stub(cpus=1)
    try:
        with RspClient.connect_when_free(server) as client:
            assert client.request(b"qfThreadInfo") == b"m1"
            assert client.request(b"T2").startswith(b"E")
            extra = bytes.fromhex(client.request(b"qThreadExtraInfo,1").decode()).decode()
            assert re.fullmatch(ONLINE.format(0), extra), extra
    finally:
        server.stop()


@pytest.mark.parametrize("count", ["0", "9", "-1"])
def test_cpus_out_of_range_is_refused_before_listening(count):
    result = serve_until_exit("--cpus", count)
    assert result.returncode == 2, result
    assert "--cpus must be between 1 and 8" in result.stderr, result


def test_help_shows_cpus():
    import subprocess

    from kgtp_sim import cli
    from kgtp_sim.machine import smp

    shown = subprocess.run(kgtp_command("serve", "--help"), capture_output=True, text=True, check=True).stdout
    assert re.search(r"--cpus CPUS\s+CPUs of the simulated machine, 1 to 8.*\(default: 2\)", shown, re.S), shown
    assert cli.MAX_CPUS == smp.MAX_CPUS and cli.DEFAULT_CPUS == 2
