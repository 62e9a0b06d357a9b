"""What a circular buffer keeps once it has wrapped: about its size in frames, in every engine.

The soak found the compiled engines keeping far less when a tracepoint had an expression action (`collect
(2*counter1+3*counter2)`, or any `teval`): they reserved `frame_room()` for it (half the ring, the most an
expression may trace) at every hit and evicted until that much was free, so right after the head passed the
middle of the ring a 16 KiB buffer held one frame where the interpreter (which appends what was collected)
keeps 52. They now reserve what the expression can trace at most (native.traced_bytes_bound); only a trace of
a computed length, or a loop, still needs the whole room.

The workload runs on this thread (`machine.call`), so the counts are the same at every run.
"""

from __future__ import annotations

import pytest

from kgtp_sim.agent.opcodes import assemble
from kgtp_sim.arch import amd64
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import Tracer
from kgtp_sim.tracing.core.frames import FRAME_HEADER, encode_block, register_collection
from kgtp_sim.tracing.core.ring import DISCARD, ENTRY_HEADER

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)
SITE = IMAGE.address_of("kgtp_test_function")
EXPR = assemble("const8 2; reg 5; ext 32; mul; const8 3; reg 4; ext 32; mul; add; ext 32; end")
SIZE = 0x4000


def kept_after_each_call(engine: str, with_expression: bool, calls: int = 300) -> list[int]:
    """tframes after each traced call, from the first wrap on ($regs, and the expression if asked)."""
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    tracer = Tracer(machine, engine)
    tracer.definitions.define(t.DefineTracepoint.parse(b"1:%x:E:0:0-" % SITE))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"1:%x:R01ffff-" % SITE))
    if with_expression:
        expression = b"1:%x:X%08x,%s" % (SITE, len(EXPR), EXPR.hex().encode())
        tracer.definitions.add_actions(t.TracepointActions.parse(expression))
    tracer.definitions.circular = True
    tracer.definitions.buffer_size = SIZE
    tracer.start()
    kept = []
    for _ in range(calls):
        machine.call("kgtp_bench_loop", 1)
        state = tracer.ring.state()
        if state.created > state.frames:
            kept.append(state.frames)
    tracer.stop(t.StopReason.STOP_COMMAND)
    return kept


REFERENCE = kept_after_each_call("interp", with_expression=True)


def test_the_interpreter_keeps_a_steady_buffer_full():
    registers = encode_block(register_collection(0x1FFFF, [0] * len(amd64.GENERAL_REGISTERS)))  # rax..rip
    entry = (ENTRY_HEADER.size + FRAME_HEADER.size + len(registers) + 7) & ~7
    assert len(REFERENCE) > 200
    # full, less at most the page's worth (and the entry) that one round of eviction frees beyond the need
    assert max(REFERENCE) == SIZE // entry and min(REFERENCE) >= (SIZE - DISCARD) // entry - 1


@pytest.mark.parametrize("engine", ["naive", "opt"])
def test_without_an_expression_compiled_engines_keep_as_much(engine):
    assert kept_after_each_call(engine, with_expression=False) == REFERENCE


@pytest.mark.parametrize("engine", ["naive", "opt"])
def test_with_an_expression_that_traces_nothing_compiled_engines_keep_as_much(engine):
    assert kept_after_each_call(engine, with_expression=True) == REFERENCE


def test_the_reservation_is_what_an_expression_can_trace_at_most():
    from kgtp_sim.agent.verify import verify
    from kgtp_sim.tracing.engines.native import traced_bytes_bound

    assert traced_bytes_bound(verify(EXPR)) == 0
    assert traced_bytes_bound(verify(assemble("reg 5; trace_quick 8; reg 4; trace16 300; tracev 3; end"))) == (
        (1 + 10 + 8) + (1 + 10 + 300) + (1 + 12))
    assert traced_bytes_bound(verify(assemble("reg 5; zero_ext 64; const16 176; trace; end"))) == 1 + 10 + 176
    assert traced_bytes_bound(verify(assemble("reg 5; reg 4; trace; end"))) is None  # a computed length
    assert traced_bytes_bound(verify(assemble("reg 5; trace_quick 8; pop; goto 0; end"))) is None  # may trace again
