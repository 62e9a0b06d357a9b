"""Frames that cost what they collect: a register collection that names fewer than all of the general registers
is recorded as a compact block of just those (and rip), by every engine and on every probe path, and reads back
the same everywhere GDB reads it.

The optimizing engine writes such a frame on a short path straight into the ring when it fits without padding
or eviction, and on the full path otherwise; the runs below go through both (a small circular ring wraps many
times), and every engine must produce the same frames, block for block, as the interpreter.
"""

from __future__ import annotations

import pytest

from kgtp_sim.agent.opcodes import assemble
from kgtp_sim.arch import amd64
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import Tracer
from kgtp_sim.tracing.core.builtins import CLOCK, CPU_ID, tsc_to_clock
from kgtp_sim.tracing.core.frames import CompactRegisters, RegisterBlock, TsvBlock, parse_blocks
from kgtp_sim.tracing.core.ring import CTL_LIMIT, CTL_PHYS, short_path_fields

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)
SITE = IMAGE.address_of("kgtp_test_function")
MARKER = next(m for m in IMAGE.markers if m.name == "kgtp_module_event")
# GDB 13's `collect (2*counter1+3*counter2)`: the registers it reads (rdi, rsi) and a silent expression
COLLECT = assemble("const8 2; reg 5; ext 32; mul; ext 32; const8 3; reg 4; ext 32; mul; ext 32; add; ext 32; "
                   "pop; end")
TRUE = assemble("reg 5; const8 0; swap; less_signed; end")  # counter1 > 0
CALLS = 150
SEGMENTS = sum(1 << amd64.REGISTER_INDEX[n] for n in ("cs", "ss", "ds", "es", "fs", "gs"))
EFLAGS = 1 << amd64.REGISTER_INDEX["eflags"]
RSP_RAX_R8 = sum(1 << amd64.REGISTER_INDEX[n] for n in ("rax", "rcx", "rdx", "rsp", "r8"))


def _x(code: bytes) -> bytes:
    return b"X%x,%s" % (len(code), code.hex().encode())


def _mask_hex(mask: int) -> bytes:
    digits = b"%x" % mask
    return b"0" * (len(digits) % 2) + digits  # whole bytes, as GDB sends it


def _define(tracer: Tracer, number: int, address: int, mask: int, *, static=False, condition=None) -> None:
    cond = b":" + _x(condition) if condition else b""
    flags = b":S" if static else b""
    tracer.definitions.define(t.DefineTracepoint.parse(b"%x:%x:E:0:0%s%s-" % (number, address, flags, cond)))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"%x:%x:R%s%s" % (number, address, _mask_hex(mask), _x(COLLECT))))


PATHS = {
    "jump": lambda tr, mask, cond: _define(tr, 1, SITE, mask, condition=cond),
    "int3": lambda tr, mask, cond: _define(tr, 1, SITE, mask, condition=cond),
    "shared": lambda tr, mask, cond: (_define(tr, 1, SITE, mask, condition=cond), _define(tr, 2, SITE, 0x30)),
    "marker": lambda tr, mask, cond: _define(tr, 1, MARKER.site, mask, static=True, condition=cond),
}
MASKS = {"thesis": 0x30, "flags+segments": 0x30 | EFLAGS | SEGMENTS, "scratch+rsp": RSP_RAX_R8 | 0x30}


def _run(engine: str, path: str, mask: int, condition: bytes | None, size: int = 0x1000):
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    tracer = Tracer(machine, engine, probe="int3" if path == "int3" else "auto")
    PATHS[path](tracer, mask, condition)
    tracer.definitions.circular = True
    tracer.definitions.buffer_size = size
    tracer.start()
    machine.call("kgtp_bench_loop", CALLS)
    status = tracer.status()
    frames = tracer.frames()
    ring = tracer.ring[0]  # one CPU
    state = ring.state()
    fields = machine.read_memory(ring.field(CTL_PHYS), 8) + machine.read_memory(ring.field(CTL_LIMIT), 8)
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert fields == short_path_fields(state.base, state.size, state.head, state.tail), (engine, path)
    return [(f.tracepoint, f.blocks) for f in frames], (status.created, status.frames)


@pytest.mark.parametrize("conditional", [False, True], ids=["always", "condition"])
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_engine_records_the_interpreters_frames(path, mask, conditional):
    condition = TRUE if conditional else None
    reference, counts = _run("interp", path, MASKS[mask], condition)
    assert counts[0] > counts[1] > 0  # the ring wrapped: the full path's padding and eviction ran too
    for engine in ("naive", "opt"):
        frames, engine_counts = _run(engine, path, MASKS[mask], condition)
        assert engine_counts == counts, (engine, path, mask)
        assert frames == reference, (engine, path, mask)


def _marker_data(tr, actions: bytes, cond) -> None:
    c = b":" + _x(cond) if cond else b""
    tr.definitions.define(t.DefineTracepoint.parse(b"1:%x:E:0:0:S%s-" % (MARKER.site, c)))
    tr.definitions.add_actions(t.TracepointActions.parse(b"1:%x:%s" % (MARKER.site, actions)))


PATHS["marker-sdata"] = lambda tr, mask, cond: _marker_data(tr, b"L", cond)
PATHS["marker-registers-sdata"] = lambda tr, mask, cond: _marker_data(tr, b"R%sL" % _mask_hex(mask), cond)


@pytest.mark.parametrize("conditional", [False, True], ids=["always", "condition"])
@pytest.mark.parametrize("path", ["marker-sdata", "marker-registers-sdata"])
def test_static_data_built_on_the_short_path_is_the_interpreters(path, conditional):
    """`collect $_sdata` at a marker whose fields are register values: built in place on the short path (with
    the registers asked beside it, or alone), block for block what the interpreter builds."""
    condition = TRUE if conditional else None
    reference, counts = _run("interp", path, MASKS["scratch+rsp"], condition)
    assert counts[0] > counts[1] > 0 and any(b.__class__.__name__ == "StaticBlock" for b in reference[0][1])
    for engine in ("naive", "opt"):
        frames, engine_counts = _run(engine, path, MASKS["scratch+rsp"], condition)
        assert (engine_counts, frames) == (counts, reference), (engine, path)


@pytest.mark.parametrize("engine", ["interp", "naive", "opt"])
def test_a_compact_block_holds_what_was_asked_and_rip(engine):
    frames, _ = _run(engine, "jump", MASKS["flags+segments"], None, size=0x100000)
    assert len(frames) == CALLS
    for number, (tracepoint, blocks) in enumerate(frames):
        (block,) = blocks
        assert isinstance(block, CompactRegisters)
        regs = block.registers()
        assert set(regs) == {"rdi", "rsi", "rip", "eflags", "cs", "ss", "ds", "es", "fs", "gs"}
        # kgtp_bench_loop(n): call i passes counter1 = i + 1, counter2 = i
        assert (regs["rdi"], regs["rsi"]) == (number + 1, number), engine
        assert regs["rip"] == SITE and regs["cs"] == 0x08 and regs["ss"] == 0x10 and regs["eflags"] & 0x2


def test_gdb_reads_a_full_register_block_with_what_was_not_collected_unavailable_live():
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    tracer = Tracer(machine, "opt")
    _define(tracer, 1, SITE, 0x30)
    tracer.start()
    machine.call("kgtp_bench_loop", 3)
    frame = tracer.frames()[0]
    tracer.stop(t.StopReason.STOP_COMMAND)
    saved = tracer.saved_frame(frame)  # what qTBuffer and tsave hand GDB
    block, *stamps = parse_blocks(saved[6:])
    assert isinstance(block, RegisterBlock) and len(block.data) == amd64.G_PACKET_SIZE
    # when and where the frame was committed, as the values of $cpu_id and $clock (GDB's format has no field)
    assert stamps == [TsvBlock(CPU_ID, frame.cpu), TsvBlock(CLOCK, tsc_to_clock(tracer.tsc, frame.timestamp))]
    regs = amd64.decode_registers(block.data)
    assert (regs["rdi"], regs["rsi"], regs["rip"]) == (frame.registers["rdi"], frame.registers["rsi"], SITE)
    assert regs["rax"] == regs["rsp"] == 0  # the tfile format has no "unavailable": zero
    live = amd64.hex_registers(frame.registers)  # the `g` reply while the frame is selected
    assert live[amd64.OFFSETS[0] * 2:amd64.OFFSETS[1] * 2] == "xx" * 8  # rax: unavailable
