"""Stopping a run while a hit is inside its detour: the CPU runs the hit out of the tracer's code first.

A collection of unmapped memory faults (a #PF from the MMU) and reaches its fault fixup. The run used to be let
out one instruction at a time, and a run limited by an instruction count drops the #PF its instruction raises:
the faulting read was retried forever and `tstop` never answered (about one stop in three).
"""

from __future__ import annotations

import threading
import time

import pytest

from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import Tracer

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)
SITE = IMAGE.address_of("kgtp_test_function")
COUNTER = IMAGE.address_of("kgtp_counter")


@pytest.mark.parametrize("engine", ["naive", "opt"])
def test_stop_during_faulting_collections_always_returns(engine):
    for _ in range(25):
        machine = Machine(IMAGE)
        tracer = Tracer(machine, engine)
        tracer.definitions.define(t.DefineTracepoint.parse(b"1:%x:E:0:0-" % SITE))
        tracer.definitions.add_actions(t.TracepointActions.parse(b"1:%x:M-1,10,8M-1,%x,4" % (SITE, COUNTER)))
        machine.start()
        try:
            tracer.start()
            deadline = time.monotonic() + 30
            while tracer.status().created < 1:  # a hit happened: the workload runs through the detour
                assert time.monotonic() < deadline
                time.sleep(0.001)
            stopper = threading.Thread(target=tracer.stop, args=(t.StopReason.STOP_COMMAND,), daemon=True)
            stopper.start()
            stopper.join(60)
            assert not stopper.is_alive(), "tstop did not return"
            frames = tracer.frames()
        finally:
            machine.shutdown()
        assert frames and all(len(f.blocks) == 1 and f.blocks[0].address == COUNTER for f in frames)
