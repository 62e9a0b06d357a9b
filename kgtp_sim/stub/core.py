"""Connect-time, register and memory packets for any target (stub/target.py), and the assembly of every handler
family that speaks to a target (`TargetHandlers`): what lets GDB attach to a target and look at it.

The thread packets and the selection `g` and `m` follow are stub/threads.py's, run control and breakpoints
stub/run.py's. These families know the target interface only: KGTP mode gives them the kernel (stub/kernel.py),
and a gdbserver role will give them a process. Runs on the server thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..arch import amd64
from ..rsp.dispatch import E_BAD_PACKET, E_MEMORY, E_PERMISSION, Binary, Reply, RspError, handles
from ..rsp.packets import connect as c
from ..rsp.packets import data as d
from .run import BreakpointHandlers, ConditionalBreakpointHandlers, NonStopHandlers, ReverseHandlers, RunHandlers
from .target import Target, ViewError
from .threads import Selection, ThreadHandlers


@dataclass
class ConnectHandlers:
    target: Target

    @handles(c.StartNoAckMode)
    def start_no_ack_mode(self, packet: c.StartNoAckMode) -> Reply:
        return b"OK"

    @handles(c.MustReplyEmpty)
    def must_reply_empty(self, packet: c.MustReplyEmpty) -> Reply:
        return b""

    @handles(c.Attached)
    def attached(self, packet: c.Attached) -> Reply:
        # "1": GDB attached to something that existed before it, so quitting GDB detaches instead of killing.
        return b"1" if self.target.attached() else b"0"

    @handles(c.Offsets)
    def offsets(self, packet: c.Offsets) -> Reply:
        return b"Text=0;Data=0;Bss=0"

    @handles(c.SymbolLookup)
    def symbol_lookup(self, packet: c.SymbolLookup) -> Reply:
        return b"OK"

    @handles(c.Detach)
    def detach(self, packet: c.Detach) -> Reply:
        """`D`, `D;PID` (multiprocess: that process; E01 for one the target has not, gdbserver's handle_detach)."""
        self.target.detach(packet.pid)
        return b"OK"

    @handles(c.Kill)
    def kill(self, packet: c.Kill) -> Reply:
        # KGTP never stops the kernel: there `kill` only ends the session.
        self.target.kill()
        return b"OK"


@dataclass
class DataHandlers:
    """Registers, memory and the target description: those of the thread `Hg` selected (stub/threads.py)."""

    target: Target
    threads: ThreadHandlers

    @handles(c.ReadFeatures)
    def read_features(self, packet: c.ReadFeatures) -> Reply:
        document = self.target.feature_document(packet.annex)
        if document is None:
            raise RspError(0x00, f"no feature document {packet.annex!r}")
        chunk = document[packet.offset : packet.offset + packet.length]
        more = packet.offset + len(chunk) < len(document)
        return Binary((b"m" if more else b"l") + chunk)

    @handles(d.ReadRegisters)
    def read_registers(self, packet: d.ReadRegisters) -> Reply:
        """`g`, as remote.c: remote_target::fetch_registers asks it after set_general_thread: the registers of
        the thread `Hg` selected (KGTP: the selected trace frame's, else the live registers of that CPU)."""
        layout = self.target.register_layout()
        return layout.hex(self.target.read_registers(self.threads.general_thread)).encode()

    @handles(d.ReadRegister)
    def read_register(self, packet: d.ReadRegister) -> Reply:
        reg = self._register(packet.regnum)
        value = self.target.read_registers(self.threads.general_thread).get(reg.name)
        if value is None:
            return b"xx" * reg.size
        return (value & ((1 << 8 * reg.size) - 1)).to_bytes(reg.size, "little").hex().encode()

    def _register(self, regnum: int) -> amd64.Register:
        registers = self.target.register_layout().registers
        if regnum >= len(registers):
            raise RspError(E_BAD_PACKET, f"no register {regnum}")
        return registers[regnum]

    @handles(d.WriteRegisters)
    def write_registers(self, packet: d.WriteRegisters) -> Reply:
        """`G` and `P` are refused (E03) by a target without register writes: KGTP's kernel on every CPU, also
        with --allow-writes (which opens memory only)."""
        writes = self.target.support_register_writes()
        if writes is None:
            raise RspError(E_PERMISSION, "this target's registers cannot be changed")
        writes.write_registers(self.threads.general_thread, self.target.register_layout().decode(packet.data))
        return b"OK"

    @handles(d.WriteRegister)
    def write_register(self, packet: d.WriteRegister) -> Reply:
        writes = self.target.support_register_writes()
        if writes is None:
            raise RspError(E_PERMISSION, "this target's registers cannot be changed")
        reg = self._register(packet.regnum)
        if len(packet.value) != reg.size:
            raise RspError(E_BAD_PACKET, f"{reg.name} is {reg.size} bytes, not {len(packet.value)}")
        writes.write_registers(self.threads.general_thread, {reg.name: int.from_bytes(packet.value, "little")})
        return b"OK"

    @handles(d.ReadMemory)
    def read_memory(self, packet: d.ReadMemory) -> Reply:
        if packet.length == 0:
            return b""
        try:
            data = self.target.read_memory(packet.address, packet.length, self.threads.general_thread)
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
        """KGTP's kernel has memory writes only with --allow-writes (and refuses them while a trace frame is
        selected or replayed)."""
        writes = self.target.support_memory_writes()
        if writes is None:
            raise RspError(E_PERMISSION, "this target's memory cannot be written (KGTP: start with --allow-writes)")
        try:
            writes.write_memory(address, data, self.threads.general_thread)
        except ViewError as error:
            raise RspError(E_MEMORY, str(error)) from None
        return b"OK"


@dataclass
class TargetHandlers:
    """Every handler family that speaks to `target`, sharing one thread selection; KGTP mode and the gdbserver
    role assemble the same families, each with its target.

    The reverse family is assembled only when the target has the reverse extension, so qSupported (derived from
    the dispatch table) announces ReverseStep+ and ReverseContinue+ only then; the non-stop family likewise
    (QNonStop+), and the `Z` that reads conditions and commands (ConditionalBreakpoints+, BreakpointCommands+). `families` lists them in the order
    their qSupported features come out (the recorded transcripts hold GDB's sessions byte for byte)."""

    target: Target
    selection: Selection = field(default_factory=Selection)

    def __post_init__(self) -> None:
        self.threads = ThreadHandlers(self.target, self.selection)
        self.data = DataHandlers(self.target, self.threads)
        self.reverse = (ReverseHandlers(self.target, self.threads)
                        if self.target.support_reverse() is not None else None)
        self.connect = ConnectHandlers(self.target)
        self.run = RunHandlers(self.target, self.threads)
        self.non_stop = (NonStopHandlers(self.target, self.run)
                         if self.target.support_non_stop() is not None else None)
        conditions = self.target.support_breakpoint_conditions()
        self.breakpoints = (BreakpointHandlers(self.target, self.threads) if conditions is None else
                            ConditionalBreakpointHandlers(self.target, self.threads, conditions))

    @property
    def families(self) -> tuple[object, ...]:
        return tuple(f for f in (self.data, self.reverse, self.connect, self.run, self.threads, self.non_stop,
                                 self.breakpoints) if f is not None)

    def stop_reply(self) -> bytes:
        """The session's reply to Ctrl-C after a deferred `c`."""
        return self.run.interrupted()

    def pending_stop(self) -> bytes | None:
        """The session's reply when the target stopped by itself after a deferred `c` (None: it runs on)."""
        return self.run.pending_stop()

    def stop_events(self) -> list[tuple[bytes, int | None]]:
        """The session's non-stop stops, as stop replies (with their threads) for `%Stop` notifications ([] in
        all-stop)."""
        return self.run.stop_events()

    def interrupt_running(self) -> None:
        """The session's Ctrl-C with no resumption waiting (non-stop's interrupt)."""
        self.run.interrupt_running()

    def session_hooks(self) -> dict[str, object]:
        """What a `Session` of these handlers is given: its replies to Ctrl-C, the target's stops and the queue
        behind `%Stop`."""
        return dict(stop_reply=self.stop_reply, async_stop=self.pending_stop, stop_events=self.stop_events,
                    notifications=self.run.notifications, interrupt=self.interrupt_running)

    def forget_session(self) -> None:
        self.threads.forget_session()
        self.run.notifications.clear()

    def supported(self, gdb_features: tuple[str, ...]) -> None:
        """The dispatcher's `on_supported`: what GDB offered in qSupported (the thread ids it reads, the events it
        wants reported)."""
        self.threads.supported(gdb_features)
        self.target.gdb_features(gdb_features)
