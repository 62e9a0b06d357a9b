"""Frames in bulk: a run of trace frames as columns, read and merged without per-frame Python work.

A `FrameBatch` holds n frames: their blocks (GDB's trace-frame format, tracing/core/frames.py) at `body[i]` for
`size[i]` bytes of one byte buffer, and beside them, one numpy column each, what GDB's format has no room for:
tracepoint, CPU (-1: unknown), the CPU's sequence number, nanoseconds since tstart, the frame number GDB
would give it, and the raw TSC stamp that orders several CPUs' frames. Batches come from ring entries (the
follow channel's drain, a recorded CTF trace: `from_entries`), from the records of a tsave'd file
(`from_records`) and from `model.Frame` objects (`from_frames`); `merged` orders several CPUs' batches as the
stub's buffer does (by stamp, then CPU, then sequence: ring.merge_key); `Merger` does it for streams read a
piece at a time. Finding where each of a run of variable-length records starts (`chain`) guesses that the next
ones have the length of the first and checks the guess for all of them at once.

Pure data: any thread.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from ..tracing.core.ring import BLOCKS_AT, ENTRY_LENGTH, ENTRY_SEQUENCE, ENTRY_TIMESTAMP, FRAME_AT, PAD_CPU
from .model import Frame, TraceFormatError

#: Below this many records of one length in a row, `chain` walks on one record at a time for a while.
_SHORT_RUN = 4
_WALK = 64
_I64 = np.int64


def as_bytes_array(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return data
    return np.frombuffer(data, dtype=np.uint8)


def rows_at(data: np.ndarray, offsets: np.ndarray, width: int) -> np.ndarray:
    """The `width` bytes at each of `offsets` in `data`, one row each: a view of `data` when the offsets are
    evenly spaced (a run of frames of one size, as a ring or a recorded packet holds them), else a copy."""
    count = len(offsets)
    if count > 1:
        first, step = int(offsets[0]), int(offsets[1]) - int(offsets[0])
        if step > 0 and first >= 0 and first + step * (count - 1) + width <= len(data) and \
                (count == 2 or (np.diff(offsets) == step).all()):
            return np.lib.stride_tricks.as_strided(data[first:], shape=(count, width), strides=(step, 1),
                                                   writeable=False)
    return data[offsets[:, None] + np.arange(width)]


class FrameRows:
    """Frames of one size as rows of bytes, read a field at a time (decode.py). Frames that lie evenly spaced in
    their buffer (a ring read's or a packet's run of one tracepoint) are views of it: a field of all of them is
    one strided copy per run, not a gather per byte."""

    MAX_RUNS = 64

    def __init__(self, data: np.ndarray, body: np.ndarray, size: int) -> None:
        self.count = len(body)
        order = np.argsort(body, kind="stable")
        ordered = body[order]
        self.inverse = None if (order == np.arange(self.count)).all() else np.argsort(order)
        gaps = np.diff(ordered)
        step = int(np.bincount(gaps).argmax()) if len(gaps) and gaps.min() >= 0 and gaps.max() < 1 << 24 else size
        breaks = np.flatnonzero(gaps != step) + 1 if len(gaps) else np.zeros(0, dtype=_I64)
        if len(breaks) < self.MAX_RUNS and step >= 1 and int(ordered[-1]) + size <= len(data):
            self.data, self.step = data, step
            bounds = np.concatenate(([0], breaks, [self.count])).tolist()
            self.runs = [(int(ordered[a]), b - a) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        else:  # scattered: one gather of every frame, then one run
            self.data = data[ordered[:, None] + np.arange(size)].ravel()
            self.step = size
            self.runs = [(0, self.count)]

    def _sorted(self, offset: int, width: int) -> np.ndarray:
        parts = [np.lib.stride_tricks.as_strided(self.data[start + offset :], shape=(count, width),
                                                 strides=(self.step, 1), writeable=False)
                 for start, count in self.runs]
        return np.ascontiguousarray(parts[0]) if len(parts) == 1 else np.concatenate(parts)

    def field(self, offset: int, width: int) -> np.ndarray:
        """The `width` bytes at `offset` of every frame, a row each, in the frames' order."""
        rows = self._sorted(offset, width)
        return rows if self.inverse is None else rows[self.inverse]

    def uint(self, offset: int, width: int) -> np.ndarray:
        """The little-endian unsigned integers of `width` bytes (1, 2, 4 or 8) at `offset`, as uint64."""
        kind = np.dtype(f"<u{width}")
        parts = [np.ndarray((count,), kind, self.data, start + offset, (self.step,)).astype(np.uint64)
                 for start, count in self.runs]
        values = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return values if self.inverse is None else values[self.inverse]


def read_uint(data: np.ndarray, offsets: np.ndarray, width: int) -> np.ndarray:
    """The little-endian unsigned integers of `width` bytes (1..8) at each of `offsets` in `data`, as uint64."""
    offsets = np.asarray(offsets, dtype=_I64)
    count = len(offsets)
    if width in (1, 2, 4, 8) and count > 1:
        first, step = int(offsets[0]), int(offsets[1]) - int(offsets[0])
        if step > 0 and first >= 0 and first + step * (count - 1) + width <= len(data) and \
                (count == 2 or (np.diff(offsets) == step).all()):
            return np.ndarray((count,), f"<u{width}", data, first, (step,)).astype(np.uint64)
    rows = rows_at(data, offsets, width)
    if width in (1, 2, 4, 8):
        return np.ascontiguousarray(rows).view(f"<u{width}")[:, 0].astype(np.uint64)
    rows = rows.astype(np.uint64)
    return (rows << (np.arange(width, dtype=np.uint64) * np.uint64(8))).sum(axis=1, dtype=np.uint64)


def read_int(data: np.ndarray, offsets: np.ndarray, width: int, signed: bool) -> np.ndarray:
    """`read_uint`, as int64 sign-extended from `width` bytes when `signed`, else uint64."""
    values = read_uint(data, offsets, width)
    if not signed:
        return values
    if width == 8:
        return values.view(_I64)
    bits = 8 * width
    signed_values = values.astype(_I64)
    return np.where(signed_values >= 1 << (bits - 1), signed_values - (1 << bits), signed_values)


def chain(data: np.ndarray, start: int, end: int,
          length_at: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, int]:
    """Where each record of a run starts, from `start` on: each record's length is `length_at(offsets)` (for
    many offsets at once); a length of 0 ends the run. Returns the starts of the records that end by `end`, and
    where reading stopped: `end`, a record of length 0, or a record that `end` cuts."""
    found: list[np.ndarray] = []
    position = start
    while position < end:
        length = int(length_at(np.array([position], dtype=_I64))[0])
        if length < 0:
            raise TraceFormatError(f"record of length {length} at offset {position}")
        if length == 0 or position + length > end:
            break
        count = (end - position) // length
        guess = position + length * np.arange(count, dtype=_I64)
        same = length_at(guess) == length
        run = count if same.all() else int(np.argmin(same))
        found.append(guess[:run])
        position += run * length
        if run < _SHORT_RUN:  # lengths vary: walk on one record at a time for a while
            walked = []
            for _ in range(_WALK):
                if position >= end:
                    break
                length = int(length_at(np.array([position], dtype=_I64))[0])
                if length <= 0 or position + length > end:
                    break
                walked.append(position)
                position += length
            if walked:
                found.append(np.array(walked, dtype=_I64))
    return (np.concatenate(found) if found else np.zeros(0, dtype=_I64)), position


@dataclass
class FrameBatch:
    data: np.ndarray  #: uint8: the bytes holding every frame's blocks
    body: np.ndarray  #: int64: where each frame's blocks start in `data`
    size: np.ndarray  #: int64: bytes of blocks
    tracepoint: np.ndarray  #: int64
    cpu: np.ndarray  #: int64, -1 when unknown
    seq: np.ndarray  #: int64: the frame's sequence on its CPU (a tsave'd file: its position)
    ns: np.ndarray  #: int64: nanoseconds since tstart
    number: np.ndarray  #: int64: the frame number GDB gives it
    stamp: np.ndarray  #: int64: what orders frames of several CPUs (the TSC, or `ns`)
    sdata: list | None = None  #: $_sdata as the stub rendered it, per frame (the follow channel's JSON frames)

    def __len__(self) -> int:
        return len(self.body)

    @staticmethod
    def empty() -> FrameBatch:
        zero = np.zeros(0, dtype=_I64)
        return FrameBatch(np.zeros(0, dtype=np.uint8), zero, zero, zero, zero, zero, zero, zero, zero)

    def take(self, index: np.ndarray | slice) -> FrameBatch:
        """These frames (the same bytes)."""
        sdata = None
        if self.sdata is not None:
            sdata = list(np.asarray(self.sdata, dtype=object)[index])
        return FrameBatch(self.data, self.body[index], self.size[index], self.tracepoint[index], self.cpu[index],
                          self.seq[index], self.ns[index], self.number[index], self.stamp[index], sdata)

    def compact(self) -> FrameBatch:
        """The same frames in a buffer of their own bytes only (a batch kept while its source reads on)."""
        if not len(self):
            return FrameBatch.empty()
        total = int(self.size.sum())
        starts = np.concatenate(([0], np.cumsum(self.size)[:-1])).astype(_I64)
        index = np.repeat(self.body - starts, self.size) + np.arange(total, dtype=_I64)
        return FrameBatch(self.data[index], starts, self.size.copy(), self.tracepoint, self.cpu, self.seq, self.ns,
                          self.number, self.stamp, self.sdata)

    def blocks(self, index: int) -> bytes:
        start = int(self.body[index])
        return self.data[start : start + int(self.size[index])].tobytes()

    def frame(self, index: int) -> Frame:
        cpu = int(self.cpu[index])
        sdata = self.sdata[index] if self.sdata is not None else None
        return Frame(int(self.seq[index]), int(self.number[index]), int(self.tracepoint[index]),
                     None if cpu < 0 else cpu, int(self.ns[index]), self.blocks(index), sdata)

    def frames(self) -> Iterator[Frame]:
        for index in range(len(self)):
            yield self.frame(index)

    def numbered(self, first: int) -> FrameBatch:
        """Frame numbers from `first` on, in this order."""
        self.number = np.arange(first, first + len(self), dtype=_I64)
        return self


def concat(batches: list[FrameBatch]) -> FrameBatch:
    """One batch of several (their bytes copied into one buffer)."""
    batches = [b for b in batches if len(b)]
    if not batches:
        return FrameBatch.empty()
    if len(batches) == 1:
        return batches[0]
    bases = np.cumsum([0] + [len(b.data) for b in batches[:-1]])
    sdata = None
    if any(b.sdata is not None for b in batches):
        sdata = [item for b in batches for item in (b.sdata if b.sdata is not None else [None] * len(b))]
    column = lambda name: np.concatenate([getattr(b, name) for b in batches])  # noqa: E731
    return FrameBatch(np.concatenate([b.data for b in batches]),
                      np.concatenate([b.body + base for b, base in zip(batches, bases)]),
                      column("size"), column("tracepoint"), column("cpu"), column("seq"), column("ns"),
                      column("number"), column("stamp"), sdata)


def order(batch: FrameBatch) -> FrameBatch:
    """The frames ordered as the stub's buffer orders several CPUs' frames: by stamp, CPU, sequence."""
    if len(batch) < 2:
        return batch
    index = np.lexsort((batch.seq, batch.cpu, batch.stamp))
    if (index == np.arange(len(index))).all():
        return batch
    return batch.take(index)


def merged(batches: list[FrameBatch]) -> FrameBatch:
    """Several CPUs' frames in one order (ring.merge_key)."""
    return order(concat(batches))


class Merger:
    """Several streams' frames in one order, a piece at a time: each stream's frames come in its own order
    (`add`); what every stream that may still bring frames has passed is ready (`ready`)."""

    def __init__(self, streams: Iterable[int]) -> None:
        self.pending: dict[int, FrameBatch] = {stream: FrameBatch.empty() for stream in streams}
        self.open = set(self.pending)

    def add(self, stream: int, batch: FrameBatch) -> None:
        if len(batch):
            self.pending[stream] = concat([self.pending[stream], batch]) if len(self.pending[stream]) else batch

    def close(self, stream: int) -> None:
        self.open.discard(stream)

    def ready(self) -> FrameBatch:
        """The frames no stream can precede any more, in order."""
        waiting = [self.pending[s] for s in self.open]
        if any(not len(b) for b in waiting):
            if self.open:
                return FrameBatch.empty()
        cutoff = min((int(b.stamp[-1]) for b in waiting), default=None)
        out = []
        for stream, batch in self.pending.items():
            if not len(batch):
                continue
            count = len(batch) if cutoff is None else int(np.searchsorted(batch.stamp, cutoff, side="right"))
            if count:
                out.append(batch.take(slice(0, count)))
                rest = batch.take(slice(count, None))
                self.pending[stream] = rest.compact() if len(rest) else FrameBatch.empty()
        return merged(out)


# ---- ring entries (the drain, recorded traces) ----------------------------------------------------------------


@dataclass(frozen=True)
class EntryFormat:
    """Where an entry's header fields are: the ring's (ring.py) or a recorded trace's events (record.py, the
    same 30 bytes in the order CTF readers want them). Blocks follow at BLOCKS_AT in both."""

    length: int
    cpu: int
    stamp: int
    seq: int
    tracepoint: int  #: u16: the tracepoint (a recorded event: its event class)
    size: int
    padding: bool  #: whether padding entries (cpu PAD_CPU) may come


RING = EntryFormat(ENTRY_LENGTH, 4, ENTRY_TIMESTAMP, ENTRY_SEQUENCE, FRAME_AT, FRAME_AT + 2, True)
RECORDED = EntryFormat(18, 22, 2, 10, 0, FRAME_AT + 2, False)


def entry_starts(data: np.ndarray, start: int = 0, end: int | None = None, form: EntryFormat = RING) -> np.ndarray:
    """Where each entry of a run of whole entries starts (padding entries included)."""
    end = len(data) if end is None else end

    def length_at(offsets: np.ndarray) -> np.ndarray:
        return read_uint(data, offsets + form.length, 4).astype(_I64)

    starts, stopped = chain(data, start, end, length_at)
    if stopped != end:
        raise TraceFormatError(f"a corrupt or torn entry at offset {stopped} of {end}")
    return starts


@dataclass
class Entries:
    """Frames of entries, the header fields as columns (`parse_entries`)."""

    starts: np.ndarray  #: where each frame's entry starts
    cpu: np.ndarray
    stamp: np.ndarray  #: the TSC at commit
    seq: np.ndarray
    tracepoint: np.ndarray
    size: np.ndarray

    @staticmethod
    def join(parts: list[Entries]) -> Entries:
        return Entries(*(np.concatenate([getattr(p, name) for p in parts]) if parts else np.zeros(0, dtype=_I64)
                         for name in ("starts", "cpu", "stamp", "seq", "tracepoint", "size")))


def parse_entries(data: np.ndarray, start: int = 0, end: int | None = None, form: EntryFormat = RING) -> Entries:
    """The frames of a run of entries (padding left out), their headers checked."""
    return entries_at(data, entry_starts(data, start, end, form), form)


def entries_at(data: np.ndarray, starts: np.ndarray, form: EntryFormat = RING) -> Entries:
    """The frames among the entries at `starts` (padding left out), their headers checked."""
    cpus = read_uint(data, starts + form.cpu, 4).astype(_I64)
    if form.padding:
        keep = cpus != PAD_CPU
        starts, cpus = starts[keep], cpus[keep]
    lengths = read_uint(data, starts + form.length, 4).astype(_I64)
    sizes = read_uint(data, starts + form.size, 4).astype(_I64)
    bad = np.flatnonzero((lengths < BLOCKS_AT) | (BLOCKS_AT + sizes > lengths))
    if bad.size:
        at = int(starts[bad[0]])
        raise TraceFormatError(f"corrupt entry at offset {at}: length {int(lengths[bad[0]])}, frame size "
                               f"{int(sizes[bad[0]])}")
    return Entries(starts, cpus, read_uint(data, starts + form.stamp, 8).view(_I64),
                   read_uint(data, starts + form.seq, 8).view(_I64),
                   read_uint(data, starts + form.tracepoint, 2).astype(_I64), sizes)


def from_entries(data: np.ndarray, entries: Entries, origin: int, ticks_per_ns: float) -> FrameBatch:
    """A batch of parsed entries; times count from the TSC `origin` (tstart), converted as `Tsc.to_ns`."""
    ns = np.trunc((entries.stamp - origin) / ticks_per_ns).astype(_I64)
    return FrameBatch(data, entries.starts + BLOCKS_AT, entries.size, entries.tracepoint, entries.cpu, entries.seq,
                      ns, np.zeros(len(entries.starts), dtype=_I64), entries.stamp)


# ---- records of a tsave'd file, and Frame objects -------------------------------------------------------------

_RECORD = struct.Struct("<HI")


def record_starts(data: np.ndarray, start: int, end: int) -> tuple[np.ndarray, int]:
    """Where each frame record (u16 tracepoint, u32 size, blocks) of a tsave'd file's frames section starts,
    from `start`: up to the end marker (tracepoint 0) or a record that `end` cuts. Returns the starts and where
    reading stopped (at the marker, or at the cut record)."""

    def length_at(offsets: np.ndarray) -> np.ndarray:
        lengths = np.full(len(offsets), end + 1, dtype=_I64)  # a header `end` cuts: not taken
        inside = offsets + _RECORD.size <= end
        if inside.any():
            at = offsets[inside]
            tracepoint = read_uint(data, at, 2)
            lengths[inside] = np.where(tracepoint == 0, 0, read_uint(data, at + 2, 4).astype(_I64) + _RECORD.size)
        return lengths

    return chain(data, start, end, length_at)


def from_records(data: np.ndarray, starts: np.ndarray, first_number: int) -> FrameBatch:
    """A batch of a tsave'd file's frame records: CPUs unknown, times by position (1 us apart), numbered from
    `first_number` (`Run`'s `load_tfile` rules; a reader with $cpu_id and $clock columns sets them after)."""
    count = len(starts)
    number = np.arange(first_number, first_number + count, dtype=_I64)
    return FrameBatch(data, starts + _RECORD.size, read_uint(data, starts + 2, 4).astype(_I64),
                      read_uint(data, starts, 2).astype(_I64), np.full(count, -1, dtype=_I64), number.copy(),
                      number * 1000, number, number * 1000)


def from_frames(frames: list[Frame]) -> FrameBatch:
    """A batch of `Frame` objects (a `Run` loaded whole)."""
    if not frames:
        return FrameBatch.empty()
    sizes = np.array([len(f.raw) for f in frames], dtype=_I64)
    body = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(_I64)
    data = np.frombuffer(b"".join(f.raw for f in frames), dtype=np.uint8)
    column = lambda values: np.array(values, dtype=_I64)  # noqa: E731
    ns = column([f.ns or 0 for f in frames])
    sdata = [f.sdata for f in frames] if any(f.sdata is not None for f in frames) else None
    return FrameBatch(data, body, sizes, column([f.tracepoint for f in frames]),
                      column([-1 if f.cpu is None else f.cpu for f in frames]), column([f.seq for f in frames]), ns,
                      column([f.number for f in frames]), ns.copy(), sdata)
