"""The machine's memory must not depend on how often the kernel drops its demand pages.

Making demand pages absent again costs a full TLB flush (cpu.py, `unmap_demand_pages` -> `_flush_tlb`), and the
kernel's pagefault_test thread drops all of them every 256 * 5 ticks (12.8 s at 100 Hz). The soak found the
stub's RSS climbing from 53 MiB to 230 MiB over its first two minutes, with or without tracing, in steps that
double at those flushes, then staying there: with unicorn 2.1.4 every UC_CTL_TLB_FLUSH on a busy CPU grows the
emulator's memory until some cap (about 120 MiB with a flush every 50 ms, 376 MiB with one every 500 ms).

Measured in a child process, so the test suite's own memory stays out of it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from ..conftest import ROOT

CHILD = r"""
import time
from unicorn import UC_CTL_IO_WRITE
from unicorn.unicorn_const import UC_CTL_TLB_FLUSH
from kgtp_sim.machine import KernelImage, Machine

def rss_mib():
    return next(int(l.split()[1]) // 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))

machine = Machine(KernelImage.load("fixtures/vmlinux"), hz=100, pace=1000000)
machine.start()
time.sleep(0.5)
before = rss_mib()
deadline = time.monotonic() + 2.0
while time.monotonic() < deadline:
    machine.run_on_cpu(lambda uc: uc.ctl(UC_CTL_TLB_FLUSH, UC_CTL_IO_WRITE))
    time.sleep(0.05)
print(rss_mib() - before)
machine.shutdown()
"""


@pytest.mark.xfail(strict=True, reason="each full TLB flush of a busy unicorn 2.1.4 CPU grows the stub's memory, "
                                       "up to hundreds of MiB (soak bug 3)")
def test_forty_tlb_flushes_leave_memory_flat():
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[-1]) < 16
