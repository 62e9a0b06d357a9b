"""The trace clock: the emulated CPU's TSC, read from Python by `rdtsc` in host code (or, where W+X pages are refused,
by a private one-instruction CPU), one clock for the frames of every hit path."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.clock import HostTsc
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import Tracer
from kgtp_sim.tracing.core.builtins import BUILTIN_VARIABLES
from kgtp_sim.tracing.core.clock import Tsc

from ..conftest import ROOT, VMLINUX

CHILD = r"""
import ctypes
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: resident memory counted 4 KiB at a time
from kgtp_sim.machine.clock import HostTsc
from kgtp_sim.tracing.core.clock import Tsc

def rss_kib():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))

tsc = Tsc()
tsc.clock.host = HostTsc(native=NATIVE)
tsc.read()
before = rss_kib()
for _ in range(50_000):
    tsc.read()
print(rss_kib() - before)
"""


BOTH = pytest.mark.parametrize("native", [True, False], ids=["native", "private-cpu"])


def _tsc(native: bool) -> Tsc:
    tsc = Tsc()
    tsc.clock.host = HostTsc(native=native)
    return tsc


@BOTH
def test_reads_follow_the_host_clock_and_convert_to_nanoseconds(native):
    tsc = _tsc(native)
    first = tsc.read()
    time.sleep(0.01)
    second = tsc.read()
    assert second > first
    assert tsc.to_ns(second - first) >= 5_000_000  # at least 5 of the 10 ms slept


@BOTH
def test_reading_the_clock_does_not_grow_memory(native):
    """Each read of the private CPU is an emulation run; ended by an `until` address it left a fresh translation
    behind every time (about 18 MiB per 50,000 reads). Ended by `hlt`, the one translation is reused."""
    child = f"NATIVE = {native}\n" + CHILD
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) < 2048, f"{result.stdout.strip()} KiB after 50,000 reads"


@BOTH
def test_reads_from_two_threads_at_once_never_fail_nor_go_back(native):
    """The CPU thread stamps frames while the server thread answers `print $rdtsc`: one private CPU, read under
    a lock (without it, unicorn's run of one thread fails inside the other's)."""
    import threading

    tsc = _tsc(native)
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


IMAGE = KernelImage.load(VMLINUX)
N = {b.name: b.number for b in BUILTIN_VARIABLES}


@pytest.mark.parametrize("engine", ["naive", "opt"])
def test_native_and_python_frames_of_one_cpu_are_in_time_order_after_the_machine_stood_still(engine):
    """A compiled tracepoint's frames are stamped by `rdtsc` in the detour, a watch tracepoint's in Python. Both
    must read one clock: Python's stamps were once extrapolated from tstart at a rate measured over 20 ms (some
    milliseconds off after a few seconds) from a reading that had the machine's stopped time taken out twice, so
    on one CPU a watch frame came out older than the compiled frame before it and the merged frames (ordered by
    timestamp) went back in time."""
    function, counter = IMAGE.address_of("kgtp_test_function"), IMAGE.address_of("kgtp_counter")
    machine = Machine(IMAGE, cpus=1)
    tracer = Tracer(machine, engine)
    tracer.definitions.define(t.DefineTracepoint(number=1, address=function, more=True))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"1:%x:M-1,%x,4" % (function, counter)))
    static = t.EvalExpression(bytes.fromhex("22012d002027"))  # const8 1; setv $watch_static; end
    tracer.definitions.define(t.DefineTracepoint(number=2, address=counter, more=True))
    tracer.definitions.add_actions(t.TracepointActions(number=2, address=counter, actions=(static,)))
    machine.start()
    try:
        for _ in range(3):  # a debugger stops the machine a while: its TSC does not run meanwhile
            machine.control.stop()
            time.sleep(0.1)
            machine.control.resume()
        tracer.start()
        deadline = time.monotonic() + 60
        while tracer.status().created < 600:
            assert time.monotonic() < deadline, "the kernel made too few calls"
            time.sleep(0.05)
        tracer.stop(t.StopReason.STOP_COMMAND)
        frames = tracer.frames()
    finally:
        machine.shutdown()
    assert {f.tracepoint for f in frames} == {1, 2}
    back = [(a.tracepoint, b.tracepoint) for a, b in zip(frames, frames[1:]) if b.timestamp < a.timestamp]
    assert not back, f"{len(back)} of {len(frames)} frames older than the one before them: {back[:5]}"
