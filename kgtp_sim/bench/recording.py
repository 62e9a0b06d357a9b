"""Recording and reading traces at the kernel's pace (issue 27): `kgtp-sim bench --record` (scripts/bench --record).

Two tracepoints on kgtp_test_function: *regs*, `collect $regs, kgtp_counter` (a 292-byte frame, 328 bytes in
the ring), and *compact*, the thesis' `if (2*counter1+3*counter2)>0` / `collect (2*counter1+3*counter2)` (29
bytes of compact registers, 64 in the ring: what `--smp` measures). The rows:

- *production*: frames a second the kernel commits at full pace (every CPU's workload thread calling
  kgtp_test_function without sleeping), 1 and 2 CPUs, a circular 5 MiB ring per CPU (serve's), nobody reading;
- *recording*: `kgtp-sim record` (a child process) beside the stub (this process: the machine, the tracer and the
  follow channel, as `kgtp-sim serve` runs them): the regs tracepoint at serve's default pace (the recorder
  should lose nothing), and the compact one at full pace (frames recorded a second; every frame is recorded or
  counted lost: recorded + lost = created is checked);
- *record RSS*: the recorder's peak RSS recording 10^4, 10^5, 10^6 regs frames at full pace (`--count`);
- *reading*: those traces: `kgtp-sim export` to each format (frames a second, peak RSS), babeltrace2 reading the
  recorded trace and the exported CTF (events a second, its text output to /dev/null), the yardstick; and
  `kgtp-sim follow` beside the stub at full pace (the frames a second it decodes and prints).

Host time, reported, never asserted: the machine interleaves its CPUs on one host thread, and the host may be
shared. Runs in the caller's thread; the machine has its own threads, the recorder and the exports are child
processes (their peak RSS from wait4).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from kgtp_sim.client.paths import ROOT, VMLINUX
from kgtp_sim.client.stub import kgtp_command
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.stub.follow import FollowServer
from kgtp_sim.tracing import Tracer
from kgtp_sim.tracing.core.model import DEFAULT_BUFFER_SIZE

from .record import FIXTURE, load
from .runner import Config, packets
from .smp import FULL_SPEED_PACE

BUFFER_PER_CPU = DEFAULT_BUFFER_SIZE  #: `kgtp-sim serve`'s ring per CPU
SERVE_PACE = 100  #: `kgtp-sim serve`'s pace (machine.DEFAULT_PACE): kgtp_test_function calls per tick
SIZES = (10_000, 100_000, 1_000_000)
FORMATS = ("ctf", "jsonl", "chrome")


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _source(number: int, address: int, kind: str, text: str) -> bytes:
    """A QTDPsrc body (the user's text of a tracepoint, as GDB sends it)."""
    data = text.encode()
    return b"%x:%x:%s:0:%x:%s" % (number, address, kind.encode(), len(data), data.hex().encode())


class Kernel:
    """A machine serving at a pace, its tracer and follow channel: what `kgtp-sim serve` runs, in this process."""

    def __init__(self, cpus: int, pace: int, image: KernelImage, buffer: int = BUFFER_PER_CPU) -> None:
        self.image = image
        self.machine = Machine(image, cpus=cpus, pace=pace)
        self.machine.start()
        _wait(lambda: self.machine.stats(count=False).cpus_online == cpus, 60, f"{cpus} CPUs online")
        self.tracer = Tracer(self.machine, "opt")
        self.tracer.definitions.buffer_size = buffer
        self.tracer.definitions.circular = True
        self.follow = FollowServer(self.tracer, port=0)
        self.follow.bind()
        self.follow.start()

    def define(self, kind: str) -> None:
        definitions = self.tracer.definitions
        definitions.clear_tracepoints()
        if kind == "regs":
            address = self.image.address_of("kgtp_test_function")
            counter = self.image.address_of("kgtp_counter")
            definitions.define(t.DefineTracepoint.parse(b"1:%x:E:0:0-" % address))
            for action in (b"Rffffffffff", b"M-1,%x,4" % counter):  # what GDB sends for `collect $regs, kgtp_counter`
                definitions.add_actions(t.TracepointActions.parse(b"1:%x:%s" % (address, action)))
            sources = [("at", "kgtp_test_function"), ("cmd", "collect $regs, kgtp_counter")]
        else:
            definition, actions = packets(Config("dynamic-jump", "cond+expr", "opt"), self.image, load(FIXTURE))
            definitions.define(t.DefineTracepoint.parse(definition))
            for action in actions:
                definitions.add_actions(t.TracepointActions.parse(action))
            address = int(definition.split(b":")[1], 16)
            sources = [("at", "kgtp_test_function"), ("cond", "(2*counter1+3*counter2)>0"),
                       ("cmd", "collect (2*counter1+3*counter2)")]
        for source_kind, text in sources:
            definitions.add_source(t.TracepointSource.parse(_source(1, address, source_kind, text)))

    def created(self) -> int:
        return self.tracer.status().created or 0

    def close(self) -> None:
        if self.tracer.running:
            self.tracer.stop(t.StopReason.STOP_COMMAND)
        self.follow.shutdown()
        self.machine.shutdown()


# ---- production ---------------------------------------------------------------------------------------------


def production(image: KernelImage, cpus: int, kind: str, seconds: float) -> dict:
    """Frames a second the kernel commits at full pace with nobody reading."""
    kernel = Kernel(cpus, FULL_SPEED_PACE, image)
    try:
        kernel.define(kind)
        kernel.tracer.start()
        _wait(lambda: kernel.created() > 0, 30, "the first frame")
        rates = []
        for _ in range(3):
            c0, t0 = kernel.created(), time.monotonic()
            time.sleep(seconds)
            rates.append((kernel.created() - c0) / (time.monotonic() - t0))
    finally:
        kernel.close()
    return {"row": "production", "tracepoint": kind, "cpus": cpus, "frames_per_s": round(statistics.median(rates)),
            "min": round(min(rates)), "max": round(max(rates))}


# ---- recording beside the stub ------------------------------------------------------------------------------


def _recorder(kernel: Kernel, directory: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(kgtp_command("record", "-o", str(directory), "--port", str(kernel.follow.port), *extra),
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 900) -> tuple[str, int]:
    """Wait for a child; its stderr and peak RSS in KiB. The peak is the child's own high-water mark (VmHWM, read
    until it exits): wait4's ru_maxrss would count this process's pages the child had before its exec."""
    peak = 0
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True) if proc.stderr else None
    if reader is not None:
        reader.start()
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        peak = max(peak, _high_water(proc.pid))
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{proc.args} did not finish in {timeout:.0f} s")
        time.sleep(0.02)
    if reader is not None:
        reader.join(10)
    return "".join(lines), peak


def _high_water(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _summary(stderr: str) -> tuple[int, int]:
    import re

    found = re.search(r"record: (\d+) frames in .*?, (\d+) lost", stderr)
    if found is None:
        raise RuntimeError(f"no summary from the recorder:\n{stderr}")
    return int(found.group(1)), int(found.group(2))


def live_recording(image: KernelImage, kind: str, pace: int, seconds: float, directory: Path, cpus: int = 2) -> dict:
    """A recorder beside the stub for `seconds` of a run: frames recorded, lost and created."""
    kernel = Kernel(cpus, pace, image)
    try:
        kernel.define(kind)
        proc = _recorder(kernel, directory)
        _wait(lambda: kernel.tracer.recorders > 0, 60, "the recorder")
        kernel.tracer.start()
        started = time.monotonic()
        time.sleep(seconds)
        kernel.tracer.stop(t.StopReason.STOP_COMMAND)
        elapsed = time.monotonic() - started
        created = kernel.created()
        notes = kernel.tracer.status().notes
        stderr, rss = _finish(proc)
    finally:
        kernel.close()
    recorded, lost = _summary(stderr)
    return {"row": "recording", "tracepoint": kind, "cpus": cpus, "pace": pace, "seconds": round(elapsed, 2),
            "created": created, "recorded": recorded, "lost": lost, "every_frame_counted": recorded + lost == created,
            "created_per_s": round(created / elapsed), "recorded_per_s": round(recorded / elapsed),
            "recorder_rss_mb": round(rss / 1024, 1), "tstatus_notes": notes}


def record_rss(image: KernelImage, frames: int, directory: Path) -> dict:
    """The recorder's peak RSS for `frames` regs frames, recorded at full pace (the trace is kept for the
    reading rows: it has `frames` frames, and gaps where the recorder lost some)."""
    kernel = Kernel(2, FULL_SPEED_PACE, image)
    try:
        kernel.define("regs")
        proc = _recorder(kernel, directory, "--count", str(frames))
        _wait(lambda: kernel.tracer.recorders > 0, 60, "the recorder")
        started = time.monotonic()
        kernel.tracer.start()
        stderr, rss = _finish(proc)
        elapsed = time.monotonic() - started
    finally:
        kernel.close()
    recorded, lost = _summary(stderr)
    return {"row": "record_rss", "frames": frames, "recorded": recorded, "lost": lost,
            "recorded_per_s": round(recorded / elapsed), "peak_rss_mb": round(rss / 1024, 1)}


# ---- reading ------------------------------------------------------------------------------------------------


def export_row(trace: Path, frames: int, form: str, out: Path) -> dict:
    """`kgtp-sim export` of a recorded trace in a child: frames a second (wall time) and peak RSS."""
    started = time.monotonic()
    proc = subprocess.Popen(kgtp_command("export", str(trace), "--format", form, "-o", str(out)), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr, rss = _finish(proc)
    elapsed = time.monotonic() - started
    if proc.returncode:
        raise RuntimeError(f"export {form} failed:\n{stderr}")
    return {"row": "export", "format": form, "frames": frames, "seconds": round(elapsed, 2),
            "frames_per_s": round(frames / elapsed), "peak_rss_mb": round(rss / 1024, 1)}


def follow_row(image: KernelImage, frames: int) -> dict:
    """`kgtp-sim follow` (a child, its lines to /dev/null) beside the stub at full pace: the frames a second it
    decodes and prints, as it reports them."""
    import re

    kernel = Kernel(2, FULL_SPEED_PACE, image)
    try:
        kernel.define("regs")
        kernel.tracer.start()
        _wait(lambda: kernel.created() > 0, 30, "the first frame")
        with open(os.devnull, "w") as sink:
            proc = subprocess.run(kgtp_command("follow", "--port", str(kernel.follow.port), "--count", str(frames)),
                                  cwd=ROOT, stdout=sink, stderr=subprocess.PIPE, text=True, timeout=900)
    finally:
        kernel.close()
    found = re.search(r"followed (\d+) frames \((\d+)/s\), missed (\d+)", proc.stderr)
    if found is None:
        raise RuntimeError(f"no summary from the follower:\n{proc.stderr}")
    return {"row": "follow", "frames": int(found.group(1)), "frames_per_s": int(found.group(2)),
            "missed": int(found.group(3))}


def babeltrace_row(trace: Path, frames: int, what: str) -> dict | None:
    babeltrace = shutil.which("babeltrace2")
    if babeltrace is None:
        return None
    started = time.monotonic()
    with open(os.devnull, "w") as sink:
        subprocess.run([babeltrace, str(trace)], stdout=sink, stderr=subprocess.DEVNULL, check=True)
    elapsed = time.monotonic() - started
    return {"row": "babeltrace2", "trace": what, "frames": frames, "seconds": round(elapsed, 2),
            "events_per_s": round(frames / elapsed)}


def recording_rows(quick: bool = False, progress=None) -> list[dict]:
    image = KernelImage.load(VMLINUX)
    seconds = 1.0 if quick else 2.0
    window = 5.0 if quick else 60.0
    sizes = SIZES[:2] if quick else SIZES
    rows: list[dict] = []

    def add(row: dict | None) -> None:
        if row is not None:
            rows.append(row)
            if progress is not None:
                progress(row)

    with tempfile.TemporaryDirectory(prefix="kgtp-bench-record-") as scratch:
        work = Path(scratch)
        for kind in ("regs", "compact"):
            for cpus in (1, 2):
                add(production(image, cpus, kind, seconds))
        add(live_recording(image, "regs", SERVE_PACE, window, work / "serve-pace"))
        shutil.rmtree(work / "serve-pace", ignore_errors=True)
        add(live_recording(image, "compact", FULL_SPEED_PACE, 5.0 if quick else 10.0, work / "full-pace"))
        shutil.rmtree(work / "full-pace", ignore_errors=True)
        for frames in sizes:
            trace = work / f"regs-{frames}"
            add(record_rss(image, frames, trace))
            recorded = rows[-1]["recorded"]
            for form in FORMATS:
                out = work / f"out-{frames}.{form}"
                add(export_row(trace, recorded, form, out))
                if form == "ctf":
                    add(babeltrace_row(out, recorded, "exported"))
                shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)
            add(babeltrace_row(trace, recorded, "recorded"))
            shutil.rmtree(trace, ignore_errors=True)
        add(follow_row(image, sizes[-1]))
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["", "Recording and reading (frames a second, host time; see kgtp_sim/bench/recording.py):", ""]
    for row in rows:
        kind = row["row"]
        if kind == "production":
            out.append(f"- kernel at full pace, {row['tracepoint']} frames, {row['cpus']} CPU(s): "
                       f"{row['frames_per_s']:,}/s (min {row['min']:,}, max {row['max']:,})")
        elif kind == "recording":
            out.append(f"- recorder, {row['tracepoint']} frames, pace {row['pace']}, {row['seconds']} s: "
                       f"{row['recorded']:,} recorded ({row['recorded_per_s']:,}/s) of {row['created']:,} created "
                       f"({row['created_per_s']:,}/s), {row['lost']:,} lost; every frame counted: "
                       f"{row['every_frame_counted']}; recorder RSS {row['recorder_rss_mb']} MB")
        elif kind == "record_rss":
            out.append(f"- recorder peak RSS for {row['frames']:,} frames: {row['peak_rss_mb']} MB "
                       f"({row['recorded_per_s']:,}/s recorded, {row['lost']:,} lost)")
        elif kind == "export":
            out.append(f"- export {row['format']} of {row['frames']:,} frames: {row['frames_per_s']:,}/s "
                       f"({row['seconds']} s), peak RSS {row['peak_rss_mb']} MB")
        elif kind == "follow":
            out.append(f"- follow beside the stub at full pace: {row['frames']:,} frames printed, "
                       f"{row['frames_per_s']:,}/s ({row['missed']:,} overwritten before it read them)")
        elif kind == "babeltrace2":
            out.append(f"- babeltrace2 reading the {row['trace']} CTF of {row['frames']:,} frames: "
                       f"{row['events_per_s']:,} events/s")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = recording_rows(args.quick, progress=lambda r: print(json.dumps(r), flush=True))
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

