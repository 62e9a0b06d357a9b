"""The breakpoint round-trip benchmark (kgtp_sim/bench/stops.py): both servers, every stop where it should be."""

from __future__ import annotations

import os

import pytest

from kgtp_sim.bench import stops


@pytest.mark.skipif(not (os.path.exists(stops.GDBSERVER) and os.path.exists(stops.GDB)), reason="needs gdbserver")
def test_both_servers_stop_at_every_call_and_are_reported_side_by_side():
    table = stops.rows(150)
    assert [row["server"] for row in table] == ["kgtp-sim", "gdbserver"]
    for row in table:
        assert row["stops"] == 100  # (150 // 50 - 1) timed batches of 50; each checked against the program's total
        assert 0 < row["us_per_stop_min"] <= row["us_per_stop_median"] <= row["us_per_stop_max"]
    assert table[0]["ratio_to_gdbserver"] > 0
    text = stops.markdown(table)
    assert "| kgtp-sim | 100 |" in text and "| gdbserver | 100 |" in text
