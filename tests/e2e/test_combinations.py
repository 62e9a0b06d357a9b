"""The combination suite's bounded run (issue 26): a seeded walk over engine, probe path, CPUs, buffer, condition,
action, pass count, changes during the run, what stands beside and how the run ends, each combination checked
against the kernel's own count of kgtp_test_function's calls (kgtp_sim/tools/combinations.py), and every pair
KGTP refuses refused with KGTP's reason. `scripts/combinations --seconds N` is the long run."""

from __future__ import annotations

import pytest

from kgtp_sim.tools.combinations import Combination, Runner, campaign, run_one

#: the walk of the suite: its seed and its time (seconds of combinations on this two-core machine)
SEED, SECONDS = 2026, 45


@pytest.mark.xfail(reason="open problems the walk still finds (reported with issue 26): beside four watch tracepoints "
                          "every CPU ends up spinning in spin_lock_slowpath (a kernel spinlock never released: the "
                          "kernel stops making calls); a while-stepping run ended by GDB's leaving reports fewer hits "
                          "than calls; a tracepoint added at the marker during a run misses one call now and then")
def test_a_seeded_walk_finds_no_failure():
    messages: list[str] = []
    ran, failures = campaign(SECONDS, SEED, report=messages.append)
    assert ran >= 20, messages
    assert not failures, "\n".join(messages)


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
