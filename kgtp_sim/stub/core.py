"""Connect-time, register and memory packets: what lets GDB attach to the live kernel and look at it."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..arch import amd64
from ..rsp.dispatch import E_MEMORY, E_PERMISSION, Binary, Deferred, Reply, RspError, handles
from ..rsp.packets import connect as c
from ..rsp.packets import data as d
from ..tracing.frames import StateView, ViewError

log = logging.getLogger(__name__)

#: The whole kernel is presented to GDB as one thread of one process, as KGTP does.
THREAD_ID = 1


@dataclass
class ViewHolder:
    """The current view; a separate object so the tracing handlers can switch it without owning this family."""

    live: StateView
    current: StateView | None = None

    @property
    def view(self) -> StateView:
        return self.current if self.current is not None else self.live


@dataclass
class CoreHandlers:
    views: ViewHolder
    allow_writes: bool = False
    write_memory: object = None  # callable(address, data) used only when allow_writes
    _xml: bytes = field(init=False, default_factory=lambda: amd64.target_xml().encode())

    @handles(c.StartNoAckMode)
    def start_no_ack_mode(self, packet: c.StartNoAckMode) -> Reply:
        return b"OK"

    @handles(c.MustReplyEmpty)
    def must_reply_empty(self, packet: c.MustReplyEmpty) -> Reply:
        return b""

    @handles(c.SetThread)
    def set_thread(self, packet: c.SetThread) -> Reply:
        return b"OK"

    @handles(c.HaltReason)
    def halt_reason(self, packet: c.HaltReason) -> Reply:
        return stop_reply()

    @handles(c.FirstThreadInfo)
    def first_thread_info(self, packet: c.FirstThreadInfo) -> Reply:
        return b"m%x" % THREAD_ID

    @handles(c.SubsequentThreadInfo)
    def subsequent_thread_info(self, packet: c.SubsequentThreadInfo) -> Reply:
        return b"l"

    @handles(c.CurrentThread)
    def current_thread(self, packet: c.CurrentThread) -> Reply:
        return b"QC%x" % THREAD_ID

    @handles(c.ThreadAlive)
    def thread_alive(self, packet: c.ThreadAlive) -> Reply:
        if packet.thread in (THREAD_ID, 0, -1):
            return b"OK"
        return b"E01"

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
        return Deferred()

    @handles(c.ReadFeatures)
    def read_features(self, packet: c.ReadFeatures) -> Reply:
        if packet.annex != "target.xml":
            raise RspError(0x00, f"no feature document {packet.annex!r}")
        chunk = self._xml[packet.offset : packet.offset + packet.length]
        more = packet.offset + len(chunk) < len(self._xml)
        return Binary((b"m" if more else b"l") + chunk)

    @handles(d.ReadRegisters)
    def read_registers(self, packet: d.ReadRegisters) -> Reply:
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
        if self.views.current is not None:
            raise RspError(E_PERMISSION, "cannot write while a trace frame is selected")
        try:
            self.write_memory(address, data)  # type: ignore[operator]
        except ViewError as error:
            raise RspError(E_MEMORY, str(error)) from None
        return b"OK"


def stop_reply() -> bytes:
    """What GDB is told about the (never really stopped) kernel: a SIGTRAP stop of thread 1."""
    return b"T05thread:%x;" % THREAD_ID
