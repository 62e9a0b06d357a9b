"""Soak: minutes of tracing into a small circular buffer with several tracepoints firing at full speed.

    python -m kgtp_sim.tools.soak [--minutes 10] [--engine opt|naive|interp] [--cpus 2] [--buffer-size N]
                                  [--sample-seconds S] [--json FILE]

Short runs answer "does it work"; this answers "does it keep working". The stub is started exactly as users
start it (`python -m kgtp_sim serve --port 0`), real GDB defines the tracepoints and starts a disconnected run
into a circular buffer small enough to wrap many times a second, and a plain RSP connection then samples, every
few seconds, the stub's memory (VmRSS, VmHWM), the buffer accounting of qTStatus (`tframes`, `tcreated`,
`tfree`, `tsize`), the tracepoints' hits and bytes (qTP), `jiffies` and `monitor stats`. At the end that
connection goes away and real GDB attaches again (through MI, so one bad frame does not end the walk): it finds
the run still going, stops it, walks the whole buffer with `tfind` and checks every frame.

Every invariant is printed PASS or FAIL with what broke it; the exit status is non-zero if any failed. The
figures (memory over time, frames per second, wraps, emulated instructions per second) are printed as a table
and, with `--json`, written to a file.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..client import VMLINUX, GdbMi, MiError, RspClient, StubProcess, run_gdb, start_stub, system_gdb
from ..rsp.packets.trace import StopReason, decode_trace_status

#: This stub's ring keeps whole entries of 8-byte multiples (tracing/core/ring.py), so `tsize - tfree` is one too.
ENTRY_ALIGNMENT = 8
#: The smallest entry that holds a frame: the 24-byte entry header and GDB's 6-byte frame header, aligned.
MIN_ENTRY_BYTES = 32
#: Kernel calls the workload thread makes per tick: far more than it can make, so it never sleeps.
FULL_SPEED_PACE = 1_000_000
#: Log lines of the stub kept in the report (the last ones).
STUB_LOG_LINES = 400
#: The system call numbers the kernel's syscall_test thread uses (fixtures/kernel/syscall.c).
KERNEL_SYSCALLS = frozenset({1, 24, 35, 39, 500})
SYSCALL_VECTOR = 0x80
MIB = 1024 * 1024


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


# ---- the stub's memory ---------------------------------------------------------------------------------------


def process_memory_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in KiB, from /proc/PID/status."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(rest.split()[0])
    return fields.get("VmRSS", 0), fields.get("VmHWM", 0)


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


_MONITOR_FRAME = re.compile(r"^frame\s+(\d+)\s+tp\s+(\d+)\s+\+\s*(-?[\d.]+) us\s+cpu (\d+)\s+seq (\d+)", re.M)


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


@dataclass
class FinalFigures:
    status_before_stop: dict[str, str] = field(default_factory=dict)
    status_after_stop: dict[str, str] = field(default_factory=dict)
    tstatus_text: str = ""
    frames_walked: int = 0
    frames_by_tracepoint: dict[int, int] = field(default_factory=dict)
    tdumps: int = 0
    final_jiffies: int | None = None


def _tracepoints_by_local_number(mi: GdbMi) -> dict[int, int]:
    """GDB's own number of each tracepoint it learned from the target -> its address.

    A reconnecting GDB numbers uploaded tracepoints itself (in the order of its upload list, not the target's),
    so frames are matched to the tracepoints defined at set-up by address, never by number.
    """
    table = mi.command("-break-list").get("BreakpointTable", {})
    body = table.get("body", []) if isinstance(table, dict) else []
    out: dict[int, int] = {}
    for row in body if isinstance(body, list) else []:
        point = row.get("bkpt") if isinstance(row, dict) else None
        if isinstance(point, dict) and isinstance(point.get("addr"), str) and point["addr"].startswith("0x"):
            out[int(str(point["number"]))] = int(point["addr"], 16)
    return out


def _status(mi: GdbMi) -> dict[str, str]:
    result = mi.command("-trace-status")
    return {k: v for k, v in result.results.items() if isinstance(v, str)}


def final_walk(gdb: str, stub: StubProcess, specs: Sequence[TracepointSpec], addresses: dict[int, int],
               jiffies_address: int, walk_limit: int) -> tuple[FinalFigures, list[Check]]:
    """Attach real GDB, stop the run and check the whole buffer (or, past `walk_limit` frames, first, last and
    evenly spaced frames): pcs, values, frame count, sequence numbers, and `tdump` on a sample."""
    figures = FinalFigures()
    checks: list[Check] = []
    with GdbMi(gdb, VMLINUX, timeout=120) as mi:
        result = mi.attach(stub.address, patience=30)
        if result.klass != "connected":
            return figures, [Check("GDB attaches at the end", False, str(result.get("msg")))]
        local = _tracepoints_by_local_number(mi)
        figures.status_before_stop = _status(mi)
        figures.tstatus_text = mi.console("tstatus").console.strip()
        running = figures.status_before_stop.get("running") == "1"
        checks.append(Check("run still going when GDB attaches at the end", running,
                            figures.tstatus_text.splitlines()[0] if figures.tstatus_text else "no tstatus"))
        jiffies = mi.evaluate(f"*(unsigned long *){jiffies_address:#x}")
        mi.command("-trace-stop", check=False)
        figures.status_after_stop = after = _status(mi)
        figures.final_jiffies = _int(mi.evaluate(f"*(unsigned long *){jiffies_address:#x}")) or _int(jiffies)
        checks.append(Check("tstop stops the run", after.get("running") == "0", f"running={after.get('running')}"))
        frames = int(after.get("frames", "0"))
        created = int(after.get("frames-created", "0"))

        rows: list[tuple[int, int, float, int]] = []
        cpu_of: dict[int, int] = {}
        monitor_error = ""
        for first in range(0, max(frames, 1), 10000):
            text = mi.console(f"monitor frames {first} 10000")
            if text.klass != "done":
                monitor_error = str(text.get("msg"))
                break
            found_rows = _MONITOR_FRAME.findall(text.console)
            rows += [(int(n), int(tp), float(us), int(seq)) for n, tp, us, _, seq in found_rows]
            cpu_of.update((int(n), int(cpu)) for n, _, _, cpu, _ in found_rows)
        problems = [f"monitor frames failed: {monitor_error}"] if monitor_error else check_sequence(rows, frames,
                                                                                                      created, cpu_of)
        checks.append(Check("each CPU's frame sequence consecutive, newest ones add up to tcreated", not problems,
                            _first(problems) if problems else f"{len(rows)} frames, seq {rows[0][3] if rows else '-'}"
                            f"..{rows[-1][3] if rows else '-'}"))

        start = mi.console("tfind start")
        found_start = re.search(r"Found trace frame 0, tracepoint (\d+)", start.console)
        checks.append(Check("tfind start finds frame 0", found_start is not None or frames == 0,
                            start.console.strip().splitlines()[0] if start.console.strip() else str(start.get("msg"))))

        on_target = {address: number for number, address in addresses.items()}
        wanted = list(range(max(frames, 0))) if frames <= walk_limit else sorted(
            {0, frames - 1, *range(0, frames, max(1, frames // walk_limit))})
        walked: list[FrameRecord] = []
        pc_problems: list[str] = []
        for number in wanted:
            found = mi.command(f"-trace-find frame-number {number}", check=False)
            if found.get("found") != "1":
                pc_problems.append(f"tfind {number} found nothing")
                continue
            address = local.get(int(str(found.get("tracepoint"))))
            tracepoint = on_target.get(address, 0) if address is not None else 0
            frame = found.get("frame", {})
            pc = int(frame["addr"], 16) if isinstance(frame, dict) and isinstance(frame.get("addr"), str) else None
            if tracepoint == 0:
                pc_problems.append(f"frame {number}: GDB's tracepoint {found.get('tracepoint')} is not one defined")
            elif pc != address:
                pc_problems.append(f"frame {number}: pc {pc if pc is None else hex(pc)} is not tracepoint "
                                   f"{tracepoint}'s address {address:#x}")
            if number < len(rows) and rows[number][1] != tracepoint:
                pc_problems.append(f"frame {number}: tfind says tracepoint {tracepoint}, monitor frames "
                                   f"{rows[number][1]}")
            spec = specs[tracepoint - 1] if 0 < tracepoint <= len(specs) else None
            values = {expr: mi.evaluate(expr) for expr in (spec.readback if spec else ())}
            walked.append(FrameRecord(number, tracepoint, pc, values, cpu_of.get(number, 0)))
        beyond = mi.command(f"-trace-find frame-number {frames}", check=False)
        figures.frames_walked = len(walked)
        figures.frames_by_tracepoint = dict(collections.Counter(f.tracepoint for f in walked))
        count_ok = len(walked) == len(wanted) and beyond.get("found") != "1"
        checks.append(Check("tfind walks exactly tframes frames", count_ok and frames > 0,
                            f"walked {len(walked)} of tframes {frames}" + (" (sampled)" if frames > walk_limit else "")
                            + ("; a frame past the end was found" if beyond.get("found") == "1" else "")))
        checks.append(Check("every frame's pc is its tracepoint's address", not pc_problems and bool(walked),
                            _first(pc_problems) if pc_problems else f"{len(walked)} frames"))
        value_problems = check_frame_values(walked, specs, figures.final_jiffies)
        checks.append(Check("collected values sane and consecutive", not value_problems and bool(walked),
                            _first(value_problems) if value_problems else
                            (", ".join(f"tp{tp}: {n}" for tp, n in sorted(figures.frames_by_tracepoint.items()))
                             + "; by CPU " + ", ".join(f"{cpu}: {n}" for cpu, n in sorted(
                                 collections.Counter(f.cpu for f in walked).items())))
                            if walked else "no frames to check"))

        dump_problems: list[str] = []
        samples = sorted({0, frames - 1, *range(0, frames, max(1, frames // 20))}) if frames > 0 else []
        for number in samples:
            found = mi.command(f"-trace-find frame-number {number}", check=False)
            dump = mi.console("tdump")
            head = re.match(r"Data collected at tracepoint (\d+), trace frame (\d+):", dump.console)
            if dump.klass != "done" or head is None or int(head.group(2)) != number:
                dump_problems.append(f"frame {number}: {dump.get('msg') or dump.console[:80]!r}")
            elif str(found.get("tracepoint")) != head.group(1) or head.group(1) not in map(str, local):
                dump_problems.append(f"frame {number}: tdump names tracepoint {head.group(1)}")
        figures.tdumps = len(samples)
        checks.append(Check("tdump works on first, last and every k-th frame", not dump_problems and bool(samples),
                            _first(dump_problems) if dump_problems else f"{len(samples)} frames dumped"))
        mi.command("-trace-find none", check=False)
        mi.command("-target-detach", check=False)
    return figures, checks


# ---- the run -------------------------------------------------------------------------------------------------


@dataclass
class SoakConfig:
    duration_s: float
    engine: str
    buffer_size: int
    sample_s: float
    warmup_s: float
    pace: int
    gdb: str
    walk_limit: int
    limits: Limits
    cpus: int = 2


@dataclass
class SoakResult:
    config: SoakConfig
    tracepoints: list[dict[str, object]]
    samples: list[Sample]
    memory: MemoryFigures
    throughput: dict[str, float]
    final: FinalFigures
    checks: list[Check]
    stub_log: list[str]
    wall_s: float

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)


def set_up_tracing(gdb: str, stub: StubProcess, config: SoakConfig,
                   specs: Sequence[TracepointSpec]) -> tuple[dict[int, int], str]:
    """Define the tracepoints with real GDB in batch mode, start a disconnected circular run, and leave.

    Returns each tracepoint's address as GDB placed it, and what GDB printed.
    """
    lines = [f"monitor pace {config.pace}", "set disconnected-tracing on", "set circular-trace-buffer on",
             f"set trace-buffer-size {config.buffer_size}"]
    for spec in specs:
        lines += [spec.command, "actions", *spec.actions, "end"]
    lines += ["tstart", "tstatus", "detach"]
    output = run_gdb(gdb, stub, *lines, timeout=120)
    addresses = {int(n): int(a, 16) for n, a in
                 re.findall(r"^(?:Static )?[Tt]racepoint (\d+) at (0x[0-9a-f]+)", output, re.M)}
    if len(addresses) != len(specs) or "Trace is running on the target" not in output:
        raise RuntimeError("GDB could not set up the run:\n" + output)
    return addresses, output


def take_sample(client: RspClient, pid: int, elapsed: float, tracepoints: dict[int, int],
                jiffies_address: int) -> Sample:
    rss, hwm = process_memory_kib(pid)
    sample = Sample(elapsed, rss, hwm)
    reply = client.request(b"qTStatus")
    try:
        status = decode_trace_status(reply)
    except ValueError:
        sample.status_error = f"qTStatus answered {reply[:60].decode(errors='replace')!r}"
    else:
        sample.running = status.running
        sample.stop_reason = status.stop_reason.value
        sample.frames, sample.created = status.frames, status.created
        sample.free, sample.size = status.buffer_free, status.buffer_size
    for number, address in tracepoints.items():
        reply = client.request(b"qTP:%x:%x" % (number, address))
        match = re.fullmatch(rb"V([0-9a-f]+):([0-9a-f]+)", reply)
        if match:
            sample.hits[number], sample.usage[number] = int(match.group(1), 16), int(match.group(2), 16)
    try:
        sample.jiffies = client.read_u64(jiffies_address)
    except (RuntimeError, ValueError):
        pass
    try:
        stats = client.monitor("stats")
    except RuntimeError:
        stats = ""
    match = re.search(r"^instructions\s+(\d+)", stats, re.M)
    sample.instructions = int(match.group(1)) if match else None
    state = re.search(r"^state\s+(.+)$", stats, re.M)
    sample.machine_state = state.group(1).strip() if state else ""
    return sample


def throughput(samples: Sequence[Sample], buffer_size: int, cpus: int = 1) -> dict[str, float]:
    """Rates between the first and last sample; wraps from the bytes the tracepoints wrote (qTP usage)."""
    good = [s for s in samples if s.created is not None]
    out: dict[str, float] = {}
    if len(good) >= 2:
        first, last = good[0], good[-1]
        span = last.elapsed_s - first.elapsed_s
        out["frames_per_s"] = (last.created - first.created) / span if span else 0.0  # type: ignore[operator]
        if first.instructions is not None and last.instructions is not None:
            out["insns_per_s"] = (last.instructions - first.instructions) / span if span else 0.0
        if first.jiffies is not None and last.jiffies is not None:
            out["jiffies_per_s"] = (last.jiffies - first.jiffies) / span if span else 0.0
        for number in last.hits:
            out[f"tp{number}_hits_per_s"] = (last.hits[number] - first.hits.get(number, 0)) / span if span else 0.0
    if good:
        last = good[-1]
        out["frames_created"] = float(last.created or 0)
        out["bytes_written"] = float(sum(last.usage.values()))
        out["wraps"] = out["bytes_written"] / (buffer_size * cpus)  # laps of the CPUs' rings, on average
        post = [s.frames for s in good if s.created and s.frames is not None and s.created > s.frames]
        if post:
            out["tframes_min"], out["tframes_median"], out["tframes_max"] = (
                float(min(post)), float(statistics.median(post)), float(max(post)))
    return out


def run_soak(config: SoakConfig, progress: Callable[[str], None] = print) -> SoakResult:
    from ..machine import KernelImage

    started = time.monotonic()
    image = KernelImage.load(VMLINUX)
    site = next(m.site for m in image.markers if m.id == "sched::sched_switch")
    jiffies_address = image.address_of("jiffies")
    specs = tracepoint_specs(site)
    stub = start_stub("--engine", config.engine, "--cpus", str(config.cpus), "--verbose", timeout=60)
    samples: list[Sample] = []
    final = FinalFigures()
    checks: list[Check] = []
    try:
        addresses, _ = set_up_tracing(config.gdb, stub, config, specs)
        progress(f"soak: stub pid {stub.pid} port {stub.port}, {config.cpus} CPUs, engine {config.engine}, "
                 f"{len(specs)} tracepoints, {config.buffer_size}-byte circular buffer; running "
                 f"{config.duration_s:.0f}s, sampling every {config.sample_s:g}s")
        run_started = time.monotonic()
        client = RspClient.connect_when_free(stub, timeout=30)
        try:
            next_at = 0.0
            while True:
                elapsed = time.monotonic() - run_started
                if elapsed >= next_at or elapsed >= config.duration_s:
                    sample = take_sample(client, stub.pid, elapsed, addresses, jiffies_address)
                    samples.append(sample)
                    progress(_sample_line(sample))
                    # a late sample (a slow reply) does not make the next ones bunch up behind it
                    next_at = max(next_at + config.sample_s, elapsed + config.sample_s / 2)
                if elapsed >= config.duration_s:
                    break
                time.sleep(max(0.0, min(next_at, config.duration_s) - (time.monotonic() - run_started)))
        finally:
            client.close()
        progress("soak: sampler disconnected; GDB attaches to stop the run and walk the buffer")
        try:
            final, checks = final_walk(config.gdb, stub, specs, addresses, jiffies_address, config.walk_limit)
        except MiError as error:
            checks = [Check("GDB walks the final buffer", False, str(error))]
            stub.dump_threads()
    except (OSError, ConnectionError, RuntimeError) as error:
        where = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == __file__][-1]
        detail = str(error).splitlines()[0] if str(error) else repr(error)
        checks = [Check("soak ran to the end", False, f"{detail} (in {where.name}, line {where.lineno})")]
        addresses = {}
        stub.dump_threads()
    finally:
        alive = stub.proc.poll() is None
        stub.stop(timeout=15)
    log = [line.rstrip("\n") for line in stub.output]
    memory = memory_figures(samples, config.duration_s, config.warmup_s)
    errors = [line for line in log if " ERROR " in line or "Traceback" in line]
    all_checks = (check_samples(samples, config.buffer_size, config.limits, config.cpus)
                  + check_memory(memory, config.limits)
                  + checks + [Check("stub alive to the end, no errors logged", alive and not errors,
                                    _first(errors) if errors else ("alive" if alive else "the stub exited"))])
    tracepoints = [{"number": n, "address": hex(a), "name": specs[n - 1].name, "command": specs[n - 1].command,
                    "actions": list(specs[n - 1].actions)} for n, a in sorted(addresses.items())]
    return SoakResult(config, tracepoints, samples, memory, throughput(samples, config.buffer_size, config.cpus), final,
                      all_checks, log[-STUB_LOG_LINES:], time.monotonic() - started)


# ---- reporting -----------------------------------------------------------------------------------------------


def _sample_line(s: Sample) -> str:
    if s.status_error:
        return f"  t={s.elapsed_s:6.0f}s  RSS {s.rss_kib / 1024:6.1f} MiB  {s.status_error}"
    return (f"  t={s.elapsed_s:6.0f}s  RSS {s.rss_kib / 1024:6.1f} MiB  HWM {s.hwm_kib / 1024:6.1f} MiB  "
            f"tframes {s.frames:>6}  tcreated {s.created:>10}  tfree {s.free:>8}  jiffies {s.jiffies}  "
            f"{'running' if s.running else 'STOPPED ' + s.stop_reason}")


def report(result: SoakResult) -> str:
    c, m, t = result.config, result.memory, result.throughput
    rows = [
        ("engine / buffer / pace", f"{c.engine} / {c.buffer_size} bytes circular / {c.pace} calls per tick"),
        ("run length", f"{c.duration_s:.0f} s traced, {len(result.samples)} samples, {result.wall_s:.0f} s wall"),
        ("RSS after warm-up", f"{m.rss_start_mib:.1f} MiB"),
        ("RSS at the end", f"{m.rss_end_mib:.1f} MiB"),
        ("RSS peak (VmHWM)", f"{m.rss_peak_mib:.1f} MiB ({m.hwm_peak_mib:.1f} MiB)"),
        ("RSS slope, last 80%", f"{m.slope_mib_per_min:+.3f} MiB/min"),
        ("frames created", f"{t.get('frames_created', 0):,.0f}"),
        ("frames per second", f"{t.get('frames_per_s', 0):,.0f}"),
        ("bytes written / wraps", f"{t.get('bytes_written', 0):,.0f} / {t.get('wraps', 0):,.0f}"),
        ("tframes once wrapped", f"min {t.get('tframes_min', 0):.0f}, median {t.get('tframes_median', 0):.0f}, "
                                 f"max {t.get('tframes_max', 0):.0f}"),
        ("emulated insns per second", f"{t.get('insns_per_s', 0):,.0f}"),
        ("jiffies per second", f"{t.get('jiffies_per_s', 0):.1f}"),
    ]
    for tp in result.tracepoints:
        rate = t.get(f"tp{tp['number']}_hits_per_s", 0.0)
        rows.append((f"tp{tp['number']} {tp['name']} hits/s", f"{rate:,.1f}"))
    rows.append(("final buffer walked", f"{result.final.frames_walked} frames, {result.final.tdumps} tdumps"))
    width = max(len(name) for name, _ in rows)
    out = ["", "figures", "-------"] + [f"{name:<{width}}  {value}" for name, value in rows]
    out += ["", "invariants", "----------"]
    out += [f"{'PASS' if ch.passed else 'FAIL'}  {ch.name}: {ch.detail}" for ch in result.checks]
    failed = sum(not ch.passed for ch in result.checks)
    if failed and result.stub_log:
        out += ["", "the stub's last log lines", "-------------------------", *result.stub_log[-60:]]
    out += ["", f"soak: {'PASS' if not failed else 'FAIL'} ({len(result.checks) - failed} passed, {failed} failed)"]
    return "\n".join(out)


def to_json(result: SoakResult) -> dict[str, object]:
    return {
        "config": asdict(result.config),
        "tracepoints": result.tracepoints,
        "memory": asdict(result.memory),
        "throughput": result.throughput,
        "final": asdict(result.final),
        "checks": [asdict(ch) for ch in result.checks],
        "passed": result.passed,
        "wall_s": result.wall_s,
        "samples": [asdict(s) for s in result.samples],
        "stub_log": result.stub_log,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to trace (default 10)")
    parser.add_argument("--seconds", type=float, default=None, help="how long to trace, overriding --minutes")
    parser.add_argument("--engine", choices=("opt", "naive", "interp"), default="opt", help="default opt")
    parser.add_argument("--buffer-size", type=lambda v: int(v, 0), default=0x20000,
                        help="circular trace buffer bytes (default 0x20000: wraps many times a second)")
    parser.add_argument("--sample-seconds", type=float, default=None,
                        help="seconds between samples (default 10, or a tenth of a shorter run)")
    parser.add_argument("--warmup-seconds", type=float, default=None,
                        help="RSS 'at start' is taken after this (default 30, or a fifth of a shorter run)")
    parser.add_argument("--pace", type=int, default=FULL_SPEED_PACE,
                        help="kgtp_test_function calls per tick (default: more than the kernel can make)")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the machine (default 2, as serve)")
    parser.add_argument("--walk-limit", type=int, default=5000, help="walk every frame up to this many, else sample")
    parser.add_argument("--rss-slope-limit", type=float, default=Limits.rss_slope_mib_per_min, help="MiB/min")
    parser.add_argument("--rss-growth-limit", type=float, default=Limits.rss_growth_mib, help="MiB")
    parser.add_argument("--frames-band", type=float, default=Limits.frames_band,
                        help="allowed relative spread of tframes around its median once wrapped")
    parser.add_argument("--gdb", default=system_gdb() or "gdb")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the figures as JSON")
    args = parser.parse_args(argv)
    duration = args.seconds if args.seconds is not None else args.minutes * 60
    if duration <= 0:
        parser.error("the run must last more than 0 seconds")
    config = SoakConfig(
        duration_s=duration, engine=args.engine, buffer_size=args.buffer_size & ~7,
        sample_s=args.sample_seconds or min(10.0, max(1.0, duration / 10)),
        warmup_s=args.warmup_seconds if args.warmup_seconds is not None else min(30.0, duration / 5),
        pace=args.pace, gdb=args.gdb, walk_limit=args.walk_limit,
        limits=Limits(args.rss_slope_limit, args.rss_growth_limit, args.frames_band), cpus=args.cpus,
    )
    result = run_soak(config)
    print(report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(to_json(result), indent=2) + "\n")
        print(f"soak: figures written to {args.json}")
    return 0 if result.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
