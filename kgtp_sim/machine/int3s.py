"""The int3s in a process's memory, whoever put them there: the one record of the byte under each.

Two layers put int3s into a traced process's memory at its addresses: the debugger's software breakpoints (the
gdbserver role's `Z0`, stub/process.py) and the tracer's tracepoints in the program (tracing/engines/userprobes.py).
Both may want one address (a `trace` and a `break` on one line), in either order, and leave it in either order.
So neither writes over the other's int3 or keeps its own copy of what is under it: the first to hold an address
writes the int3 and the byte it replaced is recorded here, a second holder only joins, and the byte goes back when
the last one lets go. A write over a held address (the debugger's, or a fast tracepoint's jump going in or out
under a breakpoint) changes the recorded byte and leaves the int3 (`write`); a read that hides the int3s reads the
recorded bytes (`hide`). The tracer runs the instruction under its int3 in place: the byte under is `lift`ed into
memory for the step (or while-stepping's steps) and the int3 `lower`ed back after, if anyone still holds it.
gdbserver keeps one such record for all its breakpoints, GDB's and the tracepoints' alike (gdbserver/mem-break.cc:
a raw breakpoint shared by the breakpoints at its address, its `old_data`).

Keyed by (the space's page-table root, address): another process's memory at the same address is another record.
A record whose int3 is no longer in memory (not lifted: its process ended and the tables went to another) is
stale, and dropped where it is met. Translated code is the writer's to drop (what it may drop depends on where the
CPU is: cpu.py's `remove_cache`).

A fork copies a process's memory, int3s included, into a new space: before the child runs (`forked`, when the kernel
tells the machine of the fork: tracee.py) the bytes under them go back into the copy, as gdbserver's
detach_breakpoints does for a fork child it does not follow (the child, untraced, would die of the first one it ran
into); a traced child (the debugger asked for fork events) keeps the debugger's, held in its own space as
gdbserver's clone_all_breakpoints copies a parent's breakpoints, for the debugger to take out or keep. The tracer's
are never the child's. An exec's old space is gone (`gone`): its records with it, never written again. Other layers
that change a process's memory beyond its int3s (the tracer's fast tracepoint jumps) hear of both (`watchers`), and
of each change of who holds an int3 (a compiled hit of the tracer's int3 goes on natively only while the debugger
holds none there).

Runs on the CPU thread (the tracer's hits inside emulation; the debugger's changes through `Machine.run_on_cpu`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from unicorn import Uc

from .layout import PAGE_SIZE

INT3 = b"\xcc"
#: the layers that hold int3s
DEBUGGER = "debugger"
TRACER = "tracer"


@dataclass
class _Held:
    under: int  #: the byte the int3 replaced
    owners: set[str] = field(default_factory=set)
    lifted: bool = False  #: the byte under is in memory for now (a step in place)


class MemoryWatcher(Protocol):
    """A layer that writes into processes' memory beyond int3s, told of the copies and ends of spaces (CPU thread)."""

    def forked(self, parent: Any, child: Any) -> None:
        """A fork copied `parent` into `child` (not run yet): whatever of this layer the copy holds is to go."""

    def gone(self, space: Any) -> None:
        """`space` is going (an exec replaced it): nothing of it is to be written again."""

    def holders_changed(self, space: Any, address: int) -> None:
        """Someone took or let go of the int3 at `address` of `space` (`holders` tells who holds it now)."""


class Int3s:
    """(space root, address) -> the byte under the int3 there and who holds it."""

    def __init__(self) -> None:
        self._held: dict[tuple[int, int], _Held] = {}
        #: told of each fork that copied a space and of each space gone, after the int3s (`MemoryWatcher`)
        self.watchers: list[MemoryWatcher] = []

    def _valid(self, space: Any, address: int, physical: int) -> _Held | None:
        """The record at `address` (its byte at `physical`), unless stale: then dropped."""
        key = (space.root, address)
        held = self._held.get(key)
        if held is not None and not held.lifted and bytes(Uc.mem_read(space.uc, physical, 1)) != INT3:
            del self._held[key]
            return None
        return held

    def hold(self, space: Any, address: int, owner: str) -> int | None:
        """`owner` wants an int3 at `address` of `space`: written if nobody held it yet. The byte under it, or None
        (and nothing held) when the page is not present."""
        physical = space.translate(address, 1)
        if physical is None:
            return None
        held = self._valid(space, address, physical)
        if held is not None:
            held.owners.add(owner)
            self._changed(space, address)
            return held.under
        under = bytes(Uc.mem_read(space.uc, physical, 1))[0]
        Uc.mem_write(space.uc, physical, INT3)
        self._held[(space.root, address)] = _Held(under, {owner})
        self._changed(space, address)
        return under

    def _changed(self, space: Any, address: int) -> None:
        for watcher in list(self.watchers):
            watcher.holders_changed(space, address)

    def release(self, space: Any, address: int, owner: str) -> bool:
        """`owner` lets go of `address`; True when it was the last, and the byte under is back in memory."""
        physical = space.translate(address, 1)
        key = (space.root, address)
        held = self._held.get(key) if physical is None else self._valid(space, address, physical)
        if held is None or owner not in held.owners:
            return False
        held.owners.discard(owner)
        if held.owners:
            self._changed(space, address)
            return False
        del self._held[key]
        if physical is not None:
            Uc.mem_write(space.uc, physical, bytes([held.under]))
        self._changed(space, address)
        return True

    def holders(self, space: Any, address: int) -> frozenset[str]:
        held = self._held.get((space.root, address))
        return frozenset(held.owners) if held is not None else frozenset()

    def lift(self, space: Any, address: int) -> bool:
        """The byte under the int3 at `address` into memory for a while (`lower` puts the int3 back); False where
        no int3 is held."""
        return self._set_lifted(space, address, True)

    def lower(self, space: Any, address: int) -> bool:
        """The int3 of a lifted record back into memory; False where none is held (nobody wants it any more)."""
        return self._set_lifted(space, address, False)

    def _set_lifted(self, space: Any, address: int, lifted: bool) -> bool:
        held = self._held.get((space.root, address))
        physical = space.translate(address, 1)
        if held is None or physical is None:
            return False
        held.lifted = lifted
        Uc.mem_write(space.uc, physical, bytes([held.under]) if lifted else INT3)
        return True

    def forked(self, parent: Any, child: Any, keep: frozenset[str] = frozenset()) -> int:
        """A fork copied `parent`'s memory into `child`, a new space the child has not run in yet: an int3 held in
        `parent` by one of the owners `keep` names stays in the copy, held there by those (a traced child's
        breakpoints: DEBUGGER); every other one is replaced in the copy by the byte under it (one being lifted is the
        byte already). How many were taken out. The watchers are told after. The child's frames were written by the
        kernel's copy, which dropped any code translated from them before, so none is left to drop here."""
        taken = 0
        for (root, address), held in list(self._held.items()):
            if root != parent.root:
                continue
            physical = parent.translate(address, 1)
            copy = child.translate(address, 1)
            if physical is None or copy is None or (not held.lifted and self._valid(parent, address, physical) is None):
                continue
            kept = held.owners & keep
            if kept:
                Uc.mem_write(child.uc, copy, INT3)
                self._held[(child.root, address)] = _Held(held.under, set(kept))
            elif bytes(Uc.mem_read(child.uc, copy, 1)) == INT3:
                Uc.mem_write(child.uc, copy, bytes([held.under]))
                taken += 1
        for watcher in list(self.watchers):
            watcher.forked(parent, child)
        return taken

    def gone(self, space: Any) -> int:
        """`space` is going (an exec replaced it; its tables may soon be another space's): its records are dropped
        without a write, and the watchers told. How many there were."""
        mine = [key for key in self._held if key[0] == space.root]
        for key in mine:
            del self._held[key]
        for watcher in list(self.watchers):
            watcher.gone(space)
        return len(mine)

    def hide(self, space: Any, address: int, data: bytes) -> bytes:
        """`data` read at `address` of `space`, with the bytes under its int3s in place of the int3s."""
        out = bytearray(data)
        root = space.root
        for (held_root, at), held in self._held.items():
            if held_root == root and address <= at < address + len(out) and out[at - address] == INT3[0]:
                out[at - address] = held.under
        return bytes(out)

    def write(self, space: Any, address: int, data: bytes) -> bool:
        """Write `data` at `address` of `space`, page by page, the int3s held there staying (the bytes under them
        take the new values). False, having written the pages before it, at the first page not present."""
        done = 0
        while done < len(data):
            at = address + done
            chunk = min(len(data) - done, PAGE_SIZE - (at & (PAGE_SIZE - 1)))
            physical = space.translate(at, chunk)
            if physical is None:
                return False
            piece = bytearray(data[done:done + chunk])
            for key in [k for k in self._held if k[0] == space.root and at <= k[1] < at + chunk]:
                held = self._valid(space, key[1], physical + key[1] - at)
                if held is not None:
                    held.under = piece[key[1] - at]
                    if not held.lifted:
                        piece[key[1] - at] = INT3[0]
            Uc.mem_write(space.uc, physical, bytes(piece))
            done += chunk
        return True
