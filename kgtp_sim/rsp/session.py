"""One debugger connection as a sans-IO state machine: bytes from GDB in, bytes for GDB out.

It owns the acknowledgement protocol (acks, `-` retransmission, QStartNoAckMode), console output for
`monitor`, and the asynchronous cases: in all-stop, a resumption (`c`, `vCont`) answered later, when the user
presses Ctrl-C or when the target stops by itself; in non-stop, each stop sent as a `%Stop` notification through
the queue GDB drains with `vStopped` (rsp/notify.py, shared with the `vStopped` and `?` handlers), and Ctrl-C
handed to the target with no reply. For the target's own stops the transport calls `poll` when it is woken (the
target stops on its own thread; the reply goes out on the transport's) and after every `receive`.

Thread: the server thread: `RspServer` makes one session per debugger and feeds it that connection's bytes on the
connection's own thread (on the calling thread, serving a pipe); the fuzz harness and the handler tests feed one on
their own thread. The dispatcher and every handler run inside `receive` and `poll`, on that thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from .codec import Decoder, EventKind, encode_packet
from .dispatch import Binary, Deferred, Dispatcher, NoReply, Reply, WithOutput
from .notify import StopNotifications

log = logging.getLogger(__name__)

#: Console output is split into `O` packets no longer than this (hex doubles it).
_CONSOLE_CHUNK = 512


@dataclass
class SessionStats:
    packets: int = 0
    bad_checksums: int = 0
    bad_packets: int = 0
    retransmits: int = 0


def ends_with_the_process(payload: bytes, reply: Reply) -> bool:
    """The session's end after a reply, for a target with one process and no extended mode: `k`, a detach or a
    vKill that was served (gdbserver then exits, or waits for the next GDB)."""
    return payload == b"k" or (payload[:1] == b"D" and reply == b"OK") or (
        payload.startswith(b"vKill;") and reply == b"OK")


@dataclass
class Session:
    dispatcher: Dispatcher
    #: the reply to a Ctrl-C after `c`: fixed bytes, or a function giving them then (the thread it names changes)
    stop_reply: bytes | Callable[[], bytes] = b"S05"
    #: the reply when the target stopped by itself after `c`, or None while it runs on (`poll`)
    async_stop: Callable[[], bytes | None] = lambda: None
    #: whether a packet and its reply end the session (closing once the reply is out)
    ends_session: Callable[[bytes, Reply], bool] = ends_with_the_process
    #: non-stop: the stop replies of the stops since the last call, each with the thread it is of (None: a process's
    #: end), queued as `%Stop` notifications (empty in all-stop, where `async_stop` answers the resumption)
    stop_events: Callable[[], list[tuple[bytes, int | None]]] = lambda: []
    #: the queue behind `%Stop` (the vStopped and `?` handlers take from it)
    notifications: StopNotifications = field(default_factory=StopNotifications)
    #: Ctrl-C while no resumption waits for its reply: non-stop's interrupt (gdbserver's request_interrupt, the
    #: stop coming as a notification), or None: ignored, as in all-stop
    interrupt: Callable[[], None] | None = None
    decoder: Decoder = field(default_factory=Decoder)
    ack_mode: bool = True
    #: a resumption waits for its stop reply (Ctrl-C or the target's own stop)
    waiting_for_interrupt: bool = False
    closing: bool = False
    stats: SessionStats = field(default_factory=SessionStats)
    _last_sent: bytes = b""

    def receive(self, data: bytes) -> bytes:
        """Consume bytes from GDB, return the bytes to send back (possibly empty)."""
        out = bytearray()
        for event in self.decoder.feed(data):
            if event.kind is EventKind.PACKET:
                self.stats.packets += 1
                if self.ack_mode:
                    out += b"+"
                out += self._answer(event.payload)
            elif event.kind is EventKind.NACK:
                if self.ack_mode and self._last_sent:
                    self.stats.retransmits += 1
                    out += self._last_sent
            elif event.kind is EventKind.INTERRUPT:
                if self.waiting_for_interrupt:
                    self.waiting_for_interrupt = False
                    stop = self.stop_reply
                    out += self._frame(stop if isinstance(stop, bytes) else stop())
                elif self.interrupt is not None:
                    self.interrupt()
                else:
                    log.info("Ctrl-C while no continue is pending: ignored")
            elif event.kind is EventKind.BAD_CHECKSUM:
                self.stats.bad_checksums += 1
                log.info("bad checksum: %s", event.detail)
                if self.ack_mode:
                    out += b"-"
            elif event.kind is EventKind.BAD_PACKET:
                self.stats.bad_packets += 1
                log.info("bad packet: %s", event.detail)
                if self.ack_mode:
                    out += b"+"
                out += self._frame(b"E01")
            # ACK: nothing to do
        return bytes(out)

    def poll(self) -> bytes:
        """The bytes to send when the target may have stopped by itself: in non-stop, a `%Stop` notification when
        the first of its new stops opens the queue; in all-stop its stop reply, once, if a resumption waits for
        it; nothing otherwise."""
        out = b"".join(self.notifications.push(reply, thread) for reply, thread in self.stop_events())
        if not self.waiting_for_interrupt:
            return out
        stop = self.async_stop()
        if stop is None:
            return out
        self.waiting_for_interrupt = False
        return out + self._frame(stop)

    def _answer(self, payload: bytes) -> bytes:
        reply = self.dispatcher.dispatch(payload)
        if payload == b"QStartNoAckMode" and reply == b"OK":
            # GDB still acknowledges this OK; from the next packet on neither side acks.
            self.ack_mode = False
        if self.ends_session(payload, reply):
            self.closing = True
        if isinstance(reply, NoReply):
            return b""
        if isinstance(reply, Deferred):
            self.waiting_for_interrupt = True
            return b""
        if isinstance(reply, WithOutput):
            out = bytearray()
            data = reply.text.encode()
            for start in range(0, len(data), _CONSOLE_CHUNK):
                out += self._frame(b"O" + data[start : start + _CONSOLE_CHUNK].hex().encode())
            return bytes(out + self._frame(reply.final))
        if isinstance(reply, Binary):
            return self._frame(reply.data, binary=True)
        return self._frame(reply)

    def _frame(self, payload: bytes, *, binary: bool = False) -> bytes:
        framed = encode_packet(payload, binary=binary)
        self._last_sent = framed
        return framed
