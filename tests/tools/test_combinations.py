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
from dataclasses import replace

from kgtp_sim.tools.combinations import (
    DIMENSIONS, MAIN, Combination, Frame, Observed, Sites, Stacks, Window, check, expected_fired, generate,
    interrupted, normalize, refusal, walk,
)
from kgtp_sim.tools.combinations.space import definitions, hits_variable

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


# ---- the process space ----------------------------------------------------------------------------------------

PROGRAM = Sites(function=0x401700, counter=0x4BB320, marker=0x401707, stepper=0x401720, watched=(),
                bench=(range(0x401730, 0x401800),), relocated=(0x7FFF_F000_0001,))
P = Combination(space="process", engine="opt", path="int3", cpus=1, action="global")


def _process_run(values: list[int], first: int = 100, last: int | None = None, hits: int | None = None,
                 cpus: list[int] | None = None, before: list[int] | None = None, after: list[int] | None = None,
                 sleeps: int = 0) -> Observed:
    """A made-up run of the program: frames in gdbserver's one buffer (one sequence for every CPU), the threads'
    pcs at both stops (`before`, `after`: a thread's pc, 0 elsewhere)."""
    last = first + len(values) if last is None else last
    cpus = cpus or [0] * len(values)
    frames = [Frame(n, MAIN, cpu, n, float(n), {"rip": PROGRAM.function}, counter=v)
              for n, (v, cpu) in enumerate(zip(values, cpus))]
    return Observed(reply=b"OK", windows=[Window(first, last, before or [0, 0], after or [0, 0])],
                    status={"tstop": ":0", "tframes": "%x" % len(values), "tcreated": "%x" % len(values),
                            "running": "0"},
                    hits={MAIN: len(values) if hits is None else hits},
                    fired={MAIN: len(values) if hits is None else hits}, frames=frames, interrupted_sleeps=sleeps)


def test_the_process_oracle_passes_a_run_that_saw_every_call_once():
    assert check(P, _process_run(list(range(100, 110))), PROGRAM) == []
    c = replace(P, path="marker", cpus=2)  # after the count: each value one more, two threads each counting up
    seen = _process_run([101, 102, 104, 104, 105], last=105, cpus=[0, 1, 0, 1, 0])  # one preempted after its add
    assert check(c, seen, PROGRAM) == []


def test_the_process_oracle_sees_a_lost_hit_a_doubled_one_and_a_sleep_cut_short():
    lost = check(P, _process_run([100, 101, 103], last=104, hits=3), PROGRAM)
    assert any("hits (qTP): 3, expected 4" in p for p in lost) and any("calls collected" in p for p in lost)
    doubled = check(P, _process_run([100, 101, 101, 102], last=103), PROGRAM)
    assert any("collected twice" in p for p in doubled)
    jump = replace(P, path="jump", cpus=2)  # two threads may read one value in a pad, one thread never twice
    assert check(jump, _process_run([100, 100, 101, 102], cpus=[0, 1, 0, 1]), PROGRAM) == []
    assert any("a call collected twice on CPU 0: [100]" in p for p in
               check(jump, _process_run([100, 100, 101, 102], cpus=[0, 0, 1, 1]), PROGRAM))
    cut = check(P, _process_run(list(range(100, 104)), sleeps=2), PROGRAM)
    assert cut == ["the program's sleeps cut short (the debugger's stops showed): 2, expected 0"]


def test_gdbservers_one_buffer_numbers_every_cpus_frames_in_one_sequence():
    two = replace(P, cpus=2)
    assert check(two, _process_run(list(range(100, 106)), cpus=[0, 1, 1, 0, 1, 0]), PROGRAM) == []
    kernel = check(replace(C, cpus=2), _process_run(list(range(100, 106)), cpus=[0, 1, 1, 0, 1, 0]), SITES)
    assert any("sequence" in p for p in kernel)  # KGTP's rings number each CPU's own


def test_a_call_left_in_a_fast_tracepoints_pad_was_probed_and_is_counted_later():
    """A thread stopped between a pad's int3 and its relocated count holds a call probed and not yet counted:
    at a window's end one more hit than calls; at its start one fewer; at both ends (it never ran) neither."""
    inside, jump, trap = PROGRAM.relocated[0], replace(P, path="jump"), replace(P, path="int3")
    assert expected_fired(jump, Window(10, 20, [0, 0], [inside, 0]), PROGRAM) == 11
    assert expected_fired(jump, Window(10, 20, [inside, 0], [0, 0]), PROGRAM) == 9
    assert expected_fired(trap, Window(10, 20, [0, inside], [0, inside]), PROGRAM) == 10
    assert expected_fired(jump, Window(10, 20, [PROGRAM.function + 3, 0], [0, 0]), PROGRAM) == 10  # no pad there
    assert expected_fired(jump, Window(10, 20, [inside, 0], [0, 0]), replace(PROGRAM, relocated=())) == 10
    # a probe in flight at the end read the last count: 100..103 and 104 of the thread left in the pad
    seen = _process_run([100, 101, 102, 103, 104], last=104, after=[0, inside])
    assert check(jump, seen, PROGRAM) == []
    seen.hits = seen.fired = {MAIN: 4}
    assert any("hits (qTP): 4, expected 5" in p for p in check(jump, seen, PROGRAM))


def test_a_call_left_in_any_pad_of_the_process_is_counted_whichever_path_runs_now():
    """A process keeps every pad the stub made for the counted instruction (a fast tracepoint's, a compiled hit's
    for each condition it decided in ring 3), and a run that ended itself may leave a thread at any one's relocated
    count, probed by that run: the next combination counts its call, whatever its own path (an interpreted int3's
    run, with no pad of its own, one fewer hit than calls)."""
    python_pad, compiled_pad = 0x7FFF_F000_0001, 0x7FFF_F000_0093
    sites = replace(PROGRAM, relocated=(python_pad, compiled_pad))
    interp = replace(P, engine="interp", path="int3", cpus=2)
    assert expected_fired(interp, Window(10, 20, [0, compiled_pad], [0, 0]), sites) == 9
    assert expected_fired(interp, Window(10, 20, [python_pad, compiled_pad], [0, 0]), sites) == 8
    # a compiled run that reached its pass count left its last hit's thread at the relocated count: probed, not counted
    passcount = replace(P, path="int3", cpus=2, passcount=3)
    seen = _process_run([100, 101, 102], last=102, after=[0, compiled_pad])
    seen.status = {"tpasscount": "1", "tframes": "3", "tcreated": "3", "running": "0"}
    assert check(passcount, seen, sites) == []
    assert any("hits with a pass count: 3, expected 2" in p for p in check(passcount, seen, PROGRAM))


@pytest.mark.parametrize("path, reason", [
    ("kret", "tracepoint 1 at 0x401700: kret is a return probe of a kernel function (KGTP's kretprobe): a "
             "tracepoint in the program cannot set it"),
    ("watch", "tracepoint 1: a watch tracepoint is a hardware breakpoint of the kernel's (KGTP's), on the kernel's "
              "memory: 0x4bb320 is the program's"),
])
def test_a_programs_return_probe_and_watch_are_refused_with_their_reason(path, reason):
    c = replace(P, path=path, beside="stepping")  # refused for what they are, before what stands beside
    assert re.search(refusal(c), reason)
    assert check(c, Observed(reply=b"E." + reason.encode(), status={"running": "0"}), PROGRAM) == []
    assert check(c, Observed(reply=b"E.cannot watch 0x4bb320: not mapped", status={"running": "0"}), PROGRAM)


def test_a_programs_tracepoints_are_defined_as_gdb_defines_them_there():
    packets = definitions(replace(P, path="jump", action="teval"), PROGRAM)
    main = [p for p in packets if p.startswith(b"QTDP:1:")]
    assert main == [b"QTDP:1:401700:E:0:0:F7-"]  # a fast tracepoint over the 7-byte count
    kernel_hits, process_hits = hits_variable(C), hits_variable(replace(P, action="teval"))
    assert process_hits == kernel_hits + 1  # after gdbserver's $trace_timestamp
    assert b"QTDV:%x:0:0:%s" % (process_hits, b"hits".hex().encode()) in packets
    marker = definitions(replace(P, path="marker"), PROGRAM)
    assert [p for p in marker if p.startswith(b"QTDP:1:")] == [b"QTDP:1:401707:E:0:0-"]  # no static marker
    assert normalize(replace(P, path="marker", action="sdata")).action == "global"


class _PanickedRunner:
    """A runner whose kernel stalled in panic(): what run_one reports of it."""

    retired: list[int] = []

    def run(self, c):
        from kgtp_sim.tools.combinations.runner import CombinationFailure
        raise CombinationFailure("waited 60s for 192 calls of kgtp_test_function: the CPUs at 0xffffffff8100092a (panic)")

    def console_tail(self, cpus: int) -> str:
        return "<0>Kernel panic - not syncing: stray int3 at ffffffff81001ae0\n<0>RIP: ffffffff81001ae0"

    def retire(self, cpus: int) -> None:
        self.retired.append(cpus)


def test_a_failure_on_a_kernel_that_said_something_reports_its_console():
    from kgtp_sim.tools.combinations.campaign import run_one

    runner = _PanickedRunner()
    outcome = run_one(type("R", (), {"of": lambda self, c: runner})(), Combination(cpus=1))
    assert outcome.problems[0].startswith("CombinationFailure: waited 60s"), outcome.problems
    assert "Kernel panic - not syncing: stray int3" in outcome.problems[-1], outcome.problems
    assert runner.retired == [1]


def test_a_wrapped_circular_buffer_keeps_the_last_hits_of_a_pass_count():
    """A process's circular buffer is gdbserver's, 4 KiB here: three hits with large frames wrap it and the first
    hit's frames go. The calls kept are then the pass count's last ones, none missing between them."""
    counted = replace(P, buffer="circular", passcount=3)

    def run(values: list[int], created: int) -> Observed:
        seen = _process_run(values, last=110, hits=3)
        seen.status = {"tpasscount": "1", "tframes": "2", "tcreated": "%x" % created, "running": "0"}
        for frame in seen.frames:  # the oldest ones gone: the kept frames' sequence numbers are the last ones
            frame.sequence += created - len(values)
        return seen

    assert check(counted, run([101, 102], 3), PROGRAM) == []
    assert any("the first ones of the run" in p for p in check(counted, run([101, 102], 2), PROGRAM))  # no wrap
    assert any("the last ones" in p for p in check(counted, run([100, 102], 3), PROGRAM))  # a gap
