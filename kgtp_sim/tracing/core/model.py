"""The tracer's vocabulary: what GDB can define (tracepoints, their actions and sources, trace state variables,
settings), why a run stops and what its status says.

Everything else speaks these words: the packet parsers in `kgtp_sim/rsp/packets/trace/` build them (a packet
*is* one of these specs plus its wire details), the stub turns them back into upload replies, the tracer runs
them. Pure state, no code runs here; any thread may read it, the server thread writes it (definitions change
only between runs or under `Tracer.arm`/`disarm`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

#: The target's trace buffer when GDB sets none (or `QTBuffer:size:-1` asks for the default): 5 MiB, the size of
#: gdbserver's buffer and of each of KGTP's per-CPU ring buffers.
DEFAULT_BUFFER_SIZE = 5 * 1024 * 1024
MAX_BUFFER_SIZE = 0x4000000  # 64 MiB
MIN_BUFFER_SIZE = 0x1000


class TraceError(Exception):
    """tstart (or a definition) cannot be honoured; the text reaches the user through GDB."""


def requested_buffer_size(size: int | None, *, one_buffer: bool = False) -> int:
    """The trace buffer `QTBuffer:size` asks for (None: `-1`, the target's default), or TraceError.

    KGTP mode (each CPU's ring gets it): MIN_BUFFER_SIZE to MAX_BUFFER_SIZE, rounded down to 8. `one_buffer`
    (the gdbserver role: gdbserver/tracepoint.cc, cmd_bigqtbuffer_size, takes any size for its one buffer and
    tstatus reports it as asked): up to MAX_BUFFER_SIZE, kept exactly."""
    if size is None:
        return DEFAULT_BUFFER_SIZE
    low = 0 if one_buffer else MIN_BUFFER_SIZE
    if not low <= size <= MAX_BUFFER_SIZE:
        raise TraceError(f"trace buffer size {size:#x} outside {low:#x}..{MAX_BUFFER_SIZE:#x}")
    return size if one_buffer else size & ~7


# --- actions -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CollectRegisters:
    """`R<mask>`: collect the registers whose bit is set; bit n is GDB's (remote) register number n."""

    mask: int


@dataclass(frozen=True)
class CollectMemory:
    """`M<basereg>,<offset>,<length>`: collect `length` bytes at register `basereg` + `offset`.

    `basereg` -1 means `offset` is an absolute address (globals). A negative frame offset is kept as its
    unsigned 64-bit two's complement; the address arithmetic wraps modulo 2**64.
    """

    basereg: int
    offset: int
    length: int


@dataclass(frozen=True)
class EvalExpression:
    """`X<len>,<bytecode>`: run an agent expression (locals, `$tsv`, `teval`, complex expressions)."""

    bytecode: bytes


@dataclass(frozen=True)
class CollectStaticData:
    """`L`: collect the static tracepoint marker's data (`collect $_sdata`)."""


Action = CollectRegisters | CollectMemory | EvalExpression | CollectStaticData


# --- what GDB defines -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TracepointSpec:
    """One location of a tracepoint as GDB defines it (QTDP): where, enabled, step and pass counts, fast
    (`ftrace`, with the instruction length GDB expects replaced), static (`strace`), condition bytecode."""

    number: int = 0
    address: int = 0
    enabled: bool = True
    step_count: int = 0
    pass_count: int = 0
    fast_insn_length: int | None = None
    static: bool = False
    condition: bytes | None = None


@dataclass(frozen=True)
class ActionList:
    """Actions for the location `number`/`address`; `stepping` starts its while-stepping list."""

    number: int = 0
    address: int = 0
    actions: tuple[Action, ...] = ()
    stepping: bool = False


SOURCE_KINDS = ("at", "cond", "cmd")


@dataclass(frozen=True)
class TracepointSource:
    """The user's text for a location (`at`), its condition (`cond`) or one action line (`cmd`), kept for the
    upload to a reconnecting GDB and for naming collected values. `length` is the whole string's length."""

    number: int = 0
    address: int = 0
    kind: str = "at"
    start: int = 0
    length: int = 0
    source: str = ""


@dataclass(frozen=True)
class VariableSpec:
    """A trace state variable as GDB defines it (`tvariable $name = value`)."""

    number: int = 0
    value: int = 0
    builtin: bool = False
    name: str = ""


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
    actions: list[Action] = field(default_factory=list)
    stepping_actions: list[Action] = field(default_factory=list)
    sources: list[TracepointSource] = field(default_factory=list)

    @property
    def key(self) -> tuple[int, int]:
        return (self.number, self.address)

    @classmethod
    def from_spec(cls, spec: TracepointSpec) -> Tracepoint:
        return cls(
            spec.number,
            spec.address,
            spec.enabled,
            spec.step_count,
            spec.pass_count,
            spec.fast_insn_length,
            spec.static,
            spec.condition,
        )

    def absolute_ranges(self) -> list[tuple[int, int]]:
        """(address, length) of every range its actions collect at a fixed address (`M-1,...`: globals)."""
        return [(a.offset, a.length) for a in (*self.actions, *self.stepping_actions)
                if isinstance(a, CollectMemory) and a.basereg == -1 and a.length > 0]

    def expressions(self) -> list[bytes]:
        """Every bytecode this location runs: condition first, then actions, then while-stepping actions."""
        found = [self.condition] if self.condition is not None else []
        found += [a.bytecode for a in (*self.actions, *self.stepping_actions) if isinstance(a, EvalExpression)]
        return found


@dataclass
class TraceVariable:
    number: int
    initial: int
    builtin: bool
    name: str
    settable: bool = True  # a built-in GDB may set with `tvariable $name = value` (QTDV); KGTP ignores the others


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

    def define(self, spec: TracepointSpec) -> Tracepoint:
        tracepoint = Tracepoint.from_spec(spec)
        self.tracepoints[tracepoint.key] = tracepoint
        self._stepping = False
        return tracepoint

    def add_actions(self, actions: ActionList) -> Tracepoint:
        tracepoint = self.tracepoints.get((actions.number, actions.address))
        if tracepoint is None:
            raise KeyError(f"actions for undefined tracepoint {actions.number} at {actions.address:#x}")
        # GDB marks only the first while-stepping piece with 'S'; the following ones are stepping too.
        self._stepping = self._stepping or actions.stepping
        (tracepoint.stepping_actions if self._stepping else tracepoint.actions).extend(actions.actions)
        return tracepoint

    def add_source(self, source: TracepointSource) -> None:
        tracepoint = self.tracepoints.get((source.number, source.address))
        if tracepoint is None:
            raise KeyError(f"source for undefined tracepoint {source.number} at {source.address:#x}")
        tracepoint.sources.append(source)

    def define_variable(self, spec: VariableSpec) -> None:
        existing = self.variables.get(spec.number)
        if existing is not None and existing.builtin:
            if existing.settable:  # GDB re-sends every built-in at tstart (`tvariable $ignore_error = 1`)
                existing.initial = spec.value
            return
        # only the stub's own variables are built-in: a client's flag must not make one outlive QTinit
        self.variables[spec.number] = TraceVariable(spec.number, spec.value, False, spec.name)


# --- what a run reports ---------------------------------------------------------------------------------


class StopReason(enum.Enum):
    """Why the run is not going, as the first qTStatus field names it (stop_reason_names in GDB)."""

    NOT_RUN = "tnotrun"
    STOP_COMMAND = "tstop"
    BUFFER_FULL = "tfull"
    DISCONNECTED = "tdisconnected"
    PASSCOUNT = "tpasscount"
    ERROR = "terror"
    UNKNOWN = "tunknown"


@dataclass(frozen=True)
class TraceStatus:
    """What qTStatus reports. None fields are left out (GDB then shows them as unknown).

    `stop_note`: for tstop, the user's note (None sends the old `tstop:0`, which GDB prints without
    parentheses, while "" prints "()"), for terror the error text. `stopping_tracepoint` goes with
    tpasscount and terror. Times are microseconds since the epoch (in the gdbserver role, on gdbserver's steady
    clock, as its tstatus reports them).
    """

    running: bool = False
    stop_reason: StopReason = StopReason.NOT_RUN
    stop_note: str | None = None
    stopping_tracepoint: int = 0
    frames: int | None = None
    created: int | None = None
    buffer_free: int | None = None
    buffer_size: int | None = None
    circular: bool | None = None
    disconnected: bool | None = None
    start_time: int | None = None
    stop_time: int | None = None
    user: str | None = None
    notes: str | None = None


@dataclass(frozen=True)
class StaticMarker:
    """A static tracepoint marker as GDB lists it: its address, id (`strace -m ID`) and free-form extra text."""

    address: int
    id: str
    extra: str = ""


@dataclass(frozen=True)
class ProbeRow:
    """One location's probe as `monitor probes` lists it: its kind (jump or int3), armed or removed, counters."""

    number: int
    address: int
    kind: str
    armed: bool
    fired: int
    hits: int
    usage: int
    function: str
