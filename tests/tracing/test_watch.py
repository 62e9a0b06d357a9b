"""KGTP's watch tracepoints (tracing/kgtp/watch.py) driven through the Tracer, in every engine.

`kgtp_bench_loop(n)` calls `kgtp_test_function` n times, whose first instruction is `addl $1, kgtp_counter(%rip)`
(7 bytes); `Machine.call` runs it deterministically (no timer). Actions are the bytecode GDB sends for
`teval $watch_static=1` (`const8 1; setv 32; end`) and `collect $watch_val` (`tracev 42`).
"""

from __future__ import annotations

import pytest

from kgtp_sim.agent.opcodes import assemble
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import TraceError, Tracer
from kgtp_sim.tracing.core.builtins import BUILTIN_VARIABLES
from kgtp_sim.tracing.core.frames import MemoryBlock, TsvBlock

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)
N = {b.name: b.number for b in BUILTIN_VARIABLES}
ENGINES = ("interp", "naive", "opt")
MASK = 2**64 - 1
COUNTER = IMAGE.address_of("kgtp_counter")
FUNCTION = IMAGE.address_of("kgtp_test_function")
AFTER_ADD = FUNCTION + 7
LOOP = IMAGE.address_of("kgtp_bench_loop")
LOOP_BODY = LOOP + 0x10  # `lea 0x1(%rdx),%edi`: once per iteration
LOOP_RET = LOOP + 0x23  # the `ret` after the loop
JIFFIES = IMAGE.address_of("jiffies")
DYNAMIC = 1  # `trace *1`: the address only names the dynamic watch
EBUSY = -16
VALUES = ("watch_val", "watch_prev_val", "watch_count", "watch_addr", "watch_type", "watch_size",
          "watch_trace_num", "watch_trace_addr")


def _setv(name: str, value: int) -> t.EvalExpression:
    return t.EvalExpression(assemble(f"const64 {value & MASK:#x}; setv {N[name]:#x}; end"))


def _collect(*names: str) -> t.EvalExpression:
    return t.EvalExpression(assemble("; ".join(f"tracev {N[name]:#x}" for name in names) + "; end"))


def _static(kind: int = 1, size: int = 4) -> tuple[t.EvalExpression, ...]:
    return (t.EvalExpression(bytes.fromhex("22012d002027")), _setv("watch_type", kind), _setv("watch_size", size))


def _tracer(engine: str) -> tuple[Machine, Tracer]:
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 1)
    return machine, Tracer(machine, engine)


def _define(tracer: Tracer, number: int, address: int, *actions, condition: bytes | None = None,
            pass_count: int = 0) -> None:
    tracer.definitions.define(t.DefineTracepoint(number=number, address=address, condition=condition,
                                                 pass_count=pass_count, more=bool(actions)))
    if actions:
        tracer.definitions.add_actions(t.TracepointActions(number=number, address=address, actions=actions))


def _frames(tracer: Tracer) -> list[tuple[int, dict[str, int], int | None]]:
    """(tracepoint, variables by name, rip if registers were collected) of every frame."""
    out = []
    for frame in tracer.frames():
        values = {BUILTIN_VARIABLES.by_number(b.number).name: b.value & MASK
                  for b in frame.blocks if isinstance(b, TsvBlock)}
        registers = frame.registers
        out.append((frame.tracepoint, values, registers["rip"] if registers else None))
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_a_static_watch_records_each_write_after_it(engine):
    machine, tracer = _tracer(engine)
    _define(tracer, 1, COUNTER, *_static(), _collect(*VALUES), t.CollectRegisters((1 << 17) - 1))
    _define(tracer, 2, LOOP_BODY, t.CollectRegisters(1))  # an ordinary tracepoint beside it, compiled or not
    tracer.start()
    assert [item.native is not None for item in tracer.probes.installed.values()] == [engine != "interp"]
    before = machine.read_symbol("kgtp_counter", 4)
    machine.call("kgtp_bench_loop", 5)
    frames = _frames(tracer)
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert machine.read_symbol("kgtp_counter", 4) == before + 5  # each write happened once
    watch = [f for f in frames if f[0] == 1]
    assert [f[0] for f in frames] == [2, 1] * 5
    assert [f[1]["watch_val"] for f in watch] == [before + 1 + i for i in range(5)]
    for _, values, rip in watch:
        assert values["watch_val"] == values["watch_prev_val"] + 1
        assert rip == AFTER_ADD  # a trap: the instruction after the write, inside kgtp_test_function
        assert IMAGE.function_at(rip).name == "kgtp_test_function"
        assert (values["watch_addr"], values["watch_type"], values["watch_size"]) == (COUNTER, 1, 4)
        assert (values["watch_trace_num"], values["watch_trace_addr"]) == (1, COUNTER)
        assert values["watch_count"] == 1  # one session: the static watch armed at tstart
    assert tracer.location_status(1, COUNTER) == (5, tracer.probe_rows()[-1].usage)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_condition_decides_and_prev_val_follows_every_trap(engine):
    machine, tracer = _tracer(engine)
    even = assemble(f"getv {N['watch_val']:#x}; const8 2; rem_unsigned; const8 0; equal; end")
    _define(tracer, 1, COUNTER, *_static(), _collect("watch_val", "watch_prev_val"), condition=even)
    tracer.start()
    machine.call("kgtp_bench_loop", 6)
    frames = _frames(tracer)
    row = tracer.probe_rows()[0]
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert len(frames) == 3 and all(f[1]["watch_val"] % 2 == 0 for f in frames)
    assert all(f[1]["watch_prev_val"] == f[1]["watch_val"] - 1 for f in frames)  # updated at the odd ones too
    assert (row.kind, row.fired, row.hits) == ("watch", 6, 3)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_dynamic_watch_is_started_and_stopped_by_other_tracepoints(engine):
    machine, tracer = _tracer(engine)
    _define(tracer, 1, DYNAMIC, t.EvalExpression(bytes.fromhex("22002d002027")), _collect(*VALUES),
            t.CollectRegisters((1 << 17) - 1))
    _define(tracer, 2, LOOP, _setv("watch_set_addr", DYNAMIC), _setv("watch_size", 4),
            _setv("watch_start", COUNTER), _collect("watch_start", "watch_type", "watch_size"))
    _define(tracer, 3, LOOP_RET, _setv("watch_stop", COUNTER), _collect("watch_stop"))
    _define(tracer, 4, LOOP_BODY, t.CollectRegisters(1))
    tracer.start()
    native = {item.tracepoint.number: item.native is not None for item in tracer.probes.installed.values()}
    assert native == {2: False, 3: False, 4: engine != "interp"}  # starts and stops run in Python
    machine.call("kgtp_test_function", 0, 0)  # before any start: no breakpoint
    for _ in range(3):
        machine.call("kgtp_bench_loop", 2)
        machine.call("kgtp_test_function", 0, 0)  # after the stop: none either
    frames = [f for f in _frames(tracer) if f[0] != 4]
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert [f[0] for f in frames] == [2, 1, 1, 3] * 3
    for session in range(3):
        start, first, second, stop = frames[4 * session: 4 * session + 4]
        assert start[1] == {"watch_start": 0, "watch_type": 1, "watch_size": 4}
        assert stop[1] == {"watch_stop": 0}
        for _, values, rip in (first, second):
            assert values["watch_val"] == values["watch_prev_val"] + 1 and rip == AFTER_ADD
            assert (values["watch_addr"], values["watch_size"], values["watch_type"]) == (COUNTER, 4, 1)
            assert (values["watch_trace_num"], values["watch_trace_addr"]) == (2, LOOP)
        # KGTP's count of this session: each start and each stop counts, so sessions get 1, 3, 5
        assert first[1]["watch_count"] == second[1]["watch_count"] == 1 + 2 * session


@pytest.mark.parametrize("engine", ENGINES)
def test_a_read_watch_sees_the_read_and_a_write_watch_does_not(engine):
    machine, tracer = _tracer(engine)
    name = machine.alloc_data(16)
    machine.write_memory(name, b"kgtp\0")
    _define(tracer, 1, JIFFIES, *_static(kind=2, size=8), _collect("watch_val", "watch_prev_val"),
            t.CollectRegisters((1 << 17) - 1))
    _define(tracer, 2, JIFFIES, *_static(kind=1, size=8), _collect("watch_val"))
    tracer.start()
    machine.call("load_module", name, 0)  # mod->load_jiffies = jiffies
    frames = _frames(tracer)
    tracer.stop(t.StopReason.STOP_COMMAND)
    jiffies = machine.read_symbol("jiffies")
    assert len(frames) == 1, frames
    number, values, rip = frames[0]
    assert number == 1 and values == {"watch_val": jiffies, "watch_prev_val": jiffies}
    assert IMAGE.function_at(rip).name == "load_module"


@pytest.mark.parametrize("engine", ENGINES)
def test_an_execute_watch_fires_before_the_instruction(engine):
    machine, tracer = _tracer(engine)
    _define(tracer, 1, FUNCTION, *_static(kind=0, size=1), _collect("watch_val", "watch_type"),
            t.CollectMemory(-1, COUNTER, 4), t.CollectRegisters((1 << 17) - 1))
    tracer.start()
    before = machine.read_symbol("kgtp_counter", 4)
    machine.call("kgtp_bench_loop", 3)
    frames = tracer.frames()
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert [f.registers["rip"] for f in frames] == [FUNCTION] * 3
    memory = [next(b.data for b in f.blocks if isinstance(b, MemoryBlock)) for f in frames]
    assert memory == [(before + i).to_bytes(4, "little") for i in range(3)]  # not yet added
    assert [_frames_values(f) for f in frames] == [{"watch_val": 0x83, "watch_type": 0}] * 3  # addl's first byte


def _frames_values(frame) -> dict[str, int]:
    return {BUILTIN_VARIABLES.by_number(b.number).name: b.value for b in frame.blocks if isinstance(b, TsvBlock)}


OTHER = [IMAGE.address_of(name) for name in ("jiffies", "kgtp_test_pace", "nr_modules_loaded", "nr_context_switches")]


def test_a_fifth_static_watch_fails_tstart():
    machine, tracer = _tracer("opt")
    for number, address in enumerate([COUNTER, *OTHER], start=1):
        _define(tracer, number, address, *_static(size=4), _collect("watch_val"))
    with pytest.raises(TraceError, match=r"tracepoint 5: no free hardware breakpoint .* x86 has 4 debug registers, "
                                         r"all in use \(tracepoints 1, 2, 3, 4\)"):
        tracer.start()
    assert not tracer.running
    assert machine.cpu.after_run is None and machine.cpu.debug_trap is None  # nothing left armed
    before = machine.read_symbol("kgtp_counter", 4)
    machine.call("kgtp_bench_loop", 2)
    assert machine.read_symbol("kgtp_counter", 4) == before + 2 and tracer.frames() == []


def test_ignore_error_leaves_the_fifth_out_with_ebusy():
    machine, tracer = _tracer("interp")
    tracer.definitions.define_variable(t.DefineTraceVariable(number=N["ignore_error"], value=1, builtin=True,
                                                             name="ignore_error"))
    for number, address in enumerate([*OTHER, COUNTER], start=1):
        _define(tracer, number, address, *_static(size=4), _collect("watch_val"))
    tracer.start()
    assert tracer.variable_value(N["last_errno"]) == EBUSY
    assert [row.armed for row in tracer.probe_rows()] == [True] * 4 + [False]
    machine.call("kgtp_bench_loop", 2)
    assert [f.tracepoint for f in tracer.frames()] == []  # kgtp_counter was the fifth
    tracer.stop(t.StopReason.STOP_COMMAND)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_fifth_start_reads_ebusy_and_the_run_goes_on(engine):
    machine, tracer = _tracer(engine)
    for number, address in enumerate(OTHER, start=1):
        _define(tracer, number, address, *_static(size=4))
    _define(tracer, 5, DYNAMIC, _setv("watch_static", 0), _collect("watch_val"))
    _define(tracer, 6, LOOP, _setv("watch_set_id", 5), _setv("watch_start", COUNTER), _collect("watch_start"))
    tracer.start()
    machine.call("kgtp_bench_loop", 2)
    frames = _frames(tracer)
    assert tracer.running
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert frames == [(6, {"watch_start": EBUSY & MASK}, None)]


def test_watch_count_and_set_id_follow_kgtp():
    """`$watch_set_id` chooses by number; a start and a stop each count (gtp_hwb_sync_count); a stop of an
    address nothing watches reads -ENXIO."""
    machine, tracer = _tracer("interp")
    _define(tracer, 7, DYNAMIC, _setv("watch_static", 0), _setv("watch_size", 4), _collect("watch_count"))
    _define(tracer, 2, LOOP, _setv("watch_set_id", 7), _setv("watch_start", COUNTER), _setv("watch_stop", JIFFIES),
            _collect("watch_start", "watch_stop", "watch_size"))
    _define(tracer, 3, LOOP_RET, _setv("watch_stop", COUNTER))
    tracer.start()
    machine.call("kgtp_bench_loop", 1)
    machine.call("kgtp_bench_loop", 1)
    frames = _frames(tracer)
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert frames == [(2, {"watch_start": 0, "watch_stop": -6 & MASK, "watch_size": 4}, None),
                      (7, {"watch_count": 1}, None), (3, {}, None),
                      (2, {"watch_start": 0, "watch_stop": -6 & MASK, "watch_size": 4}, None),
                      (7, {"watch_count": 3}, None), (3, {}, None)]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_watch_can_stop_itself_and_a_pass_count_stops_the_run(engine):
    machine, tracer = _tracer(engine)
    stop_self = assemble(f"getv {N['watch_addr']:#x}; setv {N['watch_stop']:#x}; end")
    _define(tracer, 1, COUNTER, *_static(), t.EvalExpression(stop_self), _collect("watch_stop"))
    _define(tracer, 2, JIFFIES, *_static(size=8), _collect("watch_val"), pass_count=2)
    tracer.start()
    machine.call("kgtp_bench_loop", 3)
    assert _frames(tracer) == [(1, {"watch_stop": 0}, None)]  # disarmed at its first hit
    tracer.stop(t.StopReason.STOP_COMMAND)

    machine, tracer = _tracer(engine)
    _define(tracer, 2, COUNTER, *_static(), _collect("watch_val"), pass_count=2)
    tracer.start()
    machine.call("kgtp_bench_loop", 4)
    status = tracer.status()
    assert (status.stop_reason, status.stopping_tracepoint, status.frames) == (t.StopReason.PASSCOUNT, 2, 2)
    assert machine.cpu.after_run is None  # tstop from inside a hit: the hooks went at the run's end


@pytest.mark.parametrize("engine", ("naive", "opt"))
def test_the_tracers_own_accesses_do_not_trap(engine):
    """A compiled tracepoint collecting the watched variable reads it from its detour: KGTP's own collection, not
    the kernel's access. The watch sees the kernel's read-and-write only."""
    machine, tracer = _tracer(engine)
    read_it = assemble(f"const64 {COUNTER:#x}; ref32; const8 0; equal; end")
    _define(tracer, 1, COUNTER, *_static(kind=2), _collect("watch_val"), t.CollectRegisters((1 << 17) - 1))
    _define(tracer, 2, LOOP_BODY, t.CollectMemory(-1, COUNTER, 4), t.EvalExpression(read_it),
            condition=assemble(f"const64 {COUNTER:#x}; ref32; const8 0; equal; log_not; end"))
    tracer.start()
    assert tracer.probes.installed[(2, LOOP_BODY)].native is not None
    machine.call("kgtp_bench_loop", 4)
    frames = _frames(tracer)
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert [f[0] for f in frames] == [2, 1] * 4
    assert all(rip == AFTER_ADD for number, _, rip in frames if number == 1)


def test_disable_and_enable_during_the_run():
    machine, tracer = _tracer("opt")
    _define(tracer, 1, COUNTER, *_static(), _collect("watch_val"))
    tracer.start()
    machine.call("kgtp_bench_loop", 2)
    tracer.disarm((1, COUNTER))
    machine.call("kgtp_bench_loop", 2)
    tracer.arm(tracer.definitions.tracepoints[(1, COUNTER)])
    tracer.arm(tracer.definitions.tracepoints[(1, COUNTER)])  # already armed: nothing more
    machine.call("kgtp_bench_loop", 2)
    assert len(tracer.frames()) == 4 and tracer.location_status(1, COUNTER)[0] == 4
    assert tracer.watches.registers.in_use == 1
    tracer.stop(t.StopReason.STOP_COMMAND)


@pytest.mark.parametrize("engine", ENGINES)
def test_tstop_takes_every_hook_out_run_after_run(engine):
    machine, tracer = _tracer(engine)
    uc = machine.cpu.uc
    hooks = len(uc._callbacks)
    _define(tracer, 1, COUNTER, *_static(), _collect("watch_val"))
    _define(tracer, 2, FUNCTION + 12, *_static(kind=0, size=1))  # the `ret`
    _define(tracer, 3, DYNAMIC, _setv("watch_static", 0))
    _define(tracer, 4, LOOP, _setv("watch_set_addr", DYNAMIC), _setv("watch_size", 8), _setv("watch_start", JIFFIES))
    for run in range(3):
        tracer.start()
        machine.call("kgtp_bench_loop", 2)
        assert len(tracer.frames()) == 5 and tracer.watches.registers.in_use == 3
        tracer.stop(t.StopReason.STOP_COMMAND)
        assert len(uc._callbacks) == hooks
        assert machine.cpu.after_run is None and machine.cpu.debug_trap is None
        before = machine.read_symbol("kgtp_counter", 4)
        machine.call("kgtp_bench_loop", 2)
        assert machine.read_symbol("kgtp_counter", 4) == before + 2 and len(tracer.frames()) == 5


@pytest.mark.parametrize("actions, condition, step, text", [
    ((_setv("watch_static", 1), t.EvalExpression(assemble(f"reg 0x0; setv {N['watch_size']:#x}; end"))), None, 0,
     "watch_size must be set to a constant"),
    ((_setv("watch_static", 2),), None, 0, "watch_static is set to 0 or 1, not 2"),
    ((_setv("watch_static", 1), _setv("watch_type", 3)), None, 0, "watch_type is 0 .execute., 1 .write. or 2"),
    ((_setv("watch_static", 1), _setv("watch_size", 3)), None, 0, "watch_size is 1, 2, 4 or 8, not 3"),
    ((_setv("watch_static", 1), _setv("watch_start", COUNTER)), None, 0,
     "a watch tracepoint cannot set variable watch_start at its hit"),
    ((_setv("watch_static", 1), _collect("watch_set_id")), None, 0, "variable watch_set_id cannot be read"),
    ((_setv("watch_static", 1),), None, 2, "a watch tracepoint cannot single-step"),
    ((_setv("watch_static", 1), _setv("kret", 0)), None, 0, "kret cannot be used with while-stepping or watch"),
    ((_collect("watch_val"),), None, 0, "variable watch_val is read only by a watch tracepoint"),
    ((), assemble(f"const8 1; setv {N['watch_start']:#x}; end"), 0, "a condition cannot set a watch variable"),
])
def test_what_kgtp_refuses_fails_tstart(actions, condition, step, text):
    machine, tracer = _tracer("opt")
    tracer.definitions.define(t.DefineTracepoint(number=1, address=COUNTER if actions else FUNCTION,
                                                 condition=condition, step_count=step, more=True))
    if actions:
        tracer.definitions.add_actions(t.TracepointActions(number=1, address=COUNTER, actions=actions, more=bool(step)))
    if step:
        tracer.definitions.add_actions(t.TracepointActions(number=1, address=COUNTER, actions=(t.CollectRegisters(1),),
                                                           stepping=True))
    with pytest.raises(TraceError, match=text):
        tracer.start()
    assert not tracer.running


def test_watches_and_while_stepping_do_not_share_a_run():
    machine, tracer = _tracer("interp")
    _define(tracer, 1, COUNTER, *_static())
    tracer.definitions.define(t.DefineTracepoint(number=2, address=FUNCTION, step_count=1, more=True))
    tracer.definitions.add_actions(t.TracepointActions(number=2, address=FUNCTION, actions=(t.CollectRegisters(1),),
                                                       stepping=True))
    with pytest.raises(TraceError, match="cannot work together with while-stepping"):
        tracer.start()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_start_without_a_chosen_watch_is_an_error_at_the_hit(engine):
    machine, tracer = _tracer(engine)
    _define(tracer, 1, DYNAMIC, _setv("watch_static", 0))
    _define(tracer, 2, LOOP, _setv("watch_start", COUNTER))
    tracer.start()
    machine.call("kgtp_bench_loop", 1)
    status = tracer.status()
    assert status.stop_reason is t.StopReason.ERROR and status.stopping_tracepoint == 2
    assert "watch_start before watch_set_id or watch_set_addr" in status.stop_note


@pytest.mark.parametrize("engine", ENGINES)
def test_a_probed_instruction_running_displaced_still_traps(engine):
    """A tracepoint on kgtp_test_function displaces its `addl` (an int3's out-of-line copy, a detour's tail): the
    write is the kernel's, as under kprobes, and traps with RIP after it in that copy."""
    machine, tracer = _tracer(engine)
    _define(tracer, 1, COUNTER, *_static(), _collect("watch_val", "watch_prev_val"), t.CollectRegisters((1 << 17) - 1))
    _define(tracer, 2, FUNCTION, t.CollectRegisters(1), t.CollectMemory(-1, COUNTER, 4))
    tracer.start()
    machine.call("kgtp_bench_loop", 4)
    frames = _frames(tracer)
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert [f[0] for f in frames] == [2, 1] * 4
    for number, values, rip in frames:
        if number == 1:
            assert values["watch_val"] == values["watch_prev_val"] + 1
            assert IMAGE.function_at(rip) is None  # module space: the displaced copy


def test_a_fifth_watch_armed_during_the_run_is_refused():
    machine, tracer = _tracer("opt")
    for number, address in enumerate(OTHER, start=1):
        _define(tracer, number, address, *_static(size=4))
    tracer.start()
    _define(tracer, 5, COUNTER, *_static(), _collect("watch_val"))
    with pytest.raises(TraceError, match="tracepoint 5: no free hardware breakpoint"):
        tracer.arm(tracer.definitions.tracepoints[(5, COUNTER)])
    tracer.disarm((1, OTHER[0]))  # one register free again
    tracer.arm(tracer.definitions.tracepoints[(5, COUNTER)])
    machine.call("kgtp_bench_loop", 2)
    assert [f[0] for f in _frames(tracer)] == [5, 5] and tracer.running
    tracer.stop(t.StopReason.STOP_COMMAND)
