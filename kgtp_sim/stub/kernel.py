"""KGTP mode's target: the running kernel of the simulated machine, as GDB sees it through KGTP.

The first implementation of the target interface (stub/target.py). Its threads are the machine's CPUs, as QEMU's
gdbstub shows them: thread k+1 is CPU k, every CPU listed, also one the kernel has not started yet (its extra info
says `offline`), so `info threads` shows the machine's CPU count from the start. Registers are the live ones of
the CPU a thread names, memory the kernel's (one address space, shared by every CPU), both read coherently
through the machine (`Machine.registers(cpu=...)`, `Machine.read_memory`, which run the read on the CPU thread).

A selected trace frame or a replay (stub/overlay.py) is laid over the live kernel: while there is one, registers
and memory come from it, whichever thread GDB selected. Registers are never written; memory only with
--allow-writes and nothing selected.

Run control. By default the kernel never stops (KGTP): `?` reports a SIGTRAP of the thread GDB looks at, `c` only
waits for the user's Ctrl-C, which answers the same without stopping anything, and step and reverse execution exist
in a replay of a while-stepping recording (stub/replay.py). Run control, QEMU's gdbstub's, is there when asked for
(machine/runcontrol.py): GDB's breakpoints (`Z0`: in the translator, kernel memory untouched; `Z1`: a debug
register) and watchpoints (`Z2` write, `Z4` access, on the debug registers watch tracepoints share; x86 has no read
watchpoint) stop the whole machine when hit, and `monitor stop` stops it without one. The stop names the CPU that
hit (`T05thread:N;`, `watch:ADDR;` for a watchpoint, GDB then switches to that thread). On a stopped machine
`vCont` steps one CPU (with the others running, GDB's default, or only it: scheduler-locking on) or a range of
instructions, and continues every CPU or the ones GDB names; the stop comes later, from the machine's thread
(`poll_stop`, after `notify_stops`'s function woke the transport). Ctrl-C after a `continue` of a machine under
run control (stopped, or with breakpoints in) stops every CPU (SIGINT); after a `continue` of the running kernel
with no breakpoint it stops nothing, as KGTP. A step of the running kernel is refused, as before. Detaching,
killing, or the debugger leaving removes every breakpoint and watchpoint GDB set and leaves the kernel running. In a
replay, run control and software breakpoints are the replay's, and never touch the kernel.

Processes. Memory at a user address is read (and, with --allow-writes, written) through the page tables the
thread's CPU has loaded, as QEMU's gdbstub reads through the selected CPU's: the process that CPU runs (kernel
addresses read the same through every CPU). A breakpoint at a user address belongs to one process: the one
`monitor process PID` names, else the one process one of whose memory areas covers the address (an executable one
for `break`/`hbreak`; its page may not have been touched yet). The machine stops only when a CPU runs that
process's code there (its CR3: machine/runcontrol.py), never when another process mapping the same address does.
No process mapping it, several (and none named), or a named process whose areas do not hold it: GDB's "Cannot
insert breakpoint N", the reason in the stub's log. At the stop the CPU's registers are the process's user
registers and its memory is the process's, so `bt`, `x`, `stepi` and `continue` work on the program with its
symbols (`add-symbol-file PROG`). GDB inserts its breakpoints again at each resumption: the process is chosen
again each time.

Runs on the server thread, as every handler that calls it; the listener `_stopped` on the CPU thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..machine import Machine, MachineError, MemoryFault
from ..machine.runcontrol import Reason, StopEvent
from ..machine.tasks import ProcessTable
from ..machine.watchpoints import EXECUTE, READ_WRITE, WRITE
from ..uc_paging import AddressSpace, kernel_half
from ..rsp.dispatch import E_BAD_PACKET, E_PERMISSION, RspError
from ..rsp.packets.connect import ALL_THREADS, ANY_THREAD
from ..tracing.core.frames import ViewError
from ..tracing.patching.probes import ProbePlacementError, instruction_at
from .live import LiveView
from .overlay import FrameOverlay
from .target import (SIGINT, SIGTRAP, Breakpoints, BreakpointType, DataAccess, MemoryWrites, ReplayLog, Resume,
                     ResumeAction, Reverse, Running, Signal, Stop, Target)

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


_NEVER_STOPS = ("the kernel never stops unless asked (KGTP): a breakpoint, a watchpoint or `monitor stop` stops it, "
                "then step; step and reverse also replay a while-stepping recording (tfind one of its frames, then "
                "`monitor replay`)")

#: the debug registers' kind of each watchpoint type GDB sets (x86 has no read-only kind)
_WATCH_KINDS = {BreakpointType.WRITE_WATCHPOINT: WRITE, BreakpointType.ACCESS_WATCHPOINT: READ_WRITE}


@dataclass
class KernelTarget(Target, MemoryWrites, Resume, Reverse, Breakpoints):
    """The live kernel, under the trace frame or replay `overlay` selects; `allow_writes` opens its memory.
    `refuses_breakpoint(address, data=)` tells why a breakpoint (a watchpoint) there cannot work with the trace
    run (the tracer's: a jump probe covers the address; while-stepping and watchpoints), None when it can."""

    machine: Machine
    allow_writes: bool = False
    names: TaskNames | None = None
    refuses_breakpoint: Callable[..., str | None] = lambda address, data=False: None
    live: LiveView = field(init=False)
    overlay: FrameOverlay = field(init=False)
    #: the breakpoints and watchpoints GDB inserted in the machine: (type, address, kind) -> the process's space of
    #: one at a user address, None at a kernel address
    inserted: dict[tuple[BreakpointType, int, int], AddressSpace | None] = field(init=False, default_factory=dict)
    #: the process breakpoints at user addresses belong to (`monitor process PID`); None: the one that maps it
    process: int | None = None
    #: KGTP's gtp_current_pid: the process GDB attached (`attach PID` in a second inferior), whose memory user
    #: addresses read, whichever CPU GDB looks at; None: as the thread's CPU sees them
    attached_pid: int | None = None
    #: the last detach forgot the attached process only: the session goes on (`ends_session` of KGTP mode)
    detached_process: bool = False
    processes: ProcessTable = field(init=False)
    _notify: Callable[[], None] | None = field(init=False, default=None)
    _waiting: int | None = field(init=False, default=None)  # a `c` waits for the first stop after this one
    _kgtp: bool = field(init=False, default=False)  # ... and it was KGTP's: the kernel never stops

    def __post_init__(self) -> None:
        self.live = LiveView(self.machine)
        self.processes = ProcessTable(self.machine)
        self.overlay = FrameOverlay(self.live)
        if self.names is None:
            self.names = TaskNames(self.machine)
        self.machine.control.listeners.append(self._stopped)

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
        """The overlay's memory, else the live memory as the thread's CPU sees it (a user address: the process
        it runs)."""
        if space is not None:
            raise ViewError("the kernel target reads the kernel's address space only")
        view = self.overlay.view
        if view is not None:
            return view.read_memory(address, length)
        return self.live.read_memory(address, length, self._cpu_space(address, thread))

    def _cpu_space(self, address: int, thread: int) -> AddressSpace | None:
        """The space a user address is read in: the attached process's, else the one the thread's CPU has loaded
        (None: a kernel address)."""
        if kernel_half(address):
            return None
        if self.attached_pid is not None:
            space = self.processes.spaces().get(self.attached_pid)
            if space is None:
                raise ViewError(f"process {self.attached_pid} has ended")
            return space
        return self.machine.cpu_space(cpu_of(thread) if self.thread_alive(thread) else 0)

    def attach_process(self, pid: int) -> None:
        """KGTP's vAttach (gtp_gdbrsp_vAttach): the process's memory is read from now on; it is not stopped, nor
        is anything else. Raises RspError for a pid that is no live process of the machine."""
        if pid not in self.processes.spaces():
            raise RspError(E_BAD_PACKET, f"no process {pid} on the machine (`info os processes` lists them)")
        self.attached_pid = pid

    def stop_reason(self) -> Stop:
        """The running kernel (KGTP: never really stopped): a SIGTRAP of the thread GDB looks at (CPU 0 after
        connecting, as QEMU's first CPU); a stopped machine: its stop."""
        control = self.machine.control
        if control.stopped and control.event is not None and self.overlay.replay is None:
            return self._stop_of(control.event)
        return Signal()

    def support_memory_writes(self) -> MemoryWrites | None:
        return self if self.allow_writes else None

    def write_memory(self, address: int, data: bytes, thread: int, space: object | None = None) -> None:
        if space is not None:
            raise ViewError("the kernel target writes the kernel's address space only")
        if self.overlay.current is not None or self.overlay.replay is not None:
            raise RspError(E_PERMISSION, "cannot write while a trace frame is selected or replayed")
        self.live.write_memory(address, data, self._cpu_space(address, thread))

    # ---- run control: the machine's (runcontrol.py), or a replay's ------------------------------------------

    def support_resume(self) -> Resume:
        return self

    def support_reverse(self) -> Reverse:
        return self

    def support_breakpoints(self) -> Breakpoints:
        return self

    def range_stepping(self) -> bool:
        return True

    def notify_stops(self, notify: Callable[[], None]) -> None:
        self._notify = notify

    def _stopped(self, event: StopEvent) -> None:
        """The machine stopped (on the CPU thread): the transport polls."""
        if self._waiting is not None and self._notify is not None:
            self._notify()

    def resume(self, actions: Sequence[ResumeAction]) -> Stop | Running:
        """In a replay: its step or continue. On the running kernel: `c` waits, for Ctrl-C (KGTP) or, with
        breakpoints in, for one of them; a step is refused. On a stopped machine: the CPUs the actions name run (one
        that no action names stays stopped: scheduler-locking), one stepped if an action says so; the stop comes
        later, or at once."""
        stepping = next((action for action in actions if action.step), None)
        if self.overlay.replay is not None:
            return self._move(step=stepping is not None, reverse=False,
                              within=stepping.range if stepping is not None else None)
        control = self.machine.control
        if not control.stopped:
            if stepping is not None:
                raise RspError(E_PERMISSION, _NEVER_STOPS, text=True)
            self._waiting, self._kgtp = control.serial, not self.inserted
            return Running()
        resumed = [thread for thread in self.threads() if self._action_of(thread, actions) is not None]
        step = None
        if stepping is not None:
            step = next(t for t in self.threads() if self._action_of(t, actions) is stepping) \
                if stepping.thread in (ANY_THREAD, ALL_THREADS) else stepping.thread
        self._waiting, self._kgtp = control.serial, False  # before the machine runs: its stop may come at once
        try:
            control.resume(None if len(resumed) == len(self.threads()) else [cpu_of(t) for t in resumed],
                           step=cpu_of(step) if step is not None else None,
                           within=stepping.range if stepping is not None else None)
        except MachineError as error:
            self._waiting = None
            raise RspError(E_PERMISSION, str(error), text=True) from None
        return self.poll_stop() or Running()

    @staticmethod
    def _action_of(thread: int, actions: Sequence[ResumeAction]) -> ResumeAction | None:
        """The action for `thread`: the first that names it or every thread (vCont's rule)."""
        return next((a for a in actions if a.thread in (thread, ANY_THREAD, ALL_THREADS)), None)

    def poll_stop(self) -> Stop | None:
        control = self.machine.control
        event = control.event
        if self._waiting is None or not control.stopped or event is None or event.serial <= self._waiting:
            return None
        self._waiting = None
        return self._stop_of(event)

    def interrupt(self) -> Stop:
        """Ctrl-C while `c` waits: the stop that came meanwhile, if one did; KGTP's kernel goes on (a SIGTRAP of
        the thread GDB looks at); a machine under run control stops (SIGINT), as QEMU's."""
        stopped = self.poll_stop()
        if stopped is not None:
            return stopped
        waiting, self._waiting = self._waiting, None
        if waiting is None or self._kgtp:
            return Signal()
        return self._stop_of(self.machine.control.stop(), SIGINT)

    def _stop_of(self, event: StopEvent, signal: int = SIGTRAP) -> Stop:
        """A machine's stop as GDB hears it: a breakpoint, watchpoint or step names its CPU's thread; a stop
        asked for (Ctrl-C, `monitor stop`) the thread GDB looks at."""
        if event.reason is Reason.REQUEST:
            return Signal(signal)
        watch = None
        if event.reason is Reason.WATCHPOINT:
            kind = BreakpointType.WRITE_WATCHPOINT if event.kind == WRITE else BreakpointType.ACCESS_WATCHPOINT
            watch = DataAccess(kind, event.address)
        return Signal(SIGTRAP, thread_of(event.cpu), watch)

    def reverse(self, *, step: bool) -> Stop:
        return self._move(step=step, reverse=True)

    def _move(self, *, step: bool, reverse: bool, within: tuple[int, int] | None = None) -> Stop:
        replay = self.overlay.replay
        if replay is None:
            raise RspError(E_PERMISSION, _NEVER_STOPS, text=True)
        low, high = within or (0, 0)
        while replay.resume(step=step, reverse=reverse):
            if not low <= (replay.view().registers().get("rip") or 0) < high:
                return Signal()
        return ReplayLog(begin=reverse)

    def detach(self, process: int | None = None) -> None:
        """With a process attached (KGTP's gtp_gdbrsp_D): that process is forgotten, nothing else (GDB detached its
        inferior; the kernel's stays); else GDB leaves: `release`."""
        if self.attached_pid is not None:
            self.attached_pid = None
            self.detached_process = True
            return
        self.release()

    def kill(self) -> None:
        """KGTP's kernel is never killed: as detach."""
        self.release()

    def release(self) -> None:
        """GDB leaves: its breakpoints and watchpoints go, and the kernel runs."""
        self.inserted.clear()
        self.process = None
        self.attached_pid = None
        self._waiting = None
        control = self.machine.control
        control.clear()
        if control.stopped:
            control.resume()

    # ---- breakpoints: the machine's, or a replay's ----------------------------------------------------------

    def supports(self, type: BreakpointType) -> bool:
        """In a replay, software breakpoints only, in the replay's own table. On the kernel: every type but the
        read watchpoint, which x86's debug registers have not (gdbserver's x86 answers the same)."""
        if self.overlay.replay is not None:
            return type == BreakpointType.SOFTWARE
        return type != BreakpointType.READ_WATCHPOINT

    def insert_breakpoint(self, type: BreakpointType, address: int, kind: int,
                          thread: int | None = None) -> None:
        replay = self.overlay.replay
        if replay is not None:
            replay.breakpoints.add(address)
            return
        control = self.machine.control
        code = type in (BreakpointType.SOFTWARE, BreakpointType.HARDWARE)
        try:
            space = None if kernel_half(address) else self.process_space(address, code)
            if not code:
                self._check(address, self.refuses_breakpoint(address, data=True))
            elif space is None:
                self._check_code(address)
            if type == BreakpointType.SOFTWARE:
                control.insert_breakpoint(address, space)
            elif type == BreakpointType.HARDWARE:
                control.insert_hardware(EXECUTE, address, 1, space)
            else:  # a watchpoint: `kind` is its length
                control.insert_hardware(_WATCH_KINDS[type], address, kind, space)
        except (MachineError, ProbePlacementError, RspError) as error:
            # GDB shows only "Cannot insert breakpoint N": the reason goes to the stub's log too
            message = error.message if isinstance(error, RspError) else f"cannot insert a breakpoint at " \
                f"{address:#x}: {error}"
            log.warning("%s (GDB's %s)", message, type.name.lower().replace("_", " "))
            raise RspError(E_PERMISSION, message, text=True) from None
        self.inserted[(type, address, kind)] = space

    def remove_breakpoint(self, type: BreakpointType, address: int, kind: int,
                          thread: int | None = None) -> None:
        replay = self.overlay.replay
        if replay is not None:
            replay.breakpoints.discard(address)
            return
        if (type, address, kind) not in self.inserted:
            return
        space = self.inserted.pop((type, address, kind))
        control = self.machine.control
        if type == BreakpointType.SOFTWARE:
            control.remove_breakpoint(address, space)
        elif type == BreakpointType.HARDWARE:
            control.remove_hardware(EXECUTE, address, 1, space)
        else:
            control.remove_hardware(_WATCH_KINDS[type], address, kind, space)

    def process_space(self, address: int, code: bool = True) -> AddressSpace:
        """The address space of the process a breakpoint at user address `address` belongs to: the one `process`
        names, else the only process that maps the address (as code, for a breakpoint; for a watchpoint, at all).
        MachineError when there is none, or several and none named."""
        spaces = self.processes.spaces()
        if self.process is not None:
            if self.process not in spaces:
                raise MachineError(f"process {self.process} (monitor process) is not running")
            if self.process not in self.processes.mapping(address, code):
                raise MachineError(f"{address:#x} is not in a memory area of process {self.process}"
                                   f"{' that may run' if code else ''}")
            return spaces[self.process]
        mapping = [pid for pid in self.processes.mapping(address, code) if pid in spaces]
        if not mapping:
            raise MachineError(f"{address:#x} is not mapped{' as code' if code else ''} in the kernel's address space "
                               "(no process maps it)")
        if len(mapping) > 1:
            raise MachineError(f"processes {', '.join(map(str, mapping))} map {address:#x}: name the one the "
                               "breakpoint is for with `monitor process PID`")
        return spaces[mapping[0]]

    def _check_code(self, address: int) -> None:
        """Where a breakpoint can stop: the start of an instruction of a kernel function that runs in place (not
        inside the bytes a jump probe replaced). The machine refuses the stub's own code and unmapped memory."""
        low, high = self.machine.image.text_range
        if low <= address < high:
            instruction_at(self.machine.image, address)
            self._check(address, self.refuses_breakpoint(address))

    @staticmethod
    def _check(address: int, refusal: str | None) -> None:
        if refusal is not None:
            raise RspError(E_PERMISSION, f"cannot insert a breakpoint at {address:#x}: {refusal}", text=True)
