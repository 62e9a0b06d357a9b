"""`kgtp-sim follow`: print trace frames as the stub commits them, one line each (gtpframe_pipe, trace_pipe).

A line is: time since tstart, CPU, tracepoint number and location, then every collected value by its source
text, and `$_sdata` as TP_printk renders it:

    +0.012345678 cpu 0 tp 1 kgtp_test_function: (2*counter1+3*counter2)=70002 kgtp_counter=14001
    +0.012401112 cpu 0 tp 2 module::kgtp_module_event: $_sdata="counter1=14001 counter2=14000"

Frames a circular buffer overwrote before the channel read them are reported as `-- missed N frames --` and
counted in the summary printed at exit. Reading never consumes: GDB still finds every frame with tfind. The
whole command runs in the main thread; Ctrl-C ends it with the summary.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

from .cexpr import text_of
from .channel import messages
from .fields import FrameReader
from .model import Run


def _registers_text(registers: dict) -> str:
    keep = ("rip", "rsp", "rdi", "rsi", "rdx", "rax")
    return "{" + " ".join(f"{name}={registers[name]:#x}" for name in keep if name in registers) + "}"


def format_line(reader: FrameReader, frame) -> str:
    info = reader.tracepoint(frame)
    marker = reader.marker(info)
    where = marker.id if marker is not None else reader.event_name(info)
    seconds = "+?" if frame.ns is None else f"+{frame.ns / 1e9:.9f}"
    cpu = "?" if frame.cpu is None else frame.cpu
    parts = [f"{seconds} cpu {cpu} tp {frame.tracepoint} {where}:"]
    for field in reader.fields(frame):
        if field.name == "$_sdata":
            parts.append(f"$_sdata={text_of(frame.sdata) if frame.sdata is not None else text_of(field.value)}")
        elif field.name == "$regs" and isinstance(field.value, dict):
            parts.append(f"$regs={_registers_text(field.value)}")
        else:
            parts.append(f"{field.name}={text_of(field.value)}")
    if frame.sdata is not None and not any(f.name == "$_sdata" for f in reader.fields(frame)):
        parts.append(f"$_sdata={text_of(frame.sdata)}")
    return " ".join(parts)


def follow(host: str, port: int, kernel: Path, from_start: bool = False, out: TextIO = sys.stdout,
           limit: int | None = None, quiet: bool = False, consume: bool = False) -> int:
    run = Run()
    reader = FrameReader.open(run, kernel)
    shown = missed = 0
    started = time.monotonic()
    answered = False  # no summary when the port was not the follow channel: its error is the whole story
    try:
        request = {"op": "follow", "from": "start" if from_start else "now", "consume": consume}
        for message in messages(host, port, request):
            answered = True
            kind = message["t"]
            if kind == "run":
                run.apply_run_message(message)
                reader.run = run
                if not quiet:
                    names = ", ".join(f"{tp.number} {tp.location}" for tp in run.tracepoints.values()) or "none"
                    state = "running" if message.get("running") else "not running"
                    print(f"-- trace run {state}; tracepoints: {names} --", file=out, flush=True)
            elif kind == "frame":
                frame = Run.frame_from_message(message)
                if not quiet:
                    print(format_line(reader, frame), file=out)
                shown += 1
                if limit is not None and shown >= limit:
                    break
            elif kind == "missed":
                missed += message["count"]
                print(f"-- missed {message['count']} frames (overwritten in the circular buffer) --", file=out)
            elif kind == "stopped":
                print(f"-- trace run stopped ({message['reason']}), {message['created']} frames created --",
                      file=out, flush=True)
            out.flush()
    except KeyboardInterrupt:
        pass
    finally:
        elapsed = max(time.monotonic() - started, 1e-9)
        if answered:
            print(f"-- followed {shown} frames ({shown / elapsed:.0f}/s), missed {missed} --", file=sys.stderr,
                  flush=True)
    return 0
