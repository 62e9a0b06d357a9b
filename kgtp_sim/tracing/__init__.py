"""Tracing: the tracer's vocabulary (`model`, `frames`), probes, the ring, and the runs (`tracer`).

`Tracer` is the entry point the stub and the benchmark use (`api.TracerApi` is what the stub may call); the rest
of the package is what it is made of. The vocabulary modules import nothing heavy, so the wire layer can build
its packets from them: `Tracer` is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .core.model import TraceError

if TYPE_CHECKING:
    from .tracer import Tracer

__all__ = ["TraceError", "Tracer"]


def __getattr__(name: str):
    if name == "Tracer":
        from .tracer import Tracer

        return Tracer
    raise AttributeError(name)
