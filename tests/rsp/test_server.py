"""The transports: a stop the target makes by itself on another thread (a breakpoint hit while `c` waits) wakes
the serving thread, which sends the session's stop reply, over TCP and over a pipe."""

from __future__ import annotations

import os
import socket
import threading

from kgtp_sim.rsp.codec import Decoder, EventKind, encode_packet
from kgtp_sim.rsp.dispatch import Deferred, Dispatcher, handles
from kgtp_sim.rsp.packets import connect as c
from kgtp_sim.rsp.server import RspServer
from kgtp_sim.rsp.session import Session


class Target:
    """`c` runs until `stop_itself`, called from any thread."""

    def __init__(self) -> None:
        self.stopped: bytes | None = None
        self.server: RspServer | None = None

    @handles(c.Continue)
    def cont(self, packet):
        self.stopped = None
        return Deferred()

    def stop_itself(self) -> None:
        self.stopped = b"T05thread:2;"
        assert self.server is not None
        self.server.wake()


def _server(target: Target) -> RspServer:
    dispatcher = Dispatcher((target,))
    server = RspServer(lambda: Session(dispatcher, async_stop=lambda: target.stopped), port=0)
    target.server = server
    return server


def _next_packet(read) -> bytes:
    decoder = Decoder()
    while True:
        for event in decoder.feed(read()):
            if event.kind is EventKind.PACKET:
                return event.payload


def test_over_tcp():
    target = Target()
    server = _server(target)
    _, port = server.bind()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(encode_packet(b"c"))
            assert sock.recv(1) == b"+"  # acknowledged; no reply while the target runs
            threading.Thread(target=target.stop_itself).start()
            assert _next_packet(lambda: sock.recv(4096)) == b"T05thread:2;"
    finally:
        server.shutdown()


def test_over_a_pipe():
    target = Target()
    server = _server(target)
    to_stub, from_gdb = os.pipe()
    to_gdb, from_stub = os.pipe()
    thread = threading.Thread(target=server.serve_pipe, args=(to_stub, from_stub), daemon=True)
    thread.start()
    try:
        os.write(from_gdb, encode_packet(b"c"))
        assert os.read(to_gdb, 1) == b"+"
        threading.Thread(target=target.stop_itself).start()
        assert _next_packet(lambda: os.read(to_gdb, 4096)) == b"T05thread:2;"
    finally:
        server.shutdown()
        os.close(from_gdb)
        thread.join(5)
        for fd in (to_stub, to_gdb, from_stub):
            os.close(fd)


def _connect_and_ask(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(encode_packet(payload))
        assert sock.recv(1) == b"+"
        return _next_packet(lambda: sock.recv(4096))


def test_a_debugger_arriving_while_the_last_one_leaves_is_served_once_it_has_left():
    """GDB's detach and the next `target remote` come back to back: the first session's end (its detach carried
    out by `on_disconnect`) may still be running when the second debugger connects. That one waits for the slot;
    one arriving while a debugger is being served is refused at once."""
    target = Target()
    leaving, left = threading.Event(), threading.Event()

    def on_disconnect() -> None:
        leaving.set()
        left.wait(10)  # the first debugger's detach, still being carried out

    dispatcher = Dispatcher((target,))
    server = RspServer(lambda: Session(dispatcher, async_stop=lambda: target.stopped), port=0,
                       on_disconnect=on_disconnect)
    target.server = server
    _, port = server.bind()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        first = socket.create_connection(("127.0.0.1", port), timeout=10)
        first.sendall(encode_packet(b"?"))
        assert first.recv(1) == b"+"
        _next_packet(lambda: first.recv(4096))
        assert b"another debugger" in _connect_and_ask(port, b"?")  # while the first is served: refused
        first.close()
        assert leaving.wait(10)
        answer: list[bytes] = []
        second = threading.Thread(target=lambda: answer.append(_connect_and_ask(port, b"?")))
        second.start()
        second.join(0.5)
        assert not answer  # waiting for the slot, not refused
        left.set()
        second.join(30)
        assert answer and b"another debugger" not in answer[0], answer
        assert server.connections == 2
    finally:
        left.set()
        server.shutdown()


class _Busy:
    """`qAttached` answered only once `release` is set (the serving thread busy with a packet)."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    @handles(c.Attached)
    def attached(self, packet):
        self.entered.set()
        self.release.wait(30)
        return b"1"


def test_a_debugger_arriving_after_the_last_one_hung_up_unseen_is_served_once_it_has_left():
    """GDB's `disconnect` sends nothing: it closes its socket, and its next `target remote` can be accepted before
    the serving thread has read the end of file (here: busy with the first debugger's last packet). The newcomer
    waits for the slot instead of being refused as a second debugger."""
    busy = _Busy()
    dispatcher = Dispatcher((busy,))
    server = RspServer(lambda: Session(dispatcher), port=0)
    _, port = server.bind()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        first = socket.create_connection(("127.0.0.1", port), timeout=10)
        first.sendall(encode_packet(b"qAttached"))
        assert busy.entered.wait(10)
        first.close()
        answer: list[bytes] = []
        second = threading.Thread(target=lambda: answer.append(_connect_and_ask(port, b"?")))
        second.start()
        second.join(0.5)
        assert not answer, answer  # waiting for the slot, not refused
        busy.release.set()
        second.join(30)
        assert answer and b"another debugger" not in answer[0], answer
        assert server.connections == 2 and server.refused == 0
    finally:
        busy.release.set()
        server.shutdown()
