"""The thread packets' parsers: ids as GDB writes them (hex, 0, -1, p<pid>.<tid>), and malformed ones refused."""

from __future__ import annotations

import pytest

from kgtp_sim.rsp.dispatch import Dispatcher, handles
from kgtp_sim.rsp.packets import connect as c
from kgtp_sim.rsp.packets.base import PacketError


@pytest.mark.parametrize(("body", "op", "thread", "process"), [
    (b"g1", "g", 1, None), (b"g2", "g", 2, None), (b"gA", "g", 10, None), (b"c-1", "c", -1, None),
    (b"g0", "g", 0, None), (b"c0", "c", 0, None), (b"m3", "m", 3, None), (b"gp1.2", "g", 2, 1),
    (b"gp1.-1", "g", -1, 1), (b"gp1", "g", 0, 1), (b"cp1.0", "c", 0, 1), (b"gp528f.528f", "g", 0x528F, 0x528F),
    (b"cp-1.-1", "c", -1, None),
])
def test_set_thread_reads_every_form_gdb_writes(body, op, thread, process):
    """The multiprocess form keeps the process it names (GDB selects a fork child's thread before it takes its
    breakpoints out of it); `p-1` is every process."""
    assert c.SetThread.parse(body) == c.SetThread(op, thread, process)


@pytest.mark.parametrize("body", [b"", b"g", b"x1", b"gzz", b"g-2", b"g-", b"g1 ", b"gp", b"gp1.", b"gpz.1",
                                  b"g" + b"f" * 40])
def test_set_thread_refuses_malformed_ids(body):
    with pytest.raises(PacketError):
        c.SetThread.parse(body)


@pytest.mark.parametrize(("body", "thread"), [(b"1", 1), (b"8", 8), (b"-1", -1), (b"0", 0), (b"p1.2", 2)])
def test_thread_alive_and_extra_info_read_an_id(body, thread):
    assert c.ThreadAlive.parse(body) == c.ThreadAlive(thread)
    assert c.ThreadExtraInfo.parse(body) == c.ThreadExtraInfo(thread)


@pytest.mark.parametrize("body", [b"", b"zz", b"-5", b"1,2", b"p.1"])
def test_thread_alive_and_extra_info_refuse_malformed_ids(body):
    for packet in (c.ThreadAlive, c.ThreadExtraInfo):
        with pytest.raises(PacketError):
            packet.parse(body)


class _Threads:
    @handles(c.ThreadExtraInfo)
    def extra(self, packet):
        return b"%x" % packet.thread

    @handles(c.ThreadAlive)
    def alive(self, packet):
        return b"OK"

    @handles(c.CurrentThread)
    def current(self, packet):
        return b"QC1"


def test_dispatch_routes_thread_packets_and_answers_bad_ids_with_e01():
    dispatcher = Dispatcher((_Threads(),))
    assert dispatcher.dispatch(b"qThreadExtraInfo,2") == b"2"
    assert dispatcher.dispatch(b"qThreadExtraInfo,zz") == b"E01"
    assert dispatcher.dispatch(b"qThreadExtraInfo") == b""  # no comma: not the packet, an unknown one
    assert dispatcher.dispatch(b"T2") == b"OK"
    assert dispatcher.dispatch(b"T") == b"E01"
    assert dispatcher.dispatch(b"qC") == b"QC1"
    assert dispatcher.dispatch(b"qCx") == b""
    assert "qThreadExtraInfo" not in ";".join(dispatcher.supported_features())  # GDB asks it without a feature
