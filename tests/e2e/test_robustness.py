"""Bad input over a real socket, security defaults and command-line errors, against the stub process."""

from __future__ import annotations

import re

import pytest

from kgtp_sim.client import ROOT, VMLINUX, RspClient, run_gdb, serve_until_exit, start_stub

from ..conftest import assert_kernel_ticks


def _connect(stub) -> RspClient:
    return RspClient.connect_when_free(stub, timeout=5)


@pytest.fixture(scope="module")
def jiffies_address():
    from kgtp_sim.machine import KernelImage

    return KernelImage.load(VMLINUX).symbols["jiffies"].address


def test_malformed_packets_get_errors_and_the_kernel_keeps_running(stub, jiffies_address):
    with _connect(stub) as client:
        for bad in (b"m", b"mzz,4", b"m1,fffffffffffffffff", b"Mffffffff81000000,2:00", b"qRcmd,zz", b"p999",
                    b"qXfer:features:read:target.xml:zz", b"Hz1"):
            (reply,) = client.exchange(bad)
            assert reply.startswith(b"E"), (bad, reply)
        assert client.exchange(b"vNoSuchPacket") == [b""]
        assert_kernel_ticks(client, jiffies_address, timeout=10)


def test_bad_checksum_is_nacked_then_the_retransmit_is_served(stub, jiffies_address):
    with _connect(stub) as client:
        client.send_raw(b"$m%x,8#00" % jiffies_address)
        assert client.sock.recv(16) == b"-"
        assert client.read_u64(jiffies_address) > 0


def test_client_vanishing_mid_packet_leaves_the_server_serving(stub, jiffies_address):
    client = _connect(stub)
    client.send_raw(b"+$m%x,8#" % jiffies_address)  # no checksum: cut off mid-packet
    client.close()
    with _connect(stub) as again:
        assert again.read_u64(jiffies_address) > 0


def test_garbage_flood_does_not_break_framing(stub, jiffies_address):
    with _connect(stub) as client:
        # '$' would open a packet and '-' legitimately asks for a retransmission; everything else is noise
        client.send_raw(bytes(range(256)).replace(b"$", b"").replace(b"-", b"") * 64)
        assert client.read_u64(jiffies_address) > 0


def test_continue_then_ctrl_c_gives_a_stop_reply(stub):
    with _connect(stub) as client:
        client.send(b"c")
        client.acknowledged()  # the stub has the `c` and waits for the interrupt
        client.send_raw(b"\x03")
        assert client.answer() == [b"T05thread:1;"]


#: GDB Python: read kgtp_counter until two reads 50 ms apart agree (the call in flight when pace 0 came is done)
_WAIT_FOR_KGTP_COUNTER_TO_SETTLE = (
    "python", "import time", "last = None", "for _ in range(400):",
    "    now = int(gdb.parse_and_eval('kgtp_counter'))", "    if now == last:", "        break",
    "    last = now", "    time.sleep(0.05)", "end",
)


def test_writes_work_only_when_enabled(gdb):
    server = start_stub("--allow-writes")
    try:
        # pace 0: the workload stops calling kgtp_test_function, so the value read back is exactly ours
        out = run_gdb(gdb, server, "monitor pace 0", *_WAIT_FOR_KGTP_COUNTER_TO_SETTLE,
                      "print kgtp_counter = 123456", "print kgtp_counter")
        assert re.search(r"^\$2 = 123456$", out, re.M), out
    finally:
        server.stop()


def test_monitor_knobs(gdb, stub):
    out = run_gdb(gdb, stub, "monitor hz 250", "monitor hz", "monitor pace 7", "monitor pace 0x10", "monitor hz 0",
                  "monitor frobnicate", "monitor hz 100")
    assert "hz 250" in out and "pace 7" in out and "pace 16" in out
    assert "hz must be between 1 and 10000" in out
    assert "unknown command 'frobnicate'" in out


def test_bad_kernel_is_a_one_line_error(tmp_path):
    bogus = tmp_path / "vmlinux"
    bogus.write_bytes(b"\x7fELF not really")
    for path in (bogus, tmp_path / "missing", ROOT / "README.md"):
        result = serve_until_exit("--kernel", str(path))
        assert result.returncode == 1
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.startswith("kgtp-sim: ")


def test_non_loopback_bind_needs_explicit_flag():
    result = serve_until_exit("--host", "0.0.0.0")
    assert result.returncode == 2 and "--allow-remote" in result.stderr


def test_default_bind_is_loopback(stub):
    assert re.search(r"listening on 127\.0\.0\.1:\d+", "".join(stub.output))
