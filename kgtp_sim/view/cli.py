"""The `kgtp-sim follow | export | plot | hotcode` commands: argument parsing and dispatch (main thread)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..client import paths
from .channel import DEFAULT_FOLLOW_PORT

COMMANDS = ("follow", "export", "plot", "hotcode")


def _source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="the stub's host (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_FOLLOW_PORT,
                        help=f"the stub's follow channel port (default: {DEFAULT_FOLLOW_PORT}, the RSP port + 1)")
    parser.add_argument("--file", type=Path, default=None, metavar="TRACE.tf",
                        help="read a file `tsave` wrote instead of a running stub ($_sdata is not in such files)")
    parser.add_argument("--kernel", type=Path, default=paths.VMLINUX, help="the kernel ELF with DWARF")


def add_parsers(commands) -> None:
    follow = commands.add_parser("follow", help="print trace frames as they are committed (read-only, beside GDB)")
    follow.add_argument("--host", default="127.0.0.1")
    follow.add_argument("--port", type=int, default=DEFAULT_FOLLOW_PORT,
                        help=f"the follow channel port (default: {DEFAULT_FOLLOW_PORT})")
    follow.add_argument("--kernel", type=Path, default=paths.VMLINUX)
    follow.add_argument("--from-start", action="store_true", help="first print the frames already in the buffer")
    follow.add_argument("--count", type=int, default=None, help="exit after this many frames")
    follow.add_argument("--quiet", action="store_true", help="print only missed counts and the summary")
    follow.add_argument("--consume", action="store_true",
                        help="a consuming read: frames shown leave the trace buffer (GDB no longer finds them)")

    export = commands.add_parser("export", help="write a run as CTF, Chrome trace-event JSON or JSON lines")
    _source(export)
    export.add_argument("--format", choices=("ctf", "chrome", "jsonl"), required=True)
    export.add_argument("-o", "--output", type=Path, required=True,
                        help="a directory for ctf, a file for chrome and jsonl")

    plot = commands.add_parser("plot", help="PNG pictures of a run: timeline, value distribution, flame graph")
    _source(plot)
    plot.add_argument("-o", "--output", type=Path, required=True, help="directory for the PNG files")
    plot.add_argument("--value", default=None,
                      help="collected expression whose distribution to draw (default: the first numeric one)")

    hotcode = commands.add_parser("hotcode", help="sample each CPU's PC at every timer tick: the hottest code")
    hotcode.add_argument("--host", default="127.0.0.1")
    hotcode.add_argument("--port", type=int, default=1234, help="the stub's RSP port (default: 1234)")
    hotcode.add_argument("--follow-port", type=int, default=None, help="its follow channel (default: --port + 1)")
    hotcode.add_argument("--kernel", type=Path, default=paths.VMLINUX)
    hotcode.add_argument("--seconds", type=float, default=5.0, help="how long to sample (default: 5)")
    hotcode.add_argument("--samples", type=int, default=None, help="stop after this many samples instead")
    hotcode.add_argument("--top", type=int, default=15, help="rows to print (default: 15)")
    hotcode.add_argument("--png", type=Path, default=None, help="also draw the hottest functions and lines")


def _load(args):
    from .channel import snapshot
    from .model import load_tfile

    if args.file is not None:
        return load_tfile(args.file)
    return snapshot(args.host, args.port)


def run(args: argparse.Namespace) -> int:
    from .channel import ChannelError
    from .model import TraceFormatError

    try:
        if args.command == "follow":
            from .follow import follow

            return follow(args.host, args.port, args.kernel, args.from_start, limit=args.count, quiet=args.quiet,
                          consume=args.consume)
        if args.command == "export":
            from .export import FORMATS
            from .fields import FrameReader

            trace = _load(args)
            reader = FrameReader.open(trace, args.kernel)
            summary = FORMATS[args.format](trace, reader, args.output)
            print(f"kgtp-sim: wrote {summary['events']} frames as {args.format} to {args.output}")
            return 0
        if args.command == "plot":
            from .fields import FrameReader
            from .plot import plot_all

            trace = _load(args)
            reader = FrameReader.open(trace, args.kernel)
            for path in plot_all(trace, reader, args.output, value=args.value):
                print(f"kgtp-sim: wrote {path}")
            return 0
        if args.command == "hotcode":
            from .hotcode import hotcode

            follow_port = args.follow_port if args.follow_port is not None else args.port + 1
            return hotcode(args.host, args.port, follow_port, args.kernel, seconds=args.seconds,
                           samples=args.samples, top=args.top, png=args.png)
    except (ChannelError, TraceFormatError, OSError) as error:
        print(f"kgtp-sim: {error}", file=sys.stderr)
        return 1
    return 2
