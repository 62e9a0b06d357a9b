"""Several tracepoints at one address run compiled, one detour after the other (kprobes' aggregated probes).

The compiled engines chain the detours of the tracepoints sharing an address: the site jumps into the first, each
ends by jumping through its link to the next, the last to the displaced instructions. Frames come in definition
order at each hit; a location leaves or joins the chain during a run by one rewritten link; the kernel's bytes
are restored when the last one goes. The interpreting engine and while-stepping keep one int3 in Python.
"""

from __future__ import annotations

import pytest

from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import Tracer

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)
SITE = IMAGE.address_of("kgtp_test_function")
COUNTER = IMAGE.address_of("kgtp_counter")


def _tracer(engine: str, *numbers: int, step: int = 0) -> tuple[Machine, Tracer]:
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    tracer = Tracer(machine, engine)
    for number in numbers:
        steps = step if number == numbers[-1] else 0
        tracer.definitions.define(t.DefineTracepoint.parse(b"%x:%x:E:%x:0-" % (number, SITE, steps)))
        tracer.definitions.add_actions(t.TracepointActions.parse(b"%x:%x:M-1,%x,4%s" % (
            number, SITE, COUNTER, b"-" if steps else b"")))
        if steps:
            tracer.definitions.add_actions(t.TracepointActions.parse(b"%x:%x:SR01" % (number, SITE)))
    return machine, tracer


def _counters(frames) -> list[tuple[int, int]]:
    return [(f.tracepoint, int.from_bytes(f.blocks[0].data, "little")) for f in frames if f.blocks]


@pytest.mark.parametrize("engine", ["naive", "opt"])
def test_tracepoints_at_one_address_run_compiled_in_order(engine):
    machine, tracer = _tracer(engine, 1, 2, 3)
    tracer.start()
    kinds = {row.number: row.kind for row in tracer.probe_rows()}
    machine.call("kgtp_bench_loop", 4)
    frames = tracer.frames()
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert kinds == {1: "jump", 2: "jump", 3: "jump"}  # one jump for all, no int3 into Python
    assert [tp for tp, _ in _counters(frames)] == [1, 2, 3] * 4
    values = [v for _, v in _counters(frames)]
    assert values == [v for v in values[::3] for _ in range(3)]  # the three saw the same hit
    assert machine.read_memory(SITE, 8) == IMAGE.read_code(SITE, 8)
    assert [r.hits for r in tracer.probe_rows()] == [4, 4, 4]


@pytest.mark.parametrize("engine", ["naive", "opt"])
def test_a_chained_location_leaves_and_joins_during_a_run(engine):
    machine, tracer = _tracer(engine, 1, 2, 3)
    tracer.start()
    machine.call("kgtp_bench_loop", 1)
    tracer.disarm((2, SITE))  # the middle one
    machine.call("kgtp_bench_loop", 1)
    tracer.disarm((1, SITE))  # the head
    machine.call("kgtp_bench_loop", 1)
    tracer.arm(tracer.definitions.tracepoints[(1, SITE)])  # joins again, now last
    machine.call("kgtp_bench_loop", 1)
    order = [tp for tp, _ in _counters(tracer.frames())]
    tracer.disarm((3, SITE))
    tracer.disarm((1, SITE))  # the chain is empty: the kernel's bytes come back
    restored = machine.read_memory(SITE, 8)
    machine.call("kgtp_bench_loop", 1)
    after = len(tracer.frames())
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert order == [1, 2, 3, 1, 3, 3, 3, 1]
    assert restored == IMAGE.read_code(SITE, 8) and after == len(order)


def test_a_location_needing_python_takes_its_address_with_it():
    """While-stepping single-steps in Python: every tracepoint at its address shares the int3 there."""
    machine, tracer = _tracer("opt", 1, 2, step=1)
    tracer.start()
    kinds = {row.number: row.kind for row in tracer.probe_rows()}
    machine.call("kgtp_bench_loop", 2)
    frames = tracer.frames()
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert kinds == {1: "int3", 2: "int3"}
    assert [f.tracepoint for f in frames] == [1, 2, 2, 1, 2, 2]  # the hit of each, then tracepoint 2's step


@pytest.mark.parametrize("stepping", [False, True], ids=["compiled", "while-stepping"])
@pytest.mark.parametrize("engine", ["naive", "opt"])
def test_a_tracepoint_added_during_a_run_joins_the_one_compiled_alone_there(engine, stepping):
    """The lone compiled probe becomes the head of a chain, the newcomer after it; or, when the newcomer steps
    (Python), both share the int3. Either way the first's counts go on from its own detour's, every later hit
    collects both in order, and the kernel's bytes come back when both leave."""
    machine, tracer = _tracer(engine, 1)
    tracer.start()
    machine.call("kgtp_bench_loop", 2)
    assert [row.kind for row in tracer.probe_rows()] == ["jump"]
    tracer.definitions.define(t.DefineTracepoint.parse(b"2:%x:E:%x:0-" % (SITE, 1 if stepping else 0)))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"2:%x:M-1,%x,4%s" % (SITE, COUNTER,
                                                                                 b"-" if stepping else b"")))
    if stepping:
        tracer.definitions.add_actions(t.TracepointActions.parse(b"2:%x:SR01" % SITE))
    tracer.arm(tracer.definitions.tracepoints[(2, SITE)])
    kinds = [row.kind for row in tracer.probe_rows()]
    machine.call("kgtp_bench_loop", 3)
    rows = [(row.number, row.hits) for row in tracer.probe_rows()]
    frames = tracer.frames()
    tracer.disarm((1, SITE))
    tracer.disarm((2, SITE))
    restored = machine.read_memory(SITE, 8)
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert kinds == (["int3", "int3"] if stepping else ["jump", "jump"])
    assert rows == [(1, 5), (2, 3)]
    order = [f.tracepoint for f in frames]
    assert order == [1, 1] + ([1, 2, 2] * 3 if stepping else [1, 2] * 3)  # (a stepping hit: its step's frame too)
    values = [v for _, v in _counters([f for f in frames if f.tracepoint == 1])]
    assert values == sorted(set(values)) and len(values) == 5  # every call seen once by the first
    assert restored == IMAGE.read_code(SITE, 8)


@pytest.mark.parametrize("engine", ["naive", "opt"])
@pytest.mark.parametrize("stopping", ["full", "passcount"])
def test_a_hit_that_ends_the_run_goes_on_through_the_rest_of_its_chain(engine, stopping):
    """The head's detour ends the run from its slow path (a full linear buffer, its pass count), which removes
    every probe; the same hit then runs the next detour of the chain, whose own slow path (the buffer still full)
    must still reach the tracer: its hypercall int3 once went to the kernel instead (`Kernel panic - not syncing:
    int3`)."""
    machine, tracer = _tracer(engine, 1, 2)
    if stopping == "full":  # the head's frames take more room: the buffer fills at its hit
        tracer.definitions.buffer_size = 0x1000
        tracer.definitions.add_actions(t.TracepointActions.parse(b"1:%x:R01ffff" % SITE))
    else:
        tracer.definitions.tracepoints[(1, SITE)].pass_count = 3
        tracer.definitions.tracepoints[(2, SITE)].pass_count = 3
    tracer.start()
    assert machine.call("kgtp_bench_loop", 1000) == 1000
    assert not tracer.running
    assert tracer.status().stop_reason is (t.StopReason.BUFFER_FULL if stopping == "full" else
                                           t.StopReason.PASSCOUNT)
    assert "panic" not in machine.console_text().lower()
    assert machine.read_memory(SITE, 8) == IMAGE.read_code(SITE, 8)
    machine.call("kgtp_bench_loop", 5)  # the kernel goes on without the probes
    tracer.start()  # the next run's own hypercalls, none left over from the last
    machine.call("kgtp_bench_loop", 2)
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert "panic" not in machine.console_text().lower()


@pytest.mark.parametrize("engine", ["naive", "opt"])
def test_a_stepping_tracepoint_added_during_a_run_takes_a_chain_to_python(engine):
    """A chain of two compiled detours, then a while-stepping tracepoint at their address: all three share the
    int3, in the order they came, the chained ones' counts going on."""
    machine, tracer = _tracer(engine, 1, 3)
    tracer.start()
    machine.call("kgtp_bench_loop", 1)
    tracer.definitions.define(t.DefineTracepoint.parse(b"2:%x:E:1:0-" % SITE))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"2:%x:M-1,%x,4-" % (SITE, COUNTER)))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"2:%x:SR01" % SITE))
    tracer.arm(tracer.definitions.tracepoints[(2, SITE)])
    kinds = [row.kind for row in tracer.probe_rows()]
    machine.call("kgtp_bench_loop", 2)
    rows = [(row.number, row.hits) for row in tracer.probe_rows()]
    order = [f.tracepoint for f in tracer.frames()]
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert kinds == ["int3", "int3", "int3"]
    assert sorted(rows) == [(1, 3), (2, 2), (3, 3)]
    assert order == [1, 3] + [1, 3, 2, 2] * 2
    assert machine.read_memory(SITE, 8) == IMAGE.read_code(SITE, 8)
