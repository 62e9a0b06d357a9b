"""`monitor` commands about the machine itself: statistics, tick rate, workload pace, kernel console."""

from __future__ import annotations

import dataclasses
import time

from ..machine import Machine
from .monitor import Monitor, parse_int


def register_machine_commands(monitor: Monitor, machine: Machine, started: float) -> None:
    @monitor.register("stats", "stats", "emulated instructions, uptime, ticks, probe hits and other counters")
    def stats(args: list[str]) -> str:
        figures = machine.stats()
        rows = dataclasses.asdict(figures) if dataclasses.is_dataclass(figures) else dict(vars(figures))
        rows.setdefault("stub_uptime_s", round(time.monotonic() - started, 3))
        width = max(len(k) for k in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows.items())

    @monitor.register("hz", "hz [N]", "show or set the timer tick rate (1..10000 Hz)")
    def hz(args: list[str]) -> str:
        if args:
            machine.set_hz(parse_int(args[0], "hz", low=1, high=10000))
        return f"hz {machine.hz}"

    @monitor.register("pace", "pace [N]", "show or set kgtp_test_function calls per tick (0..1000000)")
    def pace(args: list[str]) -> str:
        if args:
            machine.set_pace(parse_int(args[0], "pace", low=0, high=1_000_000))
        return f"pace {machine.pace}"

    @monitor.register("console", "console", "the kernel's recent console output")
    def console(args: list[str]) -> str:
        return machine.console_text() or "(no console output)"
