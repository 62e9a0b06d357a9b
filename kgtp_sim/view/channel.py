"""Client of the stub's read-only follow channel (server side: kgtp_sim/stub/follow.py).

`messages(host, port, request)` yields the JSON messages the stub sends; `snapshot(host, port)` loads every
frame in the buffer as a `Run`. Runs in the caller's thread; a blocking socket read is the only wait.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

from .model import Run

DEFAULT_FOLLOW_PORT = 1235


class ChannelError(RuntimeError):
    """The follow channel refused the request or could not be reached."""


def messages(host: str, port: int, request: dict, timeout: float | None = None) -> Iterator[dict]:
    try:
        sock = socket.create_connection((host, port), timeout=10)
    except OSError as error:
        raise ChannelError(f"cannot reach the follow channel at {host}:{port}: {error.strerror or error} "
                           "(kgtp-sim serve prints its port; it is the RSP port + 1 by default)") from None
    sock.settimeout(timeout)
    try:
        sock.sendall(json.dumps(request).encode() + b"\n")
        reader = sock.makefile("rb", buffering=1 << 16)
        for line in reader:
            message = json.loads(line)
            if message.get("t") == "error":
                raise ChannelError(message.get("message", "refused"))
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
