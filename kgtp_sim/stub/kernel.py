"""KGTP mode's target: the running kernel of the simulated machine, as GDB sees it through KGTP.

The first implementation of the target interface (stub/target.py). Its threads are the machine's CPUs, as QEMU's
gdbstub shows them: thread k+1 is CPU k, every CPU listed, also one the kernel has not started yet (its extra info
says `offline`), so `info threads` shows the machine's CPU count from the start. Registers are the live ones of
the CPU a thread names, memory the kernel's (one address space, shared by every CPU), both read coherently
through the machine (`Machine.registers(cpu=...)`, `Machine.read_memory`, which run the read on the CPU thread).

A selected trace frame or a replay (stub/overlay.py) is laid over the live kernel: while there is one, registers
and memory come from it, whichever thread GDB selected. The kernel never stops: `?` and Ctrl-C report a SIGTRAP of
the thread GDB looks at, `c` only waits for the user's Ctrl-C, and step, reverse execution and software
breakpoints exist only in a replay of a while-stepping recording (stub/replay.py), whose breakpoints never touch
kernel memory. Registers are never written; memory only with --allow-writes and nothing selected.

Runs on the server thread, as every handler that calls it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..machine import Machine, MemoryFault
from ..rsp.dispatch import E_PERMISSION, RspError
from ..tracing.core.frames import ViewError
from .live import LiveView
from .overlay import FrameOverlay
from .replay import Replay
from .target import (Breakpoints, BreakpointType, MemoryWrites, ReplayLog, Resume, ResumeAction, Reverse,
                     Running, Signal, Stop, Target)

log = logging.getLogger(__name__)

#: What GDB reads of a task's name (TASK_COMM_LEN).
COMM_LENGTH = 16


def thread_of(cpu: int) -> int:
    return cpu + 1


def cpu_of(thread: int) -> int:
    return thread - 1


@dataclass
class TaskNames:
    """Reads the name (`comm`) of the task a CPU runs, at the offset the kernel's DWARF gives `struct task_struct`'s
    `comm` (found once, on first use: the stub starts without reading the DWARF)."""

    machine: Machine
    comm_offset: int | None = None
    _looked_up: bool = field(default=False, init=False)

    def _offset(self) -> int | None:
        if self.comm_offset is None and not self._looked_up:
            self._looked_up = True
            self.comm_offset = comm_offset(self.machine.image.path)
        return self.comm_offset

    def task_of(self, cpu: int, task: int) -> int:
        """The task CPU `cpu` runs: its per-CPU `current_task`; on a kernel without per-CPU data (one CPU), the
        global `current` for CPU 0."""
        if task or cpu != 0:
            return task
        symbol = self.machine.image.symbols.get("current")
        if symbol is None:
            return 0
        try:
            return int.from_bytes(self.machine.read_memory(symbol.address, 8), "little")
        except MemoryFault:
            return 0

    def comm(self, task: int) -> str:
        offset = self._offset()
        if not task or offset is None:
            return ""
        try:
            raw = self.machine.read_memory(task + offset, COMM_LENGTH)
        except MemoryFault:
            return ""
        return raw.split(b"\0", 1)[0].decode("latin-1")


def comm_offset(path) -> int | None:
    """Offset of `comm` in the kernel's `struct task_struct`, from its DWARF: through the per-CPU area's
    `current_task`, the `tasks` array or the `current` pointer, whichever the kernel has."""
    from ..machine.dwarf import KernelDwarf

    try:
        dwarf = KernelDwarf(path)
    except Exception as error:  # noqa: BLE001 (no DWARF: threads are shown without their task's name)
        log.info("no DWARF for task names: %s", error)
        return None
    try:
        return dwarf.task_comm_offset()
    finally:
        dwarf.close()


_NEVER_STOPS = ("the kernel never stops: step and reverse only replay a while-stepping recording (tfind one of "
                "its frames, then `monitor replay`)")


@dataclass
class KernelTarget(Target, MemoryWrites, Resume, Reverse, Breakpoints):
    """The live kernel, under the trace frame or replay `overlay` selects; `allow_writes` opens its memory."""

    machine: Machine
    allow_writes: bool = False
    names: TaskNames | None = None
    live: LiveView = field(init=False)
    overlay: FrameOverlay = field(init=False)

    def __post_init__(self) -> None:
        self.live = LiveView(self.machine)
        self.overlay = FrameOverlay(self.live)
        if self.names is None:
            self.names = TaskNames(self.machine)

    # ---- threads: one per CPU ------------------------------------------------------------------------------

    def threads(self) -> Sequence[int]:
        return range(thread_of(0), thread_of(self.machine.cpu_count))

    def thread_alive(self, thread: int) -> bool:
        """Every CPU of the machine: one the kernel has not started is there, only offline."""
        return 0 <= cpu_of(thread) < self.machine.cpu_count

    def thread_extra_info(self, thread: int) -> str:
        """QEMU's `CPU#<index> [<state>]` followed by the name of the task the CPU runs (read from the
        task_struct its per-CPU `current_task` points at): `CPU#1 [running] kgtp_bench/1`; `[offline]` for a
        CPU the kernel has not started, which runs no task."""
        cpu = cpu_of(thread)
        state = self.machine.cpu_states()[cpu]
        text = f"CPU#{cpu} [{state.state}]"
        if state.state != "offline":
            assert self.names is not None
            name = self.names.comm(self.names.task_of(cpu, state.current_task))
            if name:
                text += f" {name}"
        return text

    # ---- registers and memory: the overlay's, else the live kernel's ----------------------------------------

    def read_registers(self, thread: int) -> dict[str, int | None]:
        """The selected trace frame's (or replayed frame's) registers, else the live registers of the thread's
        CPU."""
        view = self.overlay.view
        if view is not None:
            return view.registers()
        return self.live.registers(cpu_of(thread))

    def read_memory(self, address: int, length: int, thread: int, space: object | None = None) -> bytes:
        if space is not None:
            raise ViewError("the kernel target reads the kernel's address space only")
        view = self.overlay.view
        return (view if view is not None else self.live).read_memory(address, length)

    def stop_reason(self) -> Stop:
        """The (never really stopped) kernel: a SIGTRAP of the thread GDB looks at (CPU 0 after connecting, as
        QEMU's first CPU)."""
        return Signal()

    def support_memory_writes(self) -> MemoryWrites | None:
        return self if self.allow_writes else None

    def write_memory(self, address: int, data: bytes, thread: int, space: object | None = None) -> None:
        if space is not None:
            raise ViewError("the kernel target writes the kernel's address space only")
        if self.overlay.current is not None or self.overlay.replay is not None:
            raise RspError(E_PERMISSION, "cannot write while a trace frame is selected or replayed")
        self.live.write_memory(address, data)

    # ---- run control: `c` waits for Ctrl-C; the rest moves through a replay ---------------------------------

    def support_resume(self) -> Resume:
        return self

    def support_reverse(self) -> Reverse:
        return self

    def support_breakpoints(self) -> Breakpoints:
        return self

    def resume(self, actions: Sequence[ResumeAction]) -> Stop | Running:
        """`c` outside a replay: the kernel runs on and the stop is reported at the user's Ctrl-C."""
        step = any(action.step for action in actions)
        if self.overlay.replay is None and not step:
            return Running()
        return self._move(step=step, reverse=False)

    def interrupt(self) -> Stop:
        return self.stop_reason()

    def reverse(self, *, step: bool) -> Stop:
        return self._move(step=step, reverse=True)

    def _move(self, *, step: bool, reverse: bool) -> Stop:
        replay = self.overlay.replay
        if replay is None:
            raise RspError(E_PERMISSION, _NEVER_STOPS, text=True)
        if replay.resume(step=step, reverse=reverse):
            return Signal()
        return ReplayLog(begin=reverse)

    def _replay_breakpoints(self, type: BreakpointType) -> Replay | None:
        replay = self.overlay.replay
        return replay if replay is not None and type == BreakpointType.SOFTWARE else None

    def supports(self, type: BreakpointType) -> bool:
        """Only in a replay, only software breakpoints, and only in the replay's own table: outside one the
        empty reply says the stub has none (the kernel is never patched for a breakpoint)."""
        return self._replay_breakpoints(type) is not None

    def insert_breakpoint(self, type: BreakpointType, address: int, kind: int) -> None:
        replay = self._replay_breakpoints(type)
        assert replay is not None  # the handlers ask `supports` first
        replay.breakpoints.add(address)

    def remove_breakpoint(self, type: BreakpointType, address: int, kind: int) -> None:
        replay = self._replay_breakpoints(type)
        assert replay is not None
        replay.breakpoints.discard(address)
