"""Tracing on two CPUs: per-CPU rings merged in timestamp order, `$cpu_id`, `$cpu_number`, per-CPU variables.

The machine is not booted: `Machine.on_cpu(k, ...)` loads CPU k (its GS base at cpu_data[k], whose cpu_number is
k) and `Machine.call` then runs `kgtp_bench_loop` on it, so hits alternate between the CPUs deterministically.
Every engine and probe path (jump, int3, a shared address, a static marker, while-stepping) is driven the same way.
"""

from __future__ import annotations

import pytest

from kgtp_sim.agent.opcodes import assemble
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import Tracer
from kgtp_sim.tracing.core.builtins import BUILTIN_VARIABLES
from kgtp_sim.tracing.core.frames import TsvBlock
from kgtp_sim.tracing.core.percpu import PerCpuName, parse
from kgtp_sim.tracing.core.ring import merge_key

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)
SITE = IMAGE.address_of("kgtp_test_function")
MARKER = next(m for m in IMAGE.markers if m.name == "kgtp_module_event")
N = {b.name: b.number for b in BUILTIN_VARIABLES}
CPU_ID, CPU_NUMBER = N["cpu_id"], N["cpu_number"]
ENGINES = ("interp", "naive", "opt")
#: rdi, rsi and rip: the thesis' compact collection (the opt engine's short path)
THESIS = 0x30
USER = 60  # a user variable's number, after the built-in ones


def _machine(cpus: int = 2) -> Machine:
    machine = Machine(IMAGE, cpus=cpus)
    machine.call("kgtp_bench_loop", 0)
    return machine


def _define(tracer: Tracer, number: int, address: int, *actions, static: bool = False, condition=None,
            step: int = 0, stepping=()) -> None:
    tracer.definitions.define(t.DefineTracepoint(number=number, address=address, static=static, step_count=step,
                                                 condition=condition, more=True))
    tracer.definitions.add_actions(t.TracepointActions(number=number, address=address, actions=tuple(actions),
                                                       more=bool(stepping)))
    if stepping:
        tracer.definitions.add_actions(t.TracepointActions(number=number, address=address,
                                                           actions=tuple(stepping), stepping=True))


def _variable(tracer: Tracer, number: int, name: str, initial: int = 0) -> None:
    tracer.definitions.define_variable(t.DefineTraceVariable(number=number, value=initial, builtin=False, name=name))


def _alternate(machine: Machine, rounds: int, calls: int = 1, cpus=(0, 1)) -> None:
    for index in range(rounds):
        machine.on_cpu(cpus[index % len(cpus)], lambda uc: None)
        assert machine.call("kgtp_bench_loop", calls) == calls
    machine.on_cpu(0, lambda uc: None)


def _collect(*numbers: int) -> t.EvalExpression:
    return t.EvalExpression(assemble("; ".join(f"tracev {n:#x}" for n in numbers) + "; end"))


def _tsv(frame, number: int) -> int | None:
    return next((b.value for b in frame.blocks if isinstance(b, TsvBlock) and b.number == number), None)


PATHS = {
    "jump": lambda tr, *a: _define(tr, 1, SITE, *a),
    "int3": lambda tr, *a: _define(tr, 1, SITE, *a),
    "shared": lambda tr, *a: (_define(tr, 1, SITE, *a), _define(tr, 2, SITE, t.CollectRegisters(THESIS))),
    "marker": lambda tr, *a: _define(tr, 1, MARKER.site, *a, static=True),
    "stepping": lambda tr, *a: _define(tr, 1, SITE, *a, step=2, stepping=(_collect(CPU_ID),)),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("engine", ENGINES)
def test_frames_from_both_cpus_carry_their_cpu_and_cpu_id(engine, path):
    machine = _machine()
    tracer = Tracer(machine, engine, probe="int3" if path == "int3" else "auto")
    PATHS[path](tracer, t.CollectRegisters(THESIS), _collect(CPU_ID, CPU_NUMBER))
    tracer.start()
    _alternate(machine, 6, calls=2)
    frames, status = tracer.frames(), tracer.status()
    tracer.stop(t.StopReason.STOP_COMMAND)
    per_hit = {"shared": 2, "stepping": 3}.get(path, 1)
    assert len(frames) == status.frames == status.created == 12 * per_hit
    assert {f.cpu for f in frames} == {0, 1}
    for frame in frames:
        if _tsv(frame, CPU_ID) is not None:  # the hit's own frame and every step's
            assert _tsv(frame, CPU_ID) == frame.cpu, (engine, path, frame)
        if _tsv(frame, CPU_NUMBER) is not None:
            assert _tsv(frame, CPU_NUMBER) == 2
    # one trace: numbered in timestamp order across the CPUs; each CPU's frames in its creation order
    assert [f.number for f in frames] == list(range(len(frames)))
    assert [merge_key(f) for f in frames] == sorted(merge_key(f) for f in frames)
    for cpu in (0, 1):
        assert [f.sequence for f in frames if f.cpu == cpu] == list(range(6 * per_hit))
    # the rounds alternate CPUs: the merged order follows them
    hits = [f.cpu for f in frames if f.tracepoint == 1 and _tsv(f, CPU_NUMBER) is not None]
    assert hits == [0, 0, 1, 1] * 3


@pytest.mark.parametrize("engine", ENGINES)
def test_each_cpu_ring_wraps_on_its_own(engine):
    """QTBuffer:size is each CPU's ring (KGTP's per-CPU gtp_rb): CPU 0 laps its circular ring many times while
    CPU 1's few frames stay; qTStatus sums frames, created and free, and reports the size times the CPUs."""
    machine = _machine()
    tracer = Tracer(machine, engine)
    _define(tracer, 1, SITE, t.CollectRegisters(0xFFFF), _collect(CPU_ID))
    tracer.definitions.circular = True
    tracer.definitions.buffer_size = 0x2000
    tracer.start()
    _alternate(machine, 1, calls=3, cpus=(1,))
    _alternate(machine, 1, calls=200, cpus=(0,))
    frames, status = tracer.frames(), tracer.status()
    zero, one = tracer.ring[0].state(), tracer.ring[1].state()
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert (zero.size, one.size) == (0x2000, 0x2000) and status.buffer_size == 0x4000
    assert (one.created, one.frames, one.discards) == (3, 3, 0)
    assert zero.created == 200 and zero.frames < 200 and zero.discards > 0
    assert (status.created, status.frames) == (203, zero.frames + 3)
    assert status.buffer_free == zero.free + one.free
    assert [f.cpu for f in frames[:3]] == [1, 1, 1]  # CPU 1's frames are the oldest and still there
    assert all(_tsv(f, CPU_ID) == f.cpu for f in frames)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_full_linear_ring_stops_the_run_with_tfull(engine):
    machine = _machine()
    tracer = Tracer(machine, engine)
    _define(tracer, 1, SITE, t.CollectRegisters(0xFFFF))
    tracer.definitions.buffer_size = 0x2000
    tracer.start()
    _alternate(machine, 1, calls=2, cpus=(1,))
    _alternate(machine, 1, calls=100, cpus=(0,))
    status = tracer.status()
    assert not tracer.running and status.stop_reason is t.StopReason.BUFFER_FULL
    assert tracer.ring[1].state().frames == 2 and tracer.ring[0].state().full


def test_status_before_a_run_reports_every_cpus_buffer():
    tracer = Tracer(_machine(), "opt")
    tracer.definitions.buffer_size = 0x3000
    status = tracer.status()
    assert status.buffer_size == status.buffer_free == 0x6000


@pytest.mark.parametrize("engine", ENGINES)
def test_a_global_variable_counts_every_hit_of_every_cpu(engine):
    machine = _machine()
    tracer = Tracer(machine, engine)
    _variable(tracer, USER, "hits")
    count = assemble(f"getv {USER:#x}; const8 1; add; setv {USER:#x}; pop; end")
    _define(tracer, 1, SITE, t.EvalExpression(count))
    tracer.start()
    _alternate(machine, 10, calls=7)
    assert tracer.variable_value(USER) == 70
    native = [item.native is not None for item in tracer.probes.installed.values()]
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert native == [engine != "interp"]  # compiled engines count in compiled code


def test_instructions_per_hit_do_not_depend_on_the_cpu_count():
    """The short path picks its CPU's ring with one instruction more than one ring needed, the same on one CPU
    and on each of two."""
    counts = []
    for cpus, cpu in ((1, 0), (2, 0), (2, 1)):
        machine = _machine(cpus)
        machine.set_counting(True)
        tracer = Tracer(machine, "opt")
        _define(tracer, 1, SITE, t.CollectRegisters(THESIS))
        machine.on_cpu(cpu, lambda uc: None)
        machine.call("kgtp_bench_loop", 5)
        before = machine.instructions()
        machine.call("kgtp_bench_loop", 20)
        untraced = machine.instructions() - before
        tracer.start()
        machine.call("kgtp_bench_loop", 5)  # translate
        before = machine.instructions()
        machine.call("kgtp_bench_loop", 20)
        counts.append((machine.instructions() - before - untraced) / 20)
        assert {f.cpu for f in tracer.frames()} == {cpu}
        tracer.stop(t.StopReason.STOP_COMMAND)
    assert counts[0] == counts[1] == counts[2], counts


# ---- per-CPU trace state variables (KGTP's $p_ / $per_cpu_) ----------------------------------------------------


def test_kgtp_per_cpu_names():
    assert parse("p_hits") == PerCpuName("p_hits", None)
    assert parse("per_cpu_hits") == PerCpuName("per_cpu_hits", None)
    assert parse("p_hits1") == PerCpuName("p_hits", 1)
    assert parse("per_cpu_x12") == PerCpuName("per_cpu_x", 12)
    assert parse("p_7") == PerCpuName("p_7", None)  # the name keeps a character
    assert parse("hits") is None and parse("p_") is None and parse("pe_hits") is None


@pytest.mark.parametrize("engine", ENGINES)
def test_per_cpu_variables_count_each_cpu_and_name_another_cpus_copy(engine):
    """`$p_hits` counts on the hitting CPU's copy; `$p_hits0`/`$p_hits1` name CPU 0's and 1's copies, here read
    by every hit on either CPU; `$per_cpu_seen` the same through the longer prefix, starting at its CPU-1 copy's
    initial value (a copy takes an initial value only when its variable names the CPU, as KGTP)."""
    machine = _machine()
    tracer = Tracer(machine, engine)
    hits, zero, one, seen, seen1 = USER, USER + 1, USER + 2, USER + 3, USER + 4
    _variable(tracer, hits, "p_hits", initial=100)  # KGTP: uploaded, but no copy takes it
    _variable(tracer, zero, "p_hits0")
    _variable(tracer, one, "p_hits1", initial=1000)
    _variable(tracer, seen, "per_cpu_seen")
    _variable(tracer, seen1, "per_cpu_seen1", initial=50)
    program = assemble(f"getv {hits:#x}; const8 1; add; setv {hits:#x}; pop; "
                       f"getv {seen:#x}; const8 1; add; setv {seen:#x}; pop; "
                       f"tracev {hits:#x}; tracev {zero:#x}; tracev {one:#x}; tracev {CPU_ID:#x}; end")
    _define(tracer, 1, SITE, t.EvalExpression(program))
    tracer.start()
    _alternate(machine, 4, calls=3)  # 6 hits on each CPU
    frames = tracer.frames()
    values = {number: tracer.variable_value(number) for number in (zero, one)}
    copies = tracer.per_cpu.values("per_cpu_seen")
    compiled = [item.native is not None for item in tracer.probes.installed.values()]
    machine.on_cpu(1, lambda uc: None)
    local_on_one = tracer.variable_value(hits)  # GDB's qTV of the local form: the loaded CPU's copy
    machine.on_cpu(0, lambda uc: None)
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert compiled == [False]  # one variable's copies under three names: only the Python path sees them alias
    assert values == {zero: 6, one: 1006}
    assert copies == [6, 56]
    assert local_on_one == 1006 and tracer.variable_value(hits) == 6
    by_cpu = {0: [], 1: []}
    for frame in frames:
        by_cpu[_tsv(frame, CPU_ID)].append((_tsv(frame, hits), _tsv(frame, zero), _tsv(frame, one)))
    assert [h for h, _, _ in by_cpu[0]] == [1, 2, 3, 4, 5, 6]
    assert [h for h, _, _ in by_cpu[1]] == [1001 + i for i in range(6)]
    for h, z, o in by_cpu[0] + by_cpu[1]:  # the other CPU's copy, read by name
        assert z <= 6 and 1000 <= o <= 1006
    assert by_cpu[1][0][1] == 3  # CPU 1's first hit read CPU 0's copy after CPU 0's first three hits
    assert by_cpu[0][3][2] == 1003  # CPU 0's fourth hit read CPU 1's copy after its three


@pytest.mark.parametrize("engine", ENGINES)
def test_per_cpu_variables_run_natively_in_the_compiled_engines(engine):
    """Per-CPU variables of distinct names in a condition and an action: the compiled engines run the location
    natively (each hit loads the hitting CPU's copies and stores back the ones it wrote) and every engine gives
    the same frames and copies."""
    machine = _machine()
    tracer = Tracer(machine, engine)
    hits, seen, other = USER, USER + 1, USER + 2
    _variable(tracer, hits, "p_hits")
    _variable(tracer, seen, "per_cpu_seen")
    _variable(tracer, other, "p_other1", initial=7)  # CPU 1's copy, read on both CPUs
    condition = assemble(f"getv {hits:#x}; const8 100; less_signed; end")
    program = assemble(f"getv {hits:#x}; const8 1; add; setv {hits:#x}; pop; "
                       f"getv {seen:#x}; const8 2; add; setv {seen:#x}; pop; "
                       f"tracev {hits:#x}; tracev {other:#x}; tracev {CPU_ID:#x}; end")
    _define(tracer, 1, SITE, t.EvalExpression(program), condition=condition)
    tracer.start()
    _alternate(machine, 4, calls=3)  # 6 hits on each CPU
    native = [item.native is not None for item in tracer.probes.installed.values()]
    frames = tracer.frames()
    copies = {base: tracer.per_cpu.values(base) for base in ("p_hits", "per_cpu_seen", "p_other")}
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert native == [engine != "interp"]
    assert copies == {"p_hits": [6, 6], "per_cpu_seen": [12, 12], "p_other": [0, 7]}
    for cpu in (0, 1):
        mine = [frame for frame in frames if _tsv(frame, CPU_ID) == cpu]
        assert [_tsv(frame, hits) for frame in mine] == [1, 2, 3, 4, 5, 6]
        assert {_tsv(frame, other) for frame in mine} == {7}


def test_per_cpu_variable_of_a_missing_cpu_is_refused():
    tracer = Tracer(_machine(), "opt")
    tracer.check_variable("p_hits1")
    with pytest.raises(ValueError):
        tracer.check_variable("p_hits2")
    tracer.check_variable("hits2")  # an ordinary variable


def test_cpu_number_is_uploaded_as_the_cpu_count():
    tracer = Tracer(_machine(), "opt")
    assert tracer.definitions.variables[CPU_NUMBER].initial == 2
    assert tracer.variable_value(CPU_NUMBER) == 2
