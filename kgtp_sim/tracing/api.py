"""What the stub may ask of a tracer: the narrow interface between packet handlers and the tracing layer.

`Tracer` implements it; the handler tests in `tests/stub/` implement it with a fake that has no machine. A
handler needs nothing else: definitions are the tracer's `Definitions` (pure state), frames are `TraceFrame`s,
status is a `TraceStatus`. Called from the server thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..arch import amd64
from ..machine import Marker
from .core.clock import Tsc
from .core.frames import TraceFrame
from .core.model import Definitions, ProbeRow, StopReason, Tracepoint, TraceStatus
from .kgtp.fbt import FunctionProbes


class TracerApi(Protocol):
    definitions: Definitions
    running: bool
    stop_reason: StopReason
    engine: str
    gdbserver: bool  # the gdbserver role's tracer (gdbserver's rules where they differ from KGTP's)
    tsc: Tsc
    start_time: int | None  # microseconds, of the last tstart: since the epoch (the gdbserver role: its steady clock)

    # run control
    def start(self) -> None:
        """tstart: install every enabled location; raises TraceError with a message for the user."""

    def stop(self, reason: StopReason, note: str | None = None, tracepoint: int = 0) -> None:
        """End the run; frames stay."""

    def arm(self, tp: Tracepoint) -> None:
        """Install one location during a run (nothing when not running)."""

    def disarm(self, key: tuple[int, int]) -> None:
        """Remove one location's probe during a run."""

    # settings
    def set_engine(self, engine: str) -> None:
        """Engine for the next tstart; ValueError for an unknown name."""

    def set_buffer_size(self, size: int | None) -> bool:
        """QTBuffer:size (None: the default); TraceError for a size the target refuses (or cannot take now).
        True when the change emptied the buffer (gdbserver's: the last run's frames are gone)."""

    def set_circular(self, circular: bool) -> None: ...

    def set_stop_note(self, note: str) -> None: ...

    # questions
    def status(self) -> TraceStatus: ...

    def location_status(self, number: int, address: int) -> tuple[int, int] | None:
        """(hits, bytes) of a location; None when GDB never defined it."""

    def check_variable(self, name: str) -> None:
        """QTDV: raise ValueError for a variable the target refuses (a per-CPU copy of a missing CPU)."""

    def variable_value(self, number: int) -> int | None:
        """A trace state variable's current value; None when unknown (never run, or no such variable)."""

    def frames(self) -> list[TraceFrame]:
        """Every frame in the buffer, oldest first; frame numbers are list indexes."""

    def consume_frames(self, through: dict[int, int]) -> int:
        """A consuming reader took each CPU's frames created up to its sequence in `through` (cpu -> sequence):
        they leave the buffer."""

    def saved_frame(self, frame: TraceFrame, regblock_size: int = amd64.G_PACKET_SIZE,
                    renumber: Callable[[int], int | None] | None = None) -> bytes:
        """The frame's bytes as a trace file holds them, its `R` blocks of `regblock_size` bytes (the register
        file GDB reads: one `g` packet), each variable numbered `renumber(number)` (None: left out) if given."""

    def markers(self) -> list[Marker]: ...

    def marker_at(self, address: int) -> Marker | None: ...

    def rendered_sdata(self, frame: TraceFrame) -> str | None:
        """The frame's `$_sdata` rendered by its marker's format; None without static data."""

    def probe_rows(self) -> list[ProbeRow]: ...

    def refuses_breakpoint(self, address: int, *, data: bool = False) -> str | None:
        """Why a debugger's breakpoint (a watchpoint, with `data`) at `address` cannot work with the run; None
        when it can."""
        ...

    def function_probes(self) -> list[FunctionProbes]:
        """Every function of the kernel, the probe its entry takes and whether its return takes one (FBT)."""
