"""`kgtp-sim follow`: print trace frames as the stub commits them, one line each (gtpframe_pipe, trace_pipe).

A line is: time since tstart, CPU, tracepoint number and location, then every collected value by its source
text, and `$_sdata` as TP_printk renders it:

    +0.012345678 cpu 0 tp 1 kgtp_test_function: (2*counter1+3*counter2)=70002 kgtp_counter=14001
    +0.012401112 cpu 0 tp 2 module::kgtp_module_event: $_sdata="counter1=14001 counter2=14000"

Frames come through the follow channel's drain (stub/stream.py, sources.drain) a read at a time; each read's
frames are decoded class by class (decode.py) and a class whose fields all have a place in its frames is
formatted with one format string. Frames a circular buffer overwrote before the channel read them are reported
as `-- missed N frames --` and counted in the summary printed at exit. Reading never consumes (unless asked
to): GDB still finds every frame with tfind. The whole command runs in the main thread; Ctrl-C ends it with the
summary.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

import numpy as np

from .batch import FrameBatch
from .cexpr import text_of
from .decode import BulkReader, Column, Const, Decoded, ItemColumns, Ints, MemberColumns, Texts, Values
from .fields import FrameReader
from .model import Run
from .sources import drain

_SHOWN_REGISTERS = ("rip", "rsp", "rdi", "rsi", "rdx", "rax")


def _registers_text(registers: dict) -> str:
    return "{" + " ".join(f"{name}={registers[name]:#x}" for name in _SHOWN_REGISTERS if name in registers) + "}"


def format_line(reader: FrameReader, frame, fields=None) -> str:
    info = reader.tracepoint(frame)
    marker = reader.marker(info)
    where = marker.id if marker is not None else reader.event_name(info)
    seconds = "+?" if frame.ns is None else f"+{frame.ns / 1e9:.9f}"
    cpu = "?" if frame.cpu is None else frame.cpu
    parts = [f"{seconds} cpu {cpu} tp {frame.tracepoint} {where}:"]
    fields = reader.fields(frame) if fields is None else fields
    for field in fields:
        if field.name == "$_sdata":
            parts.append(f"$_sdata={text_of(frame.sdata) if frame.sdata is not None else text_of(field.value)}")
        elif field.name == "$regs" and isinstance(field.value, dict):
            parts.append(f"$regs={_registers_text(field.value)}")
        else:
            parts.append(f"{field.name}={text_of(field.value)}")
    if frame.sdata is not None and not any(f.name == "$_sdata" for f in fields):
        parts.append(f"$_sdata={text_of(frame.sdata)}")
    return " ".join(parts)


class TextTemplate:
    """A class's lines as one format string: literal text, and per-frame slots (`%d`, `%#x`, `%.9f`, `%s`)."""

    def __init__(self) -> None:
        self.format = ""
        self.columns: list = []

    def text(self, literal: str) -> None:
        self.format += literal.replace("%", "%%")

    def slot(self, conversion: str, values) -> None:
        self.format += conversion
        self.columns.append(values.tolist() if isinstance(values, np.ndarray) else values)

    def value(self, column: Column, hexadecimal: bool = False) -> None:
        """text_of of a column's values."""
        if isinstance(column, Const):
            self.text(f"{column.value:#x}" if hexadecimal and isinstance(column.value, int) else text_of(column.value))
        elif isinstance(column, Ints):
            self.slot("%#x" if hexadecimal else "%d", column.values)
        elif isinstance(column, (Texts, Values)):
            self.slot("%s", [text_of(v) for v in column.values])
        elif isinstance(column, MemberColumns):
            self.text("{")
            for index, (name, child) in enumerate(column.members):
                self.text(f"{', ' if index else ''}{name} = ")
                self.value(child)
            self.text("}")
        elif isinstance(column, ItemColumns):
            self.text("{")
            for index, child in enumerate(column.items):
                self.text(", " if index else "")
                self.value(child)
            self.text("}")

    def lines(self, count: int) -> list[str]:
        if not self.columns:
            return [self.format % ()] * count
        return list(map(self.format.__mod__, zip(*self.columns)))


def class_lines(batch: FrameBatch, part: Decoded) -> list[str]:
    """`format_line` for every frame of an exact class, in bulk."""
    plan, rows = part.plan, part.rows
    template = TextTemplate()
    template.slot("+%.9f", batch.ns[rows] / 1e9)
    cpus = batch.cpu[rows]
    if (cpus >= 0).all():
        template.text(" cpu ")
        template.slot("%d", cpus)
    else:
        template.text(" cpu ")
        template.slot("%s", ["?" if c < 0 else str(c) for c in cpus.tolist()])
    where = plan.marker.id if plan.marker is not None else plan.event
    template.text(f" tp {plan.tracepoint} {where}:")
    sdata = part.sdata
    for planned, column in zip(plan.fields, part.columns):
        template.text(" ")
        if planned.name == "$_sdata":
            template.text("$_sdata=")
            if sdata is not None:
                template.slot("%s", [text_of(s) for s in sdata])
            else:
                template.value(column)
        elif planned.name == "$regs" and isinstance(column, MemberColumns):
            template.text("$regs={")
            members = dict(column.members)
            shown = [name for name in _SHOWN_REGISTERS if name in members]
            for index, name in enumerate(shown):
                template.text(f"{' ' if index else ''}{name}=")
                template.value(members[name], hexadecimal=True)
            template.text("}")
        else:
            template.text(f"{planned.name}=")
            template.value(column)
    if sdata is not None and not any(f.name == "$_sdata" for f in plan.fields):
        template.text(" $_sdata=")
        template.slot("%s", [text_of(s) for s in sdata])
    return template.lines(len(rows))


def batch_lines(decoder: BulkReader, batch: FrameBatch) -> list[str]:
    """A line per frame of the batch, in order."""
    out = np.empty(len(batch), dtype=object)
    for part in decoder.decode(batch):
        if part.plan.exact:
            out[part.rows] = class_lines(batch, part)
        else:
            out[part.rows] = [format_line(decoder.reader, decoder.frame(batch, int(row), part.sdata[i] if part.sdata
                                                                         else None))
                              for i, row in enumerate(part.rows.tolist())]
    return out.tolist()


def follow(host: str, port: int, kernel: Path, from_start: bool = False, out: TextIO = sys.stdout,
           limit: int | None = None, quiet: bool = False, consume: bool = False) -> int:
    run = Run()
    reader = FrameReader.open(run, kernel)
    decoder = BulkReader(reader)
    shown = missed = 0
    started = time.monotonic()
    answered = False  # no summary when the port was not the follow channel: its error is the whole story
    try:
        request = {"from": "start" if from_start else "now", "consume": consume}
        for kind, message in drain(host, port, request):
            answered = True
            if kind == "run":
                run = Run()
                run.apply_run_message(message)
                reader.run = run
                decoder = BulkReader(reader)
                if not quiet:
                    names = ", ".join(f"{tp.number} {tp.location}" for tp in run.tracepoints.values()) or "none"
                    state = "running" if message.get("running") else "not running"
                    print(f"-- trace run {state}; tracepoints: {names} --", file=out, flush=True)
            elif kind == "frames":
                batch = message
                if limit is not None and shown + len(batch) > limit:
                    batch = batch.take(slice(0, limit - shown))
                if not quiet:
                    lines = batch_lines(decoder, batch)
                    if lines:
                        out.write("\n".join(lines) + "\n")
                shown += len(batch)
                if limit is not None and shown >= limit:
                    break
            elif kind == "lost":
                missed += message
                print(f"-- missed {message} frames (overwritten in the circular buffer) --", file=out)
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
