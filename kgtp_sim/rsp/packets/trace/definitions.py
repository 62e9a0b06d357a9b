"""Defining tracepoints and trace state variables: what `tstart` downloads (QTDP, its QTDP:- action packets,
QTDPsrc, QTDV, QTro) and what GDB asks before it creates a fast tracepoint (qTMinFTPILen).

Requests are built by GDB 13.1's remote_target::download_tracepoint, download_trace_state_variable,
trace_set_readonly_regions and get_min_fast_tracepoint_insn_len. The tracepoint and variable words (specs,
actions, sources) are the tracer's; these classes add only their wire details. What GDB reads back of them at
upload (qTfP/qTsP, qTfV/qTsV) is in upload.py.

Thread: the server thread (`RspServer`), where the dispatcher parses these packets and the trace handlers
(kgtp_sim/stub/trace.py) encode their replies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from ....tracing.core.model import (
    SOURCE_KINDS,
    ActionList,
    TracepointSource as SourceSpec,
    TracepointSpec,
    VariableSpec,
)
from ..base import Packet, PacketError, parse_hex, split_exact
from .actions import _parse_agent_expr, parse_actions
from .wire import _INT_BITS, _flag, _number, _signed64, _text, _unhex


@dataclass(frozen=True)
class DefineTracepoint(TracepointSpec, Packet):
    """`QTDP:<n>:<addr>:<E|D>:<step>:<pass>[:F<len>][:S][:X<len>,<cond>][-]`: create one tracepoint location.

    `more` (trailing '-') says action packets follow. Conditions only arrive when ConditionalTracepoints+ is
    announced; InstallInTrace+ makes GDB send this during a run (no QTinit), so its handler must cope with
    that. The upload reply `T...` of qTfP/qTsP has the same fields (see encode_tracepoint_definition).
    """

    PREFIX = b"QTDP:"
    FEATURES = ("ConditionalTracepoints+", "InstallInTrace+")
    more: bool = False

    @classmethod
    def parse(cls, body: bytes) -> Self:
        more = body.endswith(b"-")
        fields = (body[:-1] if more else body).split(b":")
        if len(fields) < 5:
            raise PacketError("QTDP: expected <n>:<addr>:<E|D>:<step>:<pass>")
        if fields[2] not in (b"E", b"D"):
            raise PacketError(f"QTDP: enable flag must be E or D, not {fields[2][:8]!r}")
        fast: int | None = None
        static = False
        condition: bytes | None = None
        for field in fields[5:]:
            if field.startswith(b"F") and fast is None and not static:
                fast = parse_hex(field[1:], "fast tracepoint instruction length", bits=_INT_BITS)
            elif field == b"S" and fast is None and not static:
                static = True
            elif field.startswith(b"X") and condition is None:
                condition, end = _parse_agent_expr(field, 0, "QTDP condition")
                if end != len(field):
                    raise PacketError("QTDP: trailing bytes after the condition")
            else:
                raise PacketError(f"QTDP: unexpected or repeated optional field {field[:16]!r}")
        return cls(
            number=_number(fields[0]),
            address=parse_hex(fields[1], "address"),
            enabled=fields[2] == b"E",
            step_count=parse_hex(fields[3], "step count"),
            pass_count=parse_hex(fields[4], "pass count", bits=_INT_BITS),
            fast_insn_length=fast,
            static=static,
            condition=condition,
            more=more,
        )


@dataclass(frozen=True)
class TracepointActions(ActionList, Packet):
    """`QTDP:-<n>:<addr>:[S]<action>...[-]`: actions for the tracepoint just defined.

    `stepping` is set on the packet that starts the while-stepping list (its leading 'S'); GDB does not
    repeat the 'S' on the stepping packets after it, so the handler remembers the mode per tracepoint until
    the next create packet. tracenz+ (`collect/s`) is announced here because this handler's expression
    evaluator is what has to implement the `tracenz` opcode.
    """

    PREFIX = b"QTDP:-"
    FEATURES = ("tracenz+",)
    more: bool = False

    @classmethod
    def parse(cls, body: bytes) -> Self:
        number, address, text = split_exact(body, b":", 3, "QTDP:-")
        more = text.endswith(b"-")
        if more:
            text = text[:-1]
        stepping = text.startswith(b"S")
        actions = parse_actions(text[1:] if stepping else text)
        if not actions:
            raise PacketError("QTDP:-: no actions")
        return cls(_number(number), parse_hex(address, "address"), actions, stepping, more)


@dataclass(frozen=True)
class TracepointSource(SourceSpec, Packet):
    """`QTDPsrc:<n>:<addr>:<at|cond|cmd>:<start>:<len>:<hex>`: the user's text, kept only for upload.

    One packet per string: the location (`at`), the condition (`cond`) and every action line (`cmd`,
    including `while-stepping N` and its closing `end`). encode_source_string always sends start 0 and
    the whole string (no trailing '-'); `length` is the total string length in bytes.
    """

    PREFIX = b"QTDPsrc:"
    FEATURES = ("TracepointSource+",)

    @classmethod
    def parse(cls, body: bytes) -> Self:
        number, address, kind, start, length, data = split_exact(body, b":", 6, "QTDPsrc")
        if kind.decode("latin-1") not in SOURCE_KINDS:
            raise PacketError(f"QTDPsrc: unknown source kind {kind[:16]!r}")
        text = _unhex(data, "QTDPsrc text")
        first, total = parse_hex(start, "start", bits=_INT_BITS), parse_hex(length, "length", bits=_INT_BITS)
        if first + len(text) > total:
            raise PacketError("QTDPsrc: text runs past the announced length")
        return cls(_number(number), parse_hex(address, "address"), kind.decode(), first, total, _text(text))


@dataclass(frozen=True)
class DefineTraceVariable(VariableSpec, Packet):
    """`QTDV:<n>:<value>:<builtin>:<hexname>`: a trace state variable (`tvariable $name = value`).

    GDB sends the initial value as 16 hex digits of its two's complement; `value` is signed here. qTfV/qTsV
    replies use the same fields (encode_trace_variable).
    """

    PREFIX = b"QTDV:"

    @classmethod
    def parse(cls, body: bytes) -> Self:
        number, value, builtin, name = split_exact(body, b":", 4, "QTDV")
        return cls(
            _number(number, "variable number"),
            _signed64(parse_hex(value, "initial value")),
            _flag(builtin, "QTDV builtin"),
            _text(_unhex(name, "variable name")),
        )


@dataclass(frozen=True)
class ReadOnlyRegions(Packet):
    """`QTro:<start>,<end>[:<start>,<end>...]`: the ELF's loaded read-only sections.

    While a frame is selected, memory in these ranges may be served live. GDB computes `end` as vma + size,
    so it is one past the last byte (gdbserver's in_readonly_region treats it as inclusive; don't copy that).
    """

    PREFIX = b"QTro"
    regions: tuple[tuple[int, int], ...] = ()

    @classmethod
    def parse(cls, body: bytes) -> Self:
        if not body:
            return cls()
        if not body.startswith(b":"):
            raise PacketError("QTro: expected ':<start>,<end>'")
        regions = []
        for item in body[1:].split(b":"):
            start, end = split_exact(item, b",", 2, "QTro region")
            region = parse_hex(start, "region start"), parse_hex(end, "region end")
            if region[0] > region[1]:
                raise PacketError("QTro: region ends before it starts")
            regions.append(region)
        return cls(tuple(regions))


@dataclass(frozen=True)
class QueryMinFastTracepointLength(Packet):
    """`qTMinFTPILen`: shortest instruction a fast tracepoint may replace (hex; 0 = unknown).

    GDB asks it for every `ftrace` whether or not FastTracepoints+ was announced, and refuses shorter
    instructions; the feature is announced here because a stub that answers it is one that can relocate
    instructions for `:F` tracepoints.
    """

    PREFIX = b"qTMinFTPILen"
    EXACT = True
    FEATURES = ("FastTracepoints+",)


def encode_min_fast_tracepoint_length(length: int) -> bytes:
    """qTMinFTPILen reply, hex; 0 means unknown, 1 means any instruction."""
    return b"%x" % length
