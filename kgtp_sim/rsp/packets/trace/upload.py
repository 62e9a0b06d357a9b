"""Uploading what the target holds: each location's hits and usage (qTP), the tracepoints with their actions
and source strings (qTfP/qTsP), the trace state variables (qTfV/qTsV) and one variable's value (qTV).

GDB 13.1 asks these at connect and for `tsave` (upload_tracepoints, upload_trace_state_variables,
get_tracepoint_status, get_trace_state_variable_value) and reads the pieces with tracepoint.c's
parse_tracepoint_definition, parse_tsv_definition and parse_tracepoint_status. A `T` piece has the fields of
`QTDP:`, an `A`/`S` piece those of `QTDP:-`, a `Z` piece those of `QTDPsrc:` (definitions.py parses them).

Thread: the server thread (`RspServer`), where the dispatcher parses these packets and the trace handlers
(kgtp_sim/stub/trace.py) encode their replies.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Self

from ....tracing.core.model import Action, Tracepoint, TracepointSource as SourceSpec, TracepointSpec, VariableSpec
from ..base import U64_MASK, Packet
from .actions import encode_actions
from .wire import _hex_text, _number, _number_and_address


@dataclass(frozen=True)
class QueryTracepointStatus(Packet):
    """`qTP:<n>:<addr>`: hit count and buffer usage of one location (address unpadded); reply `V<hits>:<usage>`."""

    PREFIX = b"qTP:"
    number: int = 0
    address: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(*_number_and_address(body, "qTP"))


@dataclass(frozen=True)
class FirstTracepointPiece(Packet):
    """`qTfP`: start uploading the target's tracepoints (connect, tsave); replies T/A/S/Z pieces, then `l`."""

    PREFIX = b"qTfP"
    EXACT = True


@dataclass(frozen=True)
class NextTracepointPiece(Packet):
    PREFIX = b"qTsP"
    EXACT = True


@dataclass(frozen=True)
class FirstTraceVariable(Packet):
    """`qTfV`: start uploading trace state variables (GDB asks even before `?`); then qTsV until `l`."""

    PREFIX = b"qTfV"
    EXACT = True


@dataclass(frozen=True)
class NextTraceVariable(Packet):
    PREFIX = b"qTsV"
    EXACT = True


@dataclass(frozen=True)
class QueryTraceVariable(Packet):
    """`qTV:<n>`: value of a trace state variable, in the selected frame if any; reply `V<hex>` or `U`."""

    PREFIX = b"qTV:"
    number: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(_number(body, "variable number"))


def encode_tracepoint_status(hits: int, usage: int) -> bytes:
    """qTP reply `V<hits>:<usage>`, both hex (gdbserver prints them in decimal, which GDB misreads)."""
    return b"V%x:%x" % (hits, usage)


def encode_tracepoint_definition(tp: TracepointSpec | Tracepoint) -> bytes:
    """qTfP/qTsP piece `T<n>:<addr>:<E|D>:<step>:<pass>[:F<len>][:S][:X<len>,<hex>]` (no trailing '-')."""
    out = b"T%x:%x:%s:%x:%x" % (tp.number, tp.address, b"E" if tp.enabled else b"D", tp.step_count, tp.pass_count)
    if tp.fast_insn_length is not None:
        out += b":F%x" % tp.fast_insn_length
    if tp.static:
        out += b":S"
    if tp.condition is not None:
        out += b":X%x," % len(tp.condition) + tp.condition.hex().encode()
    return out


def encode_tracepoint_actions(
    number: int, address: int, actions: Iterable[Action], *, stepping: bool = False
) -> bytes:
    """qTfP/qTsP piece `A<n>:<addr>:<actions>` (or `S...` for while-stepping ones, without a leading 'S')."""
    return b"%s%x:%x:" % (b"S" if stepping else b"A", number, address) + encode_actions(actions)


def encode_tracepoint_source(src: SourceSpec) -> bytes:
    """qTfP/qTsP piece `Z<n>:<addr>:<at|cond|cmd>:<start>:<len>:<hex>`; GDB rebuilds commands from these."""
    return b"Z%x:%x:%s:%x:%x:" % (src.number, src.address, src.kind.encode(), src.start, src.length) + _hex_text(
        src.source
    )


def encode_trace_variable(tsv: VariableSpec) -> bytes:
    """qTfV/qTsV reply `<n>:<value>:<builtin>:<hexname>`; negative values as 64-bit two's complement."""
    return b"%x:%x:%x:" % (tsv.number, tsv.value & U64_MASK, tsv.builtin) + _hex_text(tsv.name)


def encode_trace_variable_value(value: int | None) -> bytes:
    """qTV reply: `V<hex two's complement>`, or `U` when the value is unknown (not collected, never run)."""
    return b"U" if value is None else b"V%x" % (value & U64_MASK)
