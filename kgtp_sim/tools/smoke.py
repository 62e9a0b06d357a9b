"""CI smoke run: start a fresh stub, drive real GDB through a short session, exit non-zero on any mismatch.

Each check is a GDB command and a predicate over what GDB printed; the first failure is reported with the
whole GDB output so a broken CI run says what went wrong without a rerun.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable

from .record_transcript import ROOT, start_stub

VMLINUX = ROOT / "fixtures" / "vmlinux"


def _numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"^\$\d+ = (\d+)$", text, re.M)]


CHECKS: list[tuple[str, Callable[[str], bool]]] = [
    ("attached with symbols",
     lambda out: re.search(r"^(0x[0-9a-f]+ in )?\w+ \(.*\) at \S+\.[cS]:\d+$", out, re.M) is not None),
    ("jiffies grows while attached", lambda out: len(_numbers(out)) >= 2 and _numbers(out)[1] > _numbers(out)[0]),
    ("rip is in kernel text", lambda out: re.search(r"^rip\s+0xffffffff8", out, re.M) is not None),
    ("a task has a name", lambda out: re.search(r'^\$\d+ = "\w', out, re.M) is not None),
    ("monitor stats answers", lambda out: "instructions" in out),
]


def main() -> int:
    gdb = shutil.which("gdb")
    if gdb is None:
        print("smoke: gdb not found", file=sys.stderr)
        return 2
    started = time.monotonic()
    stub, port = start_stub()
    try:
        command = [
            gdb, "-nx", "-batch", str(VMLINUX), "-ex", f"target remote 127.0.0.1:{port}",
            "-ex", "print jiffies", "-ex", "shell sleep 0.3", "-ex", "print jiffies",
            "-ex", "info registers rip", "-ex", "print tasks[1].comm", "-ex", "monitor stats", "-ex", "detach",
        ]
        out = subprocess.run(command, capture_output=True, text=True, timeout=60)
        text = out.stdout + out.stderr
    finally:
        stub.terminate()
        stub.wait(10)
    failed = [name for name, check in CHECKS if not check(text)]
    for name, _ in CHECKS:
        print(f"{'FAIL' if name in failed else 'PASS'}: {name}")
    if failed:
        print("--- gdb output ---\n" + text, file=sys.stderr)
        return 1
    print(f"smoke: {len(CHECKS)} passed, 0 failed in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
