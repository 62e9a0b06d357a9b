"""One trace-variable store: every engine and every probe path reads and writes the same `$hits`.

The scenario: `teval $hits = $hits + 1` and `collect $hits` at kgtp_test_function, beside whatever makes the
location take another path (a second tracepoint at the same address, an int3, a static marker, while-stepping,
a passcount). Under interp, naive and opt alike the frames must read 1, 2, 3... and the variable's value after
the run must be the number of hits: the compiled code, the Python hit path and `qTV` share one store.
"""

from __future__ import annotations

import pytest

from kgtp_sim.agent.opcodes import assemble
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing.core.builtins import BUILTIN_VARIABLES
from kgtp_sim.tracing import Tracer
from kgtp_sim.arch import amd64
from kgtp_sim.tracing.core.frames import TsvBlock
from kgtp_sim.tracing.engines.native import sdata_in_place
from kgtp_sim.tracing.core.sdata import build_entry

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)
SITE = IMAGE.address_of("kgtp_test_function")
MARKER = next(m for m in IMAGE.markers if m.name == "kgtp_module_event")
HITS = max(b.number for b in BUILTIN_VARIABLES) + 1  # the first number GDB gives a user variable after them
CALLS = 12
# GDB 13's bytecode for `teval $hits = $hits + 1` and `collect $hits` (tests/agent/data/gdb13_corpus.json)
INCREMENT = assemble(f"getv {HITS}; const8 1; add; ext 64; setv {HITS}; pop; end")
COLLECT = assemble(f"getv {HITS}; tracev {HITS}; pop; end")
NEVER = assemble("reg 5; const8 0; less_signed; end")  # counter1 < 0


def _x(code: bytes) -> bytes:
    return b"X%x,%s" % (len(code), code.hex().encode())


def _define(tracer: Tracer, number: int, address: int, actions: bytes, *, static=False, step=0, passcount=0,
            condition: bytes | None = None, stepping: bytes = b"") -> None:
    cond = b":" + _x(condition) if condition else b""
    flags = b":S" if static else b""
    tracer.definitions.define(t.DefineTracepoint.parse(b"%x:%x:E:%x:%x%s%s-" % (number, address, step, passcount,
                                                                              flags, cond)))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"%x:%x:%s%s" % (number, address, actions,
                                                                              b"-" if stepping else b"")))
    if stepping:
        tracer.definitions.add_actions(t.TracepointActions.parse(b"%x:%x:S%s" % (number, address, stepping)))


def _counting(tracer: Tracer, number: int = 1, address: int = SITE, **kw) -> None:
    _define(tracer, number, address, _x(INCREMENT) + _x(COLLECT), **kw)


PATHS = {
    "jump": lambda tr: _counting(tr),
    "int3": lambda tr: _counting(tr),
    "shared": lambda tr: (_counting(tr), _define(tr, 2, SITE, b"M-1,%x,4" % IMAGE.address_of("kgtp_counter"),
                                                 condition=NEVER)),
    "marker": lambda tr: _counting(tr, address=MARKER.site, static=True),
    "stepping": lambda tr: _counting(tr, step=2, stepping=b"R01"),
    "passcount": lambda tr: _counting(tr, passcount=5),
}


def _run(engine: str, path: str):
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    tracer = Tracer(machine, engine, probe="int3" if path == "int3" else "auto")
    tracer.definitions.define_variable(t.DefineTraceVariable(number=HITS, value=0, name="hits"))
    PATHS[path](tracer)
    tracer.start()
    machine.call("kgtp_bench_loop", CALLS)
    frames = tracer.frames()
    value_during = tracer.variable_value(HITS)
    tracer.stop(t.StopReason.STOP_COMMAND)
    collected = [b.value for f in frames if f.tracepoint == 1 for b in f.blocks if isinstance(b, TsvBlock)]
    return collected, value_during, tracer.variable_value(HITS)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("engine", ["interp", "naive", "opt"])
def test_hits_count_one_two_three_on_every_path(engine, path):
    collected, during, after = _run(engine, path)
    hits = 5 if path == "passcount" else CALLS
    assert collected == list(range(1, hits + 1)), (engine, path)
    assert during == after == hits, (engine, path)



REGISTER_MARKERS = [m.name for m in IMAGE.markers if sdata_in_place(m) is not None]


def test_some_markers_are_built_in_place_and_some_by_the_hypercall():
    assert "kgtp_module_event" in REGISTER_MARKERS and len(REGISTER_MARKERS) < len(IMAGE.markers)


@pytest.mark.parametrize("engine", ["naive", "opt"])
@pytest.mark.parametrize("marker", REGISTER_MARKERS)
def test_sdata_built_in_place_is_the_entry_of_the_hit_registers(engine, marker):
    """`collect $_sdata` in generated code: each frame's entry is what the interpreter's builder makes from the
    same hit's registers (collected beside it), at every marker whose fields are register values."""
    import time

    found = next(m for m in IMAGE.markers if m.name == marker)
    machine = Machine(IMAGE, hz=1000)
    tracer = Tracer(machine, engine)
    _define(tracer, 1, found.site, b"RffffffL", static=True)
    tracer.start()
    machine.start()
    try:
        deadline = time.monotonic() + 60
        while tracer.status().created < 5:  # the kernel's own activity reaches every marker
            assert time.monotonic() < deadline, marker
            time.sleep(0.01)
        tracer.stop(t.StopReason.STOP_COMMAND)
    finally:
        machine.shutdown()
    for frame in tracer.frames():
        regs = frame.registers
        ordered = [regs[r.name] for r in amd64.GENERAL_REGISTERS]
        assert frame.static_data() == build_entry(found, ordered, lambda a, n: None), (marker, frame.number)


@pytest.mark.parametrize("engine", ["interp", "naive", "opt"])
def test_sdata_at_the_benchmark_marker_counts_along(engine):
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    tracer = Tracer(machine, engine)
    _define(tracer, 1, MARKER.site, b"L", static=True)
    tracer.start()
    machine.call("kgtp_bench_loop", 4)
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert [tracer.rendered_sdata(f) for f in tracer.frames()] == [
        f"counter1={n + 1} counter2={n}" for n in range(4)]


@pytest.mark.parametrize("marker", REGISTER_MARKERS)
def test_sdata_on_the_short_path_is_the_full_paths_at_every_register_marker(marker):
    """Two tracepoints at one marker, one hit: `collect $regs, $_sdata` takes the optimizing engine's full path,
    `collect $_sdata` alone its short path; their entries must be the same at every hit."""
    import time

    found = next(m for m in IMAGE.markers if m.name == marker)
    machine = Machine(IMAGE, hz=1000)
    tracer = Tracer(machine, "opt")
    _define(tracer, 1, found.site, b"RffffffL", static=True)
    _define(tracer, 2, found.site, b"L", static=True)
    tracer.start()
    machine.start()
    try:
        deadline = time.monotonic() + 60
        while tracer.status().created < 10:
            assert time.monotonic() < deadline, marker
            time.sleep(0.01)
        tracer.stop(t.StopReason.STOP_COMMAND)
    finally:
        machine.shutdown()
    full = [f.static_data() for f in tracer.frames() if f.tracepoint == 1]
    short = [f.static_data() for f in tracer.frames() if f.tracepoint == 2]
    assert full and short and full[:len(short)] == short[:len(full)], marker
    assert all(f.registers is None for f in tracer.frames() if f.tracepoint == 2)
