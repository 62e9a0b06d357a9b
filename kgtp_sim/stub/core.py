"""Connect-time, register and memory packets: what lets GDB attach to the live kernel and look at it.

The thread packets, and which CPU the registers come from, are stub/threads.py's; the stop replies here name the
thread it says. Runs on the server thread."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..arch import amd64
from ..rsp.dispatch import E_MEMORY, E_PERMISSION, Binary, Deferred, Reply, RspError, handles
from ..rsp.packets import connect as c
from ..rsp.packets import data as d
from ..rsp.packets import replay as r
from ..tracing.core.frames import StateView, ViewError
from .replay import Replay
from .threads import ThreadHandlers

log = logging.getLogger(__name__)


class ViewHolder:
    """The current view; a separate object so the tracing handlers can switch it without owning this family.

    A replay (`monitor replay`, stub/replay.py) outranks the rest: GDB's `tfind -1` clears the selected trace
    frame and leaves the replayed frame as the stopped state; selecting a trace frame ends the replay."""

    def __init__(self, live: StateView, current: StateView | None = None) -> None:
        self.live = live
        self._current = current
        self.replay: Replay | None = None

    @property
    def current(self) -> StateView | None:
        return self._current

    @current.setter
    def current(self, view: StateView | None) -> None:
        if view is not None:
            self.end_replay()
        self._current = view

    def end_replay(self) -> None:
        self.replay = None

    @property
    def view(self) -> StateView:
        if self.replay is not None:
            return self.replay.view()
        return self.current if self.current is not None else self.live


@dataclass
class CoreHandlers:
    views: ViewHolder
    threads: ThreadHandlers
    allow_writes: bool = False
    write_memory: object = None  # callable(address, data) used only when allow_writes
    _xml: bytes = field(init=False, default_factory=lambda: amd64.target_xml().encode())

    @handles(c.StartNoAckMode)
    def start_no_ack_mode(self, packet: c.StartNoAckMode) -> Reply:
        return b"OK"

    @handles(c.MustReplyEmpty)
    def must_reply_empty(self, packet: c.MustReplyEmpty) -> Reply:
        return b""

    @handles(c.HaltReason)
    def halt_reason(self, packet: c.HaltReason) -> Reply:
        return self.threads.stop_reply()

    @handles(c.Attached)
    def attached(self, packet: c.Attached) -> Reply:
        # "1": GDB attached to something that existed before it, so quitting GDB detaches instead of killing.
        return b"1"

    @handles(c.Offsets)
    def offsets(self, packet: c.Offsets) -> Reply:
        return b"Text=0;Data=0;Bss=0"

    @handles(c.SymbolLookup)
    def symbol_lookup(self, packet: c.SymbolLookup) -> Reply:
        return b"OK"

    @handles(c.Detach)
    def detach(self, packet: c.Detach) -> Reply:
        return b"OK"

    @handles(c.Kill)
    def kill(self, packet: c.Kill) -> Reply:
        # KGTP never stops the kernel: `kill` only ends the session.
        return b"OK"

    @handles(c.Continue)
    def continue_(self, packet: c.Continue) -> Reply:
        if self.views.replay is not None:
            return self._resume(step=False, reverse=False)
        return Deferred()

    # ---- replay of a while-stepping recording (stub/replay.py); the live kernel is never stopped ------------------

    def _resume(self, *, step: bool, reverse: bool) -> Reply:
        replay = self.views.replay
        if replay is None:
            raise RspError(E_PERMISSION, "the kernel never stops: step and reverse only replay a while-stepping "
                           "recording (tfind one of its frames, then `monitor replay`)", text=True)
        if replay.resume(step=step, reverse=reverse):
            return self.threads.stop_reply()
        return b"T05replaylog:%s;thread:%x;" % (b"begin" if reverse else b"end", self.threads.general_thread)

    @handles(r.Step)
    def step(self, packet: r.Step) -> Reply:
        return self._resume(step=True, reverse=False)

    @handles(r.ReverseStep)
    def reverse_step(self, packet: r.ReverseStep) -> Reply:
        return self._resume(step=True, reverse=True)

    @handles(r.ReverseContinue)
    def reverse_continue(self, packet: r.ReverseContinue) -> Reply:
        return self._resume(step=False, reverse=True)

    @handles(r.InsertBreakpoint)
    def insert_breakpoint(self, packet: r.InsertBreakpoint) -> Reply:
        """Only in a replay, only software breakpoints, and only in the replay's own table: outside one the
        empty reply says the stub has none (the kernel is never patched for a breakpoint)."""
        if self.views.replay is None or packet.type != 0:
            return b""
        self.views.replay.breakpoints.add(packet.address)
        return b"OK"

    @handles(r.RemoveBreakpoint)
    def remove_breakpoint(self, packet: r.RemoveBreakpoint) -> Reply:
        if self.views.replay is None or packet.type != 0:
            return b""
        self.views.replay.breakpoints.discard(packet.address)
        return b"OK"

    @handles(c.ReadFeatures)
    def read_features(self, packet: c.ReadFeatures) -> Reply:
        if packet.annex != "target.xml":
            raise RspError(0x00, f"no feature document {packet.annex!r}")
        chunk = self._xml[packet.offset : packet.offset + packet.length]
        more = packet.offset + len(chunk) < len(self._xml)
        return Binary((b"m" if more else b"l") + chunk)

    @handles(d.ReadRegisters)
    def read_registers(self, packet: d.ReadRegisters) -> Reply:
        """`g`, as remote.c: remote_target::fetch_registers asks it after set_general_thread: the selected trace
        frame's registers, else the live registers of the CPU whose thread `Hg` selected (stub/threads.py)."""
        return amd64.hex_registers(self.views.view.registers()).encode()

    @handles(d.ReadRegister)
    def read_register(self, packet: d.ReadRegister) -> Reply:
        if packet.regnum >= len(amd64.REGISTERS):
            raise RspError(0x01, f"no register {packet.regnum}")
        reg = amd64.REGISTERS[packet.regnum]
        return amd64.hex_registers(self.views.view.registers())[
            2 * amd64.OFFSETS[packet.regnum] : 2 * (amd64.OFFSETS[packet.regnum] + reg.size)
        ].encode()

    @handles(d.WriteRegisters)
    def write_registers(self, packet: d.WriteRegisters) -> Reply:
        """`G` and `P` are refused on every CPU, also with --allow-writes (which opens memory only)."""
        raise RspError(E_PERMISSION, "registers of the running kernel cannot be changed")

    @handles(d.WriteRegister)
    def write_register(self, packet: d.WriteRegister) -> Reply:
        raise RspError(E_PERMISSION, "registers of the running kernel cannot be changed")

    @handles(d.ReadMemory)
    def read_memory(self, packet: d.ReadMemory) -> Reply:
        if packet.length == 0:
            return b""
        try:
            data = self.views.view.read_memory(packet.address, packet.length)
        except ViewError as error:
            raise RspError(E_MEMORY, str(error)) from None
        if not data:
            raise RspError(E_MEMORY, f"cannot read {packet.address:#x}")
        return data.hex().encode()

    @handles(d.WriteMemory)
    def write_memory_hex(self, packet: d.WriteMemory) -> Reply:
        return self._write(packet.address, packet.data)

    @handles(d.WriteMemoryBinary)
    def write_memory_binary(self, packet: d.WriteMemoryBinary) -> Reply:
        return self._write(packet.address, packet.data)

    def _write(self, address: int, data: bytes) -> Reply:
        if not self.allow_writes or self.write_memory is None:
            raise RspError(E_PERMISSION, "writes to kernel memory are disabled (start with --allow-writes)")
        if self.views.current is not None or self.views.replay is not None:
            raise RspError(E_PERMISSION, "cannot write while a trace frame is selected or replayed")
        try:
            self.write_memory(address, data)  # type: ignore[operator]
        except ViewError as error:
            raise RspError(E_MEMORY, str(error)) from None
        return b"OK"

