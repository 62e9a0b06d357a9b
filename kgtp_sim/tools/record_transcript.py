"""Record a real GDB session against a freshly started stub as a transcript (see transcript.py).

    python -m kgtp_sim.tools.record_transcript OUT.rsp --gdb /usr/bin/gdb -- -ex 'info registers rip' ...

Starts `kgtp-sim serve` on a free port, puts the recording proxy in front of it, runs GDB in batch mode with
the bundled kernel's symbols and the given GDB arguments, and writes what went over the wire.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from .transcript import RecordingProxy

ROOT = Path(__file__).resolve().parents[2]


def start_stub(extra: list[str] | None = None) -> tuple[subprocess.Popen, int]:
    """Start `kgtp-sim serve --port 0` and return it with the port it printed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kgtp_sim", "serve", "--port", "0", *(extra or [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        match = re.search(r"listening on [\d.]+:(\d+)", line)
        if match:
            return proc, int(match.group(1))
    proc.wait()
    raise RuntimeError("the stub exited before listening")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--gdb", default="/usr/bin/gdb")
    parser.add_argument("gdb_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    gdb_args = [a for a in args.gdb_args if a != "--"]
    stub, port = start_stub()
    try:
        proxy = RecordingProxy(("127.0.0.1", port))
        version = subprocess.run([args.gdb, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
        command = [args.gdb, "-nx", "-batch", str(ROOT / "fixtures" / "vmlinux"),
                   "-ex", f"target remote 127.0.0.1:{proxy.port}", *gdb_args, "-ex", "detach"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        proxy.wait()
        shown = " ".join(a if a.startswith("-") else repr(a) for a in gdb_args)
        proxy.write(args.out, [f"recorded from a real session of {version}", f"gdb arguments: {shown}"])
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        return result.returncode
    finally:
        stub.terminate()
        stub.wait(10)


if __name__ == "__main__":
    raise SystemExit(main())
