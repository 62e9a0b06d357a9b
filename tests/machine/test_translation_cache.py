"""The emulator's translation cache is bounded: a serving machine's memory stops growing under compiled tracing.

Compiled tracing at full pace on a running machine makes the emulator translate code it never runs again (about
4 MiB of host memory a second, seen in the soak); with its default 1 GiB cache that memory was only reclaimed
after a gigabyte. The machine now sets a cache of `TRANSLATION_CACHE` bytes, which the emulator empties and refills
by itself when full.
"""

from __future__ import annotations

import time

from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.cpu import TRANSLATION_CACHE
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import Tracer

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)
SITE = IMAGE.address_of("kgtp_test_function")


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def _until_frames(tracer: Tracer, count: int) -> None:
    deadline = time.monotonic() + 300
    while tracer.status().created < count:  # frames, not seconds: a loaded host is just slower
        assert time.monotonic() < deadline, tracer.status()
        time.sleep(0.05)


def test_the_cache_is_set_small():
    machine = Machine(IMAGE)
    assert machine.cpu.uc.ctl_get_tcg_buffer_size() == TRANSLATION_CACHE <= 64 << 20


def test_memory_stays_bounded_under_compiled_tracing_at_full_pace():
    machine = Machine(IMAGE, pace=2000)
    tracer = Tracer(machine, "opt")
    tracer.definitions.define(t.DefineTracepoint.parse(b"1:%x:E:0:0-" % SITE))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"1:%x:R01ffff" % SITE))
    tracer.definitions.buffer_size = 1 << 17
    tracer.definitions.circular = True
    tracer.start()
    machine.start()
    try:
        _until_frames(tracer, 50_000)
        warm = _rss_mib()
        _until_frames(tracer, 650_000)
        grown = _rss_mib() - warm
        tracer.stop(t.StopReason.STOP_COMMAND)
    finally:
        machine.shutdown()
    # the 1 GiB default grew about 66 MiB over these 600,000 frames; the bounded cache fills once, then stays
    assert grown < 44, f"host memory grew {grown:.1f} MiB"  # 32 MiB of cache filling, and some slack
