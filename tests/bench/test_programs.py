"""Programs on the kernel, timed (bench/programs.py): the exact and deterministic parts only, never host timings.
One small run of the whole section (every row, the RSS soak over 2,000 switches) is shared by the tests, less the
switch row: its windows count only where two processes ping-pong through every yield, which depends on how the
host schedules the machine's ticks and spawns (on a busy host none may qualify), so it is the benchmark's alone."""

from __future__ import annotations

import dataclasses

import pytest

from kgtp_sim.bench import programs

ISSUE_GETPID_BOUND = 150  #: the issue: a getpid round trip in at most 150 emulated instructions


@pytest.fixture(scope="module")
def table() -> dict[str, dict]:
    rows = programs.rows(dataclasses.replace(programs.Sizes.small(), yields=0))
    if "skipped" in rows[0]:
        pytest.skip(rows[0]["skipped"])
    return {row["row"]: row for row in rows}


def test_every_row_is_there_with_its_figures(table):
    assert list(table) == ["hello", "loop (user)", "loop (kernel)", "getpid", "kgtp-sim run", "rss (1 CPU)"]
    for name in ("hello", "kgtp-sim run"):
        assert table[name]["runs"] == 1 and table[name]["seconds_median"] > 0
    # the hello world's user instructions are part of what the machine counted from spawn to exit
    assert 0 < table["hello"]["user_insns"] < table["hello"]["insns_median"]
    for name in ("loop (user)", "loop (kernel)"):
        assert table[name]["insns_per_s"] > 0 and table[name]["ratio_to_kernel"] > 0
    text = programs.markdown(list(table.values()))
    assert sum(line.startswith("| ") for line in text.splitlines()) == 3 + 2 + 3 + 1  # three headers, the rows (no switch row here)
    assert "getpid round trip" in text and "rss (1 CPU)" in text


def test_the_loop_counts_exactly_in_both_modes(table):
    """kgtp_bench_loop: the kernel's lea mov add call (addl nopl ret) cmp jne, gcc -O2's user twin the same
    without the marker's nopl; counted over windows of n and 2n calls, so nothing else is in the figure."""
    assert table["loop (kernel)"]["insns"] == 9
    assert table["loop (user)"]["insns"] == 8 and table["loop (user)"]["exact"]


def test_a_getpid_round_trip_is_counted_exactly(table):
    row = table["getpid"]
    assert row["exact"]  # every clean window of each size counted the same
    assert row["insns_per_call"] == int(row["insns_per_call"]) > 5  # the user loop's 5 and the kernel's path
    assert row["ns_per_call"] > 0


def test_a_getpid_round_trip_is_within_the_issues_bound(table):
    assert table["getpid"]["insns_per_call"] <= ISSUE_GETPID_BOUND


def test_the_soak_switched_as_often_as_asked_and_sampled_memory(table):
    row = table["rss (1 CPU)"]
    assert row["switches"] >= 2_000 and row["samples"] >= 2  # before the first process, and after the last
    assert 0 < row["rss_base_mib"] <= row["rss_max_mib"]
    assert row["flat"] == (row["rss_max_mib"] - row["rss_base_mib"] <= row["tolerance_mib"])
