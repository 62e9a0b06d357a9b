"""Running a trace experiment and asking how it goes: QTinit, the buffer and disconnected modes (QTBuffer:*,
QTDisconnected), QTNotes, QTStart/QTStop, enabling and disabling a location during a run (QTEnable/QTDisable),
what GDB allows the target (QAllow), and qTStatus with its reply and GDB's reader of it.

Requests are built by GDB 13.1's remote.c (trace_init, trace_start, trace_stop, set_circular_trace_buffer,
set_trace_buffer_size, set_trace_notes, set_disconnected_tracing, enable_tracepoint, get_trace_status); the
status reply is read by tracepoint.c's parse_trace_status, which `decode_trace_status` models.

Thread: the server thread (`RspServer`), where the dispatcher parses these packets and the trace handlers
(kgtp_sim/stub/trace.py) encode their replies; `decode_trace_status` runs on the thread of the test or tool
that calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Self

from ....tracing.core.model import StopReason, TraceStatus
from ..base import Packet, PacketError, parse_hex
from .wire import _flag, _hex_text, _number_and_address, _text, _unhex


@dataclass(frozen=True)
class TraceInit(Packet):
    """`QTinit`: forget every tracepoint, variable and frame; the first packet of `tstart`."""

    PREFIX = b"QTinit"
    EXACT = True


@dataclass(frozen=True)
class SetDisconnectedTracing(Packet):
    """`QTDisconnected:<0|1>`: keep tracing after GDB goes away (sent only with DisconnectedTracing+)."""

    PREFIX = b"QTDisconnected:"
    FEATURES = ("DisconnectedTracing+",)
    keep_tracing: bool = False

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(_flag(body, "QTDisconnected"))


@dataclass(frozen=True)
class SetCircularBuffer(Packet):
    """`QTBuffer:circular:<0|1>`: always sent by tstart; an empty reply makes tstart fail."""

    PREFIX = b"QTBuffer:circular:"
    circular: bool = False

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(_flag(body, "QTBuffer:circular"))


@dataclass(frozen=True)
class SetTraceBufferSize(Packet):
    """`QTBuffer:size:<hex|-1>`: requested buffer size; the literal `-1` (`size` None) means the default."""

    PREFIX = b"QTBuffer:size:"
    FEATURES = ("QTBuffer:size+",)
    size: int | None = None

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(None if body == b"-1" else parse_hex(body, "trace buffer size"))


@dataclass(frozen=True)
class SetTraceNotes(Packet):
    """`QTNotes:[user:<hex>;][notes:<hex>;][tstop:<hex>;]`: any subset, each ended by ';', empty allowed.

    tstart sends `user:` and `notes:` (both possibly empty), `set trace-user/-notes/-stop-notes` one each,
    and tstop sends `tstop:` after QTStop. A field that is absent is None.
    """

    PREFIX = b"QTNotes:"
    user: str | None = None
    notes: str | None = None
    stop_note: str | None = None

    _KEYS: ClassVar[dict[bytes, str]] = {b"user": "user", b"notes": "notes", b"tstop": "stop_note"}

    @classmethod
    def parse(cls, body: bytes) -> Self:
        if not body:
            return cls()
        if not body.endswith(b";"):
            raise PacketError("QTNotes: every field ends with ';'")
        values: dict[str, str] = {}
        for item in body[:-1].split(b";"):
            key, sep, value = item.partition(b":")
            field = cls._KEYS.get(key)
            if not sep or field is None or field in values:
                raise PacketError(f"QTNotes: unexpected or repeated field {item[:16]!r}")
            values[field] = _text(_unhex(value, f"QTNotes {key.decode()}"))
        return cls(**values)


@dataclass(frozen=True)
class TraceStart(Packet):
    """`QTStart`: insert the tracepoints and start collecting."""

    PREFIX = b"QTStart"
    EXACT = True


@dataclass(frozen=True)
class TraceStop(Packet):
    """`QTStop`: stop collecting (reason tstop); the stop note follows in a separate QTNotes."""

    PREFIX = b"QTStop"
    EXACT = True


@dataclass(frozen=True)
class EnableTracepoint(Packet):
    """`QTEnable:<n>:<addr>`: `enable N` during a run (address as 16 digits)."""

    PREFIX = b"QTEnable:"
    FEATURES = ("EnableDisableTracepoints+",)
    number: int = 0
    address: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(*_number_and_address(body, "QTEnable"))


@dataclass(frozen=True)
class DisableTracepoint(Packet):
    """`QTDisable:<n>:<addr>`: `disable N` during a run; announced together with QTEnable."""

    PREFIX = b"QTDisable:"
    FEATURES = ("EnableDisableTracepoints+",)
    number: int = 0
    address: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(*_number_and_address(body, "QTDisable"))


@dataclass(frozen=True)
class SetPermissions(Packet):
    """`QAllow:WriteReg:<0|1>;WriteMem:..;InsertBreak:..;InsertTrace:..;InsertFastTrace:..;Stop:..`.

    GDB sends it only when QAllow+ is announced: right after qSupported and on every `set may-...`.
    Unknown operations are ignored (the manual leaves room for more); missing ones keep GDB's default, 1.
    """

    PREFIX = b"QAllow:"
    FEATURES = ("QAllow+",)
    write_registers: bool = True
    write_memory: bool = True
    insert_breakpoints: bool = True
    insert_tracepoints: bool = True
    insert_fast_tracepoints: bool = True
    stop: bool = True

    _KEYS: ClassVar[dict[bytes, str]] = {
        b"WriteReg": "write_registers",
        b"WriteMem": "write_memory",
        b"InsertBreak": "insert_breakpoints",
        b"InsertTrace": "insert_tracepoints",
        b"InsertFastTrace": "insert_fast_tracepoints",
        b"Stop": "stop",
    }

    @classmethod
    def parse(cls, body: bytes) -> Self:
        values: dict[str, bool] = {}
        for item in body.split(b";"):
            key, sep, value = item.partition(b":")
            if not key or not sep:
                raise PacketError(f"QAllow: expected <op>:<0|1>, not {item[:24]!r}")
            allowed = _flag(value, f"QAllow {key[:16].decode('latin-1')}")
            if key in cls._KEYS:
                values[cls._KEYS[key]] = allowed
        return cls(**values)


@dataclass(frozen=True)
class QueryTraceStatus(Packet):
    """`qTStatus`: sent at connect, before every tstart and by tstatus; an empty reply means "no tracing"."""

    PREFIX = b"qTStatus"
    EXACT = True


def encode_trace_status(status: TraceStatus) -> bytes:
    """`T<0|1>;<reason>;tframes:..;tcreated:..;tfree:..;tsize:..;circular:..;disconn:..;starttime:..;...`

    Field order and spelling as gdbserver's cmd_qtstatus; GDB's parse_trace_status accepts any order.
    """
    reason = status.stop_reason
    if reason is StopReason.STOP_COMMAND:
        note = b"" if status.stop_note is None else _hex_text(status.stop_note) + b":"
        first = b"tstop:" + note + b"0"
    elif reason is StopReason.ERROR:
        first = b"terror:%s:%x" % (_hex_text(status.stop_note or ""), status.stopping_tracepoint)
    elif reason is StopReason.PASSCOUNT:
        first = b"tpasscount:%x" % status.stopping_tracepoint
    else:
        first = reason.value.encode() + b":0"
    fields = [b"T1" if status.running else b"T0", first]
    for key, value in (
        (b"tframes", status.frames),
        (b"tcreated", status.created),
        (b"tfree", status.buffer_free),
        (b"tsize", status.buffer_size),
        (b"circular", status.circular),
        (b"disconn", status.disconnected),
        (b"starttime", status.start_time),
        (b"stoptime", status.stop_time),
    ):
        if value is not None:
            if value < 0:
                raise ValueError(f"qTStatus {key.decode()} must not be negative")
            fields.append(b"%s:%x" % (key, value))
    for key, text in ((b"username", status.user), (b"notes", status.notes)):
        if text is not None:
            fields.append(key + b":" + _hex_text(text))
    return b";".join(fields)


def decode_trace_status(reply: bytes) -> TraceStatus:
    """Read a qTStatus reply the way parse_trace_status does.

    Keys match by prefix in GDB's order (strncmp over the key's length), unknown keys are skipped, a field
    without ':' is an error; numbers are hex.
    """
    if not reply.startswith(b"T"):
        raise ValueError("qTStatus reply must start with T")
    values: dict[str, object] = {"running": reply[1:2] == b"1", "stop_reason": StopReason.UNKNOWN}
    order = ("tfull", "tnotrun", "tpasscount", "tstop", "tdisconnected", "terror", "tframes", "tcreated",
             "tfree", "tsize", "disconn", "circular", "starttime", "stoptime", "username", "notes")
    for field in reply[3:].split(b";") if len(reply) > 2 else ():
        key, sep, rest = field.partition(b":")
        if not sep:
            raise ValueError(f"malformed trace status field {field!r}")
        name = next((n for n in order if n.encode().startswith(key)), None)
        if name is None:
            continue
        if name in ("tstop", "terror"):
            note, sep, number = rest.partition(b":")
            if name == "tstop" and not sep:
                note, number = None, rest
            values["stop_reason"] = StopReason(name)
            values["stop_note"] = None if note is None else _text(bytes.fromhex(note.decode()))
            if name == "terror":
                values["stopping_tracepoint"] = int(number, 16)
        elif name in ("username", "notes"):
            values["user" if name == "username" else "notes"] = _text(bytes.fromhex(rest.decode()))
        elif name in ("tfull", "tnotrun", "tdisconnected", "tpasscount"):
            values["stop_reason"] = StopReason(name)
            if name == "tpasscount":
                values["stopping_tracepoint"] = int(rest, 16)
        else:
            target = {"tframes": "frames", "tcreated": "created", "tfree": "buffer_free", "tsize": "buffer_size",
                      "disconn": "disconnected", "circular": "circular", "starttime": "start_time",
                      "stoptime": "stop_time"}[name]
            number = int(rest, 16)
            values[target] = bool(number) if target in ("circular", "disconnected") else number
    return TraceStatus(**values)  # type: ignore[arg-type]
