"""The probe effect of function-boundary tracing (bench/probe_effect.py): deterministic results only, never
timings. Every function probed changes nothing of what the kernel runs: the machine's performance counters count
the untraced loop's instructions in every row, while the machine's own count shows the probes' cost."""

from __future__ import annotations

from kgtp_sim.bench.probe_effect import ENGINES, PROBES, markdown, probe_effect_rows
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.tracing import Tracer

from ..conftest import VMLINUX


def test_every_row_counts_the_untraced_kernels_instructions():
    rows = probe_effect_rows(calls=50, repetitions=1)
    assert [(r["probes"], r["engine"]) for r in rows] == [("none", "-")] + [
        (p, e) for p in PROBES[1:] for e in ENGINES]
    functions = Tracer(Machine(KernelImage.load(VMLINUX))).function_probes()
    untraced = rows[0]
    # lea mov add call (kgtp_test_function: addl nopl ret) cmp jne
    assert untraced["insns_per_call"] == untraced["counted_insns_per_call"] == 9
    for row in rows[1:]:
        assert row["counted_insns_per_call"] == 9, row
        assert row["insns_per_call"] > 9, row  # the probes' own instructions, which the counters leave out
        entries = sum(bool(f.entry) for f in functions)
        if row["probes"] == "entry":
            assert row["tracepoints"] == entries and row["hits_per_call"] == 1, row
        else:
            assert row["tracepoints"] == entries + sum(f.returns for f in functions), row
            assert row["hits_per_call"] == 2, row  # kgtp_test_function's entry and its return
    table = markdown(rows)
    assert table.count("\n| ") == len(rows) and "perf counter" in table
