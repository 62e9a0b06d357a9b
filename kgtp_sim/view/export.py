"""`kgtp-sim export`: a run's frames as CTF 1.8 (LTTng's style), Chrome trace-event JSON, or JSON lines.

Every writer takes the same input: a `Run` (from a running stub through the follow channel, or from a tsave'd
file) and a `FrameReader` that names and types each frame's collected values with the kernel's DWARF.

CTF: a directory with `metadata` (TSDL) and one stream file per CPU (`channel0_<cpu>`), as LTTng lays out a
kernel trace. One event class per tracepoint (a static tracepoint's class is named after its marker), with the
fields of its `collect` actions: a C expression's field is named after its text (`(2*counter1+3*counter2)`
becomes `x2_counter1_3_counter2`, the metadata comments give the mapping), `$regs` gives `regs_rax` ...,
`$args`/`$locals` give `args_<name>`/`locals_<name>`, `$_sdata` the marker's TP_STRUCT fields under their own
names and C types. Every event carries `frame` (GDB's frame number, for tfind) and, in its packet context, the
CPU it ran on; its timestamp is nanoseconds on a clock whose origin is tstart. A value the frame does not hold
is written as 0 (or "") and named in the event's `unavailable` field.

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

from .fields import Field, FrameReader, flatten
from .model import Run

CTF_MAGIC = 0xC1FC1FC1
_KEYWORDS = {"align", "callsite", "const", "char", "clock", "double", "enum", "env", "event", "floating_point",
             "float", "integer", "int", "long", "short", "signed", "stream", "string", "struct", "trace",
             "typealias", "typedef", "unsigned", "variant", "void", "_Bool", "_Complex", "_Imaginary", "id", "name"}
UNKNOWN_CPU = 0xFFFFFFFF
_PACKET_CONTENT = 256 * 1024


def identifier(text: str) -> str:
    """A TSDL identifier for a source text: `(2*counter1+3*counter2)` -> `x2_counter1_3_counter2`."""
    name = re.sub(r"[^A-Za-z0-9]+", "_", text.replace("->", "_").replace("$", "")).strip("_") or "expr"
    if name[0].isdigit():
        name = "x" + name
    if name in _KEYWORDS:
        name += "_"
    return name


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


class EventClass:
    def __init__(self, number: int, name: str, static_event: bool) -> None:
        self.number = number
        self.name = name
        self.static = static_event
        self.columns: list[tuple[str, str, tuple]] = []  # (TSDL name, source path, spec)
        self._taken = {"frame", "unavailable"}
        self.has_unavailable = False

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


def write_ctf(run: Run, reader: FrameReader, directory: Path) -> dict:
    """Write the CTF trace; returns a summary (events per CPU, classes)."""
    directory.mkdir(parents=True, exist_ok=True)
    classes: dict[int, EventClass] = {}
    rows = []
    for frame in run.frames:
        info = reader.tracepoint(frame)
        event = classes.get(frame.tracepoint)
        if event is None:
            event = classes[frame.tracepoint] = EventClass(len(classes), reader.event_name(info),
                                                           reader.marker(info) is not None)
        fields = reader.fields(frame)
        leaves = _leaves(fields)
        for path, (value, spec, field_name) in leaves.items():
            event.column(field_name, path, spec)
        if any(value is None for value, _, _ in leaves.values()):
            event.has_unavailable = True
        rows.append((frame, event, leaves))
    names_used: dict[str, int] = {}
    for event in classes.values():  # two tracepoints on one function: distinct class names
        count = names_used.get(event.name, 0)
        names_used[event.name] = count + 1
        if count:
            event.name = f"{event.name}_tp{event.number}"

    trace_uuid = uuid.uuid4()
    streams: dict[int, list[bytes]] = {}
    times: dict[int, list[int]] = {}
    for frame, event, leaves in rows:
        cpu = UNKNOWN_CPU if frame.cpu is None else frame.cpu
        payload = bytearray(struct.pack("<IQ", event.number, max(frame.ns or 0, 0)))
        payload += struct.pack("<Q", frame.number)
        missing = []
        for name, path, spec in event.columns:
            value = leaves.get(path, (None,))[0]
            if value is None:
                missing.append(name)
            payload += _pack(spec, value)
        if event.has_unavailable:
            payload += " ".join(missing).encode() + b"\0"
        streams.setdefault(cpu, []).append(bytes(payload))
        times.setdefault(cpu, []).append(max(frame.ns or 0, 0))
    for cpu, events in streams.items():
        _write_stream(directory / f"channel0_{cpu if cpu != UNKNOWN_CPU else 'unknown'}", trace_uuid, cpu, events,
                      times[cpu])
    (directory / "metadata").write_text(_metadata(run, classes.values(), trace_uuid))
    return {"events": len(rows), "cpus": sorted(streams), "classes": {e.name: len(e.columns) for e in classes.values()}}


_HEADER = struct.Struct("<I16sIQ")  # magic, uuid, stream_id, stream_instance_id
_CONTEXT = struct.Struct("<QQQQQQI")  # timestamp_begin, timestamp_end, content_size, packet_size, seq, discarded, cpu


def _write_stream(path: Path, trace_uuid: uuid.UUID, cpu: int, events: list[bytes], stamps: list[int]) -> None:
    order = sorted(range(len(events)), key=lambda i: stamps[i])  # a stream's events in time order
    packets: list[list[int]] = [[]]
    size = 0
    for index in order:
        if packets[-1] and size + len(events[index]) > _PACKET_CONTENT:
            packets.append([])
            size = 0
        packets[-1].append(index)
        size += len(events[index])
    with open(path, "wb") as out:
        for sequence, packet in enumerate(packets):
            body = b"".join(events[i] for i in packet)
            header_size = _HEADER.size + _CONTEXT.size
            total = header_size + len(body)
            begin = stamps[packet[0]] if packet else 0
            end = stamps[packet[-1]] if packet else 0
            out.write(_HEADER.pack(CTF_MAGIC, trace_uuid.bytes, 0, cpu))
            out.write(_CONTEXT.pack(begin, end, total * 8, total * 8, sequence, 0, cpu))
            out.write(body)


def _metadata(run: Run, classes, trace_uuid: uuid.UUID) -> str:
    start_ns = (run.start_us or 0) * 1000
    lines = [
        "/* CTF 1.8 */",
        "",
        "typealias integer { size = 8; align = 8; signed = false; } := uint8_t;",
        "typealias integer { size = 32; align = 8; signed = false; } := uint32_t;",
        "typealias integer { size = 64; align = 8; signed = false; } := uint64_t;",
        "",
        "trace {",
        "\tmajor = 1;",
        "\tminor = 8;",
        f'\tuuid = "{trace_uuid}";',
        "\tbyte_order = le;",
        "\tpacket.header := struct {",
        "\t\tuint32_t magic;",
        "\t\tuint8_t uuid[16];",
        "\t\tuint32_t stream_id;",
        "\t\tuint64_t stream_instance_id;",
        "\t};",
        "};",
        "",
        "env {",
        '\thostname = "kgtp-sim";',
        '\tdomain = "kernel";',
        '\ttracer_name = "kgtp-sim";',
        f'\ttrace_origin = "{run.origin}";',
        f'\ttime_source = "{run.time_source}";',
        f'\tcpu_source = "{run.cpu_source}";',
        f"\tframes_missed = {run.missed};",
        "};",
        "",
        "clock {",
        '\tname = "trace_clock";',
        f'\tuuid = "{uuid.uuid5(trace_uuid, "clock")}";',
        '\tdescription = "nanoseconds; the offset is tstart (wall clock)";',
        "\tfreq = 1000000000;",
        "\tprecision = 1;",
        f"\toffset_s = {start_ns // 1_000_000_000};",
        f"\toffset = {start_ns % 1_000_000_000};",
        f"\tabsolute = {'true' if run.start_us else 'false'};",
        "};",
        "",
        "typealias integer { size = 64; align = 8; signed = false; map = clock.trace_clock.value; } := uint64_clock_t;",
        "",
        "stream {",
        "\tid = 0;",
        "\tevent.header := struct {",
        "\t\tuint32_t id;",
        "\t\tuint64_clock_t timestamp;",
        "\t};",
        "\tpacket.context := struct {",
        "\t\tuint64_clock_t timestamp_begin;",
        "\t\tuint64_clock_t timestamp_end;",
        "\t\tuint64_t content_size;",
        "\t\tuint64_t packet_size;",
        "\t\tuint64_t packet_seq_num;",
        "\t\tuint64_t events_discarded;",
        "\t\tuint32_t cpu_id;",
        "\t};",
        "};",
    ]
    for event in classes:
        lines += ["", "event {", f'\tname = "{event.name}";', f"\tid = {event.number};", "\tstream_id = 0;",
                  "\tfields := struct {", "\t\tuint64_t frame;"]
        for name, path, spec in event.columns:
            before, after = _tsdl_type(spec)
            comment = path.replace("*/", "* /")
            lines.append(f"\t\t{before} {name}{after};  /* {comment} */")
        if event.has_unavailable:
            lines.append("\t\tstring unavailable;  /* names of the fields this frame does not hold */")
        lines += ["\t};", "};"]
    return "\n".join(lines) + "\n"


# ---- Chrome trace events and JSON lines ---------------------------------------------------------------------------

def frame_record(reader: FrameReader, frame) -> dict:
    info = reader.tracepoint(frame)
    marker = reader.marker(info)
    fields = reader.fields(frame)
    record = {
        "frame": frame.number,
        "seq": frame.seq,
        "tracepoint": frame.tracepoint,
        "event": reader.event_name(info),
        "location": info.location,
        "marker": marker.id if marker is not None else None,
        "cpu": frame.cpu,
        "time_ns": frame.ns,
        "fields": {f.name: f.value for f in fields},
    }
    unavailable = {f.name: f.error for f in fields if f.value is None}
    if unavailable:
        record["unavailable"] = unavailable
    if frame.sdata is not None:
        record["sdata"] = frame.sdata
    return record


def write_jsonl(run: Run, reader: FrameReader, path: Path) -> dict:
    with open(path, "w") as out:
        for frame in run.frames:
            out.write(json.dumps(frame_record(reader, frame)) + "\n")
    return {"events": len(run.frames)}


def write_chrome(run: Run, reader: FrameReader, path: Path) -> dict:
    pid = 1
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": "kgtp-sim kernel"}}]
    cpus = sorted({f.cpu for f in run.frames}, key=lambda c: (c is None, c or 0))
    for cpu in cpus:
        tid = cpu if cpu is not None else 9999
        label = f"CPU {cpu}" if cpu is not None else "CPU unknown"
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    for frame in run.frames:
        record = frame_record(reader, frame)
        args = {"frame": frame.number, "seq": frame.seq, "tracepoint": frame.tracepoint, **record["fields"]}
        if "sdata" in record:
            args["$_sdata (TP_printk)"] = record["sdata"]
        events.append({
            "ph": "i", "s": "t", "name": record["event"], "cat": f"tp{frame.tracepoint}", "pid": pid,
            "tid": frame.cpu if frame.cpu is not None else 9999, "ts": (frame.ns or 0) / 1000, "args": args,
        })
    document = {
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "otherData": {"tracer": "kgtp-sim", "origin": run.origin, "time_source": run.time_source,
                      "cpu_source": run.cpu_source, "tstart_us": run.start_us, "frames_missed": run.missed},
    }
    path.write_text(json.dumps(document))
    return {"events": len(run.frames), "cpus": cpus}


FORMATS = {"ctf": write_ctf, "chrome": write_chrome, "jsonl": write_jsonl}
