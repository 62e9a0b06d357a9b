"""Packets that move execution: single step, reverse step and continue, software breakpoints.

The kernel never stops, so these act only on a replay of recorded while-stepping frames (`monitor replay`, see
kgtp_sim/stub/replay.py). `c` is in connect.py (outside a replay it waits for the user's Ctrl-C).

Thread: the server thread (`RspServer`), where the dispatcher parses these packets for the run-control handlers
(kgtp_sim/stub/run.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from .base import Packet, PacketError, Resume, parse_hex, split_exact


@dataclass(frozen=True)
class Step(Resume):
    """`s [addr]`: one step forward."""

    PREFIX = b"s"


@dataclass(frozen=True)
class ReverseStep(Packet):
    """`bs`: one step backward (advertised so that GDB's reverse-step and reverse-next use it)."""

    PREFIX = b"bs"
    EXACT = True
    FEATURES = ("ReverseStep+",)


@dataclass(frozen=True)
class ReverseContinue(Packet):
    """`bc`: backward until a breakpoint or the start of the recording."""

    PREFIX = b"bc"
    EXACT = True
    FEATURES = ("ReverseContinue+",)


@dataclass(frozen=True)
class _Breakpoint(Packet):
    """`Z`/`z<type>,<addr>,<kind>[;cond...]`: the fields both share."""

    type: int = 0
    address: int = 0
    kind: int = 1

    @classmethod
    def parse(cls, body: bytes) -> Self:
        what = cls.PREFIX.decode()
        kind, address, size = split_exact(body.split(b";", 1)[0], b",", 3, what)
        if len(kind) != 1 or kind not in b"01234":
            raise PacketError(f"{what}: unknown breakpoint type {kind!r}")
        return cls(int(kind), parse_hex(address, "address"), parse_hex(size, "kind", bits=32))


@dataclass(frozen=True)
class InsertBreakpoint(_Breakpoint):
    """`Z<type>,<addr>,<kind>[;cond...]`."""

    PREFIX = b"Z"


@dataclass(frozen=True)
class RemoveBreakpoint(_Breakpoint):
    """`z<type>,<addr>,<kind>`."""

    PREFIX = b"z"
