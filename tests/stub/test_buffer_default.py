"""The trace buffer a user gets without asking for one: 5 MiB, as gdbserver and KGTP."""

from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.stub.overlay import FrameOverlay
from kgtp_sim.stub.trace import TraceHandlers

from .fake_tracer import FakeTracer


def test_default_buffer_is_five_mib_and_size_minus_one_restores_it():
    tracer = FakeTracer()
    handlers = TraceHandlers(tracer, FrameOverlay(None))
    assert t.decode_trace_status(handlers.trace_status(t.QueryTraceStatus())).buffer_size == 5 * 1024 * 1024
    handlers.buffer_size(t.SetTraceBufferSize.parse(b"10000"))
    assert tracer.definitions.buffer_size == 0x10000
    handlers.buffer_size(t.SetTraceBufferSize.parse(b"-1"))
    assert tracer.definitions.buffer_size == 5 * 1024 * 1024
