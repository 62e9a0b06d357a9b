"""Tracepoint packets: defining, running and inspecting a trace experiment, plus the replies GDB reads back.

Every format here follows GDB 13.1. Requests are built in gdb/remote.c (remote_target::download_tracepoint,
trace_find, get_trace_status, ...) with action strings from gdb/tracepoint.c (collection_list::stringify,
encode_source_string). Replies are read by gdb/tracepoint.c (parse_trace_status, parse_tracepoint_status,
parse_tracepoint_definition, parse_tsv_definition, parse_static_tracepoint_marker_definition,
parse_traceframe_info) and by remote.c itself (trace_find, get_raw_trace_data, ...).
docs/tracepoint-packets.md has the table; tests/rsp/test_trace_packets.py holds the wire literals recorded
from a real GDB 13.1.

Prefix collisions are resolved by the dispatcher's longest-prefix rule: `QTDP:-` (actions) beats `QTDP:`
(create), `QTFrame:pc:`/`tdp:`/`range:`/`outside:` beat `QTFrame:`, and `qTBuffer:` (lower-case q, read the
buffer) lives in a different bucket from `QTBuffer:circular:`/`QTBuffer:size:`.

Why this module is long: it is the whole tracepoint family of the protocol, about forty packets, each parser next
to the reply encoder GDB reads back and to the model of GDB's own reader the tests use; the small strict readers
at the top are shared by all of them. The words themselves (actions, specs, status) are the tracer's
(`kgtp_sim/tracing/core/model.py`); this module only reads and writes their wire form.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Self

from ...tracing.core.model import (
    SOURCE_KINDS,
    Action,
    ActionList,
    CollectMemory,
    CollectRegisters,
    CollectStaticData,
    EvalExpression,
    StaticMarker,
    StopReason,
    TraceStatus,
    Tracepoint,
    TracepointSource as SourceSpec,
    TracepointSpec,
    VariableSpec,
)
from .base import U64_MASK, Packet, PacketError, parse_hex, parse_signed_hex, split_exact

_HEX = frozenset(b"0123456789abcdefABCDEF")
#: GDB prints tracepoint, frame and variable numbers with "%x" of an int.
_INT_BITS = 32
_NUMBER_BITS = 16
#: A register mask wider than this is not a mask GDB could build (it has a few hundred registers at most).
MAX_REGISTER_MASK_BYTES = 128
#: `QTFrame:ffffffff` is `tfind none`: GDB prints -1 with "%x".
NO_FRAME = 0xFFFFFFFF
#: Reply that ends every qTfP/qTsP, qTfV/qTsV, qTfSTM/qTsSTM and qTBuffer sequence (lower-case ell).
END_OF_LIST = b"l"


# --- small strict readers -----------------------------------------------------------------------------


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


# --- tracepoint actions (the `action...` part of QTDP:-) -----------------------------------------------


# The actions themselves (CollectRegisters, CollectMemory, EvalExpression, CollectStaticData) are the tracer's
# words (kgtp_sim/tracing/core/model.py); this section reads and writes their wire form. `R` masks arrive most
# significant byte first, two digits a byte, leading zero bytes dropped; `M` offsets are printed with phex_nz,
# so a negative frame offset arrives as its 64-bit two's complement.


def _parse_agent_expr(text: bytes, start: int, what: str) -> tuple[bytes, int]:
    """`X<hex len>,<2*len hex digits>` starting at text[start] == 'X'; returns the bytecode and the end."""
    comma = text.find(b",", start + 1)
    if comma < 0:
        raise PacketError(f"{what}: expected X<length>,<bytecode>")
    length = parse_hex(text[start + 1 : comma], f"{what} length", bits=_INT_BITS)
    if length == 0:
        raise PacketError(f"{what}: empty agent expression")
    end = comma + 1 + 2 * length
    if end > len(text):
        raise PacketError(f"{what}: truncated bytecode ({length:#x} bytes announced)")
    return _unhex(text[comma + 1 : end], f"{what} bytecode"), end


def parse_actions(text: bytes) -> tuple[Action, ...]:
    """Split a run of concatenated actions (GDB packs several `M` and `X` into one packet)."""
    actions: list[Action] = []
    i = 0
    while i < len(text):
        letter = text[i : i + 1]
        if letter == b"R":
            end = _hex_run_end(text, i + 1)
            digits = text[i + 1 : end]
            if not digits or len(digits) % 2 or len(digits) > 2 * MAX_REGISTER_MASK_BYTES:
                raise PacketError("R: register mask must be whole hex bytes")
            actions.append(CollectRegisters(int(digits, 16)))
            i = end
        elif letter == b"M":
            comma1 = text.find(b",", i + 1)
            comma2 = text.find(b",", comma1 + 1) if comma1 >= 0 else -1
            if comma2 < 0:
                raise PacketError("M: expected M<basereg>,<offset>,<length>")
            basereg = parse_signed_hex(text[i + 1 : comma1], "M base register", bits=_INT_BITS)
            if basereg < -1:
                raise PacketError("M: base register must be a register number or -1")
            end = _hex_run_end(text, comma2 + 1)
            offset = parse_hex(text[comma1 + 1 : comma2], "M offset")
            actions.append(CollectMemory(basereg, offset, parse_hex(text[comma2 + 1 : end], "M length")))
            i = end
        elif letter == b"X":
            bytecode, i = _parse_agent_expr(text, i, "X")
            actions.append(EvalExpression(bytecode))
        elif letter == b"L":
            actions.append(CollectStaticData())
            i += 1
        else:
            raise PacketError(f"unknown tracepoint action {letter!r}")
    return tuple(actions)


def encode_action(action: Action) -> bytes:
    """One action exactly as collection_list::stringify prints it."""
    match action:
        case CollectRegisters(mask):
            return b"R" + mask.to_bytes(max(1, (mask.bit_length() + 7) // 8), "big").hex().encode()
        case CollectMemory(basereg, offset, length):
            base = b"-1" if basereg == -1 else b"%X" % basereg
            return b"M%s,%x,%X" % (base, offset & U64_MASK, length)
        case EvalExpression(bytecode):
            return b"X%08X," % len(bytecode) + bytecode.hex().encode()
        case CollectStaticData():
            return b"L"
    raise TypeError(f"not a tracepoint action: {action!r}")


def encode_actions(actions: Iterable[Action]) -> bytes:
    return b"".join(encode_action(a) for a in actions)


# --- defining a trace experiment (tstart: QTinit, QTDP..., QTDPsrc, QTDV, QTro, modes, QTStart) --------


@dataclass(frozen=True)
class TraceInit(Packet):
    """`QTinit`: forget every tracepoint, variable and frame; the first packet of `tstart`."""

    PREFIX = b"QTinit"
    EXACT = True


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


# --- status and upload (qTStatus, qTP, qTfP/qTsP, qTfV/qTsV, qTV) --------------------------------------


@dataclass(frozen=True)
class QueryTraceStatus(Packet):
    """`qTStatus`: sent at connect, before every tstart and by tstatus; an empty reply means "no tracing"."""

    PREFIX = b"qTStatus"
    EXACT = True


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


# --- examining frames (tfind, traceframe-info, qTBuffer, QTSave) ---------------------------------------


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
    """`QTFrame:tdp:<n>`: next frame after the current one recorded by tracepoint `number`."""

    PREFIX = b"QTFrame:tdp:"
    number: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(_number(body))


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


# --- fast and static tracepoints -----------------------------------------------------------------------


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


# --- reply encoders ------------------------------------------------------------------------------------


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


def encode_frame_reply(frame: int | None, tracepoint: int = 0) -> bytes:
    """QTFrame reply: `F<frame>T<tracepoint>` when found, `F-1` when not (`tfind none` gets plain `OK`)."""
    return b"F-1" if frame is None else b"F%xT%x" % (frame, tracepoint)


def encode_static_markers(markers: Sequence[StaticMarker]) -> bytes:
    """qTfSTM/qTsSTM/qTSTMat reply `m<addr>:<hex id>:<hex extra>[,...]`, or `l` for none (end of list)."""
    if not markers:
        return END_OF_LIST
    return b"m" + b",".join(b"%x:%s:%s" % (m.address, _hex_text(m.id), _hex_text(m.extra)) for m in markers)


def encode_traceframe_info(memory: Iterable[tuple[int, int]] = (), tvars: Iterable[int] = ()) -> bytes:
    """The traceframe-info XML document: `(start, length)` memory blocks and collected variable numbers."""
    lines = [b"<traceframe-info>"]
    lines += [b'<memory start="0x%x" length="0x%x"/>' % (start, length) for start, length in memory]
    lines += [b'<tvar id="%d"/>' % number for number in tvars]
    lines.append(b"</traceframe-info>")
    return b"\n".join(lines) + b"\n"


def encode_qxfer_chunk(document: bytes, offset: int, length: int) -> bytes:
    """A qXfer read reply payload: `m<data>` if more follows, `l<data>` at the end (send it as Binary)."""
    chunk = document[offset : offset + length]
    return (b"m" if offset + len(chunk) < len(document) else b"l") + chunk


def encode_trace_buffer(data: bytes) -> bytes:
    """qTBuffer reply: the bytes in hex (get_raw_trace_data hex-decodes), `l` when nothing is left."""
    return data.hex().encode() if data else END_OF_LIST


def encode_min_fast_tracepoint_length(length: int) -> bytes:
    """qTMinFTPILen reply, hex; 0 means unknown, 1 means any instruction."""
    return b"%x" % length


# --- GDB's side of the replies (models of its parsers, for tests and tooling) ---------------------------


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
