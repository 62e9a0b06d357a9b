"""`kgtp-sim export`: a run's frames as CTF 1.8 (LTTng's style), Chrome trace-event JSON, or JSON lines.

Every writer takes the same input: a `Run` (from a running stub through the follow channel, a tsave'd file or
a recorded trace: sources.py) and a `FrameReader` that names and types each frame's collected values with the
kernel's DWARF. Frames are read a batch at a time and written as they come, so memory does not grow with the
trace; a batch's frames are decoded class by class (decode.py), and a class whose every field has a place in
its frames is formatted in bulk (a numpy record per event for CTF, one format string per class for JSON); the
other frames go through the FrameReader one at a time and come out the same.

CTF: a directory with `metadata` (TSDL) and one stream file per CPU (`channel0_<cpu>`), as LTTng lays out a
kernel trace (ctf.py). One event class per tracepoint (a static tracepoint's class is named after its marker),
with the fields of its `collect` actions: a C expression's field is named after its text
(`(2*counter1+3*counter2)` becomes `x2_counter1_3_counter2`, the metadata comments give the mapping), `$regs`
gives `regs_rax` ..., `$args`/`$locals` give `args_<name>`/`locals_<name>`, `$_sdata` the marker's TP_STRUCT
fields under their own names and C types (a tracepoint whose frames differ in shape, a block missing from some,
has a class per shape, under one name). Every event carries `frame` (GDB's frame number, for tfind) and, in its
packet context, the CPU it ran on; its timestamp is nanoseconds on a clock whose origin is tstart. A value the
frame does not hold is written as 0 (or "") and named in the event's `unavailable` field.

Chrome trace events: one track per CPU (`tid` = CPU), an instant event per frame with its fields as `args`;
opens in Perfetto UI and chrome://tracing.

JSON lines: one object per frame with its fields keyed by source text, for scripts and dataframes.
Runs in the caller's thread.
"""

from __future__ import annotations

import json
import re
import struct
import uuid
from pathlib import Path

import numpy as np

from .batch import FrameBatch
from .ctf import (UNKNOWN_CPU, StreamWriter, comment, identifier, packet_context, preamble, stream_files,
                  write_metadata)
from .decode import BulkReader, Column, Const, Decoded, Ints, MemberColumns, Texts, Values
from .fields import Field, FrameReader, flatten
from .model import Run
from .sources import batches

__all__ = ["FORMATS", "frame_record", "identifier", "write_chrome", "write_ctf", "write_jsonl"]

_PACKET_CONTENT = 256 * 1024


def _leaf_name(field_name: str, path: str, static_event: bool) -> str:
    """Field names in LTTng's style: the marker's fields as they are, the rest prefixed by what they are."""
    member = path[len(field_name) + 1 :] if path != field_name else ""
    if field_name == "$_sdata" and member:
        return identifier(member) if static_event else identifier("sdata_" + member)
    if field_name == "$regs" and member:
        return identifier("regs_" + member)
    if field_name in ("$args", "$locals") and member:
        return identifier(field_name[1:] + "_" + member)
    return identifier(path)


# ---- one frame, as the per-frame writers see it -----------------------------------------------------------------


def frame_record(reader: FrameReader, frame, fields: list[Field] | None = None) -> dict:
    info = reader.tracepoint(frame)
    marker = reader.marker(info)
    fields = reader.fields(frame) if fields is None else fields
    return _record(frame.number, frame.seq, frame.tracepoint, reader.event_name(info), info.location,
                   marker.id if marker is not None else None, frame.cpu, frame.ns, fields, frame.sdata)


def _record(number, seq, tracepoint, event, location, marker, cpu, ns, fields: list[Field], sdata) -> dict:
    record = {
        "frame": number,
        "seq": seq,
        "tracepoint": tracepoint,
        "event": event,
        "location": location,
        "marker": marker,
        "cpu": cpu,
        "time_ns": ns,
        "fields": {f.name: f.value for f in fields},
    }
    unavailable = {f.name: f.error for f in fields if f.value is None}
    if unavailable:
        record["unavailable"] = unavailable
    if sdata is not None:
        record["sdata"] = sdata
    return record


def _chrome_event(record: dict, tracepoint: int, cpu, ns) -> dict:
    args = {"frame": record["frame"], "seq": record["seq"], "tracepoint": tracepoint, **record["fields"]}
    if "sdata" in record:
        args["$_sdata (TP_printk)"] = record["sdata"]
    return {"ph": "i", "s": "t", "name": record["event"], "cat": f"tp{tracepoint}", "pid": 1,
            "tid": cpu if cpu is not None else 9999, "ts": ns / 1000, "args": args}


# ---- JSON in bulk: one format string per class ----------------------------------------------------------------


class _Slot(str):
    """A placeholder for a per-frame value in a record built for a class."""

    __slots__ = ()


_SLOT = re.compile(r'"\\u0000(\d+)\\u0000"')


class JsonTemplate:
    """A class's records as one format string: the record built once with placeholders where frames differ,
    dumped as json.dumps dumps it, and cut at the placeholders."""

    def __init__(self) -> None:
        self.slots: list[tuple[str, object]] = []  # (kind, column-like) per placeholder, in order

    def slot(self, kind: str, values) -> _Slot:
        self.slots.append((kind, values))
        return _Slot(f"\0{len(self.slots) - 1}\0")

    def value(self, column: Column):
        """The record's value for a column: the constant itself, or placeholders down to each varying leaf."""
        if isinstance(column, Const):
            return column.value
        if isinstance(column, Ints):
            return self.slot("int", column.values)
        if isinstance(column, (Texts, Values)):
            return self.slot("json", column.values)
        if isinstance(column, MemberColumns):
            return {name: self.value(child) for name, child in column.members}
        return [self.value(child) for child in column.items]

    def render(self, record: dict, count: int) -> list[str]:
        """`count` lines: `record` with every placeholder filled in."""
        text = json.dumps(record)
        pieces = _SLOT.split(text)
        fmt = pieces[0].replace("%", "%%")
        order = []
        for index in range(1, len(pieces), 2):
            kind, _ = self.slots[int(pieces[index])]
            fmt += ("%d" if kind == "int" else "%r" if kind == "float" else "%s") + pieces[index + 1].replace("%", "%%")
            order.append(int(pieces[index]))
        columns = []
        for index in order:
            kind, values = self.slots[index]
            if kind in ("int", "float"):
                columns.append(values.tolist() if isinstance(values, np.ndarray) else list(values))
            elif kind == "text":
                columns.append(values)
            else:
                columns.append([json.dumps(v) for v in values])
        if not columns:
            return [fmt % ()] * count
        return list(map(fmt.__mod__, zip(*columns)))


def _cpu_values(cpus: np.ndarray) -> tuple[str, object]:
    if (cpus >= 0).all():
        return "int", cpus
    return "text", ["null" if c < 0 else str(c) for c in cpus.tolist()]


class _Writer:
    """What the three writers share: the run, the bulk reader, and each class's constant parts."""

    def __init__(self, run: Run, reader: FrameReader, bulk: bool) -> None:
        self.run, self.reader, self.bulk = run, reader, bulk
        self.decoder = BulkReader(reader)
        self.count = 0

    def decoded(self, batch: FrameBatch) -> list[Decoded]:
        return self.decoder.decode(batch)

    def exact(self, part: Decoded) -> bool:
        return self.bulk and part.plan.exact

    def fields(self, part: Decoded, index: int, frame) -> list[Field]:
        """Row `index`'s fields: from the class's columns when they are exact, else the FrameReader's."""
        return part.fields(index) if self.exact(part) else self.reader.fields(frame)

    def frame(self, batch: FrameBatch, part: Decoded, index: int):
        return self.decoder.frame(batch, int(part.rows[index]), part.sdata[index] if part.sdata else None)

    def marker_id(self, part: Decoded):
        return part.plan.marker.id if part.plan.marker is not None else None

    def lines(self, batch: FrameBatch, parts: list[Decoded], line_of_class, line_of_frame) -> list[str]:
        """One line per frame of the batch, in order: a class's in bulk, or frame by frame."""
        out = np.empty(len(batch), dtype=object)
        for part in parts:
            if self.exact(part):
                out[part.rows] = line_of_class(batch, part)
            else:
                out[part.rows] = [line_of_frame(self.frame(batch, part, i), part, i) for i in range(len(part.rows))]
        return out.tolist()

    def json_record(self, template: JsonTemplate, batch: FrameBatch, part: Decoded) -> dict:
        rows = part.rows
        kind, cpus = _cpu_values(batch.cpu[rows])
        fields = [Field(f.name, template.value(column), f.spec, f.error if isinstance(column, Const) else None)
                  for f, column in zip(part.plan.fields, part.columns)]
        sdata = template.slot("json", part.sdata) if part.sdata is not None else None
        return _record(template.slot("int", batch.number[rows]), template.slot("int", batch.seq[rows]),
                       part.plan.tracepoint, part.plan.event, part.plan.info.location, self.marker_id(part),
                       template.slot(kind, cpus), template.slot("int", batch.ns[rows]), fields, sdata)


# ---- JSON lines and Chrome trace events -----------------------------------------------------------------------


def write_jsonl(run: Run, reader: FrameReader, path: Path, bulk: bool = True) -> dict:
    writer = _Writer(run, reader, bulk)

    def line_of_class(batch: FrameBatch, part: Decoded) -> list[str]:
        template = JsonTemplate()
        return template.render(writer.json_record(template, batch, part), len(part.rows))

    def line_of_frame(frame, part: Decoded, index: int) -> str:
        return json.dumps(frame_record(reader, frame, writer.fields(part, index, frame)))

    with open(path, "w") as out:
        for batch in batches(run):
            lines = writer.lines(batch, writer.decoded(batch), line_of_class, line_of_frame)
            out.write("\n".join(lines) + "\n" if lines else "")
            writer.count += len(batch)
    return {"events": writer.count}


def write_chrome(run: Run, reader: FrameReader, path: Path, bulk: bool = True) -> dict:
    writer = _Writer(run, reader, bulk)
    pid = 1
    cpus: set[int | None] = set()

    def line_of_class(batch: FrameBatch, part: Decoded) -> list[str]:
        template = JsonTemplate()
        record = writer.json_record(template, batch, part)
        rows = part.rows
        tids = np.where(batch.cpu[rows] >= 0, batch.cpu[rows], 9999)
        event = _chrome_event(record, part.plan.tracepoint, None, 0)
        event["tid"] = template.slot("int", tids)
        event["ts"] = template.slot("float", batch.ns[rows] / 1000)
        return template.render(event, len(rows))

    def line_of_frame(frame, part: Decoded, index: int) -> str:
        record = frame_record(reader, frame, writer.fields(part, index, frame))
        return json.dumps(_chrome_event(record, frame.tracepoint, frame.cpu, frame.ns or 0))

    with open(path, "w") as out:
        out.write('{"traceEvents": [')
        out.write(json.dumps({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": "kgtp-sim kernel"}}))
        for batch in batches(run):
            cpus.update(None if c < 0 else c for c in np.unique(batch.cpu).tolist())
            lines = writer.lines(batch, writer.decoded(batch), line_of_class, line_of_frame)
            if lines:
                out.write(", " + ", ".join(lines))
            writer.count += len(batch)
        ordered = sorted(cpus, key=lambda c: (c is None, c or 0))
        for cpu in ordered:
            tid = cpu if cpu is not None else 9999
            label = f"CPU {cpu}" if cpu is not None else "CPU unknown"
            for event in ({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}},
                          {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}}):
                out.write(", " + json.dumps(event))
        out.write('], "displayTimeUnit": "ns", "otherData": ' + json.dumps(
            {"tracer": "kgtp-sim", "origin": run.origin, "time_source": run.time_source,
             "cpu_source": run.cpu_source, "tstart_us": run.start_us, "frames_missed": run.missed}) + "}")
    return {"events": writer.count, "cpus": ordered}


# ---- CTF ------------------------------------------------------------------------------------------------------


class EventClass:
    def __init__(self, number: int, tracepoint: int, name: str, static_event: bool) -> None:
        self.number = number
        self.tracepoint = tracepoint
        self.name = name
        self.static = static_event
        self.columns: list[tuple[str, str, tuple]] = []  # (TSDL name, source path, spec)
        self._taken = {"frame", "unavailable"}
        self.has_unavailable = False
        self.dtype: np.dtype | None = None  # a record per event, when every column is a fixed-size integer

    def column(self, field_name: str, path: str, spec: tuple) -> None:
        if any(c[1] == path for c in self.columns):
            return
        name = _leaf_name(field_name, path, self.static)
        base, count = name, 2
        while name in self._taken:
            name = f"{base}_{count}"
            count += 1
        self._taken.add(name)
        self.columns.append((name, path, spec))


def _tsdl_type(spec: tuple) -> tuple[str, str]:
    """(type text before the name, suffix after it) for a leaf spec."""
    if spec[0] == "string":
        return "string", ""
    if spec[0] == "array":
        inner, suffix = _tsdl_type(spec[2])
        return inner, f"[{spec[1]}]{suffix}"
    bits, signed, base = spec[1], spec[2], spec[3] if len(spec) > 3 else 10
    return (f"integer {{ size = {bits}; align = 8; signed = {'true' if signed else 'false'}; base = {base}; }}", "")


def _pack(spec: tuple, value) -> bytes:
    if spec[0] == "string":
        text = value if isinstance(value, str) else ""
        return text.replace("\0", "").encode("utf-8") + b"\0"
    if spec[0] == "array":
        items = value if isinstance(value, list) else []
        return b"".join(_pack(spec[2], items[i] if i < len(items) else None) for i in range(spec[1]))
    bits = spec[1]
    number = value if isinstance(value, int) else 0
    return (number & ((1 << bits) - 1)).to_bytes(bits // 8, "little")


def _leaves(fields: list[Field]) -> dict[str, tuple[object, tuple, str]]:
    out = {}
    for item in fields:
        for path, value, spec in flatten(item.name, item.value, item.spec):
            out[path] = (value, spec, item.name)
    return out


def _column_leaves(name: str, column: Column, spec: tuple) -> list[tuple[str, Column, tuple]]:
    """`flatten` over a column: the scalar leaves (strings and arrays stay leaves) and their columns."""
    if spec[0] == "struct":
        members = dict(column.members) if isinstance(column, MemberColumns) else {}
        out = []
        for member, member_spec in spec[1]:
            out.extend(_column_leaves(f"{name}.{member}", members.get(member, Const(None)), member_spec))
        return out
    return [(name, column, spec)]


_WIDTHS = {8: "<u1", 16: "<u2", 32: "<u4", 64: "<u8"}
_HEAD = struct.Struct("<IQQ")  # event id, timestamp, frame


class CtfWriter:
    """The CTF trace of one run, written a batch at a time."""

    def __init__(self, run: Run, reader: FrameReader, directory: Path, bulk: bool = True) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        for paths in stream_files(directory).values():  # an earlier trace's streams would not match this one
            for path in paths:
                path.unlink()
        self.run, self.reader, self.directory = run, reader, directory
        self.writer = _Writer(run, reader, bulk)
        self.classes: dict[tuple, EventClass] = {}
        self.tracepoint_names: dict[int, str] = {}
        self.trace_uuid = uuid.uuid4()
        self.streams: dict[int, StreamWriter] = {}

    def _class(self, tracepoint: int, event: str, static_event: bool, leaves: list[tuple[str, tuple, str]],
               has_unavailable: bool) -> EventClass:
        key = (tracepoint, tuple((path, spec) for path, spec, _ in leaves), has_unavailable)
        found = self.classes.get(key)
        if found is None:
            found = self.classes[key] = EventClass(len(self.classes), tracepoint, event, static_event)
            self.tracepoint_names.setdefault(tracepoint, event)
            for path, spec, field_name in leaves:
                found.column(field_name, path, spec)
            found.has_unavailable = has_unavailable
            if all(spec[0] == "int" and spec[1] in _WIDTHS for _, _, spec in found.columns):
                found.dtype = np.dtype([("id", "<u4"), ("timestamp", "<u8"), ("frame", "<u8")]
                                       + [(f"c{i}", _WIDTHS[spec[1]]) for i, (_, _, spec) in enumerate(found.columns)])
        return found

    def add(self, batch: FrameBatch) -> None:
        events: list[bytes | None] = [None] * len(batch)
        blocks: list[tuple[np.ndarray, np.ndarray]] = []  # (rows, one record per row as uint8 rows)
        for part in self.writer.decoded(batch):
            if self.writer.exact(part) and self._bulk(batch, part, blocks):
                continue
            for index, row in enumerate(part.rows.tolist()):
                frame = self.writer.frame(batch, part, index)
                fields = self.writer.fields(part, index, frame)
                events[row] = self._event(frame, part, fields)
        sizes = np.array([len(e) if e is not None else 0 for e in events], dtype=np.int64)
        for rows, records in blocks:
            sizes[rows] = records.shape[1]
        for cpu in np.unique(batch.cpu).tolist():
            rows = np.flatnonzero(batch.cpu == cpu)
            rows = rows[np.argsort(batch.ns[rows], kind="stable")]
            self._write(UNKNOWN_CPU if cpu < 0 else cpu, batch, rows, sizes, events, blocks)

    def _bulk(self, batch: FrameBatch, part: Decoded, blocks: list) -> bool:
        leaves = []
        for planned, column in zip(part.plan.fields, part.columns):
            leaves += [(path, leaf, spec, planned.name) for path, leaf, spec in
                       _column_leaves(planned.name, column, planned.spec)]
        missing = [path for path, leaf, _, _ in leaves if isinstance(leaf, Const) and leaf.value is None]
        event = self._class(part.plan.tracepoint, part.plan.event, part.plan.marker is not None,
                            [(path, spec, name) for path, _, spec, name in leaves], bool(missing))
        if event.dtype is None or any(not isinstance(leaf, (Const, Ints)) for _, leaf, _, _ in leaves):
            return False
        rows = part.rows
        records = np.zeros(len(rows), dtype=event.dtype)
        records["id"] = event.number
        records["timestamp"] = np.maximum(batch.ns[rows], 0)
        records["frame"] = batch.number[rows]
        by_path = {path: leaf for path, leaf, _, _ in leaves}
        for index, (_, path, spec) in enumerate(event.columns):
            leaf = by_path[path]
            if isinstance(leaf, Ints):
                records[f"c{index}"] = leaf.values.astype(np.uint64).astype(_WIDTHS[spec[1]])
            elif isinstance(leaf.value, int):
                records[f"c{index}"] = leaf.value & ((1 << spec[1]) - 1)
        raw = records.view(np.uint8).reshape(len(rows), event.dtype.itemsize)
        if event.has_unavailable:
            names = {path: name for name, path, _ in event.columns}
            tail = np.frombuffer((" ".join(names[p] for p in missing)).encode() + b"\0", dtype=np.uint8)
            raw = np.concatenate([raw, np.broadcast_to(tail, (len(rows), len(tail)))], axis=1)
        blocks.append((rows, raw))
        return True

    def _event(self, frame, part: Decoded, fields: list[Field]) -> bytes:
        info = self.reader.tracepoint(frame)
        leaves = _leaves(fields)
        has_unavailable = any(value is None for value, _, _ in leaves.values())
        event = self._class(frame.tracepoint, part.plan.event, self.reader.marker(info) is not None,
                            [(path, spec, name) for path, (_, spec, name) in leaves.items()], has_unavailable)
        payload = bytearray(_HEAD.pack(event.number, max(frame.ns or 0, 0), frame.number))
        missing = []
        for name, path, spec in event.columns:
            value = leaves.get(path, (None,))[0]
            if value is None:
                missing.append(name)
            payload += _pack(spec, value)
        if event.has_unavailable:
            payload += " ".join(missing).encode() + b"\0"
        return bytes(payload)

    def _write(self, cpu: int, batch: FrameBatch, rows: np.ndarray, sizes: np.ndarray, events, blocks) -> None:
        stream = self.streams.get(cpu)
        if stream is None:
            stream = self.streams[cpu] = StreamWriter(self.directory, cpu, self.trace_uuid)
        lengths = sizes[rows]
        ends = np.cumsum(lengths)
        starts = ends - lengths
        whole = [records for block_rows, records in blocks if len(block_rows) == len(batch)]
        if whole:  # every frame of the batch in one class: its records, this CPU's in order
            out = whole[0][rows].reshape(-1)
        else:
            out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.uint8)
            position = np.full(len(batch), -1, dtype=np.int64)
            position[rows] = starts
            for block_rows, records in blocks:
                at = position[block_rows]
                keep = at >= 0
                if keep.any():
                    out[at[keep][:, None] + np.arange(records.shape[1])] = records[keep]
            for index, row in enumerate(rows.tolist()):
                if events[row] is not None:
                    out[starts[index] : ends[index]] = np.frombuffer(events[row], dtype=np.uint8)
        first = 0
        while first < len(rows):
            last = int(np.searchsorted(ends, starts[first] + _PACKET_CONTENT, side="right"))
            last = max(last, first + 1)
            ns = batch.ns[rows[first:last]]
            stream.packet(memoryview(out[starts[first] : ends[last - 1]]), last - first, max(int(ns[0]), 0),
                          max(int(ns[-1]), 0))
            first = last

    def finish(self) -> dict:
        for stream in self.streams.values():
            stream.close()
        write_metadata(self.directory, self._metadata())
        names = self._names()
        return {"events": self.writer.count, "cpus": sorted(self.streams),
                "classes": {names[e.tracepoint]: len(e.columns) for e in self.classes.values()}}

    def _names(self) -> dict[int, str]:
        """Each tracepoint's class name; two tracepoints on one function get distinct names."""
        used: dict[str, int] = {}
        names = {}
        for tracepoint, name in self.tracepoint_names.items():
            count = used.get(name, 0)
            used[name] = count + 1
            names[tracepoint] = f"{name}_tp{tracepoint}" if count else name
        return names

    def _metadata(self) -> str:
        run = self.run
        start_ns = (run.start_us or 0) * 1000
        env = {"hostname": "kgtp-sim", "domain": "kernel", "tracer_name": "kgtp-sim", "trace_origin": run.origin,
               "time_source": run.time_source, "cpu_source": run.cpu_source, "frames_missed": run.missed}
        clock = {"name": "trace_clock", "uuid": f'"{uuid.uuid5(self.trace_uuid, "clock")}"',
                 "description": "nanoseconds; the offset is tstart (wall clock)", "freq": 1_000_000_000,
                 "precision": 1, "offset_s": start_ns // 1_000_000_000, "offset": start_ns % 1_000_000_000,
                 "absolute": bool(run.start_us)}
        lines = preamble(self.trace_uuid, env, clock)
        lines += ["stream {", "\tid = 0;", "\tevent.header := struct {", "\t\tuint32_t id;",
                  "\t\tuint64_clock_t timestamp;", "\t};", *packet_context(), "};"]
        names = self._names()
        for event in self.classes.values():
            lines += ["", "event {", f'\tname = "{names[event.tracepoint]}";', f"\tid = {event.number};",
                      "\tstream_id = 0;", "\tfields := struct {", "\t\tuint64_t frame;"]
            for name, path, spec in event.columns:
                before, after = _tsdl_type(spec)
                lines.append(f"\t\t{before} {name}{after};  /* {comment(path)} */")
            if event.has_unavailable:
                lines.append("\t\tstring unavailable;  /* names of the fields this frame does not hold */")
            lines += ["\t};", "};"]
        return "\n".join(lines) + "\n"


def write_ctf(run: Run, reader: FrameReader, directory: Path, bulk: bool = True) -> dict:
    """Write the CTF trace; returns a summary (events, CPUs, classes)."""
    writer = CtfWriter(run, reader, directory, bulk)
    for batch in batches(run):
        writer.add(batch)
        writer.writer.count += len(batch)
    return writer.finish()


FORMATS = {"ctf": write_ctf, "chrome": write_chrome, "jsonl": write_jsonl}
