"""Register and memory access packets.

Thread: the server thread (`RspServer`), where the dispatcher parses these packets for the handlers of
kgtp_sim/stub/core.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from .base import Packet, PacketError, parse_hex, parse_hex_bytes, split_exact

#: The largest `m` we serve in one reply; GDB splits larger reads itself (PacketSize bounds them anyway).
MAX_READ = 0x4000


def _address_length(body: bytes, what: str) -> tuple[int, int]:
    addr, length = split_exact(body, b",", 2, what)
    return parse_hex(addr, "address"), parse_hex(length, "length")


@dataclass(frozen=True)
class ReadRegisters(Packet):
    PREFIX = b"g"
    EXACT = True


@dataclass(frozen=True)
class WriteRegisters(Packet):
    PREFIX = b"G"
    data: bytes = b""

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(parse_hex_bytes(body, "register data"))


@dataclass(frozen=True)
class ReadRegister(Packet):
    PREFIX = b"p"
    regnum: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(parse_hex(body, "register number", bits=16))


@dataclass(frozen=True)
class WriteRegister(Packet):
    PREFIX = b"P"
    regnum: int = 0
    value: bytes = b""

    @classmethod
    def parse(cls, body: bytes) -> Self:
        reg, value = split_exact(body, b"=", 2, "P")
        return cls(parse_hex(reg, "register number", bits=16), parse_hex_bytes(value, "register value"))


@dataclass(frozen=True)
class ReadMemory(Packet):
    PREFIX = b"m"
    address: int = 0
    length: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        address, length = _address_length(body, "m")
        if length > MAX_READ:
            raise PacketError(f"m: length {length:#x} exceeds {MAX_READ:#x}")
        return cls(address, length)


@dataclass(frozen=True)
class WriteMemory(Packet):
    PREFIX = b"M"
    address: int = 0
    data: bytes = b""

    @classmethod
    def parse(cls, body: bytes) -> Self:
        where, data = split_exact(body, b":", 2, "M")
        address, length = _address_length(where, "M")
        payload = parse_hex_bytes(data, "M data")
        if len(payload) != length:
            raise PacketError(f"M: length {length:#x} but {len(payload):#x} bytes given")
        return cls(address, payload)


@dataclass(frozen=True)
class WriteMemoryBinary(Packet):
    PREFIX = b"X"
    address: int = 0
    data: bytes = b""

    @classmethod
    def parse(cls, body: bytes) -> Self:
        where, sep, data = body.partition(b":")
        if not sep:
            raise PacketError("X: expected <addr>,<len>:<data>")
        address, length = _address_length(where, "X")
        if len(data) != length:
            raise PacketError(f"X: length {length:#x} but {len(data):#x} bytes given")
        return cls(address, data)
