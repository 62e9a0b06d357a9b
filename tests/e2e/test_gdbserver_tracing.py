"""Tracepoints and signals of a program debugged through `kgtp-sim gdbserver`, with real GDB (13 and 18): tracepoints
in the program (every engine, 1 and 2 CPUs), the program's and the kernel's tracepoints in one buffer in time order,
signals as gdbserver reports and passes them, multiprocess thread ids.

The program (tests/programs/traceme.c, gcc -g -O0) runs as a process on the simulated kernel; each test starts its
own server (`--once`, a free port, read from gdbserver's `Listening on port` line) and waits for its end.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from kgtp_sim.client import GDB_CLIENTS, ROOT, VMLINUX, run_gdb
from kgtp_sim.client.stub import kgtp_command

SOURCE = Path(__file__).resolve().parents[1] / "programs" / "traceme.c"
pytestmark = pytest.mark.skipif(not GDB_CLIENTS, reason="no GDB")
GDB13 = next((g for g in GDB_CLIENTS if g.version == "13"), GDB_CLIENTS[0] if GDB_CLIENTS else None)


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> dict[str, Path]:
    """traceme, static and dynamic (both with debug info, unoptimized: its locals are where GDB looks)."""
    out = tmp_path_factory.mktemp("traceme")
    built = {}
    for mode, flags in (("static", ["-static"]), ("dynamic", [])):
        binary = out / f"traceme-{mode}"
        subprocess.run(["gcc", "-g", "-O0", *flags, str(SOURCE), "-o", str(binary)], check=True, capture_output=True)
        built[mode] = binary
    return built


class Server:
    """`kgtp-sim gdbserver --once 127.0.0.1:0 PROG`: its port, once it listens; what it printed, once it ended."""

    def __init__(self, program: Path, *options: str) -> None:
        self.proc = subprocess.Popen(kgtp_command("gdbserver", "--once", *options, "127.0.0.1:0", str(program)),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        self.stderr: list[str] = []
        self.port: int | None = None
        self.pid: int | None = None
        listening = threading.Event()

        def drain() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.stderr.append(line)
                created = re.match(r"Process .* created; pid = (\d+)", line)
                if created:
                    self.pid = int(created.group(1))
                match = re.match(r"Listening on port (\d+)", line)
                if match:
                    self.port = int(match.group(1))
                    listening.set()
            listening.set()

        self._drain = threading.Thread(target=drain, daemon=True)
        self._drain.start()
        if not listening.wait(60) or self.port is None:
            self.stop()
            raise RuntimeError("the gdbserver role did not start:\n" + "".join(self.stderr))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def finish(self, timeout: float = 30) -> tuple[str, str]:
        """Its stdout (the program's) and stderr once it has ended (GDB left)."""
        out, _ = self.proc.communicate(timeout=timeout)
        self._drain.join(timeout)  # its last lines (`Child exited ...`) may still be on their way
        return out, "".join(self.stderr)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def session(gdb, program: Path, commands, *options: str) -> tuple[str, str, str]:
    """GDB's output, then the server's stdout and stderr, for one session of `commands` (or `commands(pid)`, the
    program's pid as the server printed it) on `program`."""
    server = Server(program, *options)
    try:
        if callable(commands):
            commands = commands(server.pid)
        with_target = [f"file {program}", f"target remote {server.address}", *commands]
        text = run_gdb(gdb, None, *with_target, attach=False, timeout=120)
        out, err = server.finish()
        return text, out, err
    finally:
        server.stop()


def debian_session(gdb, program: Path, commands: list[str]) -> str:
    """GDB's output for `commands` on `program` served by Debian's gdbserver (`--once`, a free port), the same way
    `session` serves it by the stub: what a comparison holds the stub to."""
    server = subprocess.Popen(["gdbserver", "--once", "127.0.0.1:0", str(program)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        assert server.stderr is not None
        for line in server.stderr:
            match = re.match(r"Listening on port (\d+)", line)
            if match:
                port = int(match.group(1))
                break
        assert port is not None
        return run_gdb(gdb, None, f"file {program}", f"target remote 127.0.0.1:{port}", *commands, attach=False,
                       timeout=120)
    finally:
        server.kill()
        server.wait()


def frames_listing() -> list[str]:
    return ["tfind start", "while $trace_frame != -1", 'printf "frame %d tp %d pc %p\\n", $trace_frame, $tracepoint, '
            "$pc", "tfind", "end"]


@pytest.mark.parametrize("engine, cpus", [("interp", 1), ("naive", 2), ("opt", 1), ("opt", 2)])
def test_tracepoints_in_the_program_collect_its_locals_and_globals(programs, engine, cpus):
    text, out, _ = session(GDB13, programs["static"], [
        "trace add", "actions", "collect a", "collect b", "collect $regs", "end",
        "trace add if b == 3", "actions", "collect counter", "collect b", "end",
        "break 29", "tstart", "continue", "tstop", "tstatus",
        "tfind start", "print a", "print b",
        "tfind 2", "print a + b",
        "tfind tracepoint 2", "print b", "print counter", "tfind end", "kill",
    ], "--engine", engine, "--cpus", str(cpus))
    assert "Collected 6 trace frames." in text, text
    values = re.findall(r"^\$\d+ = (.*)$", text, re.M)
    # frame 0: add(0, 0); frame 2: add(1, 2); tracepoint 2's one frame: add(3, 3), counter 3 before its ++
    assert values == ["0", "0", "3", "3", "3"], text
    assert "killed]" in text, text
    assert "tick" in out


@pytest.mark.parametrize("mode, engine, cpus", [("dynamic", "interp", 1), ("static", "naive", 2),
                                                 ("dynamic", "opt", 2), ("static", "opt", 1)])
def test_a_fast_tracepoint_in_the_program_jumps_to_a_pad_it_can_reach(programs, mode, engine, cpus):
    """`ftrace` at counter++ (a RIP-relative load, 6 bytes): a jump into a pad the process mapped near its code
    (PIE or not), its values collected at each round, the relocated load still reading the counter (the program's
    result unchanged: the pad ran it, the jump went back after it)."""
    text, _, _ = session(GDB13, programs[mode], [
        "break main", "continue", "ftrace 26", "actions", "collect counter", "collect total", "end",
        "tstart", "continue", "tstop", "tstatus",
        "tfind start", "print counter", "print total", "tfind 4", "print counter", "print total",
        "tfind none", "continue",
    ], "--engine", engine, "--cpus", str(cpus))
    assert re.search(r"Fast tracepoint 2 at 0x[0-9a-f]+: file .*traceme.c, line 26", text), text
    assert "Collected 5 trace frames." in text, text
    values = re.findall(r"^\$\d+ = (.*)$", text, re.M)
    assert values == ["0", "0", "4", "10"], text  # round 0 before counter++, round 4 after add(6, 4)
    assert re.search(r"exited with code 024\]", text), text


@pytest.mark.parametrize("engine, cpus", [("interp", 1), ("opt", 2)])
def test_steps_and_a_breakpoint_at_a_fast_tracepoint_collect_once_and_step_its_instruction(programs, engine, cpus):
    """A single step of the jump goes on through the pad (its hit collected) and ends after the instruction it
    displaced, as a step of that instruction does; a breakpoint at the tracepoint (its int3 over the jump) stops
    there, and the step over it collects: one frame per round, however the program was stepped."""
    text, _, _ = session(GDB13, programs["dynamic"], [
        "break 25", "continue", "ftrace 26", "actions", "collect counter", "end", "tstart",
        "next", "info line *$pc", "stepi", "info line *$pc", "print $pc - 'main'",
        "break 26", "continue", "continue", "print counter", "next", "delete", "continue", "tstop", "tstatus",
    ], "--engine", engine, "--cpus", str(cpus))
    start = re.search(r"Line 26 of .* starts at address (0x[0-9a-f]+) <main\+(\d+)>", text)
    assert start, text
    # counter++ at -O0 begins with a 6-byte RIP-relative load: the step ends 6 bytes on
    assert re.search(r"^\$1 = " + str(int(start.group(2)) + 6) + "$", text, re.M), text
    assert "Breakpoint 3, main () at" in text, text
    assert re.search(r"^\$2 = 1$", text, re.M), text
    assert "Collected 5 trace frames." in text, text


@pytest.mark.parametrize("engine, cpus", [("interp", 1), ("naive", 2), ("opt", 1), ("opt", 2)])
def test_while_stepping_in_the_program_collects_each_step_and_debugger_steps_still_stop(programs, engine, cpus):
    """`while-stepping 3` at add(): each hit's frame, then one per instruction the program runs after it (its PC
    on, inside add), the int3 back after the steps (every round hit); a debugger's `next` afterwards still stops
    (the #DB hook before the steps is back), and the program's result is unchanged."""
    text, _, _ = session(GDB13, programs["static"], [
        "trace add", "actions", "collect a", "while-stepping 3", "collect $regs", "end", "end",
        "break 29", "tstart", "continue", "next", "info line *$pc", "tstop", "tstatus", *frames_listing(),
        "tfind none", "continue", "continue",
    ], "--engine", engine, "--cpus", str(cpus))
    assert "Collected 20 trace frames." in text, text
    frames = re.findall(r"^frame (\d+) tp 1 pc (0x[0-9a-f]+)", text, re.M)
    assert [int(n) for n, _ in frames] == list(range(20)), text
    pcs = [int(pc, 16) for _, pc in frames]
    for start in range(0, 20, 4):  # a hit, then its three steps, each one instruction on
        assert pcs[start] == pcs[0] and pcs[start:start + 4] == sorted(set(pcs[start:start + 4])), text
        assert pcs[start + 3] - pcs[start] < 16, text
    assert re.search(r"Line 30 of .* starts at address", text), text
    assert re.search(r"exited with code 024\]", text), text


@pytest.mark.parametrize("engine, cpus", [("interp", 1), ("opt", 2)])
def test_a_pass_count_with_while_stepping_stops_the_run_after_the_last_hits_steps(programs, engine, cpus):
    """`passcount 2` and `while-stepping 2` at add(): the second hit's steps are recorded, then the run stops (the
    int3 leaves the program from inside the steps' trap); another tracepoint's frame in between; the program goes
    on to its end untouched."""
    text, _, _ = session(GDB13, programs["static"], [
        "trace add", "passcount 2", "actions", "collect a", "while-stepping 2", "collect $regs", "end", "end",
        "trace 27", "actions", "collect counter", "end", "tstart", "continue", "tstatus", *frames_listing(),
        "tfind none", "continue", "continue",
    ], "--engine", engine, "--cpus", str(cpus))
    assert "Trace stopped by tracepoint 1." in text, text
    tracepoints = [int(tp) for tp in re.findall(r"^frame \d+ tp (\d+) pc", text, re.M)]
    assert tracepoints == [1, 1, 1, 2, 1, 1, 1], text
    assert "received signal SIGTRAP" not in text and re.search(r"exited with code 024\]", text), text


@pytest.mark.parametrize("engine, cpus", [("interp", 1), ("opt", 2)])
def test_a_breakpoint_at_a_tracepoint_stops_after_its_collection_and_collects_once(programs, engine, cpus):
    """`break add` and `trace add` (one int3 for both): each hit collects, then stops as the breakpoint; going on
    from that stop collects nothing more; with the breakpoint deleted the tracepoint alone goes on."""
    text, _, _ = session(GDB13, programs["static"], [
        "break add", "trace add", "actions", "collect a", "end", "tstart",
        "continue", "print a", "continue", "print a", "continue", "print a", "tstatus",
        "delete 1", "continue", "tstop", "tstatus", "tfind tracepoint 2", "print a", "tfind 2", "print a",
        "tfind none", "continue",
    ], "--engine", engine, "--cpus", str(cpus))
    assert text.count("Breakpoint 1, add (a=") == 3, text
    assert re.findall(r"^\$\d+ = (.*)$", text, re.M) == ["0", "0", "1", "0", "1"], text
    assert re.search(r"Trace is running on the target\.\nCollected 3 trace frames\.", text), text
    assert "Collected 5 trace frames." in text, text  # once per round, stopped at or not
    assert "received signal SIGTRAP" not in text and re.search(r"exited with code 024\]", text), text


@pytest.mark.parametrize("engine, cpus", [("naive", 1), ("opt", 2)])
def test_a_breakpoint_set_over_a_running_tracepoint_outlives_it_and_leaves_no_int3(programs, engine, cpus):
    """The breakpoint's int3 goes over the tracepoint's (one int3, the byte under it recorded once): tstop leaves
    the breakpoint in, and deleting it afterwards leaves the program's own byte (no stray int3: no SIGTRAP)."""
    text, _, _ = session(GDB13, programs["static"], [
        "trace add", "actions", "collect a", "end", "tstart", "break add",
        "continue", "x/2xb $pc", "tstop", "tstatus", "continue", "print a", "delete", "continue", "continue",
    ], "--engine", engine, "--cpus", str(cpus))
    assert text.count("Breakpoint 2, add (a=") == 2, text
    assert "Collected 1 trace frames." in text, text
    code = re.search(r"<add\+\d+>:\s+(0x[0-9a-f]+)\s+(0x[0-9a-f]+)", text)
    assert code and code.group(1) != "0xcc", text  # memory read through the int3s shows the program's bytes
    assert re.search(r"^\$1 = 0$", text, re.M), text
    assert "received signal SIGTRAP" not in text and re.search(r"exited with code 024\]", text), text


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda g: f"gdb{g.version}")
def test_a_tsaved_trace_of_the_program_reads_back_in_its_register_layout(programs, gdb, tmp_path):
    """`tsave` (GDB writes the frames qTBuffer gives it) and `tsave -r`-free reading with `target tfile`: the
    register blocks are one `g` packet of the process's register file (x86-64 Linux's, wider than KGTP's), so
    the file reads back: each frame's registers, its collected memory, in order."""
    saved = tmp_path / "program.tf"
    text, _, _ = session(gdb, programs["static"], [
        "trace add", "actions", "collect $regs", "collect a", "collect b", "end",
        "break 29", "tstart", "continue", "tstop", "tfind 3", "print a", "print b", "print/x $rsp", "print/x $pc",
        "tfind none", f"tsave {saved}", "kill",
    ])
    live = re.findall(r"^\$\d+ = (.*)$", text, re.M)
    assert len(live) == 4 and live[:2] == ["3", "3"], text
    back = run_gdb(gdb, None, f"file {programs['static']}", f"target tfile {saved}", "tstatus", "tfind 3",
                   "print a", "print b", "print/x $rsp", "print/x $pc", "tfind 4", "print a", "print b",
                   attach=False, timeout=60)
    assert "Collected 5 trace frames." in back, back
    values = re.findall(r"^\$\d+ = (.*)$", back, re.M)
    assert values[:4] == live, (back, live)  # add(3, 3): the same frame, live and from the file
    assert values[4:] == ["6", "4"], back
    assert "Truncated" not in back and "Bogus" not in back, back


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda g: f"gdb{g.version}")
def test_program_and_kernel_tracepoints_share_one_buffer_in_time_order(programs, gdb):
    """The program's loop and the kernel's do_syscall for this process only (KGTP's $current_task_pid by its
    name), one run: the kernel's frames of the loop's write() calls interleave with the program's add() frames."""
    text, _, err = session(gdb, programs["dynamic"], lambda pid: [
        f"add-symbol-file {VMLINUX}",
        "break main", "continue",
        "trace add", "actions", "collect a", "end",
        "tvariable $current_task_pid",  # KGTP's, declared by its name (gdbserver's numbering: stub/variables.py)
        f"trace do_syscall if $current_task_pid == {pid}", "actions", "collect $current_task_pid", "collect $regs",
        "collect regs->orig_ax", "end",
        "break 29", "tstart", "continue", "tstop", "tstatus", *frames_listing(),
        "tfind tracepoint 3", "print $current_task_pid", "print regs->orig_ax", "kill",
    ], "--cpus", "2")
    pid = int(re.search(r"pid = (\d+)", err).group(1))
    assert "Collected" in text, text
    kinds = ["program" if int(pc, 16) < 1 << 47 else "kernel"
             for pc in re.findall(r"^frame \d+ tp \d+ pc (0x[0-9a-f]+)", text, re.M)]
    # five add() hits, each followed by the write() system call of its round
    assert kinds.count("program") == 5, text
    rounds = "".join("p" if k == "program" else "k" for k in kinds)
    assert re.search(r"(pk+){4}p", rounds), rounds
    assert re.search(rf"^\$\d+ = {pid}\n\$\d+ = 1$", text, re.M), text  # write() is system call 1


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_a_signal_stops_the_program_and_its_handler_runs_on_continue(programs, mode):
    text, out, err = session(GDB13, programs[mode], [
        "break on_usr1", "continue", "print $_siginfo.si_signo", "continue", "bt", "continue",
    ])
    assert "Program received signal SIGUSR1, User defined signal 1." in text, text
    assert re.search(r"^\$1 = 10$", text, re.M), text
    assert "Breakpoint 1, on_usr1" in text, text
    assert "<signal handler called>" in text, text
    assert re.search(r"\[Inferior 1 \(process \d+\) exited with code 024\]", text), text
    assert "Child exited with status 20" in err


def test_signals_gdb_passes_without_stopping_reach_the_handler(programs):
    text, _, _ = session(GDB13, programs["static"], [
        "handle SIGUSR1 nostop noprint pass", "continue",
    ])
    assert "received signal" not in text, text
    assert re.search(r"exited with code 024\]", text), text


def test_threads_are_named_with_their_process_and_exit_names_it(programs):
    text, _, err = session(GDB13, programs["static"], ["info threads", "continue", "continue"])
    pid = int(re.search(r"pid = (\d+)", err).group(1))
    assert f"Thread {pid}.{pid}" in text, text
    assert f"[Inferior 1 (process {pid}) exited with code 024]" in text, text


def test_a_tracepoint_outside_the_program_is_refused_at_tstart(programs):
    """A clear error, no run, and the program goes on as if nothing had been tried."""
    text, _, _ = session(GDB13, programs["static"], [
        "trace *0x10000", "actions", "collect $regs", "end",
        "python", "try:", "    gdb.execute('tstart')", "except gdb.error as error:", "    print('refused:', error)",
        "end", "tstatus", "continue", "continue",
    ])
    assert re.search(r"^refused: .*0x10000: no memory of the process there", text, re.M), text
    assert "Trace is not running" in text or "No trace has been run" in text, text
    assert re.search(r"exited with code 024\]", text), text


@pytest.mark.skipif(shutil.which("gdbserver") is None, reason="needs Debian's gdbserver")
def test_the_tracepoint_session_matches_gdbserver(programs):
    """The same trap tracepoints with Debian's gdbserver and the stub, same GDB and program: the same frames and
    values (gdbserver's `trace` without its agent is a trap tracepoint too)."""
    commands = ["trace add", "actions", "collect a", "collect b", "end", "break 29", "tstart", "continue",
                "tstop", "tfind start", "while $trace_frame != -1", 'printf "a=%d b=%d\\n", a, b', "tfind", "end",
                "kill"]
    ours, _, _ = session(GDB13, programs["static"], commands)
    theirs = debian_session(GDB13, programs["static"], commands)
    pairs = re.findall(r"^a=\d+ b=\d+$", ours, re.M)
    assert pairs and pairs == re.findall(r"^a=\d+ b=\d+$", theirs, re.M), (ours, theirs)


def test_a_watchpoint_on_data_nothing_maps_is_accepted_as_gdbserver_accepts_it(programs):
    """`watch *(int *) ADDR` where no page is yet: the debug register is taken (Z2 answered OK, as gdbserver's x86
    debug registers take any address) and the program runs on to its end."""
    text, _, _ = session(GDB13, programs["static"], ["watch *(int *) 0x10000", "continue", "continue"])
    assert "Hardware watchpoint 1: *(int *) 0x10000" in text, text
    assert "Could not insert" not in text and re.search(r"exited with code 024\]", text), text


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda g: f"gdb{g.version}")
def test_compiled_trace_and_ftrace_in_the_program_under_the_opt_engine(programs, gdb):
    """The optimizing engine's compiled hits in the program (tracing/engines/userprobes.py): a `trace` whose
    condition reads the program's memory (an argument: its detour decides, behind the call gate), a `trace` at
    add's first instruction whose condition reads a register only (decided in the pad, in ring 3) and an `ftrace`
    at counter++ with a condition on a local, each collecting program variables and a register. `tstatus` and
    `info tracepoints` count what each collected, `monitor probes` what each saw (the pad's false conditions
    too), and `tdump` shows each frame's values."""
    text, _, _ = session(gdb, programs["static"], [
        "trace add if b >= 2", "actions", "collect a", "collect b", "collect $rsp", "end",
        "trace *add if $rsi == 3", "actions", "collect $rdi", "end",
        "ftrace 26 if i >= 3", "actions", "collect i", "collect counter", "collect $rip", "end",
        "break 29", "tstart", "continue", "tstop", "tstatus", "info tracepoints", "monitor probes",
        "tfind start", "tdump", *["tfind", "tdump"] * 5, "tfind none", "info registers rsp", "kill",
    ], "--engine", "opt", "--cpus", "2")
    assert "Collected 6 trace frames." in text, text
    # add(1, 2), add(3, 3) and add(6, 4) pass b >= 2; add(3, 3) alone has 3 in %rsi; rounds 3 and 4 pass i >= 3
    assert re.findall(r"tracepoint already hit (\d+) times?", text) == ["3", "1", "2"], text
    # (after tstop: the locations removed, their counts kept; the jump is the ftrace's, compiled)
    probes = re.findall(r"^\s*(\d+)\s+0x[0-9a-f]+\s+(\w+)\s+removed\s+fired (\d+)\s+hits (\d+)", text, re.M)
    assert probes == [("1", "int3", "5", "3"), ("2", "int3", "5", "1"), ("3", "jump", "5", "2")], text
    dumps = re.findall(r"^Data collected at tracepoint (\d+), trace frame (\d+):$|"
                       r"^(a|b|\$rsp|\$rdi|i|counter|\$rip) = (?:\(.*\) )?(\S+)", text, re.M)
    frames = [(int(tp), int(frame)) for tp, frame, _, _ in dumps if tp]
    # in time order: add(1, 2); add(3, 3) at its first instruction, then after its prologue; round 3's counter++;
    # add(6, 4); round 4's counter++
    assert frames == [(1, 0), (2, 1), (1, 2), (3, 3), (1, 4), (3, 5)], text
    values = [(name, value) for tp, _, name, value in dumps if not tp]
    assert [v for v in values if v[0] in ("a", "b")] == [("a", "1"), ("b", "2"), ("a", "3"), ("b", "3"),
                                                         ("a", "6"), ("b", "4")], text
    assert [v for v in values if v[0] in ("$rdi", "i", "counter")] == [
        ("$rdi", "3"), ("i", "3"), ("counter", "3"), ("i", "4"), ("counter", "4")], text
    rsps = [int(v, 16) for n, v in values if n == "$rsp"]
    live = int(re.search(r"^rsp\s+(0x[0-9a-f]+)", text, re.M).group(1), 16)  # main's, stopped at line 29
    assert len(rsps) == 3 and all(live - 0x40 < rsp < live for rsp in rsps), (rsps, hex(live), text)
    line = re.search(r"^3\s+fast tracepoint\s+keep y\s+(0x[0-9a-f]+) in main", text, re.M)
    rips = [int(v, 16) for n, v in values if n == "$rip"]
    assert line and rips == [int(line.group(1), 16)] * 2, text  # the ftrace's address, not its pad's
    assert "killed]" in text, text


@pytest.mark.parametrize("gdb, engine, first, second", [
    (GDB13, "opt", "trace", "trace"), (GDB13, "opt", "ftrace", "trace"), (GDB13, "opt", "trace", "ftrace"),
    (GDB13, "naive", "ftrace", "ftrace"), (GDB_CLIENTS[-1] if GDB_CLIENTS else None, "opt", "ftrace", "trace")],
    ids=lambda v: getattr(v, "version", v))
def test_a_tracepoint_set_during_the_run_where_one_runs_compiled_collects_beside_it(programs, gdb, engine, first,
                                                                                   second):
    """trace-break.exp's fifth case in the program: a tracepoint set during a run at the line where another one
    already runs compiled (its pad) is installed beside it (both then on the Python path, the first's count going
    on), and each later round collects a frame of each, the first's first."""
    text, _, _ = session(gdb, programs["static"], [
        "break main", "continue", f"{first} 26", "actions", "collect counter", "end", "break 25", "tstart",
        "continue", "continue", f"{second} 26", "actions", "collect i", "end", "delete 3", "break 29", "continue",
        "tstop", "tstatus", "info tracepoints", *frames_listing(), "kill",
    ], "--engine", engine, "--cpus", "2")
    assert "Target returns error" not in text and "Collected 9 trace frames." in text, text
    assert re.findall(r"tracepoint already hit (\d+) times?", text) == ["5", "4"], text
    order = [int(tp) for tp in re.findall(r"^frame \d+ tp (\d+) pc", text, re.M)]
    assert order == [2] + [2, 4] * 4, text
