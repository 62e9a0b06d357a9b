"""The packets of extended-remote (rsp/packets): vRun's hex words, vAttach's pid, `!` and `R`, and a reply that is
no reply (NoReply: acknowledged, nothing sent), as a session writes it."""

from __future__ import annotations

import pytest

from kgtp_sim.rsp.dispatch import Dispatcher, NoReply, handles
from kgtp_sim.rsp.packets import connect as c
from kgtp_sim.rsp.packets import run as v
from kgtp_sim.rsp.packets.base import PacketError
from kgtp_sim.rsp.session import Session, ends_with_the_process


def test_vrun_words_are_hex_the_first_the_program():
    packet = v.VRun.parse(b"2f746d702f70;61;;62")
    assert (packet.program, packet.args) == ("/tmp/p", ("a", "", "b"))
    assert v.VRun.parse(b"") == v.VRun("", ())  # the last program run again
    with pytest.raises(PacketError):
        v.VRun.parse(b"2f7")


def test_vattach_takes_a_hex_pid():
    assert v.VAttach.parse(b"64").pid == 100
    with pytest.raises(PacketError):
        v.VAttach.parse(b"")


class _Restart:
    @handles(c.Restart)
    def restart(self, packet: c.Restart) -> NoReply:
        return NoReply()


def test_no_reply_is_acknowledged_and_nothing_else():
    session = Session(Dispatcher((_Restart(),)))
    assert session.receive(b"$R00#b2") == b"+"
    assert session.receive(b"$!#21") == b"+$#00"  # no handler: the empty reply


def test_only_the_one_process_sessions_end_with_a_kill_or_a_detach():
    assert ends_with_the_process(b"k", b"")
    assert ends_with_the_process(b"D;64", b"OK") and not ends_with_the_process(b"D;64", b"E01")
    assert ends_with_the_process(b"vKill;64", b"OK") and not ends_with_the_process(b"vRun;", b"OK")
    session = Session(Dispatcher(()), ends_session=lambda payload, reply: False)
    session.receive(b"$k#6b")
    assert not session.closing
