"""The combination suite's oracle: everything wrong with what a combination's run left (`check`), as the count of
the counted function's calls says it must be: the kernel's kgtp_counter, or the program's `counter` (process.py).

It expects the calls between the two stops (a call between the function's entry and the probed place when every
CPU stopped is counted from where it is: `expected_fired`): that many fired hits (`monitor probes`), that many hits
(qTP) unless the condition, pass count, `$disable` or a full buffer says less, frames whose collected kgtp_counter
are exactly those calls' values, registers that agree with them (the soak's `check_frame_values`), each CPU's
sequence numbers consecutive (the soak's `check_sequence`), `$hits` and `$p_hits` counting 1, 2, 3...; a pair KGTP
refuses must be refused with KGTP's reason.

In a process the same rules hold where they apply. A call's probe and its count are one step at a trap tracepoint
(the int3's hit and the probed instruction run together, interrupts off); after the count at the marker's place, as
in the kernel; and before it at a fast tracepoint, or a compiled hit (an int3's or a jump's), whose pad runs the
probe, then the relocated count: a thread stopped between them (its pc at one of `Sites.relocated`: a run that ends
itself takes its pads out under a thread in its detour, which then goes on unguarded) holds a call probed and not
yet counted, which the next window counts, whichever combination's (a pad stays the program's, its thread too).
Every thread's pc is seen at a stop (the process stops as a whole), and GDB's leaving finds it stopped, so nothing
runs uncounted. The program must never see the debugger: none of its sleeps ends early.

Pure functions, on the caller's thread.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import replace

from ..soak_checks import FrameRecord, TracepointSpec, check_frame_values, check_sequence
from .runner import Observed, Window
from .space import ADDED, MAIN, SHARED, STEPS, Combination, Sites, refusal


def in_flight(c: Combination, s: Sites) -> Callable[[int], bool] | None:
    """Whether a pc is between a call's count and the combination's probed place: after the count and before the
    probe (a marker, a return), or, in a process, probed and not yet counted (in a pad, fast or compiled, between its
    hit and its relocated count, `counted_first` False); None when the probe fires with the count."""
    if c.path == "marker":
        return lambda pc: pc == s.marker
    if c.path == "kret" and c.space == "kernel":
        return lambda pc: s.function < pc < s.function + 16  # past the add, before ret ran
    if c.space == "process" and s.relocated:  # the pads: every path may find a thread left in any of them
        return lambda pc: pc in s.relocated
    return None


def counted_first(c: Combination) -> bool:
    """Whether a call in flight (`in_flight`) was counted before it is probed (else probed, then counted)."""
    return c.path == "marker" or (c.path == "kret" and c.space == "kernel")


def expected_fired(c: Combination, w: Window, s: Sites) -> int:
    """The main tracepoint's hits the kernel's count says happened in a window (before any condition).

    kgtp_counter counts entries. The probed place of a marker (after the add) or of a return is later in the
    call: a call that was between the two when every CPU stopped entered in one window and is probed in the next.
    Such a call is where a CPU's pc is, or in a thread interrupted there (`Halt.waiting`): the kernel preempts at
    every tick, and a block boundary after the add (where the out-of-line copy or detour of a probe at the
    function's entry jumps back, or where an earlier interrupt returned) lets a tick in, so the thread can be
    switched out, or its CPU in the handler, with the call half done and no CPU's pc inside the function.

    In a process's pad the probe comes first: a call in flight at the start was probed before the window and is
    counted in it, one in flight at the end probed in it and counted after (a thread there at both ends never ran
    in the window: its call neither)."""
    calls = w.last - w.first
    inside = in_flight(c, s)
    if inside is None:
        return calls
    after = sum(map(inside, w.pcs_after + w.waiting_after))
    before = sum(map(inside, w.pcs_before + w.waiting_before))
    if c.path == "kret":  # a return is probed only for entries made while the run was on
        return calls - after + w.unmoved(inside)
    if not counted_first(c):
        return calls - before + after
    return calls + before - after


def check(c: Combination, seen: Observed, s: Sites) -> list[str]:
    """Everything wrong with what a combination's run left, as the kernel's own count says it must be."""
    problems: list[str] = []
    reason = refusal(c)
    if reason is not None:
        text = seen.reply[2:].decode(errors="replace") if seen.reply.startswith(b"E.") else ""
        if not re.search(reason, text):
            problems.append(f"tstart answered {seen.reply[:160]!r}, not KGTP's refusal /{reason}/")
        if seen.status.get("running") != "0":
            problems.append("a refused run is running")
        return problems
    if seen.reply != b"OK":
        return [f"tstart answered {seen.reply[:200]!r}"]
    mine = [f for f in seen.frames if f.tracepoint == MAIN]
    stepping = c.path == "stepping"
    hit_frames = [f for f in mine if not stepping or f.registers.get("rip") == s.function]
    step_frames = [f for f in mine if stepping and f.registers.get("rip") != s.function]
    fired = sum(expected_fired(c, w, s) for w in seen.windows)
    frames, created = int(seen.status.get("tframes", "0"), 16), int(seen.status.get("tcreated", "0"), 16)
    stop = next((k for k in seen.status if k.startswith("t") and k not in ("tframes", "tcreated", "tfree", "tsize")),
                "")
    hits = seen.hits.get(MAIN)
    disconnect = c.ending == "disconnect"
    # GDB's leaving lets the kernel's CPUs run before the stub stops the run; a process stays stopped
    loose = disconnect and c.space == "kernel"

    def expect(what: str, got: object, wanted: object) -> None:
        if got != wanted:
            problems.append(f"{what}: {got}, expected {wanted}")

    # the run's end
    ends = {"fault": "terror"} if c.condition == "fault" else {}
    wanted_stop = ends.get("fault") if c.condition == "fault" else (
        "tfull" if c.buffer == "fill" else "tpasscount" if c.passcount and fired >= c.passcount else
        "tdisconnected" if disconnect else "tstop")
    if c.condition == "fault":
        wanted_stop = "terror" if fired else ("tdisconnected" if disconnect else "tstop")
    expect("the run's stop reason", stop, wanted_stop)

    # hits (qTP) and fired (monitor probes) against the count
    if c.condition in ("none", "true") and not c.passcount and c.buffer != "fill" and c.action != "disable":
        if loose:  # GDB's leaving let the CPUs run before the stub stopped the run: at least the count
            if hits is None or hits < fired:
                problems.append(f"hits {hits}, fewer than the {fired} calls counted before GDB left")
        else:
            expect("hits (qTP)", hits, fired)
            if c.path != "watch":
                expect("fired (monitor probes)", seen.fired.get(MAIN), fired)
    elif c.condition == "false":
        expect("hits of a false condition", hits, 0)
        if not loose and c.buffer != "fill":  # another tracepoint's frames may fill the buffer first
            expect("fired (monitor probes)", seen.fired.get(MAIN), fired)
    elif c.condition == "fault":
        expect("frames of a faulting condition", len(mine), 0)
        if fired:
            expect("the stopping tracepoint", seen.status.get("terror", "").split(":")[-1], "%x" % MAIN)
    elif c.passcount:
        expect("hits with a pass count", hits, min(c.passcount, fired) if not loose else hits)
        if fired >= c.passcount:
            expect("the tracepoint that reached its pass count", seen.status.get("tpasscount"), "%x" % MAIN)
    elif c.action == "disable":
        expect("hits of a tracepoint that disables itself", hits, 1 if fired else 0)
    if c.path == "shared" and c.buffer != "fill" and c.condition != "fault" and not c.passcount:
        if not loose and c.action != "disable":  # on its own through the whole run (a toggle's gap too)
            span = Window.between(seen.windows[0].start(), seen.windows[-1].end())
            expect("hits of the tracepoint sharing the address", seen.hits.get(SHARED),
                   expected_fired(c, span, s) if c.space == "process" else span.last - span.first)
    if c.change == "add" and not loose:
        at = replace(c, path="jump" if c.path == "marker" else "marker")
        expect("hits of the tracepoint added during the run", seen.hits.get(ADDED),
               sum(expected_fired(at, w, s) for w in seen.added_windows))

    # the frames: the buffer's accounting and each CPU's sequence
    expect("frames listed", len(seen.frames), frames)
    rows = [(f.number, f.tracepoint, f.stamp, f.sequence) for f in seen.frames]
    # KGTP's ring per CPU numbers each CPU's frames; gdbserver's one buffer numbers them all in one sequence
    rings = {f.number: f.cpu for f in seen.frames} if c.space == "kernel" else None
    problems += check_sequence(rows, frames, created, rings)
    if c.buffer != "circular":
        expect("frames kept (a linear buffer loses none)", frames, created)
    per_hit = 1 + (STEPS if stepping else 0)
    # GDB's leaving stops the run while the kernel runs: a hit whose steps were under way loses those still to
    # come, as KGTP's gtp_stop ends every CPU's while-stepping. At most one: the steps run with interrupts off
    # and no CPU is switched out or stopped while it single-steps, so one CPU at a time is in them.
    cut = STEPS if stepping and loose else 0
    if c.buffer == "linear" and hits is not None and c.condition != "fault":
        if not 0 <= hits * per_hit - len(mine) <= cut:
            expect("frames of the main tracepoint", len(mine), hits * per_hit)
    if stepping and c.buffer == "linear" and not 0 <= STEPS * len(hit_frames) - len(step_frames) <= cut:
        expect("while-stepping frames", len(step_frames), STEPS * len(hit_frames))

    # the values every frame collected, against the kernel's count
    values = [f.counter for f in hit_frames]
    if None in values:
        problems.append(f"frames without the collected counter: {[f.number for f in hit_frames if f.counter is None][:5]}")
        return problems
    after_add = c.path in ("marker", "kret", "watch")  # these read the count after the call's add
    inside = in_flight(c, s)
    boundaries = [pc for w in seen.windows for pc in w.pcs_before + w.waiting_before + w.pcs_after + w.waiting_after]
    # a call in flight at a window's end was probed in it and reads the count as it then was, the last value
    late = [any(map(inside, w.pcs_after + w.waiting_after)) if inside is not None and not counted_first(c) else
            False for w in seen.windows]

    def begun(w: Window) -> bool:
        """A marker's call was in flight when the window began: it reads kgtp_counter as it was then, if no
        add comes first."""
        return c.path == "marker" and inside is not None and any(map(inside, w.pcs_before + w.waiting_before))

    calls = [set(range(w.first + after_add - begun(w), w.last + after_add + more)) for w, more in
             zip(seen.windows, late)]
    allowed = set().union(*calls) if calls else set()
    # A marker or a return reads the count some time after its call's add, a process's pad before it: when the
    # thread is preempted or its CPU switched out in between, other CPUs' adds come between, and two CPUs can read
    # one value. At a trap tracepoint in a process the probe and the count are one step.
    racy = c.cpus > 1 and (inside is not None if c.space == "kernel" else c.path in ("marker", "jump", "shared"))
    # every call of the windows probed once and nothing else: unless a call was in flight at a window's boundary
    # (in a process, one left in a pad by an earlier run is counted without a probe)
    exact = not racy and (inside is None or not any(map(inside, boundaries)) or c.space == "kernel")
    if racy:
        # One CPU's calls are its thread's, one after the other: on each CPU, in the order of its frames, the
        # values strictly increase, and a call collected twice reads one value twice.
        by_cpu: dict[int, list[int]] = {}
        for f in sorted(hit_frames, key=lambda f: (f.cpu, f.sequence)):
            by_cpu.setdefault(f.cpu, []).append(f.counter)  # type: ignore[arg-type]
        for cpu, row in sorted(by_cpu.items()):
            twice = sorted({b for a, b in zip(row, row[1:]) if b <= a})
            if twice:
                problems.append(f"a call collected twice on CPU {cpu}: {twice[:5]}")
    elif len(set(values)) != len(values):
        problems.append("a call collected twice: " + str(sorted(v for v in set(values) if values.count(v) > 1)[:5]))
    if c.path != "marker" and c.path != "kret" and not loose and exact:  # a marker's or return's last calls: from pcs
        if c.buffer == "linear" and c.condition in ("none", "true") and not c.passcount and c.action != "disable":
            expect("the calls collected (kgtp_counter of every frame)", _ranges(values), _ranges(allowed))
        elif c.passcount or c.buffer == "fill" or c.action == "disable":
            first = min(w.first for w in seen.windows) + after_add
            if c.buffer == "circular" and created > frames and hits is not None:
                # a small circular buffer (a process's: 4 KiB) that wrapped let the oldest frames go: the calls
                # kept are the last ones of the run's hits, none missing in between
                expect("the calls collected (the last ones of the run's hits, the buffer having wrapped)",
                       _ranges(values), _ranges(range(first + hits - len(values), first + hits)))
            else:
                expect("the calls collected (the first ones of the run)", _ranges(values), _ranges(
                    range(first, first + len(values))))
    top = max(allowed, default=0)
    outside = sorted(v for v in set(values) - allowed if not (loose and v > top))
    if c.path in ("marker", "kret"):  # at most one call per CPU probed past a window's end
        outside = [v for v in outside if not any(w.last + after_add <= v <= w.last + after_add + c.cpus
                                                 for w in seen.windows)]
    if outside and c.condition != "fault":
        problems.append(f"counters collected outside the calls counted: {outside[:5]}")

    # registers, as the soak checks them (counter2 is counter1 - 1, the expression GDB would evaluate)
    if c.action in ("registers", "$regs", "$args", "sdata") and c.path not in ("watch",):
        spec = TracepointSpec("kgtp_test_function", "", (), ("$rdi", "$rsi", "kgtp_counter", "(2*counter1+3*counter2)"))
        records = []
        for f in hit_frames:
            rdi, rsi = f.registers.get("rdi"), f.registers.get("rsi")
            readback = {"$rdi": rdi, "$rsi": rsi, "kgtp_counter": f.counter,
                        "(2*counter1+3*counter2)": None if rdi is None or rsi is None else
                        2 * _s32(rdi) + 3 * _s32(rsi)}
            records.append(FrameRecord(f.number, 1, None, {k: None if v is None else str(_s32(v) if k[0] == "$" else v)
                                                           for k, v in readback.items()}, f.cpu))
        consecutive = c.buffer == "linear" and c.condition in ("none", "true") and c.change == "none" and \
            c.path not in ("kret",)
        found = check_frame_values(records, [spec], None)
        if not consecutive:  # frames of one CPU are not every call of it: only each frame's own consistency
            found = [p for p in found if "stepped" not in p]
        problems += found
    if c.action in ("registers", "$regs") and c.path not in ("watch", "kret"):
        wanted_pc = s.marker if c.path == "marker" else s.function
        wrong = [f.number for f in hit_frames if f.registers.get("rip") != wanted_pc]
        if wrong:
            problems.append(f"frames whose pc is not the probed address {wanted_pc:#x}: {wrong[:5]}")
    if c.action in ("memory", "bt") and c.path not in ("watch", "kret"):
        wrong = [f.number for f in hit_frames if f.stack is None or not any(f.stack in r for r in s.bench)]
        if wrong:
            problems.append(f"frames whose stack does not start with a return into the benchmark: {wrong[:5]}")
    if c.action == "sdata":
        for f in hit_frames:
            found = re.fullmatch(r"counter1=(-?\d+) counter2=(-?\d+)", f.sdata or "")
            rdi = f.registers.get("rdi")
            if found is None or rdi is None or int(found.group(1)) != _s32(rdi) or \
                    int(found.group(2)) != int(found.group(1)) - 1:
                problems.append(f"frame {f.number}: $_sdata {f.sdata!r} with counter1 {rdi}")
                break
    if c.action == "teval" and c.buffer == "linear" and c.condition != "fault":
        counted = sorted(f.variables.get("hits") or 0 for f in hit_frames)
        expect("$hits collected at each hit", counted, list(range(1, len(hit_frames) + 1)))
        expect("$hits after the run", seen.hits_variable, hits)
    if c.action == "percpu" and c.condition != "fault":
        by_cpu: dict[int, list[int]] = {}
        for f in hit_frames:
            by_cpu.setdefault(f.cpu, []).append(f.variables.get("p_hits") or 0)
        for cpu, counted in sorted(by_cpu.items()):
            if c.buffer == "linear":
                expect(f"$p_hits collected on CPU {cpu}", sorted(counted), list(range(1, len(counted) + 1)))
            elif sorted(counted) != list(range(min(counted), min(counted) + len(counted))):
                problems.append(f"$p_hits of CPU {cpu} not consecutive: {sorted(counted)[:8]}")
        if hits is not None and c.buffer != "fill" and not loose:
            expect("$p_hits summed over the CPUs", sum(v or 0 for v in seen.p_hits), hits)
    if c.action == "kgtp":
        tasks: dict[int, set[int | None]] = {}
        for f in hit_frames:
            if f.variables.get("cpu_id") != f.cpu:
                problems.append(f"frame {f.number}: $cpu_id {f.variables.get('cpu_id')} on CPU {f.cpu}")
                break
            tasks.setdefault(f.cpu, set()).add(f.variables.get("current_task"))
        if c.path != "kret" and any(len(t) != 1 or None in t or 0 in t for t in tasks.values()):
            problems.append(f"$current_task of each CPU's benchmark thread not one task: {tasks}")
        if len({next(iter(t)) for t in tasks.values()}) != len(tasks):
            problems.append(f"two CPUs ran one task: {tasks}")
    if c.space == "process":
        expect("the program's sleeps cut short (the debugger's stops showed)", seen.interrupted_sleeps, 0)
    return problems


def _s32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >> 31 else value


def _ranges(values: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted values as runs [first, last]: a short message for a long list."""
    out: list[tuple[int, int]] = []
    for v in sorted(values):
        if out and v == out[-1][1] + 1:
            out[-1] = (out[-1][0], v)
        else:
            out.append((v, v))
    return out
