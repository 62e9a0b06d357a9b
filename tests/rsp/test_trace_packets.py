"""Tracepoint packet parsers and reply encoders.

Every request literal below was recorded from Debian's GDB 13.1 talking to a logging stub (static
`-nostdlib` test program: func at 0x401000, func2 at 0x40102d, gvar at 0x403000, garr at 0x403010) while
running `tvariable`, `trace ... if`, `actions`/`while-stepping`, `ftrace`, `strace`, `tstart`, `tstatus`,
`enable`/`disable`, `tstop`, every `tfind` form, `tsave`, `tsave -r`, `set trace-*` and
`info static-tracepoint-markers`. The GDB-side formatters (`gdb_*`) re-state remote.c's and tracepoint.c's
format strings so hypothesis can check the parsers against packets GDB could send.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kgtp_sim.rsp.dispatch import Dispatcher, handles
from kgtp_sim.rsp.packets import connect, data
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.rsp.packets.base import Packet, PacketError

U64 = (1 << 64) - 1


# --- a dispatcher that knows every packet family -------------------------------------------------------


def _packet_classes(*modules):
    """The packet classes a family defines (the trace family's live in the modules of its package)."""
    return [
        obj
        for module in modules
        for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, Packet)
        and (obj.__module__ == module.__name__ or obj.__module__.startswith(module.__name__ + "."))
    ]


TRACE_CLASSES = _packet_classes(t)


class AllHandlers:
    """Answers OK to everything, so the table (and qSupported) holds every packet class."""


for _i, _cls in enumerate(_packet_classes(connect, data, t)):
    if _cls is not connect.QSupported:  # the dispatcher answers qSupported itself
        setattr(AllHandlers, f"handle_{_i}", handles(_cls)(lambda self, packet: b"OK"))

DISPATCHER = Dispatcher((AllHandlers(),))


def parse(payload: bytes) -> Packet:
    """Route a payload like the dispatcher does and parse it."""
    found = DISPATCHER.lookup(payload)
    assert found is not None, f"no packet class for {payload!r}"
    cls, body = found
    return cls.parse(body)


# --- GDB's formats, restated ---------------------------------------------------------------------------


def gdb_qtdp(number, address, enabled, step, pass_count, fast=None, static=False, cond=None, more=False) -> bytes:
    """download_tracepoint: "QTDP:%x:%s:%c:%lx:%x" with phex(addr, 8), [":F%x" | ":S"], [":X%x," hex], ["-"]."""
    out = "QTDP:%x:%016x:%s:%x:%x" % (number, address, "E" if enabled else "D", step, pass_count)
    if fast is not None:
        out += ":F%x" % fast
    elif static:
        out += ":S"
    if cond is not None:
        out += ":X%x," % len(cond) + cond.hex()
    return (out + ("-" if more else "")).encode()


def gdb_action(action) -> str:
    """collection_list::stringify: "R"+bytes (high first), "M-1,%s,%lX" / "M%X,%s,%lX", "X%08X,"+hex, "L"."""
    if isinstance(action, t.CollectRegisters):
        mask = action.mask.to_bytes(max(1, (action.mask.bit_length() + 7) // 8), "big")
        return "R" + mask.hex()
    if isinstance(action, t.CollectMemory):
        base = "-1" if action.basereg == -1 else "%X" % action.basereg
        return "M%s,%x,%X" % (base, action.offset, action.length)
    if isinstance(action, t.EvalExpression):
        return "X%08X," % len(action.bytecode) + action.bytecode.hex()
    return "L"


def gdb_qtdp_actions(number, address, actions, stepping=False, more=False) -> bytes:
    """"QTDP:-%x:%s:%s%s%s" with the 'S' only on the first while-stepping packet."""
    text = "".join(gdb_action(a) for a in actions)
    marker, tail = "S" if stepping else "", "-" if more else ""
    return ("QTDP:-%x:%016x:%s%s%s" % (number, address, marker, text, tail)).encode()


def gdb_qtdpsrc(number, address, kind, source: str) -> bytes:
    """encode_source_string: "%x:%s:%s:%x:%x:" (start always 0, length strlen) + hex."""
    raw = source.encode("utf-8", "surrogateescape")
    return ("QTDPsrc:%x:%x:%s:%x:%x:" % (number, address, kind, 0, len(raw))).encode() + raw.hex().encode()


def gdb_qtdv(number, value, builtin, name: str) -> bytes:
    """download_trace_state_variable: "QTDV:%x:%s:%x:" with phex(value, 8), then the hex name."""
    return ("QTDV:%x:%016x:%x:" % (number, value & U64, builtin)).encode() + name.encode().hex().encode()


def gdb_qtnotes(user=None, notes=None, stop=None) -> bytes:
    """set_trace_notes: each present field as "<key>:" + hex + ";"."""
    out = b"QTNotes:"
    for key, value in ((b"user", user), (b"notes", notes), (b"tstop", stop)):
        if value is not None:
            out += key + b":" + value.encode("utf-8", "surrogateescape").hex().encode() + b";"
    return out


# --- strategies ----------------------------------------------------------------------------------------

u64 = st.integers(0, U64)
tp_number = st.integers(1, 0xFFFF)  # a frame records its tracepoint in 16 bits
text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
actions_st = st.one_of(
    st.builds(t.CollectRegisters, st.integers(1, (1 << 1024) - 1)),
    st.builds(t.CollectMemory, st.integers(-1, 0xFFFF), u64, u64),
    st.builds(t.EvalExpression, st.binary(min_size=1, max_size=80)),
    st.just(t.CollectStaticData()),
)
action_lists = st.lists(actions_st, min_size=1, max_size=8)


# --- requests, as GDB 13.1 sent them -------------------------------------------------------------------

COND = bytes.fromhex("26000622100222dc16080219162022032b1427")  # x > 3 on the frame base


@pytest.mark.parametrize(
    "payload, expected",
    [
        (b"QTinit", t.TraceInit()),
        (b"QTDP:1:000000000040100a:E:2:0:X13,26000622100222dc16080219162022032b1427-",
         t.DefineTracepoint(1, 0x40100A, True, 2, 0, None, False, COND, True)),
        (b"QTDP:2:0000000000401034:E:0:0:F3-", t.DefineTracepoint(2, 0x401034, True, 0, 0, 3, more=True)),
        (b"QTDP:3:0000000000401052:D:0:7", t.DefineTracepoint(3, 0x401052, False, 0, 7)),
        (b"QTDP:1:0000000000401000:E:0:0:S-", t.DefineTracepoint(1, 0x401000, True, 0, 0, static=True, more=True)),
        (b"QTDP:1:000000000040100a:E:0:0-", t.DefineTracepoint(1, 0x40100A, more=True)),
        (b"QTDP:-1:000000000040100a:R0fffffffffffffff-",
         t.TracepointActions(1, 0x40100A, (t.CollectRegisters(0x0FFFFFFFFFFFFFFF),), False, True)),
        (b"QTDP:-1:000000000040100a:M-1,403000,4M-1,403010,10X0000000F,26000622100222dc16080222040c27"
         b"X0000000F,26000622100222d816080222040c27X0000000F,26000622100222ec16080222040c27"
         b"X00000008,2c00012e00012927-",
         t.TracepointActions(1, 0x40100A, (
             t.CollectMemory(-1, 0x403000, 4),
             t.CollectMemory(-1, 0x403010, 0x10),
             t.EvalExpression(bytes.fromhex("26000622100222dc16080222040c27")),
             t.EvalExpression(bytes.fromhex("26000622100222d816080222040c27")),
             t.EvalExpression(bytes.fromhex("26000622100222ec16080222040c27")),
             t.EvalExpression(bytes.fromhex("2c00012e00012927")),
         ), False, True)),
        (b"QTDP:-1:000000000040100a:X0000000C,2c000122010216402d000127-",
         t.TracepointActions(1, 0x40100A, (t.EvalExpression(bytes.fromhex("2c000122010216402d000127")),),
                             False, True)),
        (b"QTDP:-1:000000000040100a:SR0fffffffffffffff-",
         t.TracepointActions(1, 0x40100A, (t.CollectRegisters(0x0FFFFFFFFFFFFFFF),), True, True)),
        (b"QTDP:-1:000000000040100a:M-1,403000,4",
         t.TracepointActions(1, 0x40100A, (t.CollectMemory(-1, 0x403000, 4),), False, False)),
        (b"QTDP:-2:0000000000401034:R40-",
         t.TracepointActions(2, 0x401034, (t.CollectRegisters(0x40),), False, True)),
        (b"QTDP:-1:0000000000401000:L-", t.TracepointActions(1, 0x401000, (t.CollectStaticData(),), False, True)),
        (b"QTDPsrc:1:40100a:at:0:4:66756e63", t.TracepointSource(1, 0x40100A, "at", 0, 4, "func")),
        (b"QTDPsrc:1:40100a:cond:0:5:78203e2033", t.TracepointSource(1, 0x40100A, "cond", 0, 5, "x > 3")),
        (b"QTDPsrc:1:40100a:cmd:0:10:7768696c652d7374657070696e672032",
         t.TracepointSource(1, 0x40100A, "cmd", 0, 16, "while-stepping 2")),
        (b"QTDPsrc:1:40100a:cmd:0:3:656e64", t.TracepointSource(1, 0x40100A, "cmd", 0, 3, "end")),
        (b"QTDPsrc:3:401052:at:0:9:2a3078343031303532", t.TracepointSource(3, 0x401052, "at", 0, 9, "*0x401052")),
        (b"QTDV:1:0000000000000005:0:636e74", t.DefineTraceVariable(1, 5, False, "cnt")),
        (b"QTDV:2:fffffffffffffffd:0:6e6567", t.DefineTraceVariable(2, -3, False, "neg")),
        (b"QTro:0000000000400190,00000000004001b4:0000000000401000,0000000000401077:"
         b"0000000000402000,0000000000402074",
         t.ReadOnlyRegions(((0x400190, 0x4001B4), (0x401000, 0x401077), (0x402000, 0x402074)))),
        (b"QTDisconnected:0", t.SetDisconnectedTracing(False)),
        (b"QTDisconnected:1", t.SetDisconnectedTracing(True)),
        (b"QTBuffer:circular:0", t.SetCircularBuffer(False)),
        (b"QTBuffer:circular:1", t.SetCircularBuffer(True)),
        (b"QTBuffer:size:-1", t.SetTraceBufferSize(None)),
        (b"QTBuffer:size:1000", t.SetTraceBufferSize(0x1000)),
        (b"QTNotes:user:;notes:6d79206e6f7465;", t.SetTraceNotes(user="", notes="my note")),
        (b"QTNotes:user:;notes:;", t.SetTraceNotes(user="", notes="")),
        (b"QTNotes:user:616c696365;", t.SetTraceNotes(user="alice")),
        (b"QTNotes:notes:68656c6c6f;", t.SetTraceNotes(notes="hello")),
        (b"QTNotes:tstop:776879;", t.SetTraceNotes(stop_note="why")),
        (b"QTNotes:tstop:;", t.SetTraceNotes(stop_note="")),
        (b"QTStart", t.TraceStart()),
        (b"QTStop", t.TraceStop()),
        (b"qTStatus", t.QueryTraceStatus()),
        (b"qTP:1:40100a", t.QueryTracepointStatus(1, 0x40100A)),
        (b"QTEnable:3:0000000000401052", t.EnableTracepoint(3, 0x401052)),
        (b"QTDisable:3:0000000000401052", t.DisableTracepoint(3, 0x401052)),
        (b"qTfP", t.FirstTracepointPiece()),
        (b"qTsP", t.NextTracepointPiece()),
        (b"qTfV", t.FirstTraceVariable()),
        (b"qTsV", t.NextTraceVariable()),
        (b"qTV:1", t.QueryTraceVariable(1)),
        (b"QTFrame:0", t.SelectTraceFrame(0)),
        (b"QTFrame:ffffffff", t.SelectTraceFrame(None)),
        (b"QTFrame:pc:401000", t.FindFrameByPc(0x401000)),
        (b"QTFrame:tdp:1", t.FindFrameByTracepoint(1)),
        (b"QTFrame:range:401000:401100", t.FindFrameInRange(0x401000, 0x401100)),
        (b"QTFrame:outside:401000:401100", t.FindFrameOutsideRange(0x401000, 0x401100)),
        (b"qXfer:traceframe-info:read::0,1000", t.ReadTraceFrameInfo(0, 0x1000)),
        (b"qTBuffer:0,7d0", t.ReadTraceBuffer(0, 0x7D0)),
        (b"QTSave:2f746d702f782e7466", t.SaveTrace("/tmp/x.tf")),
        (b"qTMinFTPILen", t.QueryMinFastTracepointLength()),
        (b"qTfSTM", t.FirstStaticMarkers()),
        (b"qTsSTM", t.NextStaticMarkers()),
        (b"qTSTMat:401000", t.StaticMarkerAt(0x401000)),
        (b"qXfer:statictrace:read::0,1000", t.ReadStaticTraceData(0, 0x1000)),
        (b"QAllow:WriteReg:1;WriteMem:1;InsertBreak:1;InsertTrace:1;InsertFastTrace:1;Stop:1", t.SetPermissions()),
        (b"QAllow:WriteReg:0;WriteMem:1;InsertBreak:1;InsertTrace:0;InsertFastTrace:1;Stop:0",
         t.SetPermissions(write_registers=False, insert_tracepoints=False, stop=False)),
        (b"QAllow:Stop:0;SomeFutureOp:1", t.SetPermissions(stop=False)),
        (b"QTro", t.ReadOnlyRegions(())),
    ],
)
def test_gdb_13_requests(payload, expected):
    assert parse(payload) == expected


def test_formatters_reproduce_the_recorded_packets():
    """The gdb_* helpers used by the property tests print exactly what GDB printed."""
    assert gdb_qtdp(1, 0x40100A, True, 2, 0, cond=COND, more=True) == (
        b"QTDP:1:000000000040100a:E:2:0:X13,26000622100222dc16080219162022032b1427-"
    )
    assert gdb_qtdp(3, 0x401052, False, 0, 7) == b"QTDP:3:0000000000401052:D:0:7"
    assert gdb_qtdp_actions(1, 0x40100A, [t.CollectRegisters(0x0FFFFFFFFFFFFFFF)], stepping=True, more=True) == (
        b"QTDP:-1:000000000040100a:SR0fffffffffffffff-"
    )
    assert gdb_qtdp_actions(1, 0x40100A, [t.CollectMemory(-1, 0x403000, 4), t.CollectMemory(-1, 0x403010, 0x10),
                                         t.EvalExpression(bytes.fromhex("2c00012e00012927"))], more=True) == (
        b"QTDP:-1:000000000040100a:M-1,403000,4M-1,403010,10X00000008,2c00012e00012927-"
    )
    assert gdb_qtdpsrc(1, 0x40100A, "cond", "x > 3") == b"QTDPsrc:1:40100a:cond:0:5:78203e2033"
    assert gdb_qtdv(2, -3, 0, "neg") == b"QTDV:2:fffffffffffffffd:0:6e6567"
    assert gdb_qtnotes(user="", notes="my note") == b"QTNotes:user:;notes:6d79206e6f7465;"
    assert t.encode_actions([t.CollectMemory(-1, 0x403000, 4), t.CollectMemory(-1, 0x403010, 0x10)]) == (
        b"M-1,403000,4M-1,403010,10"
    )


def test_register_relative_memory_keeps_gdbs_unsigned_offset():
    """`M6,ffffffffffffffec,4` is rbp-0x14: GDB prints the offset with phex_nz, the basereg with %X."""
    packet = parse(b"QTDP:-1:000000000040100a:M6,ffffffffffffffec,4MA,10,8")
    assert packet.actions == (t.CollectMemory(6, 0xFFFFFFFFFFFFFFEC, 4), t.CollectMemory(10, 0x10, 8))
    assert (0x1000 + packet.actions[0].offset) & U64 == 0x1000 - 0x14


# --- malformed requests --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [
        # QTDP create
        b"QTDP:1:000000000040100a:X:2:0",  # enable flag neither E nor D
        b"QTDP:1:000000000040100a:e:2:0",
        b"QTDP:1:000000000040100a:E:2",  # missing pass count
        b"QTDP:1:000000000040100a",
        b"QTDP:1:10000000000000000:E:0:0",  # 65-bit address
        b"QTDP:100000000:40100a:E:0:0",  # tracepoint number wider than GDB's int
        b"QTDP:10000:40100a:E:0:0",  # wider than the 16 bits a frame records
        b"QTDP:1:40100z:E:0:0",  # non-hex
        b"QTDP::40100a:E:0:0",
        b"QTDP:1:40100a:E:0:0:X13,2600",  # truncated condition
        b"QTDP:1:40100a:E:0:0:X2,2600ff",  # bytes after the condition
        b"QTDP:1:40100a:E:0:0:X0,",  # empty condition
        b"QTDP:1:40100a:E:0:0:X2,26g0",
        b"QTDP:1:40100a:E:0:0:F3:S",  # fast and static
        b"QTDP:1:40100a:E:0:0:F3:F3",
        b"QTDP:1:40100a:E:0:0:Q",  # unknown optional field
        b"QTDP:1:40100a:E:0:0:-",
        b"QTDP:1:40100a:E:0:0:F",
        # QTDP actions
        b"QTDP:-1:40100a:Q12",  # unknown action letter
        b"QTDP:-1:40100a:R0ff",  # odd-length mask
        b"QTDP:-1:40100a:R",
        b"QTDP:-1:40100a:R" + b"ff" * (t.MAX_REGISTER_MASK_BYTES + 1),
        b"QTDP:-1:40100a:M-1,403000",  # missing length
        b"QTDP:-1:40100a:M-1,403000,",
        b"QTDP:-1:40100a:M-2,403000,4",  # base register below -1
        b"QTDP:-1:40100a:M-1,10000000000000000,4",  # 65-bit offset
        b"QTDP:-1:40100a:Mx,403000,4",
        b"QTDP:-1:40100a:X0000000F,2600",  # truncated bytecode
        b"QTDP:-1:40100a:X00000001,2g",
        b"QTDP:-1:40100a:X00000001",
        b"QTDP:-1:40100a:M-1,403000,4Z",
        b"QTDP:-1:40100a:",  # no actions
        b"QTDP:-1:40100a:S-",
        b"QTDP:-1:40100a",
        b"QTDP:-1:40100a:SS",
        # QTDPsrc
        b"QTDPsrc:1:40100a:where:0:4:66756e63",
        b"QTDPsrc:1:40100a:at:0:4:66756e6",  # odd hex
        b"QTDPsrc:1:40100a:at:0:4:66 756e6",
        b"QTDPsrc:1:40100a:at:0:2:66756e63",  # longer than announced
        b"QTDPsrc:1:40100a:at:0:4",
        # QTDV
        b"QTDV:1:0000000000000005:2:636e74",  # builtin is a flag
        b"QTDV:1:10000000000000005:0:636e74",  # 65-bit value
        b"QTDV:10000:0:0:636e74",  # wider than bytecode's 16-bit variable operands
        b"QTDV:1:5:0",
        b"QTDV:1:5:0:636e7",
        # modes and notes
        b"QTro:401000",
        b"QTro:401000,400000",  # ends before it starts
        b"QTro:401000,401077:",
        b"QTroX",
        b"QTBuffer:circular:2",
        b"QTBuffer:circular:",
        b"QTBuffer:size:-2",
        b"QTBuffer:size:",
        b"QTDisconnected:",
        b"QTDisconnected:01",
        b"QTNotes:user:616c696365",  # missing ';'
        b"QTNotes:owner:;",
        b"QTNotes:user:;user:;",
        b"QTNotes:user:6;",
        b"QTNotes:;",
        b"QAllow:WriteReg:2",
        b"QAllow:WriteReg",
        b"QAllow:",
        # status, frames, buffers
        b"qTP:1",
        b"qTP:1:40100a:3",
        b"QTEnable:3:",
        b"QTDisable:3",
        b"qTV:",
        b"qTV:100000000",
        b"QTFrame:",
        b"QTFrame:fffffffe",  # negative but not -1
        b"QTFrame:-1",
        b"QTFrame:pc:",
        b"QTFrame:pc:10000000000000000",
        b"QTFrame:tdp:x",
        b"QTFrame:range:401000",
        b"QTFrame:outside:1:2:3",
        b"qXfer:traceframe-info:read:annex:0,10",
        b"qXfer:traceframe-info:read::0",
        b"qXfer:statictrace:read:0,10",
        b"qTBuffer:0",
        b"qTBuffer:,10",
        b"QTSave:",
        b"QTSave:2f7",
        b"qTSTMat:",
    ],
)
def test_malformed_requests_are_rejected(payload):
    with pytest.raises(PacketError):
        parse(payload)


def test_malformed_packet_becomes_E01():
    assert DISPATCHER.dispatch(b"QTDP:1:000000000040100a:X:2:0") == b"E01"
    assert DISPATCHER.dispatch(b"QTDP:1:000000000040100a:E:2:0-") == b"OK"


# --- routing -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload, cls",
    [
        (b"QTDP:1:000000000040100a:E:0:0-", t.DefineTracepoint),
        (b"QTDP:-1:000000000040100a:R0f", t.TracepointActions),
        (b"QTDPsrc:1:40100a:at:0:4:66756e63", t.TracepointSource),
        (b"QTDV:1:0000000000000005:0:636e74", t.DefineTraceVariable),
        (b"QTDisconnected:1", t.SetDisconnectedTracing),
        (b"QTDisable:3:0000000000401052", t.DisableTracepoint),
        (b"QTFrame:0", t.SelectTraceFrame),
        (b"QTFrame:ffffffff", t.SelectTraceFrame),
        (b"QTFrame:pc:401000", t.FindFrameByPc),
        (b"QTFrame:tdp:1", t.FindFrameByTracepoint),
        (b"QTFrame:range:1:2", t.FindFrameInRange),
        (b"QTFrame:outside:1:2", t.FindFrameOutsideRange),
        (b"QTBuffer:circular:1", t.SetCircularBuffer),
        (b"QTBuffer:size:-1", t.SetTraceBufferSize),
        (b"qTBuffer:0,7d0", t.ReadTraceBuffer),
        (b"qTfP", t.FirstTracepointPiece),
        (b"qTfV", t.FirstTraceVariable),
        (b"qTfSTM", t.FirstStaticMarkers),
        (b"qTsSTM", t.NextStaticMarkers),
        (b"qTSTMat:401000", t.StaticMarkerAt),
        (b"qTStatus", t.QueryTraceStatus),
        (b"qTP:1:40100a", t.QueryTracepointStatus),
        (b"qTV:1", t.QueryTraceVariable),
        (b"qXfer:traceframe-info:read::0,fff", t.ReadTraceFrameInfo),
        (b"qXfer:statictrace:read::0,fff", t.ReadStaticTraceData),
        (b"qXfer:features:read:target.xml:0,fff", connect.ReadFeatures),
        (b"QTStart", t.TraceStart),
        (b"QTStop", t.TraceStop),
        (b"QTinit", t.TraceInit),
        (b"QStartNoAckMode", connect.StartNoAckMode),
        (b"T1", connect.ThreadAlive),
        (b"QAllow:Stop:1", t.SetPermissions),
    ],
)
def test_routing(payload, cls):
    found = DISPATCHER.lookup(payload)
    assert found is not None and found[0] is cls


@pytest.mark.parametrize(
    "payload", [b"QTStartX", b"QTStop1", b"qTStatus:", b"qTfPx", b"QTinit:", b"qTMinFTPILen1"]
)
def test_exact_packets_do_not_swallow_longer_ones(payload):
    assert DISPATCHER.lookup(payload) is None
    assert DISPATCHER.dispatch(payload) == b""


def test_prefixes_are_unique():
    prefixes = [cls.PREFIX for cls in TRACE_CLASSES]
    assert len(prefixes) == len(set(prefixes))


def test_qsupported_announces_what_the_trace_handlers_implement():
    features = DISPATCHER.supported_features()
    for feature in ("ConditionalTracepoints+", "TracepointSource+", "FastTracepoints+", "StaticTracepoints+",
                    "InstallInTrace+", "DisconnectedTracing+", "EnableDisableTracepoints+", "QTBuffer:size+",
                    "tracenz+", "qXfer:traceframe-info:read+", "qXfer:statictrace:read+", "QAllow+"):
        assert features.count(feature) == 1, feature
    only_static = Dispatcher((_only(t.StaticMarkerAt)(),)).supported_features()
    assert "StaticTracepoints+" in only_static and "FastTracepoints+" not in only_static


def _only(cls):
    class One:
        @handles(cls)
        def handle(self, packet):
            return b"OK"

    return One


# --- property tests: parsers recover what GDB formats --------------------------------------------------


@given(tp_number, u64, st.booleans(), u64, st.integers(0, 0x7FFFFFFF),
       st.one_of(st.none(), st.integers(1, 15), st.just("S")),
       st.one_of(st.none(), st.binary(min_size=1, max_size=60)), st.booleans())
def test_qtdp_create_from_gdb_format(number, address, enabled, step, pass_count, kind, cond, more):
    fast = kind if isinstance(kind, int) else None
    packet = parse(gdb_qtdp(number, address, enabled, step, pass_count, fast, kind == "S", cond, more))
    assert packet == t.DefineTracepoint(number, address, enabled, step, pass_count, fast, kind == "S", cond, more)


@given(tp_number, u64, action_lists, st.booleans(), st.booleans())
def test_qtdp_actions_from_gdb_format(number, address, actions, stepping, more):
    packet = parse(gdb_qtdp_actions(number, address, actions, stepping, more))
    assert packet == t.TracepointActions(number, address, tuple(actions), stepping, more)


@given(action_lists)
def test_action_encoding_round_trips(actions):
    encoded = t.encode_actions(actions)
    assert encoded.decode() == "".join(gdb_action(a) for a in actions)
    assert t.parse_actions(encoded) == tuple(actions)


@given(tp_number, u64, st.sampled_from(t.SOURCE_KINDS), text)
def test_qtdpsrc_from_gdb_format(number, address, kind, source):
    length = len(source.encode("utf-8", "surrogateescape"))
    expected = t.TracepointSource(number, address, kind, 0, length, source)
    assert parse(gdb_qtdpsrc(number, address, kind, source)) == expected


@given(tp_number, st.integers(-(1 << 63), (1 << 63) - 1), st.booleans(),
       st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True))
def test_qtdv_from_gdb_format(number, value, builtin, name):
    expected = t.DefineTraceVariable(number, value, builtin, name)
    assert parse(gdb_qtdv(number, value, int(builtin), name)) == expected


@given(st.one_of(st.none(), text), st.one_of(st.none(), text), st.one_of(st.none(), text))
def test_qtnotes_from_gdb_format(user, notes, stop):
    assert parse(gdb_qtnotes(user, notes, stop)) == t.SetTraceNotes(user, notes, stop)


@given(st.lists(st.tuples(u64, u64).map(sorted), max_size=12))
def test_qtro_from_gdb_format(regions):
    payload = b"QTro" + b"".join(b":%016x,%016x" % (start, end) for start, end in regions)
    assert parse(payload) == t.ReadOnlyRegions(tuple(tuple(r) for r in regions))


@given(st.integers(0, 0x7FFFFFFF))
def test_qtframe_number(frame):
    assert parse(b"QTFrame:%x" % frame) == t.SelectTraceFrame(frame)


# --- property tests: encoders round-trip with the parsers (both directions exist) ----------------------

definitions = st.builds(
    t.DefineTracepoint,
    number=tp_number, address=u64, enabled=st.booleans(), step_count=u64, pass_count=st.integers(0, 0x7FFFFFFF),
    fast_insn_length=st.none(), static=st.booleans(),
    condition=st.one_of(st.none(), st.binary(min_size=1, max_size=40)),
).flatmap(
    lambda tp: st.one_of(
        st.just(tp), st.integers(1, 15).map(lambda n: replace(tp, static=False, fast_insn_length=n))
    )
)


@given(definitions)
def test_upload_tracepoint_round_trips(tp):
    reply = t.encode_tracepoint_definition(tp)
    assert reply.startswith(b"T") and not reply.endswith(b"-")
    assert t.DefineTracepoint.parse(reply[1:]) == tp


@given(tp_number, u64, action_lists, st.booleans())
def test_upload_actions_round_trip(number, address, actions, stepping):
    reply = t.encode_tracepoint_actions(number, address, actions, stepping=stepping)
    assert reply[:1] == (b"S" if stepping else b"A")
    assert t.TracepointActions.parse(reply[1:]) == t.TracepointActions(number, address, tuple(actions))


@given(tp_number, u64, st.sampled_from(t.SOURCE_KINDS), text)
def test_upload_source_round_trips(number, address, kind, source):
    src = t.TracepointSource(number, address, kind, 0, len(source.encode("utf-8", "surrogateescape")), source)
    reply = t.encode_tracepoint_source(src)
    assert reply.startswith(b"Z") and t.TracepointSource.parse(reply[1:]) == src


@given(st.builds(t.DefineTraceVariable, number=tp_number, value=st.integers(-(1 << 63), (1 << 63) - 1),
                 builtin=st.booleans(), name=text))
def test_upload_variable_round_trips(tsv):
    assert t.DefineTraceVariable.parse(t.encode_trace_variable(tsv)) == tsv


# --- replies GDB parses --------------------------------------------------------------------------------


def test_trace_status_literals():
    stopped = t.TraceStatus(
        running=False, stop_reason=t.StopReason.STOP_COMMAND, stop_note="bye", frames=2, created=2,
        buffer_free=0x100, buffer_size=0x1000, circular=False, disconnected=False, start_time=5, stop_time=6,
        user="", notes="",
    )
    # GDB 13.1 printed "Trace stopped by a tstop command (bye). Collected 2 trace frames. Trace buffer has
    # 256 bytes of 4096 bytes free (93% full)." for this reply.
    assert t.encode_trace_status(stopped) == (
        b"T0;tstop:627965:0;tframes:2;tcreated:2;tfree:100;tsize:1000;circular:0;disconn:0;"
        b"starttime:5;stoptime:6;username:;notes:"
    )
    assert t.encode_trace_status(t.TraceStatus()) == b"T0;tnotrun:0"
    assert t.encode_trace_status(t.TraceStatus(running=True)) == b"T1;tnotrun:0"
    assert t.encode_trace_status(t.TraceStatus(stop_reason=t.StopReason.STOP_COMMAND)) == b"T0;tstop:0"
    empty_note = t.TraceStatus(stop_reason=t.StopReason.STOP_COMMAND, stop_note="")
    assert t.encode_trace_status(empty_note) == b"T0;tstop::0"
    assert t.encode_trace_status(t.TraceStatus(stop_reason=t.StopReason.PASSCOUNT, stopping_tracepoint=3)) == (
        b"T0;tpasscount:3"
    )
    assert t.encode_trace_status(t.TraceStatus(stop_reason=t.StopReason.ERROR, stop_note="div0",
                                               stopping_tracepoint=0x1a)) == b"T0;terror:64697630:1a"
    assert t.encode_trace_status(t.TraceStatus(stop_reason=t.StopReason.BUFFER_FULL, circular=True)) == (
        b"T0;tfull:0;circular:1"
    )
    assert t.encode_trace_status(t.TraceStatus(stop_reason=t.StopReason.DISCONNECTED)) == b"T0;tdisconnected:0"


def test_gdb_model_reads_gdbserver_style_status():
    """gdbserver ends its reply with `notes:<hex>:`; the model (like GDB) stops the hex at the ';' or end."""
    status = t.decode_trace_status(b"T0;tstop::0;tframes:0;tcreated:0;tfree:500000;tsize:500000;circular:0;"
                                   b"disconn:0;starttime:0;stoptime:0;username:;notes:;futurefield:7")
    assert status.stop_reason is t.StopReason.STOP_COMMAND and status.stop_note == ""
    assert status.buffer_free == 0x500000 and status.notes == ""


@st.composite
def statuses(draw):
    reason = draw(st.sampled_from(list(t.StopReason)))
    note, stopping = None, 0
    if reason is t.StopReason.STOP_COMMAND:
        note = draw(st.one_of(st.none(), text))
    elif reason is t.StopReason.ERROR:
        note, stopping = draw(text), draw(tp_number)
    elif reason is t.StopReason.PASSCOUNT:
        stopping = draw(tp_number)
    count = st.one_of(st.none(), st.integers(0, 0x7FFFFFFF))
    flag = st.one_of(st.none(), st.booleans())
    when = st.one_of(st.none(), st.integers(0, (1 << 63) - 1))
    return t.TraceStatus(
        draw(st.booleans()), reason, note, stopping, draw(count), draw(count), draw(count), draw(count),
        draw(flag), draw(flag), draw(when), draw(when), draw(st.one_of(st.none(), text)),
        draw(st.one_of(st.none(), text)),
    )


@given(statuses())
def test_trace_status_round_trips_through_gdbs_parser(status):
    assert t.decode_trace_status(t.encode_trace_status(status)) == status


def test_small_replies():
    assert t.encode_tracepoint_status(1, 0x20) == b"V1:20"
    assert t.encode_tracepoint_status(300, 4096) == b"V12c:1000"
    assert t.encode_trace_variable_value(5) == b"V5"
    assert t.encode_trace_variable_value(-3) == b"Vfffffffffffffffd"
    assert t.encode_trace_variable_value(None) == b"U"
    assert t.encode_frame_reply(0, 1) == b"F0T1"
    assert t.encode_frame_reply(0x1f, 0x2a) == b"F1fT2a"
    assert t.encode_frame_reply(None) == b"F-1"
    assert t.encode_min_fast_tracepoint_length(5) == b"5"
    assert t.encode_trace_buffer(b"") == b"l"
    assert t.encode_trace_buffer(b"\x01\x00\xff") == b"0100ff"
    assert t.encode_static_markers([]) == b"l"
    assert t.encode_static_markers([t.StaticMarker(0x401000, "mark", "ex")]) == b"m401000:6d61726b:6578"
    conditional = t.DefineTracepoint(1, 0x40100A, True, 2, 0, None, False, COND, True)
    assert t.encode_tracepoint_definition(conditional) == (
        b"T1:40100a:E:2:0:X13,26000622100222dc16080219162022032b1427"
    )
    assert t.encode_tracepoint_actions(1, 0x40100A, [t.CollectRegisters(0x40)], stepping=True) == b"S1:40100a:R40"
    assert t.encode_tracepoint_source(t.TracepointSource(1, 0x40100A, "cond", 0, 5, "x > 3")) == (
        b"Z1:40100a:cond:0:5:78203e2033"
    )
    assert t.encode_trace_variable(t.DefineTraceVariable(2, -3, False, "neg")) == b"2:fffffffffffffffd:0:6e6567"


@given(st.one_of(st.none(), st.integers(0, 0x7FFFFFFF)), st.integers(0, 0x7FFFFFFF))
def test_frame_reply_round_trips_through_gdbs_parser(frame, tracepoint):
    expected = (-1, None) if frame is None else (frame, tracepoint)
    assert t.decode_frame_reply(t.encode_frame_reply(frame, tracepoint)) == expected


def test_tfind_none_ok_reply():
    assert t.decode_frame_reply(b"OK") == (-1, None)


@given(st.lists(st.builds(t.StaticMarker, u64, text, text), max_size=6))
def test_static_markers_round_trip_through_gdbs_parser(markers):
    decoded = t.decode_static_markers(t.encode_static_markers(markers))
    assert decoded == (markers or None)


@given(st.binary(max_size=300))
def test_trace_buffer_reply_is_hex(data):
    reply = t.encode_trace_buffer(data)
    assert reply == b"l" if not data else bytes.fromhex(reply.decode()) == data


def test_traceframe_info_document():
    doc = t.encode_traceframe_info([(0x403000, 4), (0x7FFF0000, 0x40)], [1, 2])
    root = ET.fromstring(doc)
    assert root.tag == "traceframe-info"
    assert [(e.tag, e.attrib) for e in root] == [
        ("memory", {"start": "0x403000", "length": "0x4"}),
        ("memory", {"start": "0x7fff0000", "length": "0x40"}),
        ("tvar", {"id": "1"}),
        ("tvar", {"id": "2"}),
    ]
    assert ET.fromstring(t.encode_traceframe_info()).tag == "traceframe-info"


@given(st.binary(max_size=200), st.integers(1, 64))
def test_qxfer_chunks_reassemble(document, window):
    out, offset = b"", 0
    while True:
        reply = t.encode_qxfer_chunk(document, offset, window)
        out += reply[1:]
        offset += len(reply) - 1
        if reply[:1] == b"l":
            break
        assert reply[:1] == b"m" and len(reply) > 1
    assert out == document
