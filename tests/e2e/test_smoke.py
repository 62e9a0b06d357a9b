"""The CI smoke script itself (scripts/smoke): a fresh server and a scripted GDB session, all checks PASS."""

import subprocess
import sys

import pytest

from ..conftest import GDB_CLIENTS, ROOT


@pytest.mark.skipif(not any(c.version == "13" for c in GDB_CLIENTS), reason="needs the system gdb")
def test_smoke_script_passes():
    result = subprocess.run([sys.executable, "-m", "kgtp_sim.tools.smoke"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout and result.stdout.count("PASS:") == 5
