"""The tracepoint handlers against a fake tracer: the stub's own logic, no machine, no GDB.

What is tested here is what `TraceHandlers` decides by itself: which frame `tfind` selects next and what the
register and memory view then is, when `qTSTMat` may name a marker, the order and end of the upload sequences,
how run control and status reach the tracer and come back as replies.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kgtp_sim.arch import amd64
from kgtp_sim.rsp.dispatch import E_TRACE, RspError
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.machine import Marker
from kgtp_sim.stub.overlay import FrameOverlay
from kgtp_sim.stub.trace import TraceHandlers
from kgtp_sim.tracing.core.frames import TsvBlock, ViewError
from kgtp_sim.tracing.core.model import StopReason

from .fake_tracer import FakeTracer, register_frame

A, B = 0xFFFFFFFF81001000, 0xFFFFFFFF81002000
GLOBAL = 0xFFFFFFFF81200000


class LiveView:
    def read_memory(self, address, length):
        return b"\x11" * length


def _handlers(**tracer_fields) -> tuple[TraceHandlers, FakeTracer]:
    tracer = FakeTracer(**tracer_fields)
    return TraceHandlers(tracer, FrameOverlay(LiveView())), tracer


def _define(handlers: TraceHandlers, body: bytes) -> bytes:
    return handlers.define_tracepoint(t.DefineTracepoint.parse(body))


def _frames() -> list:
    return [
        register_frame(0, 1, A, (GLOBAL, b"\x01\x02")),
        register_frame(1, 2, B),
        register_frame(2, 1, A),
    ]


# ---- tfind: the frame cursor ------------------------------------------------------------------------------


def test_tfind_searches_start_after_the_selected_frame():
    handlers, _ = _handlers(recorded=_frames())
    assert handlers.select_frame(t.SelectTraceFrame.parse(b"0")) == b"F0T1"
    assert handlers.find_by_tracepoint(t.FindFrameByTracepoint.parse(b"1")) == b"F2T1"
    assert handlers.find_by_tracepoint(t.FindFrameByTracepoint.parse(b"1")) == b"F-1"
    assert handlers.select_frame(t.SelectTraceFrame.parse(b"ffffffff")) == b"OK"  # tfind none
    assert handlers.find_by_pc(t.FindFrameByPc.parse(b"%x" % B)) == b"F1T2"
    assert handlers.find_in_range(t.FindFrameInRange.parse(b"%x:%x" % (A, A + 1))) == b"F2T1"
    assert handlers.select_frame(t.SelectTraceFrame.parse(b"ffffffff")) == b"OK"
    assert handlers.find_outside_range(t.FindFrameOutsideRange.parse(b"%x:%x" % (A, A))) == b"F1T2"


def test_tfind_past_the_last_frame_finds_nothing():
    handlers, _ = _handlers(recorded=_frames())
    assert handlers.select_frame(t.SelectTraceFrame.parse(b"3")) == b"F-1"
    assert handlers.views.current is None


def test_a_selected_frame_is_what_registers_and_memory_read():
    handlers, _ = _handlers(recorded=_frames())
    handlers.select_frame(t.SelectTraceFrame.parse(b"0"))
    view = handlers.views.view
    assert view.registers()["rip"] == A
    assert view.read_memory(GLOBAL, 2) == b"\x01\x02"
    with pytest.raises(ViewError):
        view.read_memory(GLOBAL + 0x100, 1)  # not collected in this frame
    handlers.select_frame(t.SelectTraceFrame.parse(b"ffffffff"))
    assert handlers.views.view is None  # back to the live kernel


def test_the_cursor_is_forgotten_with_the_debugger():
    handlers, _ = _handlers(recorded=_frames())
    handlers.select_frame(t.SelectTraceFrame.parse(b"1"))
    handlers.forget_session()
    assert handlers.views.current is None
    assert handlers.find_by_tracepoint(t.FindFrameByTracepoint.parse(b"1")) == b"F0T1"  # from the start again


def test_frame_info_and_variables_come_from_the_selected_frame():
    handlers, tracer = _handlers(recorded=_frames(), variables={5: 42})
    assert handlers.variable_value(t.QueryTraceVariable.parse(b"5")) == b"V2a"  # live value, no frame selected
    handlers.select_frame(t.SelectTraceFrame.parse(b"0"))
    assert handlers.variable_value(t.QueryTraceVariable.parse(b"5")) == b"U"  # the frame did not collect it
    info = handlers.traceframe_info(t.ReadTraceFrameInfo.parse(b":0,1000")).data
    assert b'<memory start="0x%x" length="0x2"/>' % GLOBAL in info
    handlers.select_frame(t.SelectTraceFrame.parse(b"ffffffff"))
    with pytest.raises(RspError):
        handlers.traceframe_info(t.ReadTraceFrameInfo.parse(b":0,1000"))


@pytest.mark.parametrize("gdbserver", [False, True])
def test_a_variable_a_frame_traced_twice_reads_as_each_server_answers(gdbserver):
    """`collect $v += 1` traces $v when it is read and again when it is set: a frame holds both values. KGTP
    answers qTV with the first (gtp_rb_traceframe_get_tv), gdbserver with the last (traceframe_read_tsv; GDB's
    tsv.exp prints the incremented value)."""
    frame = register_frame(0, 1, A)
    frame = replace(frame, blocks=frame.blocks + (TsvBlock(5, 15), TsvBlock(5, 16)))
    handlers, _ = _handlers(recorded=[frame], variables={5: 99}, gdbserver=gdbserver)
    handlers.select_frame(t.SelectTraceFrame.parse(b"0"))
    assert handlers.variable_value(t.QueryTraceVariable.parse(b"5")) == (b"V10" if gdbserver else b"Vf")


# ---- qTSTMat gating -------------------------------------------------------------------------------------


def _marker(site: int) -> Marker:
    return Marker("module", "kgtp_module_event", site, "counter1=%d", "counter1", "int counter1", ("counter1",),
                  4, (), ("%edi",))


def test_marker_at_names_a_marker_only_while_gdb_downloads():
    handlers, tracer = _handlers(listed_markers=[_marker(A)])
    ask = t.StaticMarkerAt.parse(b"%x" % A)
    assert handlers.marker_at(ask) == t.END_OF_LIST  # at `strace` time: GDB 13-18 crash on a named marker
    handlers.trace_init(t.TraceInit())
    assert handlers.marker_at(ask).startswith(b"m%x:" % A)  # between QTinit and QTStart
    assert handlers.marker_at(t.StaticMarkerAt.parse(b"%x" % B)) == t.END_OF_LIST  # no marker there
    handlers.trace_start(t.TraceStart())
    assert handlers.marker_at(ask) == t.END_OF_LIST
    handlers.trace_init(t.TraceInit())
    handlers.forget_session()  # the downloading GDB went away
    assert handlers.marker_at(ask) == t.END_OF_LIST


def test_marker_list_is_one_marker_a_reply_then_the_end():
    handlers, _ = _handlers(listed_markers=[_marker(A), _marker(B)])
    first = handlers.first_markers(t.FirstStaticMarkers())
    second = handlers.next_markers(t.NextStaticMarkers())
    assert [m.address for m in t.decode_static_markers(first) + t.decode_static_markers(second)] == [A, B]
    assert handlers.next_markers(t.NextStaticMarkers()) == t.END_OF_LIST


# ---- uploads ---------------------------------------------------------------------------------------------


def test_upload_sequence_gives_definitions_actions_sources_then_the_end():
    handlers, _ = _handlers()
    _define(handlers, b"1:%x:E:0:0-" % A)
    handlers.tracepoint_actions(t.TracepointActions.parse(b"1:%x:R01-" % A))
    handlers.tracepoint_actions(t.TracepointActions.parse(b"1:%x:SM-1,%x,8" % (A, GLOBAL)))
    handlers.tracepoint_source(t.TracepointSource.parse(b"1:%x:at:0:5:2a61626364" % A))
    pieces = [handlers.first_tracepoint_piece(t.FirstTracepointPiece())]
    while pieces[-1] != b"l":
        pieces.append(handlers.next_tracepoint_piece(t.NextTracepointPiece()))
    assert pieces == [
        b"T1:%x:E:0:0" % A,
        b"A1:%x:R01" % A,
        b"S1:%x:M-1,%x,8" % (A, GLOBAL),
        b"Z1:%x:at:0:5:2a61626364" % A,
        b"l",
    ]
    assert handlers.next_tracepoint_piece(t.NextTracepointPiece()) == b"l"  # stays at the end


def test_variables_upload_in_number_order_and_qtinit_keeps_only_builtins():
    handlers, tracer = _handlers()
    handlers.define_variable(t.DefineTraceVariable.parse(b"9:5:0:6869"))
    handlers.define_variable(t.DefineTraceVariable.parse(b"3:fffffffffffffffd:0:6c6f"))
    first = handlers.first_variable(t.FirstTraceVariable())
    assert first == b"3:fffffffffffffffd:0:6c6f"
    assert handlers.next_variable(t.NextTraceVariable()) == b"9:5:0:6869"
    assert handlers.next_variable(t.NextTraceVariable()) == b"l"
    handlers.trace_init(t.TraceInit())
    assert handlers.first_variable(t.FirstTraceVariable()) == b"l"


def test_the_gdbserver_role_uploads_the_newest_variable_first_as_gdbserver():
    """gdbserver's list has each new variable at its head, and GDB reverses what it uploads: its `=tsv-created`
    notifications then come in the order the variables were defined (mi-tsv-changed.exp expects $tvar1 first)."""
    handlers, tracer = _handlers(gdbserver=True)
    for body in (b"1:0:0:7476617231", b"2:2d:0:7476617232"):  # $tvar1, then $tvar2 = 45
        handlers.define_variable(t.DefineTraceVariable.parse(body))
    uploaded = [handlers.first_variable(t.FirstTraceVariable())]
    while uploaded[-1] != b"l":
        uploaded.append(handlers.next_variable(t.NextTraceVariable()))
    assert uploaded == [b"2:2d:0:7476617232", b"1:0:0:7476617231", b"l"]


# ---- run control and status ------------------------------------------------------------------------------


def test_tstart_refused_by_the_tracer_is_a_text_error():
    handlers, tracer = _handlers(refuse_start="tracepoint 1 at 0x1: no probe here")
    with pytest.raises(RspError) as raised:
        handlers.trace_start(t.TraceStart())
    assert raised.value.code == E_TRACE and raised.value.text and "no probe here" in raised.value.message


def test_tstop_always_sends_a_note_and_status_reports_it():
    handlers, tracer = _handlers()
    handlers.trace_start(t.TraceStart())
    assert t.decode_trace_status(handlers.trace_status(t.QueryTraceStatus())).running
    handlers.trace_stop(t.TraceStop())
    status = t.decode_trace_status(handlers.trace_status(t.QueryTraceStatus()))
    assert status.stop_reason is StopReason.STOP_COMMAND and status.stop_note == ""  # never the bare tstop:0
    handlers.trace_notes(t.SetTraceNotes.parse(b"tstop:%s;" % b"done".hex().encode()))
    assert t.decode_trace_status(handlers.trace_status(t.QueryTraceStatus())).stop_note == "done"


def test_qtinit_stops_a_run_and_forgets_the_selection():
    handlers, tracer = _handlers(recorded=_frames())
    handlers.trace_start(t.TraceStart())
    handlers.select_frame(t.SelectTraceFrame.parse(b"1"))
    _define(handlers, b"1:%x:E:0:0" % A)
    assert handlers.trace_init(t.TraceInit()) == b"OK"
    assert tracer.calls[-1] == "stop STOP_COMMAND" and not tracer.running
    assert not tracer.definitions.tracepoints and handlers.views.current is None


def test_a_tracepoint_downloaded_during_a_run_is_armed_after_its_last_piece():
    handlers, tracer = _handlers()
    handlers.trace_start(t.TraceStart())
    _define(handlers, b"2:%x:E:0:0-" % B)
    assert tracer.armed == []  # actions still to come
    handlers.tracepoint_actions(t.TracepointActions.parse(b"2:%x:R01" % B))
    assert tracer.armed == [(2, B)]
    handlers.disable_tracepoint(t.DisableTracepoint.parse(b"2:%x" % B))
    assert tracer.armed == []
    handlers.enable_tracepoint(t.EnableTracepoint.parse(b"2:%x" % B))
    assert tracer.armed == [(2, B)]


def test_actions_for_an_undefined_tracepoint_are_refused():
    handlers, _ = _handlers()
    with pytest.raises(RspError) as raised:
        handlers.tracepoint_actions(t.TracepointActions.parse(b"7:%x:R01" % A))
    assert raised.value.code == E_TRACE


def test_qtp_reports_hits_of_defined_locations_only():
    handlers, _ = _handlers(recorded=_frames())
    _define(handlers, b"1:%x:E:0:0" % A)
    assert handlers.tracepoint_status(t.QueryTracepointStatus.parse(b"1:%x" % A)) == b"V2:0"
    assert handlers.tracepoint_status(t.QueryTracepointStatus.parse(b"4:%x" % A)) == b""  # unknown: empty


def test_the_trace_buffer_is_every_saved_frame_in_order():
    handlers, tracer = _handlers(recorded=_frames())
    data = b"".join(f.to_gdb() for f in tracer.recorded)
    first = handlers.trace_buffer(t.ReadTraceBuffer.parse(b"0,10"))
    rest = handlers.trace_buffer(t.ReadTraceBuffer.parse(b"10,%x" % len(data)))
    assert bytes.fromhex((first + rest).decode()) == data
    assert handlers.trace_buffer(t.ReadTraceBuffer.parse(b"%x,10" % len(data))) == b"l"


def test_a_process_targets_trace_buffer_has_register_blocks_of_its_register_file():
    """The gdbserver role's handlers (arch/amd64.LINUX): each `R` block is one `g` packet of the process's
    registers (GDB reads qTBuffer's blocks by that size), KGTP's registers first, then zeros."""
    tracer = FakeTracer(recorded=_frames())
    handlers = TraceHandlers(tracer, FrameOverlay(LiveView()), layout=amd64.LINUX)
    reply = handlers.trace_buffer(t.ReadTraceBuffer.parse(b"0,4000"))
    data = bytes.fromhex(reply.decode())
    kgtp = tracer.recorded[0].to_gdb()
    header = 6  # tracepoint number, then the frame's length
    assert int.from_bytes(data[2:6], "little") == len(kgtp) - header + amd64.LINUX.size - amd64.G_PACKET_SIZE
    block = data[header + 1: header + 1 + amd64.LINUX.size]
    assert data[header:header + 1] == b"R" and block[:amd64.G_PACKET_SIZE] == kgtp[header + 1:][:amd64.G_PACKET_SIZE]
    assert amd64.LINUX.decode(block)["rip"] == A and not any(block[amd64.G_PACKET_SIZE:])
    assert data[header + 1 + amd64.LINUX.size:][:1] == b"M"  # the frame's next block starts right after


def test_tfind_tracepoint_minus_one_finds_no_frame():
    """GDB sends `tfind tracepoint -1` as 32 bits of ones: no tracepoint has that number, so no frame (gdbserver's
    `F-1`, where an error would be GDB's `Target returns error code`)."""
    handlers, _ = _handlers(recorded=_frames())
    assert handlers.find_by_tracepoint(t.FindFrameByTracepoint.parse(b"ffffffff")) == b"F-1"
