"""Packets that move execution: single step, reverse step and continue, software breakpoints.

The kernel never stops, so these act only on a replay of recorded while-stepping frames (`monitor replay`, see
kgtp_sim/stub/replay.py), or under run control. `c` is in connect.py (outside a replay it waits for the user's
Ctrl-C).

`Z0`/`Z1` may carry the breakpoint's conditions and commands after a `;` (remote.c:
remote_add_target_side_condition and remote_add_target_side_commands write them, gdbserver's server.cc:
process_point_options reads them): `X<len>,<bytecode>` per condition (GDB writes them one after the other, a `;`
between them is taken too), then `cmds:<persist>,` and an `X` per command. `ConditionalInsertBreakpoint` reads
them, strictly (an unknown token or a bad expression refuses the packet, where gdbserver skips it); it is the `Z`
of a target that evaluates conditions, so its presence announces ConditionalBreakpoints+ and BreakpointCommands+.
Each expression is verified here (agent/verify.py), a printf's format with its C escapes read as gdbserver's agent
printf reads them (agent/printf_format.py: read_escapes; gdbserver finds a bad one only when it prints), so a bad
one is the packet's E01 and nothing is inserted.

Thread: the server thread (`RspServer`), where the dispatcher parses these packets for the run-control handlers
(kgtp_sim/stub/run.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from .base import Packet, PacketError, Resume, parse_hex, split_exact
from ...agent.errors import BytecodeError
from ...agent.printf_format import FormatError, read_escapes
from ...agent.verify import Program, verify
from .trace.actions import _parse_agent_expr


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
class ConditionalInsertBreakpoint(InsertBreakpoint):
    """`Z<type>,<addr>,<kind>[;X<len>,<expr>...][;cmds:<persist>,X<len>,<expr>...]`: `conditions` (the breakpoint
    stops when one is true), `commands` (run at each hit, `persist`: kept when GDB disconnects), each an agent
    expression verified as the tracer verifies a tracepoint's (agent/verify.py; a condition must leave a value): a
    bad one refuses the packet, naming it."""

    FEATURES = ("ConditionalBreakpoints+", "BreakpointCommands+")

    conditions: tuple[Program, ...] = ()
    commands: tuple[Program, ...] = ()
    persist: bool = False

    @classmethod
    def parse(cls, body: bytes) -> Self:
        plain = super().parse(body)
        head, semicolon, options = body.partition(b";")
        if not semicolon:
            return plain
        if plain.type > 1:
            raise PacketError(f"Z{plain.type}: only breakpoints (Z0, Z1) take conditions or commands")
        conditions: list[Program] = []
        commands: list[Program] = []
        persist = False
        at = 0
        while at < len(options):
            if options[at:at + 1] == b";":
                at += 1
                continue
            if options.startswith(b"cmds:", at):
                if commands:
                    raise PacketError("Z: a second cmds: list")
                flag, comma = options[at + 5:at + 6], options[at + 6:at + 7]
                if flag not in (b"0", b"1") or comma != b",":
                    raise PacketError("Z: cmds: is followed by 0 or 1 and a comma")
                persist = flag == b"1"
                at += 7
                while options[at:at + 1] == b"X":
                    command, at = _parse_agent_expr(options, at, "Z command")
                    commands.append(_verified(command, f"command {len(commands) + 1}", value=False))
                if not commands:
                    raise PacketError("Z: cmds: without a command")
            elif options[at:at + 1] == b"X":
                if commands:
                    raise PacketError("Z: a condition after the commands")
                condition, at = _parse_agent_expr(options, at, "Z condition")
                conditions.append(_verified(condition, f"condition {len(conditions) + 1}", value=True))
            else:
                raise PacketError(f"Z: unknown breakpoint option {options[at:at + 16]!r}")
        return cls(plain.type, plain.address, plain.kind, tuple(conditions), tuple(commands), persist)


def _verified(code: bytes, what: str, *, value: bool) -> Program:
    try:
        program = verify(code, require_value=value)
        for insn in program.insns:
            if insn.name == "printf":
                read_escapes(insn.format)
    except (BytecodeError, FormatError) as error:
        raise PacketError(f"Z: breakpoint {what}: {error}") from None
    return program


@dataclass(frozen=True)
class RemoveBreakpoint(_Breakpoint):
    """`z<type>,<addr>,<kind>`."""

    PREFIX = b"z"
