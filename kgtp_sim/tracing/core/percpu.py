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

Where the copies live. In an interpreting run, here. In a compiled run, in emulated memory (`attach`): copy `cpu`
of the i-th base name at `address + 8 * (i * cpus + cpu)`, so detours read and write them natively: a detour of a
location using per-CPU variables loads the hitting CPU's copies (`%gs:0x8`) into the run's shared array of
variables when it starts and stores them back when it ends (`builtins.native_refresh_asm`, `detour.build`); the
stub's code is never interleaved between CPUs (docs/DESIGN.md, Several CPUs), so the shared slots are the
hitting CPU's for the whole hit. The Python hit path reads and writes the same memory.
"""

from __future__ import annotations

import struct
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
        self.copies: dict[str, list[int]] = {}  # base name -> one value per CPU (before `attach`)
        self._memory = None  # the emulated memory holding the copies of a compiled run (`attach`)
        self._address = 0

    def define(self, variables) -> None:
        """At tstart: the per-CPU variables among `variables` (number -> TraceVariable), copies reset."""
        self.names, self.copies, self._memory = {}, {}, None
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

    def size(self) -> int:
        """Bytes the copies take in emulated memory."""
        return 8 * len(self.copies) * self.cpus

    def attach(self, memory, address: int) -> None:
        """From now on keep the copies at `address` in `memory` (read/write of emulated memory), starting with
        their values so far."""
        self._memory, self._address = memory, address
        values = [value for base in self.copies for value in self.copies[base]]
        memory.write(address, struct.pack(f"<{len(values)}q", *values))

    @property
    def attached(self) -> bool:
        return self._memory is not None

    def copy_address(self, number: int, cpu: int = 0) -> int:
        """Where variable `number`'s copy for `cpu` is (for the local form, `cpu`'s; for a form naming a CPU,
        that CPU's whatever `cpu` is). Only once attached."""
        name = self.names[number]
        return self._copies_of(name.base) + 8 * (name.cpu if name.cpu is not None else cpu)

    def _copies_of(self, base: str) -> int:
        """Where CPU 0's copy of the variables named `base` is; CPU k's follows at + 8 * k."""
        return self._address + 8 * self.cpus * list(self.copies).index(base)

    def values(self, base: str) -> list[int]:
        """Every CPU's copy of the variables named `base`."""
        if self._memory is None:
            return list(self.copies[base])
        return list(struct.unpack(f"<{self.cpus}q", self._memory.read(self._copies_of(base), 8 * self.cpus)))

    def get(self, number: int, cpu: int) -> int:
        name = self.names[number]
        index = name.cpu if name.cpu is not None else cpu
        if index >= self.cpus:
            return 0
        if self._memory is not None:
            return struct.unpack("<q", self._memory.read(self.copy_address(number, index), 8))[0]
        return self.copies[name.base][index]

    def set(self, number: int, cpu: int, value: int) -> None:
        name = self.names[number]
        index = name.cpu if name.cpu is not None else cpu
        if index >= self.cpus:
            return
        if self._memory is not None:
            self._memory.write(self.copy_address(number, index), struct.pack("<Q", value & (2**64 - 1)))
        else:
            self.copies[name.base][index] = value
