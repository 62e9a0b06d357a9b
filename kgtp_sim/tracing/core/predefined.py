"""Trace state variables a target defines for itself besides KGTP's (builtins.py): gdbserver's `$trace_timestamp`,
which the gdbserver role's tracer has and KGTP mode's has not.

gdbserver (gdbserver/tracepoint.cc, initialize_tracepoint) creates variable 1 at start-up, names it
`trace_timestamp` and gives it a getter, get_timestamp: std::chrono::steady_clock now, in microseconds
(CLOCK_MONOTONIC on Linux). Here it takes the number after KGTP's table (`gdbserver_variables`), since the role's
tracer has KGTP's variables too; GDB goes by the name. What gdbserver does with it, and so the role:

- qTfV/qTsV upload it as a built-in (`N:0:1:<hex name>`, cmd_qtfv's response_tsv), so a GDB that connects lists it
  in `info tvariables` before defining any of its own;
- a condition or action reading it (`getv`, `tracev`: `collect $trace_timestamp`, `teval`) gets the clock at that
  moment: get_trace_state_variable_value calls the getter at every read;
- an assignment (`teval $trace_timestamp = 7`, `setv`) is taken and has no effect: the getter replaces the value
  at the next read, so a frame records the clock, never the assigned number (gdbserver refuses nothing, and runs
  nothing else differently); GDB's own `print $trace_timestamp = 7` is refused by GDB (not an lvalue);
- QTDV (GDB sends every variable it knows at tstart, `tvariable $trace_timestamp = 5` included) keeps GDB's initial
  value for the next upload and changes nothing else (cmd_qtdv);
- qTV without a selected frame answers unknown (`U`) before the first run, then the clock (cmd_qtv); in a frame,
  what the frame collected.

Pure: the table is fixed when the tracer is made; the clock is read on the CPU thread at hits and on the server
thread for GDB's qTV.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .model import TraceVariable

#: gdbserver's name of its clock variable
TRACE_TIMESTAMP = "trace_timestamp"


def steady_clock_us() -> int:
    """gdbserver's get_timestamp: the monotonic clock (std::chrono::steady_clock, CLOCK_MONOTONIC) in
    microseconds."""
    return time.monotonic_ns() // 1000


@dataclass(frozen=True)
class Predefined:
    """One variable the target defines: its number and name, and the getter every read of it calls."""

    number: int
    name: str
    getter: Callable[[], int]

    def definition(self) -> TraceVariable:
        """As GDB gets it (qTfV): built in, initial value 0; QTDV may change the initial value it is uploaded with."""
        return TraceVariable(self.number, 0, True, self.name, settable=True)


@dataclass(frozen=True)
class PredefinedVariables:
    """The variables a tracer defines besides KGTP's, by number (none: KGTP mode)."""

    variables: dict[int, Predefined] = field(default_factory=dict)

    def __contains__(self, number: object) -> bool:
        return number in self.variables

    def definitions(self) -> list[TraceVariable]:
        return [variable.definition() for variable in self.variables.values()]

    def value(self, number: int) -> int:
        """The getter's value now (gdbserver's get_trace_state_variable_value)."""
        return self.variables[number].getter()

    def used_by(self, programs: Iterable) -> bool:
        """Does any of these verified programs read or write one of them (then it runs on the Python hit path,
        where the getter runs)?"""
        return any(insn.name in ("getv", "tracev", "setv") and insn.operands[0] in self.variables
                   for program in programs for insn in program.insns)


def gdbserver_variables(number: int, clock: Callable[[], int] = steady_clock_us) -> PredefinedVariables:
    """gdbserver's predefined variables, `$trace_timestamp` numbered `number`."""
    return PredefinedVariables({number: Predefined(number, TRACE_TIMESTAMP, clock)})
