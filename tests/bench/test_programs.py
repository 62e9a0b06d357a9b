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
    assert list(table) == ["hello", "loop (user)", "loop (kernel)", "loop (kernel text)", "getpid", "kgtp-sim run",
                           "rss (1 CPU)"]
    for name in ("hello", "kgtp-sim run"):
        assert table[name]["runs"] == 1 and table[name]["seconds_median"] > 0
    # the hello world's user instructions are part of what the machine counted from spawn to exit
    assert 0 < table["hello"]["user_insns"] < table["hello"]["insns_median"]
    # host times are the benchmark's to judge (a small run on a busy host may even time n calls under 0 calls):
    # here only that each side was timed in every round, at 0 and at n calls
    for name in ("loop (user)", "loop (kernel)", "loop (kernel text)"):
        assert all(isinstance(table[name][key], float) for key in ("ns", "insns_per_s", "ratio_to_kernel"))
    assert table["loop (user)"]["windows"][0] >= 2 and table["loop (user)"]["windows"][1] >= 2  # a clean one a round
    assert table["loop (kernel)"]["windows"] == table["loop (kernel text)"]["windows"] == [2 * 2, 2 * 2]
    assert table["loop (kernel)"]["ratio_to_kernel"] == 1
    text = programs.markdown(list(table.values()))
    assert sum(line.startswith("| ") for line in text.splitlines()) == 3 + 2 + 4 + 1  # three headers, the rows (no switch row here)
    assert "getpid round trip" in text and "rss (1 CPU)" in text


def test_the_loop_counts_exactly_in_both_rings(table):
    """ring_loop: lea mov add call (addl nopl ret) cmp jne, the same bytes in a process and copied into kernel
    memory, and the kernel's kgtp_bench_loop, the same instructions; counted over windows (calls) of n and 2n, so
    nothing else is in the figure."""
    for name in ("loop (user)", "loop (kernel)", "loop (kernel text)"):
        assert table[name]["insns"] == 9 and table[name]["exact"], name
    assert table["loop (user)"]["bytes"] == table["loop (kernel)"]["bytes"]


def test_ring_loops_bytes_run_in_ring_0_as_copied(tmp_path):
    """The copy is the program's bytes, at the same offset in a page, and runs as the kernel's code: n calls of
    ring_function, each one adding to the counter."""
    from kgtp_sim.client.paths import VMLINUX
    from kgtp_sim.machine import KernelImage, Machine

    try:
        binary = programs.build(tmp_path)["windows"]
    except programs.Unavailable as error:
        pytest.skip(str(error))
    loop, end = programs.symbols_of(binary, "ring_loop", "ring_end")
    machine = Machine(KernelImage.load(VMLINUX))
    address, counter, code = programs.ring0_copy(machine, binary)
    assert code == programs.bytes_at(binary, loop, end - loop) and len(code) == end - loop > 0
    assert machine.read_memory(address, len(code)) == code
    assert address % 4096 == loop % 4096 and address >= 0xFFFF800000000000
    assert machine.call(address, 7, counter) == 7
    assert int.from_bytes(machine.read_memory(counter, 4), "little") == 7


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
