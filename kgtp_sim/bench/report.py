"""Markdown table, JSON rows and chart of the thesis benchmark.

Pure formatting, on the thread of `kgtp-sim bench` (bench/cli.py) or of the test that calls it; the chart is drawn
there with matplotlib (Agg backend).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..optional import pyplot
from .runner import FIELDS, thesis_of


def _num(value, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.{max(digits, 1)}f}" if abs(value) < 100 else f"{value:,.0f}"
    return f"{value:,.0f}"


def markdown(rows: list[dict], calls: int, repetitions: int, speed: tuple[float, float] | None = None) -> str:
    """The rows as a table; `speed` (Bench.speed_figures: emulated instructions per second of the untraced
    workload with counting off and on) as a line above it."""
    lines = [
        f"Thesis workload: kgtp_bench_loop({calls}) calling kgtp_test_function, {repetitions} repetitions each.",
        "insns/hit: emulated instructions per call minus the untraced run (exact, from counted runs). ns/hit: host "
        "nanoseconds per call minus the untraced median (median, min..max), timed with instruction counting off, "
        "as a serving kernel runs. The `none` row is the untraced loop itself, absolute; "
        "`disabled-marker` is the marker site's one 5-byte NOP (part of every untraced run, no separate time).",
        "Thesis columns are CPU cycles on a 2 GHz Xeon E5405 (KGTP / SystemTap), a different unit: for orientation "
        "only. Static thesis `cond+expr` is condition + $_sdata.",
        "gdbserver rows: the same workload built as a user program (gcc -O2 -no-pie) under Debian's gdbserver with "
        "its in-process agent, driven by GDB 13.1; `trap` is `trace`, `fast` is `ftrace`; host ns per hit minus "
        "the untraced program's (whose row gives ns per call). No emulated instructions there: native code.",
    ]
    if speed:
        lines.append(
            f"Emulated speed of the untraced workload: {speed[0] / 1e6:.1f} M instructions/s with counting off "
            f"(how a serving kernel runs and the rows are timed), {speed[1] / 1e6:.1f} M with counting on.")
    lines += [
        "",
        "| probe | case | engine | insns/hit | ns/hit median | ns/hit min..max | frames | thesis KGTP (cycles) "
        "| thesis SystemTap (cycles) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        kgtp, stap = thesis_of(row)
        spread = "-" if row["ns_per_hit_min"] is None else f"{_num(row['ns_per_hit_min'])}..{_num(row['ns_per_hit_max'])}"
        lines.append(
            f"| {row['probe']} | {row['case']} | {row['engine']} | {_num(row['insns_per_hit'], 3)} "
            f"| {_num(row['ns_per_hit_median'])} | {spread} | {row['frames']:,} | {_num(kgtp)} | {_num(stap)} |"
        )
    return "\n".join(lines) + "\n"


def program_markdown(rows: list[dict]) -> str:
    """Tracepoints in a program (bench/cli.py's --program-tracepoints): the stub's rows (tools/program_hits.py)
    beside gdbserver's (peer.py)."""
    lines = [
        "Thesis workload as a user program (fixtures/peer/thesis_workload.c: kgtp_bench_loop calling "
        "kgtp_test_function), a tracepoint at kgtp_test_function; `trap` is `trace`, `fast` is `ftrace`.",
        "stub rows: `kgtp-sim gdbserver` (the role, in process, one CPU, opt engine), the program static; insns/hit: "
        "emulated instructions per call minus the untraced program's (exact, from windows around the calls no "
        "interrupt entered, on a counting machine); ns/hit: host ns per call minus the untraced median, median and "
        "range over the clean windows of one run on a machine that never counts. The `none` rows are absolute, "
        "per call.",
        "gdbserver rows: Debian's gdbserver with its in-process agent, driven by GDB 13.1, the program -no-pie; "
        "host ns per call minus the untraced median over the repetitions; native code, no instruction count.",
        "",
        "| probe | case | engine | insns/hit | ns/hit median | ns/hit min..max | frames | calls | Python hits |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(f"| {row['probe']} | {row['case']} | {row['engine']} | {_num(row['insns_per_hit'], 3)} "
                     f"| {_num(row['ns_per_hit_median'])} | {_num(row['ns_per_hit_min'])}..{_num(row['ns_per_hit_max'])} "
                     f"| {row['frames']:,} | {row['calls']:,} | {_num(row.get('python_hits'))} |")
    return "\n".join(lines) + "\n"


def write_json(rows: list[dict], path: Path) -> None:
    path.write_text(json.dumps([{k: row[k] for k in FIELDS} for row in rows], indent=2) + "\n")


def chart(rows: list[dict], path: Path, title: str = "kgtp-sim: cost per hit (thesis workload)") -> None:
    plt = pyplot()
    traced = [r for r in rows if r["probe"] not in ("none", "disabled-marker") and r["insns_per_hit"] is not None]
    labels = [f"{r['probe']}\n{r['case']}\n{r['engine']}" for r in traced]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(10, len(traced) * 0.55), 9), sharex=True)
    xs = range(len(traced))
    colors = {"interp": "tab:red", "naive": "tab:orange", "opt": "tab:green"}
    ax1.bar(xs, [r["insns_per_hit"] for r in traced], color=[colors.get(r["engine"], "gray") for r in traced])
    ax1.set_ylabel("emulated instructions / hit")
    ax1.set_title(title)
    med = [r["ns_per_hit_median"] for r in traced]
    err = [[m - r["ns_per_hit_min"] for m, r in zip(med, traced)], [r["ns_per_hit_max"] - m for m, r in zip(med, traced)]]
    ax2.bar(xs, med, yerr=err, capsize=2, color=[colors.get(r["engine"], "gray") for r in traced])
    ax2.set_ylabel("host ns / hit (median, min..max)")
    ax2.set_yscale("log")
    ax2.set_xticks(list(xs))
    ax2.set_xticklabels(labels, fontsize=6)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax1.legend(handles, list(colors), loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
