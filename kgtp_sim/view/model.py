"""A trace run as the viewers see it: definitions and frames, loaded from a running stub or from a tfile.

From a running stub the run comes through the read-only follow channel (`channel.py`): every frame with its
sequence number, CPU, time since tstart and `$_sdata`. From a file `tsave` wrote, the frames carry what GDB's
trace-file format holds (registers, memory, trace state variables); the CPU and the time then come from the
frame's `$cpu_id` and `$clock` variables when it collected them, and are otherwise unknown (CPU None, the frame's
position as its time). A trace too long to hold is read a piece at a time (`Run.stream`, sources.py). Pure data
and parsing: any thread.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..arch import amd64

_FRAME = struct.Struct("<HI")
_MEMORY = struct.Struct("<QH")
_TSV = struct.Struct("<iq")
_MASK = struct.Struct("<I")


class TraceFormatError(ValueError):
    """Bytes that are not a trace file or a frame this reader knows."""


@dataclass(frozen=True)
class Blocks:
    """The blocks of one frame, parsed."""

    registers: dict[str, int] | None
    memory: tuple[tuple[int, bytes], ...]
    variables: dict[int, int]
    static: bytes | None

    def read(self, address: int, length: int) -> bytes | None:
        """`length` bytes at `address` from the frame's memory blocks (pieced together), or None."""
        out = bytearray()
        cursor, end = address, address + length
        while cursor < end:
            for start, data in self.memory:
                if start <= cursor < start + len(data):
                    piece = data[cursor - start : end - start]
                    out += piece
                    cursor += len(piece)
                    break
            else:
                return None
        return bytes(out)


def _compact_registers(body: bytes, position: int) -> tuple[dict[str, int], int]:
    """A compact register block (tracing/core/frames.py: u32 mask, u64 per register of the mask) read as GDB
    reads it once widened to `R` (`TraceFrame.to_gdb`): the registers it holds, zero for the others."""
    (mask,) = _MASK.unpack_from(body, position)
    present = [reg for index, reg in enumerate(amd64.GENERAL_REGISTERS) if mask >> index & 1]
    if mask >> len(amd64.GENERAL_REGISTERS):
        raise TraceFormatError(f"compact register block with mask {mask:#x}")
    start = position + _MASK.size
    end = start + 8 * len(present)
    if end > len(body):
        raise TraceFormatError("truncated compact register block")
    values = struct.unpack_from(f"<{len(present)}Q", body, start)
    registers = {reg.name: 0 for reg in amd64.REGISTERS}
    registers.update({reg.name: value & ((1 << 8 * reg.size) - 1) for reg, value in zip(present, values)})
    return registers, end


def parse_blocks(body: bytes) -> Blocks:
    registers = None
    memory: list[tuple[int, bytes]] = []
    variables: dict[int, int] = {}
    static = None
    position = 0
    try:
        while position < len(body):
            kind = body[position : position + 1]
            position += 1
            if kind == b"R":
                end = position + amd64.G_PACKET_SIZE
                if end > len(body):
                    raise TraceFormatError("truncated register block")
                registers = amd64.decode_registers(body[position:end])
            elif kind == b"r":  # the ring's compact registers (the drain sends them as the ring holds them)
                registers, end = _compact_registers(body, position)
            elif kind == b"M":
                address, length = _MEMORY.unpack_from(body, position)
                start = position + _MEMORY.size
                end = start + length
                memory.append((address, body[start:end]))
            elif kind == b"V":
                number, value = _TSV.unpack_from(body, position)
                variables[number] = value
                end = position + _TSV.size
            elif kind == b"S":
                (length,) = struct.unpack_from("<H", body, position)
                start = position + 2
                end = start + length
                static = body[start:end]
            else:
                raise TraceFormatError(f"unknown block {kind!r} at offset {position - 1}")
            position = end
    except struct.error:
        raise TraceFormatError("truncated block") from None
    return Blocks(registers, tuple(memory), variables, static)


@dataclass(frozen=True)
class Source:
    kind: str  # at, cond, cmd
    text: str


@dataclass
class TracepointInfo:
    number: int
    address: int
    static: bool = False
    marker: str | None = None  # system::name of a static tracepoint's marker
    enabled: bool = True
    sources: list[Source] = field(default_factory=list)

    @property
    def location(self) -> str:
        return next((s.text for s in self.sources if s.kind == "at"), f"*{self.address:#x}")

    def collect_lines(self) -> list[str]:
        """The `collect` actions' arguments, in order (while-stepping actions are left out: their frames have
        no tracepoint PC to evaluate at)."""
        found, stepping = [], False
        for source in self.sources:
            if source.kind != "cmd":
                continue
            text = source.text.strip()
            if text.startswith("while-stepping") or text.startswith("stepping") or text.startswith("ws"):
                stepping = True
            elif text == "end":
                stepping = False
            elif not stepping and text.startswith("collect"):
                found.append(text)
        return found


@dataclass
class Frame:
    seq: int
    number: int
    tracepoint: int
    cpu: int | None
    ns: int | None  # since tstart
    raw: bytes  # the frame's blocks (without GDB's 6-byte frame header)
    sdata: str | None = None

    @property
    def blocks(self) -> Blocks:
        cached = self.__dict__.get("_blocks")
        if cached is None:
            cached = parse_blocks(self.raw)
            self.__dict__["_blocks"] = cached
        return cached


@dataclass
class Run:
    tracepoints: dict[int, TracepointInfo] = field(default_factory=dict)
    variables: dict[int, str] = field(default_factory=dict)  # trace state variable number -> name
    frames: list[Frame] = field(default_factory=list)
    start_us: int | None = None  # tstart, wall clock (µs since the epoch)
    origin: str = "live"  # live: from a running stub; tfile: from a saved file; recorded: kgtp-sim record
    time_source: str = "tsc"  # tsc, $clock, or frame-order
    cpu_source: str = "frame"  # frame, $cpu_id, or unknown
    missed: int = 0
    #: a trace read a piece at a time: a callable giving its frames as batches (view/sources.py); the frames
    #: are then not in `frames`, and `missed` is known once they have all been read
    stream: object = field(default=None, repr=False, compare=False)

    def apply_run_message(self, message: dict) -> None:
        self.start_us = message.get("start_us")
        self.tracepoints = {}
        for item in message.get("tracepoints", []):
            self.tracepoints.setdefault(item["number"], TracepointInfo(
                item["number"], item["address"], item.get("static", False), item.get("marker"),
                item.get("enabled", True), [Source(s["kind"], s["source"]) for s in item.get("sources", [])]))
        self.variables = {int(number): name for number, name in message.get("variables", {}).items()}

    @staticmethod
    def frame_from_message(message: dict) -> Frame:
        data = base64.b64decode(message["data"])
        _, size = _FRAME.unpack_from(data)
        return Frame(message["seq"], message["n"], message["tp"], message["cpu"], message["ns"],
                     data[_FRAME.size : _FRAME.size + size], message.get("sdata"))

    def variable_number(self, name: str) -> int | None:
        return next((n for n, v in self.variables.items() if v == name), None)


def _unhex_text(text: str) -> str:
    return bytes.fromhex(text).decode("utf-8", "replace")


TFILE_MAGIC = b"\x7fTRACE0\n"


def tfile_header(data: bytes, path: Path | str) -> tuple[Run, int]:
    """The definitions a trace file's header holds, and where its frames begin. `data` is at least the header
    (a file's first bytes)."""
    if not data.startswith(TFILE_MAGIC):
        raise TraceFormatError(f"{path}: not a GDB trace file")
    header_end = data.find(b"\n\n", 8)
    if header_end < 0:
        raise TraceFormatError(f"{path}: no end of the header")
    run = Run(origin="tfile")
    for line in data[8:header_end].decode("latin-1").split("\n"):
        if line.startswith("tp T"):
            parts = line[4:].split(":")
            number, address = int(parts[0], 16), int(parts[1], 16)
            info = run.tracepoints.setdefault(number, TracepointInfo(number, address))
            info.enabled = parts[2] == "E"
            info.static = "S" in parts[5:]
        elif line.startswith("tp A"):
            parts = line[4:].split(":", 2)
            if len(parts) == 3 and parts[2].startswith("L"):  # collect $_sdata: GDB writes static ones this way
                number = int(parts[0], 16)
                run.tracepoints.setdefault(number, TracepointInfo(number, int(parts[1], 16))).static = True
        elif line.startswith("tp Z"):
            parts = line[4:].split(":", 5)
            number = int(parts[0], 16)
            info = run.tracepoints.setdefault(number, TracepointInfo(number, int(parts[1], 16)))
            info.sources.append(Source(parts[2], _unhex_text(parts[5])))
        elif line.startswith("tsv "):
            parts = line[4:].split(":")
            run.variables[int(parts[0], 16)] = _unhex_text(parts[3]) if len(parts) > 3 else f"tsv{parts[0]}"
    return run, header_end + 2
