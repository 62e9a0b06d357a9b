"""Tracepoint packets: defining, running and inspecting a trace experiment, plus the replies GDB reads back.

Every format here follows GDB 13.1. Requests are built in gdb/remote.c (remote_target::download_tracepoint,
trace_find, get_trace_status, ...) with action strings from gdb/tracepoint.c (collection_list::stringify,
encode_source_string). Replies are read by gdb/tracepoint.c (parse_trace_status, parse_tracepoint_status,
parse_tracepoint_definition, parse_tsv_definition, parse_static_tracepoint_marker_definition,
parse_traceframe_info) and by remote.c itself (trace_find, get_raw_trace_data, ...).
docs/tracepoint-packets.md has the table; tests/rsp/test_trace_packets.py holds the wire literals recorded
from a real GDB 13.1.

The family is split by what the packets are for, each parser next to the reply encoder GDB reads back and to
the model of GDB's own reader the tests use:

- `definitions`: what tstart downloads (QTDP, QTDP:-, QTDPsrc, QTDV, QTro) and qTMinFTPILen;
- `run`: run control and status (QTinit, QTBuffer:*, QTDisconnected, QTNotes, QTStart/QTStop,
  QTEnable/QTDisable, QAllow, qTStatus);
- `frames`: tfind (QTFrame:*), qXfer:traceframe-info, qTBuffer, QTSave;
- `upload`: qTP, qTfP/qTsP, qTfV/qTsV, qTV;
- `markers`: static tracepoint markers (qTfSTM/qTsSTM, qTSTMat) and qXfer:statictrace;
- `actions`: the actions' wire form (`R`, `M`, `X`, `L`), shared by QTDP:- and the upload pieces;
- `wire`: the small strict readers every module uses.

Every name is imported here, so `kgtp_sim.rsp.packets.trace` (the stub's handlers import it as `t`) offers the
whole family as one namespace; the words themselves (actions, specs, status) are the tracer's
(`kgtp_sim/tracing/core/model.py`) and are offered too, as the packets are built from them, and so is the packet
base (`Packet`, `PacketError`, the number readers) as it always was.

Prefix collisions are resolved by the dispatcher's longest-prefix rule: `QTDP:-` (actions) beats `QTDP:`
(create), `QTFrame:pc:`/`tdp:`/`range:`/`outside:` beat `QTFrame:`, and `qTBuffer:` (lower-case q, read the
buffer) lives in a different bucket from `QTBuffer:circular:`/`QTBuffer:size:`. Which module a class lives in
changes nothing there: the table and qSupported are derived from the handlers' marks.

Thread: the server thread (`RspServer`) parses and encodes; GDB's readers (`decode_*`) run on the thread of the
test or tool that calls them.
"""

from ....tracing.core.model import (
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
from ..base import U64_MASK, Packet, PacketError, parse_hex, parse_signed_hex, split_exact
from .actions import MAX_REGISTER_MASK_BYTES, encode_action, encode_actions, parse_actions
from .definitions import (
    DefineTracepoint,
    DefineTraceVariable,
    QueryMinFastTracepointLength,
    ReadOnlyRegions,
    TracepointActions,
    TracepointSource,
    encode_min_fast_tracepoint_length,
)
from .frames import (
    FindFrameByPc,
    FindFrameByTracepoint,
    FindFrameInRange,
    FindFrameOutsideRange,
    ReadTraceBuffer,
    ReadTraceFrameInfo,
    SaveTrace,
    SelectTraceFrame,
    decode_frame_reply,
    encode_frame_reply,
    encode_trace_buffer,
    encode_traceframe_info,
)
from .markers import (
    FirstStaticMarkers,
    NextStaticMarkers,
    ReadStaticTraceData,
    StaticMarkerAt,
    decode_static_markers,
    encode_static_markers,
)
from .run import (
    DisableTracepoint,
    EnableTracepoint,
    QueryTraceStatus,
    SetCircularBuffer,
    SetDisconnectedTracing,
    SetPermissions,
    SetTraceBufferSize,
    SetTraceNotes,
    TraceInit,
    TraceStart,
    TraceStop,
    decode_trace_status,
    encode_trace_status,
)
from .upload import (
    FirstTracepointPiece,
    FirstTraceVariable,
    NextTracepointPiece,
    NextTraceVariable,
    QueryTracepointStatus,
    QueryTraceVariable,
    encode_trace_variable,
    encode_trace_variable_value,
    encode_tracepoint_actions,
    encode_tracepoint_definition,
    encode_tracepoint_source,
    encode_tracepoint_status,
)
from .wire import END_OF_LIST, NO_FRAME, encode_qxfer_chunk

__all__ = [
    # the tracer's words the packets are built from
    "SOURCE_KINDS", "Action", "ActionList", "CollectMemory", "CollectRegisters", "CollectStaticData",
    "EvalExpression", "SourceSpec", "StaticMarker", "StopReason", "TraceStatus", "Tracepoint", "TracepointSpec",
    "VariableSpec",
    # the base every packet module shares
    "U64_MASK", "Packet", "PacketError", "parse_hex", "parse_signed_hex", "split_exact",
    # actions
    "MAX_REGISTER_MASK_BYTES", "encode_action", "encode_actions", "parse_actions",
    # definitions
    "DefineTraceVariable", "DefineTracepoint", "QueryMinFastTracepointLength", "ReadOnlyRegions",
    "TracepointActions", "TracepointSource", "encode_min_fast_tracepoint_length",
    # run control and status
    "DisableTracepoint", "EnableTracepoint", "QueryTraceStatus", "SetCircularBuffer", "SetDisconnectedTracing",
    "SetPermissions", "SetTraceBufferSize", "SetTraceNotes", "TraceInit", "TraceStart", "TraceStop",
    "decode_trace_status", "encode_trace_status",
    # frames
    "FindFrameByPc", "FindFrameByTracepoint", "FindFrameInRange", "FindFrameOutsideRange", "ReadTraceBuffer",
    "ReadTraceFrameInfo", "SaveTrace", "SelectTraceFrame", "decode_frame_reply", "encode_frame_reply",
    "encode_trace_buffer", "encode_traceframe_info",
    # upload
    "FirstTraceVariable", "FirstTracepointPiece", "NextTraceVariable", "NextTracepointPiece",
    "QueryTraceVariable", "QueryTracepointStatus", "encode_trace_variable", "encode_trace_variable_value",
    "encode_tracepoint_actions", "encode_tracepoint_definition", "encode_tracepoint_source",
    "encode_tracepoint_status",
    # static markers
    "FirstStaticMarkers", "NextStaticMarkers", "ReadStaticTraceData", "StaticMarkerAt", "decode_static_markers",
    "encode_static_markers",
    # shared wire pieces
    "END_OF_LIST", "NO_FRAME", "encode_qxfer_chunk",
]
