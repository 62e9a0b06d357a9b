"""What GDB looks at instead of the live target: the trace frame `tfind` selected, or a replay (stub/replay.py).

gdbserver keeps the same state as its `current_traceframe` (server.cc reads registers and memory from the
selected frame while there is one). Here the tracing handlers (stub/trace.py) and `monitor replay` switch it, and
the target that owns it (stub/kernel.py) answers registers and memory from it. Runs on the server thread.
"""

from __future__ import annotations

from ..tracing.core.frames import StateView
from .replay import Replay


class FrameOverlay:
    """The selected trace frame (`current`) or replay, over `live` (the live memory a frame's read-only regions
    come from, tracing/frames.py FrameView).

    A replay (`monitor replay`) outranks the selected frame: GDB's `tfind -1` clears the selected trace frame and
    leaves the replayed frame as the stopped state; selecting a trace frame ends the replay."""

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
    def view(self) -> StateView | None:
        """What registers and memory are read from instead of the live target; None: the live target."""
        if self.replay is not None:
            return self.replay.view()
        return self.current
