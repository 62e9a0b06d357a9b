"""The gdbserver role's target: one program on the simulated kernel, traced through the kernel's ptrace, as GDB
sees a process under gdbserver (gdbserver/linux-low.cc, linux-x86-low.cc).

The second implementation of the target interface (stub/target.py), beside KGTP mode's kernel. Its threads are the
process's (thread ids are tids; the leader's is the pid); a thread the kernel makes is adopted at its first stop,
a quiet one before its first instruction. It is stopped where gdbserver stops a program: at its first instruction
after exec, then at every signal a thread gets (breakpoint, single step, fault, the user's Ctrl-C); while it is
stopped the kernel and every other process run on. All-stop, as gdbserver's linux-low.cc: the thread that reports
an event is the stop reply, every other running thread is then stopped quietly (no signal), and an event one of
them met meanwhile stays pending, reported at the next resumption that resumes that thread (before anything
runs); each thread takes the first `vCont` action naming it, and one named by none stays stopped (GDB steps one
thread over a breakpoint that way). Non-stop, GDB's other mode, is stub/nonstop.py's, over the same threads. Registers are the process's (x86-64 Linux's description:
the core, SSE, `orig_rax`, `fs_base`, `gs_base`), memory its own address space, both writable, as a debugger's are
(the kernel's half is read-only here: KGTP mode's `--allow-writes` is the way to write it).

Software breakpoints (`Z0`) are int3s in the process's memory, as gdbserver's mem-break.cc inserts them: reads show
the original bytes, writes over one keep it (the machine's one record of the bytes under int3s, machine/int3s.py,
shared with the tracer's tracepoints in the program: one address may have both, set and removed in any order); they are written when the process resumes and taken out only when
GDB removes them and resumes again (GDB removes and reinserts every breakpoint at each stop: unchanged, memory is
not touched). A stop on an int3 of ours is reported as `swbreak` with the PC back on the breakpoint; a stop on one
GDB removed while threads ran (non-stop), taken in after the removal, puts the PC back and goes on untold, as
gdbserver discards it (an int3's SIGTRAP is told from a step's by its si_code). Range stepping (`vCont;r`) steps here
until the PC leaves the range.

A process attached to (`attached`: gdbserver's linux_attach) is the same target, its threads stopped by the
kernel's PTRACE_ATTACH, its program's path and auxiliary vector read under its stack's top.

Events (gdbserver's handle_extended_wait), when GDB asked for them (`set_events`: the kernel's ptrace options): a
fork or vfork is its thread's event `Forked`, the child made a `ProcessTarget` of its own before it is reported
(`forked_from`: stopped before its first instruction, GDB's breakpoints cloned with the int3s the child's copy keeps,
machine/int3s.py) and handed to `on_fork` (the server's list of processes, stub/extended.py); a vfork's end is
`VforkDone`; an exec is `Execd`, the process made anew in place (one thread, the new program's path and auxiliary
vector, no breakpoint: the old image's int3s went with its address space), as gdbserver mourns the process and adds
it again.

Why this module is long: it is one target, gdbserver's linux-low for one process: threads, registers, memory, the
breakpoints in the process's memory and debug registers, and the all-stop run control that ties them, which share
the per-thread state kept here.

Runs on the server thread, as every handler; the stop listener on the CPU thread only wakes the server.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..agent.verify import Program
from ..arch import amd64, signals
from ..machine import MachineError
from ..machine import smp
from ..machine.int3s import DEBUGGER
from ..machine.tracee import (PTRACE_EVENT_EXEC, PTRACE_EVENT_FORK, PTRACE_EVENT_VFORK, PTRACE_EVENT_VFORK_DONE,
                              SIGTRAP, TASK_SIZE_MAX, PtraceStop, Tracee, TraceeGone)
from ..machine.watchpoints import EXECUTE, READ_WRITE, WRITE, WatchpointError, aligned_pieces, busy_message
from ..rsp.dispatch import E_BAD_PACKET, E_MEMORY, E_PERMISSION, RspError
from ..rsp.packets import connect as c
from .auxv import auxv_below_stack_top, initial_auxv
from .conditions import BreakpointOptions
from .nonstop import NonStopControl
from .overlay import FrameOverlay
from .target import (SIGINT, BreakpointConditions, Breakpoints, BreakpointType, DataAccess, Execd, Exited, Forked, MemoryWrites,
                     RegisterWrites, Resume, ResumeAction, Running, Signal, Stop, Target, Terminated, VforkDone,
                     ViewError)

log = logging.getLogger(__name__)

#: seconds a thread the process made just before it was detached may take to stop at its start
_NEW_THREAD_S = 2.0
_LINUX_XML = amd64.LINUX.target_xml().encode()


#: signals a breakpoint may raise, reported to GDB even when it passes them (linux_wstatus_maybe_breakpoint)
_MAYBE_BREAKPOINT = frozenset((4, 5, 11))  # SIGILL, SIGTRAP, SIGSEGV (GDB's numbers)
SI_KERNEL = 0x80  #: the si_code of an int3's SIGTRAP (Linux's x86 do_int3)
INT3 = b"\xcc"


class ProcessView:
    """The live process as a trace frame's view reads what the frame did not collect (read-only memory)."""

    def __init__(self, target: ProcessTarget) -> None:
        self.target = target

    def registers(self) -> dict[str, int | None]:
        return self.target.live_registers()

    def read_memory(self, address: int, length: int) -> bytes:
        return self.target.live_memory(address, length)


class ProcessTarget(NonStopControl, Target, RegisterWrites, MemoryWrites, Resume, Breakpoints, BreakpointConditions):
    """A traced process (`tracee`) of the machine; `exec_path` is its program's path inside the machine. A trace
    frame GDB selects (`tfind`) is laid over it (`overlay`), as over KGTP mode's kernel."""

    def __init__(self, tracee: Tracee, exec_path: str | None = None, overlay: FrameOverlay | None = None,
                 attached: dict[int, Tracee] | None = None, forked_from: ProcessTarget | None = None) -> None:
        """`tracee`: the process's leader, stopped at its first instruction; or, `attached` (its threads by tid,
        the leader `tracee` among them, each stopped by Ptrace.attach), a running process GDB attached to, whose
        program's path (`exec_path` None) is read from its stack (AT_EXECFN's string, at the top); or, `forked_from`,
        the fork child of that process, stopped before its first instruction (its program and auxiliary vector the
        parent's, GDB's breakpoints cloned: gdbserver's clone_all_breakpoints). `overlay`: the trace-frame overlay to
        look through (shared by the processes of one server), a new one by default."""
        NonStopControl.__init__(self)
        self.overlay = overlay or FrameOverlay(ProcessView(self))
        self.leader = tracee
        self.machine = tracee.machine
        self.pid = tracee.pid
        self.was_attached = attached is not None
        #: its threads by tid, the leader first (a thread the kernel made is adopted at its first stop)
        self.threads_by_tid: dict[int, _Thread] = {tid: _Thread(t) for tid, t in (attached or {tracee.pid: tracee}).items()}
        self._resumed: set[int] = set()  #: the threads the last resumption resumed
        self._stopping = False  #: _stop_all is stopping the running threads
        self._last: Stop = Signal(SIGTRAP, self.pid)
        self._wanted: set[int] = set()  #: software breakpoints GDB has set
        self._inserted: set[int] = set()  #: the int3s it holds in the process's memory (machine/int3s.py)
        #: int3s taken out while a thread ran: one may have trapped on it, its stop not taken in yet (_classify)
        self._lifted: set[int] = set()
        self._hardware: dict[tuple[BreakpointType, int, int], list[int]] = {}  #: Z1-Z4 -> debug registers
        #: the conditions and commands of GDB's software breakpoints, by address (set with their `Z0`)
        self._options: dict[int, BreakpointOptions] = {}
        #: breakpoint hits GDB did not hear of (conditions all false, or commands run), and steps over them
        self.silent_hits = 0
        #: where the `printf` of a breakpoint's commands goes (gdbserver prints it on its stdout)
        self.command_output: Callable[[str], None] = self._print
        self._notify: Callable[[], None] | None = None
        self.detached = False  #: GDB detached: the process goes on untraced
        #: GDB's signals given to the program without a stop (QPassSignals), and those it may be resumed with
        #: (QProgramSignals; None: any)
        self.pass_signals: frozenset[int] = frozenset()
        self.program_signals: frozenset[int] | None = None
        #: the events GDB asked for (PTRACE_O_* options of every thread: set_events)
        self.events = 0
        #: given each fork child (a new ProcessTarget) before its parent's `Forked` is reported; None: the child is
        #: detached at once and the parent goes on, nothing reported
        self.on_fork: Callable[[ProcessTarget], None] | None = None
        #: the process it is a fork child of (None: GDB's program, started or attached to)
        self.parent = forked_from.pid if forked_from is not None else None
        if forked_from is not None:
            parent = forked_from
            self.exec_path, self.auxv, self.was_attached = parent.exec_path, parent.auxv, parent.was_attached
            self.pass_signals, self.program_signals = parent.pass_signals, parent.program_signals
            self.events = parent.events  # the kernel gave the child its parent's options
            self._last = Signal(0, self.pid)  # gdbserver's: stopped, GDB_SIGNAL_0
            space = self.tracee.space()
            self._wanted = set(parent._wanted)
            self._options = dict(parent._options)  # gdbserver's clone_all_breakpoints copies them too
            self.command_output = parent.command_output
            self._inserted = {a for a in parent._inserted if DEBUGGER in self.machine.int3s.holders(space, a)}
        elif attached is None:
            self.exec_path = exec_path or ""
            self.auxv = initial_auxv(self.tracee)
        else:
            self.exec_path, self.auxv = auxv_below_stack_top(self.tracee)
            self._last = Signal(0, self.pid)  # gdbserver's report of the attach stop (linux-low: a resume_stop SIGSTOP)
            for tid, thread in self.threads_by_tid.items():  # a signal one was about to take: its next event
                stop = self.machine.ptrace.stop_of(tid)
                if stop is not None and stop.signal:
                    thread.pending = Signal(signals.to_gdb(stop.signal), tid)
        self.machine.ptrace.listeners.append(self._heard)

    # ---- the process -------------------------------------------------------------------------------------

    @property
    def tracee(self) -> Tracee:
        """A thread to read and write the process's memory through (a stopped one when there is one: the threads
        share one address space)."""
        for thread in self.threads_by_tid.values():
            if thread.after is None and thread.tracee.ended is None:
                return thread.tracee
        return self.leader

    def ended(self) -> Stop | None:
        status = self.machine.processes.exited().get(self.pid)  # the process's end (its pid), whichever thread
        if status is None:
            return None
        if status & 0x7F:
            return Terminated(signals.to_gdb(status & 0x7F), self.pid)
        return Exited(status >> 8 & 0xFF, self.pid)

    def set_events(self, options: int) -> None:
        """Report the events the ptrace options `options` name (PTRACE_O_TRACEFORK, ...: gdbserver's
        linux_low_ptrace_options from what GDB asked), set in every thread (a thread made later inherits them)."""
        self.events = options
        for thread in list(self.threads_by_tid.values()):
            try:
                thread.tracee.set_options(options)
            except MachineError as error:
                log.info("thread %d: options: %s", thread.tracee.pid, error)

    def _print(self, text: str) -> None:
        """A breakpoint command's `printf`: where the program's standard output goes (the machine's relay of it), as
        gdbserver prints it on the stdout its inferior shares."""
        log.info("breakpoint command printf: %s", text.rstrip("\n"))
        sink = self.machine.processes.sink
        if sink is not None:
            sink(1, text.encode("utf-8", "surrogateescape"))

    def forget(self) -> None:
        """GDB is done with it (ended, killed, detached): its stops are no longer listened to."""
        if self._heard in self.machine.ptrace.listeners:
            self.machine.ptrace.listeners.remove(self._heard)

    # ---- base -------------------------------------------------------------------------------------------------

    def threads(self) -> Sequence[int]:
        self._forget_gone_threads()
        return tuple(self.threads_by_tid) or (self.pid,)

    def process_id(self) -> int:
        return self.pid

    def thread_alive(self, thread: int) -> bool:
        return thread in self.threads_by_tid and self.ended() is None

    def _thread(self, tid: int) -> _Thread:
        thread = self.threads_by_tid.get(tid)
        if thread is None:
            raise RspError(E_BAD_PACKET, f"no thread {tid} in process {self.pid}")
        return thread

    def _forget_gone_threads(self) -> set[int]:
        """Threads the kernel no longer has (a thread ended: only the process's end is told to the machine)
        forgotten; returns the threads it has that are not met yet (made by the process, their first stop, at
        their start, not taken in yet)."""
        if self.ended() is not None:
            return set()
        live = self.machine.ptrace.threads_of(self.pid)
        for tid in [t for t in self.threads_by_tid if t not in live]:
            del self.threads_by_tid[tid]
        return set(live) - set(self.threads_by_tid)

    def register_layout(self) -> amd64.RegisterLayout:
        return amd64.LINUX

    def feature_document(self, annex: str) -> bytes | None:
        return _LINUX_XML if annex == "target.xml" else None

    def read_registers(self, thread: int) -> dict[str, int | None]:
        view = self.overlay.view
        return view.registers() if view is not None else self.live_registers(thread)

    def live_registers(self, thread: int | None = None) -> dict[str, int | None]:
        """A running thread's (non-stop) are unavailable, as gdbserver answers `g` for one: all `x`."""
        tracee = self.tracee if thread is None else self._thread(thread).tracee
        if thread is not None and self.threads_by_tid[thread].after is not None:
            return {}
        try:
            return dict(tracee.registers())
        except MachineError as error:
            raise RspError(E_MEMORY, str(error)) from None

    def read_memory(self, address: int, length: int, thread: int, space: object | None = None) -> bytes:
        view = self.overlay.view
        return view.read_memory(address, length) if view is not None else self.live_memory(address, length)

    def live_memory(self, address: int, length: int) -> bytes:
        """Its memory as the program sees it (the breakpoints' int3s hidden); the kernel's half read-only."""
        try:
            data = self.tracee.read_memory(address, length, hide_int3s=True)
        except MachineError as error:
            raise ViewError(str(error)) from None
        if not data:
            raise ViewError(f"cannot access memory at {address:#x}")
        return data

    def stop_reason(self) -> Stop:
        return self.ended() or self._last

    def attached(self) -> bool:
        """Started for GDB (gdbserver's PROG, vRun): quitting GDB kills it; attached to: GDB detaches."""
        return self.was_attached

    def _release_hardware(self) -> None:
        slots = [slot for taken in self._hardware.values() for slot in taken]
        self._hardware.clear()
        if slots:
            self.machine.run_on_cpu(lambda uc: self.machine.debug_registers.release(slots))

    def detach(self, process: int | None = None) -> None:
        """Every thread goes on untraced, the breakpoints out of its memory (gdbserver: linux_detach); a thread the
        process made that GDB has not met yet too, once it has stopped at its start (it would wait there for a
        debugger forever)."""
        self._stop_all()
        self._collect_stops(step_over=False)  # one at a breakpoint it was not to stop at runs it without it
        self._release_hardware()
        self._take_out_breakpoints(everything=True)
        self._wanted.clear()
        self.detached = True
        done: set[int] = set()
        while self.ended() is None:
            threads = {tid: t.tracee for tid, t in self.threads_by_tid.items() if tid not in done}
            for tid in self.machine.ptrace.threads_of(self.pid):
                if tid not in done and tid not in threads:  # made meanwhile: traced, stopping at its start
                    try:
                        stop = self.machine.ptrace.wait(tid, 0, timeout=_NEW_THREAD_S)
                    except MachineError:  # not traced after all
                        done.add(tid)
                        continue
                    if stop is not None:
                        threads[tid] = Tracee(self.machine.ptrace, tid, stop.task)
            if not threads:
                break
            for tid, tracee in threads.items():
                done.add(tid)
                try:
                    tracee.detach()
                except MachineError as error:
                    log.info("detach: %s", error)

    def kill(self) -> None:
        """Every thread killed (gdbserver: linux_kill); returns once the process has ended."""
        self._release_hardware()
        self._stop_all()
        for thread in list(self.threads_by_tid.values()):
            try:
                thread.tracee.kill()
            except MachineError as error:
                log.info("kill: %s", error)

    def support_register_writes(self) -> RegisterWrites:
        return self

    def support_memory_writes(self) -> MemoryWrites:
        return self

    def support_resume(self) -> Resume:
        return self

    def support_breakpoints(self) -> Breakpoints:
        return self

    def support_non_stop(self) -> NonStopControl:
        return self

    def support_breakpoint_conditions(self) -> BreakpointConditions:
        return self

    # ---- writes ---------------------------------------------------------------------------------------------

    def _refuse_in_frame(self) -> None:
        if self.overlay.view is not None:
            raise RspError(E_PERMISSION, "cannot write while a trace frame is selected")

    def write_registers(self, thread: int, values: dict[str, int]) -> None:
        self._refuse_in_frame()
        try:
            self._thread(thread).tracee.write_registers(values)
        except MachineError as error:
            raise RspError(E_MEMORY, str(error)) from None

    def write_memory(self, address: int, data: bytes, thread: int, space: object | None = None) -> None:
        self._refuse_in_frame()
        if address + len(data) > TASK_SIZE_MAX:
            raise RspError(E_PERMISSION, f"{address:#x}: the kernel's memory is not the process's to write")
        try:  # an int3 there stays; what it hides is the new byte
            self.tracee.write_memory(address, data)
        except MachineError as error:
            raise ViewError(str(error)) from None

    # ---- breakpoints ------------------------------------------------------------------------------------------

    def supports(self, type: BreakpointType) -> bool:
        """x86's: no read-only watchpoint (gdbserver's x86_supports_z_point_type)."""
        return type != BreakpointType.READ_WATCHPOINT

    def insert_breakpoint(self, type: BreakpointType, address: int, kind: int, thread: int | None = None) -> None:
        """gdbserver's E01 for an address the process cannot read (no area there)."""
        if type != BreakpointType.SOFTWARE:
            self._insert_hardware(type, address, kind)
            return
        if address >= TASK_SIZE_MAX:
            raise RspError(E_BAD_PACKET, f"{address:#x} is not in the process's memory")
        if address not in self._inserted:
            try:
                present = self.tracee.read_memory(address, 1)
            except MachineError as error:
                raise RspError(E_BAD_PACKET, str(error)) from None
            if not present:
                raise RspError(E_BAD_PACKET, f"cannot access memory at {address:#x}")
        self._wanted.add(address)
        self._breakpoints_now()

    def remove_breakpoint(self, type: BreakpointType, address: int, kind: int, thread: int | None = None) -> None:
        if type != BreakpointType.SOFTWARE:
            slots = self._hardware.pop((type, address, kind), None)
            if slots:
                self.machine.run_on_cpu(lambda uc: self.machine.debug_registers.release(slots))
            self._forget_options(address)
            return
        self._wanted.discard(address)
        self._forget_options(address)
        self._breakpoints_now()

    def set_conditions(self, type: BreakpointType, address: int, conditions: Sequence[Program],
                       commands: Sequence[Program] = (), thread: int | None = None) -> None:
        """Kept by address, for the software and hardware breakpoints there (gdbserver judges a hit by both:
        gdb_condition_true_at_breakpoint); the last `Z` sent for an address decides."""
        options = BreakpointOptions(tuple(conditions), tuple(commands))
        if options:
            self._options[address] = options
        else:
            self._options.pop(address, None)

    def _forget_options(self, address: int) -> None:
        """A breakpoint's conditions go with the last breakpoint GDB has at its address."""
        if address not in self._wanted and (BreakpointType.HARDWARE, address) not in {k[:2] for k in self._hardware}:
            self._options.pop(address, None)

    def _breakpoints_now(self) -> None:
        """While threads run (non-stop: GDB's breakpoints are always inserted), memory follows GDB's set at once."""
        if self._running():
            try:
                self._put_in_breakpoints()
            except MachineError as error:
                raise RspError(E_BAD_PACKET, str(error)) from None

    def _insert_hardware(self, type: BreakpointType, address: int, length: int) -> None:
        """A hardware breakpoint or watchpoint in the machine's debug registers (four, shared with KGTP's watch
        tracepoints), on the process's own frame of the address (its page faulted in first): only this process
        trips it, on whichever CPU runs it."""
        key = (type, address, length)
        if key in self._hardware:
            return
        if address + max(length, 1) > TASK_SIZE_MAX:
            raise RspError(E_BAD_PACKET, f"{address:#x} is not in the process's memory")
        kind = {BreakpointType.HARDWARE: EXECUTE, BreakpointType.WRITE_WATCHPOINT: WRITE,
                BreakpointType.ACCESS_WATCHPOINT: READ_WRITE}[type]
        try:
            pieces = [(address, 1)] if kind == EXECUTE else aligned_pieces(address, length)
            for piece, size in pieces:
                if not self.tracee.read_memory(piece, size):
                    if kind == EXECUTE:
                        raise RspError(E_BAD_PACKET, f"cannot access memory at {piece:#x}")
                    # data nothing maps (`watch *ptr` while ptr is NULL): accepted, as gdbserver's debug registers
                    # take any address; no access can reach it until it is mapped, and GDB inserts its
                    # watchpoints again at each resumption, when the page may be there
                    self._hardware[key] = []
                    return
        except WatchpointError as error:
            raise RspError(E_BAD_PACKET, str(error)) from None
        except MachineError as error:
            raise RspError(E_BAD_PACKET, str(error)) from None
        space = self.tracee.space()

        def arm(uc: object) -> list[int]:
            registers = self.machine.debug_registers
            taken: list[int] = []
            try:
                for piece, size in pieces:
                    slot = registers.free_slot()
                    if slot is None:
                        raise WatchpointError(busy_message(registers, len(pieces)))
                    handler = functools.partial(self._on_debug_register, type, address)
                    registers.set(slot, piece, size, kind, handler, space=space)
                    taken.append(slot)
            except WatchpointError:
                registers.release(taken)
                raise
            return taken

        try:
            self._hardware[key] = self.machine.run_on_cpu(arm)
        except WatchpointError as error:
            raise RspError(E_BAD_PACKET, str(error)) from None

    def _on_debug_register(self, type: BreakpointType, address: int, uc: Any, slot: int) -> None:
        """A debug register of ours matched (CPU thread, inside emulation): when the task on this CPU is the
        process, the CPU raises #DB, as it would for the process's DR7, and the kernel stops the process with
        SIGTRAP (at the next instruction for a data access, at the instruction itself for an instruction
        breakpoint); another task's access to the frame, or another space's code at the address, is no hit."""
        task = smp.current_task(uc)
        thread = next((t for t in self.threads_by_tid.values() if t.tracee.task == task), None)
        if thread is None:
            return
        thread.hit = (type, address)
        self.machine.cpu.deliver(1)
        self.machine.cpu.forget_fault_in_flight()  # from a code hook, the delivery left one (a later #PF: #DF)

    def _put_in_breakpoints(self) -> None:
        """Memory follows GDB's breakpoints before the process runs: int3s in, removed ones out (one trip to the
        machine for all of them)."""
        leaving = sorted(self._inserted - self._wanted)
        coming = sorted(self._wanted - self._inserted)
        if not leaving and not coming:
            return
        done = self.tracee.debugger_int3s(coming, leaving)
        self._taken_out(leaving)
        self._inserted |= {address for address, ok in zip(coming, done) if ok}

    def _taken_out(self, leaving: Sequence[int]) -> None:
        """Int3s no longer in memory; one lifted while a thread runs may have trapped it (`_lifted`, _classify)."""
        self._inserted -= set(leaving)
        if self._running():
            self._lifted |= set(leaving)

    def _take_out_breakpoints(self, everything: bool) -> None:
        leaving = sorted(a for a in self._inserted if everything or a not in self._wanted)
        if not leaving:
            return
        self._taken_out(leaving)
        try:
            self.tracee.debugger_int3s((), leaving)
        except MachineError as error:
            log.info("breakpoints at %s: %s", ", ".join(f"{a:#x}" for a in leaving), error)

    # ---- run control: all-stop over the process's threads (gdbserver's linux-low.cc) ---------------------------

    def range_stepping(self) -> bool:
        return True

    def notify_stops(self, notify: Callable[[], None]) -> None:
        self._notify = notify

    def _heard(self, pid: int) -> None:
        """A stop or an end of some traced task (CPU thread): the server looks (poll_stop). Always: a thread
        resumed on the server thread may stop here before the server has marked it running."""
        if self._notify is not None:
            self._notify()

    def _running(self) -> list[_Thread]:
        return [t for t in self.threads_by_tid.values() if t.after is not None]

    @staticmethod
    def _go(thread: _Thread, step: bool = False, signal: int = 0) -> None:
        """Resume one thread (its Linux `signal` taken), as running from now."""
        thread.after = thread.tracee.resume(step=step, signal=signal)
        thread.asked_stop = thread.report_stop = False
        thread.step_over = None  # still at a breakpoint it was not to stop at: it meets it again

    def _chosen(self, actions: Sequence[ResumeAction]) -> dict[int, ResumeAction | None]:
        """Each thread's action: the first naming it, or every thread (of every process, or of this one), None when
        none does."""
        def names(action: ResumeAction, tid: int) -> bool:
            return action.thread == tid or (action.thread in (c.ANY_THREAD, c.ALL_THREADS)
                                            and action.process in (None, self.pid))

        return {tid: next((a for a in actions if names(a, tid)), None) for tid in self.threads_by_tid}

    def pending_report(self, actions: Sequence[ResumeAction]) -> int | None:
        """A thread `actions` resume that has an event GDB has not heard of yet: that event is the reply to the
        resumption (gdbserver reports a pending status first), nothing resumed."""
        chosen = self._chosen(actions)
        for tid, thread in self.threads_by_tid.items():
            if thread.pending is not None and chosen[tid] is not None and self._still_pending(thread):
                return tid
        return None

    def _start(self, thread: _Thread, action: ResumeAction) -> None:
        """Resume a stopped thread as `action` says, past any event it had (its signal dropped when GDB may not give
        it to the program: gdbserver's program_signals)."""
        thread.pending = None
        thread.range = action.range if action.step else None
        thread.stepping = action.step
        signal = action.signal if self.program_signals is None or action.signal in self.program_signals else 0
        self._go(thread, action.step, signals.to_linux(signal) or 0)

    def resume(self, actions: Sequence[ResumeAction]) -> Stop | Running:
        """Each thread takes the first action naming it (or all threads); one named by none stays stopped. A
        thread with an event GDB has not heard of yet is not resumed: that event is the stop reply (gdbserver
        reports a pending status first)."""
        ended = self.ended()
        if ended is not None:
            return ended
        chosen = self._chosen(actions)
        if not any(chosen.values()):
            raise RspError(E_BAD_PACKET, f"no action for any thread of process {self.pid}")
        pending = self.pending_report(actions)
        if pending is not None:
            return self._report(pending)
        self._resumed = {tid for tid, action in chosen.items() if action is not None}
        try:
            self._put_in_breakpoints()
            for tid, action in chosen.items():
                thread = self.threads_by_tid[tid]
                if action is not None and thread.after is None:
                    self._start(thread, action)
        except TraceeGone:
            return self.ended() or Exited(0)
        except MachineError as error:
            raise RspError(E_BAD_PACKET, str(error)) from None
        return Running()

    def _still_pending(self, thread: _Thread) -> bool:
        """A pending breakpoint event whose breakpoint GDB removed meanwhile is dropped (its PC is back on the
        breakpoint's address, so the instruction runs when the thread goes on: gdbserver's discard)."""
        stop = thread.pending
        if isinstance(stop, Signal) and stop.swbreak and thread.tracee.pc() not in self._wanted:
            thread.pending = None
            return False
        return True

    def poll_stop(self) -> Stop | None:
        if not self._running():
            return None
        self._collect_stops()
        ended = self.ended()
        if ended is not None:
            for thread in self.threads_by_tid.values():
                thread.after = None
            return ended
        # only a thread this resumption resumed may report (one GDB left stopped keeps its event for later: GDB
        # steps one thread over a breakpoint and expects that thread's stop)
        event = next((tid for tid, t in self.threads_by_tid.items() if t.pending is not None and tid in self._resumed),
                     None)
        return None if event is None else self._report(event)

    def _collect_stops(self, step_over: bool = True) -> None:
        """Take in the stops of running threads (each classified: an event for GDB, or none) and adopt new
        threads at their first stop (resumed when the others run); then (`step_over`, unless every thread is being
        stopped) step the threads at a breakpoint GDB is not to hear of past it."""
        stops = self.machine.ptrace.stopped_tids()
        for tid, stop in stops.items():
            thread = self.threads_by_tid.get(tid)
            if thread is None:
                if self._adopt(tid, stop.task) is None:
                    continue
                thread = self.threads_by_tid[tid]
                # the process runs (non-stop: GDB takes a thread it finds to be running): so does its new thread
                if (self._running() or self._non_stop) and not self._stopping:
                    self._go(thread)
                    self._resumed.add(tid)
                continue
            if thread.after is not None and stop.serial > thread.after:
                thread.after = None
                try:
                    event = self._classify(thread, stop)
                    self.threads_by_tid.get(tid, thread).pending = event  # an exec made the thread anew
                except MachineError as error:  # gone meanwhile (its group ended): the process's end says the rest
                    log.info("thread %d: %s", tid, error)
                    self.threads_by_tid.pop(tid, None)
        if not self._running():
            self._lifted.clear()  # every trap on a lifted int3 is taken in
        if step_over and not self._stopping:
            self._step_overs()

    def _reported_hit(self, thread: _Thread, address: int) -> bool:
        """A hit of GDB's breakpoint at `address`: its commands run, and whether GDB hears of it (stub/conditions.py);
        one it does not hear of is counted."""
        options = self._options.get(address)
        if not options:
            return True
        try:
            registers: dict[str, int | None] = dict(thread.tracee.registers())
        except MachineError as error:
            log.info("thread %d at the breakpoint at %#x: %s", thread.tracee.pid, address, error)
            return True

        def read(at: int, length: int) -> bytes:
            try:
                return thread.tracee.read_memory(at, length, hide_int3s=True)
            except MachineError:
                return b""

        if options.judge(registers, self.register_layout(), read, self.command_output):
            return True
        self.silent_hits += 1
        log.debug("thread %d: breakpoint at %#x not reported (%d so far)", thread.tracee.pid, address,
                  self.silent_hits)
        return False

    def _step_overs(self) -> None:
        """Threads at a breakpoint GDB is not to hear of go on past it, one at a time, as gdbserver's linux-low steps
        over a breakpoint (start_step_over, finish_step_over): every other thread stopped quietly, the breakpoint
        taken out (its int3, or its debug register), the thread stepped over its instruction, the breakpoint put back,
        then the threads resumed as they were (the stepped one continuing, or, when GDB had asked it for a step, its
        step reported as done). An event another thread met meanwhile stays pending; in all-stop it is reported
        and nothing is resumed (a thread still at a breakpoint meets it again when GDB resumes it). Only a thread
        the resumption resumed is stepped: one GDB left stopped (all-stop: GDB steps one thread over its breakpoint
        while another waits at a hit whose condition was false, met as the last report stopped everyone) stays
        where it is until GDB resumes it, as gdbserver steps over a breakpoint only a thread it resumes (linux-low's
        need_step_over_p: a thread whose last resumption was a stop "should remain stopped"); stepped and continued
        here, it ran on alone, GDB's breakpoints out of memory."""
        while self.ended() is None:
            thread = next((t for tid, t in self.threads_by_tid.items()
                           if t.step_over is not None and t.after is None and tid in self._resumed), None)
            if thread is None:
                return
            running = self._running()
            known = set(self.threads_by_tid)
            self._stop_all()
            made = [t for tid, t in self.threads_by_tid.items() if tid not in known]  # met at their start meanwhile
            running += made
            self._resumed |= {t.tracee.pid for t in made}
            if self.ended() is not None or self._event_waits():
                return
            type, address = thread.step_over or (BreakpointType.SOFTWARE, 0)
            thread.step_over = None
            self._past_breakpoint(thread, type, address)
            if thread.after is None and thread.pending is None and thread.tracee.ended is None:
                if thread.stepping and not (thread.range and thread.range[0] <= thread.tracee.pc() < thread.range[1]):
                    thread.pending = Signal(SIGTRAP, thread.tracee.pid)  # GDB's step, done
                    thread.range = None
                elif not self._event_waits():
                    self._go(thread, thread.stepping)
            if self._event_waits():
                return
            for other in running:
                if other.after is None and other.pending is None and other.step_over is None:
                    if other.report_stop:  # non-stop's vCont;t asked while we stopped it: its stop is the event
                        other.pending = Signal(0, other.tracee.pid)
                    else:
                        self._go(other, other.stepping)

    def _event_waits(self) -> bool:
        """All-stop: a thread GDB resumed has an event to report (nothing more is to be resumed)."""
        return not self._non_stop and any(t.pending is not None and tid in self._resumed
                                          for tid, t in self.threads_by_tid.items())

    def _past_breakpoint(self, thread: _Thread, type: BreakpointType, address: int) -> None:
        """Step `thread`, stopped at GDB's breakpoint at `address`, over that instruction with the breakpoint out
        (every other thread stopped); what the step met besides its end becomes the thread's event."""
        hardware = [key for key in self._hardware if key[:2] == (type, address)]
        try:
            if type == BreakpointType.SOFTWARE:
                if address in self._inserted:
                    self._inserted.discard(address)
                    self.tracee.debugger_int3s((), [address])
            else:
                for key in hardware:
                    slots = self._hardware.pop(key)
                    if slots:
                        self.machine.run_on_cpu(lambda uc, slots=slots: self.machine.debug_registers.release(slots))
            after = thread.tracee.resume(step=True)
            stop = self.machine.ptrace.wait(thread.tracee.pid, after)
        except MachineError as error:
            log.info("thread %d: step over the breakpoint at %#x: %s", thread.tracee.pid, address, error)
            return
        finally:
            try:
                self._put_in_breakpoints()
                for key in hardware:
                    self._insert_hardware(*key)
            except (MachineError, RspError) as error:
                log.warning("breakpoint at %#x not put back: %s", address, error)
        if stop is None:  # the thread ended (its instruction ended the process)
            return
        if stop.event or stop.signal != SIGTRAP:
            thread.after = None
            thread.pending = self._classify(thread, stop)

    def _adopt(self, tid: int, task: int) -> _Thread | None:
        """A traced task GDB has not seen: a new thread of this process (stopped quietly at its start), or
        another process's."""
        layout = self.machine.ptrace.layout
        try:
            tgid = int.from_bytes(self.machine.read_memory(task + layout.tgid, 4), "little", signed=True)
        except MachineError:
            return None
        if tgid != self.pid:
            return None
        thread = self.threads_by_tid[tid] = _Thread(Tracee(self.machine.ptrace, tid, task))
        return thread

    def _classify(self, thread: _Thread, stop: PtraceStop) -> Stop | None:
        """A thread stopped (`stop`): the stop GDB hears of (the signal as GDB numbers it, or the event), or None
        when there is nothing to tell (a quiet stop; range stepping or a passed signal: the thread goes on)."""
        if stop.event:
            return self._event(thread, stop)
        linux_signal = stop.signal
        if linux_signal == 0:  # a quiet stop: asked by _stop_all (it stays stopped), else stale: it goes on
            if thread.report_stop and not self._stopping:  # non-stop's vCont;t: a stop with signal 0
                return Signal(0, thread.tracee.pid)
            if not self._stopping:
                self._go(thread, thread.stepping)
            return None
        tid = thread.tracee.pid
        signal = signals.to_gdb(linux_signal)
        hit, thread.hit = thread.hit, None
        if signal == SIGTRAP and hit is not None:
            type, address = hit
            if type == BreakpointType.HARDWARE and not self._reported_hit(thread, address):
                thread.step_over = (type, address)
                return None
            thread.range = None
            return (Signal(signal, tid, hwbreak=True) if type == BreakpointType.HARDWARE else
                    Signal(signal, tid, watch=DataAccess(type, address)))
        # straight to the program, GDB not told (gdbserver's linux-low wait_1): never to a thread GDB steps, which
        # GDB must hear of (it runs the handler with a step-resume breakpoint, not stepped), nor a signal that may
        # be a breakpoint's (SIGTRAP, SIGILL, SIGSEGV)
        if signal in self.pass_signals and signal not in _MAYBE_BREAKPOINT and not thread.stepping:
            self._go(thread, False, linux_signal)
            return None
        swbreak = False
        if signal == SIGTRAP:
            rip = thread.tracee.pc()
            if rip - 1 in self._inserted:  # the int3 trapped: the PC goes back on the breakpoint
                thread.tracee.set_pc(rip - 1)
                swbreak = True
                if not self._reported_hit(thread, rip - 1):
                    thread.step_over = (BreakpointType.SOFTWARE, rip - 1)
                    return None
            elif self._lifted_trap(thread, rip - 1):
                # GDB removed that breakpoint while the thread ran, after it trapped: back on the instruction, and on
                # as it was, GDB not told (gdbserver discards such a breakpoint stop; GDB would ignore it as "a
                # delayed software breakpoint trap"); a stop GDB asked for (vCont;t) is still its stop
                thread.tracee.set_pc(rip - 1)
                if thread.report_stop and not self._stopping:
                    return Signal(0, tid)
                if not self._stopping:
                    self._go(thread, thread.stepping)
                return None
            elif thread.range is not None and thread.range[0] <= rip < thread.range[1]:
                self._go(thread, True)
                return None
        thread.range = None
        return Signal(signal, tid, swbreak=swbreak)

    def _lifted_trap(self, thread: _Thread, address: int) -> bool:
        """Did `thread` stop on the int3 GDB's breakpoint at `address` had, lifted since? Its SIGTRAP is an int3's
        (si_code SI_KERNEL, not a step's) and the program's own byte there is no int3 of its own."""
        if address not in self._lifted:
            return False
        try:
            return (thread.tracee.signal_code() == SI_KERNEL
                    and thread.tracee.read_memory(address, 1, hide_int3s=True) not in (b"", INT3))
        except MachineError as error:
            log.info("thread %d at %#x: %s", thread.tracee.pid, address, error)
            return False

    def _event(self, thread: _Thread, stop: PtraceStop) -> Stop | None:
        """An event stop (gdbserver's handle_extended_wait): a fork's or vfork's child made a process target and
        handed to `on_fork` before the event is reported (nobody to take it: detached, and the thread goes on), a
        vfork's end, an exec (the process made anew). An event no one asked for: the thread goes on."""
        tid = thread.tracee.pid
        thread.range = None
        if stop.event in (PTRACE_EVENT_FORK, PTRACE_EVENT_VFORK):
            child = self._fork_child(thread.tracee.event_message())
            if child is not None:
                return Forked(tid, child.pid, vfork=stop.event == PTRACE_EVENT_VFORK)
        elif stop.event == PTRACE_EVENT_VFORK_DONE:
            return VforkDone(tid)
        elif stop.event == PTRACE_EVENT_EXEC:
            return self._execd(stop)
        self._go(thread, thread.stepping)
        return None

    def _fork_child(self, pid: int) -> ProcessTarget | None:
        """The fork child `pid`, once stopped before its first instruction, as a process target given to `on_fork`;
        None when it ended first, or nobody takes it (then it goes on untraced, its breakpoints taken out)."""
        try:
            first = self.machine.ptrace.wait(pid, 0)
        except MachineError as error:
            log.warning("fork child %d: %s", pid, error)
            return None
        if first is None:
            return None
        child = ProcessTarget(Tracee(self.machine.ptrace, pid, first.task), overlay=self.overlay, forked_from=self)
        if self.on_fork is None:
            child.detach()
            child.forget()
            return None
        self.on_fork(child)
        return child

    def _execd(self, stop: PtraceStop) -> Execd:
        """The process exec'd (its thread `stop` names, now with the process's pid, the others ended): made anew, as
        gdbserver mourns it and adds it again: one thread, the new program's path and auxiliary vector, no
        breakpoint (their int3s went with the old address space: machine/int3s.py), no debug register."""
        tracee = Tracee(self.machine.ptrace, self.pid, stop.task)
        self.leader = tracee
        self.threads_by_tid = {self.pid: _Thread(tracee)}
        self._resumed.add(self.pid)
        self._wanted.clear()
        self._inserted.clear()
        self._options.clear()
        self._release_hardware()
        self._last_of.clear()
        self.auxv = initial_auxv(tracee)
        self.exec_path = auxv_below_stack_top(tracee)[0] or self.exec_path
        return Execd(self.pid, self.exec_path)

    def _report(self, tid: int) -> Stop:
        """Thread `tid`'s event, once every other thread is stopped too (all-stop: gdbserver's stop_all_lwps);
        events the others meet meanwhile wait for the next resumption."""
        self._stop_all()
        thread = self.threads_by_tid[tid]
        stop, thread.pending = thread.pending, None
        assert stop is not None
        self._last = stop
        return stop

    def _stop_all(self) -> None:
        """Stop every running thread (quietly: no signal) and wait for each, and for each thread the process made
        that has not stopped at its start yet; their own events become pending. gdbserver's stop_all_lwps stops a
        clone child too, known from its parent's clone event; the machine hears of a new thread only at its first
        stop, which may come after every thread it knew of stopped: met later, it would go on under whatever GDB
        resumes next, a step of one thread over a breakpoint GDB lifted meanwhile among them, and run past it."""
        self._stopping = True
        try:
            self._stop_running()
        finally:
            self._stopping = False

    def _stop_running(self) -> None:
        ptrace = self.machine.ptrace
        while True:
            for thread in self._running():  # each running thread asked once (one going on again: again)
                if not thread.asked_stop:
                    thread.asked_stop = True
                    try:
                        thread.tracee.interrupt(quiet=True)
                    except MachineError as error:
                        log.info("stop thread %d: %s", thread.tracee.pid, error)
            serial = ptrace.serial
            self._collect_stops()
            unmet = self._forget_gone_threads()
            if self.ended() is not None or not (self._running() or unmet):
                break
            if any(not thread.asked_stop for thread in self._running()):
                # one stopped with a signal GDB passes instead (the kernel takes that stop for the quiet one asked)
                # and went on with it: asked again before the wait, which its stop, older, would not end
                continue
            if self._running():
                ptrace.wait_serial(serial)
                continue
            try:  # only new threads left, each stopping at its start on its own
                ptrace.wait_serial(serial, _NEW_THREAD_S)
            except MachineError:
                log.info("threads %s of process %d did not stop at their start", sorted(unmet), self.pid)
                break
        if self.ended() is not None:
            for thread in self.threads_by_tid.values():
                thread.after = None

    def interrupt(self) -> Stop:
        """Ctrl-C: SIGINT for the process (its leader, or a running thread), then what it stopped with first."""
        running = self._running()
        if not running:
            return self.stop_reason()
        target = next((t for t in running if t.tracee.pid == self.pid), running[0])
        try:
            target.tracee.interrupt()
            while True:
                serial = self.machine.ptrace.serial
                stop = self.poll_stop()
                if stop is not None:
                    return stop
                self.machine.ptrace.wait_serial(serial)
        except MachineError as error:
            log.warning("interrupt: %s", error)
            for thread in self.threads_by_tid.values():
                thread.after = None
            return self.ended() or Signal(SIGINT, self.pid)


@dataclass
class _Thread:
    """A thread of the process, as the all-stop run control keeps it."""

    tracee: Tracee
    after: int | None = None  #: resumed: the serial its next stop will be above; None: stopped
    pending: Stop | None = None  #: an event GDB has not heard of yet
    range: tuple[int, int] | None = None  #: range stepping
    stepping: bool = False
    hit: tuple[BreakpointType, int] | None = None  #: the debug register that stopped it
    asked_stop: bool = False  #: _stop_all asked it to stop since it was last resumed
    report_stop: bool = False  #: non-stop: GDB asked it to stop (vCont;t): its quiet stop is an event
    #: stopped at GDB's breakpoint (its type and address) without GDB being told: to be stepped over it
    step_over: tuple[BreakpointType, int] | None = None
