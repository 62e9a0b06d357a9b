"""The thesis benchmark (chapter 2, section 2.4, Tables 3, 5, 6) on the simulated kernel.

Workload: `kgtp_bench_loop(N)` calls `kgtp_test_function(counter1, counter2)` N times (Figure 13), run with
`Machine.call` (no timer interrupt, deterministic). A probe at kgtp_test_function's first instruction (dynamic) or
at the kgtp_module_event marker (static) runs GDB 13's own bytecode for the thesis expressions
(fixtures/bench/thesis_bytecode.json, recorded by kgtp_sim.bench.record) downloaded the way GDB downloads it.

Per row: `insns_per_hit`, emulated instructions per call minus the untraced run's (exact: the native counter of
the machine), and host nanoseconds per call minus the untraced median (median/min/max over the repetitions, all
in one process). The `none` row is absolute (the untraced loop per call); `disabled-marker` is the cost of the
marker site itself, its one 5-byte NOP (no separate host time: it is part of the untraced run).

Runs on the caller's thread (the main thread of `kgtp-sim bench`, or a test's): the machines it builds are never
started, so their CPU runs there too (`Machine.run_on_cpu` runs directly before `start`) and no CPU or tick thread
exists.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

from kgtp_sim.client.paths import VMLINUX
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import Tracer
from kgtp_sim.tracing.patching.probes import plan_probe

from .record import FIXTURE, load

MARKER_ID = "module::kgtp_module_event"
BUFFER_SIZE = 64 << 20

PROBES = ("none", "disabled-marker", "dynamic-jump", "dynamic-int3", "static",
          "gdbserver-none", "gdbserver-trap", "gdbserver-fast")  # the last three: bench/peer.py
CASES = ("none", "false-cond", "expr", "cond+expr", "sdata")
ENGINES = ("none", "interp", "naive", "opt", "gdbserver")
FIELDS = ("probe", "case", "engine", "insns_per_hit", "ns_per_hit_median", "ns_per_hit_min", "ns_per_hit_max",
          "frames")
#: calls of kgtp_test_function per run of the speed measurement (1.8 M emulated instructions)
SPEED_CALLS = 200_000

#: the thesis' figures, in CPU cycles on a 2 GHz Xeon E5405 (a different unit from ours): (KGTP, SystemTap)
THESIS_CYCLES = {
    ("dynamic", "false-cond"): (202, 351),
    ("dynamic", "expr"): (500, 1035),
    ("dynamic", "cond+expr"): (602, 1061),
    ("static", "false-cond"): (154, 223),
    ("static", "sdata"): (1216, 1252),
    ("static", "cond+expr"): (1368, 1336),  # thesis: condition and data ($_sdata), here condition and expression
    ("disabled-marker", "none"): (7, None),
}


@dataclass(frozen=True)
class Config:
    probe: str
    case: str
    engine: str

    @property
    def site_kind(self) -> str:
        return "static" if self.probe == "static" else "dynamic"


def configurations() -> list[Config]:
    rows = [Config("none", "none", "none"), Config("disabled-marker", "none", "none")]
    dyn = ("false-cond", "expr", "cond+expr")
    rows += [Config("dynamic-jump", c, e) for c in dyn for e in ("interp", "naive", "opt")]
    # int3 probes (kprobes without optimization): the compiled engines trap into the same detour
    rows += [Config("dynamic-int3", c, e) for c in dyn for e in ("interp", "naive", "opt")]
    rows += [Config("static", c, e) for c in (*dyn, "sdata") for e in ("interp", "naive", "opt")]
    return rows


def _x(code: bytes, width: int) -> bytes:
    return b"X%0*x,%s" % (width, len(code), code.hex().encode())


def packets(config: Config, image: KernelImage, fixture: dict | None = None) -> tuple[bytes, list[bytes]]:
    """The QTDP bodies GDB would send for one row: the definition and its action packets (without `QTDP:`)."""
    fixture = fixture or load(FIXTURE)
    site = fixture["sites"][config.site_kind]
    address = int(site["address"], 16)
    if config.site_kind == "static":
        (marker,) = [m for m in image.markers if f"{m.system}::{m.name}" == MARKER_ID]
        assert marker.site == address, (hex(marker.site), site["address"])
    flags = b""
    if config.probe == "dynamic-jump" and config.engine == "interp":
        # `ftrace`: a fast tracepoint, so the interpreter too is reached through a jump (GDB sends F<insn length>)
        flags = b":F%x" % len(plan_probe(image, address, "int3").displaced[0].code)
    if config.probe == "static":
        flags += b":S"
    cond = b""
    if config.case in ("false-cond", "cond+expr"):
        name = "false_condition" if config.case == "false-cond" else "true_condition"
        cond = b":" + _x(bytes.fromhex(site[name]["bytecode"]), 0)
    if config.case == "sdata":
        actions = [b"L"]
    else:
        collect = site["collect"]
        # `collect (2*counter1+3*counter2)`: GDB merges the expression's register mask into a register block
        actions = [b"R%s" % collect["reg_mask"].encode() + _x(bytes.fromhex(collect["bytecode"]), 8)]
    definition = b"1:%x:E:0:0%s%s" % (address, flags, cond)
    return definition + b"-", [b"1:%x:%s" % (address, a) for a in actions]


@dataclass
class Measurement:
    insns_per_call: float
    ns_per_call: list[float]
    frames: int
    tracer: Tracer | None = None


class Bench:
    def __init__(self, calls: int = 10_000, repetitions: int = 5, image: KernelImage | None = None,
                 cpus: int = 1, on_cpu: int = 0) -> None:
        """`cpus`, `on_cpu`: the machine's CPUs, and the one the workload runs on (the others stay idle: the
        per-hit cost must not depend on them)."""
        self.calls = calls
        self.cpus = cpus
        self.on_cpu = on_cpu
        self.repetitions = repetitions
        self.image = image or KernelImage.load(VMLINUX)
        self.fixture = load(FIXTURE)
        self.speed_figures: tuple[float, float] | None = None  #: set by rows(): see speed()

    def machine(self, counting: bool = True) -> Machine:
        machine = Machine(self.image, cpus=self.cpus)
        machine.on_cpu(self.on_cpu, lambda uc: None)  # Machine.call runs on the loaded CPU
        if counting:
            machine.set_counting(True)  # every row's instruction count is exact
        machine.call("kgtp_bench_loop", 0)  # place call()'s stack first: same rsp in every run
        return machine

    def speed(self, calls: int = SPEED_CALLS) -> tuple[float, float]:
        """Emulated instructions per second of the untraced workload, kgtp_bench_loop(calls): with counting off
        (how a serving kernel runs) and on (how the rows are measured); medians over the repetitions. The
        uncounted runs execute exactly the instructions the counted ones counted (the call is deterministic)."""
        machine = self.machine(counting=False)
        rates: dict[bool, list[float]] = {False: [], True: []}
        insns = 0
        for counting in (True, False):
            machine.set_counting(counting)
            for _ in range(self.repetitions):
                gc.collect()
                gc.disable()
                try:
                    i0 = machine.instructions()
                    t0 = time.perf_counter_ns()
                    assert machine.call("kgtp_bench_loop", calls) == calls
                    t1 = time.perf_counter_ns()
                    i1 = machine.instructions()
                finally:
                    gc.enable()
                if counting:
                    insns = i1 - i0
                rates[counting].append(insns / ((t1 - t0) / 1e9))
        return statistics.median(rates[False]), statistics.median(rates[True])

    def _timed(self, machine: Machine, before=None, after=None) -> tuple[list[int], list[float]]:
        """Emulated instructions of two counted runs (exact: they must agree), then host time per call of
        `repetitions` runs with counting off, as a serving kernel runs (the counting hook would add about 12 ns
        to every instruction), after one untimed run that translates the code again."""
        insns, times = [], []

        def once() -> int:
            if before:
                before()
            gc.collect()
            gc.disable()
            try:
                t0 = time.perf_counter_ns()
                result = machine.call("kgtp_bench_loop", self.calls)
                elapsed = time.perf_counter_ns() - t0
            finally:
                gc.enable()
            assert result == self.calls, result
            if after:
                after()
            return elapsed

        for _ in range(2):
            i0 = machine.instructions()
            once()
            insns.append(machine.instructions() - i0)
        machine.set_counting(False)
        try:
            once()
            times = [once() / self.calls for _ in range(self.repetitions)]
        finally:
            machine.set_counting(True)
        return insns, times

    def loop_overhead(self, machine: Machine) -> int:
        """Instructions of kgtp_bench_loop(0) and the call sentinel: subtracted so per-call counts are exact."""
        counts = []
        for n in (1, 2):
            i0 = machine.instructions()
            machine.call("kgtp_bench_loop", n)
            counts.append(machine.instructions() - i0)
        return 2 * counts[0] - counts[1]  # fixed part of a run: calls of N cost overhead + N * per-call exactly

    def untraced(self, machine: Machine | None = None) -> Measurement:
        machine = machine or self.machine()
        insns, times = self._timed(machine)
        assert len(set(insns)) == 1, insns  # exact and repeatable
        return Measurement((insns[0] - self.loop_overhead(machine)) / self.calls, times, 0)

    def traced(self, config: Config, machine: Machine | None = None, tracer_setup=None) -> Measurement:
        machine = machine or self.machine()
        tracer = Tracer(machine, config.engine, probe="int3" if config.probe == "dynamic-int3" else "auto")
        tracer.definitions.buffer_size = BUFFER_SIZE
        definition, actions = packets(config, self.image, self.fixture)
        tracer.definitions.define(t.DefineTracepoint.parse(definition))
        for action in actions:
            tracer.definitions.add_actions(t.TracepointActions.parse(action))
        if tracer_setup:
            tracer_setup(tracer)
        frames: list[int] = []

        def stop() -> None:
            status = tracer.status()
            if status.stop_reason is not t.StopReason.NOT_RUN:
                raise RuntimeError(f"{config}: the run stopped early: {status.stop_reason.name} {status.stop_note}")
            frames.append(status.frames or 0)
            tracer.stop(t.StopReason.STOP_COMMAND)

        insns, times = self._timed(machine, tracer.start, stop)
        assert len(set(insns)) == 1, (config, insns)
        assert len(set(frames)) == 1, (config, frames)
        return Measurement((insns[0] - self.loop_overhead(machine)) / self.calls, times, frames[0], tracer)

    def rows(self, configs: list[Config] | None = None, progress=None) -> list[dict]:
        configs = configs or configurations()
        base = self.untraced()
        base_ns = statistics.median(base.ns_per_call)
        #: emulated instructions per second of the untraced workload, counting off and on (`speed`)
        self.speed_figures = self.speed(max(20 * self.calls, SPEED_CALLS // 4))
        out = []
        for config in configs:
            if config.probe == "none":
                row = _row(config, base.insns_per_call, base.ns_per_call, 0)
            elif config.probe == "disabled-marker":
                row = _row(config, self.marker_cost(), None, 0)
            else:
                m = self.traced(config)
                row = _row(config, m.insns_per_call - base.insns_per_call, [x - base_ns for x in m.ns_per_call],
                           m.frames)
            out.append(row)
            if progress:
                progress(row)
        return out

    def marker_cost(self) -> int:
        """Emulated instructions the disabled marker adds per call: its site is one 5-byte NOP on the path."""
        (marker,) = [m for m in self.image.markers if f"{m.system}::{m.name}" == MARKER_ID]
        site = plan_probe(self.image, marker.site, "int3").displaced[0]
        assert site.code == b"\x0f\x1f\x44\x00\x00", site
        return 1


def _row(config: Config, insns: float, ns: list[float] | None, frames: int) -> dict:
    return {
        "probe": config.probe, "case": config.case, "engine": config.engine,
        "insns_per_hit": round(insns, 3),
        "ns_per_hit_median": None if ns is None else round(statistics.median(ns), 1),
        "ns_per_hit_min": None if ns is None else round(min(ns), 1),
        "ns_per_hit_max": None if ns is None else round(max(ns), 1),
        "frames": frames,
    }


def thesis_of(row: dict) -> tuple[int | None, int | None]:
    kind = "static" if row["probe"] == "static" else "dynamic" if row["probe"].startswith("dynamic") else row["probe"]
    return THESIS_CYCLES.get((kind, row["case"]), (None, None))


def expected_frames(row: dict, calls: int) -> int:
    return 0 if row["case"] in ("none", "false-cond") else calls
