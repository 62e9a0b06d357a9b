"""scripts/gdb-testsuite end to end: one short gdb.trace file of GDB's own testsuite against Debian's gdbserver,
and the regression gate (`--gate`): its files against the stub, compared with fixtures/gdb-testsuite/gate.txt.

The Debian packages the harness needs (gdb-source, dejagnu, gdbserver...) are installed by `scripts/test` and
`scripts/gdb-testsuite`, not by pytest: when they are missing these tests fail under `scripts/test` (which exports
KGTP_SIM_GDB_TESTSUITE=required after installing them) and are skipped, saying why, under a bare pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kgtp_sim.client import ROOT
from kgtp_sim.tools import gdb_testsuite as gt
from kgtp_sim.tools import gdb_testsuite_gate as gate

pytestmark = [pytest.mark.gdb, pytest.mark.slow]

#: a short file (a few seconds): trace state variables, defined, listed, collected and read back in frames
FILE = "gdb.trace/tsv.exp"
#: the gate's run may first wait for another run holding the testsuite's cache (gdb_testsuite.Cache.locked)
GATE_TIMEOUT = 1800


@pytest.fixture(scope="module")
def packages():
    lacking = gt.missing()
    if lacking:
        why = "GDB's testsuite needs Debian's " + ", ".join(sorted(set(lacking.values())))
        if os.environ.get(gate.REQUIRED) == "required":
            pytest.fail(why + f" ({gate.REQUIRED}=required: scripts/test installed them, yet they are missing)")
        pytest.skip(why + " (scripts/test and scripts/gdb-testsuite install them; pytest alone does not)")


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


def test_the_regression_gate_finds_no_regression(packages, tmp_path):
    """Every test fixtures/gdb-testsuite/gate.txt records as PASS still passes against the stub, and the run is
    whole (each file ran, no Tcl ERROR). New passes are printed, to be recorded with `--gate --update`."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "kgtp_sim.tools.gdb_testsuite_gate", "--no-install",
                           "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=GATE_TIMEOUT)
    print(proc.stdout)
    assert proc.returncode == 0, f"the gate failed (exit status {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    total = proc.stdout.splitlines()[-1]
    assert total.startswith("gate ok: 0 regressions, "), proc.stdout
    ran = gt.files_of((tmp_path / "gdb.sum").read_text())
    assert sorted(ran) == sorted(gate.GATE)
