"""Trace state variables with real GDB: one store, whatever runs the hit.

The scenario a user tries first: a counter incremented with `teval` at a location that a second tracepoint
shares (so the location runs through one int3 in Python beside compiled code). The frames must read 1, 2, 3...
and `info tvariables` the number of hits, under every engine.
"""

from __future__ import annotations

import re

import pytest

from ..conftest import run_gdb, start_stub, wait_for_hits


@pytest.mark.parametrize("engine", ["interp", "naive", "opt"])
def test_a_counter_counts_on_a_shared_address_under_every_engine(gdb, engine):
    server = start_stub("--engine", engine)
    try:
        out = run_gdb(gdb, server, "monitor pace 5", "tvariable $hits = 0",
                      "trace kgtp_test_function", "actions", "teval $hits = $hits + 1", "collect $hits", "end",
                      "trace kgtp_test_function if (counter1 < 0)", "actions", "collect counter1", "end",
                      "tstart", *wait_for_hits(1, 5), "tstop", "info tvariables",
                      "tfind 0", "print $hits", "tfind 1", "print $hits", "tfind 2", "print $hits", "tstatus")
    finally:
        server.stop()
    printed = [int(v) for v in re.findall(r"^\$\d+ = (-?\d+)$", out, re.M)]
    assert printed == [1, 2, 3], out
    frames = int(re.search(r"Collected (\d+) trace frames", out).group(1))
    current = re.search(r"^\$hits\s+0\s+(\d+)\s*$", out, re.M)
    assert current and int(current.group(1)) == frames >= 5, out  # every hit counted, none lost
