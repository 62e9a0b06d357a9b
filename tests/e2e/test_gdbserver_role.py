"""`kgtp-sim gdbserver` end to end with real GDB 13.1 and 18.1, each capability as a user meets it, and the same
sessions against Debian's gdbserver (/usr/bin/gdbserver) with the same program and the same GDB: the same stops
at the same lines, the same values printed.

tests/programs/debugme.c is the program, built with -g -O0 in the link modes the kernel runs (tests/programs.py);
its lines are found by the `line:NAME` markers in its comments. The command line: gdbserver's lines on stderr,
the program's output on stdout, a port already taken, `--once`, a second connection, `monitor exit`, a server on
GDB's pipe. A debug session: break, next, step, finish with the values returned (a long, a struct, a double),
locals and globals, bt, a watchpoint on a global, hbreak, tbreak, until, advance, a memory write and a register
write (jump) the program goes on with, registers of x86-64 Linux (xmm0, orig_rax, fs_base), the exit code; a
SIGSEGV stopped and then ending the program; Ctrl-C on a looping program, which is resumed. The full session
runs on each GDB with glibc-dynamic on one and two CPUs, a short one on each GDB x link
mode x CPU count, the same sessions under Debian's gdbserver compared.

Every wait is for an event (a line a server prints, a stop GDB reports, a prompt), never a time window; each
test stops the servers it started.
"""

from __future__ import annotations

import difflib
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from kgtp_sim.client import GDB_CLIENTS, ROOT, GdbClient, GdbMi, batch_argv, command_file, kgtp_command
from kgtp_sim.client.gdb import gdb_environment

from ..programs import MODES, SOURCES, compile_program

pytestmark = pytest.mark.gdb

SOURCE = SOURCES / "debugme.c"
GDBSERVER = "/usr/bin/gdbserver"
WAIT_S = 60
#: ours, and Debian's to compare with
KINDS = ["kgtp-sim", "gdbserver"]
#: the main combination: the full session, and the comparison with gdbserver
MAIN_MODE = "glibc-dynamic"


def _lines() -> dict[str, int]:
    """`line:NAME` marker -> its line number in debugme.c."""
    found = {}
    for number, text in enumerate(SOURCE.read_text().splitlines(), 1):
        for name in re.findall(r"line:([\w-]+)", text):
            found[name] = number
    return found


LINE = _lines()


def _gdb(version: str) -> GdbClient:
    for client in GDB_CLIENTS:
        if client.version == version:
            return client
    pytest.skip(f"no GDB {version} on this host")


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """debugme built in a link mode, with its debugging information and unoptimized, so every line and local is
    there to step to and print (each mode's compiler and flags from tests/programs.py, -g -O0 last)."""
    out_dir = tmp_path_factory.mktemp("debugme")

    def build(mode: str) -> Path:
        compile_program("hello", mode, out_dir)  # skips as that does when the mode cannot be built here
        out = out_dir / f"debugme-{mode}"
        if not out.exists():
            subprocess.run([*MODES[mode], "-g", "-O0", str(SOURCE), "-o", str(out)], check=True,
                           capture_output=True)
        return out

    return build


# ---- the servers ---------------------------------------------------------------------------------------------------


class Server:
    """A gdbserver as a child process, ours (`kgtp-sim gdbserver`) or Debian's: every line it printed on stdout and
    on stderr, read by one daemon thread per stream from the start, and waited for as events."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> None:
        self.argv = argv
        # PYTHONFAULTHANDLER: ours prints every thread's stack on SIGABRT, which `wait` sends to a server that
        # does not end (what it was doing is then in the failure)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=cwd,
                                     env=dict(os.environ, PYTHONFAULTHANDLER="1", **(env or {})))
        self.out: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._changed = threading.Condition()
        self._open = 2
        for name in self.out:
            threading.Thread(target=self._drain, args=(name,), daemon=True).start()

    def _drain(self, name: str) -> None:
        for line in getattr(self.proc, name):
            with self._changed:
                self.out[name].append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._open -= 1
            self._changed.notify_all()

    def text(self, stream: str = "stderr") -> str:
        with self._changed:
            return "\n".join(self.out[stream])

    def wait_line(self, pattern: str, stream: str = "stderr", after: int = 0,
                  timeout: float = WAIT_S) -> re.Match:
        """The first line from index `after` on `stream` that matches `pattern`, once printed; fails with what the
        server printed if the stream ends without it or `timeout` seconds pass."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.out[stream][after:]:
                    if found := re.search(pattern, line):
                        return found
                if not self._open or time.monotonic() > deadline:
                    raise AssertionError(f"{' '.join(self.argv)} (exit status {self.proc.poll()}) never printed "
                                         f"{pattern!r} on {stream}:\n" + self.text() + "\n" + self.text("stdout"))
                self._changed.wait(deadline - time.monotonic())

    def listening(self) -> int:
        return int(self.wait_line(r"^Listening on port (\d+)$").group(1))

    def wait(self, timeout: float = WAIT_S) -> int:
        """The exit status, once it exited and both streams are read to their end; a server still running after
        `timeout` is aborted and the failure shows what it printed (ours: every thread's stack)."""
        try:
            status = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)
            self.proc.wait(30)
            with self._changed:
                self._changed.wait_for(lambda: not self._open, 30)
            raise AssertionError(f"{' '.join(self.argv)} did not end in {timeout:.0f} s; it printed:\n"
                                 + self.text() + "\n" + self.text("stdout")) from None
        with self._changed:
            while self._open:
                self._changed.wait(timeout)
        return status

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _command(kind: str, options: tuple[str, ...], comm: str, program: Path, args: tuple[str, ...],
             cpus: int | None) -> list[str]:
    if kind == "kgtp-sim":
        return kgtp_command("gdbserver", *options, *(("--cpus", str(cpus)) if cpus else ()), comm, str(program),
                            *args)
    if not os.access(GDBSERVER, os.X_OK):
        pytest.skip(f"no {GDBSERVER} on this host (Debian's gdbserver package)")
    return [GDBSERVER, *options, comm, str(program), *args]


@pytest.fixture
def servers():
    """Start servers: `servers(kind, program, *args, options=..., comm=..., cpus=...)` -> a Server; every one is
    stopped when the test ends."""
    started: list[Server] = []

    def start(kind: str, program: Path, *args: str, options: tuple[str, ...] = ("--once",), comm: str = ":0",
              cpus: int | None = None) -> Server:
        server = Server(_command(kind, options, comm, program, args, cpus))
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


# ---- GDB -----------------------------------------------------------------------------------------------------------


#: GDB 18.1 (the gdb-for-pwndbg wheel) asks a debuginfod server on the network for the libraries' debugging
#: information, which Debian's gdbserver lets it identify: a wait on the network, and lines about it
QUIET = ("set debuginfod enabled off",)


def run_session(gdb: GdbClient, program: Path, port: int | str, commands: list[str], timeout: float = WAIT_S) -> str:
    """GDB in batch mode on `program`, attached to the server on `port` (or `target remote PORT`'s text: `| COMMAND`
    for a server on a pipe), running `commands` from a command file; everything it printed."""
    where = f"127.0.0.1:{port}" if isinstance(port, int) else port
    # a server on a pipe boots its machine and starts the program before it reads GDB's first packet: under a
    # loaded suite that took more than GDB's 2 s remotetimeout (1 to 10 s measured), and GDB's resent qSupported
    # then read the first one's reply as its own. On a port too, a reply the loaded host delays past 2 s (a
    # library read through vFile beside a walk and the suite: load 12 on two cores) made GDB resend, and a late
    # reply then answered the next request ("Unknown remote qXfer reply: F0")
    patience = ["set remotetimeout 30"]
    lines = ["set pagination off", "set confirm off", "set width 0", *QUIET, *patience, f"target remote {where}",
             *commands]
    with command_file(lines) as script:
        gdb_process = subprocess.Popen(batch_argv(gdb, "-x", str(script), program=program), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, env=gdb_environment(), cwd=ROOT)
        try:
            return gdb_process.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            gdb_process.kill()
            raise AssertionError(f"GDB did not end its session in {timeout} s; it printed:\n"
                                 + gdb_process.communicate()[0]) from None


def debug(servers, kind: str, gdb: GdbClient, program: Path, args: tuple[str, ...], commands: list[str],
          cpus: int | None = None) -> tuple[str, Server]:
    """A server of `kind` for `program ARGS`, GDB's session on it, the server's end: GDB's output and the server."""
    server = servers(kind, program, *args, cpus=cpus)
    try:
        out = run_session(gdb, program, server.listening(), commands)
    except AssertionError as error:
        raise AssertionError(f"{error}\n---- the server printed:\n{server.text()}") from None
    assert server.wait() == 0, server.text()
    return out, server


#: what GDB prints that is not about the program: its lines about reading the program's files from the server
#: (both servers serve them, through vFile) and the inferior's name
_NOISE = re.compile(r"^(Reading .* from remote target\.\.\.|warning: File transfers from remote targets can be slow.*"
                    r"|warning: remote target does not support file transfer.*|\s*)$")


def normalized(out: str, moved: bool = False) -> list[str]:
    """GDB's output with what may differ between two correct servers made equal: addresses in the stack and the
    mmap area (the environment's size and the libraries' placement), `target:` before the libraries' paths, and
    the inferior's name (`process N`: gdbserver's multiprocess extension, which ours does not announce).

    `moved`: the program itself is loaded elsewhere, so its code addresses differ too. A static PIE (no
    PT_INTERP) is one: Linux (binfmt_elf.c, since 4.13) maps it in the mmap area below the stack, the simulated
    kernel at the base of PIE programs, 0x555555554000."""
    lines = []
    for line in out.splitlines():
        if _NOISE.match(line):
            continue
        line = re.sub(r"0x0*7ff[0-9a-f]{9}\b", "0x7ff…", line)
        if moved:
            line = re.sub(r"0x0*5555555[0-9a-f]{5}\b", "0x7ff…", line)
        line = line.replace("target:/", "/")
        line = re.sub(r"\[Inferior 1 \((process \d+|Remote target)\)", "[Inferior 1 (…)", line)
        lines.append(line)
    return lines


def _line(name: str) -> str:
    return f"{SOURCE.name}:{LINE[name]}"


# ---- debug sessions ----------------------------------------------------------------------------------------------

#: the short session: a breakpoint in main, a memory write the program goes on with (five rounds instead of four),
#: a breakpoint in add, its frames, finish with the value returned, a global and a local, the exit code
SHORT = [
    "break main", "continue", "print limit", "set var limit = 5", "break add", "continue", "bt", "finish",
    "print counter", "print i", "delete", "continue",
]

#: the full session: everything a user does in one run; the jump skips the third round's store, so the counter
#: goes 1, 3, 3, 7, 12 and the total is 26 (`test_the_full_session` has the values)
FULL = [
    "break main", "continue", "next", "next", "print end", "print limit", "set var limit = 5", "print limit",
    "info sharedlibrary",
    f"break {LINE['call']}", "continue", "step", "bt", "finish", "print counter", "print i", "print total",
    "delete", "watch counter", "continue", "delete",
    f"break {LINE['store']}", "continue", "print before", f"jump {LINE['add-return']}", "print counter",
    "print step", "delete",
    "tbreak combine", "continue", "finish", f"until {LINE['half-call']}",
    "hbreak half", "continue", "finish", "print $xmm0.v2_double[0]", "print $orig_rax", "print $fs_base != 0",
    "delete", f"advance {LINE['return']}", "print total", "print halved", "print both",
    "continue",
]

#: a fault: the stop gdbserver reports, the faulting pointer, the frames, then the program ends with the signal
SEGV = ["continue", "print nowhere", "bt", "continue"]


def assert_in_order(out: str, *patterns: str) -> None:
    """Each regular expression (matching whole lines, `^`/`$` at line ends) matches `out` after the previous."""
    at = 0
    for pattern in patterns:
        found = re.compile(pattern, re.M).search(out, at)
        assert found, f"{pattern!r} not found after offset {at} of:\n{out}"
        at = found.end()


def _stop(header: str, function: str, arguments: str, line: str) -> str:
    """A stop's lines: `HEADER, FUNCTION (ARGUMENTS) at .../debugme.c:N` (no header where `header` is empty, an
    address first where the stop is not at the start of the line) and source line N, the marker `line`'s."""
    where = rf"(0x[0-9a-f]+ in )?{function} \({arguments}\) at \S*{re.escape(_line(line))}\n{LINE[line]}\t"
    return rf"^{header}, {where}" if header else rf"^{where}"


MAIN_ARGS = r"argc=2, argv=0x[0-9a-f]+"


#: the full session on one CPU and on two (a watchpoint's hook deleted on a CPU that has another space loaded
#: once left a #PF in flight there, which double-faulted the kernel: watchpoints.py clears it now)
FULL_CPUS = [1, 2]


@pytest.mark.parametrize("cpus", FULL_CPUS, ids=lambda c: f"{c}cpu")
@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_the_full_session(build, servers, gdb, cpus):
    program = build(MAIN_MODE)
    out, server = debug(servers, "kgtp-sim", gdb, program, ("exit",), FULL, cpus=cpus)
    assert_in_order(
        out,
        _stop("Breakpoint 1", "main", MAIN_ARGS, "main"), rf"^{LINE['main'] + 1}\t", rf"^{LINE['main'] + 2}\t",
        r'^\$1 = 0x[0-9a-f]+ "exit"$', r"^\$2 = 4$", r"^\$3 = 5$",
        r"^0x[0-9a-f]+\s+0x[0-9a-f]+\s+Yes( \(\*\))?\s+\S*/ld-linux-x86-64\.so\.2$",
        r"^0x[0-9a-f]+\s+0x[0-9a-f]+\s+Yes( \(\*\))?\s+\S*/libc\.so\.6$",
        # step into add, its frames, finish with the value it returns
        _stop("Breakpoint 2", "main", MAIN_ARGS, "call"), _stop("", "add", "step=1", "add"),
        rf"^#0  add \(step=1\) at \S*{_line('add')}\n#1  0x[0-9a-f]+ in main \({MAIN_ARGS}\) at \S*{_line('call')}$",
        _stop("", "main", MAIN_ARGS, "call"), r"^Value returned is \$4 = 1$",
        r"^\$5 = 1$", r"^\$6 = 1$", r"^\$7 = 0$",
        # the watchpoint on the global: its old and new value, where the store left the program
        r"^Hardware watchpoint 3: counter$", r"^Hardware watchpoint 3: counter\n\nOld value = 1\nNew value = 3$",
        _stop("", "add", "step=2", "add-return"),
        # a register write: jumping over the store leaves the counter at 3 in the third round
        _stop("Breakpoint 4", "add", "step=3", "store"), r"^\$8 = 3$",
        _stop("Breakpoint 4", "add", "step=4", "store"), r"^\$9 = 3$", r"^\$10 = 4$",
        _stop("Temporary breakpoint 5", "combine", "a=26, b=12", "combine"), _stop("", "main", MAIN_ARGS,
                                                                                  "combine-call"),
        r"^Value returned is \$11 = \{sum = 38, product = 312\}$", _stop("", "main", MAIN_ARGS, "half-call"),
        r"^Hardware assisted breakpoint 6 at 0x[0-9a-f]+: file \S*debugme\.c, line " + str(LINE["half"]),
        _stop("Breakpoint 6", "half", "value=26", "half"), r"^Value returned is \$12 = 13$",
        r"^\$13 = 13$", r"^\$14 = -1$", r"^\$15 = 1$",  # xmm0 holds the double; orig_rax; fs_base (TLS) is set
        _stop("", "main", MAIN_ARGS, "return"), r"^\$16 = 26$", r"^\$17 = 13$",
        r"^\$18 = \{sum = 38, product = 312\}$",
        r"^\[Inferior 1 \(.*\) exited with code 014\]$",
    )
    assert server.out["stdout"] == ["total 26 counter 12 sum 38 product 312 half 13.0"], server.out
    assert "Child exited with status 12" in server.out["stderr"], server.out


MATRIX = [(gdb, mode, cpus) for gdb in GDB_CLIENTS for mode in sorted(MODES) for cpus in (1, 2)]


@pytest.mark.parametrize("gdb, mode, cpus", MATRIX, ids=[f"gdb{g.version}-{m}-{c}cpu" for g, m, c in MATRIX])
def test_the_short_session(build, servers, gdb, mode, cpus):
    program = build(mode)
    out, server = debug(servers, "kgtp-sim", gdb, program, ("exit",), SHORT, cpus=cpus)
    assert_in_order(
        out, _stop("Breakpoint 1", "main", MAIN_ARGS, "main"), r"^\$1 = 4$",
        _stop("Breakpoint 2", "add", "step=1", "add"),
        rf"^#0  add \(step=1\) at \S*{_line('add')}\n#1  0x[0-9a-f]+ in main \({MAIN_ARGS}\) at \S*{_line('call')}$",
        _stop("", "main", MAIN_ARGS, "call"), r"^Value returned is \$2 = 1$", r"^\$3 = 1$", r"^\$4 = 1$",
        r"^\[Inferior 1 \(.*\) exited with code 017\]$",
    )
    assert server.out["stdout"] == ["total 35 counter 15 sum 50 product 525 half 17.5"], server.out
    assert "Child exited with status 15" in server.out["stderr"], server.out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", [MAIN_MODE, "musl-static"])
def test_a_sigsegv_is_reported_then_ends_the_program(build, servers, mode, kind):
    program = build(mode)
    out, server = debug(servers, kind, _gdb("13"), program, ("segv",), SEGV)
    assert_in_order(
        out, r"^Program received signal SIGSEGV, Segmentation fault\.$", _stop("", "main", MAIN_ARGS, "fault"),
        r"^\$1 = \(volatile int \*\) 0x0$", rf"^#0  (0x[0-9a-f]+ in )?main \({MAIN_ARGS}\) at \S*{_line('fault')}$",
        r"^Program terminated with signal SIGSEGV, Segmentation fault\.\nThe program no longer exists\.$",
    )
    assert server.out["stdout"] == ["total 20 counter 10 sum 30 product 200 half 10.0"], server.out
    assert any(line.startswith("Child terminated with signal = 0xb ") for line in server.out["stderr"]), server.out


@pytest.mark.parametrize("kind", [
    "gdbserver",
    "kgtp-sim",
])
def test_the_terminating_signal_is_named_as_gdbserver_names_it(build, servers, kind):
    _out, server = debug(servers, kind, _gdb("13"), build(MAIN_MODE), ("segv",), ["continue", "continue"])
    assert "Child terminated with signal = 0xb (SIGSEGV)" in server.out["stderr"], server.out


# ---- the command line --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_created_listening_the_output_and_the_exit_status(build, servers, kind):
    """`Process PROG created; pid = N` then `Listening on port N`; the program's stdout and stderr on the server's;
    `Child exited with status N`; with --once the server ends with status 0 once GDB has gone."""
    program = build(MAIN_MODE)
    server = servers(kind, program, "exit")
    created = server.wait_line(r"^Process (.*) created; pid = (\d+)$")
    assert created.group(1) == str(program) and int(created.group(2)) > 0, server.text()
    port = server.listening()
    out = run_session(_gdb("13"), program, port, ["continue"])
    assert "[Inferior 1 (" in out and ") exited with code 012]" in out, out
    assert server.wait() == 0, server.text()
    assert server.out["stdout"] == ["total 20 counter 10 sum 30 product 200 half 10.0"], server.out
    stderr = [line for line in server.out["stderr"] if line and not line.startswith("Remote debugging from host")]
    assert stderr == [f"Process {program} created; pid = {created.group(2)}", f"Listening on port {port}",
                      "ending: exit", "Child exited with status 10"], server.out


@pytest.mark.parametrize("kind", KINDS)
def test_a_port_already_taken(build, servers, kind):
    program = build(MAIN_MODE)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = servers(kind, program, comm=f":{taken.getsockname()[1]}")
        assert server.wait() == 1, server.text()
    assert "Can't bind address: Address already in use." in server.out["stderr"], server.out
    assert server.out["stderr"][-1] == "Exiting" and server.out["stdout"] == [], server.out


@pytest.mark.parametrize("kind", [
    "gdbserver",
    "kgtp-sim",
])
def test_a_port_already_taken_starts_nothing(build, servers, kind):
    program = build(MAIN_MODE)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = servers(kind, program, comm=f":{taken.getsockname()[1]}")
        assert server.wait() == 1
    assert server.out["stderr"] == ["Can't bind address: Address already in use.", "Exiting"], server.out


@pytest.mark.parametrize("kind", KINDS)
def test_once_ends_the_server_when_gdb_disconnects_and_kills_the_program(build, servers, kind):
    program = build(MAIN_MODE)
    server = servers(kind, program, "exit")
    out = run_session(_gdb("13"), program, server.listening(), ["break add", "continue", "disconnect"])
    assert re.search(r"^Breakpoint 1, add \(step=1\) at .*" + re.escape(_line("add")), out, re.M), out
    assert server.wait() == 0, server.text()
    assert server.out["stdout"] == [] and "Child exited with status" not in server.text(), server.out


@pytest.mark.parametrize("kind", KINDS)
def test_a_second_connection_finds_the_program_where_the_first_left_it_and_monitor_exit_ends_it(build, servers,
                                                                                                 kind):
    """Without --once the server serves again: a second GDB (its `target remote` retries while the port is
    reopened, GDB's `tcp auto-retry`) finds the program stopped where the first disconnected, and `monitor exit`
    ends the server and its program."""
    program = build(MAIN_MODE)
    server = servers(kind, program, "exit", options=())
    port = server.listening()
    gdb = _gdb("13")
    first = run_session(gdb, program, port, ["break add", "continue", "continue", "print counter", "disconnect"])
    assert re.search(r"^Breakpoint 1, add \(step=2\)", first, re.M) and re.search(r"^\$1 = 1$", first, re.M), first
    assert server.proc.poll() is None, server.text()
    second = run_session(gdb, program, port, ["bt 1", "print counter", "monitor exit"])
    assert re.search(r"^#0  add \(step=2\) at .*" + re.escape(_line("add")), second, re.M), second
    assert re.search(r"^\$1 = 1$", second, re.M), second
    assert server.wait() == 0, server.text()
    assert server.out["stdout"] == [] and "Child exited with status" not in server.text(), server.out


@pytest.mark.parametrize("kind", [
    "gdbserver",
    "kgtp-sim",
])
def test_monitor_exit_ends_the_server_while_gdb_is_still_connected(build, servers, kind):
    """The server ends once its reply is sent: GDB, still attached, finds the connection gone at its next
    packet."""
    program = build(MAIN_MODE)
    server = servers(kind, program, "exit", options=())
    with GdbMi(_gdb("13"), program=program) as mi:
        assert mi.attach(f"127.0.0.1:{server.listening()}").klass == "connected"
        assert mi.console("monitor exit").klass == "done"
        after = mi.console("monitor help")
        # closed, or reset when GDB's packet reached the socket before the server closed it
        assert after.klass == "error" and re.search(r"Remote connection closed|Target disconnected",
                                                    str(after.get("msg"))), after
    assert server.wait() == 0, server.text()


@pytest.mark.parametrize("kind", [
    "gdbserver",
    "kgtp-sim",
])
def test_each_connection_is_announced_and_the_port_reopened(build, servers, kind):
    """Two connections, the second ending the program (`kill`): gdbserver's lines for each, in order."""
    program = build(MAIN_MODE)
    server = servers(kind, program, "exit", options=())
    port = server.listening()
    gdb = _gdb("13")
    run_session(gdb, program, port, ["disconnect"])
    run_session(gdb, program, port, ["kill"])  # GDB retries its connection while the port is reopened
    assert server.wait() == 0, server.text()
    lines = [line for line in server.out["stderr"] if line.startswith(("Listening", "Remote"))]
    host = r"Remote debugging from host 127\.0\.0\.1, port \d+"
    expected = [f"Listening on port {port}", host,
                r"Remote side has terminated connection\.  GDBserver will reopen the connection\.",
                f"Listening on port {port}", host]
    assert len(lines) == len(expected) and all(map(re.fullmatch, expected, lines)), server.out


@pytest.mark.parametrize("kind", KINDS)
def test_a_server_on_gdbs_pipe(build, kind):
    """`target remote | SERVER - PROG`: packets on the server's stdin and stdout, its lines and the program's
    output on its stderr, which GDB shares; the server ends with the program."""
    program = build(MAIN_MODE)
    server = " ".join(_command(kind, (), "-", program, ("exit",), None))
    out = run_session(_gdb("13"), program, f"| {server}", SHORT)
    assert_in_order(
        out, rf"^Process {re.escape(str(program))} created; pid = \d+$", r"^Remote debugging using stdio$",
        _stop("Breakpoint 1", "main", MAIN_ARGS, "main"), _stop("Breakpoint 2", "add", "step=1", "add"),
        r"^Value returned is \$2 = 1$", r"^total 35 counter 15 sum 50 product 525 half 17\.5$", r"^ending: exit$",
        # GDB and the server's `Child exited with status 15` write at once: no line of their own
        r"\[Inferior 1 \(.*\) exited with code 017\]",
    )


# ---- the same as gdbserver ---------------------------------------------------------------------------------------

SESSIONS = {"full": FULL, "short": SHORT, "segv": SEGV}
COMPARED = [
    *[("full", version, MAIN_MODE, "exit") for version in ("13", "18")],
    *[("short", "13", mode, "exit") for mode in sorted(MODES) if mode != MAIN_MODE],
    *[("segv", "13", mode, "segv") for mode in (MAIN_MODE, "musl-static")],
]


@pytest.mark.parametrize("session, version, mode, argument", COMPARED,
                         ids=[f"{s}-gdb{v}-{m}" for s, v, m, _ in COMPARED])
def test_the_same_session_as_under_gdbserver(build, servers, session, version, mode, argument):
    """The same program, GDB and commands with Debian's gdbserver: GDB prints the same (stops, lines, values, the
    end), the program writes the same."""
    gdb, program = _gdb(version), build(mode)
    ours, our_server = debug(servers, "kgtp-sim", gdb, program, (argument,), SESSIONS[session],
                             cpus=1 if session == "full" else None)
    theirs, their_server = debug(servers, "gdbserver", gdb, program, (argument,), SESSIONS[session])
    moved = mode == "glibc-static-pie"
    ours, theirs = normalized(ours, moved), normalized(theirs, moved)
    assert ours == theirs, "\n".join(difflib.unified_diff(theirs, ours, "gdbserver", "kgtp-sim gdbserver",
                                                          lineterm=""))
    assert our_server.out["stdout"] == their_server.out["stdout"], (our_server.out, their_server.out)
    program_lines = [line for line in their_server.out["stderr"] if line.startswith("ending: ")]
    assert program_lines and program_lines == [line for line in our_server.out["stderr"]
                                               if line.startswith("ending: ")], (our_server.out, their_server.out)


# ---- Ctrl-C ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_ctrl_c_stops_a_looping_program_with_sigint_and_it_goes_on(build, servers, gdb, kind):
    """The user's Ctrl-C (MI's -exec-interrupt) on a program spinning in a loop: a SIGINT stop; the program resumes
    (Ctrl-C stops it again, a breakpoint in the loop is hit round after round) and, told to stop spinning, exits."""
    program = build(MAIN_MODE)
    server = servers(kind, program, "loop")
    with GdbMi(gdb, program=program, mi_async=True) as mi:
        for setting in QUIET:
            mi.command(f"-gdb-{setting}")
        assert mi.attach(f"127.0.0.1:{server.listening()}").klass == "connected"
        mi.command("-exec-continue")
        server.wait_line(r"^ending: loop$")  # past its output: spinning from here
        for _ in range(2):
            mi.command("-exec-interrupt")
            stop = mi.wait_stopped()
            assert stop.get("reason") == "signal-received" and stop.get("signal-name") == "SIGINT", stop
            mi.command("-exec-continue")
        mi.command("-exec-interrupt")
        assert mi.wait_stopped().get("signal-name") == "SIGINT"
        # by file: the Ctrl-C may stop it in libc (its write of the line above not returned yet), whose file a bare
        # line number would name
        mi.console(f"break debugme.c:{LINE['spin']}")
        rounds = []
        for _ in range(2):
            mi.command("-exec-continue")
            stop = mi.wait_stopped()
            assert stop.get("reason") == "breakpoint-hit" and stop["frame"]["line"] == str(LINE["spin"]), stop
            rounds.append(int(mi.evaluate("spins")))
        assert rounds[1] == rounds[0] + 1, rounds
        mi.console("delete")
        mi.console("set var spinning = 0")
        mi.command("-exec-continue")
        stop = mi.wait_stopped()
        assert stop.get("reason") == "exited" and stop.get("exit-code") == "012", stop
    assert server.wait() == 0, server.text()
