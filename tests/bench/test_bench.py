"""The benchmark's deterministic results (issue 6): instruction counts, frames, JSON schema. Never timings."""

from __future__ import annotations

import json

import pytest

from kgtp_sim.agent.opcodes import assemble
from kgtp_sim.bench.record import FIXTURE, load
from kgtp_sim.bench.report import markdown, write_json
from kgtp_sim.bench.runner import CASES, ENGINES, FIELDS, PROBES, Bench, Config, configurations, expected_frames
from kgtp_sim.client.paths import VMLINUX
from kgtp_sim.machine.image import KernelImage

CALLS = 50


@pytest.fixture(scope="module")
def rows():
    return Bench(calls=CALLS, repetitions=1).rows()


def by(rows, probe, case, engine):
    (row,) = [r for r in rows if (r["probe"], r["case"], r["engine"]) == (probe, case, engine)]
    return row


def test_fixture_is_gdb_13_bytecode():
    data = load(FIXTURE)
    dynamic = data["sites"]["dynamic"]
    assert data["gdb"].startswith("GNU gdb") and "13." in data["gdb"]
    function = KernelImage.load(VMLINUX).address_of("kgtp_test_function")  # the recording matches the kernel
    assert int(dynamic["address"], 16) == function and int(data["sites"]["static"]["address"], 16) == function + 7
    for site in data["sites"].values():
        for name in ("false_condition", "true_condition", "collect"):
            entry = site[name]
            assert entry["reg_mask"] == "30"  # rdi, rsi
            assert assemble("; ".join(entry["listing"])).hex() == entry["bytecode"]
            assert entry["command"].startswith("maint agent")
    # Table 4 of the thesis, as GDB 13 emits it: 2*counter1+3*counter2>0 ends in const8 0; swap; less_signed
    assert dynamic["true_condition"]["listing"][-4:] == ["const8 0", "swap", "less_signed", "end"]
    assert dynamic["collect"]["listing"][-2:] == ["pop", "end"]


def test_untraced_loop_is_nine_instructions_per_call(rows):
    assert by(rows, "none", "none", "none")["insns_per_hit"] == 9
    assert by(rows, "disabled-marker", "none", "none")["insns_per_hit"] <= 1  # the site's one nop


def test_every_row_is_integral_and_frames_match(rows):
    assert len(rows) == len(configurations())
    for row in rows:
        assert float(row["insns_per_hit"]).is_integer(), row
        assert row["frames"] == expected_frames(row, CALLS), row


def test_opt_never_costs_more_than_naive(rows):
    for row in rows:
        if row["engine"] == "opt":
            naive = by(rows, row["probe"], row["case"], "naive")
            assert row["insns_per_hit"] <= naive["insns_per_hit"], row


def test_native_false_condition_is_short(rows):
    for probe in ("dynamic-jump", "static"):
        opt = by(rows, probe, "false-cond", "opt")["insns_per_hit"]
        assert 0 < opt < by(rows, probe, "false-cond", "naive")["insns_per_hit"]
        # the target (issue 6), everything included: 16 at the jump probe, 15 at the marker, since the fast
        # path runs the condition inline on the site's registers (28 and 27 with a register block and a call)
        assert opt <= 25


def test_frames_cost_what_they_collect(rows):
    """Issue 13's targets, everything included, optimizing engine: the thesis' `collect (2*counter1+3*counter2)`
    records rdi, rsi and rip in a compact block written straight into the ring (the expression itself is
    silent: GDB reads its value back from those registers), at most 60 instructions a hit; with the condition
    in front, at most 80; both at most a third of the naive engine's, at every probe."""
    for probe in ("dynamic-jump", "dynamic-int3", "static"):
        expr, both = (by(rows, probe, case, "opt")["insns_per_hit"] for case in ("expr", "cond+expr"))
        assert expr <= 60 and both <= 80, (probe, expr, both)
        assert 3 * expr <= by(rows, probe, "expr", "naive")["insns_per_hit"], probe
        assert 3 * both <= by(rows, probe, "cond+expr", "naive")["insns_per_hit"], probe
    # `collect $_sdata` at module::kgtp_module_event: its fields are register values, built on the short path
    assert by(rows, "static", "sdata", "opt")["insns_per_hit"] <= 60


def test_json_schema_and_markdown(rows, tmp_path):
    path = tmp_path / "rows.json"
    write_json(rows, path)
    data = json.loads(path.read_text())
    for row in data:
        assert tuple(row) == FIELDS
        assert row["probe"] in PROBES and row["case"] in CASES and row["engine"] in ENGINES
        assert isinstance(row["frames"], int)
        for key in FIELDS[3:7]:
            assert row[key] is None or isinstance(row[key], (int, float))
    table = markdown(rows, CALLS, 1)
    assert table.count("\n| ") == len(rows) + 1 and "different unit" in table


def test_the_cli_prints_and_writes_every_table(tmp_path, capsys):
    """One run of the benchmark's command line (the tables' contents are the other tests'): our rows, gdbserver's
    beside them (where gdbserver and its in-process agent can be installed), the probe effect, as JSON and as the
    printed tables."""
    from kgtp_sim.bench import peer
    from kgtp_sim.bench.cli import main
    from kgtp_sim.bench.probe_effect import ENGINES as EFFECT_ENGINES

    try:
        peer.ensure_gdbserver(install=True)
        unavailable = None
    except peer.PeerUnavailable as exc:
        unavailable = str(exc)
    out, effect = tmp_path / "b.json", tmp_path / "effect.json"
    args = ["--calls", "20", "--repetitions", "1", "--json", str(out), "--probe-effect-json", str(effect),
            "--no-stops", "--no-programs"]  # their tables: test_stops.py, test_programs.py
    assert main(args + (["--no-peer"] if unavailable else [])) == 0
    rows = json.loads(out.read_text())
    table = capsys.readouterr().out
    ours = [r for r in rows if not r["probe"].startswith("gdbserver")]
    assert len(ours) == len(configurations())
    assert "| dynamic-jump | false-cond | opt |" in table and "| dynamic-jump | expr | opt |" in table
    assert len(json.loads(effect.read_text())) == 1 + 2 * len(EFFECT_ENGINES)
    assert "Probe effect of function-boundary tracing" in table and "| entry+return | opt |" in table
    if unavailable:
        pytest.skip(f"gdbserver with libinproctrace.so cannot be installed here: {unavailable}")
    theirs = [r for r in rows if r["probe"].startswith("gdbserver")]
    assert {(r["probe"], r["case"]) for r in theirs} >= {
        ("gdbserver-trap", case) for case in ("false-cond", "expr", "cond+expr")} | {
        ("gdbserver-fast", case) for case in ("false-cond", "expr", "cond+expr")}
    assert all(r["insns_per_hit"] is None and r["ns_per_hit_median"] is not None for r in theirs)
    assert "| gdbserver-fast | expr | gdbserver |" in table


def test_configs_cover_issue_matrix():
    configs = set(configurations())
    assert Config("static", "sdata", "opt") in configs and Config("dynamic-int3", "expr", "interp") in configs
