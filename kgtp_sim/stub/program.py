"""What the gdbserver role adds around its process target (stub/process.py): the packets only a process has, and
the program as the tracer's user space.

- `ProcessHandlers`: `qXfer:auxv:read`, `qXfer:exec-file:read`, `qXfer:siginfo:read`, `qXfer:threads:read`
  (gdbserver's qXfer objects),
  `vKill`, `QPassSignals`, `QProgramSignals`;
- `ProgramSpace`: the process as tracing/core/run.py's `UserSpace`, so that tracepoints at its addresses go into
  its own memory (tracing/engines/userprobes.py).

Runs on the server thread, as every handler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from xml.sax.saxutils import escape

from ..machine import MachineError
from ..machine.layout import PAGE_SIZE
from ..machine.tracee import TASK_SIZE_MAX, Tracee
from ..rsp.dispatch import E_BAD_PACKET, Binary, Reply, RspError, handles
from ..rsp.packets import connect as c
from ..rsp.packets import run as v
from ..tracing.core.model import TraceError
from .extended import Inferior
from .threads import ThreadHandlers


#: a jump pad area's size in pages (room for hundreds of pads) and a rel32 jump's reach either way
PAD_PAGES = 16
JUMP_REACH = 1 << 31


class ProgramSpace:
    """The process as the tracer's `UserSpace` (tracing/core/run.py): tracepoints at its addresses go into its
    memory."""

    def __init__(self, tracee: Tracee) -> None:
        self.tracee = tracee
        self._space = tracee.space()
        self.root = self._space.root
        self._pads: list[int] = []  #: the jump pad areas it mapped (Tracee.map_jump_pad)

    def holds(self, address: int) -> bool:
        return 0 <= address < TASK_SIZE_MAX

    def space(self) -> Any:
        return self._space

    def prepare(self, addresses: list[int], fast: list[int] = ()) -> None:
        """Their pages present: the process faults them in itself (it must be stopped, as GDB has it at
        tstart). A fast tracepoint's address gets a jump pad area within its jump's reach, mapped by the process
        (Tracee.map_jump_pad) the first time one is needed there and kept for the process's life."""
        for address in addresses:
            if self._space.translate(address) is None and not self.tracee.fault_in(address):
                raise TraceError(f"{address:#x}: no memory of the process there")
        for address in fast:
            if self.pad_area(address) is None:
                try:
                    self._pads.append(self.tracee.map_jump_pad(address, PAD_PAGES))
                except MachineError as error:
                    raise TraceError(f"fast tracepoint at {address:#x}: {error}") from None

    def pad_area(self, address: int) -> tuple[int, int] | None:
        size = PAD_PAGES * PAGE_SIZE
        for start in self._pads:
            if start - address + size < JUMP_REACH and address - start < JUMP_REACH - size:
                return start, size
        return None


@dataclass
class ProcessHandlers:
    """The packets only a process has: its auxiliary vector, its program's path and the siginfo of its stop
    (gdbserver's qXfer objects); those of the process GDB debugs now (E01 with none)."""

    target: Inferior
    threads: ThreadHandlers
    _threads_document: bytes | None = None  #: read in windows: made at the first, kept for the next

    @staticmethod
    def _window(document: bytes, packet: c.ReadFeatures) -> Reply:
        chunk = document[packet.offset: packet.offset + packet.length]
        return Binary((b"m" if packet.offset + len(chunk) < len(document) else b"l") + chunk)

    @handles(c.ReadAuxv)
    def read_auxv(self, packet: c.ReadAuxv) -> Reply:
        if packet.annex:
            raise RspError(E_BAD_PACKET, "qXfer:auxv:read takes no annex")
        return self._window(self.target.current().auxv, packet)

    @handles(v.VKill)
    def vkill(self, packet: v.VKill) -> Reply:
        """gdbserver's handle_v_kill: E for a process it does not have, else the process killed and OK."""
        self.target.kill_process(packet.pid)
        return b"OK"

    @handles(v.PassSignals)
    def pass_signals(self, packet: v.PassSignals) -> Reply:
        self.target.set_signals(passed=packet.signals)
        return b"OK"

    @handles(v.ProgramSignals)
    def program_signals(self, packet: v.ProgramSignals) -> Reply:
        self.target.set_signals(program=packet.signals)
        return b"OK"

    @handles(c.ReadSiginfo)
    def read_siginfo(self, packet: c.ReadSiginfo) -> Reply:
        if packet.annex:
            raise RspError(E_BAD_PACKET, "qXfer:siginfo:read takes no annex")
        try:
            siginfo = self.target.current().tracee.siginfo()
        except MachineError as error:
            raise RspError(E_BAD_PACKET, str(error)) from None
        return self._window(siginfo, packet)

    @handles(c.ReadThreads)
    def read_threads(self, packet: c.ReadThreads) -> Reply:
        """Each thread, its name (the task's comm) and the CPU it is bound to, as gdbserver's document."""
        if packet.annex:
            raise RspError(E_BAD_PACKET, "qXfer:threads:read takes no annex")
        if packet.offset == 0 or self._threads_document is None:
            self._threads_document = self._document()
        return self._window(self._threads_document, packet)

    def _document(self) -> bytes:
        process = self.target.process
        machine = self.target.machine
        layout = machine.ptrace.layout
        lines = ["<?xml version=\"1.0\"?>", "<threads>"]
        for tid in self.target.threads():
            thread = process.threads_by_tid.get(tid) if process is not None else None
            name, core = "", -1
            if thread is not None:
                try:
                    raw = machine.read_memory(thread.tracee.task + layout.comm, 16)
                    name = escape(raw.split(b"\0", 1)[0].decode("latin-1"), {'"': "&quot;"})
                    core = int.from_bytes(machine.read_memory(thread.tracee.task + layout.cpu, 4), "little",
                                          signed=True)
                except MachineError:
                    pass
            attributes = f' id="{self.threads.thread_id(tid).decode()}"'
            if core >= 0:
                attributes += f' core="{core}"'
            if name:
                attributes += f' name="{name}"'
            lines.append(f"<thread{attributes}/>")
        lines.append("</threads>")
        return ("\n".join(lines) + "\n").encode()

    @handles(c.ReadExecFile)
    def read_exec_file(self, packet: c.ReadExecFile) -> Reply:
        """The program's path inside the machine, never a host file's contents (gdbserver answers the path of
        /proc/PID/exe)."""
        process = self.target.current()
        try:
            pid = int(packet.annex, 16) if packet.annex else process.pid
        except ValueError:
            raise RspError(E_BAD_PACKET, f"qXfer:exec-file:read: {packet.annex!r} is no pid") from None
        if pid != process.pid:
            raise RspError(E_BAD_PACKET, f"no process {packet.annex}")
        return self._window(process.exec_path.encode(), packet)
