"""KGTP's special variables under every engine: the same conditions and collections of the computed ones, run
through the interpreter and both compilers, give the same values (or, for clocks, values on the same clock).

Each run drives `kgtp_bench_loop(n)` through a tracepoint on `kgtp_test_function` with `machine.call`
(deterministic, no timer). The compiled engines refresh the slots they can compute in the detour; a location
reading one only Python computes runs on the Python hit path, which is checked too.
"""

from __future__ import annotations

import time

import pytest

from kgtp_sim.agent.opcodes import assemble
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import TraceError, Tracer
from kgtp_sim.tracing.core.builtins import (BUILTIN_VARIABLES, CPU_NUMBER, GTP_VERSION, PT_REGS_SIZE, KernelLayout,
                                       tsc_to_clock)
from kgtp_sim.tracing.core.frames import TsvBlock
from kgtp_sim.tracing.engines.installer import NATIVE_BUILTINS

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)
SITE = IMAGE.address_of("kgtp_test_function")
ENGINES = ("interp", "naive", "opt")
CALLS = 6
N = {b.name: b.number for b in BUILTIN_VARIABLES}

#: the computed variables the compiled engines refresh themselves
NATIVE = [name for name in NATIVE_BUILTINS]
#: the ones only Python computes: their tracepoints take the Python hit path in every engine
PYTHON = ["cooked_clock", "cooked_rdtsc", "xtime_sec", "xtime_nsec", "hardirq_count", "irq_count", "step_id",
          "step_count"]
#: what a watch tracepoint's hit or a watch-setting hit reads (test_watch.py)
WATCH = ["watch_type", "watch_size", "watch_start", "watch_stop", "watch_trace_num", "watch_trace_addr",
         "watch_addr", "watch_val", "watch_count", "watch_prev_val"]


def _collect(*names: str) -> bytes:
    return assemble("; ".join(f"tracev {N[name]:#x}" for name in names) + "; end")


#: a condition on the computed variables that holds on this machine
CONDITION = assemble(
    f"getv {N['cpu_id']:#x}; const8 0; equal; getv {N['cpu_number']:#x}; const8 {CPU_NUMBER:#x}; equal; bit_and; "
    f"getv {N['current_task_user']:#x}; log_not; bit_and; getv {N['clock']:#x}; const8 0; equal; log_not; bit_and; end")


def _run(engine: str, names: list[str], condition: bytes | None = CONDITION):
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    tracer = Tracer(machine, engine)
    tracer.definitions.define(t.DefineTracepoint(number=1, address=SITE, condition=condition, more=True))
    tracer.definitions.add_actions(t.TracepointActions(number=1, address=SITE, actions=(t.EvalExpression(
        _collect(*names)),)))
    tracer.start()
    native = [item.native is not None for item in tracer.probes.installed.values()]
    machine.call("kgtp_bench_loop", CALLS)
    frames = tracer.frames()
    tracer.stop(t.StopReason.STOP_COMMAND)
    values = [{b.number: b.value for b in frame.blocks if isinstance(b, TsvBlock)} for frame in frames]
    return machine, tracer, values, native


def _u64(value: int) -> int:
    return value & (2**64 - 1)


def test_numbers_have_no_gap():
    # GDB numbers a user variable after the count of those uploaded: a gap would reuse a special one's number
    assert sorted(b.number for b in BUILTIN_VARIABLES) == list(range(1, len(BUILTIN_VARIABLES) + 1))


def test_the_lists_cover_every_computed_variable():
    computed = {b.name for b in BUILTIN_VARIABLES if b.computed}
    assert computed == set(NATIVE) | set(PYTHON) | set(WATCH) | {"dump_stack"}


@pytest.mark.parametrize("engine", ENGINES)
def test_native_variables_agree_with_the_kernel_in_every_engine(engine):
    names = NATIVE
    machine, tracer, frames, native = _run(engine, names)
    assert native == [engine != "interp"]  # compiled engines ran them in the detour
    assert len(frames) == CALLS
    layout = KernelLayout.of(IMAGE)
    task = machine.current_task()
    base = layout.stack_base(task)
    expected = {
        "gtp_version": GTP_VERSION, "cpu_id": 0, "cpu_number": CPU_NUMBER, "current_task": task,
        "current_task_pid": int.from_bytes(machine.read_memory(task, 4), "little", signed=True),
        "current_thread_info": base, "current_task_user": 0, "softirq_count": 0, "inferior_pid": 0,
        "task_pt_regs": base + layout.thread_size - PT_REGS_SIZE,
    }
    for frame in frames:
        for name, value in expected.items():
            assert _u64(frame[N[name]]) == _u64(value), name
    rdtsc = [_u64(f[N["rdtsc"]]) for f in frames]
    clock = [_u64(f[N["clock"]]) for f in frames]
    assert rdtsc == sorted(rdtsc) and clock == sorted(clock) and len(set(clock)) == CALLS
    for ticks, ns in zip(rdtsc, clock):  # one formula in every engine: the clock of the TSC read beside it
        assert abs(ns - tsc_to_clock(tracer.tsc, ticks)) < 5_000_000, (ns, ticks)


def test_native_values_are_the_interpreters():
    deterministic = [n for n in NATIVE if n not in ("rdtsc", "clock")]
    runs = {engine: _run(engine, deterministic)[2] for engine in ENGINES}
    assert runs["interp"] == runs["naive"] == runs["opt"]


@pytest.mark.parametrize("engine", ENGINES)
def test_python_only_variables_take_the_python_path_in_every_engine(engine):
    before = time.time_ns()
    machine, tracer, frames, native = _run(engine, ["clock", "cooked_clock", "rdtsc", "cooked_rdtsc", "xtime_sec",
                                                    "xtime_nsec", "hardirq_count", "irq_count", "step_id",
                                                    "step_count"])
    after = time.time_ns()
    assert native == [False]
    assert len(frames) == CALLS
    for frame in frames:
        assert 0 <= frame[N["clock"]] - frame[N["cooked_clock"]]  # what tracing took is left out
        assert 0 <= _u64(frame[N["rdtsc"]]) - _u64(frame[N["cooked_rdtsc"]])
        wall = frame[N["xtime_sec"]] * 1_000_000_000 + frame[N["xtime_nsec"]]
        assert before <= wall <= after and 0 <= frame[N["xtime_nsec"]] < 1_000_000_000
        assert frame[N["hardirq_count"]] == frame[N["irq_count"]] == 0  # machine.call runs outside interrupts
        assert frame[N["step_count"]] == 0  # a hit, not a step
    costs = [f[N["clock"]] - f[N["cooked_clock"]] for f in frames]
    assert costs == sorted(costs) and costs[-1] > costs[0]  # each hit's handler time adds up
    assert [f[N["step_id"]] for f in frames] == list(range(1, CALLS + 1))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_run_reading_cooked_time_times_every_tracepoint(engine):
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    tracer = Tracer(machine, engine)
    caller = IMAGE.address_of("kgtp_bench_loop")
    tracer.definitions.define(t.DefineTracepoint(number=1, address=SITE, more=True))
    tracer.definitions.add_actions(t.TracepointActions(number=1, address=SITE, actions=(
        t.EvalExpression(_collect("cooked_clock")),)))
    tracer.definitions.define(t.DefineTracepoint(number=2, address=caller, more=True))
    tracer.definitions.add_actions(t.TracepointActions(number=2, address=caller, actions=(
        t.EvalExpression(_collect("cpu_id")),)))
    tracer.start()
    assert all(item.native is None for item in tracer.probes.installed.values())
    machine.call("kgtp_bench_loop", CALLS)
    assert tracer.kgtp.cost_ns() > 0
    tracer.stop(t.StopReason.STOP_COMMAND)


@pytest.mark.parametrize("engine", ENGINES)
def test_stepping_frames_carry_their_step_number_and_the_hits_step_id(engine):
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    tracer = Tracer(machine, engine)
    tracer.definitions.define(t.DefineTracepoint(number=1, address=SITE, step_count=2, more=True))
    collect = t.EvalExpression(_collect("step_id", "step_count"))
    tracer.definitions.add_actions(t.TracepointActions(number=1, address=SITE, actions=(collect,), more=True))
    tracer.definitions.add_actions(t.TracepointActions(number=1, address=SITE, actions=(collect,), stepping=True))
    tracer.start()
    machine.call("kgtp_bench_loop", 3)
    frames = tracer.frames()
    tracer.stop(t.StopReason.STOP_COMMAND)
    seen = [tuple(b.value for b in f.blocks if isinstance(b, TsvBlock)) for f in frames]
    assert seen[:6] == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)], seen


@pytest.mark.parametrize("code, text", [
    (f"const8 1; setv {N['clock']:#x}; end", "$clock cannot be set by a tracepoint"),
    (f"getv {N['ignore_error']:#x}; end", "$ignore_error cannot be read by a tracepoint"),
    (f"getv {N['last_errno']:#x}; end", "$last_errno cannot be read by a tracepoint"),
    (f"const8 1; setv {N['kret']:#x}; end", "$kret cannot be set in a condition"),
    (f"getv {N['watch_val']:#x}; end", "variable watch_val is read only by a watch tracepoint"),
])
def test_what_kgtp_refuses_in_an_action_fails_tstart(code, text):
    machine = Machine(IMAGE)
    tracer = Tracer(machine, "opt")
    tracer.definitions.define(t.DefineTracepoint(number=1, address=SITE, condition=assemble(code)))
    with pytest.raises(TraceError, match=text.replace("$", r"\$").replace("(", r"\(").replace(")", r"\)")):
        tracer.start()
    assert not tracer.running


@pytest.mark.parametrize("engine", ENGINES)
def test_ignore_error_leaves_out_what_cannot_be_installed_and_sets_last_errno(engine):
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    tracer = Tracer(machine, engine)
    tracer.definitions.define_variable(t.DefineTraceVariable(number=N["ignore_error"], value=1, builtin=True,
                                                             name="ignore_error"))
    tracer.definitions.define(t.DefineTracepoint(number=1, address=SITE + 1))  # inside an instruction
    tracer.definitions.define(t.DefineTracepoint(number=2, address=SITE))
    tracer.start()
    assert tracer.running and list(tracer.probes.installed) == [(2, SITE)]
    assert tracer.variable_value(N["last_errno"]) == -22  # -EINVAL, as KGTP records it
    machine.call("kgtp_bench_loop", 3)
    assert len(tracer.frames()) == 3
    tracer.stop(t.StopReason.STOP_COMMAND)
    # without it tstart fails and nothing goes in
    tracer.definitions.define_variable(t.DefineTraceVariable(number=N["ignore_error"], value=0, builtin=True,
                                                             name="ignore_error"))
    with pytest.raises(TraceError, match="middle of an instruction"):
        tracer.start()
    assert not tracer.running


def test_gdb_reads_live_values_settings_and_unknowns_as_kgtp_answers():
    machine = Machine(IMAGE)
    tracer = Tracer(machine, "opt")
    assert tracer.variable_value(N["gtp_version"]) == GTP_VERSION
    assert tracer.variable_value(N["cpu_number"]) == 1 and tracer.variable_value(N["cpu_id"]) == 0
    assert tracer.variable_value(N["bt"]) == 512 and tracer.variable_value(N["ignore_error"]) == 0
    assert tracer.variable_value(N["clock"]) < tracer.variable_value(N["clock"])
    assert abs(tracer.variable_value(N["xtime_sec"]) - time.time()) < 5
    for name in ("current_task", "cooked_clock", "printk_tmp", "watch_val", "kret", "step_id"):
        assert tracer.variable_value(N[name]) is None, name  # KGTP has no GDB-side value for these
    # settings follow `tvariable`; variables KGTP gives GDB no way to set keep their value
    tracer.definitions.define_variable(t.DefineTraceVariable(number=N["bt"], value=1024, builtin=True, name="bt"))
    tracer.definitions.define_variable(t.DefineTraceVariable(number=N["gtp_version"], value=7, builtin=True,
                                                             name="gtp_version"))
    assert tracer.variable_value(N["bt"]) == 1024 and tracer.variable_value(N["gtp_version"]) == GTP_VERSION
