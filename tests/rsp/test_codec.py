"""The sans-IO codec on byte strings: framing, checksums, escapes, run-length, acks, Ctrl-C."""

from hypothesis import given
from hypothesis import strategies as st

from kgtp_sim.rsp.codec import Decoder, EventKind, checksum, decode_body, encode_packet, escape


def kinds(events):
    return [e.kind for e in events]


def test_packet_with_valid_checksum_is_decoded():
    (event,) = Decoder().feed(b"$qSupported:multiprocess+#c4"[:-2] + b"%02x" % checksum(b"qSupported:multiprocess+"))
    assert event.kind is EventKind.PACKET
    assert event.payload == b"qSupported:multiprocess+"


def test_real_gdb_packet_bytes():
    # As GDB 13.1 sends it (checksum computed by GDB, not by us).
    (event,) = Decoder().feed(b"$vMustReplyEmpty#3a")
    assert (event.kind, event.payload) == (EventKind.PACKET, b"vMustReplyEmpty")


def test_bad_checksum_is_reported_not_delivered():
    (event,) = Decoder().feed(b"$g#00")
    assert event.kind is EventKind.BAD_CHECKSUM


def test_non_hex_checksum_is_bad_checksum():
    (event,) = Decoder().feed(b"$g#zz")
    assert event.kind is EventKind.BAD_CHECKSUM


def test_packet_split_across_reads():
    decoder = Decoder()
    assert decoder.feed(b"$m1234,") == []
    assert decoder.pending == 7
    assert decoder.feed(b"4#") == []
    (event,) = decoder.feed(b"%02x" % checksum(b"m1234,4"))
    assert event.payload == b"m1234,4"
    assert decoder.pending == 0


def test_acks_interrupt_and_noise():
    events = Decoder().feed(b"+-\x03garbage$?#3f+")
    assert kinds(events) == [EventKind.ACK, EventKind.NACK, EventKind.INTERRUPT, EventKind.PACKET, EventKind.ACK]


def test_escapes_are_undone():
    body = b"X0,4:" + escape(b"$#}*")
    (event,) = Decoder().feed(b"$" + body + b"#%02x" % checksum(body))
    assert event.payload == b"X0,4:$#}*"


def test_run_length_decoding():
    assert decode_body(b"0* ") == b"0000"  # ' ' = 32 -> 3 more
    assert decode_body(b"ab*!c") == b"abbbbbc"


def test_truncated_escape_is_a_bad_packet():
    body = b"X0,1:}"
    (event,) = Decoder().feed(b"$" + body + b"#%02x" % checksum(body))
    assert event.kind is EventKind.BAD_PACKET


def test_restarted_packet_drops_fragment():
    events = Decoder().feed(b"$qTStat$g#67")
    assert kinds(events) == [EventKind.BAD_PACKET, EventKind.PACKET]
    assert events[1].payload == b"g"


def test_oversized_packet_is_dropped_without_buffering_forever():
    decoder = Decoder(max_packet_size=64)
    (event,) = decoder.feed(b"$" + b"a" * 100)
    assert event.kind is EventKind.BAD_PACKET
    assert decoder.pending == 0
    (event,) = decoder.feed(b"$g#67")
    assert event.payload == b"g"


def test_encode_text_and_binary():
    assert encode_packet(b"OK") == b"$OK#9a"
    framed = encode_packet(b"l$#}*", binary=True)
    assert framed == b"$l}\x04}\x03}]}\n#" + b"%02x" % checksum(b"l}\x04}\x03}]}\n")


@given(st.binary(max_size=300))
def test_binary_roundtrip(payload):
    (event,) = Decoder().feed(encode_packet(payload, binary=True))
    assert event.kind is EventKind.PACKET
    assert event.payload == payload


@given(st.binary(max_size=200), st.integers(min_value=1, max_value=17))
def test_any_chunking_gives_same_packets(payload, step):
    stream = b"+" + encode_packet(payload, binary=True) + b"$g#67"
    decoder = Decoder()
    events = []
    for i in range(0, len(stream), step):
        events += decoder.feed(stream[i : i + step])
    assert [e.payload for e in events if e.kind is EventKind.PACKET] == [payload, b"g"]
