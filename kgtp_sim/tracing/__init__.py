"""Tracing: the tracer's vocabulary (tracepoints, actions, status, frames), probes, the ring, and the runs.

`Tracer` is the entry point the stub and the benchmark use; the rest of the package is what it is made of.
"""

from .tracer import TraceError, Tracer

__all__ = ["TraceError", "Tracer"]
