"""The gdbserver role: `kgtp-sim gdbserver [OPTIONS] COMM PROG [ARGS...]` (or `--multi COMM`, `--attach COMM PID`),
a drop-in for gdbserver whose program runs as a process on the simulated kernel.

Wiring, as app.py is KGTP mode's: the machine boots with the program in its initramfs, the program is started
traced and stopped at its first instruction (stub/process.py's target over the kernel's ptrace), and GDB is served
on COMM. The command line and the lines printed are gdbserver's (gdbserver/server.cc: captured_main), because GDB's
testsuite and users' scripts read them: `Process PROG created; pid = N`, `Listening on port N`, `Remote debugging
from host H, port P`, `Can't bind address: Address already in use.` (then exit 1, the port bound before anything
starts), `Child exited with status N`. The program's streams are relayed on this command's own stdout and stderr,
and this command's standard input is the program's (unless packets come on it), as gdbserver's inferior shares its
terminal. Besides gdbserver's packets, the session has KGTP mode's tracing: tracepoints in the program (its own
memory) and in the kernel under it, with `$inferior_pid` the program; its trace buffer and `$trace_timestamp` are
gdbserver's (one buffer of the size GDB sets, its predefined clock variable: the tracer's `gdbserver` flavour), and
so are GDB's variable numbers: KGTP's special variables exist once declared by name (`tvariable $cpu_id`), or all
of them, uploaded, with `--kgtp-variables` (stub/variables.py).
Its environment is this
command's, less the largest variables when the kernel's spawn request cannot hold them all (`fit_environment`: the
variables left out are named on stderr).

Options: `--once` (serve one connection, then exit), `--multi` (start without PROG: the machine boots with no
process, and GDB's `target extended-remote` runs one with vRun: stub/extended.py), `--attach` (COMM then the pid of
a process already on the machine: only useful with a kernel that starts one itself; vAttach is the usual way),
`--wrapper WRAPPER... --` (accepted, not run: the machine has no shell and starts the program directly, as
`--no-startup-with-shell`), `--debug`/`--remote-debug`/`--debug-format=...` (more logging), and ours: `--cpus`,
`--kernel`, `--hz`, `--engine`, `--kgtp-variables`, `--with FILE` (repeatable: a host file packed too, such as a library the program only
dlopen()s, which gdbserver's program would find on the host: programs.named_files; found inside by its path;
`$ORIGIN/NAME` is NAME beside the program, NAME maybe a pattern; a file named that is not there is an error before
boot, one beside a program GDB runs fails that vRun). COMM is `[HOST]:PORT` (loopback unless HOST says otherwise) or
`stdio`/`-` (GDB's `target remote | kgtp-sim gdbserver - PROG`).

A program named on the command line goes into the initramfs before boot; one GDB runs later (vRun, `run` in
extended-remote: a host path, as gdbserver takes it) is added to the running machine's initramfs with what its
dynamic linker opens (programs.install_program) and the `--with` files, nothing else of the host. Without `--once`
the server keeps serving new connections while the process lives, as gdbserver reopens its connection; once GDB sent
`!` (extended-remote) it serves on when the process ended, was killed or detached, as gdbserver's extended_protocol;
else it ends when the process ended or was detached and GDB left. `monitor exit` ends it (it hangs up once its reply
is out, as gdbserver's does).

Threads: the main thread parses, boots, serves (accepts) and waits; each connection is served on its own thread
(rsp/server.py); the program's output is written from the CPU thread, its input fed by a daemon thread; the main
thread ends the server if the machine crashes.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .rsp.session import Session
    from .stub.variables import VariableNumbers

USAGE = """\
usage: kgtp-sim gdbserver [OPTIONS] COMM PROG [ARGS ...]
       kgtp-sim gdbserver [OPTIONS] --multi COMM
       kgtp-sim gdbserver [OPTIONS] --attach COMM PID

COMM is [HOST]:PORT (HOST: loopback unless given) or stdio (or -: packets on
stdin and stdout). PROG is a static or dynamic x86_64 Linux program; it runs
as a process on the simulated kernel, stopped at its first instruction until
GDB resumes it.

Options (gdbserver's):
  --once                exit after the first connection closes
  --multi               start without PROG; GDB runs one (target
                        extended-remote, run); the server stays up after it
  --attach              debug the running process PID of the machine
  --wrapper WRAPPER --  accepted and not run: the machine starts PROG directly
  --debug, --remote-debug, --debug-format=...   log more
Options (the machine's):
  --cpus N              CPUs of the simulated machine (default 2)
  --kernel FILE         the kernel ELF (default: the bundled fixtures/vmlinux)
  --hz N                the kernel's timer rate (default 100)
  --engine E            how tracepoint conditions and actions run: interp,
                        naive or opt (default)
  --with FILE           pack FILE into the machine too (repeatable): a library
                        PROG only dlopen()s, a file it opens; inside at its
                        path (and, named relative, at that path from /, the
                        working directory inside). '$ORIGIN/NAME' is NAME beside
                        PROG (and each program GDB runs), where a RUNPATH of
                        $ORIGIN finds it; NAME may be a pattern: '$ORIGIN/*.so'.
                        Nothing else of the host is reachable from inside.
  --kgtp-variables      upload KGTP's special trace state variables ($cpu_id,
                        $current_task_pid, ...) at connection; without it GDB
                        sees gdbserver's $trace_timestamp, and a KGTP variable
                        exists once declared by name: tvariable $cpu_id

examples:
  gcc -g -o prog prog.c
  kgtp-sim gdbserver :2345 ./prog arg1   # gdb ./prog -ex 'target remote :2345'
  kgtp-sim gdbserver --once --cpus 1 localhost:2345 ./prog
  kgtp-sim gdbserver --with ./libplugin.so :2345 ./prog  # prog dlopen()s it
  gdb ./prog -ex 'target remote | kgtp-sim gdbserver - ./prog'
  kgtp-sim gdbserver --multi :2345       # then in GDB: target extended-remote
                                         # :2345, set remote exec-file prog, run
"""


#: Events gdbserver announces on Linux (server.cc: handle_query's qSupported), reported as it reports them when GDB
#: asks for them too (`T05fork:`, `vfork:`, `vforkdone:`, `exec:`: stub/process.py, stub/extended.py).
EVENTS = ("fork-events+", "vfork-events+", "exec-events+")


class UsageError(Exception):
    pass


@dataclass
class Options:
    comm: str = ""
    program: list[str] = field(default_factory=list)
    once: bool = False
    multi: bool = False
    attach: int | None = None  #: --attach PID
    debug: int = 0
    wrapper: list[str] = field(default_factory=list)
    cpus: int = 2
    kernel: Path | None = None
    hz: int = 100
    engine: str = "opt"
    with_files: list[str] = field(default_factory=list)  #: --with FILE, in order
    kgtp_variables: bool = False  #: --kgtp-variables: KGTP's special variables uploaded, KGTP mode's numbering


def parse(argv: list[str]) -> Options:
    """gdbserver's command line (server.cc: captured_main's option loop): options first, then COMM, then PROG."""
    options = Options()
    args = list(argv)
    while args and args[0].startswith("--"):
        option = args.pop(0)
        name, eq, value = option.partition("=")
        if option == "--":
            break
        if name == "--once":
            options.once = True
        elif name == "--kgtp-variables":
            options.kgtp_variables = True
        elif name == "--multi":
            options.multi = True
        elif name in ("--debug", "--remote-debug", "--event-loop-debug") or name == "--debug-format":
            options.debug += 1
        elif name in ("--no-startup-with-shell", "--startup-with-shell", "--disable-randomization",
                      "--no-disable-randomization", "--disable-packet"):
            pass  # the machine never uses a shell, and has no address randomization to turn off
        elif name == "--wrapper":
            while args and args[0] != "--":
                options.wrapper.append(args.pop(0))
            if not args:
                raise UsageError("--wrapper needs its arguments ended by --")
            args.pop(0)
        elif name in ("--cpus", "--kernel", "--hz", "--engine", "--with"):
            if not eq:
                if not args:
                    raise UsageError(f"{name} needs a value")
                value = args.pop(0)
            if name == "--with":
                if not value:
                    raise UsageError("--with needs a file")
                options.with_files.append(value)
            elif name == "--kernel":
                options.kernel = Path(value)
            elif name == "--engine":
                if value not in ("interp", "naive", "opt"):
                    raise UsageError("--engine is interp, naive or opt")
                options.engine = value
            else:
                try:
                    setattr(options, name[2:], int(value))
                except ValueError:
                    raise UsageError(f"{name} needs a number, not {value!r}") from None
        elif name == "--attach":
            options.attach = 0
        elif name in ("--help", "--version"):
            raise UsageError("")
        else:
            raise UsageError(f"unknown option {option}")
    if not args:
        raise UsageError("no COMM given")
    options.comm = args.pop(0)
    if args and args[0] == "--attach":  # gdbserver's older spelling: --attach after COMM
        options.attach = 0
        args.pop(0)
    if options.attach is not None:
        if len(args) != 1 or not args[0].isdigit() or not int(args[0]):
            raise UsageError("--attach takes COMM and one PID")
        options.attach = int(args[0])
        args = []
    options.program = args
    if not options.program and options.attach is None and not options.multi:
        raise UsageError("no program to run (PROG): nothing to debug (or --multi, or --attach PID)")
    if not 1 <= options.cpus <= 8:
        raise UsageError("--cpus must be between 1 and 8")
    return options


def fit_environment(path: str, argv: list[str], envp: list[str], budget: int) -> tuple[list[str], list[str]]:
    """The environment the kernel can take beside the program's path and arguments (its spawn request holds
    `budget` bytes of NUL-terminated strings, where Linux's exec takes megabytes): the largest variables are left
    out until the rest fits, the others keep their order. Returns (the environment passed, the names left out).
    gdbserver passes its whole environment; a make's (MAKEFLAGS, RUNTESTFLAGS naming every test file) or a
    terminal's (LS_COLORS) alone can outgrow the kernel's page."""
    sizes = [len(variable.encode()) + 1 for variable in envp]
    total = sum(len(s.encode()) + 1 for s in (path, *argv)) + sum(sizes)
    left_out: set[int] = set()
    for index in sorted(range(len(envp)), key=lambda i: -sizes[i]):
        if total <= budget:
            break
        left_out.add(index)
        total -= sizes[index]
    kept = [variable for i, variable in enumerate(envp) if i not in left_out]
    return kept, [envp[i].partition("=")[0] for i in sorted(left_out)]


def parse_comm(comm: str) -> tuple[str, int] | None:
    """`[HOST]:PORT` -> (host, port); None for stdio."""
    if comm in ("stdio", "-"):
        return None
    host, colon, port = comm.rpartition(":")
    if not colon or not port.isdigit():
        raise UsageError(f"COMM must be [HOST]:PORT or stdio, not {comm!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return (host or "127.0.0.1", int(port))


class Server:
    """One gdbserver: the machine, the traced program, the handlers, the transport."""

    def __init__(self, options: Options) -> None:
        from .client import paths
        from .machine import KernelImage, Machine
        from .programs import Program, load_programs, relay_input, relay_output

        self.options = options
        kernel = options.kernel or paths.VMLINUX
        # a warm start's machine was built by the warm server before it forked this one (warm.py)
        self.machine = Machine.prepared(kernel, hz=options.hz, cpus=options.cpus) or \
            Machine(KernelImage.load(kernel), hz=options.hz, cpus=options.cpus)
        self.program: Program | None = None
        self.inside = ""
        if options.program:
            self.program = Program(Path(options.program[0]), tuple(options.program))
        if self.program is not None or options.with_files:  # the --with files named plainly are checked here
            packed = [self.program] if self.program is not None else []
            inside = load_programs(self.machine, packed, options.with_files)
            self.inside = inside[self.program.path] if self.program is not None else ""
        relay_output(self.machine)
        if options.comm not in ("stdio", "-"):  # the program reads this server's standard input, as gdbserver's does
            relay_input(self.machine)
        self.done = threading.Event()
        self.exit_requested = False
        self.port: int | None = None  #: the TCP port served (None: a pipe)
        self.session: Session | None = None  #: the connection's session (one at a time), which `monitor exit` closes

    def _environment(self, inside: str, argv: list[str]) -> list[str]:
        """This command's environment, less what the kernel's spawn request cannot hold (named on stderr)."""
        from .machine.process import SPAWN_ARGS_SIZE
        from .programs import environment

        kept, left_out = fit_environment(inside, argv, environment(), SPAWN_ARGS_SIZE)
        if left_out:
            print(f"kgtp-sim gdbserver: the kernel takes {SPAWN_ARGS_SIZE} bytes of arguments and environment; "
                  f"not passed to the program: {', '.join(left_out)}", file=sys.stderr, flush=True)
        return kept

    def _run(self, program: str, args: list[str]):
        """vRun's program (a host path, as gdbserver's): into the running machine's initramfs, then started traced
        (Inferior's `start`)."""
        from .programs import install_program

        inside = install_program(self.machine, Path(program), self.options.with_files)
        argv = [program, *args]
        return self.machine.ptrace.spawn(inside, argv, self._environment(inside, argv)), inside

    def start(self) -> None:
        from .arch import amd64
        from .machine.procfs import ProcFiles
        from .machine.ramfs import Ramfs
        from .rsp.dispatch import Dispatcher
        from .stub.core import TargetHandlers
        from .stub.monitor import Monitor
        from .stub.extended import ExtendedHandlers, Inferior, OsdataHandlers
        from .stub.hostio import HostIOHandlers
        from .stub.process import ProcessTarget
        from .stub.program import ProcessHandlers
        from .stub.trace import TraceHandlers, register_trace_commands
        from .tracing import Tracer

        self.machine.start()
        self.target = Inferior(self.machine, start=self._run, say=_say)
        if self.program is not None:
            argv = list(self.program.argv)
            tracee = self.machine.ptrace.spawn(self.inside, argv, self._environment(self.inside, argv))
            self.target.program = (argv[0], tuple(argv[1:]))
            self.target.adopt(ProcessTarget(tracee, self.inside, overlay=self.target.overlay))
        elif self.options.attach is not None:
            self.target.attach(self.options.attach)
        self.machine.processes.exit_listeners.append(self._ended)
        self.handlers = TargetHandlers(self.target)
        monitor = Monitor()

        @monitor.register("exit", "exit", "end this gdbserver (and its program) once GDB has its reply")
        def _exit(words: list[str]) -> str:
            """gdbserver's `monitor exit` (server.cc: handle_monitor_command sets exit_requested, and the serial
            loop ends after the reply): the connection closes once the reply is out, without waiting for GDB to
            leave; GDB's testsuite waits for the server's end of file after it (gdbserver_exit)."""
            self.exit_requested = True
            if self.session is not None:
                self.session.closing = True
            return ""

        # tracepoints, in the kernel under the program: KGTP's engines on the same machine, frames laid over the
        # process when GDB selects one; tracepoints in the program go into its own memory; the buffer and
        # `$trace_timestamp` as gdbserver has them
        self.tracer = Tracer(self.machine, self.options.engine, gdbserver=True)
        self.target.before_detach = self._before_detach
        self.target.listeners.append(self._process_changed)
        if self.target.process is not None:
            self._process_changed(self.target.process)
        register_trace_commands(monitor, self.tracer)
        self.trace = TraceHandlers(self.tracer, self.target.overlay, layout=amd64.LINUX,
                                   numbers=None if self.options.kgtp_variables else gdbserver_numbers(self.tracer))
        process = ProcessHandlers(self.target, self.handlers.threads)
        self.extended = ExtendedHandlers(self.target, self.handlers.threads, extended=False)
        # vFile: the machine's files and its processes' /proc, never the host's
        self.hostio = HostIOHandlers(Ramfs(self.machine), ProcFiles(self.machine))
        self.dispatcher = Dispatcher((*self.handlers.families, process, self.extended, OsdataHandlers(self.machine),
                                      self.trace, monitor, self.hostio),
                                     extra_features=("swbreak+", "hwbreak+", "multiprocess+", *EVENTS),
                                     on_supported=self.handlers.supported)

    def _before_detach(self) -> bool:
        """gdbserver's handle_detach: a trace run under disconnected tracing keeps the process GDB detaches; any
        other run stops, as by a `tstop` (GDB is still connected), its frames kept."""
        if not self.tracer.running:
            return False
        if self.tracer.definitions.disconnected_tracing:
            return True
        from .rsp.packets.trace import StopReason

        self.tracer.stop(StopReason.STOP_COMMAND, note=self.tracer.definitions.stop_note or "")
        return False

    def _process_changed(self, process) -> None:
        """The process GDB debugs changed (vRun, vAttach, its end): KGTP's $inferior_pid and the tracer's user
        space follow it."""
        from .machine.ramfs import Ramfs
        from .stub.program import ProgramSpace, program_sdt_markers

        if process is not None:
            files = Ramfs(self.machine)
            self.tracer.user_space = ProgramSpace(process.leader,
                                                  markers=lambda: program_sdt_markers(process, files))
            self.tracer.inferior_pid = process.pid

    def _ended(self, pid: int) -> None:
        """A process GDB debugs ended (CPU thread): gdbserver's line on its own terminal, for each one it waits for
        (target.cc: mywait)."""
        if pid == self.target.process_id() or pid in self.target.processes:
            status = self.machine.processes.exited()[pid]
            if status & 0x7F:  # server.cc names it as gdb_signal_to_name does
                number = status & 0x7F
                try:
                    name = signal.Signals(number).name
                except ValueError:
                    name = f"signal {number}"
                print(f"\nChild terminated with signal = 0x{number:x} ({name})", file=sys.stderr, flush=True)
            else:
                print(f"\nChild exited with status {status >> 8 & 0xFF}", file=sys.stderr, flush=True)

    def make_session(self):
        from .rsp.session import Session

        self.session = Session(self.dispatcher, ends_session=self._ends_session, **self.handlers.session_hooks())
        return self.session

    def _ends_session(self, payload: bytes, reply) -> bool:
        """Outside extended mode a kill or detach ends the session, as gdbserver then exits; in it GDB stays."""
        from .rsp.session import ends_with_the_process

        return not self.extended.extended and ends_with_the_process(payload, reply)

    def on_connect(self, peer: tuple | None = None) -> None:
        """gdbserver's line for each connection (server.cc: remote_open's `Remote debugging from host`)."""
        if peer is not None:
            print(f"Remote debugging from host {peer[0]}, port {peer[1]}", file=sys.stderr, flush=True)
        self.handlers.forget_session()
        self.trace.forget_session()
        self.hostio.forget_session()

    def on_disconnect(self) -> None:
        """gdbserver's choice when GDB leaves: keep serving while the program lives and is traced (unless --once),
        else end; a program still traced when this server ends is killed, as gdbserver's is. Tracing stops unless
        disconnected tracing was asked for."""
        self.trace.forget_session()
        if self.tracer.running and not self.tracer.definitions.disconnected_tracing:
            from .rsp.packets.trace import StopReason

            self.tracer.stop(StopReason.DISCONNECTED)
        process = self.target.live()
        # gdbserver: !extended_protocol && !target_running (a process kept at a detach is running)
        gone = process is None and self.target.kept is None and not self.extended.extended
        if self.options.once or self.exit_requested or gone:
            if process is not None and not process.attached():
                process.kill()
            elif process is not None:
                process.detach()
            self.done.set()
        elif self.port is not None:  # gdbserver's words when it serves the program to the next GDB
            print("Remote side has terminated connection.  GDBserver will reopen the connection.", file=sys.stderr)
            print(f"Listening on port {self.port}", file=sys.stderr, flush=True)

    def shutdown(self) -> None:
        self.machine.shutdown()


def gdbserver_numbers(tracer) -> VariableNumbers:
    """GDB's variable numbers as gdbserver gives them (stub/variables.py): `$trace_timestamp` is 1, uploaded; the
    tracer's other variables (KGTP's) only when declared by name; the user's above every number of the tracer."""
    from .stub.variables import VariableNumbers
    from .tracing.core.predefined import TRACE_TIMESTAMP

    own = {v.name: v.number for v in tracer.definitions.variables.values() if v.builtin}
    return VariableNumbers(own, {TRACE_TIMESTAMP: 1}, max(own.values(), default=0) + 1)


def _say(line: str) -> None:
    """gdbserver's lines about its processes, on its stderr."""
    print(line, file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    from .rsp.server import RspServer

    try:
        options = parse(argv)
        address = parse_comm(options.comm)
    except UsageError as error:
        if not str(error):  # --help
            print(USAGE, end="")
            return 0
        print(f"kgtp-sim gdbserver: {error}", file=sys.stderr)
        print(USAGE, file=sys.stderr, end="")
        return 2
    logging.basicConfig(level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(options.debug, 2)],
                        format="kgtp-sim: %(levelname)s %(name)s: %(message)s")
    holder: list[Server] = []  # the server, made once the port is bound (gdbserver binds before it starts PROG)
    rsp = RspServer(lambda: holder[0].make_session(), *(address or ("127.0.0.1", 0)),
                    on_connect=lambda: holder[0].on_connect(rsp.peer), on_disconnect=lambda: holder[0].on_disconnect())
    port = None
    if address is not None:
        try:
            _host, port = rsp.bind()
        except OSError as error:
            import errno

            if error.errno == errno.EADDRINUSE:
                print("Can't bind address: Address already in use.", file=sys.stderr)
            else:
                print(f"Can't bind address: {error.strerror}.", file=sys.stderr)
            print("Exiting", file=sys.stderr, flush=True)
            return 1
    try:
        server = Server(options)
    except (OSError, ValueError) as error:
        from .programs import NamedFileError

        what = "" if isinstance(error, NamedFileError) else f"{options.program[0] if options.program else ''}: "
        print(f"kgtp-sim gdbserver: {what}{getattr(error, 'strerror', None) or error}", file=sys.stderr)
        return 1
    holder.append(server)
    server.port = port
    try:
        try:
            server.start()
        except Exception as error:  # noqa: BLE001 - a program the kernel cannot start: gdbserver's message
            what = options.program[0] if options.program else f"process {options.attach}"
            print(f"kgtp-sim gdbserver: cannot start {what}: {getattr(error, 'message', None) or error}",
                  file=sys.stderr)
            return 1
        if server.program is not None:
            print(f"Process {options.program[0]} created; pid = {server.target.process_id()}", file=sys.stderr,
                  flush=True)
        server.target.notify_stops(rsp.wake)
        if address is None:
            print("Remote debugging using stdio", file=sys.stderr, flush=True)
            read_fd, write_fd = 0, os.dup(1)
            os.dup2(2, 1)
            rsp.serve_pipe(read_fd, write_fd)
            return 0
        accept = threading.Thread(target=rsp.serve_forever, name="rsp-accept", daemon=True)
        try:  # Ctrl-C (SIGINT) from the line on, which is when a caller knows the server is there, ends it cleanly
            print(f"Listening on port {port}", file=sys.stderr, flush=True)
            accept.start()
            while not server.done.wait(0.5):
                if server.machine.stats(count=False).state.startswith("crashed"):  # nothing will ever stop again
                    print(f"kgtp-sim gdbserver: the machine stopped: {server.machine.stats(count=False).state}",
                          file=sys.stderr, flush=True)
                    rsp.shutdown()
                    return 1
        except KeyboardInterrupt:
            pass
        rsp.shutdown()
        return 0
    finally:
        server.shutdown()
