"""The gdbserver comparison of the benchmark, end to end: the thesis workload as a user program under Debian's
gdbserver 13 and its in-process agent, driven by real GDB. Behaviour only (frames, counted hits, the bytecode
GDB compiles): never timings."""

from __future__ import annotations

import json
import statistics
import subprocess

import pytest

from kgtp_sim.bench import peer
from kgtp_sim.bench.record import COMMANDS, EXPR, FIXTURE, load, parse_listing
from kgtp_sim.bench.runner import FIELDS  # the schema the rows follow

pytestmark = [pytest.mark.gdb, pytest.mark.slow]

CALLS = 200
REPETITIONS = 2


@pytest.fixture(scope="module")
def available():
    try:
        peer.ensure_gdbserver(install=True)
    except peer.PeerUnavailable as exc:
        pytest.skip(f"gdbserver with libinproctrace.so cannot be installed here: {exc}")


@pytest.fixture(scope="module")
def result(available):
    return peer.measure(calls=CALLS, repetitions=REPETITIONS)


@pytest.fixture(scope="module")
def rows(result):
    return peer.rows_from(result)


@pytest.fixture(scope="module")
def binary(available, tmp_path_factory):
    return peer.build(tmp_path_factory.mktemp("peer"))


def by(rows, probe, case):
    (row,) = [r for r in rows if (r["probe"], r["case"]) == (probe, case)]
    return row


def test_cases_are_the_benchmarks():
    assert peer.EXPRESSION == EXPR
    assert peer.condition("false-cond") == COMMANDS["false_condition"][1]
    assert peer.condition("cond+expr") == COMMANDS["true_condition"][1]
    assert peer.actions("expr") == peer.actions("cond+expr") == [f"collect {COMMANDS['collect'][1]}"]
    assert peer.condition("expr") is None and peer.actions("false-cond") == []


def test_gdb_compiles_the_fixtures_bytecode_on_the_program(binary):
    """Same function, same registers: GDB emits on the program the bytecode the simulator's rows run."""
    dynamic = load(FIXTURE)["sites"]["dynamic"]
    argv = ["/usr/bin/gdb", "-batch", "-nx", str(binary)]
    names = list(COMMANDS)
    for name in names:
        kind, expr = COMMANDS[name]
        argv += ["-ex", f"maint {kind} -at {peer.FUNCTION}, {expr}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    listings = parse_listing(done.stdout)
    assert len(listings) == len(names), done.stderr
    for name, listing in zip(names, listings):
        assert listing["ops"] == dynamic[name]["listing"], name
        assert listing["reg_mask"] == dynamic[name]["reg_mask"] == "30"


def test_program_runs_standalone(binary):
    done = subprocess.run([str(binary), "100", "3"], capture_output=True, text=True, timeout=30, check=True)
    values = [float(line) for line in done.stdout.split()]
    assert len(values) == 3 and all(v > 0 for v in values)


def test_every_probe_and_case_is_measured(rows, result):
    assert [(r["probe"], r["case"]) for r in rows] == [("gdbserver-none", "none")] + [
        (p, c) for p in ("gdbserver-trap", "gdbserver-fast") for c in peer.CASES]
    assert result["gdbserver"].startswith("GNU gdbserver") and " 13." in result["gdbserver"]
    assert len(result["untraced_ns"]) == REPETITIONS
    for entry in result["rows"]:
        assert len(entry["ns"]) == len(entry["frames"]) == REPETITIONS


def test_rows_have_the_benchmark_schema(rows):
    for row in rows:
        assert tuple(row)[: len(FIELDS)] == FIELDS
        assert set(row) == set(FIELDS) | set(peer.EXTRA)
        assert set(peer.FIELDS) <= set(FIELDS)
        for key in set(FIELDS) - set(peer.FIELDS):
            assert row[key] is None, key  # the benchmark's other fields: not measured on native code
        assert row["insns_per_hit"] is None and isinstance(row["frames"], int)
        assert row["calls"] == CALLS
    json.dumps(rows)


def test_frames_per_batch(rows):
    for probe in ("gdbserver-trap", "gdbserver-fast"):
        assert by(rows, probe, "false-cond")["frames"] == 0
        assert by(rows, probe, "expr")["frames"] == CALLS
        assert by(rows, probe, "cond+expr")["frames"] == CALLS


def test_every_call_is_a_counted_hit(rows):
    """False conditions make no frame, yet the probe ran on every call; true ones collect on every call."""
    for row in rows[1:]:
        assert row["hit_calls"] == CALLS, row
        assert row["hits"] == CALLS, row
        assert row["hit_frames"] == peer.expected_frames(row["case"], CALLS), row
        assert peer.check(row) is None, row


def test_host_times_are_positive_and_relative_to_untraced(rows, result):
    base = statistics.median(result["untraced_ns"])
    assert base > 0 and all(x > 0 for x in result["untraced_ns"])
    assert rows[0]["ns_per_hit_median"] == round(base, 1)
    for entry, row in zip(result["rows"], rows[1:]):
        assert all(x > 0 for x in entry["ns"]), entry
        assert row["ns_per_hit_median"] == pytest.approx(statistics.median(entry["ns"]) - base, abs=0.1)
        assert row["ns_per_hit_min"] <= row["ns_per_hit_median"] <= row["ns_per_hit_max"]


def test_check_flags_wrong_rows(rows):
    row = dict(by(rows, "gdbserver-fast", "false-cond"))
    assert peer.check(row) is None
    assert "hits" in peer.check({**row, "hits": CALLS - 1})
    assert "frames" in peer.check({**row, "frames": 1})
    assert "counting batch" in peer.check({**row, "hit_frames": CALLS})


def test_ensure_gdbserver_shell_function_is_idempotent(available):
    done = subprocess.run(["bash", "-c", f'. "{peer.PEER_SH}" && ensure_gdbserver && echo ok'],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
