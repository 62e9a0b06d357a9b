"""Frame layouts: where each block of a frame is, the same for every frame its tracepoint's actions collect.

A tracepoint's actions decide its frames' blocks: `collect $regs, kgtp_counter` gives a register block then a
4-byte memory block at &kgtp_counter, every time. A `Layout` is that shape: each block's kind, where it starts
in the frame's blocks and what its header says (a memory block's length, a variable's number, a compact
register block's mask, static data's length); its `skeleton` is the bytes that say so. Frames of one
tracepoint with the same size and skeleton have the same layout, so a run of them decodes at fixed offsets
(view/decode.py) and a recorder names their fields once (view/record.py). A frame whose collection differed (a
memory read that faulted and left its block out, a string of another length) has a layout of its own.

A memory block's address is not in the skeleton: a collection relative to a register (`$bt`, a local on the
stack) has a new address in every frame. The addresses a layout shows (`BlockAt.address`) are those of the
frame it was made from; a decoder that relies on them checks them frame by frame (decode.py).

`LayoutTable.classify` sorts a batch's frames into layouts checking skeletons for all frames at once; only the
first frame of a new layout is parsed one block at a time. Pure data: any thread.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from ..arch import amd64
from .batch import FrameBatch, FrameRows
from .model import TraceFormatError

_MEMORY = struct.Struct("<QH")
_TSV = struct.Struct("<iq")
_MASK = struct.Struct("<I")
_STATIC = struct.Struct("<H")
#: Bit n of a compact register block's mask: GDB's register n of the general ones (tracing/core/frames.py).
GENERAL = amd64.GENERAL_REGISTERS


@dataclass(frozen=True)
class BlockAt:
    """One block of a layout: its kind ('R', 'r', 'M', 'V', 'S') at `at` (the offset of its kind byte) and the
    offset of its data (`data`, `length` bytes); a memory block's `address`, a variable's `number`, a compact
    register block's `mask`."""

    kind: str
    at: int
    data: int
    length: int
    address: int = 0
    number: int = 0
    mask: int = 0

    @property
    def end(self) -> int:
        return self.data + self.length

    def registers(self) -> dict[str, tuple[int, int]]:
        """A register block's registers: name -> (offset of its value, bytes of it)."""
        if self.kind == "R":
            return {reg.name: (self.data + offset, reg.size) for reg, offset in zip(amd64.REGISTERS, amd64.OFFSETS)}
        present = [reg for index, reg in enumerate(GENERAL) if self.mask >> index & 1]
        return {reg.name: (self.data + 8 * index, 8) for index, reg in enumerate(present)}


@dataclass(frozen=True)
class Layout:
    size: int
    blocks: tuple[BlockAt, ...]
    skeleton_at: np.ndarray = field(compare=False, repr=False)  #: offsets of the bytes that fix the layout
    skeleton: np.ndarray = field(compare=False, repr=False)  #: their values

    @property
    def key(self) -> tuple:
        """What identifies the layout: everything but memory blocks' addresses."""
        return (self.size, tuple((b.kind, b.at, b.length, b.number, b.mask) for b in self.blocks))

    @property
    def skeleton_runs(self) -> list[tuple[int, np.ndarray]]:
        """The skeleton as runs of consecutive bytes: (offset, their values)."""
        runs = self.__dict__.get("_runs")
        if runs is None:
            runs = []
            for offset, value in zip(self.skeleton_at.tolist(), self.skeleton.tolist()):
                if runs and runs[-1][0] + len(runs[-1][1]) == offset:
                    runs[-1][1].append(value)
                else:
                    runs.append((offset, [value]))
            runs = [(offset, np.array(values, dtype=np.uint8)) for offset, values in runs]
            object.__setattr__(self, "_runs", runs)
        return runs

    def last(self, *kinds: str) -> BlockAt | None:
        """The last block of these kinds (the view's rule for registers and static data: the last one wins)."""
        return next((b for b in reversed(self.blocks) if b.kind in kinds), None)

    def memory(self) -> list[BlockAt]:
        return [b for b in self.blocks if b.kind == "M"]

    def variable(self, number: int) -> BlockAt | None:
        """The block of variable `number` (the last one, as the view reads a frame's variables)."""
        return next((b for b in reversed(self.blocks) if b.kind == "V" and b.number == number), None)

    def pieces(self, address: int, length: int) -> tuple[list[int] | None, set[int]]:
        """Where in the frame each byte of [address, address + length) is, taken as `model.Blocks.read` takes
        it (at each byte, the first memory block that holds it, on to that block's end): None when a byte is in
        no block; and the memory blocks (indexes into `memory()`) it was taken from."""
        where: list[int] = []
        used: set[int] = set()
        cursor, end = address, address + length
        memory = self.memory()
        while cursor < end:
            for index, block in enumerate(memory):
                if block.address <= cursor < block.address + block.length:
                    count = min(end, block.address + block.length) - cursor
                    first = block.data + cursor - block.address
                    where.extend(range(first, first + count))
                    used.add(index)
                    cursor += count
                    break
            else:
                return None, used
        return where, used


def layout_of(body: bytes) -> Layout:
    """The layout of one frame's blocks (TraceFormatError for bytes that are not blocks)."""
    blocks: list[BlockAt] = []
    fixed: list[tuple[int, bytes]] = []
    position = 0
    try:
        while position < len(body):
            at = position
            kind = chr(body[at])
            data = at + 1
            if kind == "R":
                block = BlockAt(kind, at, data, amd64.G_PACKET_SIZE)
                header = b""
            elif kind == "r":
                (mask,) = _MASK.unpack_from(body, data)
                if mask & ~((1 << len(GENERAL)) - 1):
                    raise TraceFormatError(f"compact register block with mask {mask:#x}")
                header = body[data : data + _MASK.size]
                block = BlockAt(kind, at, data + _MASK.size, 8 * mask.bit_count(), mask=mask)
            elif kind == "M":
                address, length = _MEMORY.unpack_from(body, data)
                header = body[data + 8 : data + _MEMORY.size]  # the length; the address is the frame's own
                block = BlockAt(kind, at, data + _MEMORY.size, length, address=address)
            elif kind == "V":
                number, _ = _TSV.unpack_from(body, data)
                header = body[data : data + 4]
                block = BlockAt(kind, at, data + 4, 8, number=number)
            elif kind == "S":
                (length,) = _STATIC.unpack_from(body, data)
                header = body[data : data + _STATIC.size]
                block = BlockAt(kind, at, data + _STATIC.size, length)
            else:
                raise TraceFormatError(f"unknown block {kind!r} at offset {at}")
            if block.end > len(body):
                raise TraceFormatError(f"truncated {kind!r} block at offset {at}")
            blocks.append(block)
            fixed.append((at, body[at : at + 1]))
            fixed.append((block.data - len(header), header))
            position = block.end
    except struct.error:
        raise TraceFormatError("truncated block") from None
    offsets = [at + i for at, raw in fixed for i in range(len(raw))]
    values = [byte for _, raw in fixed for byte in raw]
    return Layout(len(body), tuple(blocks), np.array(offsets, dtype=np.int64), np.array(values, dtype=np.uint8))


@dataclass
class LayoutTable:
    """The layouts seen so far, by tracepoint and size; a class is one (tracepoint, layout)."""

    classes: list[tuple[int, Layout]] = field(default_factory=list)
    _candidates: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    _index: dict[tuple[int, tuple], int] = field(default_factory=dict)

    def add(self, tracepoint: int, layout: Layout) -> int:
        key = (tracepoint, layout.key)
        found = self._index.get(key)
        if found is None:
            found = self._index[key] = len(self.classes)
            self.classes.append((tracepoint, layout))
            self._candidates.setdefault((tracepoint, layout.size), []).append(found)
        return found

    def classify(self, batch: FrameBatch) -> np.ndarray:
        """The class of every frame of `batch` (an index into `classes`)."""
        out = np.full(len(batch), -1, dtype=np.int64)
        if not len(batch):
            return out
        keys = batch.tracepoint * (1 << 32) + batch.size
        if keys[0] == keys.min() == keys.max():  # one tracepoint, one size: the usual run
            groups = [(int(keys[0]), np.arange(len(batch)))]
        else:
            unique, inverse = np.unique(keys, return_inverse=True)
            groups = [(key, np.flatnonzero(inverse == group)) for group, key in enumerate(unique.tolist())]
        for key, members in groups:
            tracepoint, size = key >> 32, key & 0xFFFFFFFF
            while members.size:
                for index in self._candidates.get((tracepoint, size), []):
                    layout = self.classes[index][1]
                    if layout.skeleton_at.size:
                        rows = FrameRows(batch.data, batch.body[members], size)
                        match = np.ones(members.size, dtype=bool)
                        for at, expected in layout.skeleton_runs:
                            match &= (rows.field(at, len(expected)) == expected).all(axis=1)
                    else:
                        match = np.ones(members.size, dtype=bool)
                    out[members[match]] = index
                    members = members[~match]
                    if not members.size:
                        break
                if members.size:  # a layout not seen yet: parse the first such frame
                    self.add(tracepoint, layout_of(batch.blocks(int(members[0]))))
        return out


def show_returns(batch: FrameBatch, table: LayoutTable, trampolines: dict[int, int]) -> FrameBatch:
    """The batch with each 8-byte aligned word of collected memory that holds a return probe's trampoline
    showing the return address it stands for (`trampolines`, tracing/kgtp/kret.py's `visible`)."""
    classes = table.classify(batch)
    hidden = np.array(sorted(trampolines), dtype=np.uint64)
    shown = np.array([trampolines[t] for t in sorted(trampolines)], dtype=np.uint64)
    data = None
    for index in np.unique(classes).tolist():
        rows = np.flatnonzero(classes == index)
        for block in table.classes[index][1].memory():
            for offset in range((-block.address) % 8, block.length - 7, 8):
                at = batch.body[rows] + block.data + offset
                words = batch.data[at[:, None] + np.arange(8)].copy().view("<u8")[:, 0]
                where = np.isin(words, hidden)
                if where.any():
                    if data is None:
                        data = batch.data.copy()
                    replaced = shown[np.searchsorted(hidden, words[where])]
                    data[at[where][:, None] + np.arange(8)] = replaced.view(np.uint8).reshape(-1, 8)
    if data is not None:
        batch.data = data
    return batch
