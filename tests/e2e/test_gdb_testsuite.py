"""scripts/gdb-testsuite end to end: one short gdb.trace file of GDB's own testsuite against Debian's gdbserver.

Skipped when the Debian packages the harness installs (gdb-source, dejagnu, gdbserver...) are not there: the
suite does not install them; `scripts/gdb-testsuite` does.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kgtp_sim.client import ROOT
from kgtp_sim.tools import gdb_testsuite as gt

pytestmark = [pytest.mark.gdb, pytest.mark.slow]

#: a short file (a few seconds): trace state variables, defined, listed, collected and read back in frames
FILE = "gdb.trace/tsv.exp"


@pytest.fixture(scope="module")
def packages():
    lacking = gt.missing()
    if lacking:
        pytest.skip("GDB's testsuite needs Debian's " + ", ".join(sorted(set(lacking.values())))
                    + " (scripts/gdb-testsuite installs them; the suite does not)")


def test_one_trace_file_against_gdbserver(packages, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "kgtp_sim.tools.gdb_testsuite", "--server", "gdbserver",
                           "--no-install", "--out", str(tmp_path), FILE],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "native-gdbserver" / "gdbserver"
    summary = (out / "gdb.sum").read_text()
    log = (out / "gdb.log").read_text()
    # the stock board started Debian's gdbserver for the program, and the same GDB ran the file
    assert "spawn /usr/bin/gdbserver --once localhost:" in log
    assert "/usr/bin/gdb -nw -nx" in log
    results = gt.parse_sum(summary)
    assert results and {r.file for r in results} == {FILE}
    passes = sum(r.outcome == "PASS" for r in results)
    assert passes > 0
    # what is printed is what the copied gdb.sum says
    report = proc.stdout
    assert report.startswith("== native-gdbserver: 1 file; wall time: gdbserver ")
    header, row = [line for line in report.splitlines() if line.startswith(("file ", FILE))]
    assert header.split()[:3] == ["file", "|", "PASS"]
    counts = row.split("|")[1].split()
    kinds = gt.columns([gt.Run("native-gdbserver", "gdbserver", [FILE], results, 0.0)])
    assert [int(c) for c in counts] == [sum(r.outcome == k for r in results) for k in kinds]
    assert (tmp_path / "native-gdbserver" / "summary.txt").read_text() == report.rstrip("\n") + "\n"
