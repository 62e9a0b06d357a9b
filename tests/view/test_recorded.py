"""Recorded traces without a stub: the recorder's writer fed ring entries as the follow channel's drain sends
them, read back by the recorded-trace reader and by babeltrace2; losses counted in the packets; LTTng-style
rotation; a write that fails (a full disk) leaves whole packets and counts what it dropped; a tsave'd file read
a piece at a time gives the frames it holds."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import textwrap

import pytest

from kgtp_sim.tracing.core.ring import PAD_CPU, align8
from kgtp_sim.view import sources
from kgtp_sim.view.ctf import read_packets, stream_files
from kgtp_sim.view.record import Recorder
from kgtp_sim.view.sources import batches, load_tfile, open_recorded, open_tfile

from ..conftest import ROOT, VMLINUX
from .test_bulk import compact, memory, registers
from .test_view_units import frame_body

TICKS_PER_NS = 2.5
ORIGIN = 10_000_000
RUN = {"t": "run", "running": True, "start_us": 1_700_000_000_000_000, "ticks_per_ns": TICKS_PER_NS,
       "tsc_origin": ORIGIN, "variables": {},
       "tracepoints": [
           {"number": 1, "address": 0, "enabled": True, "static": False, "marker": None,
            "sources": [{"kind": "at", "source": "kgtp_test_function"},
                        {"kind": "cmd", "source": "collect $regs, kgtp_counter"}]},
           {"number": 2, "address": 0, "enabled": True, "static": False, "marker": None,
            "sources": [{"kind": "at", "source": "kgtp_test_function"},
                        {"kind": "cmd", "source": "collect $rdi, $rsi"}]}]}


@pytest.fixture(scope="module")
def run_message():
    from kgtp_sim.machine.dwarf import KernelDwarf

    dwarf = KernelDwarf(VMLINUX)
    address = dwarf.address_of("kgtp_test_function")
    message = {**RUN, "tracepoints": [{**tp, "address": address} for tp in RUN["tracepoints"]]}
    counter, _ = dwarf.global_variable("kgtp_counter")
    return message, address, counter


def entry(tracepoint: int, cpu: int, seq: int, stamp: int, blocks: bytes) -> bytes:
    length = align8(30 + len(blocks))
    return (struct.pack("<IIQQHI", length, cpu, stamp, seq, tracepoint, len(blocks)) + blocks).ljust(length, b"\0")


def padding(length: int) -> bytes:
    return struct.pack("<II", length, PAD_CPU).ljust(length, b"\xaa")


class Frames:
    """Frames made for a CPU, as a ring holds them, and what they were."""

    def __init__(self, address: int, counter: int) -> None:
        self.address, self.counter = address, counter
        self.made: list[tuple[int, int, int, int, bytes]] = []  # tracepoint, cpu, seq, stamp, blocks
        self.sequence: dict[int, int] = {}

    def make(self, cpu: int, count: int, skip: int = 0) -> bytes:
        """`count` frames of `cpu` after `skip` lost ones; every fifth is tracepoint 2's compact registers."""
        out = b""
        seq = self.sequence.get(cpu, 0) + skip
        for _ in range(count):
            stamp = ORIGIN + 1000 * (2 * seq + cpu) + 7
            if seq % 5 == 4:
                tracepoint, blocks = 2, compact({"rdi": seq, "rsi": cpu, "rip": self.address})
            else:
                tracepoint = 1
                blocks = frame_body(registers(rdi=seq, rsi=cpu, rip=self.address))
                blocks += memory(self.counter, (seq * 10 + cpu).to_bytes(4, "little"))
            self.made.append((tracepoint, cpu, seq, stamp, blocks))
            out += entry(tracepoint, cpu, seq, stamp, blocks)
            seq += 1
        self.sequence[cpu] = seq
        return out


def feed(recorder: Recorder, pieces: list[tuple[int, bytes, int]]) -> None:
    """One read of the drain: (cpu, entries, frames lost before them) per CPU."""
    recorder.on_entries({"t": "entries", "data": bytearray(b"".join(data for _, data, _ in pieces)),
                         "cpus": [{"cpu": cpu, "bytes": len(data), "lost": lost} for cpu, data, lost in pieces]})


def recorded_frames(directory):
    run = open_recorded(directory)
    frames = [(f.tracepoint, f.cpu, f.seq, f.ns, f.raw) for batch in batches(run) for f in batch.frames()]
    return run, frames


def expected(made) -> list:
    ordered = sorted(made, key=lambda f: (f[3], f[1], f[2]))
    return [(tp, cpu, seq, int((stamp - ORIGIN) / TICKS_PER_NS), blocks) for tp, cpu, seq, stamp, blocks in ordered]


def test_recorded_frames_read_back_as_they_were_committed(run_message, tmp_path):
    message, address, counter = run_message
    frames = Frames(address, counter)
    recorder = Recorder(tmp_path / "trace", VMLINUX)
    recorder.on_run(message)
    feed(recorder, [(0, frames.make(0, 30), 0), (1, frames.make(1, 20), 0)])
    # a lap of CPU 0's ring ends with a padding entry; CPU 1 lost 7 frames the ring overwrote
    feed(recorder, [(0, frames.make(0, 3) + padding(72) + frames.make(0, 4), 0), (1, frames.make(1, 10, skip=7), 7)])
    recorder.close()
    assert (recorder.recorded, recorder.lost) == (67, 7)
    run, read = recorded_frames(tmp_path / "trace")
    assert read == expected(frames.made)
    assert run.missed == 7 and run.origin == "recorded" and set(run.tracepoints) == {1, 2}

    babeltrace = shutil.which("babeltrace2")
    if babeltrace is None:
        pytest.skip("babeltrace2 not installed (scripts/test installs Debian's package)")
    result = subprocess.run([babeltrace, str(tmp_path / "trace")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 67
    assert "Tracer discarded 7 events" in result.stderr
    first = next(line for line in lines if "{ seq = 1," in line and "cpu_id = 0" in line)
    assert "kgtp_test_function: { cpu_id = 0 }, { seq = 1, entry_size = 328, cpu = 0, frame_size = 292 }" in first
    assert 'regs_block = "R", regs_rax = 0x0' in first and "regs_rdi = 0x1," in first
    assert 'kgtp_counter_block = "M"' in first and "kgtp_counter = 10 }" in first
    compact_line = next(line for line in lines if "{ seq = 4," in line and "cpu_id = 1" in line)
    assert 'regs_block = "r", regs_mask = 0x10030, regs_rsi = 0x1, regs_rdi = 0x4, regs_rip = ' in compact_line


def test_rotation_keeps_the_newest_files_of_each_cpu(run_message, tmp_path):
    message, address, counter = run_message
    frames = Frames(address, counter)
    recorder = Recorder(tmp_path / "trace", VMLINUX, max_size=16 * 1024, keep=2)
    recorder.on_run(message)
    for _ in range(10):
        feed(recorder, [(0, frames.make(0, 40), 0)])
        recorder.flush()
    recorder.close()
    files = stream_files(tmp_path / "trace")[0]
    assert [path.name for path in files] == ["channel0_0_8", "channel0_0_9"]
    assert all(path.stat().st_size <= 16 * 1024 for path in files)
    run, read = recorded_frames(tmp_path / "trace")
    assert read == expected(frames.made)[-len(read):] and 0 < len(read) < 400
    babeltrace = shutil.which("babeltrace2")
    if babeltrace is not None:
        result = subprocess.run([babeltrace, str(tmp_path / "trace")], capture_output=True, text=True)
        assert result.returncode == 0 and len(result.stdout.splitlines()) == len(read), result.stderr


FULL_DISK = textwrap.dedent("""
    import json, resource, sys
    sys.path.insert(0, sys.argv[1])
    from pathlib import Path
    from tests.view.test_recorded import Frames, feed
    from kgtp_sim.view.record import Recorder
    message, address, counter, directory = json.loads(sys.argv[2])
    frames = Frames(address, counter)
    recorder = Recorder(Path(directory), Path(sys.argv[3]))
    recorder.on_run(message)
    # files may not pass 100 KiB from now on: a full disk, as a write sees it (EFBIG; Python ignores SIGXFSZ)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100 * 1024, resource.RLIM_INFINITY))
    for _ in range(20):
        feed(recorder, [(0, frames.make(0, 50), 0)])
        recorder.flush()
    recorder.close()
    print(json.dumps([recorder.recorded, recorder.lost, recorder.failures(), len(frames.made)]))
""")


def test_a_full_disk_leaves_whole_packets_and_counts_what_it_dropped(run_message, tmp_path):
    message, address, counter = run_message
    directory = tmp_path / "trace"
    result = subprocess.run([sys.executable, "-c", FULL_DISK, str(ROOT), __import__("json").dumps(
        [message, address, counter, str(directory)]), str(VMLINUX)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    recorded, lost, failures, made = __import__("json").loads(result.stdout)
    assert recorded + lost == made and lost > 0 and failures, result.stdout
    assert (directory / "channel0_0").stat().st_size <= 100 * 1024
    packets = list(read_packets(directory / "channel0_0", align=8))
    assert packets and all(p.content for p in packets[:-1])  # whole packets, written before the disk filled ...
    run, read = recorded_frames(directory)
    assert len(read) == recorded and run.missed == lost  # ... and the count of the rest, in the last one that fit


def test_a_torn_stream_file_is_read_up_to_its_last_whole_packet(run_message, tmp_path):
    message, address, counter = run_message
    frames = Frames(address, counter)
    recorder = Recorder(tmp_path / "trace", VMLINUX)
    recorder.on_run(message)
    for _ in range(3):
        feed(recorder, [(0, frames.make(0, 20), 0)])
        recorder.flush()
    recorder.close()
    path = tmp_path / "trace" / "channel0_0"
    path.write_bytes(path.read_bytes()[:-100])
    run, read = recorded_frames(tmp_path / "trace")
    assert read == expected(frames.made)[:40]


def test_a_tsaved_file_read_a_piece_at_a_time(tmp_path, monkeypatch, run_message):
    _, address, _ = run_message
    bodies = [frame_body(registers(rdi=i, rip=address)) + b"V" + struct.pack("<iq", 1, i % 2)
              + b"V" + struct.pack("<iq", 2, 5000 + 10 * i) for i in range(50)]
    header = (b"\x7fTRACE0\nR 1\nstatus 0;tframes:32\n"
              + b"tsv 1:0:1:%s\ntsv 2:0:1:%s\n" % (b"cpu_id".hex().encode(), b"clock".hex().encode())
              + b"tp T1:%x:E:0:0\n\n" % address)
    path = tmp_path / "run.tf"
    path.write_bytes(header + b"".join(struct.pack("<HI", 1, len(b)) + b for b in bodies) + b"\0\0")
    monkeypatch.setattr(sources, "FILE_CHUNK", 1000)  # records cut between reads
    run = open_tfile(path)
    frames = [f for batch in batches(run) for f in batch.frames()]
    assert [f.raw for f in frames] == bodies
    assert [f.cpu for f in frames] == [i % 2 for i in range(50)] and run.cpu_source == "$cpu_id"
    assert [f.ns for f in frames] == [10 * i for i in range(50)] and run.time_source == "$clock"
    assert [f.raw for f in load_tfile(path).frames] == bodies
