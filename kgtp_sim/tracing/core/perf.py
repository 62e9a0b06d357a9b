"""KGTP's perf-event trace state variables: `$pe_FIELD_NAME` and the per-CPU `$p_pe_FIELD_NAME<cpu>`, on the
machine's performance counters (machine/counters.py).

Owns the naming rules and one run's events; no thread of its own (hits read and write on the CPU thread, tstart
and tstop run there too; GDB's qTV comes from the server thread through `Tracer`, which reads on the CPU thread).

The rules are KGTP's (gtp.c 20140510: gtp_gdbrsp_qtdv, gtp_gdbrsp_qtstart, gtp_var_agent_get_val and _set_val,
gtp_check_getv and _setv, gtp_pc_pe_en, gtp_pe_set_en, gtp_gdbrsp_qtv):

- a variable named `pe_` (or `perf_event_`) + FIELD + `_` + NAME is one field of the perf event NAME; FIELD is
  `cpu`, `type`, `config`, `en`, `val`, `enabled` or `running`; another FIELD, or no NAME, and QTDV fails;
- with KGTP's per-CPU prefix (`p_`, `per_cpu_`, percpu.py) the event is per CPU: `$p_pe_type_00_c0` is a field of
  the event `00_c0` on CPU 0 (the CPU the trailing digits name; NAME keeps them), and the local form without
  digits (`$p_pe_val_00_c`) reads and writes, at a hit, the event of the hitting CPU whose variable of that
  form names it (`$p_pe_val_00_c1` on CPU 1);
- at tstart each event is created from its fields' values as GDB defined them (the type and config default to
  PERF_TYPE_HARDWARE and PERF_COUNT_HW_CPU_CYCLES, the CPU to the per-CPU digits, else 0; `en` non-zero starts it
  enabled); an event the machine cannot count fails tstart, as KGTP's perf_event_create_kernel_counter error;
- a condition or action may read `val`, `enabled`, `running` (the count, and the nanoseconds the event was
  enabled and running) and set `en` (switch the event) and `val` (set its count, perf_event_set); any other
  access fails tstart;
- `$p_pe_en` set by an action switches every event of the hitting CPU on or off (gtp_pc_pe_en); an event of
  the hitting CPU switched on by `$pe_en_NAME` counts only while its CPU's switch is on (KGTP enables it at the
  handler's end, and not while the CPU's events are all disabled); an event of another CPU switches at once;
- GDB reads `val`, `enabled`, `running` live during a run and as they were at tstop afterwards; the other fields
  read 0, as KGTP answers.

What counts is the machine's: exact instructions and branches of the kernel, the tracer's own code never counted.
KGTP runs its handler before the probed instruction with the CPU's counters off; here a hit reads and switches the
counters as they were before the probed instruction (`Counters.raw`'s `at`), and the handler itself runs no
kernel instruction. Locations using these variables run on the Python hit path in every engine
(`builtins.runs_natively`), where `$kret`'s return probes run anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...machine.counters import Counter, CounterError, EventAttr, HwEvent, PerfType
from .model import TraceError
from .percpu import PREFIXES, parse as parse_per_cpu

PE_PREFIXES = ("pe_", "perf_event_")
FIELDS = ("cpu", "type", "config", "en", "val", "enabled", "running")
#: what a condition or action may read and write (gtp_check_getv, gtp_check_setv)
AGENT_READ = frozenset({"val", "enabled", "running"})
AGENT_WRITE = frozenset({"en", "val"})
_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class PerfName:
    """What a perf-event variable's name says."""

    field: str  #: cpu, type, config, en, val, enabled, running
    event: str  #: the event's name (KGTP's pe->name; for the per-CPU form, with the CPU digits)
    per_cpu: bool
    cpu: int | None  #: the per-CPU form's CPU; None for the local form (the hitting CPU's) or a global event
    group: str = ""  #: the per-CPU base name (percpu.py): the local form finds its CPU's variable by it


def parse(name: str) -> PerfName | None:
    """The perf-event form of a variable name (without `$`), None for another variable; ValueError for a name
    KGTP's QTDV refuses (an unknown field, no event name)."""
    per_cpu = parse_per_cpu(name)
    rest = name
    if per_cpu is not None:
        rest = name[len(next(p for p in PREFIXES if name.startswith(p))):]
    prefix = next((p for p in PE_PREFIXES if rest.startswith(p)), None)
    if prefix is None:
        return None
    rest = rest[len(prefix):]
    kind = next((f for f in sorted(FIELDS, key=len, reverse=True) if rest.startswith(f + "_")), None)
    if kind is None:
        raise ValueError(f"${name}: a perf event variable is pe_FIELD_NAME, FIELD one of {', '.join(FIELDS)}")
    event = rest[len(kind) + 1:]
    if not event:
        raise ValueError(f"${name}: the perf event has no name")
    if per_cpu is None:
        return PerfName(kind, event, False, None)
    return PerfName(kind, event, True, per_cpu.cpu, per_cpu.base)


@dataclass
class PerfEvent:
    """One event of a run: its definition from the fields, then its counter on the machine."""

    key: tuple[bool, str]  #: (per CPU, name)
    cpu: int = 0
    type: int = PerfType.HARDWARE
    config: int = HwEvent.CPU_CYCLES
    en: bool = False
    counter: Counter | None = None
    last: tuple[int, int, int] = (0, 0, 0)  #: (val, enabled, running) at tstop, for GDB afterwards


@dataclass
class PerfEvents:
    """One run's perf-event variables and the counters behind them (`Tracer.perf`)."""

    machine: Any
    names: dict[int, PerfName] = field(default_factory=dict)  #: variable number -> its name
    events: dict[tuple[bool, str], PerfEvent] = field(default_factory=dict)
    switches: dict[int, bool] = field(default_factory=dict)  #: CPU -> its events' switch ($p_pe_en)
    running: bool = False

    def __contains__(self, number: int) -> bool:
        return number in self.names

    def check(self, name: str) -> None:
        """QTDV: ValueError for a name KGTP refuses (a per-CPU CPU number is percpu.py's check)."""
        parse(name)

    # ---- tstart and tstop (CPU thread) ---------------------------------------------------------------------

    def define(self, variables) -> None:
        """The perf-event variables among `variables` (number -> TraceVariable), their events defined from the
        fields' values (KGTP sets them as each QTDV arrives; GDB sends every definition before tstart)."""
        self.names, self.events = {}, {}
        for number in sorted(variables):
            variable = variables[number]
            if variable.builtin or not variable.name:
                continue
            try:
                name = parse(variable.name)
            except ValueError:
                continue  # refused at QTDV
            if name is None:
                continue
            self.names[number] = name
            if name.per_cpu and name.cpu is None:
                continue  # the local form has no event of its own (KGTP: `goto out`)
            event = self.events.get((name.per_cpu, name.event))
            if event is None:
                event = self.events[(name.per_cpu, name.event)] = PerfEvent((name.per_cpu, name.event))
                if name.per_cpu:
                    event.cpu = name.cpu or 0
            value = variable.initial
            if name.field == "cpu":
                event.cpu = value
            elif name.field == "type":
                event.type = value & 0xFFFF_FFFF
            elif name.field == "config":
                event.config = value & _MASK
            elif name.field == "en":
                event.en = bool(value)

    def start(self) -> None:
        """Create every event on the machine's counters (KGTP's tstart); the first one the machine cannot count
        fails tstart, the ones created before it released."""
        counters = self.machine.counters
        self.switches = {cpu: False for cpu in range(self.machine.cpu_count)}
        for event in self.events.values():
            try:
                event.counter = counters.open(event.cpu, EventAttr(event.type, event.config), enabled=event.en)
            except CounterError as error:
                self.stop()
                raise TraceError(f"cannot create perf event {event.key[1]} (CPU {event.cpu}, type {event.type}, "
                                 f"config {event.config:#x}): {error}") from None
            if event.en:
                self.switches[event.cpu] = True
        self.running = bool(self.events)

    def stop(self) -> None:
        """tstop: each event's values kept for GDB, its counter released."""
        counters = self.machine.counters
        for event in self.events.values():
            if event.counter is not None:
                value = counters.close(event.counter)
                event.last = (value.value, value.enabled_ns, value.running_ns)
                event.counter = None
        self.running = False

    def check_access(self, programs, where: str) -> None:
        """tstart: refuse the reads and writes KGTP's action checker refuses."""
        for program in programs:
            for insn in program.insns:
                if insn.name not in ("getv", "tracev", "setv") or insn.operands[0] not in self.names:
                    continue
                name = self.names[insn.operands[0]]
                allowed = AGENT_WRITE if insn.name == "setv" else AGENT_READ
                if name.field not in allowed:
                    verb = "set" if insn.name == "setv" else "read"
                    raise TraceError(f"{where}: perf event trace state variable pe_{name.field}_{name.event} "
                                     f"cannot be {verb} by a tracepoint")

    # ---- at a hit (CPU thread) -------------------------------------------------------------------------------

    def _event_of(self, number: int, cpu: int) -> PerfEvent | None:
        name = self.names[number]
        if name.per_cpu and name.cpu is None:  # the local form: the hitting CPU's variable of its group
            for other in self.names.values():
                if other.per_cpu and other.group == name.group and other.cpu == cpu:
                    return self.events.get((True, other.event))
            return None
        return self.events.get((name.per_cpu, name.event))

    def get(self, number: int, cpu: int, site: int | None = None) -> int | None:
        """A read: at a hit on `cpu` (standing at probe `site`, if any), or by GDB (qTV, cpu the loaded one)."""
        name = self.names[number]
        event = self._event_of(number, cpu)
        if name.field not in AGENT_READ:
            return 0  # GDB reads the other fields as 0 (gtp_gdbrsp_qtv)
        if event is None:
            return 0
        if event.counter is None:
            values = event.last
        else:
            read = event.counter.read(site)
            values = (read.value, read.enabled_ns, read.running_ns)
        return values[("val", "enabled", "running").index(name.field)] & _MASK

    def set(self, number: int, value: int, cpu: int, site: int | None = None) -> None:
        """An action's write of `en` or `val` (the only fields it may set) at a hit on `cpu`."""
        name = self.names[number]
        event = self._event_of(number, cpu)
        if event is None or event.counter is None:
            return
        if name.field == "val":
            event.counter.write(value & _MASK, site)
        elif name.field == "en":
            event.en = bool(value)
            counting = event.en and (event.cpu != cpu or self.switches.get(event.cpu, False))
            if counting:
                event.counter.enable(site if event.cpu == cpu else None)
            else:
                event.counter.disable(site if event.cpu == cpu else None)

    def switch(self, cpu: int, value: int, site: int | None = None) -> None:
        """`$p_pe_en = value` at a hit on `cpu`: every event of that CPU on or off (gtp_pc_pe_en)."""
        on = bool(value)
        self.switches[cpu] = on
        for event in self.events.values():
            if event.cpu != cpu or event.counter is None:
                continue
            event.en = on
            if on:
                event.counter.enable(site)
            else:
                event.counter.disable(site)

    def reads_or_writes(self, programs) -> bool:
        """Does any of these programs use a perf-event variable (then it runs on the Python hit path)?"""
        return any(insn.name in ("getv", "tracev", "setv") and insn.operands[0] in self.names
                   for program in programs for insn in program.insns)
