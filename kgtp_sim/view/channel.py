"""Client of the stub's read-only follow channel (server side: kgtp_sim/stub/follow.py).

`messages(host, port, request)` yields the JSON messages the stub sends; `snapshot(host, port)` loads every
frame in the buffer as a `Run`. Runs in the caller's thread; a blocking socket read is the only wait.

The RSP port is one below the follow channel and easily given instead. An RSP server sends nothing on connect
(it waits for a packet), so every request carries a probe it answers at once: GDB's own `vMustReplyEmpty`
packet, as the value of the request's first key. The follow channel ignores that key and answers with a JSON
line; an RSP server drops the JSON around the packet as noise outside a packet (as GDB's protocol says) and
answers the packet: `+`, then an empty reply, or an error when its one debugger slot is taken. The first byte
back tells the two apart, and a port that answers nothing within `ANSWER_TIMEOUT` is not the follow channel.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

from .model import Run

DEFAULT_FOLLOW_PORT = 1235
#: The packet every request carries for an RSP server to answer (its checksum is GDB's, remote.c).
RSP_PROBE = "$vMustReplyEmpty#3a"
#: The follow channel answers every request at once (the run's definitions); a port silent this long is not it.
ANSWER_TIMEOUT = 10.0
_WHERE = "kgtp-sim serve prints its port; it is the RSP port + 1 by default"


class ChannelError(RuntimeError):
    """The follow channel refused the request or could not be reached."""


def _check_answer(sock: socket.socket, host: str, port: int) -> None:
    """Wait for the first byte of the answer (not consuming it) and raise ChannelError unless it starts a JSON
    line: an RSP port's `+`/`$`, silence or a hang-up each get their own message."""
    sock.settimeout(ANSWER_TIMEOUT)
    try:
        first = sock.recv(1, socket.MSG_PEEK)
    except TimeoutError:
        raise ChannelError(f"{host}:{port} sent nothing in {ANSWER_TIMEOUT:.0f} s: not the follow channel, which "
                           f"answers at once ({_WHERE})") from None
    if first == b"{":
        return
    if first in (b"+", b"-", b"$"):
        raise ChannelError(f"{host}:{port} is a GDB remote protocol (RSP) port, where GDB attaches, not the follow "
                           f"channel: that is the port `kgtp-sim serve` printed for followers, by default the RSP "
                           f"port + 1 (here {port + 1})")
    if not first:
        raise ChannelError(f"{host}:{port} closed the connection without answering: not the follow channel "
                           f"({_WHERE})")
    raise ChannelError(f"{host}:{port} answered {first!r}..., not as the follow channel does ({_WHERE})")


def messages(host: str, port: int, request: dict, timeout: float | None = None, raw: bool = False) -> Iterator[dict]:
    """The messages the follow channel sends for `request`; with `raw`, an `entries` message of the drain
    (stub/stream.py) carries the bytes that follow it as its "data"."""
    try:
        sock = socket.create_connection((host, port), timeout=10)
    except OSError as error:
        raise ChannelError(f"cannot reach the follow channel at {host}:{port}: {error.strerror or error} "
                           f"({_WHERE})") from None
    try:
        sock.sendall(json.dumps({"rsp_probe": RSP_PROBE, **request}).encode() + b"\n")
        _check_answer(sock, host, port)
        sock.settimeout(timeout)
        reader = sock.makefile("rb", buffering=1 << 16)
        for line in reader:
            message = json.loads(line)
            if message.get("t") == "error":
                raise ChannelError(message.get("message", "refused"))
            if raw and message.get("t") == "entries":
                length = sum(item["bytes"] for item in message["cpus"])
                message["data"] = bytearray(length)
                if reader.readinto(message["data"]) != length:
                    raise ChannelError(f"the follow channel at {host}:{port} closed in the middle of a message")
            yield message
    finally:
        sock.close()


def snapshot(host: str, port: int) -> Run:
    """Every frame the stub's buffer holds now, with the run's definitions."""
    run = Run()
    for message in messages(host, port, {"op": "snapshot"}):
        kind = message["t"]
        if kind == "run":
            run.apply_run_message(message)
        elif kind == "frame":
            run.frames.append(Run.frame_from_message(message))
        elif kind == "end":
            run.missed = max(0, message.get("created", 0) - message.get("frames", 0))
            break
    return run
