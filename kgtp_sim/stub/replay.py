"""Replay of a while-stepping recording (KGTP's `monitor replay`): GDB steps through recorded frames as if the
kernel were stopped there, forwards and backwards, while the live kernel keeps running underneath.

A recording is the frames of one while-stepping hit: the tracepoint's frame and the frames of its steps, told
apart from other hits by the `$step_id` they collected (KGTP's rule: replay needs `collect $step_id`). With a
frame of that hit selected (`tfind`), `monitor replay` makes that frame the stopped state; GDB's `tfind -1` then
leaves the trace-frame view while the stub keeps presenting the replayed frame, and `step`, `next`,
`continue` (to a breakpoint or the recording's end), `reverse-step`, `reverse-continue` move through it.
Breakpoints (Z0) exist only in a replay and never touch kernel memory. `monitor replay stop`, `tstart` or
selecting another trace frame end it. Runs on the server thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..tracing.core.builtins import STEP_ID
from ..tracing.core.frames import FrameView, StateView, TraceFrame, ViewError


@dataclass
class ImageView(StateView):
    """The kernel image's original bytes in its read-only segments (code, rodata): what a recording did not
    collect but could not have changed."""

    image: object

    def registers(self) -> dict[str, int | None]:
        return {}

    def read_memory(self, address: int, length: int) -> bytes:
        for segment in self.image.segments:  # type: ignore[attr-defined]
            if not segment.writable and segment.vaddr <= address < segment.vaddr + len(segment.data):
                start = address - segment.vaddr
                return segment.data[start : start + length]
        raise ViewError(f"memory at {address:#x} was not recorded")


def step_id(frame: TraceFrame) -> int | None:
    return next((value for number, value in frame.tsv_values() if number == STEP_ID), None)


@dataclass
class Replay:
    frames: list[TraceFrame]
    index: int
    image: object
    breakpoints: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, frames: list[TraceFrame], selected: int, image: object) -> Replay:
        """The recording the selected frame belongs to; ValueError with the reason when there is none."""
        frame = frames[selected]
        wanted = step_id(frame)
        if wanted is None:
            raise ValueError("the selected trace frame did not collect $step_id")
        recording = [f for f in frames if f.tracepoint == frame.tracepoint and step_id(f) == wanted]
        if any(f.registers is None for f in recording):
            raise ValueError("a frame of this recording has no registers (collect $regs or $bt)")
        return cls(recording, recording.index(frame), image)

    @property
    def frame(self) -> TraceFrame:
        return self.frames[self.index]

    def view(self) -> StateView:
        registers = self.frame.registers or {}
        segments = [(s.vaddr, s.vaddr + len(s.data)) for s in self.image.segments if not s.writable]  # type: ignore[attr-defined]
        return FrameView(self.frame, registers.get("rip", 0), ImageView(self.image), segments)

    def resume(self, *, step: bool, reverse: bool) -> bool:
        """Move one frame (`step`) or until a breakpoint's address; False when the recording's end (or its
        start, backwards) stopped the move."""
        move = -1 if reverse else 1
        while True:
            if not 0 <= self.index + move < len(self.frames):
                return False
            self.index += move
            if step or (self.frame.registers or {}).get("rip") in self.breakpoints:
                return True


def register_replay_commands(monitor, trace, views, image) -> None:
    """`monitor replay` and `monitor replay stop`, on the trace frame `tfind` selected (`trace`: TraceHandlers)."""
    from .monitor import MonitorUsageError

    @monitor.register("replay", "replay [stop]",
                      "replay the while-stepping recording of the selected trace frame with step/continue/reverse")
    def replay(args: list[str]) -> str:
        if args and args[0] != "stop":
            raise MonitorUsageError(f"unknown argument {args[0]!r}")
        if args:
            if views.replay is None:
                return "not replaying"
            views.end_replay()
            return "replay stopped"
        if views.replay is not None:
            return "already replaying; `monitor replay stop` first"
        if trace._selected is None or trace._frames is None:
            return "select a frame of a while-stepping tracepoint with tfind first"
        try:
            views.replay = Replay.of(trace._frames, trace._selected, image)
        except ValueError as error:
            return f"cannot replay: {error}"
        recording = views.replay
        return (f"replaying {len(recording.frames)} frames of tracepoint {recording.frame.tracepoint} "
                f"($step_id {step_id(recording.frame)}), at {recording.index + 1}; `tfind -1` to look at them "
                "with step, next, continue, reverse-step, reverse-continue")
