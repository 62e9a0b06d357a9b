"""The combination suite in the test run (issue 26): a walk of one seed over every dimension, each combination
checked against the count of its space (the kernel's, or the program's under the gdbserver role); every pair KGTP
refuses is refused with KGTP's reason and the kernel goes on; the runner sees a call the tick preempted where it
waits. Longer walks (`scripts/combinations --seconds N`,
kgtp_sim/tools/combinations/) are the soak: README, Reliability, records the last hour's."""

from __future__ import annotations

import itertools

import pytest

from kgtp_sim.machine.scheduler import TIMER_VECTOR
from kgtp_sim.tools.combinations import DIMENSIONS, Combination, Halt, Runners, Window, expected_fired, run_one, walk


@pytest.fixture(scope="module")
def runners():
    runners = Runners()
    yield runners
    runners.close()


#: the test run's walk: its seed and length (every value of every dimension comes within its first 166; 121 of
#: the 240 are in the process space)
WALK_SEED, WALK_LENGTH = 2611, 240


def test_a_walk_over_every_dimension_finds_no_failure(runners):
    combinations = list(itertools.islice(walk(WALK_SEED), WALK_LENGTH))
    for name, values in DIMENSIONS.items():
        assert {getattr(c, name) for c in combinations} == set(values), name
    for space in DIMENSIONS["space"]:  # and every path in each space
        assert {c.path for c in combinations if c.space == space} == set(DIMENSIONS["path"]), space
    failures = []
    for number, c in enumerate(combinations, start=1):
        outcome = run_one(runners, c)
        if outcome.problems:
            failures.append(f"combination {number}: --only '{c.spec()}'\n  " + "\n  ".join(outcome.problems[:8]))
    assert not failures, f"seed {WALK_SEED}: " + "\n".join(failures)


@pytest.mark.parametrize("space, path, beside", [
    ("kernel", "kret", "stepping"), ("kernel", "watch", "watches"), ("kernel", "watch", "stepping"),
    ("kernel", "stepping", "watches"), ("process", "kret", "none"), ("process", "watch", "stepping"),
    ("process", "stepping", "watches"),
])
def test_what_kgtp_refuses_is_refused_with_its_reason_and_the_kernel_goes_on(runners, space, path, beside):
    outcome = run_one(runners, Combination(space=space, engine="opt", path=path, cpus=2, beside=beside))
    assert not outcome.problems


def test_a_thread_interrupted_inside_the_function_is_counted_where_it_waits(runners):
    """The oracle's view of a call the tick preempted: the benchmark thread stopped at the marker (a breakpoint
    there, between the call's add and its marker) counts as a call in flight from its CPU's pc; a timer interrupt
    delivered there, as the machine delivers one (`Cpu.deliver`), moves the CPU into the handler, and the call is
    then read back from the interrupt frame on the thread's stack, counting the same."""
    runner = runners.kernel
    h = runner.harness(1)
    machine, marker = h.machine, runner.sites.marker
    control = machine.control
    control.stop()
    control.insert_breakpoint(marker)
    try:
        event = control.wait(control.resume(), timeout=30)
    finally:
        control.remove_breakpoint(marker)
    assert event is not None and event.address == marker
    at_marker = runner.halt(h, 1)
    assert at_marker.pcs == [marker] and marker not in at_marker.waiting
    saved = machine.registers(0)

    def tick(uc) -> None:
        machine.cpu.deliver(TIMER_VECTOR)

    machine.on_cpu(0, tick, stay=False)
    try:
        in_handler = runner.halt(h, 1)
    finally:
        machine.set_registers(saved, cpu=0)
    assert in_handler.pcs == [runner.image.address_of("asm_timer_interrupt")]
    assert in_handler.waiting == [marker]
    marker_path, later = Combination(path="marker"), Halt(at_marker.counter + 10, [0])
    for start in (at_marker, in_handler):  # ten calls, and the one in flight
        assert expected_fired(marker_path, Window.between(start, later), runner.sites) == 11
    h.request(b"qRcmd," + b"go".hex().encode())
    runner.healthy(1)
