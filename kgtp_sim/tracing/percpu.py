"""KGTP's per-CPU trace state variables: `$p_NAME` / `$per_cpu_NAME`, one copy per CPU.

Owns the naming rules and the copies; no thread of its own (values are read and written on the CPU thread by
hits, and by the server thread for GDB's qTV, through `Tracer`).

The rules are KGTP's (gtp.c, gtp_gdbrsp_qtdv and gtp_var_get_pc):

- a variable whose name starts with `p_` or `per_cpu_` has one copy per CPU; a condition or action reads and
  writes the copy of the CPU it runs on (`this_cpu_ptr`);
- trailing decimal digits name one CPU's copy: `$p_hits1` is CPU 1's copy of `$p_hits` (the name without them);
  every variable of one such base name shares the copies, whichever was defined first; at least one character
  of the name stays (`$p_7` is the local copy of `p_7`); a CPU number not below `$cpu_number` is refused (QTDV
  errors, as KGTP's "id is bigger than cpu number");
- at each tstart every copy starts at 0, then each variable naming a CPU sets that copy to its initial value; the
  initial value of a variable without a CPU number is uploaded to GDB but no copy takes it (KGTP sets only
  `per_cpu_ptr(pc, cpu)` when the id is given);
- GDB reading a variable outside a frame (qTV) reads the copy it names, or for the local form the copy of the CPU
  loaded in the machine (KGTP: of the CPU the reading process runs on).

The compiled engines keep one array of variables shared by every CPU; a location that reads or writes a per-CPU
variable runs on the Python hit path in every engine (`builtins.runs_natively`), where the hitting CPU is known.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIXES = ("p_", "per_cpu_")


@dataclass(frozen=True)
class PerCpuName:
    base: str  #: the name without its CPU number: the copies it shares
    cpu: int | None  #: the CPU whose copy it names; None: the hitting CPU's


def parse(name: str) -> PerCpuName | None:
    """The per-CPU form of a variable name (without `$`), or None for an ordinary variable."""
    prefix = next((p for p in PREFIXES if name.startswith(p)), None)
    if prefix is None:
        return None
    rest = name[len(prefix):]
    if not rest:
        return None  # KGTP needs a name after the prefix
    digits = len(rest) - len(rest.rstrip("0123456789"))
    digits = min(digits, len(rest) - 1)
    if not digits:
        return PerCpuName(name, None)
    return PerCpuName(name[: len(name) - digits], int(rest[len(rest) - digits:]))


class PerCpuVariables:
    """The copies of one run's per-CPU variables."""

    def __init__(self, cpus: int) -> None:
        self.cpus = cpus
        self.names: dict[int, PerCpuName] = {}  # variable number -> its per-CPU name
        self.copies: dict[str, list[int]] = {}  # base name -> one value per CPU

    def define(self, variables) -> None:
        """At tstart: the per-CPU variables among `variables` (number -> TraceVariable), copies reset."""
        self.names, self.copies = {}, {}
        for number in sorted(variables):
            variable = variables[number]
            if variable.builtin or not variable.name:
                continue
            name = parse(variable.name)
            if name is None:
                continue
            if name.cpu is not None and name.cpu >= self.cpus:
                continue  # refused at QTDV (`check`); a stale definition never names a missing CPU
            self.names[number] = name
            copies = self.copies.setdefault(name.base, [0] * self.cpus)
            if name.cpu is not None:
                copies[name.cpu] = variable.initial

    def check(self, name: str) -> None:
        """QTDV: refuse a CPU number the machine does not have."""
        parsed = parse(name)
        if parsed is not None and parsed.cpu is not None and parsed.cpu >= self.cpus:
            raise ValueError(f"${name}: CPU {parsed.cpu} is not below the CPU count {self.cpus}")

    def __contains__(self, number: int) -> bool:
        return number in self.names

    def _slot(self, number: int, cpu: int) -> tuple[list[int], int]:
        name = self.names[number]
        return self.copies[name.base], name.cpu if name.cpu is not None else cpu

    def get(self, number: int, cpu: int) -> int:
        copies, index = self._slot(number, cpu)
        return copies[index] if index < len(copies) else 0

    def set(self, number: int, cpu: int, value: int) -> None:
        copies, index = self._slot(number, cpu)
        if index < len(copies):
            copies[index] = value
