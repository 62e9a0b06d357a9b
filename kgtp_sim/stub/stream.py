"""The follow channel's drain: committed entries of every CPU's ring, streamed unparsed (`{"op": "stream"}`).

The follow channel's JSON frames (stub/follow.py) cost the stub a parse, a re-encoding and base64 per frame: a
few thousand frames a second. The drain reads each CPU's new bytes at one instant (`Tracer.read_entries`, the
ring's bytes from where this reader stopped to `head`) and sends them as they are, so the stub does no work
per frame and the reader decodes runs of frames in bulk (view/batch.py). The recorder (`kgtp-sim record`),
`follow`, `export`, `plot` read this way. The request:

    {"op": "stream", "from": "now" | "start", "until": null | "now" | "stop", "record": false, "consume": false}

`from`: at the first look, the frames in the buffer are skipped ("now") or sent ("start"). `until`: "now"
sends what the buffer holds and ends (a snapshot); "stop" ends once the run the reader saw running has stopped;
null follows every run until the reader leaves. `record`: the reader is a recorder: while it is attached the
ring is GDB's flight recorder (`Tracer.attach_recorder`) and tstatus's notes say how many frames it got and
lost. `consume`: KGTP's frame pipe: what was sent leaves the buffer (`Tracer.consume_frames`). Replies:

    {"t": "run", ...}         as on the follow channel (stub/follow.py), with "tsc_origin": the TSC at tstart
    {"t": "entries", "cpus": [{"cpu", "bytes", "first_seq", "frames", "lost"}, ...], "kret": {...}}
                              then the bytes of every listed CPU, in that order: whole ring entries (ring.py's
                              format, padding entries included), `frames` of them frames whose sequences run
                              from `first_seq`; `lost` frames of that CPU a circular buffer overwrote before they
                              were read (every frame is sent or counted). `kret` (only with return probes): the
                              trampoline addresses collected stack words hold, and the return addresses they
                              stand for (kgtp/kret.py's `visible`)
    {"t": "stopped", "reason": ..., "created": N}   the run ended (after its last entries)
    {"t": "end", "frames": N, "lost": L, ...}       `until` reached

Threads: runs on the follower's thread of the follow channel (`FollowServer._serve`); its reads run on the CPU
thread, between two instructions, as one request each.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from dataclasses import dataclass, field

from ..tracing.core.ring import ENTRY_HEADER, PAD_CPU

_PAD = struct.Struct("<II")
#: A read that brought at least this share of a CPU's ring is followed by the next at once, not after `poll`.
_BUSY_SHARE = 8


def first_sequence(data: bytes) -> int | None:
    """The sequence number of the first frame in a run of ring entries (None: padding only)."""
    at = 0
    while at + _PAD.size <= len(data):
        length, cpu = _PAD.unpack_from(data, at)
        if cpu != PAD_CPU:
            return ENTRY_HEADER.unpack_from(data, at)[3]
        if length < _PAD.size:
            return None
        at += length
    return None


@dataclass
class DrainCounts:
    """What one reader got of the current run: frames sent and lost, per CPU and in all."""

    sent: int = 0
    lost: int = 0
    expect: dict[int, int] = field(default_factory=dict)  # cpu -> sequence of the next frame to send

    def reset(self) -> None:
        self.sent, self.lost, self.expect = 0, 0, {}


def _signature(tracer) -> tuple:
    definitions = tracer.definitions
    return (tracer.start_time,
            tuple((key, tp.enabled, len(tp.sources)) for key, tp in list(definitions.tracepoints.items())))


def stream(server, conn: socket.socket, request: dict, run_message) -> None:
    """Serve one `stream` request on `conn` until `until` is reached or the reader leaves (the server's send
    raises); `run_message(tracer)` is the `run` message (stub/follow.py's, with the TSC at tstart)."""
    tracer = server.tracer
    until = request.get("until")
    # a reader that waits for a run's end (the recorder) skips the frames of a run already stopped
    from_start = request.get("from", "now") == "start" and (until != "stop" or tracer.running)
    record = request.get("record") is True
    consume = request.get("consume") is True
    positions: dict[int, int] = {}
    counts = DrainCounts()
    signature = None
    seen_running = False
    if record:
        tracer.attach_recorder()
    try:
        while not server.stop_requested():
            now_running = tracer.running  # read before the entries: a stop seen here follows its last frame
            now = _signature(tracer)
            if now != signature:
                if signature is None or now[0] != signature[0]:  # the first look, or a new tstart
                    positions, first_look = {}, signature is None
                    counts.reset()
                    seen_running = seen_running or not first_look  # a run began (and may be over already)
                    if first_look and not from_start and tracer.ring is not None:
                        for cpu, state in enumerate(tracer.ring.states()):
                            positions[cpu] = state.head
                            counts.expect[cpu] = state.created
                signature = now
                server.send(conn, run_message(tracer))
            raws = tracer.read_entries(positions)
            if _signature(tracer)[0] != signature[0]:
                continue  # a tstart came between: read again from the new run's start
            busy = _send_entries(server, conn, tracer, raws, positions, counts)
            if consume and busy is not None:
                tracer.consume_frames({raw.cpu: raw.created - 1 for raw in raws if raw.data})
            if record and (busy is not None or not counts.sent):
                tracer.report_recorder(f"kgtp-sim record attached: {counts.sent} frames recorded, {counts.lost} "
                                       f"lost (overwritten before they were read)")
            seen_running = seen_running or now_running
            if seen_running and not now_running:
                status = tracer.status()
                server.send(conn, {"t": "stopped", "reason": status.stop_reason.name, "created": status.created})
                seen_running = False
                if until == "stop":
                    break
            if until == "now":
                break
            if server.peer_closed(conn):
                return
            if not busy:
                time.sleep(server.poll)
        status = tracer.status()
        server.send(conn, {"t": "end", "frames": counts.sent, "lost": counts.lost, "created": status.created,
                           "running": tracer.running, "stop_reason": status.stop_reason.name})
    finally:
        if record:
            tracer.detach_recorder()
            if (counts.sent or counts.lost) and tracer.running:
                tracer.report_recorder(f"kgtp-sim record detached after {counts.sent} frames ({counts.lost} lost); "
                                       f"the buffer stays circular until the run ends")
            elif counts.sent or counts.lost:
                tracer.report_recorder(f"kgtp-sim record: {counts.sent} frames recorded, {counts.lost} lost")


def _send_entries(server, conn, tracer, raws, positions: dict[int, int], counts: DrainCounts) -> bool | None:
    """Send one read's entries; returns None when there were none, else whether a ring was busy (a large share
    of it new), in which case the next read comes at once."""
    listed, payload, busy = [], [], False
    for raw in raws:
        positions[raw.cpu] = raw.head
        if not raw.data:
            continue
        first = first_sequence(raw.data)
        frames = 0 if first is None else raw.created - first
        lost = 0 if first is None else max(0, first - counts.expect.get(raw.cpu, 0))
        if first is not None:
            counts.expect[raw.cpu] = raw.created
        counts.sent += frames
        counts.lost += lost
        listed.append({"cpu": raw.cpu, "bytes": len(raw.data), "first_seq": first, "frames": frames, "lost": lost})
        payload.append(raw.data)
        busy = busy or len(raw.data) * _BUSY_SHARE >= raw.size
    if not listed:
        return None
    message = {"t": "entries", "cpus": listed}
    kret = getattr(tracer, "kret", None)
    display = dict(kret.display) if kret is not None else {}  # one snapshot: the CPU thread adds trampolines
    if display:
        message["kret"] = {str(trampoline): kret.resolve(trampoline) for trampoline in display}
    server.send_raw(conn, (json.dumps(message, separators=(",", ":")) + "\n").encode() + b"".join(payload))
    return busy
