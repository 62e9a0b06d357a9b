"""The gdbserver role's extended-remote (`target extended-remote`): the process GDB debugs changes under one
server, as gdbserver's extended_protocol lets it (gdbserver/server.cc: handle_v_run, handle_v_attach, handle_v_kill,
`!`, `R`, handle_detach; gdb/remote.c: extended_remote_run, extended_remote_attach, remote_target::mourn_inferior).

- `Inferior`: the target the handlers speak to (stub/target.py), the process GDB debugs now (a `ProcessTarget`,
  stub/process.py) or none: before the first vRun of `kgtp-sim gdbserver --multi`, once it ended, was killed or was
  detached. Every method of a process is the current process's; with none, the thread list is empty, `?` answers
  `W00` and what needs a process is refused with E01, as gdbserver's require_running. One process at a time: a vRun
  or vAttach while one lives is refused (gdbserver's answer outside multiprocess mode; GDB kills the old process
  before it runs a new one). Signals GDB passes (QPassSignals, QProgramSignals), non-stop mode (QNonStop) and
  trace-frame selection outlive the processes, as GDB sends them once.
- `ExtendedHandlers`: `!`, `vRun`, `vAttach` and `R`.
- `OsdataHandlers`: `qXfer:osdata:read` (`info os processes`: the machine's processes in gdbserver's table,
  linux-osdata.cc: linux_xfer_osdata_processes), for KGTP mode too.

How a program gets into the running machine and started is the caller's (`start`: kgtp_sim/gdbserver.py puts the
host file and what its dynamic linker opens into the initramfs, then spawns it traced); attaching is the kernel's
PTRACE_ATTACH (machine/tracee.py: Ptrace.attach). gdbserver's lines (`Process P created; pid = N`, `Attached; pid
= N`, `Detaching from process N`, the reasons of a failed vRun or vAttach) go to `say`.

Runs on the server thread, as every handler; the stop listener (`notify_stops`) is called on the CPU thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

from ..arch import amd64
from ..machine import MachineError
from ..machine.tracee import Tracee
from ..rsp.dispatch import E_BAD_PACKET, Binary, NoReply, Reply, RspError, handles
from ..rsp.packets import connect as c
from ..rsp.packets import run as v
from .overlay import FrameOverlay
from .process import ProcessTarget, ProcessView
from .run import stop_reply
from .target import (Breakpoints, BreakpointType, Exited, MemoryWrites, NonStop, RegisterWrites, Resume,
                     ResumeAction, Running, Stop, Target, Terminated)
from .threads import ThreadHandlers

log = logging.getLogger(__name__)

#: starts a program from a host path and its arguments: its leader traced and stopped at its first instruction,
#: and the program's path inside the machine; raises OSError, ValueError or MachineError naming what is wrong
Starter = Callable[[str, Sequence[str]], tuple[Tracee, str]]


class Inferior(Target, RegisterWrites, MemoryWrites, Resume, Breakpoints, NonStop):
    """The process GDB debugs now, or none; what the handlers of a gdbserver role speak to."""

    def __init__(self, machine: object, start: Starter | None = None, say: Callable[[str], None] = lambda line: None):
        self.machine = machine
        self._start = start
        self.say = say
        self.overlay = FrameOverlay(ProcessView(self))
        self.process: ProcessTarget | None = None
        #: the pid GDB last knew (stop replies of an ended process name it); None before any
        self._pid: int | None = None
        self.program: tuple[str, tuple[str, ...]] | None = None  #: the last program run, for `R` and a bare vRun
        self.detached = False  #: the last process was detached (it goes on untraced)
        self.pass_signals: frozenset[int] = frozenset()
        self.program_signals: frozenset[int] | None = None
        self._non_stop = False
        self._notify: Callable[[], None] | None = None
        #: told of each new process (or None when the last one went): the server points tracing at it
        self.listeners: list[Callable[[ProcessTarget | None], None]] = []

    # ---- the current process -----------------------------------------------------------------------------

    def adopt(self, process: ProcessTarget) -> None:
        """`process` is the one GDB debugs from now on."""
        self.process = process
        self._pid = process.pid
        self.detached = False
        process.pass_signals = self.pass_signals
        process.program_signals = self.program_signals
        process.set_non_stop(self._non_stop)
        if self._notify is not None:
            process.notify_stops(self._notify)
        for listener in self.listeners:
            listener(process)

    def _drop(self) -> None:
        if self.process is not None:
            self.process.forget()
            self.process = None
            for listener in self.listeners:
                listener(None)

    def live(self) -> ProcessTarget | None:
        """The process, while it has not ended."""
        return self.process if self.process is not None and self.process.ended() is None else None

    def current(self) -> ProcessTarget:
        """The process, or E01 (gdbserver's require_running) when there is none."""
        if self.process is None:
            raise RspError(E_BAD_PACKET, "no process: `run` or `attach` first")
        return self.process

    def _reported(self, outcome: Stop | Running | None) -> Stop | Running | None:
        """An end GDB is told of: the process is gone for it (remote.c: mourn_inferior)."""
        if isinstance(outcome, (Exited, Terminated)):
            self._drop()
        return outcome

    def run(self, program: str, args: Sequence[str]) -> Stop:
        """vRun: `program` (a host path; empty: the last one) started traced, stopped at its first instruction."""
        if self.live() is not None:
            raise RspError(E_BAD_PACKET, f"already debugging process {self.process.pid}: kill it first")
        if not program:
            if self.program is None:
                raise RspError(E_BAD_PACKET, "vRun without a program, and none was run before")
            program = self.program[0]
        if self._start is None:
            raise RspError(E_BAD_PACKET, "this server starts no programs")
        self._drop()
        self.program = (program, tuple(args))
        try:
            tracee, inside = self._start(program, list(args))
        except (OSError, ValueError, MachineError) as error:
            reason = getattr(error, "strerror", None) or str(error)
            self.say(f"kgtp-sim gdbserver: cannot run {program}: {reason}")
            raise RspError(E_BAD_PACKET, f"{program}: {reason}") from None
        self.adopt(ProcessTarget(tracee, inside, overlay=self.overlay))
        self.say(f"Process {program} created; pid = {tracee.pid}")
        return self.process.stop_reason()

    def attach(self, pid: int) -> Stop:
        """vAttach: every thread of running process `pid` traced and stopped (gdbserver: attach_inferior)."""
        if self.live() is not None:
            raise RspError(E_BAD_PACKET, f"already debugging process {self.process.pid}")
        ptrace = self.machine.ptrace  # type: ignore[attr-defined]
        try:
            threads = ptrace.attach(pid)
        except MachineError as error:
            self.say(f"kgtp-sim gdbserver: {error}")
            raise RspError(E_BAD_PACKET, str(error)) from None
        self._drop()
        self.adopt(ProcessTarget(threads[pid], overlay=self.overlay, attached=threads))
        self.say(f"Attached; pid = {pid}")
        return self.process.stop_reason()

    def kill_process(self, pid: int) -> None:
        """vKill: gdbserver's handle_v_kill, E01 for a process it does not have."""
        process = self.live()
        if process is None or process.pid != pid:
            raise RspError(E_BAD_PACKET, f"no process {pid:x}")
        self.kill()

    # ---- Target: the current process's, or none -------------------------------------------------------------

    def threads(self) -> Sequence[int]:
        return self.process.threads() if self.process is not None else ()

    def thread_alive(self, thread: int) -> bool:
        return self.process is not None and self.process.thread_alive(thread)

    def process_id(self) -> int | None:
        return self.process.pid if self.process is not None else self._pid

    def is_process(self) -> bool:
        return True

    def register_layout(self) -> amd64.RegisterLayout:
        return amd64.LINUX

    def feature_document(self, annex: str) -> bytes | None:
        return self.current().feature_document(annex)

    def read_registers(self, thread: int) -> dict[str, int | None]:
        return self.current().read_registers(thread)

    def live_registers(self, thread: int | None = None) -> dict[str, int | None]:
        return self.current().live_registers(thread)

    def read_memory(self, address: int, length: int, thread: int, space: object | None = None) -> bytes:
        return self.current().read_memory(address, length, thread, space)

    def live_memory(self, address: int, length: int) -> bytes:
        return self.current().live_memory(address, length)

    def stop_reason(self) -> Stop:
        """gdbserver's handle_status: the process's stop, or `W00` with none."""
        if self.process is None:
            return Exited(0)
        return self._reported(self.process.stop_reason())  # type: ignore[return-value]

    def attached(self) -> bool:
        return self.process is not None and self.process.attached()

    def detach(self) -> None:
        """`D`: the process goes on untraced (gdbserver's handle_detach, its line first)."""
        process = self.current()
        self.say(f"Detaching from process {process.pid}")
        process.detach()
        self._drop()
        self.detached = True

    def kill(self) -> None:
        """`k`, vKill: every thread killed; the process is gone for GDB."""
        if self.process is not None:
            self.process.kill()
        self._drop()

    def support_register_writes(self) -> RegisterWrites:
        return self

    def support_memory_writes(self) -> MemoryWrites:
        return self

    def support_resume(self) -> Resume:
        return self

    def support_breakpoints(self) -> Breakpoints:
        return self

    def support_non_stop(self) -> NonStop:
        return self

    def write_registers(self, thread: int, values: dict[str, int]) -> None:
        self.current().write_registers(thread, values)

    def write_memory(self, address: int, data: bytes, thread: int, space: object | None = None) -> None:
        self.current().write_memory(address, data, thread, space)

    def supports(self, type: BreakpointType) -> bool:
        return type != BreakpointType.READ_WATCHPOINT

    def insert_breakpoint(self, type: BreakpointType, address: int, kind: int) -> None:
        self.current().insert_breakpoint(type, address, kind)

    def remove_breakpoint(self, type: BreakpointType, address: int, kind: int) -> None:
        if self.process is not None:
            self.process.remove_breakpoint(type, address, kind)

    def range_stepping(self) -> bool:
        return True

    def notify_stops(self, notify: Callable[[], None]) -> None:
        self._notify = notify
        if self.process is not None:
            self.process.notify_stops(notify)

    def resume(self, actions: Sequence[ResumeAction]) -> Stop | Running:
        return self._reported(self.current().resume(actions))  # type: ignore[return-value]

    def poll_stop(self) -> Stop | None:
        return self._reported(self.process.poll_stop()) if self.process is not None else None  # type: ignore

    def interrupt(self) -> Stop:
        if self.process is None:
            return Exited(0)
        return self._reported(self.process.interrupt())  # type: ignore[return-value]

    # ---- non-stop: the current process's, the mode kept for the next -----------------------------------------

    def non_stop(self) -> bool:
        return self._non_stop

    def set_non_stop(self, on: bool) -> None:
        if self.process is not None:
            self.process.set_non_stop(on)
        self._non_stop = on

    def resume_threads(self, actions: Sequence[ResumeAction]) -> None:
        self.current().resume_threads(actions)

    def stop_events(self) -> list[Stop]:
        if self.process is None:
            return []
        events = self.process.stop_events()
        for stop in events:
            self._reported(stop)
        return events

    def stopped_threads(self) -> list[Stop]:
        return self.process.stopped_threads() if self.process is not None else []

    def request_interrupt(self) -> None:
        if self.process is not None:
            self.process.request_interrupt()

    def set_signals(self, passed: frozenset[int] | None = None, program: frozenset[int] | None = None) -> None:
        """QPassSignals, QProgramSignals: kept for every process to come, and given to the current one."""
        if passed is not None:
            self.pass_signals = passed
        if program is not None:
            self.program_signals = program
        if self.process is not None:
            self.process.pass_signals = self.pass_signals
            self.process.program_signals = self.program_signals


def processes_document(machine: object) -> bytes:
    """`info os processes`: every process of the machine, in gdbserver's table (linux_xfer_osdata_processes: pid,
    user, command, cores); every process here is root's."""
    items = []
    for entry in machine.processes.listing():  # type: ignore[attr-defined]
        command = escape(entry.command)
        cores = ",".join(str(core) for core in entry.cores)
        items.append(f'<item><column name="pid">{entry.pid}</column><column name="user">root</column>'
                     f'<column name="command">{command}</column><column name="cores">{cores}</column></item>')
    return ('<osdata type="processes">\n' + "".join(items) + "</osdata>\n").encode()


#: the tables `info os` lists (gdbserver's osdata_table has more: cpus, files, modules ...; the machine's are these)
_TYPES = ('<osdata type="types">\n<item><column name="Type">processes</column>'
          '<column name="Description">Listing of all processes</column>'
          '<column name="Title">Processes</column></item></osdata>\n').encode()


@dataclass
class ExtendedHandlers:
    """The packets of extended mode, and `info os`. `extended` is set by `!` (gdbserver's extended_protocol: for
    the server's life once GDB asked)."""

    inferior: Inferior
    threads: ThreadHandlers
    extended: bool = False

    @handles(c.ExtendedMode)
    def extended_mode(self, packet: c.ExtendedMode) -> Reply:
        self.extended = True
        return b"OK"

    @handles(v.VRun)
    def vrun(self, packet: v.VRun) -> Reply:
        """The reply is the new process's stop at its first instruction, which selects its thread."""
        self.threads.selection.general = None
        return stop_reply(self.inferior.run(packet.program, packet.args), self.threads)

    @handles(v.VAttach)
    def vattach(self, packet: v.VAttach) -> Reply:
        """The reply is the process's stop; in non-stop `OK`, each thread's stop following as a notification
        (gdbserver's handle_v_attach; GDB's extended_remote_attach takes nothing else then)."""
        self.threads.selection.general = None
        stop = self.inferior.attach(packet.pid)
        if self.inferior.non_stop():
            self.inferior.current().announce_stopped()
            return b"OK"
        return stop_reply(stop, self.threads)

    @handles(c.Restart)
    def restart(self, packet: c.Restart) -> Reply:
        """`R`: in extended mode, the process killed and the last program run again; no reply either way
        (gdbserver's process_serial_event)."""
        if not self.extended:
            return NoReply()
        self.inferior.kill()
        self.inferior.say("GDBserver restarting")
        if self.inferior.program is not None:
            try:
                self.inferior.run(*self.inferior.program)
            except RspError as error:
                log.info("R: %s", error.message)
        return NoReply()



@dataclass
class OsdataHandlers:
    """`info os` of the machine (`qXfer:osdata:read`): the table types, and `processes`."""

    machine: object
    _osdata: dict[str, bytes] = field(default_factory=dict)  #: a table read in windows: made at the first

    @handles(c.ReadOsdata)
    def read_osdata(self, packet: c.ReadOsdata) -> Reply:
        if packet.annex not in ("", "processes"):
            raise RspError(E_BAD_PACKET, f"no table {packet.annex!r} (the machine lists processes)")
        if packet.offset == 0 or packet.annex not in self._osdata:
            self._osdata[packet.annex] = processes_document(self.machine) if packet.annex else _TYPES
        document = self._osdata[packet.annex]
        chunk = document[packet.offset: packet.offset + packet.length]
        return Binary((b"m" if packet.offset + len(chunk) < len(document) else b"l") + chunk)
