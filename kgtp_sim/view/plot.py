"""`kgtp-sim plot`: PNG pictures of a run (matplotlib, Agg backend, in the caller's thread).

- `timeline.png`: every frame as a tick on a row per tracepoint and CPU, over time since tstart, with the hits
  per time bin of each tracepoint below;
- `distribution.png`: the histogram of one collected numeric value (the first scalar expression by default);
- `flamegraph.png`: the call stacks of frames that collected `$bt` (and `$regs`), unwound with the kernel's
  `.eh_frame` CFI from the stack bytes `$bt` recorded, drawn as a flame graph (root at the bottom, width =
  share of samples).
"""

from __future__ import annotations

import zlib
from collections import Counter
from pathlib import Path

from ..optional import pyplot
from .fields import FrameReader, flatten
from .model import Run


def plot_timeline(run: Run, reader: FrameReader, path: Path) -> Path:
    plt = pyplot()
    rows: dict[tuple[int, int | None], list[float]] = {}
    for frame in run.frames:
        rows.setdefault((frame.tracepoint, frame.cpu), []).append((frame.ns or 0) / 1e9)
    keys = sorted(rows, key=lambda k: (k[0], -1 if k[1] is None else k[1]))
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(11, 2.2 + 0.45 * len(keys) + 2.4), sharex=True,
                                         gridspec_kw={"height_ratios": [max(len(keys), 1), 3]})
    colours = plt.get_cmap("tab10")
    labels = []
    for index, key in enumerate(keys):
        number, cpu = key
        info = run.tracepoints.get(number)
        name = reader.event_name(info) if info is not None else f"tp {number}"
        top.eventplot([rows[key]], lineoffsets=index, linelengths=0.7, linewidths=0.6, colors=[colours(number % 10)])
        labels.append(f"tp {number} {name}\nCPU {'?' if cpu is None else cpu} ({len(rows[key])} hits)")
    top.set_yticks(range(len(keys)), labels, fontsize=8)
    top.set_ylim(-0.6, len(keys) - 0.4)
    top.set_title(f"Trace frames over time ({len(run.frames)} frames"
                  + (f", {run.missed} missed" if run.missed else "") + ")")
    end = max(((f.ns or 0) / 1e9 for f in run.frames), default=1.0) or 1.0
    bins = min(200, max(10, len(run.frames) // 20))
    for number in sorted({k[0] for k in keys}):
        times = [(f.ns or 0) / 1e9 for f in run.frames if f.tracepoint == number]
        info = run.tracepoints.get(number)
        name = reader.event_name(info) if info is not None else f"tp {number}"
        bottom.hist(times, bins=bins, range=(0, end), histtype="step", color=colours(number % 10),
                    label=f"tp {number} {name}")
    bottom.set_ylabel(f"hits per {end / bins * 1e3:.3g} ms")
    bottom.set_xlabel("seconds since tstart" if run.time_source != "frame-order" else "frame order (no timestamps)")
    bottom.legend(fontsize=8, loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def numeric_values(run: Run, reader: FrameReader, name: str | None) -> tuple[str, list[int]]:
    """The values of collected field `name` (a source text, or `$_sdata.counter1`) over the run's frames;
    without a name, the first numeric expression any tracepoint collects."""
    found: dict[str, list[int]] = {}
    order: list[str] = []
    for frame in run.frames:
        for field in reader.fields(frame):
            if name is None and field.name.startswith("$") and field.name != "$_sdata":
                continue
            for path, value, spec in flatten(field.name, field.value, field.spec):
                if spec[0] != "int" or not isinstance(value, int):
                    continue
                if path not in found:
                    found[path] = []
                    order.append(path)
                found[path].append(value)
    if name is None:
        if not order:
            return "", []
        name = order[0]
    return name, found.get(name, [])


def plot_distribution(run: Run, reader: FrameReader, path: Path, name: str | None = None) -> Path | None:
    name, values = numeric_values(run, reader, name)
    if not values:
        return None
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(9, 4.5))
    distinct = len(set(values))
    axis.hist(values, bins=min(60, max(distinct, 1)), color="#4c72b0", edgecolor="white", linewidth=0.4)
    axis.set_title(f"Distribution of {name} over {len(values)} frames (min {min(values)}, max {max(values)})")
    axis.set_xlabel(name)
    axis.set_ylabel("frames")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def stacks(run: Run, reader: FrameReader) -> Counter:
    """Folded call stacks (root first) of the frames that hold registers and stack bytes."""
    folded: Counter = Counter()
    for frame in run.frames:
        blocks = frame.blocks
        if blocks.registers is None or not blocks.memory:
            continue
        info = reader.tracepoint(frame)
        if not any("$bt" in line for line in info.collect_lines()):
            continue
        pcs = reader.dwarf.unwind(blocks.registers, blocks.read)
        names = []
        for pc in reversed(pcs):
            symbol = reader.dwarf.symbolize(pc)
            names.append(symbol[0] if symbol else f"{pc:#x}")
        folded[tuple(names)] += 1
    return folded


def plot_flamegraph(run: Run, reader: FrameReader, path: Path) -> Path | None:
    folded = stacks(run, reader)
    if not folded:
        return None
    plt = pyplot()
    total = sum(folded.values())
    depth = max(len(s) for s in folded)
    figure, axis = plt.subplots(figsize=(12, 1.2 + 0.42 * depth))
    colours = plt.get_cmap("autumn")

    def draw(prefix: tuple, level: int, x: float) -> None:
        children: dict[str, int] = {}
        for stack, count in folded.items():
            if len(stack) > level and stack[:level] == prefix:
                children[stack[level]] = children.get(stack[level], 0) + count
        for name in sorted(children):
            width = children[name] / total
            colour = colours((zlib.crc32(name.encode()) % 100) / 140)
            axis.add_patch(plt.Rectangle((x, level), width, 0.95, facecolor=colour, edgecolor="white", linewidth=0.5))
            if width > 0.03:
                axis.text(x + 0.004, level + 0.45, f"{name} ({children[name]})", va="center", fontsize=8,
                          clip_on=True)
            draw(prefix + (name,), level + 1, x)
            x += width

    draw((), 0, 0.0)
    axis.set_xlim(0, 1)
    axis.set_ylim(0, depth)
    axis.set_yticks([])
    axis.set_xlabel("share of samples")
    axis.set_title(f"Call stacks of {total} frames (collect $bt, unwound with the kernel's CFI)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_all(run: Run, reader: FrameReader, directory: Path, value: str | None = None) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    made = [plot_timeline(run, reader, directory / "timeline.png")]
    for item in (plot_distribution(run, reader, directory / "distribution.png", value),
                 plot_flamegraph(run, reader, directory / "flamegraph.png")):
        if item is not None:
            made.append(item)
    return made
