"""Record a real GDB session against a freshly started stub as a transcript (see transcript.py).

    python -m kgtp_sim.tools.record_transcript [--gdb /usr/bin/gdb] OUT.rsp -ex 'info registers rip' ...

Starts `kgtp-sim serve` on a free port, puts the recording proxy in front of it, runs GDB in batch mode with
the bundled kernel's symbols and the given GDB arguments, and writes what went over the wire. The stub has one
CPU, as the machine tests/e2e/test_transcripts.py replays against (the thread packets' replies depend on it).

It runs in its own process: the recording proxy relays on threads of its own (transcript.py) while GDB runs in
the foreground on the main thread.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..client import gdb_batch, gdb_version, start_stub, system_gdb
from .transcript import RecordingProxy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--gdb", default=system_gdb() or "gdb")
    parser.add_argument("gdb_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    gdb_args = [a for a in args.gdb_args if a != "--"]
    stub = start_stub(cpus=1)
    try:
        proxy = RecordingProxy(("127.0.0.1", stub.port))
        version = gdb_version(args.gdb)
        result = gdb_batch(args.gdb, "-ex", f"target remote 127.0.0.1:{proxy.port}", *gdb_args, "-ex", "detach",
                           timeout=120)
        proxy.wait()
        shown = " ".join(a if a.startswith("-") else repr(a) for a in gdb_args)
        proxy.write(args.out, [f"recorded from a real session of {version}", f"gdb arguments: {shown}"])
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        return result.returncode
    finally:
        stub.stop()


if __name__ == "__main__":
    raise SystemExit(main())
