"""Frames a second with 1, 2 and 4 CPUs (issue 15): the machine serving, every CPU's `kgtp_bench/N` thread
calling kgtp_test_function at full pace, the thesis' cond+expr tracepoint compiled at its entry, a circular
per-CPU buffer. Host time, reported (never asserted): the machine interleaves its CPUs on one host thread
(docs/DESIGN.md, Several CPUs), so this shows what several CPUs cost, not a speed-up.

Runs on the caller's thread; the machine it starts has its own CPU and ticker threads.
"""

from __future__ import annotations

import statistics
import time

from kgtp_sim.client.paths import VMLINUX
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import Tracer

from .record import FIXTURE, load
from .runner import Config, packets

FULL_SPEED_PACE = 1_000_000  #: kgtp_test_function calls per tick: more than a CPU can make, so it never sleeps
BUFFER_PER_CPU = 1 << 20


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.01)


def smp_row(cpus: int, seconds: float = 2.0, windows: int = 3, engine: str = "opt",
            image: KernelImage | None = None) -> dict:
    """One CPU count: frames committed a second over `windows` windows of `seconds` each (median, min, max),
    the kernel's calls of kgtp_test_function a second, and each CPU's share of the frames in the buffer."""
    image = image or KernelImage.load(VMLINUX)
    machine = Machine(image, cpus=cpus, pace=FULL_SPEED_PACE)
    try:
        machine.start()
        _wait(lambda: machine.stats(count=False).cpus_online == cpus, 30, f"{cpus} CPUs online")
        tracer = Tracer(machine, engine)
        tracer.definitions.buffer_size = BUFFER_PER_CPU
        tracer.definitions.circular = True
        definition, actions = packets(Config("dynamic-jump", "cond+expr", engine), image, load(FIXTURE))
        tracer.definitions.define(t.DefineTracepoint.parse(definition))
        for action in actions:
            tracer.definitions.add_actions(t.TracepointActions.parse(action))
        tracer.start()
        _wait(lambda: (tracer.status().created or 0) > 0, 30, "the first frame")
        rates, calls = [], []
        for _ in range(windows):
            c0, k0, t0 = tracer.status().created or 0, machine.read_symbol("kgtp_counter"), time.monotonic()
            time.sleep(seconds)
            c1, k1, t1 = tracer.status().created or 0, machine.read_symbol("kgtp_counter"), time.monotonic()
            rates.append((c1 - c0) / (t1 - t0))
            calls.append(((k1 - k0) & 0xFFFFFFFF) / (t1 - t0))
        shares: dict[int, int] = {}
        for frame in tracer.frames():
            shares[frame.cpu] = shares.get(frame.cpu, 0) + 1
        stats = machine.stats(count=False)
        tracer.stop(t.StopReason.STOP_COMMAND)
    finally:
        machine.shutdown()
    total = sum(shares.values()) or 1
    return {
        "cpus": cpus, "engine": engine, "case": "cond+expr", "probe": "dynamic-jump",
        "frames_per_s_median": round(statistics.median(rates)), "frames_per_s_min": round(min(rates)),
        "frames_per_s_max": round(max(rates)), "calls_per_s_median": round(statistics.median(calls)),
        "cpu_share_of_buffer": {str(cpu): round(n / total, 3) for cpu, n in sorted(shares.items())},
        "cpu_switches": stats.cpu_switches, "windows": windows, "window_s": seconds,
    }


def smp_rows(counts: tuple[int, ...] = (1, 2, 4), seconds: float = 2.0, windows: int = 3) -> list[dict]:
    return [smp_row(n, seconds, windows) for n in counts]


def markdown(rows: list[dict]) -> str:
    base = rows[0]["frames_per_s_median"] or 1
    lines = ["| CPUs | frames/s (median) | min .. max | ratio to 1 CPU | kernel calls/s | share of frames by CPU |",
             "|---:|---:|---|---:|---:|---|"]
    for row in rows:
        share = ", ".join(f"{cpu}: {v:.0%}" for cpu, v in row["cpu_share_of_buffer"].items())
        lines.append(f"| {row['cpus']} | {row['frames_per_s_median']:,} | {row['frames_per_s_min']:,} .. "
                     f"{row['frames_per_s_max']:,} | {row['frames_per_s_median'] / base:.2f} | "
                     f"{row['calls_per_s_median']:,} | {share} |")
    return "\n".join(lines)
