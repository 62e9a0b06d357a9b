"""The soak's tracepoints and its verdicts: what is traced and read back from each frame, the samples taken during
the run and the invariants over them (buffer accounting, growth, wraps, a kernel that keeps running), the stub's
memory figures and their limits, and the checks of the frames walked at the end (values consistent frame to frame,
each CPU's sequence numbers consecutive).

Pure functions over recorded figures, so a broken invariant can be shown on made-up samples
(tests/e2e/test_soak_script.py). They run on the thread of the soak (soak.py) or of the test that calls them.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..rsp.packets.trace import StopReason

#: This stub's ring keeps whole entries of 8-byte multiples (tracing/core/ring.py), so `tsize - tfree` is one too.
ENTRY_ALIGNMENT = 8
#: The smallest entry that holds a frame: the 24-byte entry header and GDB's 6-byte frame header, aligned.
MIN_ENTRY_BYTES = 32

#: The system call numbers the kernel's syscall_test thread uses (fixtures/kernel/syscall.c).
KERNEL_SYSCALLS = frozenset({1, 24, 35, 39, 500})
SYSCALL_VECTOR = 0x80


# ---- what is traced ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TracepointSpec:
    """A tracepoint of the soak: how GDB creates it, what it collects, and what to read back from each frame."""

    name: str
    command: str
    actions: tuple[str, ...]
    readback: tuple[str, ...]


def tracepoint_specs(sched_switch_site: int) -> list[TracepointSpec]:
    """The hot kernel function (every call of the full-speed workload), the scheduler (every tick and yield),
    the system call entry (a memory range through a pointer) and a static marker (`$_sdata` built at the hit):
    registers, globals, an expression, memory and static data, in both probe kinds the kernel allows."""
    return [
        TracepointSpec("kgtp_test_function", "trace kgtp_test_function",
                       ("collect $regs", "collect kgtp_counter", "collect (2*counter1+3*counter2)"),
                       ("$rdi", "$rsi", "kgtp_counter", "(2*counter1+3*counter2)")),
        TracepointSpec("schedule", "trace schedule", ("collect $regs", "collect jiffies"), ("jiffies",)),
        TracepointSpec("do_syscall", "trace do_syscall", ("collect $regs", "collect *regs"),
                       ("regs->orig_ax", "regs->vector")),
        TracepointSpec("sched_switch marker", f"strace *{sched_switch_site:#x}", ("collect $_sdata", "collect jiffies"),
                       ("$_sdata", "jiffies")),
    ]


# ---- samples and the invariants over them --------------------------------------------------------------------


@dataclass
class Sample:
    """One look at the run. Counters are None when the stub could not answer that question."""

    elapsed_s: float
    rss_kib: int
    hwm_kib: int
    status_error: str | None = None
    running: bool = False
    stop_reason: str = ""
    frames: int | None = None
    created: int | None = None
    free: int | None = None
    size: int | None = None
    jiffies: int | None = None
    instructions: int | None = None
    hits: dict[int, int] = field(default_factory=dict)
    usage: dict[int, int] = field(default_factory=dict)
    machine_state: str = ""


@dataclass(frozen=True)
class Check:
    """An invariant's verdict; `detail` says what was measured, or where it first broke."""

    name: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class Limits:
    """How much drift the verdicts tolerate. Defaults suit a ten-minute run on a shared two-core host."""

    rss_slope_mib_per_min: float = 0.5
    rss_growth_mib: float = 16.0
    frames_band: float = 0.5


def _first(items: Iterable[str], limit: int = 3) -> str:
    items = list(items)
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return "; ".join(items[:limit]) + more


def check_samples(samples: Sequence[Sample], buffer_size: int, limits: Limits = Limits(),
                  cpus: int = 1) -> list[Check]:
    """The invariants that must hold at every sample and between consecutive samples.

    Buffer accounting is checked against what this stub's qTStatus means, summed over the CPUs' rings as KGTP
    sums its per-CPU buffers: `tsize` is every ring's size (`buffer_size` each), `tfree` what no entry holds (so
    `tsize - tfree` is the bytes of whole entries: 8-byte multiples, each at least a header and a frame header,
    none more than half its ring, plus at most one padding entry at each ring's end).
    """
    checks: list[Check] = []
    good = [s for s in samples if s.status_error is None and s.created is not None]

    errors = [f"t={s.elapsed_s:.0f}s: {s.status_error}" for s in samples if s.status_error is not None]
    checks.append(Check("qTStatus answers", not errors and bool(samples),
                        _first(errors) if errors else f"{len(samples)} samples"))

    stopped = [f"t={s.elapsed_s:.0f}s: {s.stop_reason or 'not running'}" for s in good
               if not s.running or s.stop_reason in {r.value for r in StopReason} - {StopReason.NOT_RUN.value}]
    checks.append(Check("run never stops (no tfull/terror/tstop)", not stopped and bool(good),
                        _first(stopped) if stopped else "running at every sample"))

    decreasing, stalled = [], []
    for before, after in zip(good, good[1:]):
        assert before.created is not None and after.created is not None
        if after.created < before.created:
            decreasing.append(f"t={after.elapsed_s:.0f}s: {before.created} -> {after.created}")
        elif after.created == before.created:
            stalled.append(f"t={after.elapsed_s:.0f}s: stuck at {after.created}")
    checks.append(Check("tcreated never decreases", not decreasing,
                        _first(decreasing) if decreasing else f"{good[0].created if good else 0} -> "
                        f"{good[-1].created if good else 0}"))
    checks.append(Check("tracepoints keep firing (tcreated grows)", not stalled and len(good) >= 2,
                        _first(stalled) if stalled else "grew between every two samples"))

    over = [f"t={s.elapsed_s:.0f}s: tframes {s.frames} > tcreated {s.created}" for s in good
            if s.frames is None or not 0 <= s.frames <= s.created]  # type: ignore[operator]
    checks.append(Check("tframes <= tcreated", not over, _first(over) if over else "at every sample"))

    accounting = []
    half = buffer_size // 2
    for s in good:
        assert s.frames is not None and s.free is not None and s.size is not None
        used = s.size - s.free
        where = f"t={s.elapsed_s:.0f}s (tframes {s.frames}, tfree {s.free}, tsize {s.size})"
        if s.size != buffer_size * cpus:
            accounting.append(f"{where}: tsize is not the {buffer_size} bytes asked for, times {cpus} CPUs")
        elif not 0 <= s.free <= s.size:
            accounting.append(f"{where}: tfree outside 0..tsize")
        elif used % ENTRY_ALIGNMENT:
            accounting.append(f"{where}: used bytes {used} not a multiple of {ENTRY_ALIGNMENT}")
        elif used < s.frames * MIN_ENTRY_BYTES:
            accounting.append(f"{where}: {s.frames} frames cannot fit in {used} bytes")
        elif used > (s.frames + cpus) * half:
            accounting.append(f"{where}: {used} bytes is more than {s.frames} frames can take")
    checks.append(Check("buffer accounting (tfree, tsize, tframes agree)", not accounting,
                        _first(accounting) if accounting else "consistent at every sample"))

    wrapped = [s for s in good if s.created is not None and s.frames is not None and s.created > s.frames]
    checks.append(Check("circular buffer wrapped", bool(wrapped),
                        f"first at t={wrapped[0].elapsed_s:.0f}s" if wrapped else "never wrapped: buffer too big"))
    steady = wrapped[1:]  # the first wrapped sample may still be filling
    if len(steady) >= 3:
        counts = [s.frames for s in steady]
        median = statistics.median(counts)  # type: ignore[type-var]
        low, high = median * (1 - limits.frames_band), median * (1 + limits.frames_band)
        outside = [f"t={s.elapsed_s:.0f}s: {s.frames}" for s in steady if not low <= s.frames <= high]  # type: ignore
        checks.append(Check(f"tframes steady once wrapped (within {limits.frames_band:.0%} of the median)",
                            not outside, f"median {median:g}, min {min(counts)}, max {max(counts)}"  # type: ignore
                            + (f"; outside: {_first(outside)}" if outside else "")))
    else:
        checks.append(Check("tframes steady once wrapped", False, f"only {len(steady)} samples after the wrap"))

    frozen = []
    with_jiffies = [s for s in samples if s.jiffies is not None]
    for before, after in zip(with_jiffies, with_jiffies[1:]):
        if after.jiffies <= before.jiffies:  # type: ignore[operator]
            frozen.append(f"t={after.elapsed_s:.0f}s: jiffies {before.jiffies} -> {after.jiffies}")
    checks.append(Check("kernel keeps running (jiffies grows)", not frozen and len(with_jiffies) >= 2,
                        _first(frozen) if frozen else f"{with_jiffies[0].jiffies if with_jiffies else '?'} -> "
                        f"{with_jiffies[-1].jiffies if with_jiffies else '?'}"))
    return checks


@dataclass(frozen=True)
class MemoryFigures:
    rss_start_mib: float
    rss_end_mib: float
    rss_peak_mib: float
    hwm_peak_mib: float
    slope_mib_per_min: float
    slope_window_s: tuple[float, float]


def least_squares_slope(points: Sequence[tuple[float, float]]) -> float:
    if len(points) < 2:
        return 0.0
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0


def memory_figures(samples: Sequence[Sample], duration_s: float, warmup_s: float) -> MemoryFigures:
    """RSS after warm-up, at the end and at its peak; the slope over the last 80% of the run (least squares)."""
    if not samples:
        return MemoryFigures(0, 0, 0, 0, 0, (0, 0))
    warm = next((s for s in samples if s.elapsed_s >= warmup_s), samples[-1])
    tail = [s for s in samples if s.elapsed_s >= 0.2 * duration_s] or list(samples)
    slope = least_squares_slope([(s.elapsed_s / 60, s.rss_kib / 1024) for s in tail])
    return MemoryFigures(
        rss_start_mib=warm.rss_kib / 1024, rss_end_mib=samples[-1].rss_kib / 1024,
        rss_peak_mib=max(s.rss_kib for s in samples) / 1024, hwm_peak_mib=max(s.hwm_kib for s in samples) / 1024,
        slope_mib_per_min=slope, slope_window_s=(tail[0].elapsed_s, tail[-1].elapsed_s),
    )


def check_memory(figures: MemoryFigures, limits: Limits = Limits()) -> list[Check]:
    growth = figures.rss_end_mib - figures.rss_start_mib
    return [
        Check(f"stub memory flat (RSS slope <= {limits.rss_slope_mib_per_min} MiB/min)",
              figures.slope_mib_per_min <= limits.rss_slope_mib_per_min,
              f"{figures.slope_mib_per_min:+.3f} MiB/min over t={figures.slope_window_s[0]:.0f}.."
              f"{figures.slope_window_s[1]:.0f}s"),
        Check(f"stub memory growth after warm-up <= {limits.rss_growth_mib:g} MiB", growth <= limits.rss_growth_mib,
              f"{figures.rss_start_mib:.1f} -> {figures.rss_end_mib:.1f} MiB ({growth:+.1f})"),
    ]


# ---- the final walk over the buffer --------------------------------------------------------------------------


@dataclass
class FrameRecord:
    number: int
    tracepoint: int
    pc: int | None
    values: dict[str, str | None]
    cpu: int = 0  #: the CPU that committed it (`monitor frames`)


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    match = re.fullmatch(r"(-?\d+)|(0x[0-9a-f]+)(?: <.*>)?", text.strip())
    if not match:
        return None
    return int(match.group(1)) if match.group(1) else int(match.group(2), 16)


def check_frame_values(frames: Sequence[FrameRecord], specs: Sequence[TracepointSpec],
                       final_jiffies: int | None) -> list[str]:
    """What each tracepoint's frames must show if the collection was right, checked against each other.

    kgtp_test_function is called by each CPU's loop, which passes counter1 and counter2 = counter1 - 1, and bumps
    kgtp_counter once per call: so in consecutive frames of it from one CPU (each CPU's buffer loses only its
    oldest frames) %rdi steps by one and kgtp_counter by one plus the calls other CPUs made meanwhile (exactly
    one with one CPU), and the collected expression is 2*%rdi + 3*%rsi. System calls come
    through vector 0x80 with a number the kernel's test thread uses. `jiffies` never goes back; `$_sdata` of
    sched_switch renders by its format.
    """
    problems: list[str] = []
    by_name = {i + 1: spec.name for i, spec in enumerate(specs)}
    previous: dict[tuple[int, int], FrameRecord] = {}
    cpus = {frame.cpu for frame in frames}
    last_jiffies: tuple[int, int] | None = None
    for frame in frames:
        name = by_name.get(frame.tracepoint)
        values = {k: _int(v) if k != "$_sdata" else v for k, v in frame.values.items()}
        missing = [k for k, v in values.items() if v is None]
        where = f"frame {frame.number} ({name})"
        if missing:
            problems.append(f"{where}: cannot read {', '.join(missing)}")
        elif name == "kgtp_test_function":
            rdi, rsi, counter, expression = (values[k] for k in specs[0].readback)
            if (rsi - rdi) & 0xFFFFFFFF != 0xFFFFFFFF:  # type: ignore[operator]
                problems.append(f"{where}: counter2 {rsi} is not counter1 {rdi} - 1")
            if expression != 2 * rdi + 3 * rsi:  # type: ignore[operator]
                problems.append(f"{where}: collected expression {expression} != 2*{rdi}+3*{rsi}")
            before = previous.get((frame.tracepoint, frame.cpu))
            if before is not None:
                step_rdi = rdi - _int(before.values["$rdi"])  # type: ignore[operator]
                step_counter = counter - _int(before.values["kgtp_counter"])  # type: ignore[operator]
                if step_rdi != 1 or step_counter < 1 or (len(cpus) == 1 and step_counter != 1):
                    problems.append(f"{where}: after frame {before.number} of CPU {frame.cpu} counter1 stepped "
                                    f"{step_rdi} and kgtp_counter {step_counter} (one call each expected)")
        elif name == "do_syscall":
            if values["regs->vector"] != SYSCALL_VECTOR or values["regs->orig_ax"] not in KERNEL_SYSCALLS:
                problems.append(f"{where}: vector {values['regs->vector']} nr {values['regs->orig_ax']}")
        elif name == "sched_switch marker":
            if not str(values["$_sdata"]).strip('"').startswith("prev_comm="):
                problems.append(f"{where}: $_sdata {values['$_sdata']!r}")
        if not missing and "jiffies" in values:
            jiffies = values["jiffies"]
            if last_jiffies is not None and jiffies < last_jiffies[0]:  # type: ignore[operator]
                problems.append(f"{where}: jiffies {jiffies} went back from {last_jiffies[0]} "
                                f"(frame {last_jiffies[1]})")
            if final_jiffies is not None and jiffies > final_jiffies:  # type: ignore[operator]
                problems.append(f"{where}: jiffies {jiffies} is ahead of the kernel's {final_jiffies}")
            last_jiffies = (jiffies, frame.number)  # type: ignore[assignment]
        if not missing:
            previous[(frame.tracepoint, frame.cpu)] = frame
    return problems


def check_sequence(rows: Sequence[tuple[int, int, float, int]], frames: int, created: int,
                   cpu_of: dict[int, int] | None = None) -> list[str]:
    """Each CPU's buffer holds its newest frames: their sequence numbers (the CPU's creation counter when each
    was committed) are consecutive, the newest CPU's ones add up to tcreated (each CPU counts from 0), and the
    merged frames' timestamps never go back."""
    problems: list[str] = []
    cpu_of = cpu_of or {}
    if len(rows) != frames:
        problems.append(f"monitor frames lists {len(rows)} frames, qTStatus says {frames}")
    last: dict[int, tuple[int, int]] = {}  # cpu -> (frame number, sequence)
    for index, (number, _, stamp, seq) in enumerate(rows):
        cpu = cpu_of.get(number, 0)
        if cpu in last and seq != last[cpu][1] + 1:
            problems.append(f"frame {number}: CPU {cpu}'s sequence {seq} after {last[cpu][1]}")
        last[cpu] = (number, seq)
        if index and stamp < rows[index - 1][2]:
            problems.append(f"frame {number}: timestamp goes back")
    if rows and sum(seq + 1 for _, seq in last.values()) != created:
        newest = ", ".join(f"CPU {cpu}: {seq}" for cpu, (_, seq) in sorted(last.items()))
        problems.append(f"newest sequences ({newest}) do not add up to tcreated {created}")
    return problems
