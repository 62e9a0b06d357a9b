"""The launcher's side of a warm start (warm.py has the protocol and the server's side): `kgtp-sim gdbserver` run
with KGTP_SIM_WARM=SOCKET sends its command line, directory, environment and fds 0 to 2 to the warm server, passes
its signals on to the fork that serves it and exits as that fork does.

It runs before anything else of the package is imported (`__main__.py`, on the main thread), once per server
GDB's testsuite starts (hundreds of times), so it imports only what the interpreter has built in: `_socket`,
`_signal` and `_json` instead of socket, signal and json, whose imports (re, enum, selectors) took 15 ms of a
launch that otherwise takes 10. The request is the JSON object json.dumps would write (`encode_request`).
"""

from __future__ import annotations

import os
import struct

import _json
import _signal
import _socket

#: the environment variable that points `kgtp-sim gdbserver` at a warm server's socket
ENV = "KGTP_SIM_WARM"
#: signals the launcher passes on to its server
FORWARDED = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP, _signal.SIGQUIT, _signal.SIGUSR1, _signal.SIGUSR2)


def read_exact(conn, size: int) -> bytes | None:
    """`size` bytes from the stream socket `conn` (a socket or _socket object); None if it ends first."""
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def encode_request(argv: list[str], cwd: str, env: dict[str, str]) -> bytes:
    """The launch request's JSON text ({"argv": [...], "cwd": ..., "env": {...}}) as json.dumps writes it, strings
    escaped by json's own C encoder (ASCII only; a lone surrogate of a non-UTF-8 environment as \\udcXX)."""
    text = _json.encode_basestring_ascii
    return ('{"argv": [' + ", ".join(text(arg) for arg in argv) + '], "cwd": ' + text(cwd) + ', "env": {'
            + ", ".join(f"{text(key)}: {text(value)}" for key, value in env.items()) + "}}").encode()


def offer(argv: list[str]) -> None:
    """`kgtp-sim ARGV`, when it is `gdbserver ...` and ENV names a warm server, served by that server (`launch`:
    then it never returns); otherwise, or where no warm server listens there, returns at once."""
    path = os.environ.get(ENV)
    if argv[:1] == ["gdbserver"] and path:
        launch(path, argv)


def launch(path: str, argv: list[str]) -> None:
    """Have the warm server at `path` run `kgtp-sim ARGV` with this process's streams, directory and environment,
    and exit as it does. Returns (nothing done) when no warm server listens there."""
    conn = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        return
    request = encode_request(argv, os.getcwd(), dict(os.environ))
    data = struct.pack("!I", len(request)) + request
    try:  # the streams ride with the request's first bytes (socket.send_fds)
        sent = conn.sendmsg([data], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack("3i", 0, 1, 2))])
        if sent < len(data):
            conn.sendall(data[sent:])
        head = read_exact(conn, 5)
    except OSError:
        head = None
    if head is None or head[:1] != b"p":  # refused before it started anything: start cold
        conn.close()
        return
    child = struct.unpack("!I", head[1:])[0]

    def forward(number: int, _frame) -> None:
        try:
            os.kill(child, number)
        except ProcessLookupError:
            pass

    for number in FORWARDED:
        _signal.signal(number, forward)
    try:
        tail = read_exact(conn, 5)
    except OSError:
        tail = None
    if tail is None or tail[:1] != b"s":  # the warm server went away first: the child's status is lost
        os._exit(1)
    code = os.waitstatus_to_exitcode(struct.unpack("!i", tail[1:])[0])
    if code < 0:  # killed by a signal: so is the launcher, for its parent's wait
        _signal.signal(-code, _signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)
