"""`monitor` commands about the machine itself: statistics, CPUs, tick rate, workload pace, kernel console, the
performance counters (`perf`, as `perf stat -a -A` prints them), a stop without a breakpoint (`stop`, `go`:
the machine's run control, machine/runcontrol.py), and the process breakpoints at user addresses belong to
(`process`: stub/kernel.py).

Runs on the server thread; the machine answers through its CPU thread (`Machine.run_on_cpu`)."""

from __future__ import annotations

import dataclasses
import time

from typing import TYPE_CHECKING

from ..machine import Machine
from ..machine.counters import Counter, EventAttr, HwEvent, PerfType, SwEvent
from .monitor import Monitor, MonitorUsageError, parse_int

if TYPE_CHECKING:
    from .kernel import KernelTarget

#: what `monitor perf on` counts on every CPU: perf stat's default events, and the user-mode share of the
#: instructions (ring 3)
PERF_STAT_EVENTS = (
    EventAttr(PerfType.SOFTWARE, SwEvent.CPU_CLOCK),
    EventAttr(PerfType.SOFTWARE, SwEvent.TASK_CLOCK),
    EventAttr(PerfType.SOFTWARE, SwEvent.CONTEXT_SWITCHES),
    EventAttr(PerfType.SOFTWARE, SwEvent.CPU_MIGRATIONS),
    EventAttr(PerfType.SOFTWARE, SwEvent.PAGE_FAULTS),
    EventAttr(PerfType.HARDWARE, HwEvent.CPU_CYCLES),
    EventAttr(PerfType.HARDWARE, HwEvent.INSTRUCTIONS),
    EventAttr(PerfType.HARDWARE, HwEvent.INSTRUCTIONS, exclude_kernel=True),
    EventAttr(PerfType.HARDWARE, HwEvent.BRANCH_INSTRUCTIONS),
)


class PerfStat:
    """`monitor perf`: counters of every CPU opened by `on`, printed like `perf stat -a -A`, closed by `off`."""

    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        self.counters: list[Counter] = []
        self.since = 0.0

    def on(self) -> str:
        if self.counters:
            return "perf: already counting (monitor perf off stops)"
        machine = self.machine

        def open_all(uc) -> list[Counter]:
            return [machine.counters.open(cpu, attr, enabled=True) for cpu in range(machine.cpu_count)
                    for attr in PERF_STAT_EVENTS]

        self.counters = machine.run_on_cpu(open_all)
        self.since = time.monotonic()
        return f"perf: counting on {machine.cpu_count} CPUs (monitor perf shows the counts, monitor perf off stops)"

    def off(self) -> str:
        if not self.counters:
            return "perf: not counting"
        text = self.show()
        counters, self.counters = self.counters, []
        self.machine.run_on_cpu(lambda uc: [self.machine.counters.close(counter) for counter in counters])
        return text + "\nperf: stopped"

    def show(self) -> str:
        if not self.counters:
            return "perf: not counting (monitor perf on starts)"
        values = self.machine.run_on_cpu(lambda uc: [counter.read().value for counter in self.counters])
        elapsed = time.monotonic() - self.since
        cpus = self.machine.cpu_count
        lines = [f" Performance counter stats for the machine ({cpus} CPU{'s' if cpus > 1 else ''}, "
                 f"since monitor perf on):", ""]
        per_cpu = len(PERF_STAT_EVENTS)
        for cpu in range(cpus):
            counted = {attr.name: value for attr, value in zip(PERF_STAT_EVENTS, values[cpu * per_cpu:])}
            for attr in PERF_STAT_EVENTS:
                lines.append(_perf_line(cpu, attr.name, counted[attr.name], counted, elapsed))
            lines.append("")
        lines.append(f"{elapsed:14.9f} seconds time elapsed")
        return "\n".join(lines)


def _perf_line(cpu: int, name: str, value: int, counted: dict[str, int], elapsed: float) -> str:
    """One row as perf stat prints it: the count (milliseconds for the clocks), the event, a ratio."""
    note = ""
    if name in ("cpu-clock", "task-clock"):
        shown = f"{value / 1e6:,.2f} msec"
        if elapsed > 0:
            note = f"#  {value / 1e9 / elapsed:6.3f} CPUs utilized" if name == "cpu-clock" else \
                f"#  {value / 1e9 / elapsed:6.3f} CPUs running (turns on the emulator)"
    else:
        shown = f"{value:,}     "
        seconds = counted["task-clock"] / 1e9
        if name in ("context-switches", "cpu-migrations", "page-faults") and elapsed > 0:
            note = f"#  {value / elapsed:10.3f} /sec"
        elif name == "cycles" and seconds > 0:
            note = f"#  {value / 1e9 / seconds:6.3f} GHz"
        elif name == "instructions" and counted["cycles"]:
            note = f"#  {value / counted['cycles']:6.2f}  insn per cycle"
        elif name == "branches" and seconds > 0:
            note = f"#  {value / 1e6 / seconds:10.3f} M/sec"
    return f"CPU{cpu:<3}{shown:>22}  {name:<20}{note}".rstrip()


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

    perf = PerfStat(machine)

    @monitor.register("perf", "perf [on|off]", "the machine's performance counters of each CPU, as perf stat -a -A")
    def perf_stat(args: list[str]) -> str:
        if not args:
            return perf.show()
        if args[0] == "on":
            return perf.on()
        if args[0] == "off":
            return perf.off()
        raise MonitorUsageError(f"perf takes on or off, not {args[0]!r}")

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


def register_process_command(monitor: Monitor, target: KernelTarget) -> None:
    @monitor.register("process", "process [PID|auto]",
                      "the process breakpoints at user addresses stop in (auto: the one that maps the address)")
    def process(args: list[str]) -> str:
        if args:
            if args[0] == "auto":
                target.process = None
            else:
                pid = parse_int(args[0], "process", low=1, high=2**31 - 1)
                running = target.processes.spaces()
                if pid not in running:
                    raise MonitorUsageError(f"no process {pid} runs (processes: "
                                            f"{', '.join(map(str, sorted(running))) or 'none'})")
                target.process = pid
        if target.process is None:
            return ("breakpoints at user addresses: in the one process that maps the address (processes: "
                    f"{', '.join(map(str, sorted(target.processes.spaces()))) or 'none'})")
        return (f"breakpoints at user addresses: in process {target.process} (GDB inserts them again at each "
                "continue)")
