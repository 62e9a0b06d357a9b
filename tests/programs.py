"""The test programs (tests/programs/*.c), compiled by the suite in each linking mode the kernel runs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SOURCES = Path(__file__).resolve().parent / "programs"

#: linking mode -> compiler command line (before the source and -o)
MODES = {
    "musl-static": ("musl-gcc", "-static", "-O2"),
    "glibc-static": ("gcc", "-static", "-O2"),
    "glibc-static-pie": ("gcc", "-static-pie", "-O2"),
}


def compile_program(name: str, mode: str, out_dir: Path) -> Path:
    """tests/programs/NAME.c built in `mode` into out_dir (skips the test if the compiler is missing)."""
    command = MODES[mode]
    if shutil.which(command[0]) is None:
        pytest.skip(f"{command[0]} is not installed (scripts/test installs it)")
    out = out_dir / f"{name}-{mode}"
    if not out.exists():
        subprocess.run([*command, str(SOURCES / f"{name}.c"), "-o", str(out), "-lm"], check=True,
                       capture_output=True)
    return out
