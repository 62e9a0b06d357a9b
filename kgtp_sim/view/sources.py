"""Where traces are read from, a piece at a time: a running stub, a tsave'd file, a recorded CTF trace.

Each source is a `Run` (model.py) whose frames come as `FrameBatch`es (`batches(run)`), in the order GDB numbers
them, numbered so, with memory that does not grow with the trace:

- a running stub (`open_stub`): the follow channel's drain (stub/stream.py) sends every CPU's ring entries as
  the ring holds them, read at one instant; they are merged as the stub's buffer merges them;
- a tsave'd file (`open_tfile`): its frame records in chunks; CPUs and times from each frame's `$cpu_id` and
  `$clock` when every frame has them (a first pass over the file says so), as `load_tfile` reads them;
- a recorded trace (`open_recorded`, `kgtp-sim record`'s directory): each CPU's stream file, packet by
  packet, merged by time; frames its recorder lost are counted from the packets' `events_discarded`.

`drain` is the follow channel's drain as a sequence of events, for the follower and the recorder. Runs in the
caller's thread.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .batch import (RECORDED, Entries, FrameBatch, Merger, from_entries, from_frames, from_records, merged,
                    parse_entries, read_int, record_starts)
from .channel import ChannelError, messages
from .ctf import read_packets, stream_files
from .layout import LayoutTable, show_returns
from .model import Run, TraceFormatError, tfile_header

#: Frames are handed on in batches of at most this many.
FRAMES_PER_BATCH = 1 << 12
#: Bytes of a tsave'd file read at a time.
FILE_CHUNK = 1 << 22
#: Where a recorded trace's metadata keeps what kgtp-sim needs to read it back (record.py writes it).
RECORDING_NOTE = re.compile(r"/\* kgtp-sim recording: (\{.*?\}) \*/", re.S)


def batches(run: Run) -> Iterator[FrameBatch]:
    """The run's frames as batches of at most FRAMES_PER_BATCH, in order (a streamed run can be read once):
    what a reader holds decoded at a time does not grow with the reads a source makes."""
    if run.stream is None:
        for start in range(0, len(run.frames), FRAMES_PER_BATCH):
            yield from_frames(run.frames[start : start + FRAMES_PER_BATCH])
        return
    for batch in run.stream():
        for start in range(0, len(batch), FRAMES_PER_BATCH):
            yield batch if len(batch) <= FRAMES_PER_BATCH else batch.take(slice(start, start + FRAMES_PER_BATCH))


def open_trace(path: Path) -> Run:
    """A tsave'd file, or the directory of a recorded trace."""
    if path.is_dir():
        return open_recorded(path)
    return open_tfile(path)


def load_tfile(path: Path | str) -> Run:
    """A tsave'd file with every frame loaded (`open_tfile` streams it)."""
    run = open_tfile(Path(path))
    frames = [frame for batch in batches(run) for frame in batch.frames()]
    run.stream = None
    run.frames = frames
    return run


# ---- a running stub -----------------------------------------------------------------------------------------


def drain(host: str, port: int, request: dict) -> Iterator[tuple[str, object]]:
    """The follow channel's drain (stub/stream.py) as events: ("run", message) when a run's definitions come,
    ("frames", FrameBatch) for each read (merged, numbered on from the previous one), ("lost", count) before
    the frames that follow a loss, ("stopped", message), ("end", message)."""
    origin, ticks_per_ns, number = 0, 1.0, 0
    for message in messages(host, port, {"op": "stream", **request}, raw=True):
        kind = message["t"]
        if kind == "run":
            origin = message.get("tsc_origin", 0)
            ticks_per_ns = message.get("ticks_per_ns", 1.0)
            number = 0
            yield "run", message
        elif kind == "entries":
            lost = sum(item["lost"] for item in message["cpus"])
            if lost:
                yield "lost", lost
            batch = entries_batch(message, origin, ticks_per_ns).numbered(number)
            number += len(batch)
            yield "frames", batch
        elif kind in ("stopped", "end"):
            yield kind, message


def entries_batch(message: dict, origin: int, ticks_per_ns: float) -> FrameBatch:
    """The frames of one `entries` message of the drain, merged as the stub's buffer merges them."""
    data = np.frombuffer(message["data"], dtype=np.uint8)
    parts, at = [], 0
    for item in message["cpus"]:
        parts.append(parse_entries(data, at, at + item["bytes"]))
        at += item["bytes"]
    batch = merged([from_entries(data, Entries.join(parts), origin, ticks_per_ns)])
    trampolines = message.get("kret")
    if trampolines:
        batch = show_returns(batch, LayoutTable(), {int(k): v for k, v in trampolines.items()})
    return batch


def open_stub(host: str, port: int) -> Run:
    """Every frame the stub's buffer holds now (the drain, `until: now`), read as it streams in."""
    events = drain(host, port, {"from": "start", "until": "now"})
    run = Run()
    for kind, message in events:
        if kind == "run":
            run.apply_run_message(message)
            break
    else:
        raise ChannelError("the follow channel closed before describing the run")

    def stream() -> Iterator[FrameBatch]:
        for kind, item in events:
            if kind == "frames":
                yield item
            elif kind == "end":
                run.missed = item.get("lost", 0)
                return

    run.stream = stream
    return run


# ---- a tsave'd file -----------------------------------------------------------------------------------------


def open_tfile(path: Path) -> Run:
    """A tsave'd file, its frames read a piece at a time (`load_tfile`'s rules for CPUs and times)."""
    with open(path, "rb") as handle:
        head = handle.read(1 << 20)
        while b"\n\n" not in head[8:]:
            more = handle.read(1 << 20)
            if not more:
                break
            head += more
    run, start = tfile_header(head, path)
    cpu_var, clock_var = run.variable_number("cpu_id"), run.variable_number("clock")
    table = LayoutTable()

    def records() -> Iterator[FrameBatch]:
        number = 0
        with open(path, "rb") as handle:
            handle.seek(start)
            pending = b""
            while True:
                chunk = handle.read(FILE_CHUNK)
                data = np.frombuffer(pending + chunk, dtype=np.uint8)
                starts, stopped = record_starts(data, 0, len(data))
                if len(starts):
                    yield from_records(data, starts, number)
                    number += len(starts)
                ended = stopped + 2 <= len(data) and int(read_int(data, np.array([stopped]), 2, False)[0]) == 0
                if ended or not chunk:
                    if not ended and stopped < len(data):
                        raise TraceFormatError(f"{path}: truncated frame {number}")
                    return
                pending = data[stopped:].tobytes()

    def variable(batch: FrameBatch, number: int | None) -> np.ndarray | None:
        """Each frame's value of variable `number`, None unless every frame has it."""
        if number is None:
            return None
        classes = table.classify(batch)
        out = np.zeros(len(batch), dtype=np.int64)
        for index in np.unique(classes).tolist():
            block = table.classes[index][1].variable(number)
            if block is None:
                return None
            rows = np.flatnonzero(classes == index)
            out[rows] = read_int(batch.data, batch.body[rows] + block.data, 8, True)
        return out

    # a first pass: whether every frame has $cpu_id and $clock, and the first time
    have_cpu, have_clock, first_clock, count = cpu_var is not None, clock_var is not None, None, 0
    for batch in records():
        count += len(batch)
        if have_cpu and variable(batch, cpu_var) is None:
            have_cpu = False
        if have_clock:
            clocks = variable(batch, clock_var)
            if clocks is None:
                have_clock = False
            elif len(clocks):
                low = int(clocks.min())
                first_clock = low if first_clock is None else min(first_clock, low)
    run.cpu_source = "$cpu_id" if count and have_cpu else "unknown"
    run.time_source = "$clock" if count and have_clock else "frame-order"

    def stream() -> Iterator[FrameBatch]:
        for batch in records():
            if run.cpu_source == "$cpu_id":
                batch.cpu = variable(batch, cpu_var)
            if run.time_source == "$clock":
                batch.ns = variable(batch, clock_var) - first_clock
                batch.stamp = batch.ns
            yield batch

    run.stream = stream
    return run


# ---- a recorded trace ---------------------------------------------------------------------------------------


def recording_note(metadata: str, directory: Path) -> dict:
    found = RECORDING_NOTE.search(metadata)
    if found is None:
        raise TraceFormatError(f"{directory}: a CTF trace, but not one kgtp-sim record wrote (no recording note in "
                               f"its metadata); babeltrace2 reads it")
    return json.loads(found.group(1))


def open_recorded(directory: Path) -> Run:
    """The trace `kgtp-sim record` wrote in `directory`: its definitions and its frames, merged by time."""
    metadata = directory / "metadata"
    if not metadata.is_file():
        raise TraceFormatError(f"{directory}: no CTF metadata (not a recorded trace)")
    note = recording_note(metadata.read_text(), directory)
    run = Run(origin="recorded")
    run.apply_run_message(note["run"])
    classes = {int(k): v for k, v in note["classes"].items()}
    origin, ticks_per_ns = note["tsc_origin"], note["ticks_per_ns"]
    trampolines = {int(k): v for k, v in note.get("kret", {}).items()}
    files = stream_files(directory)

    def packets(paths: list[Path]) -> Iterator:
        for path in paths:
            yield from read_packets(path, align=8)

    def stream() -> Iterator[FrameBatch]:
        readers = {cpu: packets(paths) for cpu, paths in files.items()}
        merger = Merger(readers)
        discarded = {cpu: 0 for cpu in readers}
        number = 0
        table = LayoutTable()
        while merger.open:
            for cpu in list(merger.open):
                if len(merger.pending[cpu]):
                    continue
                packet = next(readers[cpu], None)
                if packet is None:
                    merger.close(cpu)
                    continue
                discarded[cpu] = packet.discarded
                if packet.content:
                    merger.add(cpu, _recorded_batch(packet.content, classes, origin, ticks_per_ns))
            batch = merger.ready()
            if len(batch):
                if trampolines:
                    batch = show_returns(batch, table, trampolines)
                yield batch.numbered(number)
                number += len(batch)
        run.missed = sum(discarded.values())

    run.stream = stream
    return run


def _recorded_batch(content: bytes, classes: dict[int, int], origin: int, ticks_per_ns: float) -> FrameBatch:
    data = np.frombuffer(content, dtype=np.uint8)
    entries = parse_entries(data, 0, len(data), RECORDED)
    lookup = np.zeros(max(classes, default=0) + 1, dtype=np.int64)
    for index, tracepoint in classes.items():
        lookup[index] = tracepoint
    if len(entries.tracepoint) and int(entries.tracepoint.max()) >= len(lookup):
        raise TraceFormatError(f"an event of class {int(entries.tracepoint.max())} the recording does not name")
    entries.tracepoint = lookup[entries.tracepoint]
    return from_entries(data, entries, origin, ticks_per_ns)
