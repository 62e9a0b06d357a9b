"""Trace blocks in GDB's trace-frame format, little-endian: the one codec the agent and the tracer share.

A block is one letter and its body: `M` + u64 address + u16 length + bytes for memory, `V` + i32 number + i64
value for a trace state variable. (`R` register blocks and `S` static-data blocks are the tracer's; they are
encoded in `kgtp_sim/tracing/core/frames.py` with these headers.) A memory block holds at most 65535 bytes (the
length is 16 bits), so bigger `trace` requests are split into several blocks, as gdbserver does. The compiled
code writes the same bytes straight into emulated memory.

Pure: the interpreter encodes blocks at a hit, on the CPU thread; kgtp_sim/tracing/core/frames.py encodes and parses
them wherever frames are read (the server and follow threads).
"""

from __future__ import annotations

import struct

MAX_BLOCK = 0xFFFF
#: The headers after the block's letter.
MEMORY_HEADER = struct.Struct("<QH")  # 10 bytes
TSV_BLOCK = struct.Struct("<iq")  # 12 bytes
#: Whole block sizes, letter included.
MEMORY_BLOCK_OVERHEAD = 1 + MEMORY_HEADER.size
TSV_BLOCK_SIZE = 1 + TSV_BLOCK.size


def memory_block(address: int, data: bytes) -> bytes:
    return b"M" + MEMORY_HEADER.pack(address & (2**64 - 1), len(data)) + data


def tsv_block(number: int, value: int) -> bytes:
    value &= 2**64 - 1
    return b"V" + TSV_BLOCK.pack(number, value - 2**64 if value >> 63 else value)


def split_blocks(data: bytes) -> list[bytes]:
    """Cut a run of `M`/`V` blocks back into single blocks (tests and `monitor` output)."""
    out: list[bytes] = []
    pos = 0
    while pos < len(data):
        kind = data[pos : pos + 1]
        if kind == b"M":
            (length,) = struct.unpack_from("<H", data, pos + 9)
            end = pos + MEMORY_BLOCK_OVERHEAD + length
        elif kind == b"V":
            end = pos + TSV_BLOCK_SIZE
        else:
            raise ValueError(f"not a trace block at {pos}: {kind!r}")
        if end > len(data):
            raise ValueError(f"truncated block at {pos}")
        out.append(data[pos:end])
        pos = end
    return out
