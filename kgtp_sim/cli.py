"""Command line: `kgtp-sim serve` starts the kernel and the stub; GDB attaches with `target remote`.

The other commands read what the stub traced (follow, record, export, plot), sample it (hotcode) or measure it (bench);
each subcommand's --help ends with examples. Runs in the main thread.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from .optional import MissingDependency

#: CPUs of `kgtp-sim serve` unless --cpus says otherwise.
DEFAULT_CPUS = 2
#: The most CPUs the machine has (kgtp_sim.machine.smp.MAX_CPUS; not imported here, so --help stays light).
MAX_CPUS = 8


#: `kgtp-sim --help`: what it is, then a first session from start to end (help text is kept to 80 columns).
_DESCRIPTION = "A GDB remote stub emulating KGTP's tracepoints over a simulated x86_64 kernel."
_FIRST_STEPS = """\
a first session:
  kgtp-sim serve                    # or scripts/serve (sets up .venv first)
  gdb fixtures/vmlinux -ex 'target remote :1234'  # trace, tstart, tsave run.tf
  kgtp-sim follow                   # meanwhile: each frame as it is committed
  kgtp-sim plot run.tf -o pics      # afterwards: timeline, values, flame graph
"""

_SERVE_EXAMPLES = f"""\
examples:
  kgtp-sim serve                    # GDB on :1234, followers on :1235, {DEFAULT_CPUS} CPUs
  gdb fixtures/vmlinux -ex 'target remote :1234'
  kgtp-sim serve --cpus 4 --save-dir /tmp/traces
  gdb fixtures/vmlinux -ex 'target remote | kgtp-sim serve --stdio'
"""


class _CommandsFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's, with the help column past the longest command name as it is printed (argparse measures the
    names without the indent it then prints them with, so the longest one's help goes to the next line)."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction):
            widest = max((len(name) for name in action.choices), default=0)
            self._action_max_length = max(self._action_max_length, widest + self._current_indent + 2 * self._indent_increment)


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """`kgtp-sim`'s parser; with `command` "run", that command's alone: `kgtp-sim run` starts a program, and the
    other commands' modules (the server, the viewers, the benchmark) would only add their import time to it."""
    parser = argparse.ArgumentParser(prog="kgtp-sim", description=_DESCRIPTION, epilog=_FIRST_STEPS,
                                     formatter_class=_CommandsFormatter)
    commands = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    from .client import paths  # here, as the subcommands' modules are: importing kgtp_sim.cli stays light

    if command != "run":
        _add_serve_parser(commands, paths.VMLINUX)
    from . import programs

    programs.add_run_parser(commands, paths.VMLINUX, DEFAULT_CPUS)
    if command != "run":
        commands.add_parser("gdbserver", help="debug a program on the kernel, as gdbserver",
                            description="kgtp-sim gdbserver [--once] [--multi] COMM PROG [ARGS...]: see "
                                        "`kgtp-sim gdbserver --help`", add_help=False)
        warm = commands.add_parser(
            "warm", help="keep the gdbserver role loaded, for faster starts",
            description="Load the gdbserver role's modules once and listen on a Unix socket:\n"
                        "`kgtp-sim gdbserver` run with KGTP_SIM_WARM=SOCKET in its environment is\n"
                        "then a fork of this process (the same command line, directory,\n"
                        "environment, streams and exit status, some 0.25 s sooner). Ends on\n"
                        "SIGTERM or Ctrl-C.",
            epilog="examples:\n  kgtp-sim warm &\n  export KGTP_SIM_WARM=$(kgtp-sim warm --print-socket)\n"
                   "  kgtp-sim gdbserver :2345 ./prog",
            formatter_class=argparse.RawDescriptionHelpFormatter)
        warm.add_argument("--socket", default=None,
                          help="the socket's path (default: $XDG_RUNTIME_DIR/kgtp-sim/warm.sock, else "
                               "/tmp/kgtp-sim-UID/warm.sock; its directory must be the user's alone)")
        warm.add_argument("--print-socket", action="store_true", help="print the socket's path and exit")
        from .view import cli as view_cli

        view_cli.add_parsers(commands)
        from .bench import cli as bench_cli

        bench_cli.add_parser(commands)
    return parser


def _add_serve_parser(commands, vmlinux: Path) -> None:
    serve = commands.add_parser("serve", help="start the simulated kernel and the GDB stub",
                                description="Start the simulated kernel; serve one GDB at a time on the RSP port\n"
                                "and any number of followers on the follow channel beside it.",
                                epilog=_SERVE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--kernel", type=Path, default=vmlinux, help="static x86_64 kernel ELF (default: bundled)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=1234, help="TCP port (default: 1234; 0 picks a free one)")
    serve.add_argument(
        "--allow-remote", action="store_true", help="allow listening on a non-loopback address (a security risk)"
    )
    serve.add_argument("--allow-writes", action="store_true", help="let GDB write kernel memory (M/X packets)")
    serve.add_argument("--hz", type=int, default=100, help="timer tick rate of the kernel (default: 100)")
    serve.add_argument("--cpus", type=int, default=DEFAULT_CPUS,
                       help=f"CPUs of the simulated machine, 1 to 8; GDB sees each as a thread (default: {DEFAULT_CPUS})")
    serve.add_argument("--pace", type=int, default=None, help="kgtp_test_function calls per tick")
    serve.add_argument("--engine", choices=("interp", "naive", "opt"), default="opt",
                       help="how conditions and actions run: interpreted, naive native or optimized native (default)")
    serve.add_argument("--save-dir", type=Path, default=None,
                       help="directory where `tsave -r` may write trace files (default: target-side saving refused)")
    serve.add_argument("--name-markers-at-strace", action="store_true",
                       help="diagnostic: name the marker when `strace` asks (triggers GDB 13-18's crash; see README)")
    serve.add_argument("--follow-port", type=int, default=None,
                       help="port of the read-only follow channel (default: the RSP port + 1, or a free one with "
                            "--port 0; -1 disables it)")
    serve.add_argument("--stdio", action="store_true",
                       help="serve one debugger on stdin/stdout instead of TCP: gdb -ex 'target remote | kgtp-sim "
                            "serve --stdio' (messages go to stderr; the follow channel only with --follow-port)")
    serve.add_argument("--run", action="append", default=[], metavar="'PROG ARGS'",
                       help="run a static x86_64 Linux program as a process once the kernel runs (split as a shell "
                            "would; repeatable); its output goes to stdout (stderr with --stdio)")
    serve.add_argument("--with", dest="with_programs", action="append", default=[], metavar="PROG",
                       help="pack a program into the machine without starting it, for `monitor run PROG ARGS` "
                            "(repeatable)")
    serve.add_argument("-v", "--verbose", action="count", default=0, help="log more (repeat for packet traces)")


#: commands that end the process without the interpreter's teardown (`entry`)
_QUICK_EXIT = ("gdbserver", "run")


def entry(warm: bool = True) -> None:
    """The `kgtp-sim` command as a process (`python -m kgtp_sim`, the installed script): `main`, then its exit.
    `kgtp-sim gdbserver` with KGTP_SIM_WARM set is first offered to that warm server (warm.py; `warm` False: this
    is that server's fork).
    The gdbserver role and `run` leave without the interpreter's teardown once their work is done (their machine
    shut down, the streams flushed here, the files they write closed before they return): freeing the emulator
    and every object one by one took 0.15 to 0.25 s after the last reply, and GDB's testsuite waits for a
    server's end at each of its hundreds of restarts."""
    if warm:
        from .launch import offer

        offer(sys.argv[1:])  # returns only where it is no warm start
    status = main()
    if sys.argv[1:2] and sys.argv[1] in _QUICK_EXIT:
        from .warm import leave

        leave(status)
    sys.exit(status)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gdbserver"]:  # gdbserver's own command line (`--wrapper ... --`), not argparse's
        from . import gdbserver

        return gdbserver.main(argv[1:])
    args = _parser("run" if argv[:1] == ["run"] else None).parse_args(argv)
    logging.basicConfig(
        level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(getattr(args, "verbose", 0), 2)],
        format="kgtp-sim: %(levelname)s %(name)s: %(message)s",
    )
    try:
        return _run(args)
    except MissingDependency as error:  # an optional package: one line saying what to install, no traceback
        print(f"kgtp-sim: {error}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.command == "serve":
        return serve(args)
    if args.command == "run":
        from . import programs

        return programs.run(args)
    if args.command == "warm":
        from . import warm

        path = args.socket or warm.default_socket()
        if args.print_socket:
            print(path)
            return 0
        try:
            return warm.serve(path, ready=lambda where: print(f"Warm on {where}", file=sys.stderr, flush=True))
        except warm.WarmError as error:
            print(f"kgtp-sim warm: {error}", file=sys.stderr)
            return 1
    if args.command == "bench":
        from .bench import cli as bench_cli

        return bench_cli.run(args)
    from .view import cli as view_cli

    if args.command in view_cli.COMMANDS:
        return view_cli.run(args)
    return 2


def _take_stdout() -> int:
    """For --stdio: the packets' own copy of stdout; from now on anything printed (ours, a library's, C code's)
    goes to stderr, so the pipe carries nothing but packets."""
    sys.stdout.flush()
    packets = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return packets


def _machine(args: argparse.Namespace, image):
    from .machine import Machine

    return Machine(image, hz=args.hz, cpus=args.cpus, **({"pace": args.pace} if args.pace is not None else {}))


def _programs(args: argparse.Namespace, machine, stdout_fd: int):
    """`--run` and `--with`: the programs packed into the machine's initramfs before boot; start() runs the --run
    ones once it runs; the launcher starts any of them later (`monitor run`)."""
    from . import programs

    wanted = [programs.Program.parse(command) for command in args.run]
    packed = wanted + [programs.Program(Path(path), (path,)) for path in getattr(args, "with_programs", [])]
    inside = programs.load_programs(machine, packed) if packed else {}
    programs.relay_output(machine, stdout_fd, 2)
    return (lambda: programs.start_programs(machine, wanted, inside)), programs.Launcher(machine, inside)


def serve(args: argparse.Namespace) -> int:
    from .app import Stub, StubConfig
    from .machine import KernelImage, KernelImageError
    from .rsp.server import is_loopback

    if not 1 <= args.cpus <= MAX_CPUS:
        print(f"kgtp-sim: --cpus must be between 1 and {MAX_CPUS}", file=sys.stderr)
        return 2
    pipe = _take_stdout() if getattr(args, "stdio", False) else None
    if pipe is not None:
        return _serve_stdio(args, pipe)

    if not is_loopback(args.host):
        if not args.allow_remote:
            print(
                f"kgtp-sim: refusing to listen on non-loopback address {args.host}: "
                "anyone who can connect controls the kernel; pass --allow-remote to do it anyway",
                file=sys.stderr,
            )
            return 2
        print(f"kgtp-sim: WARNING: listening on {args.host}: any host that reaches it controls the kernel", file=sys.stderr)
    try:
        image = KernelImage.load(args.kernel)
    except KernelImageError as error:
        print(f"kgtp-sim: {error}", file=sys.stderr)
        return 1
    if not 1 <= args.hz <= 10000:
        print("kgtp-sim: --hz must be between 1 and 10000", file=sys.stderr)
        return 2
    machine = _machine(args, image)
    try:
        start_programs, launcher = _programs(args, machine, 1)
    except (OSError, ValueError) as error:
        print(f"kgtp-sim: --run: {error}", file=sys.stderr)
        return 1
    stub = Stub(machine, StubConfig(allow_writes=args.allow_writes, engine=args.engine, save_dir=args.save_dir,
                                           name_markers_always=args.name_markers_at_strace, launch=launcher))
    server = stub.server(args.host, args.port)
    try:
        host, port = server.bind()
    except OSError as error:
        print(f"kgtp-sim: cannot listen on {args.host}:{args.port}: {error.strerror or error}", file=sys.stderr)
        return 1
    follow = None
    follow_port = args.follow_port if args.follow_port is not None else (port + 1 if args.port else 0)
    if follow_port >= 0:
        follow = stub.follow_server(host, follow_port)
        try:
            follow.bind()
        except OSError as error:
            print(f"kgtp-sim: cannot listen on {host}:{follow_port} for followers: {error.strerror or error}",
                  file=sys.stderr)
            if args.follow_port is not None:  # asked for by the user: a failure, not a missing extra
                return 1
            follow = None
        if follow is not None:
            follow.start()
            print(f"kgtp-sim: follow channel (read-only) on {host}:{follow.port}: "
                  f"kgtp-sim follow --port {follow.port}", flush=True)
    machine.start()
    start_programs()
    print(f"kgtp-sim: kernel {args.kernel} running; listening on {host}:{port}", flush=True)
    print(f"kgtp-sim: attach with: gdb {args.kernel} -ex 'target remote {host}:{port}'", flush=True)

    stop = threading.Event()

    def request_stop(signum: int, frame: object) -> None:
        stop.set()
        server.shutdown()

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    # `kill -USR1 PID` prints every thread's stack to stderr: where a stub that stopped answering is stuck
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        server.serve_forever()
    finally:
        if follow is not None:
            follow.shutdown()
        machine.shutdown()
    return 0


def _serve_stdio(args: argparse.Namespace, pipe: int) -> int:
    """`target remote | kgtp-sim serve --stdio`: the kernel runs while GDB holds the pipe; end of file ends it."""
    from .app import Stub, StubConfig
    from .machine import KernelImage, KernelImageError

    try:
        image = KernelImage.load(args.kernel)
    except KernelImageError as error:
        print(f"kgtp-sim: {error}", file=sys.stderr)
        return 1
    machine = _machine(args, image)
    try:
        start_programs, launcher = _programs(args, machine, 2)  # stdout is GDB's pipe
    except (OSError, ValueError) as error:
        print(f"kgtp-sim: --run: {error}", file=sys.stderr)
        return 1
    stub = Stub(machine, StubConfig(allow_writes=args.allow_writes, engine=args.engine, save_dir=args.save_dir,
                                    name_markers_always=args.name_markers_at_strace, launch=launcher))
    server = stub.server(args.host, 0)
    follow = None
    if args.follow_port is not None and args.follow_port >= 0:
        follow = stub.follow_server(args.host, args.follow_port)
        follow.bind()
        follow.start()
        print(f"kgtp-sim: follow channel (read-only) on {args.host}:{follow.port}", file=sys.stderr, flush=True)
    machine.start()
    start_programs()
    print(f"kgtp-sim: kernel {args.kernel} running; serving the debugger on stdin/stdout", file=sys.stderr,
          flush=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # GDB sends Ctrl-C in the packet stream; the terminal's is not ours
    signal.signal(signal.SIGTERM, lambda signum, frame: server.shutdown())
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        server.serve_pipe(0, pipe)
    finally:
        if follow is not None:
            follow.shutdown()
        machine.shutdown()
    return 0
