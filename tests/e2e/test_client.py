"""kgtp_sim.client against the stub process: start-up and its failure, the one debugger slot, no-ack mode, and the
MI driver attached with real GDB."""

from __future__ import annotations

import threading

import pytest

from kgtp_sim.client import GDB_CLIENTS, GdbMi, RspClient, StubProcess, start_stub


def test_a_stub_that_cannot_start_is_reported_with_its_output(tmp_path) -> None:
    """The stub exits before listening: start_stub says so at once (the end of its output is the event), with
    what it printed."""
    with pytest.raises(RuntimeError, match=r"(?s)the stub did not start:.*kgtp-sim: "):
        start_stub("--kernel", str(tmp_path / "missing"))


def test_connect_when_free_waits_until_the_slot_is_let_go(stub: StubProcess) -> None:
    """While one client holds the stub, a second is refused; connect_when_free keeps trying and is served as soon
    as the first goes."""
    first = RspClient.connect_when_free(stub)
    served: list[RspClient] = []
    waiter = threading.Thread(target=lambda: served.append(RspClient.connect_when_free(stub, timeout=30)))
    try:
        waiter.start()
        with RspClient.connect(stub.port) as other:
            other.send(b"qSupported")
            assert other.packet().startswith(b"E.kgtp-sim: another debugger is attached")
        assert waiter.is_alive() and not served
    finally:
        first.close()
    waiter.join(30)
    (second,) = served
    with second:
        assert second.request(b"qTStatus").startswith(b"T")


def test_no_ack_mode_stops_the_acks_both_ways(stub: StubProcess) -> None:
    with RspClient.connect_when_free(stub) as client:
        client.send(b"qTStatus")
        assert client.acknowledged()
        client.answer()
        client.no_ack_mode()
        client.send(b"m0,1")
        assert client.sock.recv(4096).startswith(b"$E")  # the reply, without a `+` in front
        assert client.request(b"qTStatus").startswith(b"T")


@pytest.mark.gdb
@pytest.mark.skipif(not GDB_CLIENTS, reason="needs gdb")
def test_gdb_mi_attaches_evaluates_and_detaches(stub: StubProcess) -> None:
    with GdbMi(GDB_CLIENTS[0].path) as mi:
        assert mi.attach(stub.address).klass == "connected"
        assert int(mi.evaluate("jiffies") or "-1") >= 0
        assert mi.evaluate("no_such_symbol") is None
        assert "Trace" in mi.console("tstatus").console
        assert mi.command("-target-detach").klass == "done"
