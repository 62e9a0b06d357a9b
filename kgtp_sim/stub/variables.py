"""GDB's numbers of trace state variables and the tracer's, where they differ: the gdbserver role.

KGTP mode uploads KGTP's special variables at connection (qTfV), so GDB numbers them as the tracer does (1 to 48)
and numbers its own after them: one numbering. gdbserver uploads only `$trace_timestamp` (its number 1), so GDB
numbers the user's variables from 2 on, numbers the tracer gives KGTP's variables. The role offers what gdbserver
offers: KGTP's variables exist in a session only when the user declares one by its KGTP name (`tvariable
$current_task_pid`, and GDB downloads it by that name at tstart), or all of them with `kgtp-sim gdbserver
--kgtp-variables` (then the numbering is KGTP mode's and this table is not used).

`VariableNumbers` maps one to the other at the protocol's edge (stub/trace.py), so that the tracer, its engines and
its frames keep their own numbers:

- QTDV (`declare`): a name of the tracer's (KGTP's table, gdbserver's `trace_timestamp`) is that variable; any other
  (the user's, KGTP's per-CPU and perf-event variables, which are the user's by name) gets a number of its own
  above every number the tracer uses;
- bytecode (getv, setv, tracev) is renumbered before the tracer sees it (at tstart, when GDB has sent every
  variable, or when a tracepoint arrives during a run), and back for an upload (qTfP);
- qTV, qTfV/qTsV, a frame's `V` blocks (qTBuffer, tsave -r) and its traceframe-info speak GDB's numbers; a variable
  GDB has no number for (one the tracer collects by itself) is left out of them.

A number GDB uses without having declared it (a tracepoint downloaded during a run that names a variable created
since tstart) gets a number of its own too, as gdbserver creates a variable it is asked about.

Pure; used on the RSP session's thread.
"""

from __future__ import annotations

from collections.abc import Iterable


class VariableNumbers:
    """GDB's variable numbers (the wire's) <-> the tracer's."""

    def __init__(self, tracer_names: dict[str, int], uploaded: dict[str, int], first_free: int) -> None:
        """`tracer_names`: name -> the tracer's number, for every variable it defines itself; `uploaded`: the
        ones uploaded at connection, name -> GDB's number (gdbserver's `trace_timestamp`: 1); `first_free`: above
        every number the tracer uses."""
        self._names = dict(tracer_names)
        self._next = first_free
        self._to_tracer: dict[int, int] = {}
        self._to_wire: dict[int, int] = {}
        self._user: dict[int, str] = {}  #: the tracer's numbers given to GDB's own variables, and their names
        for name, wire in uploaded.items():
            self._bind(wire, self._names[name])

    def _bind(self, wire: int, tracer: int) -> None:
        old = self._to_tracer.pop(wire, None)
        if old is not None:
            self._to_wire.pop(old, None)
        stale = self._to_wire.pop(tracer, None)
        if stale is not None:
            self._to_tracer.pop(stale, None)
        self._to_tracer[wire] = tracer
        self._to_wire[tracer] = wire

    def _fresh(self) -> int:
        number, self._next = self._next, self._next + 1
        return number

    def declare(self, wire: int, name: str) -> int:
        """QTDV: GDB's variable `wire` is `$name`; returns the tracer's number for it (the same one each time GDB
        downloads it again)."""
        tracer = self._names.get(name)
        if tracer is None:
            current = self._to_tracer.get(wire)
            if current is not None and self._user.get(current) in (name, ""):
                tracer = current  # declared before, or used before it was declared
            else:
                tracer = self._fresh()
            self._user[tracer] = name
        self._bind(wire, tracer)
        return tracer

    def tracer(self, wire: int) -> int:
        """The tracer's number of GDB's `wire`; one of its own when GDB never declared it."""
        found = self._to_tracer.get(wire)
        if found is None:
            found = self._fresh()
            self._user[found] = ""
            self._bind(wire, found)
        return found

    def known(self, wire: int) -> int | None:
        """The tracer's number of GDB's `wire`, None if GDB never declared nor used it."""
        return self._to_tracer.get(wire)

    def wire(self, tracer: int) -> int | None:
        """GDB's number of the tracer's `tracer`, None where GDB has none."""
        return self._to_wire.get(tracer)

    def uploaded(self, numbers: Iterable[int]) -> list[tuple[int, int]]:
        """(tracer's, GDB's) of those of `numbers` GDB has a number for."""
        return [(n, self._to_wire[n]) for n in numbers if n in self._to_wire]
