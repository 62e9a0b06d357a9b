"""Optional dependencies: packages only some commands need, imported when first needed (caller's thread).

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
