"""The small strict readers and writers every tracepoint packet shares: hex text, user text, flags, 16-bit
tracepoint and variable numbers, `<n>:<addr>` pairs, qXfer windows and the qXfer reply chunk, and the constants of
the family's wire form (numbers printed with GDB's "%x" of an int, the end-of-list reply).

Thread: the server thread (`RspServer`), where the dispatcher parses the family's packets and the trace
handlers (kgtp_sim/stub/trace.py) encode their replies; the readers also serve GDB's side of the replies
(`decode_*`), on the thread of the test or tool that calls them.
"""

from __future__ import annotations

from ..base import PacketError, parse_hex, split_exact

_HEX = frozenset(b"0123456789abcdefABCDEF")
#: GDB prints tracepoint, frame and variable numbers with "%x" of an int.
_INT_BITS = 32
_NUMBER_BITS = 16
#: `QTFrame:ffffffff` is `tfind none`: GDB prints -1 with "%x".
NO_FRAME = 0xFFFFFFFF
#: Reply that ends every qTfP/qTsP, qTfV/qTsV, qTfSTM/qTsSTM and qTBuffer sequence (lower-case ell).
END_OF_LIST = b"l"


def _unhex(text: bytes, what: str) -> bytes:
    """Hex-encoded bytes; unlike bytes.fromhex, whitespace is not tolerated."""
    if any(c not in _HEX for c in text):
        raise PacketError(f"{what} is not hex: {text[:32]!r}")
    if len(text) % 2:
        raise PacketError(f"{what}: odd number of hex digits")
    return bytes.fromhex(text.decode("ascii"))


def _text(data: bytes) -> str:
    """User text (notes, names, source lines) as GDB sent it; surrogateescape keeps any byte round-trippable."""
    return data.decode("utf-8", "surrogateescape")


def _hex_text(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape").hex().encode()


def _flag(text: bytes, what: str) -> bool:
    if text == b"0":
        return False
    if text == b"1":
        return True
    raise PacketError(f"{what} must be 0 or 1, not {text[:16]!r}")


def _number(text: bytes, what: str = "tracepoint number") -> int:
    """Tracepoint and trace variable numbers: 16 bits, because a trace frame records its tracepoint in two
    bytes (as the trace file format does) and bytecode names a variable in a 16-bit operand. A larger number
    could never be told apart from a smaller one, so it is refused here rather than truncated later."""
    return parse_hex(text, what, bits=_NUMBER_BITS)


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >> 63 else value


def _hex_run_end(text: bytes, start: int) -> int:
    end = start
    while end < len(text) and text[end] in _HEX:
        end += 1
    return end


def _number_and_address(body: bytes, what: str) -> tuple[int, int]:
    number, address = split_exact(body, b":", 2, what)
    return _number(number), parse_hex(address, "address")


def _xfer_window(body: bytes, what: str) -> tuple[int, int]:
    """`qXfer:<object>:read:<annex>:<offset>,<length>`; GDB sends no annex for trace objects."""
    if not body.startswith(b":"):
        raise PacketError(f"{what}: expected an empty annex (':<offset>,<length>')")
    offset, length = split_exact(body[1:], b",", 2, what)
    return parse_hex(offset, "offset"), parse_hex(length, "length")


def encode_qxfer_chunk(document: bytes, offset: int, length: int) -> bytes:
    """A qXfer read reply payload: `m<data>` if more follows, `l<data>` at the end (send it as Binary)."""
    chunk = document[offset : offset + length]
    return (b"m" if offset + len(chunk) < len(document) else b"l") + chunk
