"""Recorded RSP sessions: a logging proxy between real GDB and the stub, and the transcript file format.

A transcript is what real GDB sent and what the stub answered, one packet per line:

    > qSupported:multiprocess+;swbreak+;...      (GDB -> stub)
    < PacketSize=4000;QStartNoAckMode+;...       (stub -> GDB)

Payloads are decoded (no framing, no escapes); bytes outside printable ASCII and the backslash are written as
`\\xNN`. Acks are left out. Lines starting with `#` are comments (the recording's provenance).

Threads: a `RecordingProxy` serves its one connection on threads of its own (one accepts it, then one pump per
direction appends to `lines` under a lock); `wait` and `write` run on the caller's thread (the main thread of
record_transcript.py). The file format's functions are pure (run on the thread of the replay test or the fuzzer that
loads a transcript).
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from ..rsp.codec import Decoder, EventKind


@dataclass(frozen=True)
class Exchange:
    """One request and the packets that answered it (monitor output gives several; `c` may give none)."""

    request: bytes
    replies: tuple[bytes, ...]


def quote(payload: bytes) -> str:
    out = []
    for byte in payload:
        if byte == 0x5C:
            out.append("\\\\")
        elif 0x20 <= byte < 0x7F:
            out.append(chr(byte))
        else:
            out.append(f"\\x{byte:02x}")
    return "".join(out)


def unquote(text: str) -> bytes:
    out = bytearray()
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            if text[i + 1] == "\\":
                out.append(0x5C)
                i += 2
            else:
                out.append(int(text[i + 2 : i + 4], 16))
                i += 4
        else:
            out.append(ord(ch))
            i += 1
    return bytes(out)


def load(path: Path) -> list[Exchange]:
    exchanges: list[Exchange] = []
    request: bytes | None = None
    replies: list[bytes] = []
    for line in path.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        direction, payload = line[:1], unquote(line[2:])
        if direction == ">":
            if request is not None:
                exchanges.append(Exchange(request, tuple(replies)))
            request, replies = payload, []
        elif direction == "<":
            replies.append(payload)
        else:
            raise ValueError(f"{path}: bad transcript line {line!r}")
    if request is not None:
        exchanges.append(Exchange(request, tuple(replies)))
    return exchanges


class RecordingProxy:
    """Forwards one GDB connection to the stub and writes the packets both ways to a transcript."""

    def __init__(self, stub_address: tuple[str, int], listen_port: int = 0) -> None:
        self.stub_address = stub_address
        self.listener = socket.create_server(("127.0.0.1", listen_port))
        self.port = self.listener.getsockname()[1]
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        upstream = socket.create_connection(self.stub_address)
        pumps = [
            threading.Thread(target=self._pump, args=(client, upstream, ">"), daemon=True),
            threading.Thread(target=self._pump, args=(upstream, client, "<"), daemon=True),
        ]
        for pump in pumps:
            pump.start()
        for pump in pumps:
            pump.join()

    def _pump(self, source: socket.socket, sink: socket.socket, direction: str) -> None:
        decoder = Decoder()
        try:
            while data := source.recv(65536):
                with self._lock:
                    for event in decoder.feed(data):
                        if event.kind is EventKind.PACKET:
                            self.lines.append(f"{direction} {quote(event.payload)}")
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def wait(self, timeout: float = 30) -> None:
        self._thread.join(timeout)
        self.listener.close()

    def write(self, path: Path, header: list[str]) -> None:
        path.write_text("".join(f"# {h}\n" for h in header) + "\n".join(self.lines) + "\n")
