"""Frames decoded in bulk: each field of a run of frames of one layout read at fixed offsets, as numpy columns.

`fields.FrameReader` decodes one frame: it parses the blocks, evaluates each `collect` argument with the kernel's
DWARF (cexpr.py) and builds Python values. Frames of one tracepoint and one layout (layout.py) hold each
value at the same place, so a *plan* made once per class says where: `$regs` is the register block's bytes,
a global (or a member or an element of one) the bytes of the memory block that holds its address, a
parameter in a register that register, a trace state variable its `V` block, `$_sdata` the marker's fields in
the static-data block; a value the layout does not hold at all is a constant (`<unavailable>` with its
reason, or the image's read-only bytes). Whatever a plan cannot place (arithmetic on collected values, a
pointer followed, a `collect/s` string) is `Each`: decoded frame by frame by the FrameReader.

A plan is checked before it is used: the first frame of its class decoded by the plan and by the FrameReader
must give equal values, or the field falls back to `Each`. A class with no `Each` field is *exact*: its
frames never go through the per-frame decoder, and the writers (export.py, follow.py, plot.py) format its
columns in bulk.

Values come as columns (`Column`): `Ints` (a numpy array), `Const` (one value for every frame), `Texts` and
`Values` (a Python list, one value per frame), `Members`/`Items` (a struct's members, an array's elements).
`value_at(column, i)` is frame i's Python value, as the FrameReader would give it. Pure: any thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..arch import amd64
from ..machine import Marker
from ..machine.dwarf import DWARF_REGISTERS, INT, LONG, CType, Unavailable
from ..tracing.core.sdata import render
from .batch import FrameBatch, FrameRows, read_uint
from .cexpr import ExpressionError, FrameContext, Value, evaluate, to_python
from .fields import GENERAL_REGISTERS, Field, FrameReader, split_arguments
from .layout import Layout, LayoutTable, layout_of
from .model import Frame, TracepointInfo

# ---- sources: where a value is in a frame of a layout -----------------------------------------------------------


@dataclass(frozen=True)
class Const:
    value: object


@dataclass(frozen=True)
class Int:
    """A little-endian integer of the bytes at these offsets in the frame's blocks."""

    offsets: tuple[int, ...]
    signed: bool


@dataclass(frozen=True)
class Text:
    """A char array: its bytes up to the first NUL, as latin-1."""

    offsets: tuple[int, ...]


@dataclass(frozen=True)
class Items:
    items: tuple


@dataclass(frozen=True)
class Members:
    members: tuple  # ((name, source), ...)


@dataclass(frozen=True)
class Each:
    """Decoded frame by frame (fields.FrameReader)."""


Source = Const | Int | Text | Items | Members | Each


class _NotPlaced(Exception):
    """A value a plan cannot place."""


# ---- columns: the values of a run of frames -------------------------------------------------------------------


@dataclass
class Ints:
    values: np.ndarray  # int64 (signed) or uint64


@dataclass
class Texts:
    values: list


@dataclass
class Values:
    values: list  # Python values, one per frame


@dataclass
class MemberColumns:
    members: list  # [(name, column)]


@dataclass
class ItemColumns:
    items: list


Column = Const | Ints | Texts | Values | MemberColumns | ItemColumns


def value_at(column: Column, index: int):
    """Frame `index`'s value, as FrameReader gives it."""
    if isinstance(column, Const):
        return column.value
    if isinstance(column, Ints):
        return int(column.values[index])
    if isinstance(column, (Texts, Values)):
        return column.values[index]
    if isinstance(column, MemberColumns):
        return {name: value_at(child, index) for name, child in column.members}
    return [value_at(child, index) for child in column.items]


def column_of(source: Source, rows: FrameRows) -> Column:
    """The values of `source` for the frames of `rows`."""
    if isinstance(source, Const):
        return source
    if isinstance(source, Int):
        offsets = source.offsets
        width = len(offsets)
        if offsets == tuple(range(offsets[0], offsets[0] + width)) and width in (1, 2, 4, 8):
            values = rows.uint(offsets[0], width)
        else:
            low = min(offsets)
            raw = rows.field(low, max(offsets) + 1 - low)[:, np.array(offsets, dtype=np.int64) - low]
            gathered = np.zeros((rows.count, 8), dtype=np.uint8)
            gathered[:, :width] = raw
            values = gathered.view("<u8")[:, 0]
        if not source.signed:
            return Ints(values)
        if width == 8:
            return Ints(values.view(np.int64))
        signed = values.astype(np.int64)
        return Ints(np.where(signed >= 1 << (8 * width - 1), signed - (1 << 8 * width), signed))
    if isinstance(source, Text):
        low = min(source.offsets)
        raw = rows.field(low, max(source.offsets) + 1 - low)[:, np.array(source.offsets) - low]
        return Texts([row.split(b"\0", 1)[0].decode("latin-1") for row in map(bytes, raw)])
    if isinstance(source, Items):
        return ItemColumns([column_of(item, rows) for item in source.items])
    if isinstance(source, Members):
        return MemberColumns([(name, column_of(child, rows)) for name, child in source.members])
    raise _NotPlaced("a per-frame value has no column")


# ---- plans ----------------------------------------------------------------------------------------------------


@dataclass
class PlannedField:
    name: str
    spec: tuple
    error: str | None  # the template frame's: constant for a placed field that is unavailable
    source: Source


@dataclass(frozen=True)
class Requirement:
    """What a plan assumes of a memory block's address (not part of the layout): that it is `address` (the
    block holds bytes the plan reads), or that the block lies apart from [address, address + length) (it could
    otherwise hold them first)."""

    at: int  #: offset of the block's address in the frame's blocks
    size: int  #: the block's length
    address: int
    length: int = 0  #: 0: the address must be `address`; else: apart from this many bytes there

    def holds(self, data: np.ndarray, body: np.ndarray) -> np.ndarray:
        addresses = read_uint(data, body + self.at, 8)
        if not self.length:
            return addresses == np.uint64(self.address)
        return (addresses + np.uint64(self.size) <= np.uint64(self.address)) | (
            addresses >= np.uint64(self.address + self.length))


@dataclass
class ClassPlan:
    """How to decode the frames of one tracepoint with one layout (those whose memory blocks' addresses meet
    `requirements`)."""

    index: int
    tracepoint: int
    layout: Layout
    info: TracepointInfo
    event: str
    marker: Marker | None
    fields: list[PlannedField]
    static_block: int | None  #: offset of the data of the frame's first `$_sdata` block, when the marker renders it
    requirements: tuple[Requirement, ...] = ()

    @property
    def exact(self) -> bool:
        return not any(isinstance(f.source, Each) for f in self.fields)

    def holds(self, data: np.ndarray, body: np.ndarray) -> np.ndarray:
        """Which of these frames (of the plan's class) the plan decodes."""
        ok = np.ones(len(body), dtype=bool)
        for requirement in self.requirements:
            ok &= requirement.holds(data, body)
        return ok


_PERTURB = 0x5A5A5A5A5A5A5A5A
#: A memory block's address and length, before its data.
_MEMORY_HEADER = 10


def _perturbed(registers: dict[str, int] | None) -> dict[str, int] | None:
    if registers is None:
        return None
    return {name: (value ^ _PERTURB) & 0xFFFFFFFFFFFFFFFF for name, value in registers.items()}


class _Registers(dict):
    """A frame's registers that remember being read."""

    used = False

    def __getitem__(self, key):
        self.used = True
        return super().__getitem__(key)

    def __contains__(self, key):
        self.used = True
        return super().__contains__(key)

    def get(self, key, default=None):
        self.used = True
        return super().get(key, default)


class Planner:
    """Plans for one FrameReader's tracepoints (one per class of `LayoutTable`)."""

    def __init__(self, reader: FrameReader) -> None:
        self.reader = reader
        self._requirements: list[Requirement] = []

    def plan(self, index: int, tracepoint: int, template: Frame, placed: bool = True) -> ClassPlan:
        """The plan of `template`'s class, made and checked on it; with `placed` False, every field `Each`."""
        reader = self.reader
        layout = layout_of(template.raw)
        info = reader.tracepoint(template)
        fields = reader.fields(template)
        arguments = [argument for line in info.collect_lines() for argument in split_arguments(line)]
        marker = reader.marker(info)
        static = next((b for b in layout.blocks if b.kind == "S"), None)
        planned = []
        requirements: set[Requirement] = set()
        for argument, reference in zip(arguments, fields, strict=True):
            self._requirements = []
            try:
                source = self._source(info, layout, template, argument) if info.address and placed else Each()
            except _NotPlaced:
                source = Each()
            if not isinstance(source, Each) and not _agrees(source, template, reference.value):
                source = Each()
            if not isinstance(source, Each):
                requirements.update(self._requirements)
            planned.append(PlannedField(reference.name, reference.spec, reference.error, source))
        return ClassPlan(index, tracepoint, layout, info, reader.event_name(info), marker, planned,
                         static.data if static is not None and marker is not None else None,
                         tuple(sorted(requirements, key=lambda r: (r.at, r.length))))

    # -- one collect argument

    def _source(self, info: TracepointInfo, layout: Layout, template: Frame, argument: str) -> Source:
        modifier, text = "", argument
        if argument.startswith("/"):
            modifier, _, text = argument.partition(" ")
        if text == "$regs":
            return self._registers(layout)
        if text in ("$args", "$locals"):
            parameters, local = self.reader.dwarf.scope(info.address)
            members: dict[str, Source] = {}
            for variable in parameters if text == "$args" else local:
                try:
                    members[variable.name] = self._expression(info, layout, template, variable.name)
                except _NotPlaced:
                    members[variable.name] = Each()
            if any(isinstance(s, Each) for s in members.values()):
                raise _NotPlaced("a variable not placed")
            return Members(tuple(members.items()))
        if text == "$_sdata":
            return self._static(info, layout)
        variables = self.reader.run.variables
        if text.startswith("$") and text[1:] in variables.values():
            number = [n for n, name in variables.items() if name == text[1:]][-1]
            block = layout.variable(number)
            return Const(None) if block is None else Int(tuple(range(block.data, block.data + 8)), True)
        if modifier == "/s":
            raise _NotPlaced("a string a pointer points at")
        return self._expression(info, layout, template, text)

    @staticmethod
    def _registers(layout: Layout) -> Source:
        block = layout.last("R", "r")
        if block is None:
            return Const(None)
        held = block.registers()
        members = []
        sizes = {reg.name: reg.size for reg in _GENERAL}
        for name in GENERAL_REGISTERS:
            if name in held:
                offset, _ = held[name]
                members.append((name, Int(tuple(range(offset, offset + sizes[name])), False)))
            else:
                members.append((name, Const(0)))  # a compact block widened to `R` reads zero there
        return Members(tuple(members))

    def _static(self, info: TracepointInfo, layout: Layout) -> Source:
        marker = self.reader.marker(info)
        block = layout.last("S")
        if marker is None or block is None:
            return Const(None)
        members = []
        for f in marker.fields:
            if f.offset + f.size > block.length:
                raise _NotPlaced("a marker field past the static data")
            start = block.data + f.offset
            if "[" in f.type:
                element_type = f.type.split("[", 1)[0].strip()
                count = int(f.type.split("[", 1)[1].rstrip("]") or 0)
                if element_type == "char":
                    members.append((f.name, Text(tuple(range(start, start + f.size)))))
                else:
                    size = f.size // max(count, 1)
                    members.append((f.name, Items(tuple(Int(tuple(range(start + i * size, start + (i + 1) * size)),
                                                            f.signed) for i in range(count)))))
            else:
                if f.size > 8:
                    raise _NotPlaced("a wide marker field")
                members.append((f.name, Int(tuple(range(start, start + f.size)), f.signed)))
        return Members(tuple(members))

    def _expression(self, info: TracepointInfo, layout: Layout, template: Frame, text: str) -> Source:
        """A C expression whose value is the bytes at one place of every frame of the layout."""
        dwarf = self.reader.dwarf
        blocks = template.blocks
        pc = info.address
        tokens = text.split()
        if len(tokens) == 1 and text.startswith("$") and text[1:] in _REGISTER_TYPES:
            return self._register_value(layout, text[1:])
        if len(tokens) == 1 and (text[0].isalpha() or text[0] == "_") and text.replace("_", "").isalnum():
            parameters, local = dwarf.scope(pc)
            for variable in [*reversed(local), *parameters]:
                if variable.name == text:
                    return self._variable(layout, blocks.registers, variable, pc)
            found = dwarf.global_variable(text)
            if found is None:
                return Const(None)  # no such symbol: unavailable in every frame alike
            return self._memory(layout, found[0], found[1], template)
        # anything else: an lvalue whose address reads nothing from the frame (a member or element of a global)
        registers = _Registers(blocks.registers or {}) if blocks.registers is not None else None
        reads: list[tuple[int, int]] = []

        def read(address: int, length: int) -> bytes | None:
            reads.append((address, length))
            return blocks.read(address, length)

        context = FrameContext(dwarf, pc, registers, read, {})
        try:
            value = evaluate(text, context)
        except (Unavailable, ExpressionError, KeyError, IndexError):
            if not reads and (registers is None or not registers.used):
                return Const(None)  # refused without reading the frame: alike in every frame (`$bt`)
            raise _NotPlaced("not evaluated") from None
        if registers is not None and registers.used or value.address is None:
            raise _NotPlaced("computed from the frame")
        perturbed_reads: list[tuple[int, int]] = []

        def perturbed(address: int, length: int) -> bytes | None:
            perturbed_reads.append((address, length))
            data = blocks.read(address, length)
            return None if data is None else bytes(b ^ 0xA5 for b in data)

        try:
            again = evaluate(text, FrameContext(dwarf, pc, None, perturbed, {}))
        except (Unavailable, ExpressionError, KeyError, IndexError):
            raise _NotPlaced("depends on the frame") from None
        if again.address != value.address or perturbed_reads != reads:
            raise _NotPlaced("an address read from the frame")
        return self._memory(layout, value.address, value.type, template)

    def _variable(self, layout: Layout, registers, variable, pc: int) -> Source:
        dwarf = self.reader.dwarf
        try:
            location = dwarf.location(variable.die, pc, registers,
                                      dwarf.cfa(pc, registers) if registers is not None else None)
        except Unavailable:
            raise _NotPlaced("unavailable") from None
        kind = variable.type
        if location.kind == "reg":
            block = layout.last("R", "r")
            if block is None or location.value >= len(DWARF_REGISTERS) or not kind.scalar or kind.size > 8:
                raise _NotPlaced("a register the frame lacks")
            held = block.registers().get(DWARF_REGISTERS[location.value])
            if held is None:  # a register a compact block did not hold: zero, as widened to `R`
                return Const(0)
            offset, size = held
            width = min(kind.size, size)
            if width < kind.size:
                raise _NotPlaced("a register narrower than its variable")
            return Int(tuple(range(offset, offset + width)), kind.signed)
        if location.kind == "mem":
            other = _perturbed(registers)
            try:
                moved = dwarf.location(variable.die, pc, other, dwarf.cfa(pc, other) if other is not None else None)
            except Unavailable:
                raise _NotPlaced("unavailable") from None
            if moved.kind != "mem" or moved.value != location.value:
                raise _NotPlaced("an address from the registers")
            return self._memory(layout, location.value, kind, None)
        raise _NotPlaced("a constant or optimized out")

    def _register_value(self, layout: Layout, name: str) -> Source:
        """`$rsi`: the register, read as cexpr types it (rip a pointer, eflags and segments int, others long)."""
        register = {"pc": "rip", "sp": "rsp", "fp": "rbp", "ps": "eflags"}.get(name, name)
        block = layout.last("R", "r")
        if block is None:
            raise _NotPlaced("no registers")
        held = block.registers().get(register)
        if held is None:
            raise _NotPlaced("a register the compact block lacks")
        kind = _REGISTER_TYPES[register]
        offset, _ = held
        return Int(tuple(range(offset, offset + kind.size)), kind.signed)

    def _memory(self, layout: Layout, address: int, kind: CType, template: Frame | None) -> Source:
        where, used = layout.pieces(address, kind.size)
        for number, block in enumerate(layout.memory()):  # what the other frames' blocks must be for this to hold
            apart = block.address + block.length <= address or block.address >= address + kind.size
            if number in used or not apart:
                self._requirements.append(Requirement(block.data - _MEMORY_HEADER, block.length, block.address))
            else:
                self._requirements.append(Requirement(block.data - _MEMORY_HEADER, block.length, address, kind.size))
        if where is None:  # not in the frame: the image's read-only bytes, or unavailable, alike for all
            data = self.reader.dwarf.read_only(address, kind.size)
            return Const(to_python(Value(kind, data, address)))
        return _typed(kind, where, 0)


_GENERAL = amd64.GENERAL_REGISTERS
_REGISTER_TYPES = {name: (CType("pointer", "", 8) if name == "rip" else INT if name in
                          ("eflags", "cs", "ss", "ds", "es", "fs", "gs") else LONG)
                   for name in GENERAL_REGISTERS}
_REGISTER_TYPES.update({alias: _REGISTER_TYPES[name] for alias, name in
                        (("pc", "rip"), ("sp", "rsp"), ("fp", "rbp"), ("ps", "eflags"))})


def _typed(kind: CType, where: list[int], depth: int) -> Source:
    """The source of `to_python(Value(kind, bytes))` for bytes at `where` (cexpr.to_python's rules)."""
    if kind.scalar:
        if kind.size > 8 or kind.size < 1:
            raise _NotPlaced("a wide scalar")
        return Int(tuple(where[: kind.size]), kind.signed)
    if kind.kind == "array" and kind.target is not None:
        if kind.target.char:
            return Text(tuple(where[: kind.size]))
        element = kind.target
        return Items(tuple(_typed(element, where[i * element.size : (i + 1) * element.size], depth + 1)
                           for i in range(min(kind.count or 0, 64))))
    if kind.kind in ("struct", "union"):
        if depth > 4:
            return Const(None)
        members: dict[str, Source] = {}
        for name, offset, member in kind.members:
            found = _typed(member, where[offset : offset + member.size], depth + 1)
            if not name and isinstance(found, Members):
                members.update(found.members)
            else:
                members[name] = found
        return Members(tuple(members.items()))
    return Const(None)


def _agrees(source: Source, frame: Frame, expected) -> bool:
    """Whether the plan gives `frame` the value the FrameReader gave it (`expected`)."""
    data = np.frombuffer(frame.raw, dtype=np.uint8)
    try:
        got = value_at(column_of(source, FrameRows(data, np.zeros(1, dtype=np.int64), len(data))), 0)
    except (_NotPlaced, IndexError, ValueError):
        return False
    return _same(got, expected)


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# ---- the bulk reader ------------------------------------------------------------------------------------------


@dataclass
class Decoded:
    """One class's frames of a batch: the rows (indexes into the batch, in order) and each field's column;
    `sdata` is the rendered `$_sdata` per row (None where frames have none)."""

    plan: ClassPlan
    rows: np.ndarray
    columns: list[Column]
    sdata: list | None

    def fields(self, index: int) -> list[Field]:
        """Row `index`'s fields as the FrameReader gives them."""
        out = []
        for planned, column in zip(self.plan.fields, self.columns):
            value = value_at(column, index)
            out.append(Field(planned.name, value, planned.spec, planned.error if value is None else None))
        return out


#: Plans a class may have for frames whose memory addresses differ; its other frames are decoded one by one.
MAX_PLANS = 8


@dataclass
class BulkReader:
    """A FrameReader for batches: frames sorted into classes, each decoded with its plan."""

    reader: FrameReader
    table: LayoutTable = field(default_factory=LayoutTable)
    plans: dict[int, list[ClassPlan]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.planner = Planner(self.reader)

    def decode(self, batch: FrameBatch) -> list[Decoded]:
        """Every frame of `batch`, class by class (each class's rows in batch order)."""
        classes = self.table.classify(batch)
        out = []
        single = len(classes) and classes[0] == classes.min() == classes.max()
        for index in [int(classes[0])] if single else np.unique(classes).tolist():
            remaining = np.arange(len(classes)) if single else np.flatnonzero(classes == index)
            plans = self.plans.setdefault(index, [])
            position = 0
            while remaining.size:
                if position == len(plans):
                    template = batch.frame(int(remaining[0]))
                    plans.append(self.planner.plan(index, int(batch.tracepoint[remaining[0]]), template,
                                                   placed=len(plans) < MAX_PLANS))
                plan = plans[position]
                position += 1
                ok = plan.holds(batch.data, batch.body[remaining])
                if ok.any():
                    out.append(self._decode(plan, batch, remaining[ok]))
                    remaining = remaining[~ok]
        return out

    def _decode(self, plan: ClassPlan, batch: FrameBatch, rows: np.ndarray) -> Decoded:
        frames = FrameRows(batch.data, batch.body[rows], plan.layout.size)
        columns: list[Column] = []
        per_frame: list[list[Field]] | None = None
        for number, planned in enumerate(plan.fields):
            if isinstance(planned.source, Each):
                if per_frame is None:
                    per_frame = [self.reader.fields(batch.frame(int(row))) for row in rows]
                columns.append(Values([fields[number].value for fields in per_frame]))
            else:
                columns.append(column_of(planned.source, frames))
        return Decoded(plan, rows, columns, self._sdata(plan, batch, rows))

    def _sdata(self, plan: ClassPlan, batch: FrameBatch, rows: np.ndarray) -> list | None:
        if batch.sdata is not None:
            return [batch.sdata[int(row)] for row in rows]
        if plan.static_block is None or plan.marker is None:
            return None
        block = next(b for b in plan.layout.blocks if b.kind == "S")
        return [render(plan.marker, batch.data[start : start + block.length].tobytes())
                for start in (batch.body[rows] + block.data).tolist()]

    def frame(self, batch: FrameBatch, row: int, sdata: str | None = None) -> Frame:
        """Frame `row` as a `Frame` (with its rendered `$_sdata`)."""
        frame = batch.frame(row)
        if sdata is not None:
            frame.sdata = sdata
        return frame


__all__ = ["BulkReader", "ClassPlan", "Column", "Const", "Decoded", "Each", "Ints", "ItemColumns", "MemberColumns",
           "Texts", "Values", "column_of", "value_at"]
