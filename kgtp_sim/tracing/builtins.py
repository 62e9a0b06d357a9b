"""KGTP's built-in trace state variables, reported to GDB through qTfV like any other.

Each has a fixed number and name. Computed ones are evaluated at the hit (`getv` in a condition or `collect
$current_task_pid` see the value of that moment); plain ones (`$ignore_error`, `$bt`) are settings the user
changes with `tvariable $ignore_error = 1` or `teval`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from unicorn import Uc

from .model import TraceVariable


@dataclass(frozen=True)
class BuiltinContext:
    uc: Uc
    machine: object
    tsc: object

    def kernel_u64(self, symbol: str) -> int:
        address = self.machine.image.address_of(symbol)  # type: ignore[attr-defined]
        return int.from_bytes(self.uc.mem_read(address, 8), "little")


@dataclass(frozen=True)
class Builtin:
    number: int
    name: str
    initial: int = 0
    compute: Callable[[BuiltinContext], int] | None = None
    summary: str = ""

    @property
    def computed(self) -> bool:
        return self.compute is not None

    def definition(self) -> TraceVariable:
        return TraceVariable(self.number, self.initial, True, self.name)


def _current_pid(ctx: BuiltinContext) -> int:
    task = ctx.kernel_u64("current")
    return int.from_bytes(ctx.uc.mem_read(task, 4), "little", signed=True)  # task_struct.pid is its first member


def _rdtsc(ctx: BuiltinContext) -> int:
    return ctx.tsc.read()  # type: ignore[attr-defined]


def _clock(ctx: BuiltinContext) -> int:
    return ctx.tsc.to_ns(ctx.tsc.read())  # type: ignore[attr-defined]


class BuiltinTable(tuple):
    def by_number(self, number: int) -> Builtin | None:
        return next((b for b in self if b.number == number), None)

    def by_name(self, name: str) -> Builtin:
        return next(b for b in self if b.name == name)


#: `$bt` holds how many bytes of stack `collect $bt` records (KGTP's default is 1 KiB).
BT_DEFAULT = 1024

BUILTIN_VARIABLES = BuiltinTable((
    Builtin(1, "cpu_id", compute=lambda ctx: 0, summary="the CPU the hit ran on (the machine has one)"),
    Builtin(2, "current_task", compute=lambda ctx: ctx.kernel_u64("current"), summary="address of `current`"),
    Builtin(3, "current_task_pid", compute=_current_pid, summary="current->pid"),
    Builtin(4, "clock", compute=_clock, summary="nanoseconds, from the TSC"),
    Builtin(5, "rdtsc", compute=_rdtsc, summary="the TSC"),
    Builtin(6, "ignore_error", summary="non-zero: an error in a condition or action skips the hit instead of stopping"),
    Builtin(7, "bt", initial=BT_DEFAULT, summary="bytes of stack `collect $bt` records"),
))
