"""The combination suite's generator and oracle (kgtp_sim/tools/combinations/), without a kernel: a seed gives the
same walk, a spec reads back, every value of every dimension is reached, the pairs KGTP refuses are named with
KGTP's reason, and the oracle catches a lost hit, a doubled one and a wrong refusal on made-up runs."""

from __future__ import annotations

import itertools
import random
import re
import struct

import pytest

from kgtp_sim.machine import KernelImage
from kgtp_sim.tools.combinations import (
    DIMENSIONS, MAIN, Combination, Frame, Observed, Sites, Stacks, Window, check, expected_fired, generate,
    interrupted, normalize, refusal, walk,
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
    w = Window(10, 20, [SITES.marker, 0], [0, SITES.marker])
    assert expected_fired(replace_path("marker"), w, SITES) == 10  # one entered before, one probed after
    w = Window(10, 20, [0, 0], [SITES.function + 7, 0])
    assert expected_fired(replace_path("kret"), w, SITES) == 9  # one still inside at the end


def test_a_call_whose_thread_was_preempted_inside_counts_as_one_whose_cpu_stopped_there():
    w = Window(10, 20, [0, 0], [0, 0], waiting_before=[SITES.marker, 0x1234], waiting_after=[])
    assert expected_fired(replace_path("marker"), w, SITES) == 11  # entered before the window, probed in it
    w = Window(10, 20, [0, 0], [0, 0], waiting_after=[SITES.marker])
    assert expected_fired(replace_path("marker"), w, SITES) == 9  # entered in the window, probed after it
    w = Window(10, 20, [0, 0], [0, 0], waiting_before=[SITES.function + 7], waiting_after=[SITES.function + 12])
    assert expected_fired(replace_path("kret"), w, SITES) == 9  # an entry before tstart is never probed
    assert expected_fired(replace_path("jump"), w, SITES) == 10  # the entry's probe fires with the add


def test_a_return_probe_expects_the_return_of_a_call_in_flight_at_both_ends_only_when_it_is_another_call():
    """A call in flight when the run started is never probed at its return, and no call of the window either,
    wherever its thread is at the end: four CPUs on a busy host may give a CPU, or a thread, no instruction in a
    short window (the walk once expected 46 returns of 49 entries where 47 were probed; another time the thread
    waiting at the start ran on a CPU at the end, still in that call)."""
    inside, kret = SITES.function + 7, replace_path("kret")
    same = Window(10, 20, [inside, 0], [inside, 0], calls_before=[(0, 5), None], calls_after=[(0, 5), None])
    assert expected_fired(kret, same, SITES) == 10
    moved = Window(10, 20, [inside, 0], [inside, 0], calls_before=[(0, 5), None], calls_after=[(0, 6), None])
    assert expected_fired(kret, moved, SITES) == 9  # the thread's next call stands there now
    other = Window(10, 20, [inside, 0], [0, inside], calls_before=[(0, 5), None], calls_after=[None, (1, 5)])
    assert expected_fired(kret, other, SITES) == 9  # another thread's call
    resumed = Window(10, 20, [0], [inside], waiting_before=[inside], calls_before=[None, (2, 9)],
                     calls_after=[(2, 9)])
    assert expected_fired(kret, resumed, SITES) == 10  # waiting at the start, on a CPU at the end: one call
    entering = Window(10, 20, [SITES.function], [inside], calls_before=[(0, 5)], calls_after=[(0, 5)])
    assert expected_fired(kret, entering, SITES) == 9  # at the entry when the run began: entered in it


def _frame_at(rsp: int, ip: int, cs: int = 0x08, ss: int = 0x10) -> tuple[int, list[int]]:
    """Where an interrupt taken at `ip` with `rsp` puts its frame (Cpu.deliver), and its five words."""
    at = (rsp & ~0xF) - 40
    return at, [ip, cs, 0x246, rsp, ss]


def test_interrupt_frames_are_found_on_a_live_stack_and_nothing_else_is():
    base = 0xFFFF_C900_0000_1000
    words = [0x1111] * 64
    at, frame = _frame_at(base + 8 * 40 + 8, SITES.marker)  # the interrupted rsp not 16-byte aligned
    words[(at - base) // 8:(at - base) // 8 + 5] = frame
    at, frame = _frame_at(base + 8 * 20, SITES.function + 12)
    words[(at - base) // 8:(at - base) // 8 + 5] = frame
    at, frame = _frame_at(base + 8 * 60, 0x400000, cs=0x33, ss=0x2B)  # from user mode: another stack's business
    words[(at - base) // 8:(at - base) // 8 + 5] = frame
    words[2:7] = [SITES.marker, 0x08, 0x246, base + 8 * 30, 0x10]  # its sp says it is not where a CPU puts it
    data = struct.pack(f"<{len(words)}Q", *words)
    assert interrupted(data, base) == [SITES.function + 12, SITES.marker]


def test_a_benchmark_threads_stack_is_live_from_its_cpus_stack_pointer_else_from_the_saved_one():
    stacks = Stacks(saved=(), base=0x10000, each=0x1000, count=4)
    saved = [0x10F00, 0x11E00, 0, 0x14000]  # not started; the last: stack 3's top, an empty stack
    assert stacks.live(saved, running=[0x11C03, 0x12800, 0xFFFF_8000]) == [
        (0x10F00, 0x11000), (0x11C08, 0x12000), (0x14000, 0x14000)]  # a CPU on another thread's stack: left out
    kernel = Stacks.of(KernelImage.load(VMLINUX))
    assert kernel.each == 0x4000 and len(kernel.saved) == 8  # THREAD_SIZE; a benchmark thread per possible CPU


def test_two_cpus_may_read_one_counter_at_a_marker_but_one_cpu_never_twice():
    c = Combination(engine="opt", path="marker", cpus=2, action="global")
    frames = [Frame(n, MAIN, cpu, seq, float(n), {"rip": SITES.marker}, counter=v)
              for n, (cpu, seq, v) in enumerate([(0, 1, 101), (1, 1, 102), (0, 2, 103), (1, 2, 103), (0, 3, 104)])]
    seen = Observed(reply=b"OK", windows=[Window(100, 104, [0, 0], [0, 0])],
                    status={"tstop": ":0", "tframes": "5", "tcreated": "5", "running": "0"},
                    hits={MAIN: 5}, fired={MAIN: 4}, frames=frames)
    assert not any("twice" in p for p in check(c, seen, SITES))
    frames[4].counter = 103
    assert any("a call collected twice on CPU 0: [103]" in p for p in check(c, seen, SITES))


def test_a_markers_call_in_flight_at_the_start_may_read_the_counter_as_it_was():
    c = Combination(engine="opt", path="marker", cpus=1, action="global", buffer="circular")
    seen = Observed(reply=b"OK", windows=[Window(100, 103, [0], [0], waiting_before=[SITES.marker])],
                    status={"tstop": ":0", "tframes": "4", "tcreated": "4", "running": "0"},
                    hits={MAIN: 4}, fired={MAIN: 4},
                    frames=[Frame(n, MAIN, 0, n, float(n), {"rip": SITES.marker}, counter=100 + n)
                            for n in range(4)])
    assert check(c, seen, SITES) == []
    seen.windows[0].waiting_before = []
    seen.fired = seen.hits = {MAIN: 3}
    seen.frames.pop(0)
    seen.frames[0].counter = 100
    assert any("outside the calls counted: [100]" in p for p in check(c, seen, SITES))


def replace_path(path: str) -> Combination:
    return Combination(path=path)
