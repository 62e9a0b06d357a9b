"""The harness' error log (kgtp_sim/tools/fuzz_harness.py): each harness reports the errors of its own stub, once.

An error its machine's CPU thread logs between two packets (a hit that failed, a machine that stopped) is reported
at the next packet; errors of another harness' machine, or logged while no session is fed, are not its. The
combination suite holds a harness per machine in one process (the kernel's, and gdbserver roles for programs): an
error of one once counted for the next packet of every other, and an error logged between packets for none."""

from __future__ import annotations

import logging

import pytest

from kgtp_sim.app import Stub, StubConfig
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.tools.fuzz_harness import FuzzFailure, Harness

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)
log = logging.getLogger("kgtp_sim.test")


def test_each_harness_reports_its_own_machines_errors_once():
    running = Harness(Stub(Machine(IMAGE, cpus=1), StubConfig()), started=True)
    other = Harness(Stub(Machine(IMAGE, cpus=1), StubConfig()), started=False)
    try:
        running.machine.run_on_cpu(lambda uc: log.error("a hit failed on the CPU thread"))
        log.error("logged by the test between packets")  # neither harness's
        assert other.request(b"QTFrame:ffffffff") == [b"OK"]
        with pytest.raises(FuzzFailure, match="a hit failed on the CPU thread"):
            running.request(b"QTFrame:ffffffff")
        assert running.request(b"QTFrame:ffffffff") == [b"OK"]  # reported once
        assert other.request(b"QTFrame:ffffffff") == [b"OK"]
    finally:
        running.close()
        other.close()
        running.machine.shutdown()
        other.machine.shutdown()
