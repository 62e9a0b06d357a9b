"""Shared pieces of every packet parser: the base class and strict number/hex readers.

Pure: used wherever a packet is parsed: on the server thread (`RspServer`) for GDB's packets, and on the caller's
thread for the trace family's readers of the stub's replies (`decode_*`) in tests and tools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Self

U64_MASK = (1 << 64) - 1


class PacketError(ValueError):
    """The packet is malformed: the stub answers `E01` (bad packet) and keeps serving."""


@dataclass(frozen=True)
class Packet:
    """A parsed request. `PREFIX` selects it (longest prefix wins); `parse` reads the rest of the payload.

    `FEATURES` are the qSupported entries this packet's presence announces: qSupported is derived from the
    dispatch table, so a feature is advertised exactly when its handler is implemented.
    `EXACT` packets match only when nothing follows the prefix.
    `MALFORMED` is the reply to a packet that does not parse, where its family has its own (host I/O's
    `F-1,<EINVAL>`); None: `E01`.
    """

    PREFIX: ClassVar[bytes] = b""
    EXACT: ClassVar[bool] = False
    FEATURES: ClassVar[tuple[str, ...]] = ()
    MALFORMED: ClassVar[bytes | None] = None

    @classmethod
    def parse(cls, body: bytes) -> Self:
        if body:
            raise PacketError(f"unexpected arguments after {cls.PREFIX.decode()}")
        return cls()


@dataclass(frozen=True)
class Resume(Packet):
    """A packet that resumes execution (`c [addr]`, `s [addr]`): the optional address GDB may send is checked,
    then ignored, as execution goes on where it is."""

    @classmethod
    def parse(cls, body: bytes) -> Self:
        if body:
            parse_hex(body, "resume address")
        return cls()


def parse_hex(text: bytes, what: str = "number", *, bits: int = 64) -> int:
    """A non-empty unsigned hex number that fits in `bits` bits (GDB never sends more than 64)."""
    if not text:
        raise PacketError(f"missing {what}")
    if len(text) > (bits + 3) // 4 + 16 or any(c not in b"0123456789abcdefABCDEF" for c in text):
        raise PacketError(f"{what} is not a hex number: {text[:32]!r}")
    value = int(text, 16)
    if value >> bits:
        raise PacketError(f"{what} does not fit in {bits} bits")
    return value


def parse_signed_hex(text: bytes, what: str = "number", *, bits: int = 64) -> int:
    """A hex number with an optional leading '-' (QTDP uses -1 for 'no base register', thread ids use -1)."""
    if text.startswith(b"-"):
        return -parse_hex(text[1:], what, bits=bits)
    return parse_hex(text, what, bits=bits)


def parse_hex_bytes(text: bytes, what: str = "data") -> bytes:
    """Hex-encoded bytes (two digits each)."""
    if len(text) % 2:
        raise PacketError(f"{what}: odd number of hex digits")
    if any(c not in b"0123456789abcdefABCDEF" for c in text):  # bytes.fromhex would accept spaces
        raise PacketError(f"{what} is not hex")
    return bytes.fromhex(text.decode("ascii"))


def split_exact(body: bytes, sep: bytes, count: int, what: str) -> list[bytes]:
    """Split into exactly `count` fields, or fail with a message naming the packet."""
    parts = body.split(sep, count - 1)
    if len(parts) != count:
        raise PacketError(f"{what}: expected {count} fields separated by {sep.decode()!r}")
    return parts


_XML_ENTITIES = {ord("'"): "&apos;", ord('"'): "&quot;", ord("&"): "&amp;", ord("<"): "&lt;", ord(">"): "&gt;"}


def xml_text(text: str) -> str:
    """`text` as character data or an attribute value of the XML documents qXfer objects carry (gdbserver:
    xml_escape_text): ' " & < > as entities."""
    return text.translate(_XML_ENTITIES)
