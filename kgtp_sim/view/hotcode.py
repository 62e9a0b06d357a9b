"""`kgtp-sim hotcode`: where each CPU is at every timer tick, and the hottest functions and lines.

The idea of KGTP's hotcode add-on, on this stub: a tracepoint on the kernel's timer interrupt handler
(`timer_interrupt(struct pt_regs *regs)`) collects `regs->ip`, the PC the tick interrupted; the frames come
back through the read-only follow channel with the CPU each ran on; the PCs are counted per function (DWARF)
and per source line (the line table).

hotcode defines its own tracepoint, so it is a debugger session of its own: it takes the RSP port's one
debugger slot (refused while GDB is attached), replaces what is defined on the target (QTinit), and stops the
run when done. The RSP conversation and the waiting run in the main thread; the frames are read by a
background thread `hotcode-follow`.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from pathlib import Path

from ..client.rsp import RspClient
from ..machine.dwarf import KernelDwarf
from ..optional import pyplot
from .channel import ChannelError, messages
from .fields import FrameReader
from .model import Run

SAMPLED_FUNCTION = "timer_interrupt"
SAMPLED_EXPRESSION = "regs->ip"


def _ok(client: RspClient, payload: bytes) -> None:
    reply = client.request(payload)
    if reply != b"OK":
        raise RuntimeError(f"{payload[:40]!r} refused: {reply.decode(errors='replace')}")


def _detach(client: RspClient) -> None:
    """`D` without waiting for the answer, then hang up."""
    try:
        client.send(b"D")
    except OSError:
        pass
    client.close()


def _source_packet(number: int, address: int, kind: str, text: str) -> bytes:
    data = text.encode()
    return b"QTDPsrc:%x:%x:%s:0:%x:%s" % (number, address, kind.encode(), len(data), data.hex().encode())


def sample(host: str, port: int, follow_port: int, dwarf: KernelDwarf, *, seconds: float,
           samples: int | None) -> tuple[Run, list]:
    """Run the sampling tracepoint; returns the run and its frames."""
    address = dwarf.address_of(SAMPLED_FUNCTION)
    parameters, _ = dwarf.scope(address)
    regs = next(v for v in parameters if v.name == "regs")
    offset, _ = regs.type.target.member("ip")
    run = Run()
    frames: list = []
    enough = threading.Event()
    ready = threading.Event()
    failure: list[BaseException] = []

    def reader() -> None:
        try:
            for message in messages(host, follow_port, {"op": "follow", "from": "now"}):
                ready.set()
                if message["t"] == "run":
                    run.apply_run_message(message)
                elif message["t"] == "frame":
                    frames.append(Run.frame_from_message(message))
                    if samples is not None and len(frames) >= samples:
                        enough.set()
                elif message["t"] == "missed":
                    run.missed += message["count"]
                if enough.is_set():
                    return
        except (ChannelError, OSError) as error:
            failure.append(error)
            ready.set()
            enough.set()

    thread = threading.Thread(target=reader, daemon=True, name="hotcode-follow")
    thread.start()
    if not ready.wait(10) or failure:
        raise ChannelError(f"no follow channel at {host}:{follow_port}: {failure[0] if failure else 'no answer'}")
    try:
        client = RspClient.connect(port, host=host)
    except OSError as error:
        raise ChannelError(f"cannot reach the stub at {host}:{port}: {error}") from None
    try:
        reply = client.request(b"qSupported")
        if reply.startswith(b"E."):
            raise ChannelError(reply[2:].decode(errors="replace") + " (hotcode defines a tracepoint: detach GDB first)")
        _ok(client, b"QTinit")
        _ok(client, b"QTDP:1:%x:E:0:0-" % address)
        # what GDB sends for `collect regs->ip`: the register holding `regs` (%rdi, GDB register 5) and the
        # 8 bytes at regs + offsetof(struct pt_regs, ip)
        _ok(client, b"QTDP:-1:%x:R20-" % address)
        _ok(client, b"QTDP:-1:%x:M5,%x,8" % (address, offset))
        _ok(client, _source_packet(1, address, "at", SAMPLED_FUNCTION))
        _ok(client, _source_packet(1, address, "cmd", f"collect {SAMPLED_EXPRESSION}"))
        _ok(client, b"QTStart")
        deadline = None if samples is not None else time.monotonic() + seconds
        while not enough.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                break
            enough.wait(0.05 if deadline is None else min(0.05, max(deadline - time.monotonic(), 0.001)))
        _ok(client, b"QTStop")
    finally:
        _detach(client)
    enough.set()
    thread.join(timeout=2)
    if failure:
        raise ChannelError(str(failure[0]))
    return run, list(frames[:samples] if samples is not None else frames)


def tally(run: Run, reader: FrameReader, frames) -> tuple[Counter, Counter, Counter, list[int]]:
    functions: Counter = Counter()
    lines: Counter = Counter()
    cpus: Counter = Counter()
    pcs = []
    for frame in frames:
        fields = reader.fields(frame)
        pc = next((f.value for f in fields if f.name == SAMPLED_EXPRESSION), None)
        if not isinstance(pc, int):
            continue
        pcs.append(pc)
        cpus[frame.cpu] += 1
        symbol = reader.dwarf.symbolize(pc)
        functions[symbol[0] if symbol else f"{pc:#x}"] += 1
        line = reader.dwarf.line_at(pc) if symbol else None
        lines[f"{line[0]}:{line[1]}" if line else f"{pc:#x}"] += 1
    return functions, lines, cpus, pcs


def plot_hotcode(functions: Counter, lines: Counter, total: int, path: Path, top: int) -> Path:
    plt = pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(13, 0.9 + 0.32 * top))
    for axis, counter, title in ((axes[0], functions, "functions"), (axes[1], lines, "source lines")):
        rows = counter.most_common(top)[::-1]
        axis.barh([r[0] for r in rows], [100 * r[1] / total for r in rows], color="#c44e52")
        axis.set_xlabel("% of timer ticks")
        axis.set_title(f"Hottest {title} ({total} samples)")
        axis.tick_params(axis="y", labelsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def hotcode(host: str, port: int, follow_port: int, kernel: Path, *, seconds: float = 5.0,
            samples: int | None = None, top: int = 15, png: Path | None = None, out=sys.stdout) -> int:
    dwarf = KernelDwarf(kernel)
    try:
        run, frames = sample(host, port, follow_port, dwarf, seconds=seconds, samples=samples)
    except (ChannelError, RuntimeError, ConnectionError) as error:
        print(f"kgtp-sim: {error}", file=sys.stderr)
        return 1
    reader = FrameReader.open(run, kernel)
    functions, lines, cpus, pcs = tally(run, reader, frames)
    total = len(pcs)
    if not total:
        print("kgtp-sim: no samples (is the kernel's timer running?)", file=sys.stderr)
        return 1
    per_cpu = ", ".join(f"CPU {cpu}: {count}" for cpu, count in sorted(cpus.items(), key=lambda c: c[0] or 0))
    print(f"{total} timer-tick samples ({per_cpu}); {run.missed} missed", file=out)
    print(f"\n{'samples':>8} {'%':>6}  function", file=out)
    for name, count in functions.most_common(top):
        print(f"{count:>8} {100 * count / total:6.1f}  {name}", file=out)
    print(f"\n{'samples':>8} {'%':>6}  line", file=out)
    for name, count in lines.most_common(top):
        print(f"{count:>8} {100 * count / total:6.1f}  {name}", file=out)
    if png is not None:
        png.parent.mkdir(parents=True, exist_ok=True)
        plot_hotcode(functions, lines, total, png, top)
        print(f"\nkgtp-sim: wrote {png}", file=out)
    return 0
