"""A tracer without a machine: what `TracerApi` promises, kept in plain Python state.

The handler tests drive `TraceHandlers` against it, so the stub's own logic (the frame cursor, `qTSTMat` gating,
upload sequences, status replies) is tested fast and apart from probes, engines and the emulator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kgtp_sim.arch import amd64
from kgtp_sim.machine import Marker
from kgtp_sim.tracing.api import TracerApi
from kgtp_sim.tracing.core.frames import MemoryBlock, RegisterBlock, TraceFrame
from kgtp_sim.tracing.core.model import (Definitions, ProbeRow, StopReason, TraceError, Tracepoint, TraceStatus,
                                         requested_buffer_size)


class FakeClock:
    def to_ns(self, ticks: int) -> int:
        return ticks


def register_frame(number: int, tracepoint: int, pc: int, memory: tuple[int, bytes] | None = None) -> TraceFrame:
    regs = [0] * len(amd64.GENERAL_REGISTERS)
    regs[amd64.PC_REGNUM] = pc
    blocks = [RegisterBlock(amd64.encode_general(regs))]
    if memory is not None:
        blocks.append(MemoryBlock(*memory))
    return TraceFrame(number, tracepoint, tuple(blocks), timestamp=1000 * number, sequence=number)


@dataclass
class FakeTracer:
    definitions: Definitions = field(default_factory=Definitions)
    running: bool = False
    stop_reason: StopReason = StopReason.NOT_RUN
    stop_note: str | None = None
    engine: str = "opt"
    gdbserver: bool = False
    start_time: int | None = None
    tsc: FakeClock = field(default_factory=FakeClock)
    listed_markers: list[Marker] = field(default_factory=list)
    recorded: list[TraceFrame] = field(default_factory=list)
    variables: dict[int, int] = field(default_factory=dict)
    refuse_start: str | None = None
    armed: list[tuple[int, int]] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)

    def start(self) -> None:
        self.calls.append("start")
        if self.refuse_start:
            raise TraceError(self.refuse_start)
        self.running, self.stop_reason, self.start_time = True, StopReason.NOT_RUN, 1

    def stop(self, reason: StopReason, note: str | None = None, tracepoint: int = 0) -> None:
        self.calls.append(f"stop {reason.name}")
        if self.running:
            self.running, self.stop_reason, self.stop_note = False, reason, note
            self.armed.clear()

    def arm(self, tp: Tracepoint) -> None:
        if self.running and tp.enabled:
            self.armed.append(tp.key)

    def disarm(self, key: tuple[int, int]) -> None:
        if key in self.armed:
            self.armed.remove(key)

    def set_engine(self, engine: str) -> None:
        if engine not in ("interp", "naive", "opt"):
            raise ValueError("engine must be one of interp, naive, opt")
        self.engine = engine

    def set_buffer_size(self, size: int | None) -> bool:
        self.definitions.buffer_size = requested_buffer_size(size)
        return False

    def set_circular(self, circular: bool) -> None:
        self.definitions.circular = circular

    def set_stop_note(self, note: str) -> None:
        self.definitions.stop_note = note
        if not self.running and self.stop_reason is StopReason.STOP_COMMAND:
            self.stop_note = note

    def status(self) -> TraceStatus:
        return TraceStatus(running=self.running, stop_reason=self.stop_reason, stop_note=self.stop_note,
                           frames=len(self.recorded), created=len(self.recorded),
                           buffer_size=self.definitions.buffer_size, circular=self.definitions.circular)

    def location_status(self, number: int, address: int) -> tuple[int, int] | None:
        if (number, address) not in self.definitions.tracepoints:
            return None
        return sum(f.tracepoint == number for f in self.recorded), 0

    def check_variable(self, name: str) -> None:
        return None

    def variable_value(self, number: int) -> int | None:
        return self.variables.get(number)

    def frames(self) -> list[TraceFrame]:
        return list(self.recorded)

    def saved_frame(self, frame: TraceFrame, regblock_size: int = amd64.G_PACKET_SIZE, renumber=None) -> bytes:
        assert renumber is None, "the fake tracer's frames keep their numbers (KGTP mode's handlers)"
        return frame.to_gdb(regblock_size)

    def markers(self) -> list[Marker]:
        return list(self.listed_markers)

    def marker_at(self, address: int) -> Marker | None:
        return next((m for m in self.listed_markers if m.site == address), None)

    def rendered_sdata(self, frame: TraceFrame) -> str | None:
        return None

    def probe_rows(self) -> list[ProbeRow]:
        return []


def _conforms(tracer: TracerApi) -> TracerApi:
    return tracer


_conforms(FakeTracer())  # a type checker holds the fake to the protocol here
