"""`kgtp-sim plot`: PNG pictures of a run (matplotlib, Agg backend, in the caller's thread).

- `timeline.png`: every frame as a tick on a row per tracepoint and CPU, over time since tstart, with the hits
  per time bin of each tracepoint below (a row of more than `TICKS` frames is drawn as its density: so many
  ticks would be a solid bar, and slow to draw);
- `distribution.png`: the histogram of one collected numeric value (the first scalar expression by default);
- `flamegraph.png`: the call stacks of frames that collected `$bt` (and `$regs`), unwound with the kernel's
  `.eh_frame` CFI from the stack bytes `$bt` recorded, drawn as a flame graph (root at the bottom, width =
  share of samples).

The run is read once, a batch at a time (sources.py): what the pictures need is kept as numpy columns (a time
per frame, a value per frame of the drawn expression) and counted stacks, not as frames.
"""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..optional import pyplot
from .batch import FrameBatch
from .decode import BulkReader, Column, Const, Decoded, Ints, Texts, Values
from .export import _column_leaves
from .fields import FrameReader, flatten
from .model import Run
from .sources import batches

#: A timeline row with more frames than this is drawn as a density, not tick by tick.
TICKS = 20_000


@dataclass
class Tally:
    """What the pictures need of a run, gathered a batch at a time (`add`)."""

    value: str | None  #: the expression to draw the distribution of (None: the first numeric one)
    times: dict[tuple[int, int | None], list[np.ndarray]] = field(default_factory=dict)
    chosen: str | None = None
    values: list[np.ndarray] = field(default_factory=list)  #: the drawn expression's, as numpy arrays
    folded: Counter = field(default_factory=Counter)
    frames: int = 0

    def add(self, decoder: BulkReader, batch: FrameBatch) -> None:
        self.frames += len(batch)
        parts = sorted(decoder.decode(batch), key=lambda p: int(p.rows[0]))
        for part in parts:
            cpus = batch.cpu[part.rows]
            for cpu in np.unique(cpus).tolist():
                key = (part.plan.tracepoint, None if cpu < 0 else cpu)
                self.times.setdefault(key, []).append(batch.ns[part.rows][cpus == cpu])
        for part in parts:
            self._values(decoder, batch, part)
            self._stacks(decoder, batch, part)

    def _values(self, decoder: BulkReader, batch: FrameBatch, part: Decoded) -> None:
        for planned, column in zip(part.plan.fields, part.columns):
            if self.value is None and planned.name.startswith("$") and planned.name != "$_sdata":
                continue
            for path, leaf, spec in _column_leaves(planned.name, column, planned.spec):
                if spec[0] != "int":
                    continue
                if self.chosen is None and (self.value is None or path == self.value):
                    numbers = _numbers(leaf, len(part.rows))
                    if numbers is None or not len(numbers):
                        continue
                    self.chosen = path
                if path == self.chosen:
                    numbers = _numbers(leaf, len(part.rows))
                    if numbers is not None and len(numbers):
                        self.values.append(numbers)

    def _stacks(self, decoder: BulkReader, batch: FrameBatch, part: Decoded) -> None:
        layout = part.plan.layout
        if layout.last("R", "r") is None or not layout.memory():
            return
        if not any("$bt" in line for line in part.plan.info.collect_lines()):
            return
        dwarf = decoder.reader.dwarf
        for row in part.rows.tolist():
            blocks = batch.frame(row).blocks
            pcs = dwarf.unwind(blocks.registers, blocks.read)
            names = []
            for pc in reversed(pcs):
                symbol = dwarf.symbolize(pc)
                names.append(symbol[0] if symbol else f"{pc:#x}")
            self.folded[tuple(names)] += 1

    def rows(self) -> dict[tuple[int, int | None], np.ndarray]:
        return {key: np.concatenate(parts) / 1e9 for key, parts in self.times.items()}


def _numbers(leaf: Column, count: int) -> np.ndarray | None:
    """A leaf's integer values (frames whose value is not an integer left out), as an object array of ints when
    they do not fit int64."""
    if isinstance(leaf, Ints):
        return leaf.values
    if isinstance(leaf, Const):
        return np.full(count, leaf.value, dtype=object) if isinstance(leaf.value, int) else None
    if isinstance(leaf, (Texts, Values)):
        kept = [v for v in leaf.values if isinstance(v, int) and not isinstance(v, bool)]
        return np.array(kept, dtype=object)
    return None


def tally(run: Run, reader: FrameReader, value: str | None = None) -> Tally:
    """Read the run once for its pictures."""
    found = Tally(value)
    decoder = BulkReader(reader)
    for batch in batches(run):
        found.add(decoder, batch)
    return found


def plot_timeline(run: Run, reader: FrameReader, path: Path, found: Tally | None = None) -> Path:
    found = found or tally(run, reader)
    plt = pyplot()
    rows = found.rows()
    keys = sorted(rows, key=lambda k: (k[0], -1 if k[1] is None else k[1]))
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(11, 2.2 + 0.45 * len(keys) + 2.4), sharex=True,
                                         gridspec_kw={"height_ratios": [max(len(keys), 1), 3]})
    colours = plt.get_cmap("tab10")
    labels = []
    end = max((float(times.max()) for times in rows.values() if len(times)), default=1.0) or 1.0
    bins = min(200, max(10, found.frames // 20))
    for index, key in enumerate(keys):
        number, cpu = key
        info = run.tracepoints.get(number)
        name = reader.event_name(info) if info is not None else f"tp {number}"
        times = rows[key]
        if len(times) <= TICKS:
            top.eventplot([times], lineoffsets=index, linelengths=0.7, linewidths=0.6, colors=[colours(number % 10)])
        else:  # a density: the share of the busiest bin each bin has
            counts, edges = np.histogram(times, bins=bins, range=(0, end))
            height = 0.7 * counts / max(counts.max(), 1)
            top.fill_between(edges[:-1], index - height / 2, index + height / 2, step="post", linewidth=0,
                             color=colours(number % 10))
        labels.append(f"tp {number} {name}\nCPU {'?' if cpu is None else cpu} ({len(times)} hits)")
    top.set_yticks(range(len(keys)), labels, fontsize=8)
    top.set_ylim(-0.6, len(keys) - 0.4)
    top.set_title(f"Trace frames over time ({found.frames} frames"
                  + (f", {run.missed} missed" if run.missed else "") + ")")
    for number in sorted({k[0] for k in keys}):
        times = np.concatenate([rows[k] for k in keys if k[0] == number])
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
    found = tally(run, reader, name)
    return _chosen(found, name)


def _chosen(found: Tally, name: str | None) -> tuple[str, list[int]]:
    if found.chosen is None:
        return (name or ""), []
    values = [int(v) for part in found.values for v in part.tolist()]
    return found.chosen, values


def plot_distribution(run: Run, reader: FrameReader, path: Path, name: str | None = None,
                      found: Tally | None = None) -> Path | None:
    found = found if found is not None else tally(run, reader, name)
    parts = [part for part in found.values if len(part)]
    if found.chosen is None or not parts:
        return None
    name = found.chosen
    low = min(int(part.min()) for part in parts)
    high = max(int(part.max()) for part in parts)
    distinct: set[int] = set()
    for part in parts:  # only whether there are fewer than 60 matters (the bins)
        distinct.update(np.unique(part).tolist()[:61])
        if len(distinct) > 60:
            break
    values = np.concatenate([part.astype(np.float64) for part in parts])
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(9, 4.5))
    axis.hist(values, bins=min(60, max(len(distinct), 1)), color="#4c72b0", edgecolor="white", linewidth=0.4)
    axis.set_title(f"Distribution of {name} over {len(values)} frames (min {low}, max {high})")
    axis.set_xlabel(name)
    axis.set_ylabel("frames")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def stacks(run: Run, reader: FrameReader) -> Counter:
    """Folded call stacks (root first) of the frames that hold registers and stack bytes."""
    return tally(run, reader).folded


def plot_flamegraph(run: Run, reader: FrameReader, path: Path, found: Tally | None = None) -> Path | None:
    folded = found.folded if found is not None else stacks(run, reader)
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
    """The three pictures, reading the run once."""
    directory.mkdir(parents=True, exist_ok=True)
    found = tally(run, reader, value)
    made = [plot_timeline(run, reader, directory / "timeline.png", found)]
    for item in (plot_distribution(run, reader, directory / "distribution.png", value, found),
                 plot_flamegraph(run, reader, directory / "flamegraph.png", found)):
        if item is not None:
            made.append(item)
    return made


__all__ = ["flatten", "numeric_values", "plot_all", "plot_distribution", "plot_flamegraph", "plot_timeline",
           "stacks", "tally"]
