"""Examining trace frames: `tfind` (QTFrame and its pc/tdp/range/outside forms), what a frame holds
(qXfer:traceframe-info), the raw trace file for a local `tsave` (qTBuffer) and `tsave -r` (QTSave), with the
replies and GDB's reader of the QTFrame reply.

Requests are built by GDB 13.1's remote_target::trace_find, traceframe_info, get_raw_trace_data and
save_trace_data; `decode_frame_reply` models how trace_find reads the answer.

Thread: the server thread (`RspServer`), where the dispatcher parses these packets and the trace handlers
(kgtp_sim/stub/trace.py) encode their replies; `decode_frame_reply` runs on the thread of the test or tool
that calls it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Self

from ..base import Packet, PacketError, parse_hex, split_exact
from .wire import END_OF_LIST, NO_FRAME, _INT_BITS, _hex_run_end, _number, _text, _unhex, _xfer_window


@dataclass(frozen=True)
class SelectTraceFrame(Packet):
    """`QTFrame:<n>`: `tfind N`; `frame` None is `tfind none` (ffffffff), answered `OK`."""

    PREFIX = b"QTFrame:"
    frame: int | None = None

    @classmethod
    def parse(cls, body: bytes) -> Self:
        frame = parse_hex(body, "frame number", bits=_INT_BITS)
        if frame == NO_FRAME:
            return cls(None)
        if frame >> (_INT_BITS - 1):
            raise PacketError("QTFrame: negative frame number other than -1")
        return cls(frame)


@dataclass(frozen=True)
class FindFrameByPc(Packet):
    """`QTFrame:pc:<addr>`: next frame after the current one whose PC is `address`."""

    PREFIX = b"QTFrame:pc:"
    address: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(parse_hex(body, "address"))


@dataclass(frozen=True)
class FindFrameByTracepoint(Packet):
    """`QTFrame:tdp:<n>`: next frame after the current one recorded by tracepoint `number`. Any number GDB sends:
    `tfind tracepoint -1` sends -1 as 32 bits (remote.c's `tdp:%x`), which no frame has (gdbserver's
    cmd_qtframe finds none and answers `F-1`)."""

    PREFIX = b"QTFrame:tdp:"
    number: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(parse_hex(body, "tracepoint number"))


@dataclass(frozen=True)
class FindFrameInRange(Packet):
    """`QTFrame:range:<a>:<b>`: next frame whose PC is in [start, end] (both inclusive); also `tfind line`."""

    PREFIX = b"QTFrame:range:"
    start: int = 0
    end: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        start, end = split_exact(body, b":", 2, "QTFrame:range")
        return cls(parse_hex(start, "range start"), parse_hex(end, "range end"))


@dataclass(frozen=True)
class FindFrameOutsideRange(Packet):
    """`QTFrame:outside:<a>:<b>`: next frame whose PC is outside [start, end]."""

    PREFIX = b"QTFrame:outside:"
    start: int = 0
    end: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        start, end = split_exact(body, b":", 2, "QTFrame:outside")
        return cls(parse_hex(start, "range start"), parse_hex(end, "range end"))


@dataclass(frozen=True)
class ReadTraceFrameInfo(Packet):
    """`qXfer:traceframe-info:read::<off>,<len>`: which memory and variables the selected frame holds.

    With the feature, GDB asks this before reading memory in a frame and only sends `m` for what it lists
    (or for QTro ranges). The reply is a window of encode_traceframe_info, see encode_qxfer_chunk.
    """

    PREFIX = b"qXfer:traceframe-info:read:"
    FEATURES = ("qXfer:traceframe-info:read+",)
    offset: int = 0
    length: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(*_xfer_window(body, "qXfer:traceframe-info"))


@dataclass(frozen=True)
class ReadTraceBuffer(Packet):
    """`qTBuffer:<off>,<len>`: raw trace-file bytes for local `tsave`; reply hex (not binary), `l` at the end."""

    PREFIX = b"qTBuffer:"
    offset: int = 0
    length: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        offset, length = split_exact(body, b",", 2, "qTBuffer")
        return cls(parse_hex(offset, "offset"), parse_hex(length, "length"))


@dataclass(frozen=True)
class SaveTrace(Packet):
    """`QTSave:<hex filename>`: `tsave -r FILE`, the target writes the trace file itself."""

    PREFIX = b"QTSave:"
    filename: str = ""

    @classmethod
    def parse(cls, body: bytes) -> Self:
        name = _unhex(body, "QTSave file name")
        if not name:
            raise PacketError("QTSave: empty file name")
        return cls(_text(name))


def encode_frame_reply(frame: int | None, tracepoint: int = 0) -> bytes:
    """QTFrame reply: `F<frame>T<tracepoint>` when found, `F-1` when not (`tfind none` gets plain `OK`)."""
    return b"F-1" if frame is None else b"F%xT%x" % (frame, tracepoint)


def encode_traceframe_info(memory: Iterable[tuple[int, int]] = (), tvars: Iterable[int] = ()) -> bytes:
    """The traceframe-info XML document: `(start, length)` memory blocks and collected variable numbers."""
    lines = [b"<traceframe-info>"]
    lines += [b'<memory start="0x%x" length="0x%x"/>' % (start, length) for start, length in memory]
    lines += [b'<tvar id="%d"/>' % number for number in tvars]
    lines.append(b"</traceframe-info>")
    return b"\n".join(lines) + b"\n"


def encode_trace_buffer(data: bytes) -> bytes:
    """qTBuffer reply: the bytes in hex (get_raw_trace_data hex-decodes), `l` when nothing is left."""
    return data.hex().encode() if data else END_OF_LIST


def decode_frame_reply(reply: bytes) -> tuple[int, int | None]:
    """Read a QTFrame reply as trace_find does: (frame, tracepoint); frame -1 means no frame selected."""
    frame, tracepoint = -1, None
    i = 0
    while i < len(reply):
        letter = reply[i : i + 1]
        if letter in (b"F", b"T"):
            end = i + 1 + (reply[i + 1 : i + 2] == b"-")
            end = _hex_run_end(reply, end)
            value = int(reply[i + 1 : end], 16)
            if letter == b"F":
                frame = value
                if frame == -1:
                    return -1, None
            else:
                tracepoint = value
            i = end
        elif reply[i:] == b"OK":
            i += 2
        else:
            raise ValueError(f"bogus QTFrame reply {reply!r}")
    return frame, tracepoint
