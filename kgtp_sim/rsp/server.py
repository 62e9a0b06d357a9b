"""Transports for the RSP session: TCP (one debugger at a time, loopback unless told otherwise) or a pipe.

The kernel is root on the machine it debugs, so the defaults are the safe ones: bind to 127.0.0.1, and refuse a
second debugger with a clear error instead of letting two clients interleave tracepoint downloads. A debugger that
connects while the one served is leaving (its session over, its detach or disconnect still being carried out) waits
for the slot instead (`LEAVING_WAIT_S`): GDB's detach and a new `target remote` come back to back.

Threads: `serve_forever` accepts on the thread that calls it (the main thread of `kgtp-sim serve`); each debugger is
served by a daemon thread of its own, `rsp-<peer port>`, the server thread of docs/DESIGN.md (one at a time: a
second debugger's thread only refuses it). `serve_pipe` serves on the calling thread (the main thread of
`kgtp-sim serve --stdio`). `on_connect` and `on_disconnect` run on the serving thread; `shutdown` is called from
the main thread's signal handlers.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .codec import Decoder, EventKind, encode_packet
from .session import Session

log = logging.getLogger(__name__)

BUSY_MESSAGE = "kgtp-sim: another debugger is attached; only one is served at a time"
#: how long a debugger that connects while the one served is leaving waits for the slot
LEAVING_WAIT_S = 30.0


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket (IPv6 when `host` is), whose accept() times out now and then so that its loop can
    notice a shutdown. Port 0 picks a free port (read it back with getsockname)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(8)
    sock.settimeout(0.2)
    return sock


@dataclass
class RspServer:
    """Accepts connections and runs one `Session` per debugger in its own thread.

    `make_session` builds a fresh session for each client (so ack mode and buffers never leak between
    debuggers); `on_disconnect` lets the tracing layer stop or keep tracing when a client leaves. `wake`, called
    from any thread (the machine's, when a breakpoint stops it), makes the serving thread poll the session for a
    stop reply to send.
    """

    make_session: Callable[[], Session]
    host: str = "127.0.0.1"
    port: int = 1234
    on_connect: Callable[[], None] = lambda: None
    on_disconnect: Callable[[], None] = lambda: None
    #: A client that has sent nothing this long after connecting is dropped: it would hold the one debugger
    #: slot forever. GDB speaks at once; an attached GDB that later goes quiet is never dropped.
    first_byte_timeout: float = 3.0
    _listener: socket.socket | None = field(init=False, default=None)
    _busy: threading.Lock = field(init=False, default_factory=threading.Lock)
    _stop: threading.Event = field(init=False, default_factory=threading.Event)
    #: the debugger served has left (its session is over) and its slot is being given back
    _leaving: threading.Event = field(init=False, default_factory=threading.Event)
    _served: socket.socket | None = field(init=False, default=None)  # the connection of the debugger served
    _threads: list[threading.Thread] = field(init=False, default_factory=list)
    connections: int = field(init=False, default=0)
    #: (host, port) of the debugger served now, or last (the gdbserver role announces it)
    peer: tuple | None = field(init=False, default=None)
    refused: int = field(init=False, default=0)
    _wake_r: socket.socket = field(init=False)
    _wake_w: socket.socket = field(init=False)

    def __post_init__(self) -> None:
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    def wake(self) -> None:
        """From any thread: the serving thread asks its session for a stop reply (`Session.poll`)."""
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (a wake-up is pending anyway) or closed (the server is gone)
            pass

    def _woken(self, session: Session) -> bytes:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:  # drained
            pass
        return session.poll()

    def bind(self) -> tuple[str, int]:
        self._listener = listener(self.host, self.port)
        host, self.port = self._listener.getsockname()[:2]
        return host, self.port

    def serve_forever(self) -> None:
        if self._listener is None:
            self.bind()
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    break
                raise
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._busy.acquire(blocking=False):
                self._take(peer)
                target = self._serve_client
            elif self._leaving.is_set() or self._served_hung_up():
                target = self._serve_when_free
            else:
                self.refused += 1
                log.warning("refused a second debugger from %s:%s", *peer[:2])
                target = self._refuse
            thread = threading.Thread(target=target, args=(conn, peer), daemon=True, name=f"rsp-{peer[1]}")
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        for thread in self._threads:
            thread.join(timeout=2)
        self.wake()  # a pipe's serving loop sees the stop at once

    def _served_hung_up(self) -> bool:
        """Has the debugger served closed its end, its thread not having seen it yet? (GDB's `disconnect` sends no
        packet, and its next `target remote` can be accepted before the served thread reads the end of file.)"""
        conn = self._served
        if conn is None:
            return False
        try:
            readable = select.select([conn], [], [], 0)[0]
            return bool(readable) and conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except OSError:  # reset, or closed by its thread meanwhile: leaving either way
            return True

    def _take(self, peer: tuple) -> None:
        """The slot is ours (the caller holds `_busy`): `peer` is the debugger served now."""
        self._leaving.clear()
        self.peer = peer[:2]
        self.connections += 1
        log.info("debugger connected from %s:%s", *peer[:2])

    def _serve_when_free(self, conn: socket.socket, peer: tuple) -> None:
        """A debugger that came while the one served was leaving: served once the slot is free, else refused."""
        if not self._busy.acquire(timeout=LEAVING_WAIT_S):
            self.refused += 1
            log.warning("refused a second debugger from %s:%s", *peer[:2])
            self._refuse(conn, peer)
            return
        self._take(peer)
        self._serve_client(conn, peer)

    def _serve_client(self, conn: socket.socket, _peer: tuple) -> None:
        session = self.make_session()
        self._served = conn
        try:
            self.on_connect()
            conn.settimeout(0.5)
            silent_until: float | None = time.monotonic() + self.first_byte_timeout
            while not self._stop.is_set() and not session.closing:
                readable = select.select([conn, self._wake_r], [], [], 0.5)[0]
                if self._wake_r in readable:
                    stopped = self._woken(session)
                    if stopped:
                        conn.sendall(stopped)
                if conn not in readable:
                    if silent_until is not None and time.monotonic() > silent_until:
                        log.warning("dropping a client that sent nothing for %.1f s", self.first_byte_timeout)
                        break
                    continue
                try:
                    data = conn.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    break
                if not data:
                    break
                silent_until = None
                reply = session.receive(data) + session.poll()
                if reply:
                    conn.sendall(reply)
        except OSError as error:
            log.info("connection lost: %s", error)
        finally:
            self._leaving.set()  # a debugger connecting from now on waits for the slot
            self._served = None
            conn.close()
            if session.decoder.pending:
                log.info("client left in the middle of a packet (%d bytes dropped)", session.decoder.pending)
            try:
                self.on_disconnect()
            finally:
                self._busy.release()
                log.info("debugger disconnected")

    def serve_pipe(self, read_fd: int, write_fd: int) -> None:
        """One debugger over a pipe: `target remote | kgtp-sim serve --stdio`, GDB having started the stub (as KGTP
        users open /sys/kernel/debug/gtp). The session is the file descriptors' until end of file, a detach, or
        `shutdown`; nothing but packets may be written to `write_fd`."""
        session = self.make_session()
        self.connections += 1
        self.on_connect()
        def send(reply: bytes) -> None:
            while reply:
                reply = reply[os.write(write_fd, reply):]

        try:
            while not self._stop.is_set() and not session.closing:
                readable = select.select([read_fd, self._wake_r], [], [], 0.5)[0]
                if self._wake_r in readable:
                    send(self._woken(session))
                if read_fd not in readable:
                    continue
                data = os.read(read_fd, 65536)
                if not data:
                    break
                send(session.receive(data) + session.poll())
        except OSError as error:
            log.info("pipe closed: %s", error)
        finally:
            self.on_disconnect()
            log.info("debugger on the pipe left")

    @staticmethod
    def _refuse(conn: socket.socket, _peer: tuple = ()) -> None:
        """Answer the newcomer's first packet with an error it prints, then hang up."""
        decoder = Decoder()
        try:
            conn.settimeout(2.0)
            while True:
                data = conn.recv(4096)
                if not data:
                    return
                if any(e.kind is EventKind.PACKET for e in decoder.feed(data)):
                    conn.sendall(b"+" + encode_packet(b"E." + BUSY_MESSAGE.encode()))
                    return
        except OSError:
            return
        finally:
            conn.close()
