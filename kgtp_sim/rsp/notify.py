"""The queue of stop replies behind GDB's `%Stop` notification, in non-stop mode (gdbserver's notif.cc; GDB's
remote-notif.c, docs "Notification Packets").

A stop is queued as its stop reply; when the queue was empty it is also announced at once, as `%Stop:<reply>`, and
it stays first in the queue. GDB then drains the queue with `vStopped`: each one drops the reply GDB has (the first)
and is answered with the next, or `OK` once the queue is empty, which lets the next stop be announced again. `?` in
non-stop queues the reply of every stopped thread and is answered as a `vStopped` is, without dropping anything
(gdbserver's handle_status). Nothing is resent: a notification is not acknowledged, and GDB asks for whatever it
has not had with `vStopped`. Each reply is queued with the thread it is of: until GDB has taken it, a resumption
leaves that thread stopped (`held`: gdbserver's in_queued_stop_replies), since GDB does not know yet it stopped.

Sans-IO and pure: one queue per connection, used on that connection's server thread (`Session.poll` pushes, the
`vStopped` and `?` handlers take).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from .codec import encode_notification

#: the name of the one notification GDB knows (remote-notif.c: notif_client_stop)
STOP = b"Stop"


@dataclass
class StopNotifications:
    """The stop replies GDB has not taken yet, first to last."""

    #: each reply with the thread it is of (None: a process's end)
    queue: deque[tuple[bytes, int | None]] = field(default_factory=deque)

    def push(self, reply: bytes, thread: int | None = None) -> bytes:
        """Queue `reply` (of `thread`): the notification to send now (`%Stop:reply#cs`) when the queue was empty
        (gdbserver: notif_push), nothing otherwise (GDB will ask for it with vStopped)."""
        first = not self.queue
        self.queue.append((reply, thread))
        return encode_notification(STOP + b":" + reply) if first else b""

    def ack(self) -> bytes:
        """`vStopped`: the first reply is GDB's now, dropped; the answer is the next one, or OK (handle_notif_ack)."""
        if self.queue:
            self.queue.popleft()
        return self.first()

    def first(self) -> bytes:
        """The first reply queued, or OK when none is (notif_write_event)."""
        return self.queue[0][0] if self.queue else b"OK"

    def status(self, replies: Iterable[tuple[bytes, int | None]]) -> bytes:
        """`?`: every stopped thread's reply (with its thread) queued behind those already there, the answer the
        first of all (or OK: no thread is stopped)."""
        self.queue.extend(replies)
        return self.first()

    def held(self) -> frozenset[int]:
        """The threads whose stop GDB has not taken yet: a resumption leaves them stopped (in_queued_stop_replies)."""
        return frozenset(thread for _, thread in self.queue if thread is not None)

    def clear(self) -> None:
        """A new debugger: what the last one left untaken is dropped (gdbserver: discard_queued_stop_replies)."""
        self.queue.clear()
