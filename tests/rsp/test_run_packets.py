"""`vCont?` and `vCont` as GDB writes them (remote.c: remote_vcont_probe, remote_resume_with_vcont): every action,
with and without a thread, signals, ranges; malformed ones are refused (E01)."""

from __future__ import annotations

import pytest

from kgtp_sim.rsp.dispatch import Dispatcher, handles
from kgtp_sim.rsp.packets.base import PacketError
from kgtp_sim.rsp.packets.run import VCont, VContAction, VContQuery


def test_each_action_and_its_thread():
    assert VCont.parse(b"c").actions == (VContAction("c"),)
    assert VCont.parse(b"s:2;c").actions == (VContAction("s", 2), VContAction("c"))
    assert VCont.parse(b"C0f:1;S05:p1.2;c:-1").actions == (
        VContAction("c", 1, signal=0xF), VContAction("s", 2, signal=5, process=1), VContAction("c", -1))
    assert VCont.parse(b"rffffffff81001000,ffffffff81001040:3;c").actions == (
        VContAction("r", 3, start=0xFFFFFFFF81001000, end=0xFFFFFFFF81001040), VContAction("c"))
    assert VCont.parse(b"t:1").actions == (VContAction("t", 1),)


def test_a_wildcard_of_one_process_keeps_the_process():
    """GDB resumes one process of several (schedule-multiple off): `c:pPID.-1`, every thread of that one."""
    assert VCont.parse(b"s:p64.64;c:p64.-1").actions == (
        VContAction("s", 0x64, process=0x64), VContAction("c", -1, process=0x64))
    assert VCont.parse(b"c:p-1.-1").actions == (VContAction("c", -1),)


@pytest.mark.parametrize("body", [b"", b"x", b"c:", b"cc", b"s:zz", b"C", b"Cxyz", b"r1000", b"r1000,", b"c;;s",
                                  b"s:-2", b"r,1000:1", b"C100"])
def test_malformed_actions_are_refused(body):
    with pytest.raises(PacketError):
        VCont.parse(body)


def test_the_query_and_the_packet_are_told_apart():
    class Handlers:
        @handles(VContQuery)
        def query(self, packet):
            return b"vCont;c;C;s;S"

        @handles(VCont)
        def resume(self, packet):
            return b"%d actions" % len(packet.actions)

    dispatcher = Dispatcher((Handlers(),))
    assert dispatcher.dispatch(b"vCont?") == b"vCont;c;C;s;S"
    assert dispatcher.dispatch(b"vCont;s:1;c") == b"2 actions"
    assert dispatcher.dispatch(b"vCont?x") == b""  # no such packet
    assert dispatcher.dispatch(b"vCont;q") == b"E01"
    assert not any("vCont" in feature for feature in dispatcher.supported_features())  # GDB asks vCont? itself
