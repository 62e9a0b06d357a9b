"""`kgtp-sim record`: drain every CPU's trace buffer while GDB traces and write the frames as a CTF 1.8 trace.

The recorder is a consumer beside GDB's session, as LTTng's consumer daemon is beside a tracing session: it
asks the follow channel's drain for the frames (stub/stream.py, `"record": true`), which makes the stub's ring
GDB's flight recorder for the run (tracer.py, `attach_recorder`), and writes each CPU's frames to that CPU's
stream file as they come. No frame is decoded: a frame is written as the ring holds it, its 30-byte header
reordered for CTF readers (event header `id`, `timestamp`; event context `seq`, `entry_size`, `cpu`,
`frame_size`; view/batch.py's RECORDED) and its blocks after it, so a run of frames costs a few numpy
operations. Each (tracepoint, layout) (layout.py) is an event class named after the tracepoint, its fields named
after what the blocks hold: `regs_rax`..., a global's name and C type for the memory block that holds it, a
trace state variable's name, the marker's fields in `$_sdata`; a block's kind byte and header are fields too
(`regs_block = "R"`, `kgtp_counter_address`). The clock is the TSC, its offset tstart's wall-clock time.

Frames the ring overwrote before the recorder read them, and frames a failing write (a full disk) left out,
are counted in the next packet's `events_discarded` (babeltrace2 reports them); a packet is whole or absent,
and the metadata is replaced whole, so a recorder killed at any moment leaves a readable trace. The metadata
ends with a note (JSON in a comment) that lets `kgtp-sim export`, `plot` and `follow`'s reader (sources.py) read
the trace back as the stub would serve it.

Size limits as LTTng's `--tracefile-size` and `--tracefile-count`: `max_size` splits each CPU's stream into
files of at most that many bytes, `keep` keeps only the newest of them.

Runs in the caller's thread; the drain's socket is its only wait.
"""

from __future__ import annotations

import json
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..arch import amd64
from ..tracing.core.ring import BLOCKS_AT, PAD_CPU
from .batch import RECORDED, RING, FrameBatch, entries_at, entry_starts, read_uint
from .cexpr import FrameContext, evaluate
from .channel import ChannelError, messages
from .ctf import StreamWriter, comment, identifier, integer, packet_context, preamble, write_metadata
from .fields import FrameReader, split_arguments
from .layout import BlockAt, Layout, LayoutTable, show_returns
from .model import Run

#: A CPU's frames are written as a packet once this many bytes wait, or after FLUSH_SECONDS.
PACKET_BYTES = 1 << 20
FLUSH_SECONDS = 0.25
#: The ring header's 30 bytes in the order a recorded event holds them (batch.RECORDED): after the event class
#: (2 bytes, written apart), the stamp, the sequence, the entry's length, its CPU and the frame's size.
_ORDER = np.array([*range(8, 16), *range(16, 24), *range(0, 4), *range(4, 8), *range(26, 30)], dtype=np.int64)
_ALIGN = 8


@dataclass
class RecordedClass:
    """One event class: a tracepoint with one layout."""

    id: int
    tracepoint: int
    layout: Layout
    fields: list[str] = field(default_factory=list)  # TSDL lines


class Recorder:
    """Writes what the drain sends into `directory` (one run)."""

    def __init__(self, directory: Path, kernel: Path, max_size: int | None = None, keep: int | None = None) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.max_size, self.keep = max_size, keep
        self.trace_uuid = uuid.uuid4()
        self.run = Run(origin="recorded")
        self.reader = FrameReader.open(self.run, kernel)
        self.run_message: dict = {}
        self.origin, self.ticks_per_ns = 0, 1.0
        self.table = LayoutTable()
        self.classes: dict[int, RecordedClass] = {}  # table class index -> event class
        self._ids = np.zeros(0, dtype=np.uint16)
        self._taken_ids: set[int] = set()
        self.streams: dict[int, StreamWriter] = {}
        self.pending: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}  # cpu -> (event bytes, event starts)
        self.pending_bytes: dict[int, int] = {}
        self.flushed = time.monotonic()
        self.kret: dict[int, int] = {}
        self.started: float | None = None
        self.announced = False
        self.dirty = True

    # ---- what the drain sends

    def on_run(self, message: dict) -> None:
        self.run_message = {k: v for k, v in message.items() if k != "t"}
        self.run.apply_run_message(message)
        self.reader.run = self.run
        self.origin = message.get("tsc_origin", 0)
        self.ticks_per_ns = message.get("ticks_per_ns", 1.0)
        self.dirty = True
        self.write_metadata()

    def on_entries(self, message: dict) -> int:
        """Take one read's entries; returns the frames taken."""
        if self.started is None:
            self.started = time.monotonic()
        if message.get("kret"):
            self.kret.update({int(k): v for k, v in message["kret"].items()})
            self.dirty = True
        data = np.frombuffer(message["data"], dtype=np.uint8)  # writable: the channel reads into a bytearray
        taken, at = 0, 0
        for item in message["cpus"]:
            taken += self._take(item, data[at : at + item["bytes"]])
            at += item["bytes"]
        if self.dirty:
            self.write_metadata()
        if time.monotonic() - self.flushed >= FLUSH_SECONDS:
            self.flush()
        return taken

    def _take(self, item: dict, data: np.ndarray) -> int:
        cpu = item["cpu"]
        starts = entry_starts(data, 0, len(data), RING)
        pads = starts[read_uint(data, starts + 4, 4) == PAD_CPU]
        entries = entries_at(data, starts, RING)
        if item["lost"]:
            self._flush_cpu(cpu)  # the loss sits between two packets
            self._stream(cpu).discarded += item["lost"]
        frames = entries.starts
        if not len(frames):
            return 0
        batch = FrameBatch(data, frames + BLOCKS_AT, entries.size, entries.tracepoint, entries.cpu, entries.seq,
                           entries.stamp, entries.seq, entries.stamp)
        classes = self.table.classify(batch)
        for index in np.unique(classes).tolist():
            if index not in self.classes:
                self._new_class(index)
        if self.kret:
            show_returns(batch, self.table, self.kret)
            data = batch.data
        ids = self._ids[classes]
        reordered = data[frames[:, None] + _ORDER[None, :]]
        data[frames[:, None] + np.arange(2)] = ids.view(np.uint8).reshape(-1, 2)
        data[frames[:, None] + np.arange(2, BLOCKS_AT)] = reordered
        # the runs of frames between padding entries (at the ring's physical end), each written as it lies
        cuts = [0] + [int(x) for pad, length in zip(pads.tolist(), read_uint(data, pads, 4).tolist())
                      for x in (pad, pad + length)] + [len(data)]
        for low, high in zip(cuts[::2], cuts[1::2]):
            inside = frames[(frames >= low) & (frames < high)]
            if len(inside):
                self.pending.setdefault(cpu, []).append((data[low:high], inside - low))
                self.pending_bytes[cpu] = self.pending_bytes.get(cpu, 0) + high - low
        if self.pending_bytes.get(cpu, 0) >= PACKET_BYTES:
            self._flush_cpu(cpu)
        return len(frames)

    # ---- event classes

    def _new_class(self, index: int) -> None:
        tracepoint, layout = self.table.classes[index]
        number = tracepoint if tracepoint not in self._taken_ids else max(
            n for n in range(0xFFFF, -1, -1) if n not in self._taken_ids)
        self._taken_ids.add(number)
        recorded = RecordedClass(number, tracepoint, layout)
        recorded.fields = self._fields(tracepoint, layout)
        self.classes[index] = recorded
        if len(self._ids) <= index:
            self._ids = np.concatenate([self._ids, np.zeros(index + 1 - len(self._ids), dtype=np.uint16)])
        self._ids[index] = number
        self.dirty = True

    def _fields(self, tracepoint: int, layout: Layout) -> list[str]:
        """The TSDL fields of the blocks of `layout`, named after what they hold."""
        info = self.run.tracepoints.get(tracepoint)
        names = _Names()
        lines: list[str] = []
        known = self._memory_names(info) if info is not None else {}
        memory_number = 0
        for block in layout.blocks:
            if block.kind in "Rr":
                prefix = names.take("regs_block")
                lines.append(f"{integer(8, text=True)} {prefix}[1];")
                if block.kind == "r":
                    lines.append(f"{integer(32, base=16)} {names.take('regs_mask')};")
                lines += _registers(block, names)
            elif block.kind == "M":
                name, kind = known.get((block.address, block.length), (None, None))
                if name is None:
                    name, memory_number = f"mem{memory_number}", memory_number + 1
                base = names.take(identifier(name))
                lines.append(f"{integer(8, text=True)} {names.take(base + '_block')}[1];")
                lines.append(f"{integer(64, base=16)} {names.take(base + '_address')};")
                lines.append(f"{integer(16)} {names.take(base + '_length')};")
                data = f"{_typed(kind, block.length)} {base}{_suffix(kind, block.length)};"
                lines.append(f"{data}  /* {comment(name)} */")
            elif block.kind == "V":
                variable = self.run.variables.get(block.number, f"tsv{block.number}")
                base = names.take(identifier(variable))
                lines.append(f"{integer(8, text=True)} {names.take(base + '_block')}[1];")
                lines.append(f"{integer(32, signed=True)} {names.take(base + '_number')};")
                lines.append(f"{integer(64, signed=True)} {base};  /* ${comment(variable)} */")
            elif block.kind == "S":
                lines += self._static(info, block, names)
        return lines

    def _memory_names(self, info) -> dict[tuple[int, int], tuple[str, object]]:
        """(address, length) -> (collected text, C type) of the collect arguments that are one place in memory."""
        found = {}
        for line in info.collect_lines():
            for argument in split_arguments(line):
                text = argument.split(" ", 1)[1] if argument.startswith("/") else argument
                if text.startswith("$"):
                    continue
                context = FrameContext(self.reader.dwarf, info.address, None, lambda a, n: None, {})
                try:
                    value = evaluate(text, context)
                except Exception:  # noqa: BLE001 - anything the expression reader refuses has no fixed place
                    continue
                if value.address is not None and value.type.size:
                    found.setdefault((value.address, value.type.size), (text, value.type))
        return found

    def _static(self, info, block: BlockAt, names: _Names) -> list[str]:
        lines = [f"{integer(8, text=True)} {names.take('sdata_block')}[1];",
                 f"{integer(16)} {names.take('sdata_length')};"]
        marker = self.reader.marker(info) if info is not None else None
        cursor, pads = 0, 0
        for f in sorted(marker.fields, key=lambda f: f.offset) if marker is not None else ():
            if f.offset < cursor or f.offset + f.size > block.length:
                continue
            if f.offset > cursor:
                lines.append(f"uint8_t {names.take(f'sdata_pad{pads}')}[{f.offset - cursor}];")
                pads += 1
            name = names.take(identifier(f.name))
            if "[" in f.type:
                count = int(f.type.split("[", 1)[1].rstrip("]") or 0)
                text = f.type.split("[", 1)[0].strip() == "char"
                element = f.size // max(count, 1)
                lines.append(f"{integer(8 * element, f.signed, text=text)} {name}[{count}];")
            else:
                lines.append(f"{integer(8 * f.size, f.signed, 16 if '*' in f.type else 10)} {name};")
            cursor = f.offset + f.size
        if block.length > cursor:
            lines.append(f"uint8_t {names.take('sdata_rest' if cursor else 'sdata')}[{block.length - cursor}];")
        return lines

    # ---- packets

    def _stream(self, cpu: int) -> StreamWriter:
        stream = self.streams.get(cpu)
        if stream is None:
            stream = self.streams[cpu] = StreamWriter(self.directory, cpu, self.trace_uuid, self.max_size, self.keep,
                                                      align=_ALIGN)
        return stream

    def flush(self) -> None:
        for cpu in list(self.pending):
            self._flush_cpu(cpu)
        self.flushed = time.monotonic()

    def _flush_cpu(self, cpu: int) -> None:
        """Write a CPU's waiting frames as packets of at most PACKET_BYTES (a run of frames as it lies, without a
        copy; small runs joined first)."""
        pending = self.pending.pop(cpu, [])
        self.pending_bytes[cpu] = 0
        pieces, small = [], []
        for piece in pending + [None]:  # consecutive small reads joined: one packet rather than one each
            if piece is not None and len(piece[0]) < PACKET_BYTES // 16:
                small.append(piece)
                continue
            if len(small) > 1:
                bases = np.cumsum([0] + [len(d) for d, _ in small[:-1]])
                small = [(np.concatenate([d for d, _ in small]),
                          np.concatenate([s + b for (_, s), b in zip(small, bases)]))]
            pieces += small + ([piece] if piece is not None else [])
            small = []
        stream = self._stream(cpu)
        for data, starts in pieces:
            lengths = read_uint(data, starts + RECORDED.length, 4).astype(np.int64)
            ends = starts + lengths
            first = 0
            while first < len(starts):
                last = max(int(np.searchsorted(ends, starts[first] + PACKET_BYTES, side="right")), first + 1)
                size = int(read_uint(data, starts[last - 1 : last] + RECORDED.size, 4)[0])
                tail = int(lengths[last - 1]) - BLOCKS_AT - size
                stamps = read_uint(data, np.array([starts[first], starts[last - 1]]) + RECORDED.stamp, 8)
                stream.packet(memoryview(data[int(starts[first]) : int(ends[last - 1])]), last - first,
                              int(stamps[0]), int(stamps[1]), tail)
                first = last

    # ---- metadata

    def write_metadata(self) -> None:
        """The metadata as it stands: every class so far, and the note that reads the trace back."""
        run = self.run
        frequency = max(1, round(self.ticks_per_ns * 1e9))
        start_ns = (run.start_us or 0) * 1000 - round(self.origin / self.ticks_per_ns)
        env = {"hostname": "kgtp-sim", "domain": "kernel", "tracer_name": "kgtp-sim record",
               "trace_origin": "recorded"}
        clock = {"name": "tsc", "uuid": f'"{uuid.uuid5(self.trace_uuid, "tsc")}"',
                 "description": "the CPUs' TSC; at offset, tstart on the wall clock", "freq": frequency,
                 "precision": 1, "offset_s": start_ns // 1_000_000_000,
                 "offset": round(start_ns % 1_000_000_000 * self.ticks_per_ns), "absolute": bool(run.start_us)}
        lines = preamble(self.trace_uuid, env, clock)
        lines += ["stream {", "\tid = 0;", "\tevent.header := struct {", "\t\tuint16_t id;",
                  "\t\tuint64_clock_t timestamp;", "\t} align(64);", "\tevent.context := struct {",
                  "\t\tuint64_t seq;  /* the frame's sequence number on its CPU */",
                  "\t\tuint32_t entry_size;", "\t\tuint32_t cpu;", "\t\tuint32_t frame_size;", "\t};",
                  *packet_context(), "};"]
        names = self._event_names()
        for recorded in self.classes.values():
            lines += ["", "event {", f'\tname = "{names[recorded.tracepoint]}";', f"\tid = {recorded.id};",
                      "\tstream_id = 0;", "\tfields := struct {"]
            lines += [f"\t\t{line}" for line in recorded.fields]
            lines += ["\t};", "};"]
        note = {"run": self.run_message, "tsc_origin": self.origin, "ticks_per_ns": self.ticks_per_ns,
                "classes": {str(c.id): c.tracepoint for c in self.classes.values()},
                "kret": {str(k): v for k, v in self.kret.items()}}
        lines += ["", "/* kgtp-sim recording: " + json.dumps(note).replace("*/", "*\\/") + " */"]
        try:
            write_metadata(self.directory, "\n".join(lines) + "\n")
            self.dirty = False
        except OSError as error:
            print(f"kgtp-sim record: cannot write the metadata: {error.strerror or error}", file=sys.stderr)

    def _event_names(self) -> dict[int, str]:
        names, used = {}, {}
        for recorded in self.classes.values():
            if recorded.tracepoint in names:
                continue
            info = self.run.tracepoints.get(recorded.tracepoint)
            marker = self.reader.marker(info) if info is not None else None
            name = marker.name if marker is not None else self.reader.event_name(info) if info is not None \
                else f"tp{recorded.tracepoint}"
            count = used.get(name, 0)
            used[name] = count + 1
            names[recorded.tracepoint] = f"{name}_tp{recorded.tracepoint}" if count else name
        return names

    def close(self) -> None:
        self.flush()
        for stream in self.streams.values():
            if stream.discarded > stream.reported:  # frames lost after the stream's last packet
                stream.empty_packet(stream.last_end, 0)
            stream.close()
        self.write_metadata()

    @property
    def recorded(self) -> int:
        return sum(s.written for s in self.streams.values())

    @property
    def lost(self) -> int:
        return sum(s.discarded for s in self.streams.values())

    def failures(self) -> list[str]:
        return sorted({s.error for s in self.streams.values() if s.error})


class _Names:
    """Field names of one event class, each used once."""

    def __init__(self) -> None:
        self.taken: set[str] = set()

    def take(self, name: str) -> str:
        base, count = name, 2
        while name in self.taken:
            name = f"{base}_{count}"
            count += 1
        self.taken.add(name)
        return name


def _registers(block: BlockAt, names: _Names) -> list[str]:
    """The TSDL fields of a register block's registers, in order: a `g` block's general registers then its x87
    state as one text field, or a compact block's registers (8 bytes each)."""
    if block.kind == "R":
        general = amd64.GENERAL_REGISTERS
        rest = amd64.G_PACKET_SIZE - sum(reg.size for reg in general)
        return [f"{integer(8 * reg.size, base=16)} {names.take('regs_' + reg.name)};" for reg in general] + [
            f"{integer(8, text=True)} {names.take('regs_x87')}[{rest}];  /* st0-st7, fctrl-fop */"]
    present = [reg for index, reg in enumerate(amd64.GENERAL_REGISTERS) if block.mask >> index & 1]
    return [f"{integer(64, base=16)} {names.take('regs_' + reg.name)};" for reg in present]


def _typed(kind, length: int) -> str:
    """The TSDL type of a memory block's data: the collected value's C type when it is a number, a string or an
    array of numbers; else bytes."""
    if kind is not None and kind.size == length:
        if kind.scalar and kind.size in (1, 2, 4, 8):
            return integer(8 * kind.size, kind.signed, 16 if kind.kind == "pointer" else 10)
        target = kind.target
        if kind.kind == "array" and target is not None and target.size in (1, 2, 4, 8) and target.scalar:
            return integer(8 * target.size, target.signed and not target.char, text=target.char)
    return "uint8_t"


def _suffix(kind, length: int) -> str:
    if kind is not None and kind.size == length:
        if kind.scalar and kind.size in (1, 2, 4, 8):
            return ""
        target = kind.target
        if kind.kind == "array" and target is not None and target.size in (1, 2, 4, 8) and target.scalar:
            return f"[{length // target.size}]"
    return f"[{length}]"


def record(host: str, port: int, directory: Path, kernel: Path, max_size: int | None = None,
           keep: int | None = None, count: int | None = None, quiet: bool = False) -> int:
    """Record one run into `directory`: the run running now, or the next one GDB starts."""
    if directory.exists() and (any(directory.glob("channel0_*")) or (directory / "metadata").exists()):
        print(f"kgtp-sim record: {directory} already holds a trace: give a new directory", file=sys.stderr)
        return 2
    directory.mkdir(parents=True, exist_ok=True)
    recorder = Recorder(directory, kernel, max_size, keep)
    stopped: list[str] = []
    taken = 0

    def terminate(signum, frame) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminate)
    answered = False
    try:
        request = {"op": "stream", "from": "start", "until": "stop", "record": True}
        for message in messages(host, port, request, raw=True):
            answered = True
            kind = message["t"]
            if kind == "run":
                recorder.on_run(message)
                if not quiet and not recorder.announced:
                    recorder.announced = True
                    state = "recording the run" if message.get("running") else "waiting for tstart"
                    print(f"kgtp-sim record: {state} into {directory}", file=sys.stderr, flush=True)
            elif kind == "entries":
                taken += recorder.on_entries(message)
                if count is not None and taken >= count:
                    stopped.append(f"{count} frames")
                    break
            elif kind == "stopped":
                stopped.append(f"the run stopped ({message['reason']})")
            elif kind == "end":
                break
        else:
            stopped.append("the stub closed the follow channel")
    except KeyboardInterrupt:
        stopped.append("interrupted")
    except (ChannelError, OSError) as error:
        if not answered:
            print(f"kgtp-sim: {error}", file=sys.stderr)
            return 1
        stopped.append(f"the connection ended: {error}")
    finally:
        signal.signal(signal.SIGTERM, previous)
        recorder.close()
    elapsed = max(time.monotonic() - (recorder.started or time.monotonic()), 1e-9)
    recorded, lost = recorder.recorded, recorder.lost
    print(f"kgtp-sim record: {recorded} frames in {directory} ({recorded / elapsed:.0f}/s), {lost} lost"
          + (f" ({', '.join(recorder.failures())})" if recorder.failures() else "")
          + (f"; {stopped[0]}" if stopped else ""), file=sys.stderr, flush=True)
    return 0


__all__ = ["Recorder", "record"]
