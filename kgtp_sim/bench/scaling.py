"""Second workload (issue 6): per-hit cost with many active tracepoints, and with trace buffers of every size.

Extra tracepoints go on instructions of kernel functions off the bench path (kgtp_test_function and
kgtp_bench_loop excluded); `Machine.call` injects no interrupt, so they are armed but never fire. The hot
tracepoint is the thesis' cond+expr (or false-cond) on kgtp_test_function with the optimizing engine.

Runs on the caller's thread (the main thread of `kgtp-sim bench --scaling`), on runner.Bench's machines, which are
never started (runner.py).
"""

from __future__ import annotations

import resource
import statistics

from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing.patching.probes import ProbePlacementError, decode, plan_probe

from .runner import Bench, Config

OFF_PATH_EXCLUDED = ("kgtp_test_function", "kgtp_bench_loop")


def idle_sites(image, limit: int) -> list[int]:
    """Probe sites off the bench path, in address order: every instruction boundary a probe may take (the tracer
    turns jumps whose window covers another site into int3s, so neighbouring sites all fit)."""
    out: list[int] = []
    for sym in sorted((s for s in image.symbols.values() if s.type == "FUNC" and s.size), key=lambda s: s.address):
        if sym.name in OFF_PATH_EXCLUDED:
            continue
        for insn in decode(image.read_code(sym.address, sym.size), sym.address):
            try:
                plan_probe(image, insn.address, "int3")
            except (ProbePlacementError, StopIteration):
                continue
            out.append(insn.address)
            if len(out) >= limit:
                return out
    return out


def _vm(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def scaling_rows(quick: bool = False, calls: int = 2000, repetitions: int = 5, case: str = "cond+expr") -> list[dict]:
    bench = Bench(calls=calls, repetitions=repetitions)
    base = bench.untraced()
    base_ns = statistics.median(base.ns_per_call)
    hot = Config("dynamic-jump", case, "opt")
    rows = []
    counts = (1, 10, 100) if quick else (1, 10, 100, 1000)
    sites = idle_sites(bench.image, max(counts) - 1)

    for n in counts:
        extra = sites[: n - 1]

        def add_extras(tracer, extra=extra):
            for k, address in enumerate(extra, start=2):
                tracer.definitions.define(t.DefineTracepoint.parse(b"%d:%x:E:0:0-" % (k, address)))
                tracer.definitions.add_actions(t.TracepointActions.parse(b"%d:%x:R30" % (k, address)))

        m = bench.traced(hot, tracer_setup=add_extras)
        rows.append({"workload": "tracepoints", "tracepoints": 1 + len(extra), "requested": n,
                     "buffer_bytes": 64 << 20, **_times(m, base, base_ns)})
    sizes = (64 << 10, 1 << 20, 64 << 20) if quick else (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
    for size in sizes:
        def small(tracer, size=size):
            tracer.definitions.buffer_size = size
            tracer.definitions.circular = True  # a small buffer wraps instead of stopping with tfull

        m = bench.traced(hot, tracer_setup=small)
        rows.append({"workload": "buffer", "tracepoints": 1, "requested": 1, "buffer_bytes": size,
                     **_times(m, base, base_ns), "vm_rss_kib": _vm("VmRSS"), "vm_hwm_kib": _vm("VmHWM"),
                     "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss})
    return rows


def _times(m, base, base_ns) -> dict:
    ns = [x - base_ns for x in m.ns_per_call]
    return {"insns_per_hit": m.insns_per_call - base.insns_per_call, "ns_per_hit_median": round(statistics.median(ns), 1),
            "ns_per_hit_min": round(min(ns), 1), "ns_per_hit_max": round(max(ns), 1), "frames": m.frames}


def markdown(rows: list[dict]) -> str:
    lines = ["Scaling (hot tracepoint: cond+expr, opt, jump; extra tracepoints armed but never hit):", "",
             "| workload | tracepoints | buffer | insns/hit | ns/hit median | min..max | frames | VmRSS / VmHWM (KiB) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        rss = f"{r['vm_rss_kib']:,} / {r['vm_hwm_kib']:,}" if "vm_rss_kib" in r else "-"
        tp = f"{r['tracepoints']}" + ("" if r["tracepoints"] == r["requested"] else f" (asked {r['requested']})")
        lines.append(f"| {r['workload']} | {tp} | {r['buffer_bytes'] >> 10:,} KiB | {r['insns_per_hit']:g} "
                     f"| {r['ns_per_hit_median']:,.0f} | {r['ns_per_hit_min']:,.0f}..{r['ns_per_hit_max']:,.0f} "
                     f"| {r['frames']:,} | {rss} |")
    return "\n".join(lines) + "\n"
