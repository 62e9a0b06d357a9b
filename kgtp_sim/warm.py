"""Warm starts of the gdbserver role: `kgtp-sim warm` keeps an interpreter with the role's modules loaded, and
`kgtp-sim gdbserver ...` run with `KGTP_SIM_WARM=SOCKET` in its environment is served by a fork of it.

Why: a cold `kgtp-sim gdbserver` spends some 0.25 s importing its modules (and loading unicorn, capstone and
keystone) before it binds its port, and a harness such as GDB's testsuite starts hundreds of servers, one per
session; gdbserver starts in milliseconds. Forked from a warm interpreter, the role starts with its modules already
loaded and its first packets find the decoder and the assembler ready, and a machine built as the role builds one
by default (Machine.prepare: not started, not booted; a fork takes its copy, Machine.prepared, some 10 ms sooner).
Nothing else is shared: each launch is a new process with the launcher's command line, working directory,
environment and standard streams, that boots its own machine; what it prints, reads and exits with is what a cold
start's would be.

The two sides, over a Unix stream socket:

    launcher (launch.py, the `kgtp-sim gdbserver` process)         warm server (`serve`, `kgtp-sim warm`)
    connect; send the request (argv, cwd, environment) and
    its fds 0, 1 and 2 (SCM_RIGHTS)                      ------->  accept; fork
                                                                    child: takes the fds, the directory, the
                                                                    environment and the argv, runs `cli.entry`
    forwards SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1/2  <-------  parent: b"p" + the child's pid
    to the child; waits                                  <-------  parent, once the child is reaped: b"s" + its
    exits as the child did (its code, or its signal)                wait status

The launcher is the process its parent knows: its signals reach the child, its exit status is the child's, and
when it dies (SIGKILL too) the child sees its end of the connection close and dies with SIGKILL, as a cold
server would have. Where `KGTP_SIM_WARM` names no listening socket the launcher starts cold, in process, as if
the variable were not set.

Security: the socket's directory is the user's own (created 0700, refused when it is anyone else's or open to
others), the socket itself 0600, and a connection from another user (SO_PEERCRED) is refused: a launch runs with
the warm server's rights, which are those of the user who could have run `kgtp-sim gdbserver` anyway. A request
that cannot be read (garbage, too long, no fds, too slow) is answered by closing it; the warm server goes on.

Threads: the warm server is one thread, never more (fork() copies only the caller's thread: a server that had
started others would hand its children their locks half-held); it waits in a selector for connections and for
SIGCHLD. The launcher runs on its main thread. A child runs `cli.entry` on its main thread, plus the watch on
its launcher's connection.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

from .launch import FORWARDED, read_exact

#: the longest request read (argv and environment as JSON); a longer one is refused
MAX_REQUEST = 4 << 20
#: seconds a connection has to deliver its request
REQUEST_TIMEOUT = 10.0
#: what a warm server loads before it serves: the gdbserver role's modules and those its sessions load on first
#: use (the tracer's compilers, the decoder, the assembler, DWARF for markers and `$kret`); the KGTP-mode server,
#: the viewers, the benchmark and the tools are left out
PRELOAD_PACKAGES = ("kgtp_sim.rsp", "kgtp_sim.stub", "kgtp_sim.machine", "kgtp_sim.tracing", "kgtp_sim.agent",
                    "kgtp_sim.arch")
PRELOAD_MODULES = ("kgtp_sim.cli", "kgtp_sim.gdbserver", "kgtp_sim.programs", "kgtp_sim.optional",
                   "kgtp_sim.uc_native", "kgtp_sim.uc_paging", "capstone", "capstone.x86_const", "keystone",
                   "elftools.elf.elffile", "elftools.dwarf.descriptions")

#: process-wide caches a server fills at its start or on first use, filled once here (each a function of no
#: arguments, cached by functools): unicorn's internal offsets found on scratch CPUs, the host's rdtsc, the decoders
WARM_UP = ("kgtp_sim.machine.syscall_entry:hflags_offset", "kgtp_sim.machine.syscall_entry:_hook_code",
           "kgtp_sim.uc_native:old_exception_offset", "kgtp_sim.uc_native:tsc_offset_field",
           "kgtp_sim.uc_native:pc_sync_flag_offset", "kgtp_sim.uc_paging:page_fault_error_offset",
           "kgtp_sim.uc_paging:_disassembler", "kgtp_sim.machine.clock:native_rdtsc",
           "kgtp_sim.machine.watchpoints:_disassembler", "kgtp_sim.machine.counters:_branch_kinds",
           "kgtp_sim.tracing.patching.probes:disassembler", "kgtp_sim.tracing.patching.probes:_kinds",
           "kgtp_sim.tracing.patching.fastpath:_status_flags")


class WarmError(Exception):
    """The warm server cannot start (its socket's place is unsafe or taken)."""


def default_socket() -> str:
    """`$XDG_RUNTIME_DIR/kgtp-sim/warm.sock`, else `/tmp/kgtp-sim-UID/warm.sock`."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(runtime, "kgtp-sim") if runtime else f"/tmp/kgtp-sim-{os.getuid()}"
    return os.path.join(base, "warm.sock")


# ---- the warm server -------------------------------------------------------------------------------------------

def preload() -> None:
    """Import what the gdbserver role and its sessions use (PRELOAD_*), and fill its caches (WARM_UP)."""
    import importlib
    import pkgutil

    for name in PRELOAD_PACKAGES:
        package = importlib.import_module(name)
        for info in pkgutil.walk_packages(package.__path__, name + "."):
            if not info.name.endswith("__main__"):
                importlib.import_module(info.name)
    for name in PRELOAD_MODULES:
        importlib.import_module(name)
    for name in WARM_UP:
        module, function = name.split(":")
        getattr(importlib.import_module(module), function)()
    from .client import paths
    from .gdbserver import Options
    from .machine import KernelImage, Machine

    # a machine of the bundled kernel as `kgtp-sim gdbserver` builds one by default, built once: each fork's
    # server takes it as built (Machine.prepared); one started with other options builds its own from the image
    # read here, each fork getting it as read
    Machine.prepare(paths.VMLINUX, hz=Options.hz, cpus=Options.cpus)
    KernelImage.preload(paths.VMLINUX)


def _private_directory(path: str) -> None:
    """The socket's directory: made 0700 if missing; refused if it is not a directory of this user's, closed to
    others."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    status = os.lstat(directory)
    import stat

    if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid() or status.st_mode & 0o077:
        raise WarmError(f"{directory} must be a directory of this user's that no one else can open (mode 0700)")


def bind(path: str) -> socket.socket:
    """The warm server's listening socket at `path` (a stale socket there, one nobody answers on, is replaced)."""
    _private_directory(path)
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)
        else:
            raise WarmError(f"a warm server already listens on {path}")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(64)
    return listener


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """A launcher's request and its three fds; ValueError when it is not one."""
    fds: list[int] = []
    try:
        conn.settimeout(REQUEST_TIMEOUT)
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != os.getuid():
            raise ValueError(f"a connection from uid {uid}")
        data, fds, _flags, _address = socket.recv_fds(conn, 65536, 3)
        if len(fds) != 3 or len(data) < 4:
            raise ValueError("a request without its streams")
        size = struct.unpack("!I", data[:4])[0]
        if size > MAX_REQUEST:
            raise ValueError("a request too long")
        body = data[4:]
        if len(body) < size:
            rest = read_exact(conn, size - len(body))
            if rest is None:
                raise ValueError("a request cut short")
            body += rest
        request = json.loads(body[:size])
        argv, cwd, env = request["argv"], request["cwd"], request["env"]
        if (not isinstance(argv, list) or not all(isinstance(a, str) for a in argv) or argv[:1] != ["gdbserver"]
                or not isinstance(cwd, str) or not isinstance(env, dict)
                or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise ValueError("a request that is not a gdbserver command line")
        conn.settimeout(None)
        return request, fds
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError, struct.error) as error:
        for fd in fds:
            os.close(fd)
        raise ValueError(str(error) or type(error).__name__) from None


def _child(conn: socket.socket, request: dict, fds: list[int], inherited: list[int]) -> None:
    """In the fork: become the launcher's `kgtp-sim gdbserver`, then exit with its status. Never returns."""
    try:
        signal.set_wakeup_fd(-1)
        for number in (*FORWARDED, signal.SIGCHLD):  # as Python starts
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in inherited:
            os.close(fd)
        for number, fd in enumerate(fds):
            os.dup2(fd, number)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _reopen_streams()
        sys.argv = ["kgtp-sim", *request["argv"]]

        def watch() -> None:  # the launcher gone (killed): so is this server, as a cold one would be
            try:
                while conn.recv(1):
                    pass
            except OSError:
                pass
            os.kill(os.getpid(), signal.SIGKILL)

        import threading

        threading.Thread(target=watch, name="warm-launcher", daemon=True).start()
        from . import gdbserver

        status = gdbserver.main(request["argv"][1:])  # `kgtp-sim gdbserver`: cli.main's way to it
    except SystemExit as end:
        status = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
        if not isinstance(end.code, int) and end.code is not None:
            print(end.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, then status 1
        import traceback

        traceback.print_exc()
        status = 1
    leave(status)


def leave(status: int) -> None:
    """End the process with `status` without the interpreter's teardown (cli.entry's way out of the gdbserver role
    and `run`, and a fork's here): logging shut down and the standard streams flushed first."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _reopen_streams() -> None:
    """sys.stdin, stdout and stderr anew over fds 0, 1 and 2 (now the launcher's), buffered as Python buffers
    them at start: stdout by line on a terminal, stderr by line always."""
    import io

    encoding, errors = sys.stdout.encoding, sys.stdout.errors
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=encoding,
                                 errors=errors)
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding=encoding,
                                  errors=errors, line_buffering=os.isatty(1))
    sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding=encoding,
                                  errors="backslashreplace", line_buffering=True)


def serve(path: str, ready=None) -> int:
    """`kgtp-sim warm`: preload, listen on `path`, and fork a gdbserver for each launch, until SIGTERM or SIGINT.
    `ready(path)` is called once it listens."""
    import selectors
    import threading

    listener = bind(path)  # before the preload: a place that cannot be used is said at once
    preload()
    if threading.active_count() != 1:  # see the module's text: a fork would copy a half-held lock
        raise WarmError("a preloaded module started a thread; a warm server must stay single-threaded")
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    os.set_blocking(wake_read, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD wakes the selector
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    launches = refused = 0
    if ready is not None:
        ready(path)
    try:
        while not stop:
            for key, _events in selector.select():
                if key.fileobj is listener:
                    try:
                        conn, _ = listener.accept()
                    except OSError:
                        continue
                    try:
                        request, fds = _receive(conn)
                    except ValueError as error:
                        refused += 1
                        print(f"kgtp-sim warm: refused {error}", file=sys.stderr, flush=True)
                        conn.close()
                        continue
                    sys.stdout.flush()
                    sys.stderr.flush()
                    pid = os.fork()
                    if pid == 0:
                        inherited = [listener.fileno(), wake_read, wake_write, selector.fileno(),
                                     *(other.fileno() for other in children.values())]
                        _child(conn, request, fds, inherited)
                    for fd in fds:
                        os.close(fd)
                    launches += 1
                    children[pid] = conn
                    try:
                        conn.sendall(b"p" + struct.pack("!I", pid))
                    except OSError:
                        pass
                else:
                    try:
                        while os.read(wake_read, 256):
                            pass
                    except BlockingIOError:
                        pass
            _reap(children)
    finally:
        listener.close()
        try:
            os.unlink(path)
        except OSError:
            pass
        print(f"kgtp-sim warm: {launches} launches, {refused} refused", file=sys.stderr, flush=True)
    return 0


def _reap(children: dict[int, socket.socket]) -> None:
    """Every child that ended: its status to its launcher, the connection closed."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        try:
            conn.sendall(b"s" + struct.pack("!i", status))
        except OSError:
            pass
        conn.close()
