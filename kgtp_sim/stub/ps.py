"""`monitor ps` and `monitor run` in KGTP mode: the kernel's tasks as ps lists them, and a program of the machine's
initramfs started as a process.

`ps` reads the kernel's own records, as a debugger of a Linux kernel would: `tasks[]` (pid, comm, state, CPU,
tgid) and `task_cputime[]` (user and system time, charged by each CPU's tick to the mode it interrupted: the kernel's
account_process_tick, fixtures/kernel/process.c), at the offsets its DWARF gives, found once on first use. `run`
starts only a program already in the machine's initramfs (packed before boot by `serve --run` or `serve --with`):
the starting itself is the caller's (`Launcher` in kgtp_sim/programs.py), so no monitor command reads a host file.

Runs on the server thread, reading the machine's memory while its CPUs run (a listing is not one instant, as ps's
is not either).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass

from ..machine import Machine
from ..machine.process import SpawnError
from .monitor import Monitor, MonitorUsageError

log = logging.getLogger(__name__)

#: task_struct.state as ps shows it (fixtures/kernel/include/kernel.h's values, Linux's letters)
STATES = {0: "R", 1: "S", 2: "D", 8: "t", 0x20: "Z"}
TASK_DEAD = 0x80  # a free process slot: not listed
NSEC_PER_SEC = 1_000_000_000


@dataclass(frozen=True)
class TaskRow:
    pid: int
    comm: str
    state: str
    cpu: int
    utime_ns: int
    stime_ns: int
    tgid: int
    process: bool  # a task of a user process (mm set), not a kernel thread


@dataclass(frozen=True)
class _Layout:
    """Where the kernel keeps what ps shows (from its DWARF)."""

    tasks: int
    count: int
    size: int
    fields: dict[str, int]  # task_struct member -> offset: pid, comm, state, cpu, tgid, mm
    comm_length: int
    cputime: int | None  # task_cputime[]: None on a kernel that does not account it
    cputime_size: int
    utime: int
    stime: int


class TaskTable:
    """The kernel's tasks, read from its memory at the offsets of its DWARF."""

    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        self._layout: _Layout | None = None

    def layout(self) -> _Layout:
        if self._layout is None:
            self._layout = self._read_layout()
        return self._layout

    def _read_layout(self) -> _Layout:
        from ..machine.dwarf import KernelDwarf

        dwarf = KernelDwarf(self.machine.image.path)
        try:
            found = dwarf.global_variable("tasks")
            if found is None or found[1].kind != "array" or found[1].target is None:
                raise LookupError("the kernel has no tasks[] array in its DWARF")
            address, array = found
            task = array.target
            fields = {name: task.member(name)[0] for name in ("pid", "comm", "state", "cpu", "tgid", "mm")}
            comm_length = task.member("comm")[1].size
            cputime, cputime_size, utime, stime = None, 0, 0, 0
            accounted = dwarf.global_variable("task_cputime")
            if accounted is not None and accounted[1].target is not None:
                cputime, element = accounted[0], accounted[1].target
                cputime_size, utime, stime = element.size, element.member("utime")[0], element.member("stime")[0]
            return _Layout(address, array.count or 0, task.size, fields, comm_length, cputime, cputime_size, utime,
                           stime)
        finally:
            dwarf.close()

    def rows(self) -> list[TaskRow]:
        """Every task that exists (not the free process slots, nor the tasks of CPUs the machine lacks), in the
        order of tasks[]."""
        layout = self.layout()
        raw = self.machine.read_memory(layout.tasks, layout.count * layout.size)
        times = (self.machine.read_memory(layout.cputime, layout.count * layout.cputime_size)
                 if layout.cputime is not None else b"")
        rows = []
        for index in range(layout.count):
            base = index * layout.size

            def field(name: str, form: str) -> int:
                return struct.unpack_from(form, raw, base + layout.fields[name])[0]

            state, cpu = field("state", "<q"), field("cpu", "<i")
            if state == TASK_DEAD or not 0 <= cpu < self.machine.cpu_count:
                continue
            comm_at = base + layout.fields["comm"]
            comm = raw[comm_at:comm_at + layout.comm_length].split(b"\0", 1)[0].decode("latin-1")
            utime = stime = 0
            if times:
                at = index * layout.cputime_size
                utime = struct.unpack_from("<Q", times, at + layout.utime)[0]
                stime = struct.unpack_from("<Q", times, at + layout.stime)[0]
            rows.append(TaskRow(field("pid", "<i"), comm, STATES.get(state, f"{state:#x}"), cpu, utime, stime,
                                field("tgid", "<i"), bool(field("mm", "<Q"))))
        return rows


def _seconds(ns: int) -> str:
    return f"{ns / NSEC_PER_SEC:.3f}"


def format_rows(rows: list[TaskRow]) -> str:
    """ps's kind of table: pid first, then comm, state, CPU, user and system time (seconds), and the thread
    group (the process a thread belongs to)."""
    lines = [f"{'PID':>5}  {'COMM':<16}  S  CPU  {'USER':>8}  {'SYSTEM':>8}  {'TGID':>5}"]
    lines += [f"{row.pid:>5}  {row.comm:<16}  {row.state}  {row.cpu:>3}  {_seconds(row.utime_ns):>8}  "
              f"{_seconds(row.stime_ns):>8}  {row.tgid:>5}" for row in rows]
    return "\n".join(lines)


#: `monitor run`'s starter: (program as the user named it, its arguments) -> the new process's pid; raises
#: LookupError for a program that is not in the machine, SpawnError for one the kernel refused
Launch = Callable[[str, list[str]], int]


def register_process_commands(monitor: Monitor, machine: Machine, launch: Launch | None) -> None:
    """`ps`, and `run` of the programs packed before boot (`launch`; None: none were, and `run` says so)."""
    table = TaskTable(machine)

    @monitor.register("ps", "ps", "the kernel's tasks: pid, comm, state, CPU, user and system time, thread group")
    def ps(args: list[str]) -> str:
        try:
            return format_rows(table.rows())
        except (LookupError, KeyError) as error:
            return f"monitor ps: cannot read the kernel's tasks: {error}"

    @monitor.register("run", "run PROG [ARG...]",
                      "start PROG (a program packed at boot: serve --run or --with) as a process; prints its pid")
    def run(args: list[str]) -> str:
        if not args:
            raise MonitorUsageError("which program?")
        if launch is None:
            return "monitor run: no program was packed at boot (kgtp-sim serve --run 'PROG ARGS' or --with PROG)"
        try:
            pid = launch(args[0], args[1:])
        except LookupError as error:
            raise MonitorUsageError(str(error).strip("'\"")) from None
        except SpawnError as error:
            return f"monitor run: {error}"
        return f"started {' '.join(args)} as pid {pid}"
