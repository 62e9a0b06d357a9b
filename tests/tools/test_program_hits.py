"""The stub's rows for tracepoints in a program (kgtp_sim/tools/program_hits.py) and their table beside gdbserver's
(bench/report.py's program_markdown): one short run of every row."""

from __future__ import annotations

import shutil

import pytest

from kgtp_sim.bench.report import program_markdown
from kgtp_sim.bench.runner import FIELDS
from kgtp_sim.tools.program_hits import CASES, EXTRA, PROBES, markdown, rows

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")


def test_every_row_is_exact_compiled_and_collects_every_call():
    table = rows(windows=2, calls=50)
    assert [(r["probe"], r["case"]) for r in table] == [("stub-none", "none")] + [
        (probe, case) for probe in PROBES.values() for case in CASES]
    for row in table:
        assert tuple(row) == (*FIELDS, *EXTRA)
        assert row["windows"] >= 2 and row["calls"] >= row["windows"] * 50
        assert row["insns_per_hit"] is not None and row["python_hits"] == 0, row
        if row["probe"] != "stub-none":
            assert row["insns_per_hit"] == int(row["insns_per_hit"]), row  # a whole number of instructions a hit
            assert row["engine"] == "opt"
            assert row["frames"] == row["hits"] == (0 if row["case"] == "false-cond" else row["calls"]), row
    cost = {(r["probe"], r["case"]): r["insns_per_hit"] for r in table}
    for probe in PROBES.values():
        # decided in the pad < through the gate < the same and a condition on the way
        assert cost[probe, "false-cond"] < cost[probe, "expr"] < cost[probe, "cond+expr"], cost
    for case in CASES:  # an int3 and a jump each take the probed instruction's place, one for one
        assert cost["stub-trap", case] == cost["stub-fast", case], cost
    assert markdown(table).count("\n| stub-") == len(table)
    printed = program_markdown(table)
    assert printed.count("\n| stub-") == len(table) and "gdbserver rows" in printed
