"""`monitor` commands about the machine itself: statistics, CPUs, tick rate, workload pace, kernel console, and a
stop without a breakpoint (`stop`, `go`: the machine's run control, machine/runcontrol.py).

Runs on the server thread; the machine answers through its CPU thread (`Machine.run_on_cpu`)."""

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

    @monitor.register("cpus", "cpus", "each CPU: running, idle or offline, where it is, its task, its ticks")
    def cpus(args: list[str]) -> str:
        ticks = machine.stats(count=False).ticks_per_cpu
        lines = []
        for cpu in machine.cpu_states():
            where = machine.image.function_bounds(cpu.rip)
            name = f"{where[0]}+{cpu.rip - where[1]:#x}" if where else "?"
            lines.append(f"CPU {cpu.index}  {cpu.state:<7}  rip {cpu.rip:#018x} ({name})  task {cpu.current_task:#x}"
                         f"  ticks {ticks[cpu.index] if cpu.index < len(ticks) else 0}")
        return "\n".join(lines)

    @monitor.register("console", "console", "the kernel's recent console output")
    def console(args: list[str]) -> str:
        return machine.console_text() or "(no console output)"

    def where(cpu: int) -> str:
        rip = machine.registers(cpu)["rip"]
        bounds = machine.image.function_bounds(rip)
        return f"CPU {cpu} at {rip:#x}" + (f" ({bounds[0]}+{rip - bounds[1]:#x})" if bounds else "")

    @monitor.register("stop", "stop", "stop every CPU, and the kernel's time, until `continue` or `monitor go`")
    def stop(args: list[str]) -> str:
        if machine.control.stopped:
            return "the machine is stopped already"
        event = machine.control.stop()
        return (f"machine stopped: {', '.join(where(cpu) for cpu in range(machine.cpu_count))} (CPU {event.cpu} "
                "was running); GDB shows registers it read before until it reads them again (`maint flush "
                "register-cache`); `continue` or `monitor go` resumes")

    @monitor.register("go", "go", "let every CPU run again (after `monitor stop` or a breakpoint)")
    def go(args: list[str]) -> str:
        if not machine.control.stopped:
            return "the machine is running"
        machine.control.resume()
        return "machine running"
