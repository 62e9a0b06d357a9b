"""The gdbserver role's target: one program on the simulated kernel, traced through the kernel's ptrace, as GDB
sees a process under gdbserver (gdbserver/linux-low.cc, linux-x86-low.cc).

The second implementation of the target interface (stub/target.py), beside KGTP mode's kernel. Its thread is the
process's (single-threaded: the thread id is the pid). It is stopped where gdbserver stops a program: at its first
instruction after exec, then at every signal it gets (breakpoint, single step, fault, the user's Ctrl-C); while it
is stopped the kernel and every other process run on. Registers are the process's (x86-64 Linux's description:
the core, SSE, `orig_rax`, `fs_base`, `gs_base`), memory its own address space, both writable, as a debugger's are
(the kernel's half is read-only here: KGTP mode's `--allow-writes` is the way to write it).

Software breakpoints (`Z0`) are int3s in the process's memory, as gdbserver's mem-break.cc inserts them: reads show
the original bytes, writes over one keep it; they are written when the process resumes and taken out only when
GDB removes them and resumes again (GDB removes and reinserts every breakpoint at each stop: unchanged, memory is
not touched). A stop on an int3 of ours is reported as `swbreak` with the PC back on the breakpoint. Range
stepping (`vCont;r`) steps here until the PC leaves the range.

Runs on the server thread, as every handler; the stop listener on the CPU thread only wakes the server.
"""

from __future__ import annotations

import functools
import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..arch import amd64, signals
from ..machine import MachineError
from ..machine import smp
from ..machine.tracee import SIGTRAP, TASK_SIZE_MAX, Tracee, TraceeGone
from ..tracing.core.model import TraceError
from ..machine.watchpoints import EXECUTE, READ_WRITE, WRITE, WatchpointError, aligned_pieces, busy_message
from ..rsp.dispatch import E_BAD_PACKET, E_MEMORY, E_PERMISSION, Binary, Reply, RspError, handles
from ..rsp.packets import connect as c
from ..rsp.packets import run as v
from .overlay import FrameOverlay
from .target import (SIGINT, Breakpoints, BreakpointType, DataAccess, Exited, MemoryWrites, RegisterWrites, Resume, ResumeAction,
                     Running, Signal, Stop, Target, Terminated, ViewError)

log = logging.getLogger(__name__)

INT3 = b"\xcc"
#: auxv entries are (type, value) pairs of 64-bit words, ended by AT_NULL
_AT_NULL = 0
_LINUX_XML = amd64.LINUX.target_xml().encode()


class ProcessView:
    """The live process as a trace frame's view reads what the frame did not collect (read-only memory)."""

    def __init__(self, target: ProcessTarget) -> None:
        self.target = target

    def registers(self) -> dict[str, int | None]:
        return self.target.live_registers()

    def read_memory(self, address: int, length: int) -> bytes:
        return self.target.live_memory(address, length)


class ProgramSpace:
    """The process as the tracer's `UserSpace` (tracing/core/run.py): tracepoints at its addresses go into its
    memory."""

    def __init__(self, tracee: Tracee) -> None:
        self.tracee = tracee
        self._space = tracee.space()
        self.root = self._space.root

    def holds(self, address: int) -> bool:
        return 0 <= address < TASK_SIZE_MAX

    def space(self) -> Any:
        return self._space

    def prepare(self, addresses: list[int]) -> None:
        """Their pages present: the process faults them in itself (it must be stopped, as GDB has it at
        tstart)."""
        for address in addresses:
            if self._space.translate(address) is None and not self.tracee.fault_in(address):
                raise TraceError(f"{address:#x}: no memory of the process there")


class ProcessTarget(Target, RegisterWrites, MemoryWrites, Resume, Breakpoints):
    """A traced process (`tracee`) of the machine; `exec_path` is its program's path inside the machine. A trace
    frame GDB selects (`tfind`) is laid over it (`overlay`), as over KGTP mode's kernel."""

    def __init__(self, tracee: Tracee, exec_path: str) -> None:
        self.overlay = FrameOverlay(ProcessView(self))
        self.tracee = tracee
        self.machine = tracee.machine
        self.pid = tracee.pid
        self.exec_path = exec_path
        self._last: Stop = Signal(SIGTRAP, self.pid)
        self._wanted: set[int] = set()  #: software breakpoints GDB has set
        self._inserted: dict[int, int] = {}  #: int3s in the process's memory -> the byte they replace
        self._hardware: dict[tuple[BreakpointType, int, int], list[int]] = {}  #: Z1-Z4 -> debug registers
        self._hit: tuple[BreakpointType, int] | None = None  #: the debug register that stopped the process
        self._after: int | None = None  #: resumed: the serial its next stop will be above
        self._range: tuple[int, int] | None = None
        self._stepping = False
        self._notify: Callable[[], None] | None = None
        self.detached = False  #: GDB detached: the process goes on untraced
        #: GDB's signals given to the program without a stop (QPassSignals), and those it may be resumed with
        #: (QProgramSignals; None: any)
        self.pass_signals: frozenset[int] = frozenset()
        self.program_signals: frozenset[int] | None = None
        self.auxv = self._initial_auxv()
        self.machine.ptrace.listeners.append(self._heard)

    # ---- the process -------------------------------------------------------------------------------------

    def _initial_auxv(self) -> bytes:
        """The auxiliary vector the kernel gave the program, read at its first instruction (the stack is then as
        exec left it: argc, argv, NULL, envp, NULL, auxv), as Linux keeps a copy for /proc/PID/auxv."""
        rsp = self.tracee.registers()["rsp"]
        words = 4096 // 8
        stack = self.tracee.read_memory(rsp, 8 * words)
        values = struct.unpack(f"<{len(stack) // 8}Q", stack[: len(stack) // 8 * 8])
        at = 1 + values[0] + 1  # past argc, argv, argv's NULL
        while at < len(values) and values[at]:
            at += 1
        at += 1  # envp's NULL
        start = at
        while at + 1 < len(values) and values[at] != _AT_NULL:
            at += 2
        return struct.pack(f"<{at + 2 - start}Q", *values[start: at + 2]) if at + 1 < len(values) else b""

    def ended(self) -> Stop | None:
        status = self.tracee.ended
        if status is None:
            return None
        return Terminated(signals.to_gdb(status & 0x7F)) if status & 0x7F else Exited(status >> 8 & 0xFF)

    # ---- base -------------------------------------------------------------------------------------------------

    def threads(self) -> Sequence[int]:
        return (self.pid,)

    def process_id(self) -> int:
        return self.pid

    def thread_alive(self, thread: int) -> bool:
        return thread == self.pid and self.tracee.ended is None

    def register_layout(self) -> amd64.RegisterLayout:
        return amd64.LINUX

    def feature_document(self, annex: str) -> bytes | None:
        return _LINUX_XML if annex == "target.xml" else None

    def read_registers(self, thread: int) -> dict[str, int | None]:
        view = self.overlay.view
        return view.registers() if view is not None else self.live_registers()

    def live_registers(self) -> dict[str, int | None]:
        try:
            return dict(self.tracee.registers())
        except MachineError as error:
            raise RspError(E_MEMORY, str(error)) from None

    def read_memory(self, address: int, length: int, thread: int, space: object | None = None) -> bytes:
        view = self.overlay.view
        return view.read_memory(address, length) if view is not None else self.live_memory(address, length)

    def live_memory(self, address: int, length: int) -> bytes:
        """Its memory as the program sees it (the breakpoints' int3s hidden); the kernel's half read-only."""
        try:
            data = bytearray(self.tracee.read_memory(address, length))
        except MachineError as error:
            raise ViewError(str(error)) from None
        if not data:
            raise ViewError(f"cannot access memory at {address:#x}")
        for at, original in self._inserted.items():
            if address <= at < address + len(data):
                data[at - address] = original
        return bytes(data)

    def stop_reason(self) -> Stop:
        return self.ended() or self._last

    def attached(self) -> bool:
        return False  # started for GDB, as gdbserver's PROG: quitting GDB kills it

    def _release_hardware(self) -> None:
        slots = [slot for taken in self._hardware.values() for slot in taken]
        self._hardware.clear()
        if slots:
            self.machine.run_on_cpu(lambda uc: self.machine.debug_registers.release(slots))

    def detach(self) -> None:
        self._release_hardware()
        self._take_out_breakpoints(everything=True)
        self._wanted.clear()
        self.detached = True
        try:
            self.tracee.detach()
        except MachineError as error:
            log.info("detach: %s", error)

    def kill(self) -> None:
        self._release_hardware()
        try:
            self.tracee.kill()
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

    # ---- writes ---------------------------------------------------------------------------------------------

    def _refuse_in_frame(self) -> None:
        if self.overlay.view is not None:
            raise RspError(E_PERMISSION, "cannot write while a trace frame is selected")

    def write_registers(self, thread: int, values: dict[str, int]) -> None:
        self._refuse_in_frame()
        try:
            self.tracee.write_registers(values)
        except MachineError as error:
            raise RspError(E_MEMORY, str(error)) from None

    def write_memory(self, address: int, data: bytes, thread: int, space: object | None = None) -> None:
        self._refuse_in_frame()
        if address + len(data) > TASK_SIZE_MAX:
            raise RspError(E_PERMISSION, f"{address:#x}: the kernel's memory is not the process's to write")
        patched = bytearray(data)
        for at in self._inserted:
            if address <= at < address + len(data):  # the int3 stays; what it hides is the new byte
                self._inserted[at] = data[at - address]
                patched[at - address] = INT3[0]
        try:
            self.tracee.write_memory(address, bytes(patched))
        except MachineError as error:
            raise ViewError(str(error)) from None

    # ---- breakpoints ------------------------------------------------------------------------------------------

    def supports(self, type: BreakpointType) -> bool:
        """x86's: no read-only watchpoint (gdbserver's x86_supports_z_point_type)."""
        return type != BreakpointType.READ_WATCHPOINT

    def insert_breakpoint(self, type: BreakpointType, address: int, kind: int) -> None:
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

    def remove_breakpoint(self, type: BreakpointType, address: int, kind: int) -> None:
        if type != BreakpointType.SOFTWARE:
            slots = self._hardware.pop((type, address, kind), None)
            if slots:
                self.machine.run_on_cpu(lambda uc: self.machine.debug_registers.release(slots))
            return
        self._wanted.discard(address)

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
                    raise RspError(E_BAD_PACKET, f"cannot access memory at {piece:#x}")
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
        if smp.current_task(uc) != self.tracee.task:
            return
        self._hit = (type, address)
        self.machine.cpu.deliver(1)

    def _put_in_breakpoints(self) -> None:
        """Memory follows GDB's breakpoints before the process runs: int3s in, removed ones out (one trip to the
        machine for all of them)."""
        leaving = [a for a in self._inserted if a not in self._wanted]
        coming = sorted(self._wanted - self._inserted.keys())
        if not leaving and not coming:
            return
        changes = [(a, bytes([self._inserted[a]])) for a in leaving] + [(a, INT3) for a in coming]
        replaced = self.tracee.swap_bytes(changes)
        for address in leaving:
            del self._inserted[address]
        for address, old in zip(coming, replaced[len(leaving):]):
            if old is not None:
                self._inserted[address] = old[0]

    def _take_out_breakpoints(self, everything: bool) -> None:
        for address in [a for a in self._inserted if everything or a not in self._wanted]:
            original = self._inserted.pop(address)
            try:
                self.tracee.write_memory(address, bytes([original]))
            except MachineError as error:
                log.info("breakpoint at %#x: %s", address, error)

    # ---- run control ------------------------------------------------------------------------------------------

    def range_stepping(self) -> bool:
        return True

    def notify_stops(self, notify: Callable[[], None]) -> None:
        self._notify = notify

    def _heard(self, pid: int) -> None:
        """A stop or an end of some traced process (CPU thread): ours wakes the server."""
        if pid == self.pid and self._after is not None and self._notify is not None:
            self._notify()

    def resume(self, actions: Sequence[ResumeAction]) -> Stop | Running:
        action = next((a for a in actions if a.thread in (self.pid, c.ANY_THREAD, c.ALL_THREADS)), None)
        ended = self.ended()
        if ended is not None:
            return ended
        if action is None:
            raise RspError(E_BAD_PACKET, f"no action for thread {self.pid}, the process's only one")
        try:
            self._put_in_breakpoints()
            self._range = action.range if action.step else None
            self._stepping = action.step
            signal = action.signal
            if self.program_signals is not None and signal not in self.program_signals:
                signal = 0  # gdbserver drops a signal GDB may not give the program
            self._after = self.tracee.resume(step=action.step, signal=signals.to_linux(signal) or 0)
        except TraceeGone:
            return self.ended() or Exited(0)
        except MachineError as error:
            raise RspError(E_BAD_PACKET, str(error)) from None
        return Running()

    def poll_stop(self) -> Stop | None:
        if self._after is None:
            return None
        stop = self.machine.ptrace.stop_of(self.pid)
        if stop is None or stop.serial <= self._after:
            ended = self.ended()
            if ended is None:
                return None
            self._after = None
            return ended
        return self._stopped(stop.signal)

    def _stopped(self, linux_signal: int) -> Stop | None:
        """The process stopped with `linux_signal`: the stop GDB hears of (the signal as GDB numbers it), or None
        when range stepping goes on."""
        signal = signals.to_gdb(linux_signal)
        swbreak = False
        hit, self._hit = self._hit, None
        if signal == SIGTRAP and hit is not None:
            self._after = self._range = None
            type, address = hit
            self._last = (Signal(signal, self.pid, hwbreak=True) if type == BreakpointType.HARDWARE else
                          Signal(signal, self.pid, watch=DataAccess(type, address)))
            return self._last
        if signal in self.pass_signals and signal != SIGTRAP:  # straight to the program, GDB not told
            self._after = self.tracee.resume(step=self._stepping, signal=linux_signal)
            return None
        if signal == SIGTRAP:
            rip = self.tracee.pc()
            if rip - 1 in self._inserted:  # the int3 trapped: the PC goes back on the breakpoint
                self.tracee.set_pc(rip - 1)
                swbreak = True
            elif self._range is not None and self._range[0] <= rip < self._range[1]:
                self._after = self.tracee.resume(step=True)
                return None
        self._after = None
        self._range = None
        self._last = Signal(signal, self.pid, swbreak=swbreak)
        return self._last

    def interrupt(self) -> Stop:
        """Ctrl-C: the process stops with SIGINT (or whatever stopped it first)."""
        if self._after is None:
            return self.stop_reason()
        try:
            self.tracee.interrupt()
            while True:
                stop = self.machine.ptrace.wait(self.pid, self._after)
                if stop is None:
                    self._after = None
                    return self.ended() or Exited(0)
                reported = self._stopped(stop.signal)
                if reported is not None:
                    return reported
        except MachineError as error:
            log.warning("interrupt: %s", error)
            self._after = None
            return self.ended() or Signal(SIGINT, self.pid)


@dataclass
class ProcessHandlers:
    """The packets only a process has: its auxiliary vector, its program's path and the siginfo of its stop
    (gdbserver's qXfer objects)."""

    target: ProcessTarget

    @staticmethod
    def _window(document: bytes, packet: c.ReadFeatures) -> Reply:
        chunk = document[packet.offset: packet.offset + packet.length]
        return Binary((b"m" if packet.offset + len(chunk) < len(document) else b"l") + chunk)

    @handles(c.ReadAuxv)
    def read_auxv(self, packet: c.ReadAuxv) -> Reply:
        if packet.annex:
            raise RspError(E_BAD_PACKET, "qXfer:auxv:read takes no annex")
        return self._window(self.target.auxv, packet)

    @handles(v.VKill)
    def vkill(self, packet: v.VKill) -> Reply:
        """gdbserver's handle_v_kill: E for a process it does not have, else the process killed and OK."""
        if packet.pid != self.target.pid:
            raise RspError(E_BAD_PACKET, f"no process {packet.pid:x}")
        self.target.kill()
        return b"OK"

    @handles(v.PassSignals)
    def pass_signals(self, packet: v.PassSignals) -> Reply:
        self.target.pass_signals = packet.signals
        return b"OK"

    @handles(v.ProgramSignals)
    def program_signals(self, packet: v.ProgramSignals) -> Reply:
        self.target.program_signals = packet.signals
        return b"OK"

    @handles(c.ReadSiginfo)
    def read_siginfo(self, packet: c.ReadSiginfo) -> Reply:
        if packet.annex:
            raise RspError(E_BAD_PACKET, "qXfer:siginfo:read takes no annex")
        try:
            siginfo = self.target.tracee.siginfo()
        except MachineError as error:
            raise RspError(E_BAD_PACKET, str(error)) from None
        return self._window(siginfo, packet)

    @handles(c.ReadExecFile)
    def read_exec_file(self, packet: c.ReadExecFile) -> Reply:
        """The program's path inside the machine, never a host file's contents (gdbserver answers the path of
        /proc/PID/exe)."""
        try:
            pid = int(packet.annex, 16) if packet.annex else self.target.pid
        except ValueError:
            raise RspError(E_BAD_PACKET, f"qXfer:exec-file:read: {packet.annex!r} is no pid") from None
        if pid != self.target.pid:
            raise RspError(E_BAD_PACKET, f"no process {packet.annex}")
        return self._window(self.target.exec_path.encode(), packet)
