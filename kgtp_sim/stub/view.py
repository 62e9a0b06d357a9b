"""What `g`, `p` and `m` read from: the live kernel, or (once a trace frame is selected) that frame.

GDB asks the same packets in both cases; the tracing layer swaps the view in and out on QTFrame.
"""

from __future__ import annotations

from typing import Protocol


class ViewError(Exception):
    """Memory that this view cannot supply (unmapped live memory, or not collected in the frame)."""


class StateView(Protocol):
    def registers(self) -> dict[str, int | None]:
        """Register values by amd64 name; None (or absent) = unavailable."""

    def read_memory(self, address: int, length: int) -> bytes:
        """The bytes at `address`; a shorter result means only that prefix is available; raises ViewError
        when not even the first byte is."""
