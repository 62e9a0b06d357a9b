"""The follow channel: a second, read-only loopback listener that streams committed trace frames.

The RSP port serves one debugger at a time, because two debuggers would interleave tracepoint downloads. Reading
frames changes nothing, so it gets a listener of its own beside the RSP one (`kgtp-sim serve --follow-port`,
by default the RSP port + 1): any number of followers may be connected while GDB is attached and tracing. The
channel cannot change the target. It speaks newline-delimited JSON, not RSP, and knows three requests:

    {"op": "follow", "from": "now" | "start", "consume": false}
                                                  stream frames as they are committed, until the client leaves;
                                                  with "consume": true the frames sent leave the buffer
    {"op": "snapshot"}                            every frame in the buffer now, then {"t": "end", ...}
    {"op": "stream", ...}                         the drain: every CPU's ring entries unparsed, in bulk, for
                                                  readers at the kernel's pace and recorders (stub/stream.py)

A request's other keys are ignored. Clients send GDB's `vMustReplyEmpty` packet as the value of their first key,
`rsp_probe`: an RSP server given the request by mistake drops the JSON around it as noise and answers the packet
(`+`), so a client pointed at the RSP port knows it from the first byte back, without waiting (view/channel.py).
Anything else (an RSP packet included) is answered `{"t": "error", ...}` and the connection is closed. Replies:

    {"t": "run", ...}        the run's definitions: tracepoints with their source text (QTDPsrc), variables,
                             markers of static tracepoints, tstart's wall-clock time; sent at every tstart and
                             whenever GDB changes the tracepoints during a run
    {"t": "frame", ...}      seq (creation order on its CPU since tstart), frame number, tracepoint, cpu, ns since
                             tstart (from the TSC read at tstart, `Tracer.start_tsc`), the frame's blocks in GDB's format (base64), $_sdata rendered by TP_printk
    {"t": "missed", "count": N}   frames a circular buffer overwrote before the channel read them
    {"t": "stopped", ...}    the run ended (tstop, pass count, full buffer, error, disconnect)

Frames are read with `tracer.frames()` and by default never consumed: GDB's tfind/tdump/tsave see every frame a
follower saw. Only a follower that asks for a consuming read (KGTP's frame pipe: a linear buffer then never
fills) removes what it was sent, through `tracer.consume_frames`; that is the one change this channel can make.
Frames come in the buffer's merged order (every CPU's ring, by timestamp: `ring.Rings`). Each follower tracks the
last sequence number it sent of each CPU; a gap in a CPU's sequence is reported as missed.

Threads: the listener runs in the thread `follow-listener`; each follower is served by its own thread
`follow-<port>`, which polls the tracer (at most every `poll` seconds, only re-reading the buffer when its
frame count changed; the drain reads again at once while the rings are busy). No code here runs on the CPU
thread (the drain's reads run there as requests, stub/stream.py).
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass, field

from ..rsp.server import listener
from .stream import stream

log = logging.getLogger(__name__)

#: A follower that has not sent its request this long after connecting is dropped.
REQUEST_TIMEOUT = 5.0
MAX_REQUEST = 4096


def _run_signature(tracer) -> tuple:
    definitions = tracer.definitions
    return (
        tracer.start_time,
        tuple((key, tp.enabled, len(tp.sources)) for key, tp in definitions.tracepoints.items()),
    )


def run_message(tracer) -> dict:
    """The definitions a reader needs to name what frames hold."""
    definitions = tracer.definitions
    tracepoints = []
    for (number, address), tp in list(definitions.tracepoints.items()):
        marker = tracer.marker_at(address) if tp.static else None
        tracepoints.append({
            "number": number,
            "address": address,
            "enabled": tp.enabled,
            "static": tp.static,
            "marker": marker.id if marker is not None else None,
            "sources": [{"kind": s.kind, "source": s.source} for s in tp.sources],
        })
    variables = {str(v.number): v.name for v in list(definitions.variables.values())}
    return {
        "t": "run",
        "running": tracer.running,
        "start_us": tracer.start_time,
        "ticks_per_ns": tracer.tsc.ticks_per_ns,
        "tracepoints": tracepoints,
        "variables": variables,
    }


def frame_message(tracer, frame, tsc_origin: int) -> dict:
    message = {
        "t": "frame",
        "seq": frame.sequence,
        "n": frame.number,
        "tp": frame.tracepoint,
        "cpu": frame.cpu,
        "ns": tracer.tsc.to_ns(frame.timestamp - tsc_origin),
        "data": base64.b64encode(frame.to_gdb()).decode(),
    }
    if frame.static_data() is not None:
        message["sdata"] = tracer.rendered_sdata(frame)
    return message


def tsc_at_start(tracer) -> int:
    """The TSC at tstart (`Tracer.start_tsc`, read on the CPU thread before the run's first hit): where frame
    times count from, the same for every reader of a run."""
    start = getattr(tracer, "start_tsc", None)
    return 0 if start is None or tracer.start_time is None else start


def _created_per_cpu(tracer) -> dict[int, int]:
    """cpu -> the sequence of the last frame created on it so far (-1: none)."""
    rings = getattr(tracer, "ring", None)
    if rings is None or not hasattr(rings, "states"):
        created = tracer.status().created
        return {0: created - 1}
    return {cpu: state.created - 1 for cpu, state in enumerate(rings.states())}


def _unsent(frames, last: dict[int, int]) -> tuple[list, int]:
    """The frames after each CPU's last sent sequence (in the buffer's order), and how many each CPU's
    sequence skipped (overwritten before they were read)."""
    batch, missed, expect = [], 0, dict(last)
    for frame in frames:
        previous = expect.get(frame.cpu, -1)
        if frame.sequence > previous:
            missed += frame.sequence - previous - 1
            expect[frame.cpu] = frame.sequence
            batch.append(frame)
    return batch, missed


class _Gone(Exception):
    """The follower closed its end."""


@dataclass
class FollowServer:
    tracer: object
    host: str = "127.0.0.1"
    port: int = 1235
    poll: float = 0.01
    _listener: socket.socket | None = field(init=False, default=None)
    _stop: threading.Event = field(init=False, default_factory=threading.Event)
    _threads: list[threading.Thread] = field(init=False, default_factory=list)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    followers: int = field(init=False, default=0)

    def bind(self) -> tuple[str, int]:
        self._listener = listener(self.host, self.port)
        host, self.port = self._listener.getsockname()[:2]
        return host, self.port

    def start(self) -> None:
        if self._listener is None:
            self.bind()
        thread = threading.Thread(target=self._accept_loop, daemon=True, name="follow-listener")
        thread.start()
        self._threads.append(thread)

    def shutdown(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        for thread in list(self._threads):
            thread.join(timeout=2)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True, name=f"follow-{peer[1]}")
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    # ---- one follower ---------------------------------------------------------------------------------------

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self.followers += 1
        try:
            request = self._read_request(conn)
            if request is None:
                return
            op = request.get("op") if isinstance(request, dict) else None
            if op == "follow":
                self._follow(conn, request.get("from", "now") == "start", request.get("consume") is True)
            elif op == "snapshot":
                self._snapshot(conn)
            elif op == "stream":
                stream(self, conn, request, lambda tracer: {**run_message(tracer), "tsc_origin": tsc_at_start(tracer)})
            else:
                self._send(conn, {"t": "error", "message": "read-only follow channel: the requests are "
                                  "{\"op\": \"follow\"}, {\"op\": \"snapshot\"} and {\"op\": \"stream\"}; debug "
                                  "through the RSP port"})
        except _Gone:
            pass
        except Exception:  # a bug here must not take the stub down; the follower sees its connection close
            log.exception("follow channel failed")
        finally:
            with self._lock:
                self.followers -= 1
            conn.close()

    def _read_request(self, conn: socket.socket) -> dict | None:
        conn.settimeout(REQUEST_TIMEOUT)
        data = b""
        try:
            while b"\n" not in data:
                chunk = conn.recv(MAX_REQUEST)
                if not chunk:
                    return None
                data += chunk
                if len(data) > MAX_REQUEST:
                    break
        except OSError:
            return None
        line = data.split(b"\n", 1)[0]
        try:
            request = json.loads(line)
        except ValueError:
            request = None
        if not isinstance(request, dict):
            try:
                self._send(conn, {"t": "error", "message": "read-only follow channel: send one JSON request "
                                  "line such as {\"op\": \"follow\"}; GDB attaches to the RSP port"})
            except _Gone:
                pass
            return None
        conn.settimeout(None)
        return request

    # what stub/stream.py's drain uses of its server
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def send(self, conn: socket.socket, *messages: dict) -> None:
        self._send(conn, *messages)

    @staticmethod
    def send_raw(conn: socket.socket, data: bytes) -> None:
        try:
            conn.sendall(data)
        except OSError:
            raise _Gone from None

    def peer_closed(self, conn: socket.socket) -> bool:
        return self._peer_closed(conn)

    @staticmethod
    def _send(conn: socket.socket, *messages: dict) -> None:
        if not messages:
            return
        data = "".join(json.dumps(m, separators=(",", ":")) + "\n" for m in messages).encode()
        try:
            conn.sendall(data)
        except OSError:
            raise _Gone from None

    def _snapshot(self, conn: socket.socket) -> None:
        tracer = self.tracer
        origin = tsc_at_start(tracer)
        frames = tracer.frames()
        status = tracer.status()
        self._send(conn, run_message(tracer))
        for start in range(0, len(frames), 256):
            self._send(conn, *(frame_message(tracer, f, origin) for f in frames[start : start + 256]))
        self._send(conn, {"t": "end", "frames": len(frames), "created": status.created, "running": tracer.running,
                          "stop_reason": status.stop_reason.name})

    def _follow(self, conn: socket.socket, from_start: bool, consume: bool = False) -> None:
        tracer = self.tracer
        signature = None
        last: dict[int, int] = {}  # cpu -> sequence of the last frame of that CPU sent in this run
        origin = 0
        running = False
        seen_created = -1
        conn.setblocking(True)
        while not self._stop.is_set():
            now_running = tracer.running  # read before the frames: a stop seen here follows its last frame
            now = _run_signature(tracer)
            if now != signature:
                if signature is None or now[0] != signature[0]:  # the first look, or a new tstart
                    origin = tsc_at_start(tracer)
                    seen_created = -1
                    first_look = signature is None
                    last = _created_per_cpu(tracer) if first_look and not from_start else {}
                signature = now
                self._send(conn, run_message(tracer))
            created = tracer.status().created
            if created != seen_created:
                seen_created = created
                frames = tracer.frames()
                batch, missed = _unsent(frames, last)
                if batch:
                    if missed:
                        self._send(conn, {"t": "missed", "count": missed})
                    for start in range(0, len(batch), 256):
                        self._send(conn, *(frame_message(tracer, f, origin) for f in batch[start : start + 256]))
                    for frame in batch:
                        last[frame.cpu] = frame.sequence
                    if consume:
                        tracer.consume_frames(dict(last))
            if running and not now_running:
                status = tracer.status()
                self._send(conn, {"t": "stopped", "reason": status.stop_reason.name, "created": status.created})
            running = now_running
            if self._peer_closed(conn):
                raise _Gone
            time.sleep(self.poll)

    @staticmethod
    def _peer_closed(conn: socket.socket) -> bool:
        try:
            conn.setblocking(False)
            try:
                data = conn.recv(1, socket.MSG_PEEK)
            finally:
                conn.setblocking(True)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return data == b""
