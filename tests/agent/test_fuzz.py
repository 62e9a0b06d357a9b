"""Differential fuzzing: generated well-formed bytecode must behave identically under every engine."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .bytecode_gen import bytecode, registers, trace_limits, tsv_values
from .harness import Differential

EXAMPLES = int(os.environ.get("KGTP_FUZZ_EXAMPLES", "600"))


@pytest.fixture(scope="module")
def diff() -> Differential:
    return Differential()


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(code=bytecode(), regs=registers, tsvs=tsv_values, limit=trace_limits, budget=st.integers(0, 6))
def test_engines_agree(diff: Differential, code: bytes, regs, tsvs, limit: int, budget: int) -> None:
    diff.check(code, regs, tsvs, trace_limit=limit, loop_budget=budget)
