"""Recording a run to disk beside GDB (`kgtp-sim record`, issue 27), end to end with real GDB: the recorded trace
read back by babeltrace2 and by `kgtp-sim export`, frame for frame what GDB's tdump shows; the ring as GDB's flight
recorder while a recorder is attached; a recorder that cannot keep up counting what it lost; a recorder killed
in the middle of a run leaving a readable trace and the run going on.

Every wait is for an event (a line from the recorder, a pass count ending the run, hits), never a time window.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading

import pytest

from ..conftest import ROOT, run_gdb, start_stub, wait_for_hits, wait_for_trace_stop
from .test_view import GENERAL, compare_with_tdump, follow_port, kgtp, parse_tdump

pytestmark = pytest.mark.gdb

TDUMP_ALL = (
    "python",
    "import re",
    "count = int(re.search(r'Buffer contains (\\d+)|Collected (\\d+)', gdb.execute('tstatus', to_string=True))"
    ".group(0).split()[-1])",
    "for index in range(count):",
    "    gdb.execute(f'tfind {index}', to_string=True)",
    "    print(gdb.execute('tdump', to_string=True), end='')",
    "print('END-OF-TDUMP')",
    "end",
    "tfind none",
)

#: GDB waits until tstatus no longer says a recorder is attached.
RECORDER_GONE = (
    "python",
    "import time",
    "deadline = time.monotonic() + 60",
    "while 'kgtp-sim record attached' in gdb.execute('tstatus', to_string=True):",
    "    if time.monotonic() > deadline:",
    "        raise gdb.GdbError('the recorder is still attached')",
    "    time.sleep(0.05)",
    "end",
)


@pytest.fixture
def record_stub():
    server = start_stub()
    yield server
    server.stop()


def babeltrace():
    found = shutil.which("babeltrace2")
    if found is None:
        pytest.fail("babeltrace2 is missing: scripts/test installs Debian's package")
    return found


class Recorder:
    """`kgtp-sim record` as a user runs it beside GDB; `attached` once it is waiting for (or recording) a run."""

    def __init__(self, stub, directory, *options: str) -> None:
        self.directory = directory
        self.proc = subprocess.Popen([sys.executable, "-m", "kgtp_sim", "record", "-o", str(directory), "--port",
                                      str(follow_port(stub)), *options], cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.attached = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if "waiting for tstart" in line or "recording the run" in line:
                self.attached.set()

    def finish(self, timeout: float = 60) -> str:
        self.proc.wait(timeout)
        self.proc.stdout.close()
        return "\n".join(self.lines)

    def summary(self) -> tuple[int, int]:
        text = "\n".join(self.lines)
        found = re.search(r"record: (\d+) frames in .*?, (\d+) lost", text)
        assert found, text
        return int(found.group(1)), int(found.group(2))


def read_back(directory, tmp_path) -> list[dict]:
    """The recorded trace as `kgtp-sim export` writes it in JSON lines."""
    out = tmp_path / f"{directory.name}.jsonl"
    result = kgtp("export", str(directory), "--format", "jsonl", "-o", str(out))
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_a_recorded_run_is_read_back_as_gdb_sees_it(gdb, record_stub, tmp_path):
    recorder = Recorder(record_stub, tmp_path / "run")
    assert recorder.attached.wait(60), recorder.lines
    out = run_gdb(gdb, record_stub, "monitor pace 2", "trace kgtp_test_function", "actions",
                  "collect $regs, kgtp_counter", "end", "passcount 150", "tstart", *wait_for_trace_stop(120),
                  "tstatus", *TDUMP_ALL, timeout=240)
    errors = recorder.finish()
    assert "END-OF-TDUMP" in out and "Trace stopped by tracepoint 1" in out, out[-3000:]
    assert recorder.proc.returncode == 0, errors
    assert recorder.summary() == (150, 0), errors
    # tstatus says a recorder drained the run (what it had reported when GDB asked: it may still have been writing
    # the last frames); the ring held every frame too, so GDB sees all of them
    noted = re.search(r"Trace notes: kgtp-sim record.*: (\d+) frames recorded, 0 lost", out)
    assert noted and 0 < int(noted.group(1)) <= 150, out
    assert "Trace buffer is circular." in out, out
    dumped = parse_tdump(out)
    assert len(dumped) == 150, out[-3000:]

    records = read_back(recorder.directory, tmp_path)
    assert [r["frame"] for r in records] == list(range(150))
    compared = sum(compare_with_tdump(r, dumped[r["frame"]]) for r in records)
    assert compared == 150 * (len(GENERAL) + 1)  # every register and kgtp_counter of every frame
    times = [r["time_ns"] for r in records]
    assert times == sorted(times) and times[0] >= 0

    # babeltrace2 lists every event with its fields named; each CPU's sequence numbers run without a gap
    read = subprocess.run([babeltrace(), str(recorder.directory)], capture_output=True, text=True, timeout=120)
    assert read.returncode == 0 and not read.stderr, read.stderr
    events = read.stdout.splitlines()
    assert len(events) == 150
    sequences: dict[int, list[int]] = {}
    for line, record in zip(events, records, strict=True):
        match = re.match(r"^\[[\d:.]+\] \([^)]*\) \S+ kgtp_test_function: \{ cpu_id = (\d+) \}, \{ seq = (\d+), .*\}, "
                         r"\{ regs_block = \"R\", (.*) \}$", line)
        assert match, line
        values = dict(re.findall(r'(\w+) = ("[^"]*"|[^,]+)(?:, |$)', match.group(3)))
        assert int(match.group(1)) == record["cpu"]
        assert int(values["regs_rip"], 16) == record["fields"]["$regs"]["rip"]
        assert int(values["kgtp_counter"]) == record["fields"]["kgtp_counter"]
        sequences.setdefault(int(match.group(1)), []).append(int(match.group(2)))
    for cpu, numbers in sequences.items():
        assert numbers == list(range(len(numbers))), cpu


def test_with_a_recorder_the_ring_is_gdbs_flight_recorder(gdb, record_stub, tmp_path):
    """A 16 KiB linear buffer a CPU holds some 49 register frames. With a recorder attached the run does not
    stop full: it reaches its pass count of 400, the recorder has every frame, and GDB finds the latest ones,
    as in circular mode; tstatus says so."""
    recorder = Recorder(record_stub, tmp_path / "flight")
    assert recorder.attached.wait(60), recorder.lines
    out = run_gdb(gdb, record_stub, "monitor pace 2", "set trace-buffer-size 16384", "set circular-trace-buffer off",
                  "trace kgtp_test_function", "actions", "collect $regs, kgtp_counter", "end", "passcount 400",
                  "tstart", *wait_for_trace_stop(180), "tstatus", *TDUMP_ALL, "echo SECOND-RUN\\n",
                  # without a recorder nothing changes: once it has left (it does when the run stops), the same
                  # buffer, linear, stops the next run full
                  *RECORDER_GONE, "tstart", *wait_for_trace_stop(180), "tstatus", timeout=400)
    out, again = out.split("SECOND-RUN", 1)
    errors = recorder.finish()
    assert "Trace stopped by tracepoint 1" in out, out[-3000:]  # the pass count, not a full buffer
    held = re.search(r"Buffer contains (\d+) trace frames \(of 400 created total\)", out)
    assert held and 0 < int(held.group(1)) < 400, out
    assert "Trace buffer is circular." in out and "Trace notes: kgtp-sim record" in out, out
    assert recorder.summary() == (400, 0), errors
    records = read_back(recorder.directory, tmp_path)
    assert len(records) == 400
    # what GDB holds is each CPU's latest frames (each CPU's ring keeps its own): the recording's frames with
    # them, in the same order, value for value
    dumped = parse_tdump(out)
    kept = int(held.group(1))
    counters = [int(dumped[index]["values"]["kgtp_counter"]) for index in range(kept)]
    cpus = sorted({r["cpu"] for r in records})
    for first in range(kept + 1):  # how many of the frames GDB holds are the first CPU's
        tails = {cpus[0]: first, cpus[-1]: kept - first} if len(cpus) == 2 else {cpus[0]: kept}
        held_frames = [r for r in records if r["seq"] >= sum(x["cpu"] == r["cpu"] for x in records) - tails[r["cpu"]]]
        if [r["fields"]["kgtp_counter"] for r in held_frames] == counters:
            break
    else:
        raise AssertionError(f"GDB's frames are not the recording's latest: {counters}")
    assert sum(compare_with_tdump(r | {"frame": i}, dumped[i]) for i, r in enumerate(held_frames)) == kept * 25
    assert "Trace stopped because the buffer was full" in again, again[-2000:]
    assert "Trace buffer is circular." not in again and "kgtp-sim record" not in again, again[-2000:]


def test_a_recorder_that_falls_behind_counts_every_frame_it_lost(gdb, record_stub, tmp_path):
    """The recorder is stopped (SIGSTOP) while a small circular buffer wraps many times over: the stub's drain
    blocks on the full socket, the ring overwrites what was not read. Every frame is recorded or counted lost,
    in the trace's packets (`events_discarded`, which babeltrace2 reports) as in the summary."""
    recorder = Recorder(record_stub, tmp_path / "behind")
    assert recorder.attached.wait(60), recorder.lines
    recorder.proc.send_signal(signal.SIGSTOP)
    try:
        out = run_gdb(gdb, record_stub, "monitor pace 400", "set trace-buffer-size 65536",
                      "trace kgtp_test_function", "actions", "collect $regs, kgtp_counter", "end", "tstart",
                      *wait_for_hits(1, 60000, timeout=120), "tstop", "tstatus", timeout=240)
    finally:
        recorder.proc.send_signal(signal.SIGCONT)
    errors = recorder.finish()
    created = int(re.search(r"\(of (\d+) created total\)", out).group(1))
    recorded, lost = recorder.summary()
    assert lost > 0 and recorded + lost == created, (errors, created)
    read = subprocess.run([babeltrace(), str(recorder.directory)], capture_output=True, text=True, timeout=300)
    assert read.returncode == 0, read.stderr[-3000:]
    assert len(read.stdout.splitlines()) == recorded
    assert "discarded" in read.stderr, read.stderr[-2000:]
    # the reader counts them too: each CPU's sequence numbers skip exactly the lost frames
    records = read_back(recorder.directory, tmp_path)
    gaps = 0
    for cpu in {r["cpu"] for r in records}:
        numbers = [r["seq"] for r in records if r["cpu"] == cpu]
        gaps += numbers[0] + sum(b - a - 1 for a, b in zip(numbers, numbers[1:]))
    assert len(records) == recorded and gaps == lost


def test_a_killed_recorder_leaves_a_readable_trace_and_the_run_goes_on(gdb, record_stub, tmp_path):
    recorder = Recorder(record_stub, tmp_path / "killed")
    assert recorder.attached.wait(60), recorder.lines
    out = run_gdb(gdb, record_stub, "monitor pace 20", "trace kgtp_test_function", "actions",
                  "collect $regs, kgtp_counter", "end", "tstart", *wait_for_hits(1, 2000, timeout=120),
                  f"shell kill -9 {recorder.proc.pid}", *wait_for_hits(1, 500, more=True, timeout=120), "tstatus",
                  "tstop", "tstatus", timeout=240)
    recorder.finish()
    assert recorder.proc.returncode == -signal.SIGKILL
    # the run went on after the recorder died, and tstatus says what it got
    assert "Trace is running on the target." in out, out[-3000:]
    notes = re.search(r"Trace notes: kgtp-sim record detached after (\d+) frames \((\d+) lost\)", out)
    assert notes and int(notes.group(1)) > 0, out[-3000:]
    # whatever packets it wrote are whole: babeltrace2 and the export read them all
    read = subprocess.run([babeltrace(), str(recorder.directory)], capture_output=True, text=True, timeout=120)
    assert read.returncode == 0, read.stderr[-3000:]
    events = len(read.stdout.splitlines())
    assert 0 < events <= int(notes.group(1))
    assert len(read_back(recorder.directory, tmp_path)) == events
