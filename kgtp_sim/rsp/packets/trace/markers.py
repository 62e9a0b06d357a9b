"""Static tracepoints: listing the kernel's markers (qTfSTM/qTsSTM), the marker at an address (qTSTMat) and the
`$_sdata` of the selected frame (qXfer:statictrace), with the marker list reply and GDB's reader of it.

GDB 13.1 asks these for `info static-tracepoint-markers`, `strace` and tstart (static_tracepoint_markers_by_strid,
static_tracepoint_marker_at) and reads the list with parse_static_tracepoint_marker_definition, which
`decode_static_markers` models.

Thread: the server thread (`RspServer`), where the dispatcher parses these packets and the trace handlers
(kgtp_sim/stub/trace.py) encode their replies; `decode_static_markers` runs on the thread of the test or
tool that calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

from ....tracing.core.model import StaticMarker
from ..base import Packet, parse_hex
from .wire import END_OF_LIST, _hex_text, _text, _xfer_window


@dataclass(frozen=True)
class FirstStaticMarkers(Packet):
    """`qTfSTM`: `info static-tracepoint-markers` and `strace -m`; replies `m...` lists, then `l`."""

    PREFIX = b"qTfSTM"
    EXACT = True


@dataclass(frozen=True)
class NextStaticMarkers(Packet):
    PREFIX = b"qTsSTM"
    EXACT = True


@dataclass(frozen=True)
class StaticMarkerAt(Packet):
    """`qTSTMat:<addr>`: the marker at an address; asked when `strace` creates the tracepoint *and* again
    while tstart downloads it. Only an `m` reply at download time gets `:S` sent; an `l` there makes tstart
    fail ("Static tracepoint not valid during download"). StaticTracepoints+ is announced here because
    without this handler no static tracepoint can be downloaded.
    """

    PREFIX = b"qTSTMat:"
    FEATURES = ("StaticTracepoints+",)
    address: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(parse_hex(body, "address"))


@dataclass(frozen=True)
class ReadStaticTraceData(Packet):
    """`qXfer:statictrace:read::<off>,<len>`: `$_sdata` of the selected frame (binary `l`/`m` reply).

    GDB 13.1 has no qSupported entry for this object and probes it regardless; the feature string is
    announced for other clients and is harmless to GDB.
    """

    PREFIX = b"qXfer:statictrace:read:"
    FEATURES = ("qXfer:statictrace:read+",)
    offset: int = 0
    length: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(*_xfer_window(body, "qXfer:statictrace"))


def encode_static_markers(markers: Sequence[StaticMarker]) -> bytes:
    """qTfSTM/qTsSTM/qTSTMat reply `m<addr>:<hex id>:<hex extra>[,...]`, or `l` for none (end of list)."""
    if not markers:
        return END_OF_LIST
    return b"m" + b",".join(b"%x:%s:%s" % (m.address, _hex_text(m.id), _hex_text(m.extra)) for m in markers)


def decode_static_markers(reply: bytes) -> list[StaticMarker] | None:
    """Read one qTfSTM/qTsSTM/qTSTMat reply; None when it is not an `m` list (end of list, or `l`)."""
    if not reply.startswith(b"m"):
        return None
    markers = []
    for item in reply[1:].split(b","):
        address, id_hex, extra = item.split(b":", 2)
        markers.append(StaticMarker(int(address, 16), _text(bytes.fromhex(id_hex.decode())),
                                    _text(bytes.fromhex(extra.decode()))))
    return markers
