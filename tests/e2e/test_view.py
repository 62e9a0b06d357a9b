"""Seeing a trace, end to end with real GDB: follow beside a tracing GDB, exports compared field by field with
tdump of the same frames (CTF read back by babeltrace2, Chrome JSON by json.load, JSON lines), pictures and
hotcode from real runs.

Every wait is for an event (a passcount ending the run, a line from follow, a reply), never a time window.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest

from ..conftest import ROOT, VMLINUX, run_gdb, start_stub, wait_for_hits, wait_for_trace_stop

pytestmark = pytest.mark.gdb

SITE_OFFSET = 7  # the kgtp_module_event marker's NOP inside kgtp_test_function
EXPR = "(2*counter1+3*counter2)"
GENERAL = ("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10", "r11", "r12", "r13", "r14",
           "r15", "rip", "eflags", "cs", "ss", "ds", "es", "fs", "gs")


@pytest.fixture
def view_stub():
    server = start_stub()
    yield server
    server.stop()


def follow_port(stub) -> int:
    for line in stub.output:
        match = re.search(r"follow channel \(read-only\) on [\d.]+:(\d+)", line)
        if match:
            return int(match.group(1))
    raise AssertionError("no follow channel announced:\n" + "".join(stub.output))


def kgtp(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kgtp_sim", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def marker_site() -> int:
    from kgtp_sim.machine import KernelImage

    image = KernelImage.load(VMLINUX)
    return next(m.site for m in image.markers if m.id == "module::kgtp_module_event")


def traced_run(gdb, stub, *after: str) -> str:
    """A real run that ends by itself: tracepoint 1 on kgtp_test_function, 2 on load_module (its pass count of 2
    stops the run), 3 a static tracepoint on kgtp_module_event; then tdump of every frame."""
    site = marker_site()
    return run_gdb(
        gdb, stub, "monitor pace 2",
        f"trace kgtp_test_function if {EXPR[:-1]}>0)", "actions", f"collect {EXPR}", "collect $regs",
        "collect kgtp_counter, jiffies", "end",
        "trace load_module", "passcount 2", "actions", "collect taints, nr_modules_loaded, modules[0].taints",
        "collect $args", "collect/s name", "end",
        f"strace *{site:#x}", "actions", "collect $_sdata", "end",
        "tstart", *wait_for_trace_stop(timeout=60), "tstatus",
        "python",
        "import re",
        "count = int(re.search(r'Collected (\\d+) trace frames', gdb.execute('tstatus', to_string=True)).group(1))",
        "for index in range(count):",
        "    gdb.execute(f'tfind {index}', to_string=True)",
        "    print(gdb.execute('tdump', to_string=True), end='')",
        "    if gdb.selected_frame().pc() == " + str(site) + ":",
        "        print('$_sdata = ' + str(gdb.parse_and_eval('$_sdata')))",
        "print('END-OF-TDUMP')",
        "end",
        "tfind none",
        *after,
        timeout=180,
    )


def parse_tdump(out: str) -> dict[int, dict]:
    """frame number -> {'tp': n, 'values': {text: first token}, 'registers': {...}, 'sdata': str}."""
    frames: dict[int, dict] = {}
    current = None
    for line in out.splitlines():
        header = re.match(r"Data collected at tracepoint (\d+), trace frame (\d+):", line)
        if header:
            current = frames[int(header.group(2))] = {"tp": int(header.group(1)), "values": {}, "registers": {}}
            continue
        if current is None:
            continue
        register = re.match(r"^([a-z0-9]+)\s+(0x[0-9a-f]+)\s", line)
        if register and register.group(1) in GENERAL:
            current["registers"][register.group(1)] = int(register.group(2), 16)
            continue
        sdata = re.match(r'^\$_sdata = "(.*)"$', line)
        if sdata:
            current["sdata"] = sdata.group(1)
            continue
        value = re.match(r"^(\S.*?) = (.*)$", line)
        if value:
            current["values"][value.group(1)] = value.group(2)
    return frames


def as_int(text: str) -> int | None:
    token = text.split()[0] if text.split() else ""
    try:
        return int(token, 0)
    except ValueError:
        return None


def compare_with_tdump(record: dict, dumped: dict) -> int:
    """Assert that every value tdump shows for a frame is the exported one; returns how many were compared."""
    fields = record["fields"]
    compared = 0
    assert record["tracepoint"] == dumped["tp"]
    for name, value in dumped["registers"].items():
        assert fields["$regs"][name] == value, (record["frame"], name)
        compared += 1
    for text, shown in dumped["values"].items():
        number = as_int(shown)
        if text in fields:
            exported = fields[text]
        elif "$args" in fields and text in fields["$args"]:
            exported = fields["$args"][text]
        else:
            continue
        if isinstance(exported, str):  # collect/s: tdump shows the pointer then the string
            assert f'"{exported}"' in shown, (record["frame"], text, shown)
        else:
            assert number is not None and exported == number, (record["frame"], text, shown, exported)
        compared += 1
    if "sdata" in dumped:
        assert record["sdata"] == dumped["sdata"]
        for pair in dumped["sdata"].split():
            key, _, number = pair.partition("=")
            assert fields["$_sdata"][key] == int(number), (record["frame"], pair)
            compared += 1
    return compared


def test_export_matches_tdump_for_every_frame(gdb, view_stub, tmp_path):
    out = traced_run(gdb, view_stub, f"tsave {tmp_path / 'run.tf'}")
    assert "END-OF-TDUMP" in out and "Trace stopped by tracepoint 2" in out, out[-3000:]
    dumped = parse_tdump(out)
    total = int(re.search(r"Collected (\d+) trace frames", out).group(1))
    assert len(dumped) == total and total > 10, out[-3000:]
    assert {d["tp"] for d in dumped.values()} == {1, 2, 3}, out[-3000:]
    port = str(follow_port(view_stub))

    # JSON lines from the running stub: every frame, every value tdump shows
    result = kgtp("export", "--port", port, "--format", "jsonl", "-o", str(tmp_path / "run.jsonl"))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [r["frame"] for r in records] == list(range(total))
    compared = sum(compare_with_tdump(r, dumped[r["frame"]]) for r in records)
    assert compared > 20 * total // 2
    assert all(r["cpu"] is not None and r["time_ns"] is not None for r in records)
    times = [r["time_ns"] for r in records]
    assert times == sorted(times) and times[0] >= 0

    # Chrome trace events, read back with json.load: one instant event per frame, its args the same values
    result = kgtp("export", "--port", port, "--format", "chrome", "-o", str(tmp_path / "run.json"))
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "run.json") as handle:
        document = json.load(handle)
    instants = [e for e in document["traceEvents"] if e["ph"] == "i"]
    assert len(instants) == total
    threads = {e["tid"]: e["args"]["name"] for e in document["traceEvents"] if e.get("name") == "thread_name"}
    for event, record in zip(instants, records, strict=True):
        assert event["args"]["frame"] == record["frame"] and event["tid"] == record["cpu"]
        assert threads[event["tid"]] == f"CPU {record['cpu']}"
        for name, value in record["fields"].items():
            assert event["args"][name] == value
        assert event["ts"] == pytest.approx(record["time_ns"] / 1000)

    # CTF, read by babeltrace2: every event, every field
    babeltrace = shutil.which("babeltrace2")
    if babeltrace is None:
        pytest.fail("babeltrace2 is missing: scripts/test installs Debian's package")
    result = kgtp("export", "--port", port, "--format", "ctf", "-o", str(tmp_path / "ctf"))
    assert result.returncode == 0, result.stderr
    read = subprocess.run([babeltrace, str(tmp_path / "ctf")], capture_output=True, text=True, timeout=120)
    assert read.returncode == 0, read.stderr
    events = read.stdout.splitlines()
    assert len(events) == total
    by_frame = {r["frame"]: r for r in records}
    for line in events:
        match = re.match(r"^\[[\d:.]+\] \([^)]*\) \S+ (\w+): \{ cpu_id = (\d+) \}, \{ (.*) \}$", line)
        assert match, line
        values = dict(re.findall(r'(\w+) = ("[^"]*"|[^,]+)(?:, |$)', match.group(3)))
        record = by_frame[int(values["frame"])]
        assert int(match.group(2)) == record["cpu"]
        assert match.group(1) == record["event"] or match.group(1).startswith(record["event"])
        dump = dumped[record["frame"]]
        fields = record["fields"]
        if record["tracepoint"] == 1:
            assert int(values["x2_counter1_3_counter2"]) == as_int(dump["values"][EXPR])
            assert int(values["kgtp_counter"]) == as_int(dump["values"]["kgtp_counter"])
            for name in GENERAL:
                assert int(values[f"regs_{name}"], 16) == dump["registers"][name] == fields["$regs"][name]
        elif record["tracepoint"] == 3:
            for pair in dump["sdata"].split():
                key, _, number = pair.partition("=")
                assert int(values[key]) == int(number)
        else:
            assert int(values["taints"]) == as_int(dump["values"]["taints"])
            assert int(values["modules_0_taints"]) == as_int(dump["values"]["modules[0].taints"])
            assert values["name_"] == f'"{fields["name"]}"'  # `name` is a TSDL keyword

    # the same run from the file tsave wrote: same values, CPUs and times (saved as $cpu_id and $clock), without
    # $_sdata; times count from the file's first frame instead of tstart
    result = kgtp("export", "--file", str(tmp_path / "run.tf"), "--format", "jsonl", "-o", str(tmp_path / "tf.jsonl"))
    assert result.returncode == 0, result.stderr
    assert "carry no" not in result.stderr, result.stderr
    saved = [json.loads(line) for line in (tmp_path / "tf.jsonl").read_text().splitlines()]
    assert len(saved) == total
    for record, live in zip(saved, records, strict=True):
        assert record["cpu"] == live["cpu"] and record["tracepoint"] == live["tracepoint"]
        elapsed, live_elapsed = record["time_ns"] - saved[0]["time_ns"], live["time_ns"] - records[0]["time_ns"]
        assert abs(elapsed - live_elapsed) <= 2 + live_elapsed // 1_000_000, (record["frame"], elapsed, live_elapsed)
        for name, value in live["fields"].items():
            if name == "$_sdata":
                assert record["fields"][name] is None and "tsave" in record["unavailable"][name]
            else:
                assert record["fields"][name] == value, (record["frame"], name)


class Follower:
    """`kgtp-sim follow` as a user runs it, its lines collected by a thread; `ready` once it has had its first
    look at the run, `stopped` once it printed the end of a run."""

    def __init__(self, stub, *options: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kgtp_sim", "follow", "--port", str(follow_port(stub)),
                                      *options], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.ready, self.stopped = threading.Event(), threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("-- trace run"):
                self.ready.set()
            if "-- trace run stopped" in line:
                self.stopped.set()

    def interrupt(self) -> str:
        """Ctrl-C, as a user ends it; returns what it printed on stderr (the summary)."""
        self.proc.send_signal(2)
        return self.proc.communicate(timeout=30)[1]


def test_follow_shows_a_live_run_while_gdb_traces(gdb, view_stub):
    follower = Follower(view_stub)
    lines = follower.lines
    try:
        assert follower.ready.wait(60), lines  # the follower is connected and has had its first look
        out = run_gdb(gdb, view_stub, "monitor pace 2", f"trace kgtp_test_function if {EXPR[:-1]}>0)", "actions",
                      f"collect {EXPR}", "collect kgtp_counter", "end", "passcount 25",
                      # while the run goes on, GDB stays attached and reads frames: the channels coexist
                      "tstart", *wait_for_hits(1, 5), "tstatus", *wait_for_trace_stop(), "tstatus",
                      "tfind 0", "tdump", "tfind 24", "tdump")
        assert follower.stopped.wait(60), "\n".join(lines)
    finally:
        errors = follower.interrupt()
    assert follower.proc.returncode == 0, errors
    assert "Collected 25 trace frames" in out, out
    frames = [line for line in lines if re.match(r"^\+\d+\.\d{9} cpu \d+ tp 1 ", line)]
    assert len(frames) == 25, "\n".join(lines)
    dumped = parse_tdump(out)
    for index in (0, 24):
        expected = dumped[index]["values"]
        assert f"{EXPR}={expected[EXPR]}" in frames[index], (frames[index], expected)
        assert f"kgtp_counter={expected['kgtp_counter']}" in frames[index]
    stamps = [float(line.split()[0]) for line in frames]
    assert stamps == sorted(stamps) and stamps[0] > 0
    assert re.search(r"followed 25 frames \(\d+/s\), missed 0", errors), errors
    # GDB still has every frame the follower printed: reading never consumed
    again = run_gdb(gdb, view_stub, "tstatus", "tfind 24", "tdump")
    assert "Collected 25 trace frames" in again and f"{EXPR} = {dumped[24]['values'][EXPR]}" in again, again


def test_a_consuming_follower_keeps_a_linear_buffer_from_filling(gdb, view_stub):
    """`follow --consume` (KGTP's frame pipe): frames shown leave the buffer. A 16 KiB linear buffer holds a few
    dozen register frames; with the consuming follower the run reaches its pass count of 400 instead of stopping
    full, the follower shows every frame, and GDB finds only what was not consumed yet."""
    follower = Follower(view_stub, "--consume")
    try:
        assert follower.ready.wait(60), follower.lines  # connected, and has had its first look
        out = run_gdb(gdb, view_stub, "monitor pace 2", "set trace-buffer-size 16384",
                      "trace kgtp_test_function", "actions", "collect $regs", "end", "passcount 400",
                      "tstart", *wait_for_trace_stop(120), "tstatus")
        assert follower.stopped.wait(60), follower.lines
    finally:
        errors = follower.interrupt()
    assert "Trace stopped by tracepoint 1" in out, out  # the pass count, not a full buffer
    held = re.search(r"Buffer contains (\d+) trace frames \(of 400 created total\)", out)
    assert held and int(held.group(1)) < 400, out  # consumed frames are gone for GDB
    assert re.search(r"followed 400 frames \(\d+/s\), missed 0", errors), errors


def test_follow_counts_frames_a_circular_buffer_overwrote(gdb, one_cpu_stub):
    view_stub = one_cpu_stub
    """A follower that cannot keep up (stopped reading) is told how many frames it missed."""
    import socket

    port = follow_port(view_stub)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b'{"op": "follow"}\n')
    reader = sock.makefile("rb")
    assert json.loads(reader.readline())["t"] == "run"
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    run_gdb(gdb, view_stub, "monitor pace 50", "set trace-buffer-size 16384", "set circular-trace-buffer on",
            "trace kgtp_test_function", "actions", "collect $regs", "end", "tstart", *wait_for_hits(1, 3000),
            "tstop", "tstatus")
    seen, missed = [], 0
    while True:
        message = json.loads(reader.readline())
        if message["t"] == "frame":
            seen.append(message["seq"])
        elif message["t"] == "missed":
            missed += message["count"]
        elif message["t"] == "stopped":
            created = message["created"]
            break
    sock.close()
    assert len(seen) + missed == created and missed > 0  # every frame is either shown or counted
    assert seen == sorted(seen)


def test_follow_channel_refuses_anything_but_reading(view_stub):
    import socket

    from kgtp_sim.rsp.codec import encode_packet

    port = follow_port(view_stub)
    for request in (encode_packet(b"QTinit") + b"\n", b'{"op": "start"}\n'):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(request)
            reply = json.loads(sock.makefile("rb").readline())
        assert reply["t"] == "error" and "read-only" in reply["message"]


def test_plot_and_hotcode_from_a_real_run(gdb, view_stub, tmp_path):
    out = run_gdb(gdb, view_stub, "monitor pace 2", "trace schedule", "actions", "collect $regs, $bt", "end",
                  "trace kgtp_test_function", "actions", f"collect {EXPR}", "end",
                  "tstart", *wait_for_hits(1, 40), "tstop", "tstatus")
    assert "Trace stopped by a tstop command" in out, out
    port = str(follow_port(view_stub))
    result = kgtp("plot", "--port", port, "-o", str(tmp_path / "pictures"), "--value", EXPR)
    assert result.returncode == 0, result.stderr
    for name in ("timeline.png", "distribution.png", "flamegraph.png"):
        data = (tmp_path / "pictures" / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, name

    from kgtp_sim.view.channel import snapshot
    from kgtp_sim.view.fields import FrameReader
    from kgtp_sim.view.plot import stacks

    trace = snapshot("127.0.0.1", int(port))
    folded = stacks(trace, FrameReader.open(trace, VMLINUX))
    assert sum(folded.values()) >= 40
    # the workload thread sleeps through schedule(): GDB's own backtrace shows the same chain
    assert any(stack[-3:] == ("kgtp_bench_thread", "msleep_ticks", "schedule") for stack in folded), folded

    # hotcode needs the debugger slot; wait for the last GDB to have been let go, then sample 30 ticks
    deadline = time.monotonic() + 30
    while True:
        result = kgtp("hotcode", "--port", str(view_stub.port), "--follow-port", port, "--samples", "30",
                      "--png", str(tmp_path / "hot.png"))
        if result.returncode == 0 or "another debugger" not in result.stderr or time.monotonic() > deadline:
            break
    assert result.returncode == 0, result.stderr
    # every CPU takes its own ticks: the samples are shared among them
    assert re.search(r"^30 timer-tick samples \(CPU \d+: \d+(, CPU \d+: \d+)*\)", result.stdout, re.M), result.stdout
    assert re.search(r"^\s+\d+\s+[\d.]+\s+cpu_idle$", result.stdout, re.M), result.stdout
    assert (tmp_path / "hot.png").read_bytes().startswith(b"\x89PNG")
