"""Trace frames in GDB's trace-buffer format, and the view GDB reads while a frame is selected.

A frame is `u16 tracepoint, u32 size` followed by `size` bytes of blocks (little-endian):
`R` + register block (exactly the length of a `g` reply), `M` + u64 address + u16 length + bytes,
`V` + i32 trace-variable number + i64 value, `S` + u16 length + static-tracepoint data.
The same bytes are what `qTBuffer` hands to `tsave`, so GDB's tfile reader is the final judge of this module.

One block is the ring's own: `r` + u32 mask + one u64 per register of the mask, in register order (bit n: GDB's
register n of the general ones, rax..gs). A register collection that names fewer than all of them is recorded
so, always with rip, at the cost of what it names; `to_gdb` widens it to an `R` block (registers not collected
read zero there, as GDB's tfile format has no way to say unavailable), and while GDB looks at the frame live they
are unavailable (`FrameView`).

Pure data: frames are built on the CPU thread and parsed and viewed on the server and follow threads.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from typing import Protocol

from ...agent.blocks import MEMORY_HEADER, TSV_BLOCK, memory_block, tsv_block
from ...arch import amd64

FRAME_HEADER = struct.Struct("<HI")
STATIC_HEADER = struct.Struct("<H")
COMPACT_HEADER = struct.Struct("<I")
#: Mask of every register a register block holds (rax..gs): a collection of all of them is a full `R` block.
ALL_GENERAL = (1 << len(amd64.GENERAL_REGISTERS)) - 1


class ViewError(Exception):
    """Memory that this view cannot supply (unmapped live memory, or not collected in the frame)."""


class StateView(Protocol):
    """What `g`, `p` and `m` read from: the live kernel, or (once a trace frame is selected) that frame."""

    def registers(self) -> dict[str, int | None]:
        """Register values by amd64 name; None (or absent) = unavailable."""

    def read_memory(self, address: int, length: int) -> bytes:
        """The bytes at `address`; a shorter result means only that prefix is available; raises ViewError
        when not even the first byte is."""


class FrameFormatError(ValueError):
    """Bytes that are not a well-formed trace frame: never produced by the stub, reported if read back."""


@dataclass(frozen=True)
class RegisterBlock:
    data: bytes


@dataclass(frozen=True)
class CompactRegisters:
    """The registers of `mask` (bit n: GDB register n), their values in register order."""

    mask: int
    values: tuple[int, ...]

    def registers(self) -> dict[str, int]:
        regs = [r for i, r in enumerate(amd64.GENERAL_REGISTERS) if self.mask >> i & 1]
        return {r.name: v & ((1 << 8 * r.size) - 1) for r, v in zip(regs, self.values)}

    def expanded(self) -> RegisterBlock:
        return RegisterBlock(amd64.encode_registers(self.registers()))


def compact_mask(gdb_mask: int) -> int:
    """What a register collection of GDB's `mask` records: the general registers it names, and rip (the frame's
    pc, which GDB needs to place it); ALL_GENERAL means a full `R` block."""
    return (gdb_mask & ALL_GENERAL) | 1 << amd64.PC_REGNUM


def whole_register_blocks(pairs: list) -> list:
    """(action, program) pairs with each `R<mask>` made a full register block: gdbserver's `R` collects every
    register whatever the mask names (tracepoint.cc: do_action_at_tracepoint), and GDB's unwinder of a frame
    needs registers its collection did not name (%rbp, to walk up from a function without CFI)."""
    from .model import CollectRegisters

    return [(CollectRegisters(ALL_GENERAL), p) if isinstance(a, CollectRegisters) else (a, p) for a, p in pairs]


def register_collection(gdb_mask: int, values: list[int]) -> Block:
    """The block a hit records for `R<mask>`, from the general registers' values in GDB order."""
    mask = compact_mask(gdb_mask)
    if mask == ALL_GENERAL:
        return RegisterBlock(amd64.encode_general(values))
    return CompactRegisters(mask, tuple(v for i, v in enumerate(values) if mask >> i & 1))


@dataclass(frozen=True)
class MemoryBlock:
    address: int
    data: bytes


@dataclass(frozen=True)
class TsvBlock:
    number: int
    value: int


@dataclass(frozen=True)
class StaticBlock:
    data: bytes


Block = RegisterBlock | CompactRegisters | MemoryBlock | TsvBlock | StaticBlock


def encode_block(block: Block, regblock_size: int = amd64.G_PACKET_SIZE) -> bytes:
    """`regblock_size`: the `R` block of a wider register file whose first registers are KGTP's (the gdbserver
    role's, arch/amd64.LINUX, as GDB reads its trace frames: one `g` packet's bytes); the registers KGTP does not
    record follow as zeros."""
    if isinstance(block, RegisterBlock):
        if len(block.data) != amd64.G_PACKET_SIZE or regblock_size < amd64.G_PACKET_SIZE:
            raise FrameFormatError(f"register block of {len(block.data)} bytes, expected {amd64.G_PACKET_SIZE}")
        return b"R" + block.data.ljust(regblock_size, b"\0")
    if isinstance(block, CompactRegisters):
        return b"r" + COMPACT_HEADER.pack(block.mask) + struct.pack(f"<{len(block.values)}Q", *block.values)
    if isinstance(block, MemoryBlock):
        return memory_block(block.address, block.data)
    if isinstance(block, TsvBlock):
        return tsv_block(block.number, block.value)
    return b"S" + STATIC_HEADER.pack(len(block.data)) + block.data


def encode_frame(tracepoint: int, blocks: list[Block] | tuple[Block, ...],
                 regblock_size: int = amd64.G_PACKET_SIZE) -> bytes:
    body = b"".join(encode_block(b, regblock_size) for b in blocks)
    return FRAME_HEADER.pack(tracepoint, len(body)) + body


def parse_blocks(body: bytes) -> tuple[Block, ...]:
    blocks: list[Block] = []
    pos = 0
    while pos < len(body):
        kind = body[pos : pos + 1]
        pos += 1
        try:
            if kind == b"R":
                end = pos + amd64.G_PACKET_SIZE
                if end > len(body):
                    raise FrameFormatError("truncated register block")
                blocks.append(RegisterBlock(body[pos:end]))
            elif kind == b"r":
                (mask,) = COMPACT_HEADER.unpack_from(body, pos)
                count = mask.bit_count()
                if mask & ~ALL_GENERAL:
                    raise FrameFormatError(f"compact register block with mask {mask:#x}")
                start = pos + COMPACT_HEADER.size
                end = start + 8 * count
                if end > len(body):
                    raise FrameFormatError("truncated compact register block")
                blocks.append(CompactRegisters(mask, struct.unpack_from(f"<{count}Q", body, start)))
            elif kind == b"M":
                address, length = MEMORY_HEADER.unpack_from(body, pos)
                start = pos + MEMORY_HEADER.size
                end = start + length
                if end > len(body):
                    raise FrameFormatError("truncated memory block")
                blocks.append(MemoryBlock(address, body[start:end]))
            elif kind == b"V":
                number, value = TSV_BLOCK.unpack_from(body, pos)
                end = pos + TSV_BLOCK.size
                blocks.append(TsvBlock(number, value))
            elif kind == b"S":
                (length,) = STATIC_HEADER.unpack_from(body, pos)
                start = pos + STATIC_HEADER.size
                end = start + length
                if end > len(body):
                    raise FrameFormatError("truncated static-data block")
                blocks.append(StaticBlock(body[start:end]))
            else:
                raise FrameFormatError(f"unknown block type {kind!r} at offset {pos - 1}")
        except struct.error:
            raise FrameFormatError(f"truncated {kind!r} block") from None
        pos = end
    return tuple(blocks)


@dataclass(frozen=True)
class TraceFrame:
    """One collected frame plus what GDB's format has no room for: when, on which CPU, in which order."""

    number: int
    tracepoint: int
    blocks: tuple[Block, ...]
    timestamp: int = 0  # TSC ticks at commit
    cpu: int = 0
    sequence: int = 0  # order of creation on its CPU since tstart (frame numbers restart as old frames are evicted)

    @property
    def registers(self) -> dict[str, int] | None:
        for block in self.blocks:
            if isinstance(block, RegisterBlock):
                return amd64.decode_registers(block.data)
            if isinstance(block, CompactRegisters):
                return block.registers()
        return None

    def memory_ranges(self) -> list[tuple[int, int]]:
        return [(b.address, len(b.data)) for b in self.blocks if isinstance(b, MemoryBlock)]

    def tsv_numbers(self) -> list[int]:
        return [b.number for b in self.blocks if isinstance(b, TsvBlock)]

    def tsv_values(self) -> list[tuple[int, int]]:
        return [(b.number, b.value) for b in self.blocks if isinstance(b, TsvBlock)]

    def static_data(self) -> bytes | None:
        for block in self.blocks:
            if isinstance(block, StaticBlock):
                return block.data
        return None

    def to_gdb(self, regblock_size: int = amd64.G_PACKET_SIZE) -> bytes:
        """The frame in GDB's format: a compact register block widened to `R` (of `regblock_size` bytes:
        `encode_block`)."""
        return encode_frame(self.tracepoint, tuple(
            b.expanded() if isinstance(b, CompactRegisters) else b for b in self.blocks), regblock_size)


@dataclass
class FrameView(StateView):
    """What `g`/`p`/`m` answer while a frame is selected.

    Registers come from the frame's register block; a frame without one still reports the tracepoint's address
    as its PC (GDB relies on that to tell a tracepoint hit from a while-stepping frame). Memory comes from the
    frame's blocks, or from live memory inside read-only regions (QTro), where the live bytes are the same as at
    hit time; anything else is unavailable.
    """

    frame: TraceFrame
    pc: int
    live: StateView
    read_only: list[tuple[int, int]] = field(default_factory=list)

    def registers(self) -> dict[str, int | None]:
        values: dict[str, int | None] = dict(self.frame.registers or {})
        if "rip" not in values:
            values["rip"] = self.pc
        return values

    def read_memory(self, address: int, length: int) -> bytes:
        out = bytearray()
        cursor = address
        end = address + length
        while cursor < end:
            chunk = self._chunk_at(cursor, end)
            if not chunk:
                break
            out += chunk
            cursor += len(chunk)
        if not out:
            raise ViewError(f"memory at {address:#x} was not collected in this trace frame")
        return bytes(out)

    def _chunk_at(self, cursor: int, end: int) -> bytes:
        # The first block that holds the address wins, as in GDB's own tfile reader, which scans blocks in
        # order; a frame never holds two different values for one address, so the order rarely matters.
        for block in self.frame.blocks:
            if isinstance(block, MemoryBlock) and block.address <= cursor < block.address + len(block.data):
                offset = cursor - block.address
                return block.data[offset : offset + (end - cursor)]
        for start, stop in self.read_only:
            if start <= cursor < stop:
                try:
                    return self.live.read_memory(cursor, min(end, stop) - cursor)
                except ViewError:
                    return b""
        return b""
