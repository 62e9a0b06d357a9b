"""The trace clock: the emulated CPU's TSC, read from Python by a private one-instruction CPU."""

from __future__ import annotations

import subprocess
import sys
import time

from kgtp_sim.tracing.core.clock import Tsc

from ..conftest import ROOT

CHILD = r"""
import ctypes
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: resident memory counted 4 KiB at a time
from kgtp_sim.tracing.core.clock import Tsc

def rss_kib():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))

tsc = Tsc()
tsc.read()
before = rss_kib()
for _ in range(50_000):
    tsc.read()
print(rss_kib() - before)
"""


def test_reads_follow_the_host_clock_and_convert_to_nanoseconds():
    tsc = Tsc()
    first = tsc.read()
    time.sleep(0.01)
    second = tsc.read()
    assert second > first
    assert tsc.to_ns(second - first) >= 5_000_000  # at least 5 of the 10 ms slept
    assert tsc.now() >= second


def test_reading_the_clock_does_not_grow_memory():
    """Each read is an emulation run; ended by an `until` address it left a fresh translation behind every
    time (about 18 MiB per 50,000 reads). Ended by `hlt`, the one translation is reused."""
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) < 2048, f"{result.stdout.strip()} KiB after 50,000 reads"


def test_reads_from_two_threads_at_once_never_fail_nor_go_back():
    """The CPU thread stamps frames while the server thread answers `print $rdtsc`: one private CPU, read under
    a lock (without it, unicorn's run of one thread fails inside the other's)."""
    import threading

    tsc = Tsc()
    problems: list[str] = []

    def reader() -> None:
        last = 0
        try:
            for _ in range(20_000):
                value = tsc.read()
                if value < last:
                    problems.append(f"{value} after {last}")
                last = value
        except Exception as error:  # noqa: BLE001 (the test reports it)
            problems.append(repr(error))

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not problems, problems[:3]
