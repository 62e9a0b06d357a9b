"""KGTP's perf-event trace state variables (tracing/core/perf.py) driven through the Tracer, on the machine's
counters: the howto's example (per-CPU `$p_pe_*` variables as its `dpe` defines them, `$p_pe_en` switched at a
function's entry and at its return with `$kret`) counts each call's instructions exactly, in every engine and on
either CPU; probes inside the counted code change nothing of the count; KGTP's access rules.

Runs are `machine.call`s (no timer): each counted call is exactly the code's own instructions.
"""

from __future__ import annotations

import pytest

from kgtp_sim.agent.opcodes import assemble
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import TraceError, Tracer
from kgtp_sim.tracing.core.builtins import BUILTIN_VARIABLES
from kgtp_sim.tracing.core.frames import TsvBlock
from kgtp_sim.tracing.core.model import StopReason

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)
ENGINES = ("interp", "naive", "opt")
N = {b.name: b.number for b in BUILTIN_VARIABLES}
TEST_FUNCTION = IMAGE.address_of("kgtp_test_function")  # addl $1, kgtp_counter; nopl; ret
BENCH_LOOP = IMAGE.address_of("kgtp_bench_loop")
LOOP_BODY = BENCH_LOOP + 0x10  # lea 1(%rdx), %edi; mov %edx, %esi: a 5-byte jump displaces both
FIRST_VARIABLE = 100


class Run:
    """A tracer on a fresh machine, with trace state variables by name and tracepoints of bytecode."""

    def __init__(self, engine: str, cpus: int = 1) -> None:
        self.machine = Machine(IMAGE, cpus=cpus)
        self.tracer = Tracer(self.machine, engine=engine)
        self.numbers: dict[str, int] = {}

    def variable(self, name: str, value: int = 0) -> int:
        number = self.numbers[name] = FIRST_VARIABLE + len(self.numbers)
        self.tracer.check_variable(name)
        self.tracer.definitions.define_variable(t.DefineTraceVariable(number=number, value=value, builtin=False,
                                                                      name=name))
        return number

    def dpe(self, pe_type: int, config: int) -> None:
        """The howto's `dpe TYPE CONFIG`: the local forms, and CPU N's type, config and value for each CPU."""
        self.variable(f"p_pe_val_{pe_type}{config}_c")
        self.variable(f"p_pe_en_{pe_type}{config}_c")
        for cpu in range(self.machine.cpu_count):
            self.variable(f"p_pe_type_{pe_type}{config}_c{cpu}", pe_type)
            self.variable(f"p_pe_config_{pe_type}{config}_c{cpu}", config)
            self.variable(f"p_pe_val_{pe_type}{config}_c{cpu}", 0)

    def tracepoint(self, number: int, address: int, *actions: str, condition: str | None = None) -> None:
        self.tracer.definitions.define(t.DefineTracepoint(
            number=number, address=address, condition=assemble(condition) if condition else None, pass_count=0,
            step_count=0, more=True))
        self.tracer.definitions.add_actions(t.TracepointActions(number=number, address=address, actions=tuple(
            t.EvalExpression(assemble(self._named(a))) for a in actions)))

    def _named(self, text: str) -> str:
        for name, number in sorted(self.numbers.items(), key=lambda item: -len(item[0])):
            text = text.replace(f"${name}", str(number))
        for name, number in N.items():
            text = text.replace(f"${name}", str(number))
        return text

    def collected(self, tracepoint: int) -> list[list[int]]:
        return [[b.value for b in frame.blocks if isinstance(b, TsvBlock)] for frame in self.tracer.frames()
                if frame.tracepoint == tracepoint]

    def on(self, cpu: int, function: str, *args: int) -> None:
        self.machine.on_cpu(cpu, lambda uc: self.machine.call(function, *args, max_instructions=10**6),
                            stay=False)


def _howto(run: Run, entry: int, function: int) -> None:
    """The howto's two tracepoints: `$p_pe_en=1` at the entry, and at the return (`$kret`) the CPU's events off,
    their values collected, then set to 0 for the next call."""
    run.dpe(0, 1)  # PERF_TYPE_HARDWARE, PERF_COUNT_HW_INSTRUCTIONS
    run.dpe(0, 4)  # PERF_COUNT_HW_BRANCH_INSTRUCTIONS
    run.tracepoint(1, entry, "const8 1; setv $p_pe_en; end")
    run.tracepoint(2, function, "const8 0; setv $kret; end", "const8 0; setv $p_pe_en; end",
                   "getv $p_pe_val_01_c; tracev $p_pe_val_01_c; end",
                   "getv $p_pe_val_04_c; tracev $p_pe_val_04_c; end",
                   "const8 0; setv $p_pe_val_01_c; end", "const8 0; setv $p_pe_val_04_c; end")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("cpus", [1, 2])
def test_the_howto_example_counts_each_call_exactly(engine, cpus):
    run = Run(engine, cpus)
    _howto(run, TEST_FUNCTION, TEST_FUNCTION)
    run.tracer.start()
    for cpu in range(cpus):
        run.on(cpu, "kgtp_bench_loop", 25)
    run.tracer.stop(StopReason.STOP_COMMAND)
    frames = run.collected(2)
    assert frames == [[3, 1]] * (25 * cpus)  # addl, nopl, ret: 3 instructions, 1 branch (the ret)


@pytest.mark.parametrize("engine", ENGINES)
def test_probes_inside_the_counted_code_change_nothing(engine):
    """kgtp_bench_loop(N) counted from its entry to its return: 9N + 6 instructions and 3N + 2 branches, the
    same with a probe on every call of kgtp_test_function and a 5-byte jump (compiled engines) over the loop's
    first two instructions, each a false condition: the tracer's code is not the kernel's, and a probe counts
    as what it displaced."""
    run = Run(engine)
    run.variable("pe_type_i", 0)
    run.variable("pe_config_i", 1)
    run.variable("pe_val_i")
    run.variable("pe_config_b", 4)
    run.variable("pe_val_b")
    run.tracepoint(1, BENCH_LOOP, "const8 1; setv $p_pe_en; end")  # both events are CPU 0's
    run.tracepoint(2, BENCH_LOOP, "const8 0; setv $kret; end", "const8 0; setv $p_pe_en; end",
                   "getv $pe_val_i; tracev $pe_val_i; end",
                   "getv $pe_val_b; tracev $pe_val_b; end", "const8 0; setv $pe_val_i; end",
                   "const8 0; setv $pe_val_b; end")
    for calls in (1, 50):
        run.tracer.start()
        run.on(0, "kgtp_bench_loop", calls)
        untraced = run.collected(2)
        run.tracepoint(3, TEST_FUNCTION, condition="const8 0; end")
        run.tracepoint(4, LOOP_BODY, condition="const8 0; end")
        run.tracer.start()
        kinds = {row.number: row.kind for row in run.tracer.probe_rows()}
        run.on(0, "kgtp_bench_loop", calls)
        run.tracer.stop(StopReason.STOP_COMMAND)
        assert untraced == run.collected(2) == [[9 * calls + 6, 3 * calls + 2]]
        assert kinds[4] == ("int3" if engine == "interp" else "jump")
        del run.tracer.definitions.tracepoints[(3, TEST_FUNCTION)], run.tracer.definitions.tracepoints[(4, LOOP_BODY)]


def test_gdb_reads_the_value_live_and_as_it_was_at_tstop():
    """qTV: `val` live during the run, kept at tstop (the counter is released); the other fields read 0, as
    KGTP answers."""
    run = Run("opt")
    value = run.variable("pe_val_x")
    kind = run.variable("pe_config_x", 1)
    run.variable("pe_en_x", 1)  # enabled from tstart
    run.tracer.start()
    run.on(0, "kgtp_bench_loop", 10)
    assert run.tracer.variable_value(value) == 96
    assert run.tracer.variable_value(kind) == 0
    run.tracer.stop(StopReason.STOP_COMMAND)
    run.on(0, "kgtp_bench_loop", 10)
    assert run.tracer.variable_value(value) == 96
    assert run.machine.cpu.observer is None  # released: the machine counts nothing any more


def test_an_enabled_event_of_a_switched_off_cpu_waits_for_its_switch():
    """`$pe_en_NAME = 1` at a hit on the event's own CPU counts only while that CPU's events are switched on
    (KGTP enables it at the handler's end, unless the CPU's events are all disabled)."""
    run = Run("interp")
    run.variable("pe_config_x", 1)
    value = run.variable("pe_val_x")
    run.variable("pe_en_x")
    run.tracepoint(1, TEST_FUNCTION, "const8 1; setv $pe_en_x; end")
    run.tracer.start()
    run.on(0, "kgtp_bench_loop", 10)
    assert run.tracer.variable_value(value) == 0
    run.tracer.stop(StopReason.STOP_COMMAND)
    run.tracepoint(1, TEST_FUNCTION, "const8 1; setv $p_pe_en; end", "const8 1; setv $pe_en_x; end")
    run.tracer.start()
    run.on(0, "kgtp_bench_loop", 10)
    assert run.tracer.variable_value(value) == 9 * 10 + 6 - 9  # all but the 9 before the first call arrives


def test_kgtps_access_rules_are_enforced_at_qtdv_and_tstart():
    run = Run("opt")
    for bad in ("pe_foo_x", "pe_val_", "p_pe_cpu_", "perf_event_size_x"):
        with pytest.raises(ValueError):
            run.tracer.check_variable(bad)
    run.tracer.check_variable("p_pe_en")  # KGTP's own special variable, which GDB sends back at each tstart
    run.variable("perf_event_type_y", 1)  # the long prefix
    run.variable("pe_type_x", 0)
    run.variable("pe_cpu_x", 0)
    for action, verb in (("getv $pe_type_x; tracev $pe_type_x; end", "read"),
                         ("const8 0; setv $pe_cpu_x; end", "set")):
        run.tracepoint(1, TEST_FUNCTION, action)
        with pytest.raises(TraceError, match=f"pe_.*cannot be {verb}"):
            run.tracer.start()
    run.tracepoint(1, TEST_FUNCTION)
    run.variable("pe_type_c", 3)  # PERF_TYPE_HW_CACHE: no caches here
    with pytest.raises(TraceError, match="cannot create perf event c .*type 3"):
        run.tracer.start()
    assert run.machine.cpu.observer is None  # the events created before it were released
