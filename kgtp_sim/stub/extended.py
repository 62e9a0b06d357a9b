"""The gdbserver role's extended-remote (`target extended-remote`): the process GDB debugs changes under one
server, as gdbserver's extended_protocol lets it (gdbserver/server.cc: handle_v_run, handle_v_attach, handle_v_kill,
`!`, `R`, handle_detach; gdb/remote.c: extended_remote_run, extended_remote_attach, remote_target::mourn_inferior).

- `Inferior`: the target the handlers speak to (stub/target.py), the processes GDB debugs now (each a
  `ProcessTarget`, stub/process.py) or none: before the first vRun of `kgtp-sim gdbserver --multi`, once they ended,
  were killed or were detached. The first is the program GDB started or attached to; a fork child joins when its
  parent's fork event is taken in (GDB then follows it, keeps it, or detaches it with `D;PID`), as gdbserver adds a
  process at a fork. Thread ids are the machine's (unique across processes): a thread's packets go to its process,
  what names no thread (`D`, `?`, the overlay of a trace frame) to the first; a breakpoint to the process of the
  thread GDB selected (`Hg`). Resumptions name each process's threads (`vCont;c:pPID.-1`: that process only); in
  all-stop, an event of one process stops every other's threads (gdbserver's stop_all_lwps); a fork child GDB has
  not heard of yet is resumed by no wildcard (gdbserver's fork_relative). With none, the thread list is empty, `?`
  answers `W00` and what needs a process is refused with E01, as gdbserver's require_running. A vRun or vAttach
  while a process lives adds one when GDB speaks multiprocess (another inferior: `add-inferior`, then `run` or
  `attach`, as gdbserver's multi_process allows), and is refused otherwise (gdbserver's "Already debugging a
  process"). Signals GDB passes (QPassSignals, QProgramSignals), the events it asked for (qSupported's
  fork-events+, vfork-events+, exec-events+), non-stop mode (QNonStop) and trace-frame selection outlive the
  processes, as GDB sends them once.
- `ExtendedHandlers`: `!`, `vRun`, `vAttach` and `R`; whether the server stays up once a process is killed or
  detached (`extended`).
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
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from ..agent.verify import Program
from ..arch import amd64
from ..machine import MachineError
from ..machine.tracee import (PTRACE_O_TRACEEXEC, PTRACE_O_TRACEFORK, PTRACE_O_TRACEVFORK, PTRACE_O_TRACEVFORKDONE,
                              Tracee)
from ..rsp.dispatch import E_BAD_PACKET, Binary, NoReply, Reply, RspError, handles
from ..rsp.packets import connect as c
from ..rsp.packets.base import xml_text
from ..rsp.packets import run as v
from .overlay import FrameOverlay
from .process import ProcessTarget, ProcessView
from .run import stop_reply
from .target import (BreakpointConditions, Breakpoints, BreakpointType, Execd, Exited, Forked, MemoryWrites, NonStop,
                     RegisterWrites, Resume, ResumeAction, Running, Stop, Target, Terminated)
from .threads import ThreadHandlers

log = logging.getLogger(__name__)

#: starts a program from a host path and its arguments: its leader traced and stopped at its first instruction,
#: and the program's path inside the machine; raises OSError, ValueError or MachineError naming what is wrong
Starter = Callable[[str, Sequence[str]], tuple[Tracee, str]]


#: the ptrace options of the events GDB asks to hear of in qSupported (gdbserver's linux_low_ptrace_options)
EVENT_OPTIONS = {"fork-events+": PTRACE_O_TRACEFORK, "vfork-events+": PTRACE_O_TRACEVFORK | PTRACE_O_TRACEVFORKDONE,
                 "exec-events+": PTRACE_O_TRACEEXEC}


class Inferior(Target, RegisterWrites, MemoryWrites, Resume, Breakpoints, BreakpointConditions, NonStop):
    """The processes GDB debugs now (the first is the program it started or attached to), or none; what the handlers
    of a gdbserver role speak to."""

    def __init__(self, machine: object, start: Starter | None = None, say: Callable[[str], None] = lambda line: None):
        self.machine = machine
        self._start = start
        self.say = say
        self.overlay = FrameOverlay(ProcessView(self))
        #: GDB's processes by pid, in the order it met them: the program, then the fork children it keeps
        self.processes: dict[int, ProcessTarget] = {}
        #: fork children whose parent's `Forked` GDB has not heard of yet -> their parent: no wildcard resumes one
        #: (gdbserver's fork_relative), and a detach of the parent detaches it too
        self._unreported: dict[int, int] = {}
        #: the pid GDB last knew (stop replies of an ended process name it); None before any
        self._pid: int | None = None
        self.program: tuple[str, tuple[str, ...]] | None = None  #: the last program run, for `R` and a bare vRun
        self.detached = False  #: the last process was detached (it goes on untraced)
        #: asked as GDB detaches a process (gdbserver's handle_detach, the server's trace run deciding): True keeps
        #: the process for the next GDB (a run under disconnected tracing); False, any trace run has been stopped
        self.before_detach: Callable[[], bool] = lambda: False
        #: a process detached under disconnected tracing, (pid, attached): it goes on, traced by the run, and the
        #: next GDB finds it stopped (gdbserver keeps such a process, its `gdb_detached`, until a GDB asks `?`)
        self.kept: tuple[int, bool] | None = None
        self.pass_signals: frozenset[int] = frozenset()
        self.program_signals: frozenset[int] | None = None
        #: the events GDB asked for in qSupported, as ptrace options (EVENT_OPTIONS)
        self.events = 0
        self.multiprocess = False  #: GDB speaks multiprocess (qSupported): a vRun or vAttach may add a process
        self._non_stop = False
        self._notify: Callable[[], None] | None = None
        #: told of each new first process (or None when the last one went), and again when it exec'd (its program
        #: changed): the server points tracing at it
        self.listeners: list[Callable[[ProcessTarget | None], None]] = []

    # ---- the processes -----------------------------------------------------------------------------------

    @property
    def process(self) -> ProcessTarget | None:
        """The first process: the program GDB started or attached to, or once that is gone the one it met next."""
        return next(iter(self.processes.values()), None)

    def adopt(self, process: ProcessTarget) -> None:
        """`process` is the one GDB debugs from now on."""
        self._pid = process.pid
        self.detached = False
        self.kept = None  # (a process kept at a detach and never taken back goes on, traced by no one)
        self._add(process)

    def _add(self, process: ProcessTarget) -> None:
        first = self.process
        process.pass_signals = self.pass_signals
        process.program_signals = self.program_signals
        process.set_non_stop(self._non_stop)
        if process.events != self.events:
            process.set_events(self.events)
        process.on_fork = self._forked
        if self._notify is not None:
            process.notify_stops(self._notify)
        self.processes[process.pid] = process
        if self.process is not first:
            self._tell(self.process)

    def _forked(self, child: ProcessTarget) -> None:
        """A fork child (stopped at its start), taken in before its parent's event is reported, as gdbserver's
        handle_extended_wait adds the process then."""
        self._unreported[child.pid] = child.parent or 0
        self._add(child)

    def _tell(self, process: ProcessTarget | None) -> None:
        for listener in self.listeners:
            listener(process)

    def _drop(self, pid: int) -> None:
        process = self.processes.get(pid)
        self._unreported.pop(pid, None)
        if process is None:
            return
        first = process is self.process
        del self.processes[pid]
        process.forget()
        if first:
            self._pid = pid if self.process is None else self.process.pid
            self._tell(self.process)

    def _drop_all(self) -> None:
        for pid in list(self.processes):
            self._drop(pid)

    def live(self) -> ProcessTarget | None:
        """The first process that has not ended."""
        return next((p for p in self.processes.values() if p.ended() is None), None)

    def current(self) -> ProcessTarget:
        """The first process, or E01 (gdbserver's require_running) when there is none."""
        process = self.process
        if process is None:
            raise RspError(E_BAD_PACKET, "no process: `run` or `attach` first")
        return process

    def holding(self, thread: int | None) -> ProcessTarget | None:
        """The process whose thread `thread` is, if any."""
        return next((p for p in self.processes.values() if thread in p.threads_by_tid), None)

    def process_for(self, thread: int | None) -> ProcessTarget:
        """The process of `thread` (GDB's selected thread: gdbserver's current process), else the first; E01 with
        none."""
        return self.holding(thread) or self.current()

    def _reported(self, outcome: Stop | Running | None) -> Stop | Running | None:
        """A stop GDB is told of: an end (the process is gone for it: remote.c's mourn_inferior), a fork (its child
        is GDB's from now on), an exec (the first process's program changed: the listeners hear of it)."""
        if isinstance(outcome, (Exited, Terminated)):
            self._drop(outcome.process if outcome.process is not None else self._pid or 0)
        elif isinstance(outcome, Forked):
            self._unreported.pop(outcome.child, None)
        elif isinstance(outcome, Execd) and self.process is not None and self.process is self.holding(outcome.thread):
            self._tell(self.process)
        return outcome

    def _another(self) -> ProcessTarget | None:
        """The live process a vRun or vAttach finds: refused unless GDB speaks multiprocess (gdbserver's answer:
        "Already debugging a process"), else the new one joins it (another inferior of GDB's: `add-inferior`)."""
        live = self.live()
        if live is not None and not self.multiprocess:
            raise RspError(E_BAD_PACKET, f"already debugging process {live.pid}: kill it first")
        return live

    def run(self, program: str, args: Sequence[str]) -> Stop:
        """vRun: `program` (a host path; empty: the last one) started traced, stopped at its first instruction,
        beside the processes GDB debugs already when it speaks multiprocess."""
        live = self._another()
        if not program:
            if self.program is None:
                raise RspError(E_BAD_PACKET, "vRun without a program, and none was run before")
            program = self.program[0]
        if self._start is None:
            raise RspError(E_BAD_PACKET, "this server starts no programs")
        if live is None:
            self._drop_all()
        self.program = (program, tuple(args))
        try:
            tracee, inside = self._start(program, list(args))
        except (OSError, ValueError, MachineError) as error:
            reason = getattr(error, "strerror", None) or str(error)
            self.say(f"kgtp-sim gdbserver: cannot run {program}: {reason}")
            raise RspError(E_BAD_PACKET, f"{program}: {reason}") from None
        process = ProcessTarget(tracee, inside, overlay=self.overlay)
        if live is None:
            self.adopt(process)
        else:
            self._add(process)
        self.say(f"Process {program} created; pid = {tracee.pid}")
        return process.stop_reason()

    def attach(self, pid: int) -> Stop:
        """vAttach: every thread of running process `pid` traced and stopped (gdbserver: attach_inferior), beside
        the processes GDB debugs already when it speaks multiprocess."""
        live = self._another()
        if pid in self.processes:
            raise RspError(E_BAD_PACKET, f"already debugging process {pid}")
        try:
            process = self._take(pid, alone=live is None)
        except MachineError as error:
            self.say(f"kgtp-sim gdbserver: {error}")
            raise RspError(E_BAD_PACKET, str(error)) from None
        self.say(f"Attached; pid = {pid}")
        return process.stop_reason()

    def _take(self, pid: int, alone: bool = True) -> ProcessTarget:
        """Every thread of running process `pid` traced and stopped (the kernel's PTRACE_ATTACH); GDB's from now,
        `alone` or beside the others."""
        threads = self.machine.ptrace.attach(pid)  # type: ignore[attr-defined]
        process = ProcessTarget(threads[pid], overlay=self.overlay, attached=threads)
        if alone:
            self._drop_all()
            self.adopt(process)
        else:
            self._add(process)
        return process

    def _take_back(self) -> None:
        """The process kept at a detach under disconnected tracing is this GDB's again, stopped, as it was started
        or attached to (gdbserver's handle_status clears `gdb_detached` and stops every thread); gone meanwhile, it
        is not."""
        (pid, attached), self.kept = self.kept, None
        try:
            process = self._take(pid)
        except MachineError as error:
            log.info("process %d, kept at the detach: %s", pid, error)
            return
        process.was_attached = attached

    def kill_process(self, pid: int) -> None:
        """vKill: that process killed (gdbserver's handle_v_kill), E01 for one it does not have."""
        process = self.processes.get(pid)
        if process is None or process.ended() is not None:
            raise RspError(E_BAD_PACKET, f"no process {pid:x}")
        process.kill()
        self._drop(pid)

    def gdb_features(self, features: tuple[str, ...]) -> None:
        """The events GDB asked for (gdbserver's report_fork_events and the others, its ptrace options set in every
        thread anew at each connection: handle_new_gdb_connection), for every process, and every one to come."""
        self.events = sum(bits for name, bits in EVENT_OPTIONS.items() if name in features)
        self.multiprocess = "multiprocess+" in features
        for process in list(self.processes.values()):
            process.set_events(self.events)

    # ---- Target: each thread's process's; the first process's for what names none --------------------------

    def threads(self) -> Sequence[int]:
        return tuple(t for p in list(self.processes.values()) for t in p.threads())

    def thread_alive(self, thread: int) -> bool:
        process = self.holding(thread)
        return process is not None and process.thread_alive(thread)

    def process_id(self) -> int | None:
        return self.process.pid if self.process is not None else self._pid

    def process_of(self, thread: int) -> int | None:
        process = self.holding(thread)
        return process.pid if process is not None else self.process_id()

    def is_process(self) -> bool:
        return True

    def register_layout(self) -> amd64.RegisterLayout:
        return amd64.LINUX

    def feature_document(self, annex: str) -> bytes | None:
        return self.current().feature_document(annex)

    def read_registers(self, thread: int) -> dict[str, int | None]:
        return self.process_for(thread).read_registers(thread)

    def live_registers(self, thread: int | None = None) -> dict[str, int | None]:
        return self.process_for(thread).live_registers(thread)

    def read_memory(self, address: int, length: int, thread: int, space: object | None = None) -> bytes:
        return self.process_for(thread).read_memory(address, length, thread, space)

    def live_memory(self, address: int, length: int) -> bytes:
        return self.current().live_memory(address, length)

    def stop_reason(self) -> Stop:
        """gdbserver's handle_status: the first process's stop (one kept at a detach taken back first), or `W00`
        with none."""
        if self.process is None and self.kept is not None:
            self._take_back()
        if self.process is None:
            return Exited(0)
        return self._reported(self.process.stop_reason())  # type: ignore[return-value]

    def attached(self) -> bool:
        return self.process is not None and self.process.attached()

    def detach(self, process: int | None = None) -> None:
        """`D` (the first process), `D;PID` (that one; E01 for one GDB does not debug): it goes on untraced
        (gdbserver's handle_detach, its line first), and with it its fork children GDB has not heard of yet. The
        last process GDB debugs ends a trace run, or under disconnected tracing is kept for the next GDB instead
        (`before_detach`, `kept`)."""
        target = self.processes.get(process) if process is not None else self.current()
        if target is None:
            raise RspError(E_BAD_PACKET, f"no process {process:x}")
        leaving = {target.pid} | {child for child, parent in self._unreported.items() if parent == target.pid}
        # the last process GDB debugs: gdbserver's choice for the run (a fork child GDB detaches, its parent still
        # debugged, leaves the run alone: gdbserver would stop it there)
        if not set(self.processes) - leaving and self.before_detach():
            # it goes on without GDB's breakpoints and its signals its own, as gdbserver passes them down to a
            # process GDB left; the trace run's probes stay in it
            self.say("Disconnected tracing in effect, leaving gdbserver attached to the process")
            target.detach()
            self.kept = (target.pid, target.attached())
            self._drop(target.pid)
            self.detached = not self.processes
            return
        for child, parent in list(self._unreported.items()):
            if parent == target.pid and child in self.processes:
                self.processes[child].detach()
                self._drop(child)
        self.say(f"Detaching from process {target.pid}")
        target.detach()
        self._drop(target.pid)
        self.detached = not self.processes

    def kill(self) -> None:
        """`k`: every process killed (gdbserver's `Killing all inferiors`); they are gone for GDB."""
        for process in list(self.processes.values()):
            process.kill()
        self._drop_all()

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

    def support_breakpoint_conditions(self) -> BreakpointConditions:
        return self

    def write_registers(self, thread: int, values: dict[str, int]) -> None:
        self.process_for(thread).write_registers(thread, values)

    def write_memory(self, address: int, data: bytes, thread: int, space: object | None = None) -> None:
        self.process_for(thread).write_memory(address, data, thread, space)

    def supports(self, type: BreakpointType) -> bool:
        return type != BreakpointType.READ_WATCHPOINT

    def insert_breakpoint(self, type: BreakpointType, address: int, kind: int, thread: int | None = None) -> None:
        """In the process of the thread GDB selected (GDB selects a fork child's before it takes its breakpoints
        out of it: infrun.c's detach_breakpoints)."""
        self.process_for(thread).insert_breakpoint(type, address, kind)

    def set_conditions(self, type: BreakpointType, address: int, conditions: Sequence[Program],
                       commands: Sequence[Program] = (), thread: int | None = None) -> None:
        """Those of the breakpoint just inserted in the process of the thread GDB selected."""
        self.process_for(thread).set_conditions(type, address, conditions, commands)

    def remove_breakpoint(self, type: BreakpointType, address: int, kind: int, thread: int | None = None) -> None:
        process = self.holding(thread) or self.process
        if process is not None:
            process.remove_breakpoint(type, address, kind)

    def range_stepping(self) -> bool:
        return True

    # ---- run control: all-stop over every process's threads -----------------------------------------------

    def notify_stops(self, notify: Callable[[], None]) -> None:
        self._notify = notify
        for process in list(self.processes.values()):
            process.notify_stops(notify)

    def _resumed_by(self, actions: Sequence[ResumeAction]) -> list[ProcessTarget]:
        """The processes some action names a thread of: by its id, or by a wildcard for every process or for that
        one; a fork child GDB has not heard of yet only by its own id (gdbserver's resume_one_thread)."""
        def names(process: ProcessTarget, action: ResumeAction) -> bool:
            if action.thread in process.threads_by_tid:
                return True
            return (action.thread in (c.ANY_THREAD, c.ALL_THREADS) and action.process in (None, process.pid)
                    and process.pid not in self._unreported)

        return [p for p in list(self.processes.values()) if any(names(p, a) for a in actions)]

    def _stop_others(self, process: ProcessTarget) -> None:
        """All-stop: every other process's running threads stopped too, their events kept (gdbserver's
        stop_all_lwps stops every process's)."""
        for other in list(self.processes.values()):
            if other is not process and other._running():
                other._stop_all()

    def resume(self, actions: Sequence[ResumeAction]) -> Stop | Running:
        """Each process some action names resumes as `actions` say (stub/process.py); a process none names stays
        stopped (GDB's schedule-multiple off resumes one process: `vCont;c:pPID.-1`). An event GDB has not heard of
        yet, of a thread this would resume, is the reply, nothing resumed."""
        processes = self._resumed_by(actions)
        if not processes:
            raise RspError(E_BAD_PACKET, "no action for a thread of any process")
        for process in processes:
            ended = process.ended()
            tid = process.pending_report(actions) if ended is None else None
            if ended is not None or tid is not None:
                return self._reported(ended or process._report(tid))  # type: ignore[arg-type, return-value]
        for process in processes:
            outcome = process.resume(actions)
            if not isinstance(outcome, Running):
                self._stop_others(process)
                return self._reported(outcome)  # type: ignore[return-value]
        return Running()

    def poll_stop(self) -> Stop | None:
        """The first process's stop (or end), every other one stopped then."""
        for process in list(self.processes.values()):
            stop = process.poll_stop() if process._running() else process.ended()
            if stop is not None:
                self._stop_others(process)
                return self._reported(stop)  # type: ignore[return-value]
        return None

    def interrupt(self) -> Stop:
        """Ctrl-C: the first running process's (gdbserver signals the program's process group), the others stopped
        then."""
        running = [p for p in list(self.processes.values()) if p._running()]
        if not running:
            return self.stop_reason()
        stop = running[0].interrupt()
        self._stop_others(running[0])
        return self._reported(stop)  # type: ignore[return-value]

    # ---- non-stop: each process's, the mode kept for the next --------------------------------------------

    def non_stop(self) -> bool:
        return self._non_stop

    def set_non_stop(self, on: bool) -> None:
        for process in list(self.processes.values()):
            process.set_non_stop(on)
        self._non_stop = on

    def resume_threads(self, actions: Sequence[ResumeAction], held: Collection[int] = ()) -> None:
        for process in self._resumed_by(actions):
            process.resume_threads(actions, held)

    def stop_events(self) -> list[Stop]:
        events = []
        for process in list(self.processes.values()):
            for stop in process.stop_events():
                events.append(self._reported(stop))
        return events  # type: ignore[return-value]

    def stopped_threads(self) -> list[Stop]:
        return [stop for p in list(self.processes.values()) if p.pid not in self._unreported
                for stop in p.stopped_threads()]

    def request_interrupt(self) -> None:
        running = [p for p in list(self.processes.values()) if p._running()]
        if running:
            running[0].request_interrupt()

    def set_signals(self, passed: frozenset[int] | None = None, program: frozenset[int] | None = None) -> None:
        """QPassSignals, QProgramSignals: kept for every process to come, and given to the current ones."""
        if passed is not None:
            self.pass_signals = passed
        if program is not None:
            self.program_signals = program
        for process in list(self.processes.values()):
            process.pass_signals = self.pass_signals
            process.program_signals = self.program_signals


def processes_document(machine: object) -> bytes:
    """`info os processes`: every process of the machine, in gdbserver's table (linux_xfer_osdata_processes: pid,
    user, command, cores); every process here is root's."""
    items = []
    for entry in machine.processes.listing():  # type: ignore[attr-defined]
        command = xml_text(entry.command)
        cores = ",".join(str(core) for core in entry.cores)
        items.append(f'<item><column name="pid">{entry.pid}</column><column name="user">root</column>'
                     f'<column name="command">{command}</column><column name="cores">{cores}</column></item>')
    return ('<osdata type="processes">\n' + "".join(items) + "</osdata>\n").encode()


#: the tables `info os` lists (gdbserver's osdata_table has more: cpus, files, modules ...; the machine's are these)
_TYPES = ('<osdata type="types">\n<item><column name="Type">processes</column>'
          '<column name="Description">Listing of all processes</column>'
          '<column name="Title">Processes</column></item></osdata>\n').encode()


class ExtendedHandlers:
    """The packets of extended mode, and `info os`. `extended_protocol` is set by `!` (gdbserver's: for the
    server's life once GDB asked)."""

    def __init__(self, inferior: Inferior, threads: ThreadHandlers, extended: bool = False) -> None:
        self.inferior = inferior
        self.threads = threads
        self.extended_protocol = extended

    @property
    def extended(self) -> bool:
        """Does the server stay up once a process is killed or detached (gdbserver's `extended_protocol ||
        target_running ()` in handle_detach, handle_v_kill)? In extended mode, and while another process GDB debugs
        lives (a fork child detached, or its parent; GDB's next process)."""
        return self.extended_protocol or self.inferior.live() is not None

    @extended.setter
    def extended(self, on: bool) -> None:
        self.extended_protocol = on

    @handles(c.ExtendedMode)
    def extended_mode(self, packet: c.ExtendedMode) -> Reply:
        self.extended_protocol = True
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
        if not self.extended_protocol:
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
