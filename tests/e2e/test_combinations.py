"""The combination suite in the test run (issue 26): every pair KGTP refuses is refused with KGTP's reason and the
kernel goes on. The seeded walk over the whole space (kgtp_sim/tools/combinations.py, `scripts/combinations
--seconds N`) joins the test run once a long run finds no failure: it still finds some (README, Reliability)."""

from __future__ import annotations

import pytest

from kgtp_sim.tools.combinations import Combination, Runner, run_one


@pytest.fixture(scope="module")
def runner():
    runner = Runner()
    yield runner
    runner.close()


@pytest.mark.parametrize("path, beside", [("kret", "stepping"), ("watch", "watches"), ("watch", "stepping"),
                                          ("stepping", "watches")])
def test_what_kgtp_refuses_is_refused_with_its_reason_and_the_kernel_goes_on(runner, path, beside):
    outcome = run_one(runner, Combination(engine="opt", path=path, cpus=2, beside=beside))
    assert not outcome.problems
