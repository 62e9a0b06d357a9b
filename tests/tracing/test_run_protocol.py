"""`core.run.Run` is what the layers above tracing's vocabulary may use of a run; `Tracer` is its one
implementation. Every member the protocol declares must exist on a real tracer, with a callable where the
protocol has a method, so the protocol cannot drift from what the hit paths and KGTP's features are given."""

from __future__ import annotations

import inspect

from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.tracing import Tracer
from kgtp_sim.tracing.api import TracerApi
from kgtp_sim.tracing.core.run import Run

from ..conftest import VMLINUX


def _members(protocol: type) -> tuple[set[str], set[str]]:
    attributes = set(inspect.get_annotations(protocol))
    methods = {name for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")}
    return attributes, methods


def test_the_tracer_has_every_member_of_the_run_protocol():
    tracer = Tracer(Machine(KernelImage.load(VMLINUX)), "opt")
    attributes, methods = _members(Run)
    assert {"machine", "ring", "kgtp", "native", "kret", "watches"} <= attributes
    assert {"stop", "check", "set_variable", "dump_stack"} <= methods
    missing = sorted(name for name in attributes | methods if not hasattr(tracer, name))
    assert not missing, f"Tracer lacks {missing}"
    not_callable = sorted(name for name in methods if not callable(getattr(tracer, name)))
    assert not not_callable


def test_the_tracer_answers_every_method_the_stub_may_call():
    _, methods = _members(TracerApi)
    assert methods, "TracerApi declares no method"
    missing = sorted(name for name in methods if not callable(getattr(Tracer, name, None)))
    assert not missing, f"Tracer lacks {missing}"
