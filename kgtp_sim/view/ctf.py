"""CTF 1.8 on disk, as LTTng writes a kernel trace: per-CPU stream files of packets, and the TSDL metadata.

Shared by `kgtp-sim export --format ctf` (export.py: named, evaluated fields) and `kgtp-sim record`
(record.py: frames as the ring holds them, with their fields named). A stream file (`channel0_<cpu>`, or
`channel0_<cpu>_<n>` when split at a size as LTTng's `--tracefile-size` does) is a sequence of packets: the
packet header (magic, trace UUID, stream class, the CPU as stream instance), the packet context
(`timestamp_begin`, `timestamp_end`, `content_size`, `packet_size`, `packet_seq_num`, `events_discarded`,
`cpu_id`) and events. `events_discarded` is LTTng's free-running count: every event of the stream lost so far,
so a reader (babeltrace2) reports the difference between two packets as discarded between them.

A packet is written with one `write` and is either whole in the file or absent: a write that fails (a full disk)
is cut back off the file and its events counted as discarded in the next packet that is written. The metadata
file is replaced whole (written beside it, then renamed), so a reader never sees half of it.

`read_packets` reads a stream file's packets back (the recorded-trace reader, sources.py). Runs in the
caller's thread.
"""

from __future__ import annotations

import errno
import os
import re
import struct
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .model import TraceFormatError

CTF_MAGIC = 0xC1FC1FC1
PACKET_HEADER = struct.Struct("<I16sIQ")  # magic, uuid, stream_id, stream_instance_id (the CPU)
PACKET_CONTEXT = struct.Struct("<QQQQQQI")  # timestamp_begin, _end, content_size, packet_size, seq, discarded, cpu
PACKET_START = PACKET_HEADER.size + PACKET_CONTEXT.size
UNKNOWN_CPU = 0xFFFFFFFF
STREAM_PREFIX = "channel0_"


def stream_name(cpu: int, part: int | None = None) -> str:
    name = STREAM_PREFIX + (str(cpu) if cpu != UNKNOWN_CPU else "unknown")
    return name if part is None else f"{name}_{part}"


@dataclass
class StreamWriter:
    """One CPU's stream: packets appended to its file; with `max_size`, a new file when the next packet would
    pass it (never smaller than one packet), the oldest deleted beyond `keep` files (LTTng's
    `--tracefile-size` and `--tracefile-count`)."""

    directory: Path
    cpu: int
    trace_uuid: uuid.UUID
    max_size: int | None = None
    keep: int | None = None
    #: first event's offset in a packet, aligned as the stream's event header is (babeltrace2 aligns it too)
    align: int = 1
    sequence: int = 0
    discarded: int = 0  #: events lost in this stream so far (what the next packet says)
    written: int = 0  #: events written
    failed: int = 0  #: packets a failing write left out
    reported: int = 0  #: the events_discarded of the last packet written
    last_end: int = 0  #: the timestamp_end of the last packet written
    error: str | None = None
    _fd: int | None = field(default=None, repr=False)
    _part: int = 0
    _size: int = 0
    _parts: list[Path] = field(default_factory=list)

    def _path(self) -> Path:
        return self.directory / stream_name(self.cpu, self._part if self.max_size else None)

    def _open(self) -> None:
        path = self._path()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self._size = os.fstat(self._fd).st_size
        self._parts.append(path)

    def packet(self, events: bytes | memoryview, count: int, begin: int, end: int, tail: int = 0,
               lost: int = 0) -> bool:
        """Write one packet of `count` events (their bytes back to back; the last `tail` bytes are the last
        event's padding, outside the content), `lost` events discarded just before them. False when the write
        failed (its events are then counted as discarded)."""
        self.discarded += lost
        start = -(-PACKET_START // self.align) * self.align
        events = memoryview(events).cast("B")
        total = start + len(events)
        header = PACKET_HEADER.pack(CTF_MAGIC, self.trace_uuid.bytes, 0, self.cpu)
        context = PACKET_CONTEXT.pack(begin, end, (total - tail) * 8, total * 8, self.sequence, self.discarded,
                                      self.cpu)
        head = header + context + bytes(start - PACKET_START)
        before = self._size
        try:
            if self._fd is None:
                self._open()
                before = self._size
            elif self.max_size and self._size and self._size + total > self.max_size:
                self._rotate()
                before = self._size
            written = os.writev(self._fd, [head, events])
            while written < total:  # a short write: the rest, from where it stopped
                rest = (head + events.tobytes())[written:] if written < len(head) else events[written - len(head):]
                written += os.write(self._fd, rest)
        except OSError as error:
            if self._fd is not None:
                self._cut(before)
            self.failed += 1
            self.discarded += count
            self.error = os.strerror(error.errno) if error.errno else str(error)
            return False
        self._size += total
        self.sequence += 1
        self.written += count
        self.reported, self.last_end = self.discarded, end
        return True

    def empty_packet(self, at: int, lost: int) -> bool:
        """A packet with no event that carries `lost` newly discarded events (a stream whose frames were all
        lost since its last packet)."""
        return self.packet(b"", 0, at, at, lost=lost)

    def _cut(self, size: int) -> None:
        try:
            os.ftruncate(self._fd, size)
        except OSError:
            pass

    def _rotate(self) -> None:
        os.close(self._fd)
        self._part += 1
        self._open()
        if self.keep is not None:
            while len(self._parts) > self.keep:
                oldest = self._parts.pop(0)
                try:
                    oldest.unlink()
                except OSError:
                    pass

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def write_metadata(directory: Path, text: str) -> None:
    """Replace `metadata` whole: written beside it, then renamed over it."""
    temporary = directory / ".metadata.tmp"
    temporary.write_text(text)
    os.replace(temporary, directory / "metadata")


def disk_full(error: OSError) -> bool:
    return error.errno in (errno.ENOSPC, errno.EDQUOT)


# ---- TSDL -----------------------------------------------------------------------------------------------------

_KEYWORDS = {"align", "callsite", "const", "char", "clock", "double", "enum", "env", "event", "floating_point",
             "float", "integer", "int", "long", "short", "signed", "stream", "string", "struct", "trace",
             "typealias", "typedef", "unsigned", "variant", "void", "_Bool", "_Complex", "_Imaginary", "id", "name"}


def identifier(text: str) -> str:
    """A TSDL identifier for a source text: `(2*counter1+3*counter2)` -> `x2_counter1_3_counter2`."""
    name = re.sub(r"[^A-Za-z0-9]+", "_", text.replace("->", "_").replace("$", "")).strip("_") or "expr"
    if name[0].isdigit():
        name = "x" + name
    if name in _KEYWORDS:
        name += "_"
    return name


def integer(bits: int, signed: bool = False, base: int = 10, text: bool = False) -> str:
    encoding = " encoding = ASCII;" if text else ""
    return (f"integer {{ size = {bits}; align = 8; signed = {'true' if signed else 'false'}; base = {base};"
            f"{encoding} }}")


def comment(text: str) -> str:
    return text.replace("*/", "* /")


def preamble(trace_uuid: uuid.UUID, env: dict[str, object], clock: dict[str, object]) -> list[str]:
    """The metadata up to the stream: type aliases, the trace (its packet header), env and the clock."""
    lines = [
        "/* CTF 1.8 */",
        "",
        "typealias integer { size = 8; align = 8; signed = false; } := uint8_t;",
        "typealias integer { size = 16; align = 8; signed = false; } := uint16_t;",
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
    ]
    for key, value in env.items():
        lines.append(f'\t{key} = "{value}";' if isinstance(value, str) else f"\t{key} = {value};")
    lines += ["};", "", "clock {"]
    for key, value in clock.items():
        if key == "description":
            lines.append(f'\t{key} = "{value}";')
        elif isinstance(value, bool):
            lines.append(f"\t{key} = {'true' if value else 'false'};")
        else:
            lines.append(f"\t{key} = {value};")
    lines += ["};", "", f"typealias integer {{ size = 64; align = 8; signed = false; map = clock.{clock['name']}"
              f".value; }} := uint64_clock_t;", ""]
    return lines


def packet_context() -> list[str]:
    return [
        "\tpacket.context := struct {",
        "\t\tuint64_clock_t timestamp_begin;",
        "\t\tuint64_clock_t timestamp_end;",
        "\t\tuint64_t content_size;",
        "\t\tuint64_t packet_size;",
        "\t\tuint64_t packet_seq_num;",
        "\t\tuint64_t events_discarded;",
        "\t\tuint32_t cpu_id;",
        "\t};",
    ]


def clock_offset(start_ns: int) -> dict[str, int]:
    return {"offset_s": start_ns // 1_000_000_000, "offset": start_ns % 1_000_000_000}


# ---- reading stream files back -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Packet:
    cpu: int
    begin: int
    end: int
    sequence: int
    discarded: int  #: the stream's events lost up to this packet's end
    content: bytes  #: the events: from the packet's first event to its content end, rounded up to `align`


def read_packets(path: Path, align: int = 1) -> Iterator[Packet]:
    """The packets of a stream file, in order, one read each; a packet the file cuts short ends the reading (a
    recorder that died mid-write leaves none: packets are whole or absent)."""
    with open(path, "rb") as handle:
        offset = 0
        while True:
            start = handle.read(PACKET_START)
            if len(start) < PACKET_START:
                return
            magic, _, _, _ = PACKET_HEADER.unpack_from(start)
            if magic != CTF_MAGIC:
                raise TraceFormatError(f"{path}: no CTF packet at offset {offset}")
            begin, end, content, size, sequence, discarded, cpu = PACKET_CONTEXT.unpack_from(start, PACKET_HEADER.size)
            size //= 8
            if size < PACKET_START or content // 8 > size:
                raise TraceFormatError(f"{path}: corrupt packet context at offset {offset}")
            rest = handle.read(size - PACKET_START)
            if len(rest) < size - PACKET_START:
                return
            first = -(-PACKET_START // align) * align - PACKET_START
            stop = min(size, -(-(content // 8) // align) * align) - PACKET_START
            yield Packet(cpu, begin, end, sequence, discarded, rest[first:stop] if first or stop < len(rest) else rest)
            offset += size


def stream_files(directory: Path) -> dict[int, list[Path]]:
    """cpu -> its stream files in order (`channel0_<cpu>`, or its parts `channel0_<cpu>_<n>` by n)."""
    found: dict[int, list[tuple[int, Path]]] = {}
    for path in directory.iterdir():
        match = re.fullmatch(re.escape(STREAM_PREFIX) + r"(\d+|unknown)(?:_(\d+))?", path.name)
        if match is None or not path.is_file():
            continue
        cpu = UNKNOWN_CPU if match.group(1) == "unknown" else int(match.group(1))
        found.setdefault(cpu, []).append((int(match.group(2) or 0), path))
    return {cpu: [p for _, p in sorted(parts)] for cpu, parts in sorted(found.items())}
