"""The combination suite's process runner (work in progress): the program (fixtures/combinations/callers.c),
built with the host's gcc.

Runs on the caller's thread.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from elftools.elf.elffile import ELFFile

from ...client.paths import FIXTURES
from .runner import CombinationFailure

SOURCE = FIXTURES / "combinations" / "callers.c"
#: the program's symbols the suite reads
SYMBOLS = ("counted_function", "round_end", "caller", "counter", "rounds", "interrupted_sleeps")


def build_program(out_dir: Path) -> Path:
    """callers.c compiled into out_dir (`gcc -O2 -static -pthread`: not PIE, its addresses those of its symbols)."""
    if shutil.which("gcc") is None:
        raise CombinationFailure("the process space needs gcc to build its program (fixtures/combinations/callers.c)")
    binary = out_dir / "callers"
    result = subprocess.run(["gcc", "-O2", "-static", "-pthread", str(SOURCE), "-o", str(binary)],
                            capture_output=True, text=True)
    if result.returncode:
        raise CombinationFailure(f"gcc callers.c failed: {result.stderr.strip()[-400:]}")
    return binary


def program_symbols(binary: Path) -> dict[str, int]:
    """The addresses of SYMBOLS in the built program (and the size of `caller`, as `caller_size`)."""
    with binary.open("rb") as f:
        table = ELFFile(f).get_section_by_name(".symtab")
        found = {}
        for name in SYMBOLS:
            symbol = table.get_symbol_by_name(name)
            if not symbol:
                raise CombinationFailure(f"{binary}: no symbol {name}")
            found[name] = symbol[0]["st_value"]
            if name == "caller":
                found["caller_size"] = symbol[0]["st_size"]
    return found
