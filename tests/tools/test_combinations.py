"""The combination suite's generator and oracle (kgtp_sim/tools/combinations.py), without a kernel: a seed gives the
same walk, a spec reads back, every value of every dimension is reached, the pairs KGTP refuses are named with
KGTP's reason, and the oracle catches a lost hit, a doubled one and a wrong refusal on made-up runs."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from kgtp_sim.machine import KernelImage
from kgtp_sim.tools.combinations import (
    DIMENSIONS, MAIN, Combination, Frame, Observed, Sites, Window, check, generate, normalize, refusal, walk,
)

from ..conftest import VMLINUX

SITES = Sites.of(KernelImage.load(VMLINUX))


def test_a_seed_gives_the_same_walk_and_specs_read_back():
    first = list(itertools.islice(walk(7), 200))
    assert first == list(itertools.islice(walk(7), 200))
    assert first != list(itertools.islice(walk(8), 200))
    for c in first:
        assert Combination.parse(c.spec()) == c
        assert normalize(c) == c  # what is printed is what ran


def test_every_value_of_every_dimension_is_reached():
    rng = random.Random(1)
    seen = {name: set() for name in DIMENSIONS}
    for _ in range(3000):
        c = generate(rng)
        for name in DIMENSIONS:
            seen[name].add(getattr(c, name))
    assert seen == {name: set(values) for name, values in DIMENSIONS.items()}


def test_a_spec_naming_no_dimension_or_value_is_refused():
    with pytest.raises(ValueError, match="no dimension"):
        Combination.parse("engine=opt colour=red")
    with pytest.raises(ValueError, match="not one of"):
        Combination.parse("engine=jit")


@pytest.mark.parametrize("path, beside, reason", [
    ("kret", "stepping", "kret cannot be used in a run with while-stepping"),
    ("watch", "watches", "no free hardware breakpoint for its watch: x86 has 4 debug registers, all in use"),
    ("watch", "stepping", "cannot work together with while-stepping"),
    ("stepping", "watches", "cannot work together with while-stepping"),
    ("jump", "stepping", None), ("kret", "watches", None), ("marker", "watches", None),
])
def test_the_pairs_kgtp_refuses(path, beside, reason):
    pattern = refusal(Combination(path=path, beside=beside))
    assert (pattern is None) == (reason is None)
    if reason:
        assert re.search(pattern, f"tracepoint 1: {reason} (tracepoint 4), as in KGTP")


def test_refusals_are_drawn():
    rng = random.Random(3)
    assert sum(refusal(generate(rng)) is not None for _ in range(1000)) > 20


def _run(values: list[int], first: int = 100, last: int | None = None, hits: int | None = None) -> Observed:
    last = first + len(values) if last is None else last
    frames = [Frame(n, MAIN, 0, n, float(n), {"rip": SITES.function}, counter=v) for n, v in enumerate(values)]
    return Observed(reply=b"OK", windows=[Window(first, last, [0], [0])],
                    status={"tstop": ":0", "tframes": "%x" % len(values), "tcreated": "%x" % len(values),
                            "running": "0"},
                    hits={MAIN: len(values) if hits is None else hits}, fired={MAIN: last - first}, frames=frames)


C = Combination(engine="opt", path="jump", cpus=1, action="global")


def test_the_oracle_passes_a_run_that_saw_every_call_once():
    assert check(C, _run(list(range(100, 110))), SITES) == []


def test_the_oracle_sees_a_lost_hit_and_a_doubled_one():
    lost = check(C, _run([100, 101, 103], last=104, hits=3), SITES)
    assert any("hits (qTP): 3, expected 4" in p for p in lost) and any("calls collected" in p for p in lost)
    doubled = check(C, _run([100, 101, 101, 102], last=103), SITES)
    assert any("collected twice" in p for p in doubled)


def test_the_oracle_wants_kgtps_reason_for_a_refusal():
    c = Combination(path="kret", beside="stepping")
    ok = Observed(reply=b"E.tracepoint 1: kret cannot be used in a run with while-stepping (tracepoint 4)",
                  status={"running": "0"})
    assert check(c, ok, SITES) == []
    assert check(c, Observed(reply=b"OK", status={"running": "1"}), SITES)
    assert check(c, Observed(reply=b"E.something else", status={"running": "0"}), SITES)


def test_a_marker_or_return_counts_the_calls_a_stop_split():
    from kgtp_sim.tools.combinations import expected_fired

    w = Window(10, 20, [SITES.marker, 0], [0, SITES.marker])
    assert expected_fired(replace_path("marker"), w, SITES) == 10  # one entered before, one probed after
    w = Window(10, 20, [0, 0], [SITES.function + 7, 0])
    assert expected_fired(replace_path("kret"), w, SITES) == 9  # one still inside at the end


def replace_path(path: str) -> Combination:
    return Combination(path=path)
