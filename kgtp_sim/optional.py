"""Optional dependencies: packages only some commands need, imported when first needed (caller's thread); and
`LazyModule`, a required package's module imported on the first use of one of its names.

The stub itself needs only the packages pyproject.toml lists as dependencies. Drawing (`kgtp-sim plot`,
`hotcode --png`, `bench --chart`) needs matplotlib, which is in the `view` and `bench` extras; `scripts/serve`
installs the `view` extra. `pyplot(purpose)` imports it or raises `MissingDependency`, whose text says in one
line what is missing and the command that installs it into the running interpreter; `kgtp_sim.cli.main` prints
that line instead of a traceback and exits 1. Commands call `pyplot` before their long work (reading a trace,
sampling, benchmarking), so a missing package is reported first, not last.
"""

from __future__ import annotations

import importlib
import shlex
import sys


class LazyModule:
    """A module imported on the first use of one of its names (`X = LazyModule("capstone.x86_const")`, then
    `X.X86_INS_RET` in a function): a server that never decodes code never loads capstone (25 ms a start). Names
    are read from the module once and kept. Any thread (an import is under Python's import lock)."""

    def __init__(self, name: str) -> None:
        self.__dict__["_LazyModule__name"] = name

    def __getattr__(self, attribute: str):
        value = getattr(importlib.import_module(self.__name), attribute)
        self.__dict__[attribute] = value
        return value


class MissingDependency(RuntimeError):
    """An optional package cannot be imported; the message is one line naming what to install and how."""


def require(module: str, purpose: str, package: str | None = None):
    """Import `module`, or raise MissingDependency saying `purpose` needs `package` (default: the module's
    top-level name) and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = package or module.split(".")[0]
        missing = getattr(error, "name", None)
        cause = "is not installed" if missing in (None, package, module) else f"cannot be imported ({error})"
        install = f"{shlex.quote(sys.executable)} -m pip install {package}"
        raise MissingDependency(f"{purpose} needs {package}, which {cause}; install it with: {install}") from None


def pyplot(purpose: str = "drawing pictures"):
    """matplotlib.pyplot on the Agg backend (PNG files, no display)."""
    matplotlib = require("matplotlib", purpose)
    matplotlib.use("Agg")
    return require("matplotlib.pyplot", purpose, "matplotlib")
