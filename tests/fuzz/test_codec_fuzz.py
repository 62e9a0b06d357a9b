"""Property-based fuzzing of the RSP framing (kgtp_sim/rsp/codec.py) and of a session fed damaged streams.

tests/rsp/test_codec.py pins each framing rule and the round trip of good packets; here the input is hostile:
random bytes, valid packets interleaved with damaged ones (bad checksums, bad escapes and run-length counts,
truncation, restarts, oversized packets), cut into arbitrary reads. The decoder must never raise, never hold
more than its limit, and deliver every intact packet that follows the damage; a session must answer each
intact packet and keep serving.
"""

from __future__ import annotations

import os
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kgtp_sim.rsp.codec import Decoder, EventKind, FramingError, checksum, decode_body, encode_packet
from kgtp_sim.rsp.dispatch import Dispatcher, handles
from kgtp_sim.rsp.packets import connect as c
from kgtp_sim.rsp.packets import data as d
from kgtp_sim.rsp.session import Session
from kgtp_sim.tools.fuzz import damaged_frame, oversized

EXTRA = int(os.environ.get("KGTP_FUZZ_EXAMPLES", "0"))


def examples(default: int) -> int:
    return max(default, EXTRA)


SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])

payloads = st.binary(max_size=120)
chunkings = st.lists(st.integers(1, 40), min_size=1, max_size=20)


def feed_in_chunks(decoder: Decoder, stream: bytes, sizes: list[int]) -> list:
    events, i, k = [], 0, 0
    while i < len(stream):
        step = sizes[k % len(sizes)]
        events += decoder.feed(stream[i : i + step])
        i += step
        k += 1
    return events


@settings(max_examples=examples(400), **SETTINGS)
@given(st.binary(max_size=400), chunkings)
def test_random_bytes_never_raise_and_never_pile_up(data, sizes):
    decoder = Decoder(max_packet_size=256)
    events = feed_in_chunks(decoder, data, sizes)
    assert all(isinstance(e.kind, EventKind) for e in events)
    assert decoder.pending <= 256 + 3  # an unfinished packet is bounded ('$', body, '#', one checksum digit)
    # whatever was left, a fresh packet after it is delivered once the stream resynchronizes ('$' restarts)
    (last,) = [e for e in decoder.feed(encode_packet(b"qC")) if e.kind is EventKind.PACKET][-1:] or [None]
    if last is None:  # the garbage ended inside a checksum: the first '$' was taken as a digit, GDB resends
        (last,) = [e for e in decoder.feed(encode_packet(b"qC")) if e.kind is EventKind.PACKET]
    assert last.payload == b"qC"


@settings(max_examples=examples(400), **SETTINGS)
@given(st.lists(st.tuples(payloads, st.booleans(), st.integers(0, 2**32)), min_size=1, max_size=12), chunkings)
def test_intact_packets_survive_damaged_neighbours(items, sizes):
    """A stream of packets, some damaged in every way the fuzzer knows: each intact one is delivered, in order,
    and each damaged one yields at most a bad-checksum/bad-packet event (or a packet GDB would also accept)."""
    stream = b""
    expected = []
    for payload, damage, seed in items:
        if damage:
            wire = damaged_frame(random.Random(seed), payload)
            # a packet cut after its '#' takes the next two bytes as checksum digits (gdbserver reads them the
            # same way; GDB retransmits after the NACK): two ack bytes separate the damage from what follows
            stream += wire + b"++"
        else:
            stream += encode_packet(payload, binary=True)
            expected.append(payload)
    decoder = Decoder()
    events = feed_in_chunks(decoder, stream, sizes)
    delivered = [e.payload for e in events if e.kind is EventKind.PACKET]
    it = iter(delivered)
    assert all(any(p == want for p in it) for want in expected), (expected, delivered)  # a subsequence


@settings(max_examples=examples(300), **SETTINGS)
@given(st.binary(max_size=200))
def test_decode_body_either_decodes_or_raises_framing_error(raw):
    try:
        out = decode_body(raw)
    except FramingError:
        return
    assert len(out) <= len(raw) * 96  # a run-length byte repeats at most 97 times


@settings(max_examples=examples(200), **SETTINGS)
@given(st.integers(1, 5000), st.integers(0, 2**32))
def test_oversized_packets_are_dropped_and_the_next_is_served(limit, seed):
    decoder = Decoder(max_packet_size=limit)
    events = decoder.feed(oversized(random.Random(seed), limit))
    assert [e.kind for e in events] == [EventKind.BAD_PACKET] and decoder.pending == 0
    (event,) = decoder.feed(encode_packet(b"g"))
    assert event.payload == b"g"


@settings(max_examples=examples(200), **SETTINGS)
@given(st.binary(min_size=1, max_size=60), st.integers(1, 255))
def test_any_wrong_checksum_is_reported_not_delivered(payload, delta):
    body = encode_packet(payload, binary=True)[1:-3]
    wire = b"$" + body + b"#%02x" % ((checksum(body) + delta) & 0xFF)
    (event,) = Decoder().feed(wire)
    assert event.kind is EventKind.BAD_CHECKSUM and event.payload == body


# ---- a session on top: acks, nacks, answers ------------------------------------------------------------------


class Echo:
    """A tiny target: `m` answers its address, anything else known answers OK."""

    @handles(d.ReadMemory)
    def m(self, packet):
        return b"%x" % packet.address

    @handles(c.StartNoAckMode)
    def noack(self, packet):
        return b"OK"


def replies(out: bytes) -> list[bytes]:
    return [e.payload for e in Decoder().feed(out) if e.kind is EventKind.PACKET]


@settings(max_examples=examples(300), **SETTINGS)
@given(st.lists(st.tuples(payloads, st.integers(0, 2**32)), max_size=10), chunkings, st.integers(0, 2**40))
def test_a_session_serves_the_next_packet_whatever_came_before(noise, sizes, address):
    session = Session(Dispatcher((Echo(),)))
    stream = b"".join(damaged_frame(random.Random(seed), payload) for payload, seed in noise)
    out = b""
    i, k = 0, 0
    while i < len(stream):  # the damage arrives in arbitrary reads; nothing escapes the session
        out += session.receive(stream[i : i + sizes[k % len(sizes)]])
        i += sizes[k % len(sizes)]
        k += 1
    # the dispatcher itself serves qSupported: a payload that happens to be one, framed intact, gets the features
    features = ";".join(session.dispatcher.supported_features()).encode()
    for reply in replies(out):  # damaged input is answered E01 (bad packet) or served; nothing else
        assert reply in (b"E01", b"OK", b"", features) or all(ch in b"0123456789abcdef" for ch in reply)
    good = encode_packet(b"m%x,1" % address)
    answer = replies(session.receive(good))
    if not answer:  # the noise ended inside a checksum; GDB retransmits on the NACK / timeout
        answer = replies(session.receive(good))
    assert answer[-1] == b"%x" % address
    assert session.stats.packets >= 1


@settings(max_examples=examples(200), **SETTINGS)
@given(payloads)
def test_a_nack_gets_the_last_reply_again_and_only_in_ack_mode(payload):
    session = Session(Dispatcher((Echo(),)))
    first = session.receive(encode_packet(b"m%x,1" % len(payload)))
    assert first.startswith(b"+") and session.receive(b"-") == first[1:]
    session.receive(encode_packet(b"QStartNoAckMode"))
    assert session.receive(b"-") == b""  # no acks, no retransmissions once ack mode is off
    assert replies(session.receive(encode_packet(b"m1,1"))) == [b"1"]
