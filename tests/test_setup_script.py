"""scripts/lib/setup.sh and scripts/serve: the venv `scripts/serve` makes has what the first session uses, and
scripts asking for different extras do not take turns reinstalling. The shell functions run for real, in a
scratch directory whose `.venv/bin/python` records the pip commands instead of running them."""

from __future__ import annotations

import hashlib
import re
import subprocess
import tomllib

from .conftest import ROOT

SETUP = ROOT / "scripts" / "lib" / "setup.sh"


def extras_of(script: str) -> list[str]:
    """The extras a script's `ensure_venv` line asks for."""
    match = re.search(r"^ensure_venv(?:[ \t]+\"?([\w,]+)\"?)?", (ROOT / "scripts" / script).read_text(), re.M)
    assert match, f"scripts/{script} does not call ensure_venv"
    return match.group(1).split(",") if match.group(1) else []


def test_serve_installs_matplotlib_for_plot():
    """The first session ends with `kgtp-sim plot run.tf -o pics` (kgtp-sim --help), in the venv scripts/serve
    made: one of the extras it installs brings matplotlib."""
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = [requirement for extra in extras_of("serve") for requirement in optional[extra]]
    assert any(re.match(r"matplotlib\b", requirement) for requirement in wanted), wanted


def ensure_venv(directory, extras: str) -> list[str]:
    """Run `ensure_venv EXTRAS` in `directory`; the pip install commands it ran."""
    log = directory / "pip.log"
    log.touch()
    before = len(log.read_text().splitlines())
    subprocess.run(["bash", "-c", f'set -euo pipefail; . "{SETUP}"; ensure_venv "$1"', "ensure_venv", extras],
                   cwd=directory, check=True, capture_output=True, text=True)
    return [line for line in log.read_text().splitlines()[before:] if " install -e " in line]


def test_an_install_keeps_the_extras_installed_before(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'scratch'\n")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "python $*" >> "{tmp_path}/pip.log"\n')
    python.chmod(0o755)
    digest = hashlib.sha256((tmp_path / "pyproject.toml").read_bytes()).hexdigest()
    (tmp_path / ".venv" / ".kgtp-installed-bench,test").write_text(digest + "\n")  # what scripts/test installed

    assert ensure_venv(tmp_path, "test,bench") == []  # covered: nothing to do
    assert ensure_venv(tmp_path, "view") == ["python -m pip install -e .[bench,test,view]"]
    assert [p.name for p in (tmp_path / ".venv").glob(".kgtp-installed*")] == [".kgtp-installed-bench,test,view"]
    assert ensure_venv(tmp_path, "test,bench") == []  # scripts/test after scripts/serve: still covered
    assert ensure_venv(tmp_path, "view") == []
    assert ensure_venv(tmp_path, "") == []

    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'changed'\n")  # what was installed is stale
    assert ensure_venv(tmp_path, "view") == ["python -m pip install -e .[view]"]
