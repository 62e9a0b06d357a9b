"""Session and dispatcher behaviour on byte strings, with a tiny handler family standing in for a target."""

from dataclasses import dataclass

from kgtp_sim.rsp.codec import Decoder, EventKind, checksum, encode_packet
from kgtp_sim.rsp.dispatch import Binary, Dispatcher, RspError, WithOutput, handles
from kgtp_sim.rsp.packets import connect as c
from kgtp_sim.rsp.packets import data as d
from kgtp_sim.rsp.packets.base import Packet
from kgtp_sim.rsp.session import Session


@dataclass(frozen=True)
class Boom(Packet):
    PREFIX = b"qBoom"
    FEATURES = ("Boom+",)


class Handlers:
    @handles(c.StartNoAckMode)
    def noack(self, p):
        return b"OK"

    @handles(d.ReadMemory)
    def m(self, p):
        if p.address == 0:
            raise RspError(2, "unmapped")
        if p.address == 1:
            raise RspError(2, "$kret needs the first address of a function (trace *FUNCTION, #1)", text=True)
        return bytes(range(p.length)).hex().encode()

    @handles(c.Continue)
    def cont(self, p):
        from kgtp_sim.rsp.dispatch import Deferred

        return Deferred()

    @handles(c.MonitorCommand)
    def rcmd(self, p):
        return WithOutput("x" * 600)

    @handles(c.ReadFeatures)
    def xfer(self, p):
        return Binary(b"l$#")

    @handles(Boom)
    def boom(self, p):
        raise ZeroDivisionError


def session():
    return Session(Dispatcher((Handlers(),)))


def packets(data):
    return [e.payload for e in Decoder().feed(data) if e.kind is EventKind.PACKET]


def send(s, payload):
    return s.receive(encode_packet(payload))


def test_ack_then_reply():
    out = send(session(), b"m100,4")
    assert out.startswith(b"+")
    assert packets(out) == [b"00010203"]


def test_malformed_packet_gets_e01_and_session_continues():
    s = session()
    assert packets(send(s, b"m100")) == [b"E01"]
    assert packets(send(s, b"mzz,4")) == [b"E01"]
    assert packets(send(s, b"m1,ffffffffffffffffff")) == [b"E01"]
    assert packets(send(s, b"m100,2")) == [b"0001"]


def test_handler_refusal_and_crash_become_error_replies():
    s = session()
    assert packets(send(s, b"m0,4")) == [b"E02"]
    assert packets(send(s, b"qBoom")) == [b"E0f"]
    assert packets(send(s, b"m100,1")) == [b"00"]


def test_unknown_packet_gets_empty_reply():
    assert packets(send(session(), b"vUnknownThing")) == [b""]


def test_qsupported_is_derived_from_handlers():
    (reply,) = packets(send(session(), b"qSupported:multiprocess+;swbreak+"))
    features = reply.split(b";")
    assert b"QStartNoAckMode+" in features
    assert b"qXfer:features:read+" in features
    assert b"Boom+" in features
    assert features[0].startswith(b"PacketSize=")


def test_no_ack_mode():
    s = session()
    out = send(s, b"QStartNoAckMode")
    assert out.startswith(b"+") and packets(out) == [b"OK"]
    out = send(s, b"m100,1")
    assert not out.startswith(b"+")


def test_bad_checksum_gets_nack_and_nack_gets_retransmit():
    s = session()
    assert s.receive(b"$m100,1#00") == b"-"
    first = send(s, b"m100,1")
    assert s.receive(b"-") == first[1:]
    assert s.stats.bad_checksums == 1 and s.stats.retransmits == 1


def test_continue_waits_for_ctrl_c():
    s = session()
    assert send(s, b"c") == b"+"
    assert packets(s.receive(b"\x03")) == [b"S05"]
    assert s.receive(b"\x03") == b""  # no continue pending: nothing sent


def test_stop_reply_may_be_computed_at_the_ctrl_c():
    thread = [1]
    s = Session(Dispatcher((Handlers(),)), stop_reply=lambda: b"T05thread:%x;" % thread[0])
    send(s, b"c")
    thread[0] = 2
    assert packets(s.receive(b"\x03")) == [b"T05thread:2;"]


def test_monitor_output_is_split_into_o_packets():
    out = packets(send(session(), b"qRcmd,6869"))
    assert out[-1] == b"OK"
    assert all(p.startswith(b"O") for p in out[:-1]) and len(out) == 3
    assert bytes.fromhex(b"".join(p[1:] for p in out[:-1]).decode()) == b"x" * 600


def test_binary_reply_is_escaped():
    out = send(session(), b"qXfer:features:read:target.xml:0,100")
    body = out[2 : out.index(b"#")]
    assert body == b"l}\x04}\x03"
    assert out.endswith(b"%02x" % checksum(body))


def test_hex_payload_with_spaces_is_malformed():
    assert packets(send(session(), b"qRcmd,68 69")) == [b"E01"]


def test_a_stop_the_target_makes_itself_is_sent_once_when_polled():
    stop: list[bytes | None] = [None]
    s = Session(Dispatcher((Handlers(),)), async_stop=lambda: stop[0])
    assert s.poll() == b""  # nothing waits
    send(s, b"c")
    assert s.poll() == b""  # the target runs on
    stop[0] = b"T05thread:2;"
    assert packets(s.poll()) == [b"T05thread:2;"]
    assert s.poll() == b"" and s.receive(b"\x03") == b""  # answered: Ctrl-C finds nothing to stop


def test_a_text_error_never_holds_the_bytes_that_frame_a_packet_or_repeat_one():
    """`$` and `#` frame a packet and `*` says the byte before it repeats (GDB's read_frame expands it in every
    packet): an `E.` text leaves them out, so GDB prints the text it was given (a `*FUNCTION` in a refusal once read
    as 41 spaces and "UNCTION")."""
    reply = packets(send(session(), b"m1,4"))
    assert reply == [b"E.kret needs the first address of a function (trace FUNCTION, 1)"]

