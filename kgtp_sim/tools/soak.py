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

The soak runs on this command's main thread; the stub and GDB are child processes (the stub's output, and that of
the GDB the final walk drives through MI, are read by daemon threads of kgtp_sim.client).
"""

# The pieces (kept out of the docstring, which is the tool's --help): soak_checks.py (the tracepoints, the samples
# and every verdict over them), soak_walk.py (the final walk through GDB/MI), this module (starting the stub,
# setting up the run with GDB, sampling it, the figures, the report and the command line; its thread is in the
# docstring). Every name of the other two is offered here too.

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ..client import VMLINUX, MiError, RspClient, StubProcess, run_gdb, start_stub, system_gdb
from ..rsp.packets.trace import decode_trace_status
from . import soak_checks, soak_walk
from .soak_checks import (
    ENTRY_ALIGNMENT,
    KERNEL_SYSCALLS,
    MIN_ENTRY_BYTES,
    SYSCALL_VECTOR,
    Check,
    FrameRecord,
    Limits,
    MemoryFigures,
    Sample,
    TracepointSpec,
    _first,
    check_frame_values,
    check_memory,
    check_samples,
    check_sequence,
    least_squares_slope,
    memory_figures,
    tracepoint_specs,
)
from .soak_walk import FinalFigures, final_walk

__all__ = [
    # the tracepoints and the verdicts
    "ENTRY_ALIGNMENT", "KERNEL_SYSCALLS", "MIN_ENTRY_BYTES", "SYSCALL_VECTOR", "Check", "FrameRecord", "Limits",
    "MemoryFigures", "Sample", "TracepointSpec", "check_frame_values", "check_memory", "check_samples",
    "check_sequence", "least_squares_slope", "memory_figures", "tracepoint_specs",
    # the final walk
    "FinalFigures", "final_walk",
    # the run
    "FULL_SPEED_PACE", "MIB", "STUB_LOG_LINES", "SoakConfig", "SoakResult", "main", "process_memory_kib", "report",
    "run_soak", "set_up_tracing", "take_sample", "throughput", "to_json",
]

#: Kernel calls the workload thread makes per tick: far more than it can make, so it never sleeps.
FULL_SPEED_PACE = 1_000_000
#: Log lines of the stub kept in the report (the last ones).
STUB_LOG_LINES = 400
MIB = 1024 * 1024
#: Where a failure is located for the report: the soak's own modules.
_SOAK_FILES = frozenset({__file__, soak_checks.__file__, soak_walk.__file__})


# ---- the stub's memory ---------------------------------------------------------------------------------------


def process_memory_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in KiB, from /proc/PID/status."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(rest.split()[0])
    return fields.get("VmRSS", 0), fields.get("VmHWM", 0)


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
        where = [f for f in traceback.extract_tb(error.__traceback__) if f.filename in _SOAK_FILES][-1]
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
