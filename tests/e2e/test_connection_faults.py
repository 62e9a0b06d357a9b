"""Connection faults with real GDB: a GDB killed mid-packet, mid-`tstart` and mid-`qTBuffer`, a second client while
one is attached, a client that sends nothing, and a reconnect storm.

After each fault the stub must still be serving, and a fresh GDB must find the trace run as the protocol says it
should be: stopped by the disconnection, or still running under disconnected tracing; and every frame collected
must be there and readable, in order, none missing, none damaged.

To kill GDB at a chosen byte, a proxy sits between it and the stub. It forwards both ways until GDB sends the
packet under test, delivers only part of that packet, and the test SIGKILLs GDB right then: the stub sees exactly
that truncated packet followed by the end of the connection, every time.

Frames are judged by what the kernel did: the workload thread calls `kgtp_test_function(counter1, ...)` with
`counter1` equal to the global `kgtp_counter` on entry, one more at each call. A trace run that collects `$regs`
and `kgtp_counter` therefore has frames whose `$pc` is the tracepoint's address, whose `$rdi` equals the collected
counter, and whose counters go up by exactly one from each frame to the next: a lost frame leaves a gap, a
damaged one breaks an equality.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from kgtp_sim.client import (
    GDB_CLIENTS,
    VMLINUX,
    GdbClient,
    RspClient,
    StubProcess,
    run_gdb,
    session_lines,
    start_gdb,
    start_stub,
)
from kgtp_sim.machine import KernelImage
from kgtp_sim.rsp.codec import Decoder, EventKind, encode_packet

from ..conftest import wait_for_hits

pytestmark = pytest.mark.gdb

IMAGE = KernelImage.load(VMLINUX)
TEST_FUNCTION = IMAGE.symbols["kgtp_test_function"].address
JIFFIES = IMAGE.symbols["jiffies"].address


@pytest.fixture(scope="module")
def stub():
    """One CPU: the frames are judged against the one workload thread (on more CPUs each CPU's kgtp_bench/N calls
    kgtp_test_function with its own counters, and kgtp_counter counts them all)."""
    server = start_stub(cpus=1)
    yield server
    server.stop()


@pytest.fixture
def fresh_stub(one_cpu_stub):
    return one_cpu_stub


KGTP_COUNTER = IMAGE.symbols["kgtp_counter"].address
KGTP_EVENT_SITE = next(m.site for m in IMAGE.markers if m.id == "module::kgtp_module_event")

#: What the stub answers a debugger that arrives while another is attached (GDB 13 prints it after `E.`).
BUSY = "another debugger is attached; only one is served at a time"

TRACE_COMMANDS = ("trace kgtp_test_function", "actions", "collect $regs", "collect kgtp_counter", "end")

#: Select every frame from the first on and print what the checks need; a frame GDB cannot read ends the script.
WALK_COMMANDS = (
    "tfind start",
    "while $trace_frame != -1",
    'printf "walked frame %d tracepoint %d pc %#lx rdi %d counter %d\\n", '
    "$trace_frame, $tracepoint, $pc, $rdi, kgtp_counter",
    "tfind",
    "end",
)

#: A GDB sends its first bytes the moment it connects; a connection silent for this long is not a debugger.
SILENT_CLIENT_LIMIT = 5.0

STORM_CONNECTS = 300
STORM_TIME_LIMIT = 20.0


# ---- the fault-injecting proxy ---------------------------------------------------------------------------------

Keep = Callable[[bytes], int]


def half(packet: bytes) -> int:
    """Deliver the first half of the packet: cut between `$` and `#`."""
    return len(packet) // 2


def whole(packet: bytes) -> int:
    """Deliver the whole packet: the stub acts on it, GDB never reads the answer."""
    return len(packet)


def first_bytes(count: int) -> Keep:
    """Deliver the first `count` bytes of the packet."""
    return lambda packet: count


@dataclass(frozen=True)
class Cut:
    """Where the client's stream is cut: the `occurrence`-th packet starting with `pattern`, of which only
    `keep(packet)` bytes reach the stub; GDB is killed `linger` seconds later, never having seen an answer."""

    pattern: bytes
    keep: Keep
    occurrence: int = 1
    linger: float = 0.0


class FaultProxy:
    """Forwards one GDB connection to the stub until the cut, then delivers nothing more from GDB.

    From the cut on, the stub's answers are held back too: GDB dies waiting for the answer to the packet it was
    sending. `delivered` is every byte the stub got from GDB, so a test can show where the cut fell.
    """

    def __init__(self, stub_port: int, cut: Cut) -> None:
        self._stub_port = stub_port
        self._cut = cut
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(30)
        self.port: int = self._listener.getsockname()[1]
        self.cut_done = threading.Event()
        self._withhold = threading.Event()
        self.delivered = bytearray()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._run, daemon=True, name="fault-proxy").start()

    def _run(self) -> None:
        try:
            client, _ = self._listener.accept()
            upstream = socket.create_connection(("127.0.0.1", self._stub_port), timeout=10)
            upstream.settimeout(None)
        except OSError:
            return
        self._sockets = [client, upstream]
        threading.Thread(target=self._pump_answers, args=(upstream, client), daemon=True).start()
        self._pump_requests(client, upstream)

    def _deliver(self, upstream: socket.socket, data: bytes) -> None:
        upstream.sendall(data)
        self.delivered += data

    def _pump_requests(self, client: socket.socket, upstream: socket.socket) -> None:
        pattern = self._cut.pattern
        pending = bytearray()
        seen = 0
        try:
            while data := client.recv(65536):
                pending += data
                while pending:
                    at = pending.find(pattern)
                    if at < 0:
                        # hold back a tail that may be the start of the pattern split across two reads
                        hold = next((n for n in range(min(len(pattern) - 1, len(pending)), 0, -1)
                                     if pending.endswith(pattern[:n])), 0)
                        self._deliver(upstream, bytes(pending[: len(pending) - hold]))
                        del pending[: len(pending) - hold]
                        break
                    if seen + 1 < self._cut.occurrence:
                        seen += 1
                        self._deliver(upstream, bytes(pending[: at + len(pattern)]))
                        del pending[: at + len(pattern)]
                        continue
                    end = pending.find(b"#", at)
                    if end < 0 or len(pending) < end + 3:  # the packet is not complete yet: wait for the rest
                        self._deliver(upstream, bytes(pending[:at]))
                        del pending[:at]
                        break
                    packet = bytes(pending[at : end + 3])
                    self._withhold.set()
                    self._deliver(upstream, bytes(pending[: at + self._cut.keep(packet)]))
                    self.cut_done.set()
                    return
        except OSError:
            return

    def _pump_answers(self, upstream: socket.socket, client: socket.socket) -> None:
        try:
            while (data := upstream.recv(65536)) and not self._withhold.is_set():
                client.sendall(data)
        except OSError:
            return

    def requests(self) -> list[bytes]:
        """The complete packets the stub received from GDB."""
        return [e.payload for e in Decoder().feed(bytes(self.delivered)) if e.kind is EventKind.PACKET]

    def close(self) -> None:
        for sock in self._sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self._listener.close()


def kill_gdb_at(client: GdbClient, stub: StubProcess, cut: Cut, commands: tuple[str, ...], workdir: Path,
                ) -> FaultProxy:
    """Run GDB with `commands` through a `FaultProxy`, SIGKILL it once its stream is cut, close both sides.

    Returns the proxy so the test can show what the stub received before the end of the connection.
    """
    proxy = FaultProxy(stub.port, cut)
    script = workdir / "killed-gdb.gdb"
    script.write_text("\n".join(session_lines(f"127.0.0.1:{proxy.port}", commands)) + "\n")
    log = workdir / "killed-gdb.out"
    with log.open("w") as output:
        victim = start_gdb(client, "-x", str(script), stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not proxy.cut_done.wait(0.02):
            assert victim.poll() is None, f"GDB ended before sending {cut.pattern!r}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"GDB never sent {cut.pattern!r}:\n{log.read_text()}"
        if cut.linger:
            time.sleep(cut.linger)  # what the stub does meanwhile is checked by the caller
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        proxy.close()
    assert victim.returncode == -signal.SIGKILL, log.read_text()  # killed at the cut, not ended on its own
    assert stub.proc.poll() is None, "".join(stub.output)
    return proxy


# ---- reading what a fresh GDB sees -----------------------------------------------------------------------------

@dataclass(frozen=True)
class WalkedFrame:
    number: int
    tracepoint: int
    pc: int
    rdi: int
    counter: int


def attach(client: GdbClient, stub: StubProcess, *commands: str, deadline: float = 10) -> str:
    """A fresh GDB attaches and runs `commands`; while the stub is still releasing a killed client's slot it is
    refused, so it tries again until `deadline` seconds have passed."""
    give_up = time.monotonic() + deadline
    while True:
        out = run_gdb(client, stub, *commands)
        if BUSY not in out:
            break
        assert time.monotonic() < give_up, f"the stub kept refusing GDB:\n{out}"
    if re.search(r"^panic \(", out, re.M):  # GDB attached to a dead kernel: show how it died
        pytest.fail("the kernel panicked:\n" + run_gdb(client, stub, "monitor console", "bt", "info registers rip")
                    + "\n" + out)
    return out


def collected(out: str) -> list[int]:
    """Frame counts of every `tstatus` in the output. GDB words it `Collected N` only when the buffer holds every
    frame created (otherwise `Buffer contains N ... (of M created total)`), so these also say none was dropped."""
    return [int(n) for n in re.findall(r"^Collected (\d+) trace frames?\.$", out, re.M)]


def walked(out: str) -> list[WalkedFrame]:
    return [WalkedFrame(*(int(v, 0) for v in match)) for match in re.findall(
        r"^walked frame (\d+) tracepoint (\d+) pc (0x[0-9a-f]+) rdi (-?\d+) counter (-?\d+)$", out, re.M)]


def assert_frames_intact(out: str) -> list[WalkedFrame]:
    """The last `tstatus` in `out` counted every frame created, and the walk after it read each of them: numbered
    0..N-1, all at the tracepoint's address, each with its own call's argument and counter, consecutive calls."""
    counts = collected(out)
    assert counts, out
    frames = walked(out)
    assert frames and len(frames) == counts[-1], out
    assert "No trace frame found" in out[out.rindex("walked frame"):], out  # the walk ended at the end, not on an error
    assert [f.number for f in frames] == list(range(len(frames))), out
    assert len({f.tracepoint for f in frames}) == 1, out
    assert all(f.pc == TEST_FUNCTION for f in frames), out
    assert all(f.rdi == f.counter for f in frames), out
    assert [f.counter - frames[0].counter for f in frames] == list(range(len(frames))), out
    return frames


def assert_running_and_growing(client: GdbClient, stub: StubProcess) -> int:
    """A fresh GDB finds the run still going, and a later one finds more frames; returns the last count seen."""
    out = attach(client, stub, "tstatus")
    assert "Trace is running on the target." in out, out
    (first,) = collected(out)
    deadline = time.monotonic() + 10
    while True:
        out = attach(client, stub, "tstatus")
        assert "Trace is running on the target." in out, out
        (now,) = collected(out)
        if now > first:
            return now
        assert time.monotonic() < deadline, f"no new frame in 10 s after {first}:\n{out}"


def stop_and_check(client: GdbClient, stub: StubProcess, at_least: int) -> list[WalkedFrame]:
    """Stop a run that survived the fault and check it kept every frame, including those collected meanwhile."""
    out = attach(client, stub, "tstop", "tstatus", *WALK_COMMANDS)
    assert "Trace stopped by a tstop command" in out, out
    frames = assert_frames_intact(out)
    assert len(frames) >= at_least, out
    return frames


def stopped_by_disconnection(client: GdbClient, stub: StubProcess) -> list[WalkedFrame]:
    """A fresh GDB finds the run stopped because its GDB went away, with every frame of it readable."""
    out = attach(client, stub, "tstatus", *WALK_COMMANDS)
    assert "Trace stopped because of disconnection." in out, out
    return assert_frames_intact(out)


@pytest.fixture
def paced_stub() -> Iterator[StubProcess]:
    """A stub of its own with one `kgtp_test_function` call per tick: runs of a second or two stay a few hundred
    frames, so walking all of them takes well under a second."""
    server = start_stub("--pace", "1", cpus=1)
    yield server
    server.stop()


def disconnected_tracing(on: bool) -> tuple[str, ...]:
    return ("set disconnected-tracing on",) if on else ()


# ---- GDB killed in the middle of things ------------------------------------------------------------------------

@pytest.mark.parametrize("keep_tracing", [False, True], ids=["stops", "disconnected-tracing"])
def test_gdb_killed_mid_packet_during_a_run(gdb: GdbClient, paced_stub: StubProcess, tmp_path: Path,
                                            keep_tracing: bool) -> None:
    """GDB dies halfway through a memory read while its run collects: the half packet is dropped, the run stops
    as a disconnection (or goes on, if asked), and the frames collected up to then are all there."""
    proxy = kill_gdb_at(gdb, paced_stub, Cut(b"$m%x," % JIFFIES, half),
                        (*disconnected_tracing(keep_tracing), *TRACE_COMMANDS, "tstart", "shell sleep 0.2",
                         "print jiffies"), tmp_path)
    read = encode_packet(b"m%x,8" % JIFFIES)
    assert b"QTStart" in proxy.requests() and proxy.delivered.endswith(read[: len(read) // 2]), proxy.requests()
    if keep_tracing:
        stop_and_check(gdb, paced_stub, assert_running_and_growing(gdb, paced_stub))
    else:
        stopped_by_disconnection(gdb, paced_stub)


@pytest.mark.parametrize(("cut", "keep_tracing", "outcome"), [
    pytest.param(Cut(b"$QTDP:", half), False, "not run", id="inside-the-tracepoint-definition"),
    pytest.param(Cut(b"$QTDP:-", half), False, "not run", id="inside-the-actions"),
    pytest.param(Cut(b"$QTStart", first_bytes(5)), False, "not run", id="inside-QTStart"),
    pytest.param(Cut(b"$QTStart", whole, linger=0.3), False, "stopped", id="QTStart-unanswered"),
    pytest.param(Cut(b"$QTStart", whole), True, "running", id="QTStart-unanswered-disconnected-tracing"),
])
def test_gdb_killed_mid_tstart(gdb: GdbClient, paced_stub: StubProcess, tmp_path: Path, cut: Cut,
                               keep_tracing: bool, outcome: str) -> None:
    """GDB dies while `tstart` downloads the experiment. Until the stub has the whole `QTStart` nothing may run,
    and the next GDB starts a run of its own cleanly, untouched by the half-received download; once the stub has
    it, the run is an ordinary one that lost its GDB."""
    kill_gdb_at(gdb, paced_stub, cut, (*disconnected_tracing(keep_tracing), *TRACE_COMMANDS, "tstart"), tmp_path)
    if outcome == "not run":
        out = attach(gdb, paced_stub, "tstatus", "delete", *TRACE_COMMANDS, "tstart", *wait_for_hits("$tpnum"), "tstop",
                     "tstatus", *WALK_COMMANDS)
        assert "No trace has been run on the target." in out and collected(out)[0] == 0, out
        assert "Trace stopped by a tstop command" in out, out
        assert_frames_intact(out)
    elif outcome == "stopped":
        stopped_by_disconnection(gdb, paced_stub)
    else:
        stop_and_check(gdb, paced_stub, assert_running_and_growing(gdb, paced_stub))


@pytest.mark.parametrize("keep_tracing", [False, True], ids=["stops", "disconnected-tracing"])
def test_gdb_killed_mid_qtbuffer(gdb: GdbClient, paced_stub: StubProcess, tmp_path: Path,
                                 keep_tracing: bool) -> None:
    """GDB dies halfway through the second `qTBuffer` request of a `tsave`, after the stub served the first
    chunk. The next GDB's `tsave` must get the whole buffer, not a remnant of the aborted upload: the file it
    writes shows, offline, exactly the frames the target shows live."""
    proxy = kill_gdb_at(gdb, paced_stub, Cut(b"$qTBuffer:", half, occurrence=2),
                        (*disconnected_tracing(keep_tracing), *TRACE_COMMANDS, "tstart", "shell sleep 0.2",
                         f"tsave {tmp_path / 'aborted.tf'}"), tmp_path)
    uploads = [r.split(b",")[0] for r in proxy.requests() if r.startswith(b"qTBuffer:")]
    assert uploads == [b"qTBuffer:0"], proxy.requests()  # the first chunk was served, the second cut
    if keep_tracing:
        running = assert_running_and_growing(gdb, paced_stub)
        stop, expected_stop = ("tstop",), "Trace stopped by a tstop command"
    else:
        running, stop, expected_stop = 0, (), "Trace stopped because of disconnection."
    saved = tmp_path / "complete.tf"
    live = attach(gdb, paced_stub, *stop, f"tsave {saved}", "tstatus", *WALK_COMMANDS)
    assert expected_stop in live, live
    frames = assert_frames_intact(live)
    assert len(frames) >= running, live
    offline = run_gdb(gdb, None, f"target tfile {saved}", "tstatus", *WALK_COMMANDS, attach=False)
    assert walked(offline) == frames, offline


# ---- other clients ---------------------------------------------------------------------------------------------

def test_second_client_is_refused_while_the_first_keeps_its_run(gdb: GdbClient, paced_stub: StubProcess,
                                                                tmp_path: Path) -> None:
    """A second debugger gets a clear refusal and nothing else: the attached GDB's run neither stops nor loses a
    frame, since a refused connection is not the attached client disconnecting."""
    started, resume = tmp_path / "started", tmp_path / "resume"
    script = tmp_path / "first.gdb"
    script.write_text("\n".join(session_lines(paced_stub.address, [
        *TRACE_COMMANDS, "tstart",
        f"shell touch {started}",
        f"shell for i in $(seq 1000); do [ -e {resume} ] && break; sleep 0.01; done",
        "tstatus", "tstop", "tstatus", *WALK_COMMANDS])) + "\n")
    first = start_gdb(gdb, "-x", str(script), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not started.exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first GDB never started its run"
            time.sleep(0.02)
        second = run_gdb(gdb, paced_stub, "tstatus")
        assert BUSY in second and "Trace is running" not in second, second
        with RspClient.connect(paced_stub.port, timeout=5) as raw:
            raw.send(b"qSupported")
            assert raw.packet() == b"E.kgtp-sim: " + BUSY.encode()
            assert raw.sock.recv(4096) == b""  # and it hangs up
        resume.touch()
        out, _ = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert "Trace is running on the target." in out, out
    assert "Trace stopped by a tstop command" in out, out
    assert_frames_intact(out)


@pytest.mark.slow
def test_a_client_that_sends_nothing_does_not_lock_out_the_debugger(paced_stub: StubProcess) -> None:
    """Anything on the machine can open the port and say nothing (a port scanner, a stuck script). It must not
    keep the user's GDB out: a connection that has not sent its first byte within SILENT_CLIENT_LIMIT seconds is
    not a debugger and is hung up on, after which GDB attaches."""
    client = GDB_CLIENTS[0]
    with socket.create_connection(("127.0.0.1", paced_stub.port), timeout=5) as silent:
        silent.settimeout(SILENT_CLIENT_LIMIT)
        try:
            hung_up = silent.recv(1) == b""
        except TimeoutError:
            hung_up = False
        assert hung_up, f"the stub still holds a connection silent for {SILENT_CLIENT_LIMIT} s"
        out = attach(client, paced_stub, "tstatus", deadline=2)
    assert "No trace has been run on the target." in out, out


def _storm_connect(index: int, port: int) -> bytes | None:
    """One connection of the storm. One in four asks qSupported and returns the answer; the others close at once
    (with a reset, or gracefully) or send half a packet and close."""
    with RspClient.connect(port, timeout=5) as client:
        kind = index % 4
        if kind == 0:
            client.send(b"qSupported")
            try:
                return client.packet()
            except ConnectionError:  # hung up without a word
                return None
        if kind == 1:
            client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        elif kind == 2:
            packet = encode_packet(b"qTStatus")
            client.send_raw(b"+" + packet[: len(packet) // 2])
        return None


def _open_files_and_threads(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def test_reconnect_storm_leaves_the_stub_serving_and_the_run_intact(paced_stub: StubProcess) -> None:
    """Hundreds of short connections (answered, refused, reset, cut mid-packet) while a run goes on under
    disconnected tracing: each is answered or dropped promptly, none leaks a socket or a thread, the run keeps
    collecting through all of them, and afterwards GDB attaches and reads every frame."""
    client = GDB_CLIENTS[0]
    attach(client, paced_stub, "set disconnected-tracing on", *TRACE_COMMANDS, "tstart")
    before = assert_running_and_growing(client, paced_stub)
    baseline = _open_files_and_threads(paced_stub.proc.pid)

    began = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(_storm_connect, range(STORM_CONNECTS), [paced_stub.port] * STORM_CONNECTS))
    elapsed = time.monotonic() - began
    assert elapsed < STORM_TIME_LIMIT, f"{STORM_CONNECTS} connections took {elapsed:.1f} s"
    asked = answers[::4]
    served = [a for a in asked if a is not None and a.startswith(b"PacketSize=")]
    refused = [a for a in asked if a == b"E.kgtp-sim: " + BUSY.encode()]
    assert len(served) + len(refused) == len(asked) and served, asked  # every question answered, some served
    assert paced_stub.proc.poll() is None, "".join(paced_stub.output)

    deadline = time.monotonic() + 10
    while (now := _open_files_and_threads(paced_stub.proc.pid)) > baseline:
        assert time.monotonic() < deadline, f"open files and threads {now}, before the storm {baseline}"
        time.sleep(0.05)

    during = assert_running_and_growing(client, paced_stub)
    assert during > before, f"{before} frames before the storm, {during} after"
    stop_and_check(client, paced_stub, during)


# ---- state one client leaves for the next ----------------------------------------------------------------------

def test_frame_selected_by_a_killed_gdb_is_not_selected_for_the_next(gdb: GdbClient, paced_stub: StubProcess,
                                                                      tmp_path: Path) -> None:
    """GDB dies while looking at frame 5 of a stopped run. The next GDB starts, as always, looking at no frame,
    so its first search must consider every frame from 0."""
    kill_gdb_at(gdb, paced_stub, Cut(b"$m%x," % KGTP_COUNTER, half),
                (*TRACE_COMMANDS, "tstart", *wait_for_hits(1, 6), "tstop", "tfind 5", "print kgtp_counter"), tmp_path)
    out = attach(gdb, paced_stub, "tstatus", "tfind tracepoint 1")
    assert "Not looking at any trace frame." in out, out
    assert re.search(r"^Found trace frame 0, tracepoint 1$", out, re.M), out


def test_strace_after_a_gdb_killed_mid_tstart_is_safe(gdb: GdbClient, paced_stub: StubProcess,
                                                      tmp_path: Path) -> None:
    """A download that never reached QTStart must not leave the stub thinking one is still in progress: the next
    GDB's `strace` has to get the same answer as on a stub that never saw the dead GDB."""
    kill_gdb_at(gdb, paced_stub, Cut(b"$QTStart", first_bytes(5)), (*TRACE_COMMANDS, "tstart"), tmp_path)
    out = attach(gdb, paced_stub, f"strace *{KGTP_EVENT_SITE:#x}", "info tracepoints")
    assert "Fatal signal" not in out and "internal-error" not in out, out
    assert "Couldn't determine the static tracepoint marker to probe" in out, out
    assert re.search(r"^\d+\s+static tracepoint\s+keep y\s+0x0*%x " % KGTP_EVENT_SITE, out, re.M), out
