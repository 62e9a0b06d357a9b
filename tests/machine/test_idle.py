"""An idle stub must not burn a host core: the kernel sleeps in hlt and the machine sleeps with it.

Its own module: the other machine tests keep a machine running, which would count against this one.
"""

from __future__ import annotations

import time

from kgtp_sim.machine import KernelImage, Machine

from ..conftest import VMLINUX


def test_idle_machine_barely_uses_the_host_cpu():
    machine = Machine(KernelImage.load(VMLINUX), hz=100)
    machine.start()
    try:
        time.sleep(0.3)  # boot
        cpu0, wall0 = time.process_time(), time.monotonic()
        time.sleep(2.0)
        usage = (time.process_time() - cpu0) / (time.monotonic() - wall0)
        stats = machine.stats()
    finally:
        machine.shutdown()
    assert stats.ticks >= 150  # the kernel did run: 100 Hz with its default workload
    assert stats.idle_s > 1.5  # ...and spent most of the time asleep in hlt
    assert usage < 0.10, f"{usage:.1%} of a host CPU"
