"""The `kgtp-sim follow | record | export | plot | hotcode` commands: argument parsing and dispatch (main thread)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..client import paths
from .channel import DEFAULT_FOLLOW_PORT

COMMANDS = ("follow", "record", "export", "plot", "hotcode")

# Each command's --help ends with examples (kept to 80 columns, printed as written).
_FOLLOW_EXAMPLES = f"""\
examples (beside a stub that `kgtp-sim serve` or scripts/serve started):
  kgtp-sim follow                   # frames from now on, while GDB traces
  kgtp-sim follow --port {DEFAULT_FOLLOW_PORT} --from-start --count 100
The follow channel is the RSP port + 1 unless serve was given --follow-port;
serve prints its port when it starts.
"""
_RECORD_EXAMPLES = f"""\
examples (beside a stub that `kgtp-sim serve` or scripts/serve started):
  kgtp-sim record -o run1           # this run, or the next tstart, until tstop
  babeltrace2 run1                  # afterwards; or kgtp-sim export/plot run1
  kgtp-sim record -o run2 --max-size 64M --rotate 4   # the newest 256 MiB/CPU
While it records, the trace buffer is GDB's flight recorder (circular: tfind
sees the latest frames) and the run never stops on a full buffer; frames the
recorder could not keep up with are counted (babeltrace2 reports them).
"""
_EXPORT_EXAMPLES = """\
examples:
  kgtp-sim export run.tf --format ctf -o run-ctf     # then: babeltrace2 run-ctf
  kgtp-sim export run.tf --format jsonl -o run.jsonl
  kgtp-sim export run1 --format chrome -o run.json   # a recorded trace
  kgtp-sim export --format chrome -o run.json        # the running stub's buffer
run.tf is a file GDB's `tsave run.tf` wrote, run1 a directory `kgtp-sim record`
wrote; without either, the frames come from the running stub's follow channel
(--host, --port).
"""
_PLOT_EXAMPLES = """\
examples:
  kgtp-sim plot run.tf -o pics                       # a file GDB's tsave wrote
  kgtp-sim plot run1 -o pics                         # a recorded trace
  kgtp-sim plot -o pics --value '$_sdata.runtime'    # the running stub's buffer
"""
_HOTCODE_EXAMPLES = """\
examples (detach GDB first: hotcode traces through the RSP port itself):
  kgtp-sim hotcode                  # 5 s of samples, the hottest code per CPU
  kgtp-sim hotcode --samples 2000 --png hot.png
"""


def _add(commands, name: str, summary: str, description: str, epilog: str) -> argparse.ArgumentParser:
    """A subcommand: its line in `kgtp-sim --help`, and its own --help, ending with examples."""
    return commands.add_parser(name, help=summary, description=description, epilog=epilog,
                               formatter_class=argparse.RawDescriptionHelpFormatter)


def _source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", nargs="?", type=Path, default=None, metavar="TRACE",
                        help="a file GDB's `tsave` wrote (it has no $_sdata), or a directory `kgtp-sim record` "
                             "wrote (default: read the running stub's buffer)")
    parser.add_argument("--file", type=Path, default=None, metavar="TRACE",
                        help="the same as the TRACE argument")
    parser.add_argument("--host", default="127.0.0.1", help="the stub's host (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_FOLLOW_PORT,
                        help=f"the stub's follow channel port (default: {DEFAULT_FOLLOW_PORT}, the RSP port + 1)")
    parser.add_argument("--kernel", type=Path, default=paths.VMLINUX,
                        help="the kernel ELF with DWARF (default: the bundled one)")


def add_parsers(commands) -> None:
    follow = _add(commands, "follow", "print trace frames live, beside GDB (read-only)",
                  "Print one line per trace frame as the stub commits it, read from its\n"
                  "read-only follow channel while GDB traces.",
                  _FOLLOW_EXAMPLES)
    follow.add_argument("--host", default="127.0.0.1", help="the stub's host (default: 127.0.0.1)")
    follow.add_argument("--port", type=int, default=DEFAULT_FOLLOW_PORT,
                        help=f"the follow channel port (default: {DEFAULT_FOLLOW_PORT}, the RSP port + 1)")
    follow.add_argument("--kernel", type=Path, default=paths.VMLINUX,
                        help="the kernel ELF with DWARF (default: the bundled one)")
    follow.add_argument("--from-start", action="store_true", help="first print the frames already in the buffer")
    follow.add_argument("--count", type=int, default=None, help="exit after this many frames")
    follow.add_argument("--quiet", action="store_true", help="print only missed counts and the summary")
    follow.add_argument("--consume", action="store_true",
                        help="a consuming read: frames shown leave the trace buffer (GDB no longer finds them)")

    record = _add(commands, "record", "record a run to disk as CTF while GDB traces",
                  "Drain every CPU's trace buffer through the follow channel as the frames are\n"
                  "committed and write them as a CTF 1.8 trace (one stream file per CPU), for\n"
                  "one run: the one running now, or the next tstart, until it stops.",
                  _RECORD_EXAMPLES)
    record.add_argument("-o", "--output", type=Path, required=True, help="a new directory for the trace")
    record.add_argument("--host", default="127.0.0.1", help="the stub's host (default: 127.0.0.1)")
    record.add_argument("--port", type=int, default=DEFAULT_FOLLOW_PORT,
                        help=f"the follow channel port (default: {DEFAULT_FOLLOW_PORT}, the RSP port + 1)")
    record.add_argument("--kernel", type=Path, default=paths.VMLINUX,
                        help="the kernel ELF with DWARF, to name fields (default: the bundled one)")
    record.add_argument("--max-size", type=_size, default=None, metavar="SIZE",
                        help="split each CPU's stream into files of at most SIZE bytes (K, M, G suffixes), as "
                             "LTTng's --tracefile-size")
    record.add_argument("--rotate", type=int, default=None, metavar="COUNT",
                        help="with --max-size: keep only the newest COUNT files of each CPU, as LTTng's "
                             "--tracefile-count")
    record.add_argument("--count", type=int, default=None, help="stop after this many frames")
    record.add_argument("--quiet", action="store_true", help="print only the summary")

    export = _add(commands, "export", "write a trace as CTF, Chrome JSON or JSON lines",
                  "Write every frame of a trace, its values named with the kernel's DWARF,\n"
                  "as CTF 1.8, Chrome trace-event JSON or JSON lines.", _EXPORT_EXAMPLES)
    _source(export)
    export.add_argument("--format", choices=("ctf", "chrome", "jsonl"), required=True,
                        help="CTF 1.8 (babeltrace2, Trace Compass), Chrome trace-event JSON (Perfetto) or JSON lines")
    export.add_argument("-o", "--output", type=Path, required=True,
                        help="a directory for ctf, a file for chrome and jsonl")

    plot = _add(commands, "plot", "draw a trace as PNGs: timeline, values, flame graph",
                "Draw timeline.png, distribution.png and flamegraph.png of a trace\n"
                "(needs matplotlib).",
                _PLOT_EXAMPLES)
    _source(plot)
    plot.add_argument("-o", "--output", type=Path, required=True, help="directory for the PNG files")
    plot.add_argument("--value", default=None,
                      help="collected expression whose distribution to draw (default: the first numeric one)")

    hotcode = _add(commands, "hotcode", "sample every CPU's PC at each tick: the hottest code",
                   "Sample the PC each timer tick interrupts (a tracepoint on timer_interrupt)\n"
                   "and print the hottest functions and source lines per CPU, after KGTP's\n"
                   "hotcode add-on.", _HOTCODE_EXAMPLES)
    hotcode.add_argument("--host", default="127.0.0.1", help="the stub's host (default: 127.0.0.1)")
    hotcode.add_argument("--port", type=int, default=1234, help="the stub's RSP port (default: 1234)")
    hotcode.add_argument("--follow-port", type=int, default=None, help="its follow channel (default: --port + 1)")
    hotcode.add_argument("--kernel", type=Path, default=paths.VMLINUX,
                         help="the kernel ELF with DWARF (default: the bundled one)")
    hotcode.add_argument("--seconds", type=float, default=5.0, help="how long to sample (default: 5)")
    hotcode.add_argument("--samples", type=int, default=None, help="stop after this many samples instead")
    hotcode.add_argument("--top", type=int, default=15, help="rows to print (default: 15)")
    hotcode.add_argument("--png", type=Path, default=None,
                         help="also draw the hottest functions and lines (needs matplotlib)")


def _size(text: str) -> int:
    """`64M` -> 67108864 (K, M, G: powers of 1024)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        size = int(float(value[:-1]) * units[value[-1]]) if value and value[-1] in units else int(value)
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (a number of bytes, or with K, M, G)") from None
    if size < 4096:
        raise argparse.ArgumentTypeError(f"{text}: at least 4K")
    return size


class UsageError(ValueError):
    """The arguments contradict each other (reported with exit status 2, as argparse reports its own)."""


def trace_file(args: argparse.Namespace) -> Path | None:
    """The trace export and plot read, given as TRACE or --file (never both); None: the live stub."""
    if args.trace is not None and args.file is not None:
        raise UsageError(f"give the trace file once: {args.trace} as TRACE or --file {args.file}, not both")
    return args.trace if args.trace is not None else args.file


def _load(args, path: Path | None):
    """The run to read: a tsave'd file or a recorded trace, or the running stub's buffer; read a piece at a
    time (sources.py)."""
    from .sources import open_stub, open_trace

    if path is None:
        return open_stub(args.host, args.port)
    trace = open_trace(path)
    notes = []  # a file from a target that did not save them (GDB's format has no field for either): say so
    if trace.cpu_source == "unknown":
        notes.append("no CPU ($cpu_id): CPUs are unknown")
    if trace.time_source == "frame-order":
        notes.append("no time ($clock): frames are placed 1 us apart, in their order")
    if notes:
        print(f"kgtp-sim {args.command}: {path}: its frames carry {'; '.join(notes)}", file=sys.stderr)
    return trace


def run(args: argparse.Namespace) -> int:
    from .channel import ChannelError
    from .model import TraceFormatError

    try:
        path = trace_file(args) if args.command in ("export", "plot") else None
        if args.command == "follow":
            from .follow import follow

            return follow(args.host, args.port, args.kernel, args.from_start, limit=args.count, quiet=args.quiet,
                          consume=args.consume)
        if args.command == "record":
            from .record import record

            if args.rotate is not None and args.max_size is None:
                raise UsageError("--rotate keeps the newest files of each CPU: give --max-size, their size")
            return record(args.host, args.port, args.output, args.kernel, max_size=args.max_size, keep=args.rotate,
                          count=args.count, quiet=args.quiet)
        if args.command == "export":
            from .export import FORMATS
            from .fields import FrameReader

            trace = _load(args, path)
            reader = FrameReader.open(trace, args.kernel)
            summary = FORMATS[args.format](trace, reader, args.output)
            print(f"kgtp-sim: wrote {summary['events']} frames as {args.format} to {args.output}")
            return 0
        if args.command == "plot":
            from ..optional import pyplot
            from .fields import FrameReader
            from .plot import plot_all

            pyplot("plot")  # before reading the trace: a missing package is said first
            trace = _load(args, path)
            reader = FrameReader.open(trace, args.kernel)
            for path in plot_all(trace, reader, args.output, value=args.value):
                print(f"kgtp-sim: wrote {path}")
            return 0
        if args.command == "hotcode":
            from .hotcode import hotcode

            if args.png is not None:
                from ..optional import pyplot

                pyplot("hotcode --png")  # before sampling
            follow_port = args.follow_port if args.follow_port is not None else args.port + 1
            return hotcode(args.host, args.port, follow_port, args.kernel, seconds=args.seconds,
                           samples=args.samples, top=args.top, png=args.png)
    except UsageError as error:
        print(f"kgtp-sim {args.command}: {error}", file=sys.stderr)
        return 2
    except (ChannelError, TraceFormatError, OSError) as error:
        print(f"kgtp-sim: {error}", file=sys.stderr)
        return 1
    return 2
