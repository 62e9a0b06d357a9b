"""What GDB has defined: tracepoints (with conditions, actions, sources), trace state variables, settings.

Pure state built from the QTDP / QTDPsrc / QTDV / QTBuffer / QTNotes packets, and turned back into the upload
replies (qTfP/qTsP, qTfV/qTsV) a reconnecting GDB uses to learn what is defined. Nothing here runs code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..rsp.packets import trace as t

#: GDB's default when `QTBuffer:size:-1` asks for "the target's default".
DEFAULT_BUFFER_SIZE = 0x100000
MAX_BUFFER_SIZE = 0x4000000  # 64 MiB
MIN_BUFFER_SIZE = 0x1000


@dataclass
class Tracepoint:
    """One location of one tracepoint (GDB numbers a tracepoint; each of its addresses is a location)."""

    number: int
    address: int
    enabled: bool = True
    step_count: int = 0
    pass_count: int = 0
    fast_insn_length: int | None = None
    static: bool = False
    condition: bytes | None = None
    actions: list[t.Action] = field(default_factory=list)
    stepping_actions: list[t.Action] = field(default_factory=list)
    sources: list[t.TracepointSource] = field(default_factory=list)

    @property
    def key(self) -> tuple[int, int]:
        return (self.number, self.address)

    @classmethod
    def from_packet(cls, packet: t.DefineTracepoint) -> Tracepoint:
        return cls(
            packet.number,
            packet.address,
            packet.enabled,
            packet.step_count,
            packet.pass_count,
            packet.fast_insn_length,
            packet.static,
            packet.condition,
        )

    def as_packet(self) -> t.DefineTracepoint:
        return t.DefineTracepoint(
            number=self.number,
            address=self.address,
            enabled=self.enabled,
            step_count=self.step_count,
            pass_count=self.pass_count,
            fast_insn_length=self.fast_insn_length,
            static=self.static,
            condition=self.condition,
            more=False,
        )

    def expressions(self) -> list[bytes]:
        """Every bytecode this location runs: condition first, then actions, then while-stepping actions."""
        found = [self.condition] if self.condition is not None else []
        found += [a.bytecode for a in (*self.actions, *self.stepping_actions) if isinstance(a, t.EvalExpression)]
        return found


@dataclass
class TraceVariable:
    number: int
    initial: int
    builtin: bool
    name: str

    def as_packet(self) -> t.DefineTraceVariable:
        return t.DefineTraceVariable(number=self.number, value=self.initial, builtin=self.builtin, name=self.name)


@dataclass
class Definitions:
    """Everything downloaded by GDB; survives disconnects (GDB uploads it back on reconnect)."""

    tracepoints: dict[tuple[int, int], Tracepoint] = field(default_factory=dict)
    variables: dict[int, TraceVariable] = field(default_factory=dict)
    read_only: list[tuple[int, int]] = field(default_factory=list)
    circular: bool = False
    buffer_size: int = DEFAULT_BUFFER_SIZE
    disconnected_tracing: bool = False
    user: str | None = None
    notes: str | None = None
    stop_note: str | None = None
    _stepping: bool = field(default=False, repr=False)

    def clear_tracepoints(self) -> None:
        """QTinit: forget tracepoints and user variables; built-in variables stay."""
        self.tracepoints.clear()
        self.variables = {n: v for n, v in self.variables.items() if v.builtin}
        self.read_only.clear()

    def define(self, packet: t.DefineTracepoint) -> Tracepoint:
        tracepoint = Tracepoint.from_packet(packet)
        self.tracepoints[tracepoint.key] = tracepoint
        self._stepping = False
        return tracepoint

    def add_actions(self, packet: t.TracepointActions) -> Tracepoint:
        tracepoint = self.tracepoints.get((packet.number, packet.address))
        if tracepoint is None:
            raise KeyError(f"actions for undefined tracepoint {packet.number} at {packet.address:#x}")
        # GDB marks only the first while-stepping piece with 'S'; the following ones are stepping too.
        self._stepping = self._stepping or packet.stepping
        (tracepoint.stepping_actions if self._stepping else tracepoint.actions).extend(packet.actions)
        return tracepoint

    def add_source(self, packet: t.TracepointSource) -> None:
        tracepoint = self.tracepoints.get((packet.number, packet.address))
        if tracepoint is None:
            raise KeyError(f"source for undefined tracepoint {packet.number} at {packet.address:#x}")
        tracepoint.sources.append(packet)

    def define_variable(self, packet: t.DefineTraceVariable) -> None:
        existing = self.variables.get(packet.number)
        if existing is not None and existing.builtin:
            existing.initial = packet.value  # GDB may re-send a built-in (e.g. `tvariable $ignore_error = 1`)
            return
        # only the stub's own variables are built-in: a client's flag must not make one outlive QTinit
        self.variables[packet.number] = TraceVariable(packet.number, packet.value, False, packet.name)

    def upload_pieces(self) -> list[bytes]:
        """qTfP/qTsP replies: each tracepoint, its actions, stepping actions and source strings."""
        pieces: list[bytes] = []
        for tp in self.tracepoints.values():
            pieces.append(t.encode_tracepoint_definition(tp.as_packet()))
            for action in tp.actions:
                pieces.append(t.encode_tracepoint_actions(tp.number, tp.address, [action]))
            for action in tp.stepping_actions:
                pieces.append(t.encode_tracepoint_actions(tp.number, tp.address, [action], stepping=True))
            for source in tp.sources:
                pieces.append(t.encode_tracepoint_source(source))
        return pieces

    def upload_variables(self) -> list[bytes]:
        return [t.encode_trace_variable(v.as_packet()) for v in sorted(self.variables.values(), key=lambda v: v.number)]
