"""CI smoke run: start a fresh stub, drive real GDB through a short session, exit non-zero on any mismatch.

Each check is a GDB command and a predicate over what GDB printed; the first failure is reported with the
whole GDB output so a broken CI run says what went wrong without a rerun.

Runs on the main thread of `scripts/smoke`; the stub and GDB are child processes (a daemon thread of kgtp_sim.client
drains the stub's output).
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable

from ..client import gdb_each, start_stub, system_gdb


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
    gdb = system_gdb()
    if gdb is None:
        print("smoke: gdb not found", file=sys.stderr)
        return 2
    started = time.monotonic()
    stub = start_stub()
    try:
        text = gdb_each(gdb, stub, "print jiffies", "shell sleep 0.3", "print jiffies", "info registers rip",
                        "print tasks[1].comm", "monitor stats", "detach", timeout=60)
    finally:
        stub.stop()
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
