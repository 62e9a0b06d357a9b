"""Sans-IO codec for GDB's Remote Serial Protocol framing.

Bytes go in, events come out; packets go in, bytes come out. Nothing here touches a socket, so every framing
rule (checksums, `}` escapes, run-length encoding, acks, the Ctrl-C byte) is testable on plain byte strings and
the same code serves the TCP server, the transcript replayer and the fuzzers.

Thread: nothing is shared between threads; a `Decoder` holds one stream's partial packet and belongs to the thread
that reads that stream: the server thread (`RspServer` and its `Session`), the caller's in the raw client
(kgtp_sim/client/rsp.py), each pump thread of the transcript proxy (tools/transcript.py), the fuzzers'.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto

ESCAPE = 0x7D  # '}'
RUN_LENGTH = 0x2A  # '*'
INTERRUPT_BYTE = 0x03
_SPECIAL = frozenset(b"$#}*")

#: A packet larger than this is refused before it is buffered whole: the largest packet GDB sends is an `X`
#: write or a QTDP of a few KiB, so this only bounds what a hostile peer can make us hold.
MAX_PACKET_SIZE = 1 << 20


def checksum(payload: bytes) -> int:
    """The modulo-256 sum GDB puts after `#`, computed over the bytes as sent (escaped)."""
    return sum(payload) & 0xFF


def escape(payload: bytes) -> bytes:
    """Escape the bytes that would end or confuse a packet (`$ # } *`), as binary replies require: each becomes
    `}` and itself xor 0x20 (`}` first, as the others' escapes bring it in; bytes.replace, not a loop per byte: a
    16 KiB vFile read escaped in Python cost a millisecond and more)."""
    out = payload.replace(b"}", bytes((ESCAPE, ESCAPE ^ 0x20)))
    for byte in b"$#*":
        out = out.replace(bytes((byte,)), bytes((ESCAPE, byte ^ 0x20)))
    return out


class FramingError(ValueError):
    """The body of a packet is not a valid escaped / run-length encoded byte string."""


def decode_body(raw: bytes) -> bytes:
    """Undo `}` escapes and `*` run-length encoding of a received packet body.

    RLE `X*n` repeats X a further `ord(n) - 29` times; GDB never sends it but stubs and proxies may, and the
    protocol allows it in both directions.
    """
    out = bytearray()
    i = 0
    n = len(raw)
    while i < n:
        byte = raw[i]
        if byte == ESCAPE:
            if i + 1 >= n:
                raise FramingError("escape character at end of packet")
            out.append(raw[i + 1] ^ 0x20)
            i += 2
        elif byte == RUN_LENGTH:
            if not out or i + 1 >= n:
                raise FramingError("run-length marker without a byte to repeat")
            count = raw[i + 1] - 29
            if count < 3 or raw[i + 1] in (ord("#"), ord("$")):
                raise FramingError("invalid run-length count")
            out.extend(out[-1:] * count)
            i += 2
        else:
            out.append(byte)
            i += 1
    return bytes(out)


def encode_packet(payload: bytes, *, binary: bool = False) -> bytes:
    """Frame a reply as `$payload#cs`. Text replies never contain special bytes; binary ones are escaped."""
    body = escape(payload) if binary else payload
    return b"$" + body + b"#" + b"%02x" % checksum(body)


def encode_notification(payload: bytes) -> bytes:
    """Frame an asynchronous notification as `%payload#cs` (GDB's remote.c: handle_notification; never
    acknowledged)."""
    return b"%" + payload + b"#" + b"%02x" % checksum(payload)


class EventKind(Enum):
    PACKET = auto()
    NOTIFICATION = auto()  #: `%...#cs`: only a decoder made with notifications=True (a debugger's side) sees these
    ACK = auto()
    NACK = auto()
    INTERRUPT = auto()
    BAD_CHECKSUM = auto()
    BAD_PACKET = auto()


@dataclass(frozen=True)
class Event:
    """One thing the peer said: a packet (decoded payload), an ack byte, a Ctrl-C, or a damaged packet."""

    kind: EventKind
    payload: bytes = b""
    detail: str = ""


class Decoder:
    """Incremental parser of the byte stream from GDB.

    Feed it whatever the socket returned; it keeps partial packets between calls. Garbage between packets
    (line noise, stray bytes) is skipped, as GDB itself does. `notifications`: the stream is a stub's, whose
    `%...#cs` notifications are events too (GDB's side; a stub's decoder skips a `%` as noise).
    """

    def __init__(self, max_packet_size: int = MAX_PACKET_SIZE, notifications: bool = False) -> None:
        self._buffer = bytearray()
        self._max = max_packet_size
        self._starts = b"$%" if notifications else b"$"

    @property
    def pending(self) -> int:
        """Bytes held for an unfinished packet (a client that vanished mid-packet leaves these behind)."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Event]:
        self._buffer.extend(data)
        events: list[Event] = []
        while self._buffer:
            first = self._buffer[0]
            if first in self._starts:
                event = self._take_packet()
                if event is None:
                    break
                events.append(event)
                continue
            del self._buffer[0]
            if first == ord("+"):
                events.append(Event(EventKind.ACK))
            elif first == ord("-"):
                events.append(Event(EventKind.NACK))
            elif first == INTERRUPT_BYTE:
                events.append(Event(EventKind.INTERRUPT))
            # anything else is noise outside a packet: dropped
        return events

    def _take_packet(self) -> Event | None:
        hash_at = self._buffer.find(b"#")
        # A '$' inside an unfinished packet means the sender restarted: drop the fragment.
        end = hash_at if hash_at >= 0 else len(self._buffer)
        restart = min((at for at in (self._buffer.find(bytes([start]), 1, end) for start in self._starts) if at > 0),
                      default=-1)
        if restart > 0:
            del self._buffer[:restart]
            return Event(EventKind.BAD_PACKET, detail="packet restarted before '#'")
        if hash_at < 0:
            if len(self._buffer) > self._max:
                self._buffer.clear()
                return Event(EventKind.BAD_PACKET, detail="packet too large")
            return None
        if len(self._buffer) < hash_at + 3:
            return None
        kind = EventKind.NOTIFICATION if self._buffer[0] == ord("%") else EventKind.PACKET
        raw = bytes(self._buffer[1:hash_at])
        sent_sum = bytes(self._buffer[hash_at + 1 : hash_at + 3])
        del self._buffer[: hash_at + 3]
        try:
            expected = int(sent_sum, 16)
        except ValueError:
            return Event(EventKind.BAD_CHECKSUM, raw, "checksum is not two hex digits")
        if expected != checksum(raw):
            return Event(EventKind.BAD_CHECKSUM, raw, f"checksum {sent_sum.decode('latin-1')} != {checksum(raw):02x}")
        try:
            return Event(kind, decode_body(raw))
        except FramingError as error:
            return Event(EventKind.BAD_PACKET, raw, str(error))
