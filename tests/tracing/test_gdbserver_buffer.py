"""The gdbserver role's tracer (`Tracer(..., gdbserver=True)`): gdbserver's one trace buffer and its predefined
`$trace_timestamp` (gdbserver/tracepoint.cc), in every engine, with KGTP mode's tracer left as it was.

The machine is not booted: `Machine.on_cpu(k, ...)` loads CPU k and `Machine.call` runs `kgtp_bench_loop` on it
(tests/tracing/test_smp_tracing.py's way), so the hits of a kernel tracepoint come from the CPUs chosen, in order.
"""

from __future__ import annotations

import pytest

from kgtp_sim.agent.opcodes import assemble
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import TraceError, Tracer
from kgtp_sim.tracing.core.builtins import BUILTIN_VARIABLES
from kgtp_sim.tracing.core.frames import TsvBlock
from kgtp_sim.tracing.core.model import DEFAULT_BUFFER_SIZE
from kgtp_sim.tracing.core.predefined import TRACE_TIMESTAMP, steady_clock_us
from kgtp_sim.tracing.core.ring import BLOCKS_AT

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)
SITE = IMAGE.address_of("kgtp_test_function")
ENGINES = ("interp", "naive", "opt")
#: the number after KGTP's variables: gdbserver's `$trace_timestamp` in the role, a user's variable in KGTP mode
AFTER_KGTP = max(b.number for b in BUILTIN_VARIABLES) + 1
REGISTERS = t.CollectRegisters(0xFFFF)


def _machine(cpus: int = 2) -> Machine:
    machine = Machine(IMAGE, cpus=cpus)
    machine.call("kgtp_bench_loop", 0)
    return machine


def _define(tracer: Tracer, *actions) -> None:
    tracer.definitions.define(t.DefineTracepoint(number=1, address=SITE, more=True))
    tracer.definitions.add_actions(t.TracepointActions(number=1, address=SITE, actions=tuple(actions)))


def _run(machine: Machine, calls_per_cpu: list[tuple[int, int]]) -> None:
    for cpu, calls in calls_per_cpu:
        machine.on_cpu(cpu, lambda uc: None)
        assert machine.call("kgtp_bench_loop", calls) == calls
    machine.on_cpu(0, lambda uc: None)


def _expression(source: str) -> t.EvalExpression:
    return t.EvalExpression(assemble(source))


def _tsv(frame, number: int) -> int | None:
    return next((b.value for b in frame.blocks if isinstance(b, TsvBlock) and b.number == number), None)


def _timestamp_number(tracer: Tracer) -> int:
    return next(v.number for v in tracer.definitions.variables.values() if v.name == TRACE_TIMESTAMP)


# ---- the buffer ---------------------------------------------------------------------------------------------------


def test_the_size_gdb_sets_is_the_size_tstatus_reports_and_minus_one_is_five_mib():
    """cmd_bigqtbuffer_size takes any size, `-1` the default; qTStatus's tsize is it, whatever the CPUs."""
    tracer = Tracer(_machine(), "opt", gdbserver=True)
    status = tracer.status()
    assert status.buffer_size == status.buffer_free == DEFAULT_BUFFER_SIZE  # not 5 MiB per CPU
    for size in (4, 100, 0x12345):
        tracer.set_buffer_size(size)
        status = tracer.status()
        assert status.buffer_size == status.buffer_free == size
    tracer.set_buffer_size(None)
    assert tracer.status().buffer_size == DEFAULT_BUFFER_SIZE


def test_kgtp_mode_keeps_a_ring_of_that_size_per_cpu_and_refuses_a_few_bytes():
    tracer = Tracer(_machine(), "opt")
    tracer.set_buffer_size(0x2004)
    assert tracer.status().buffer_size == 2 * 0x2000
    with pytest.raises(TraceError):
        tracer.set_buffer_size(4)
    assert not any(v.name == TRACE_TIMESTAMP for v in tracer.definitions.variables.values())


@pytest.mark.parametrize("engine", ENGINES)
def test_every_cpu_writes_the_one_buffer_until_it_is_full(engine):
    """A linear buffer of 0x1000 bytes, frames of both CPUs: they go into it in the order they were made, each
    naming its CPU, until the next does not fit: the run stops full, tfree what the frames left."""
    machine = _machine()
    tracer = Tracer(machine, engine, gdbserver=True)
    _define(tracer, REGISTERS)
    tracer.set_buffer_size(0x1000)
    tracer.start()
    _run(machine, [(1, 2), (0, 2), (1, 40)])
    frames, status = tracer.frames(), tracer.status()
    assert not tracer.running and status.stop_reason is t.StopReason.BUFFER_FULL
    assert 4 < len(frames) == status.frames < 44 and status.buffer_size == 0x1000
    assert [f.cpu for f in frames[:4]] == [1, 1, 0, 0] and {f.cpu for f in frames[4:]} == {1}
    assert [f.sequence for f in frames] == list(range(len(frames)))  # the buffer's count, not a CPU's
    used = 0x1000 - status.buffer_free  # tfree: what the frames left, less than the next one needed
    need = used // len(frames)
    assert used == len(frames) * need and status.buffer_free < need and need % 8 == 0 and need > BLOCKS_AT


@pytest.mark.parametrize("engine", ENGINES)
def test_a_circular_buffer_wraps_and_keeps_the_latest_frames_of_every_cpu(engine):
    machine = _machine()
    tracer = Tracer(machine, engine, gdbserver=True)
    _define(tracer, REGISTERS)
    tracer.set_buffer_size(0x1000)
    tracer.set_circular(True)
    tracer.start()
    _run(machine, [(0, 30), (1, 30)])
    frames, status = tracer.frames(), tracer.status()
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert status.running and status.created == 60 and 0 < status.frames == len(frames) < 30
    assert [f.sequence for f in frames] == list(range(60 - len(frames), 60))  # the latest, in order
    assert {f.cpu for f in frames} == {1}
    assert 0 <= status.buffer_free < 0x1000 and status.buffer_size == 0x1000


@pytest.mark.parametrize("circular", [False, True], ids=["linear", "circular"])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_buffer_too_small_for_any_frame_stops_the_run_full_at_the_first_hit(engine, circular):
    """GDB's `set trace-buffer-size 4` (trace-buffer-size.exp): gdbserver cannot even allocate the first frame
    and stops, full, in either buffer mode; tstatus keeps reporting 4 bytes, all free."""
    machine = _machine()
    tracer = Tracer(machine, engine, gdbserver=True)
    _define(tracer, t.CollectMemory(-1, IMAGE.address_of("kgtp_counter"), 4))
    tracer.set_buffer_size(4)
    tracer.set_circular(circular)
    tracer.start()
    _run(machine, [(0, 3)])
    status = tracer.status()
    assert not tracer.running and status.stop_reason is t.StopReason.BUFFER_FULL
    assert (status.frames, status.buffer_size, status.buffer_free) == (0, 4, 4)


def test_a_new_size_is_refused_during_a_run_and_afterwards_empties_the_buffer():
    machine = _machine(1)
    tracer = Tracer(machine, "opt", gdbserver=True)
    _define(tracer, REGISTERS)
    tracer.start()
    _run(machine, [(0, 3)])
    with pytest.raises(TraceError, match="while a trace is running"):
        tracer.set_buffer_size(0x2000)
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert len(tracer.frames()) == 3
    assert tracer.set_buffer_size(0x2000) is True  # init_trace_buffer: gdbserver's frames are gone
    status = tracer.status()
    assert tracer.frames() == [] and (status.frames, status.created) == (0, 0)
    assert status.stop_reason is t.StopReason.STOP_COMMAND and status.buffer_free == 0x2000
    tracer.start()  # the next run has the new size
    _run(machine, [(0, 2)])
    assert len(tracer.frames()) == 2 and tracer.ring[0].state().size == 0x2000


# ---- $trace_timestamp -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_trace_timestamp_is_the_steady_clock_at_each_hit_and_an_assignment_does_not_stick(engine):
    """`collect $trace_timestamp` (tracev) records gdbserver's get_timestamp at the hit, growing from frame to
    frame; `teval $trace_timestamp = 7` is taken and changes nothing (the getter answers every read)."""
    machine = _machine()
    tracer = Tracer(machine, engine, gdbserver=True)
    number = _timestamp_number(tracer)
    assert number == AFTER_KGTP
    _define(tracer, _expression(f"const8 7; setv {number:#x}; pop; end"), _expression(f"tracev {number:#x}; end"))
    assert tracer.variable_value(number) is None  # qTV before the first run: unknown (cmd_qtv)
    before = steady_clock_us()
    tracer.start()
    _run(machine, [(0, 3), (1, 3)])
    after = steady_clock_us()
    frames = tracer.frames()
    tracer.stop(t.StopReason.STOP_COMMAND)
    stamps = [_tsv(frame, number) for frame in frames]
    assert len(stamps) == 6 and before <= stamps[0] and stamps == sorted(set(stamps)) and stamps[-1] <= after
    assert before <= tracer.variable_value(number)  # after the run: the clock, live
    assert all(item.native is None for item in tracer.probes.installed.values())  # its getter is Python's


def test_trace_timestamp_is_uploaded_as_a_builtin_and_gdbs_initial_value_is_kept():
    tracer = Tracer(_machine(1), "opt", gdbserver=True)
    number = _timestamp_number(tracer)
    variable = tracer.definitions.variables[number]
    assert (variable.initial, variable.builtin) == (0, True)
    tracer.definitions.define_variable(t.DefineTraceVariable(number=number, value=5, builtin=True,
                                                             name=TRACE_TIMESTAMP))  # tvariable ... = 5, tstart
    tracer.definitions.clear_tracepoints()  # QTinit keeps built-in variables
    assert tracer.definitions.variables[number].initial == 5


def test_in_kgtp_mode_that_number_is_an_ordinary_user_variable():
    machine = _machine(1)
    tracer = Tracer(machine, "opt")
    tracer.definitions.define_variable(t.DefineTraceVariable(number=AFTER_KGTP, value=7, builtin=False, name="x"))
    _define(tracer, _expression(f"getv {AFTER_KGTP:#x}; const8 1; add; setv {AFTER_KGTP:#x}; pop; "
                                f"tracev {AFTER_KGTP:#x}; end"))
    tracer.start()
    _run(machine, [(0, 3)])
    frames = tracer.frames()
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert [_tsv(frame, AFTER_KGTP) for frame in frames] == [8, 9, 10]
