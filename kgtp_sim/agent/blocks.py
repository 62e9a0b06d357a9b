"""Trace blocks in GDB's trace-frame format, as the agent writes them (little-endian).

`M` + u64 address + u16 length + bytes for memory, `V` + i32 number + i64 value for a trace state variable.
A memory block holds at most 65535 bytes (the length is 16 bits), so bigger `trace` requests are split into
several blocks, as gdbserver does. The compiled code writes the same bytes straight into emulated memory.
"""

from __future__ import annotations

import struct

MAX_BLOCK = 0xFFFF
MEMORY_HEADER = struct.Struct("<cQH")  # 11 bytes
TSV_BLOCK = struct.Struct("<ciq")  # 13 bytes


def memory_block(address: int, data: bytes) -> bytes:
    return MEMORY_HEADER.pack(b"M", address & (2**64 - 1), len(data)) + data


def tsv_block(number: int, value: int) -> bytes:
    value &= 2**64 - 1
    return TSV_BLOCK.pack(b"V", number, value - 2**64 if value >> 63 else value)


def split_blocks(data: bytes) -> list[bytes]:
    """Cut a run of `M`/`V` blocks back into single blocks (tests and `monitor` output)."""
    out: list[bytes] = []
    pos = 0
    while pos < len(data):
        kind = data[pos : pos + 1]
        if kind == b"M":
            (length,) = struct.unpack_from("<H", data, pos + 9)
            end = pos + MEMORY_HEADER.size + length
        elif kind == b"V":
            end = pos + TSV_BLOCK.size
        else:
            raise ValueError(f"not a trace block at {pos}: {kind!r}")
        if end > len(data):
            raise ValueError(f"truncated block at {pos}")
        out.append(data[pos:end])
        pos = end
    return out
