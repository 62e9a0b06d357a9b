"""The probe effect of function-boundary tracing (issue 29, after seed 004's DTrace FBT measurements): the kernel's
workload with no probes, with every function probed at its entry (a false condition: `kgtp-fbt *` with `if 0`),
and at its entry and return (`$kret`), in emulated instructions and host time per workload call.

The workload is the thesis loop, `kgtp_bench_loop(N)` calling kgtp_test_function N times, run with
`Machine.call` (no timer: deterministic); a workload call is one call of kgtp_test_function, and the loop's own
prologue and return are left out (two runs of 1 and 2 calls give them). Every function `monitor fbt` lists as
probeable is probed, as `kgtp-fbt *` probes it; the loop crosses the probes of kgtp_bench_loop and
kgtp_test_function, and the others are installed all the same.

Each row also counts the kernel's instructions with the machine's performance counters (an instructions event on
the CPU, machine/counters.py): they count the kernel's own code only, a probe standing for the instructions it
displaced, so they must equal the untraced run's instruction count in every row (checked), while the machine's
own count (a hook on every instruction) includes the tracer's code. Host times are taken with both off, as a
serving kernel runs, less what a run of no calls takes (Machine.call's own cost).

Runs on the caller's thread.
"""

from __future__ import annotations

import gc
import statistics
import time

from kgtp_sim.client.paths import VMLINUX
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.counters import EventAttr, HwEvent, PerfType
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import Tracer
from kgtp_sim.tracing.core.builtins import BUILTIN_VARIABLES

ENGINES = ("interp", "naive", "opt")
PROBES = ("none", "entry", "entry+return")
FALSE = bytes.fromhex("2200" "27")  #: `if 0`: const8 0; end
KRET = bytes.fromhex("2200" "2d") + BUILTIN_VARIABLES.by_name("kret").number.to_bytes(2, "big") + b"\x27"
INSTRUCTIONS = EventAttr(PerfType.HARDWARE, HwEvent.INSTRUCTIONS)


def _define(tracer: Tracer, probes: str) -> int:
    """Every probeable function's entry (false condition) and, for entry+return, its return (false condition):
    the tracepoints `kgtp-fbt *` would create with `if 0`. Returns how many."""
    number = 0
    for function in tracer.function_probes():
        sides = ("entry", "return") if probes == "entry+return" else ("entry",)
        for side in sides:
            if not function.entry or (side == "return" and not function.returns):
                continue
            number += 1
            tracer.definitions.define(t.DefineTracepoint(number=number, address=function.address, condition=FALSE,
                                                         pass_count=0, step_count=0, more=side == "return"))
            if side == "return":
                tracer.definitions.add_actions(t.TracepointActions(number=number, address=function.address,
                                                                   actions=(t.EvalExpression(KRET),)))
    return number


def probe_effect_row(probes: str, engine: str, calls: int, repetitions: int,
                     image: KernelImage | None = None) -> dict:
    image = image or KernelImage.load(VMLINUX)
    machine = Machine(image)
    machine.call("kgtp_bench_loop", 0)  # call()'s stack placed before anything is counted
    tracer = Tracer(machine, engine if probes != "none" else "opt")
    tracepoints = _define(tracer, probes) if probes != "none" else 0
    counter = machine.run_on_cpu(lambda uc: machine.counters.open(0, INSTRUCTIONS, enabled=True))
    machine.set_counting(True)
    if tracepoints:
        tracer.start()
    try:
        def counted(n: int) -> tuple[int, int, int]:
            """(emulated instructions, the counter's, probe hits) of a run of n calls."""
            i0, c0, h0 = machine.instructions(), counter.read().value, _hits(tracer)
            assert machine.call("kgtp_bench_loop", n) == n
            return machine.instructions() - i0, counter.read().value - c0, _hits(tracer) - h0

        fixed = [2 * one - two for one, two in zip(counted(1), counted(2))]  # the loop's prologue and return
        runs = [counted(calls) for _ in range(2)]
        assert runs[0] == runs[1], (probes, engine, runs)  # exact and repeatable
        machine.set_counting(False)
        machine.run_on_cpu(lambda uc: machine.counters.close(counter))  # host times without any counting hook
        machine.call("kgtp_bench_loop", calls)  # translated again
        empty = min(_timed(machine, 0) for _ in range(max(repetitions, 5)))  # Machine.call's own cost
        times = [max(_timed(machine, calls) - empty, 0) / calls for _ in range(repetitions)]
    finally:
        if tracepoints:
            tracer.stop(t.StopReason.STOP_COMMAND)
    per_call = [(value - base) / calls for value, base in zip(runs[0], fixed)]
    return {
        "workload": "kgtp_bench_loop", "probes": probes, "engine": engine if probes != "none" else "-",
        "tracepoints": tracepoints, "insns_per_call": round(per_call[0], 3),
        "counted_insns_per_call": round(per_call[1], 3), "hits_per_call": round(per_call[2], 3),
        "ns_per_call_median": round(statistics.median(times), 1), "ns_per_call_min": round(min(times), 1),
        "ns_per_call_max": round(max(times), 1),
    }


def _timed(machine: Machine, calls: int) -> int:
    """Host nanoseconds of one run of `calls` calls."""
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        machine.call("kgtp_bench_loop", calls)
        return time.perf_counter_ns() - t0
    finally:
        gc.enable()


def _hits(tracer: Tracer) -> int:
    """Probe hits so far: every location's fired count, and each return probe's returns."""
    return sum(row.fired for row in tracer.probe_rows())


def probe_effect_rows(calls: int = 2000, repetitions: int = 5, engines: tuple[str, ...] = ENGINES,
                      progress=None) -> list[dict]:
    image = KernelImage.load(VMLINUX)
    rows = []
    for probes in PROBES:
        for engine in engines if probes != "none" else ("-",):
            row = probe_effect_row(probes, engine, calls, repetitions, image)
            rows.append(row)
            if progress:
                progress(row)
    base = rows[0]
    for row in rows:
        if row["counted_insns_per_call"] != base["insns_per_call"]:
            raise AssertionError(f"{row}: the performance counters counted {row['counted_insns_per_call']} "
                                 f"instructions a call, the untraced kernel runs {base['insns_per_call']}")
        row["slowdown"] = round(row["ns_per_call_median"] / base["ns_per_call_median"], 1) \
            if base["ns_per_call_median"] > 0 else None
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| probes | engine | tracepoints | probe hits / call | emulated insns / call | kernel insns / call "
        "(perf counter) | host ns / call (median) | x untraced |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(f"| {row['probes']} | {row['engine']} | {row['tracepoints']} | {row['hits_per_call']:g} "
                     f"| {row['insns_per_call']:,.1f} | {row['counted_insns_per_call']:,.1f} "
                     f"| {row['ns_per_call_median']:,.0f} | "
                     f"{'-' if row['slowdown'] is None else format(row['slowdown'], ',.1f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m kgtp_sim.bench.probe_effect [--calls N] [--repetitions N]`: this section of the benchmark alone."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kgtp_sim.bench.probe_effect", description=main.__doc__)
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--repetitions", type=int, default=5)
    args = parser.parse_args(argv)
    print(markdown(probe_effect_rows(calls=args.calls, repetitions=args.repetitions)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
