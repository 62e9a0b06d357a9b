"""While-stepping is exact with the kernel running beside a busy host CPU.

Every hit of a while-stepping tracepoint must be followed by frames at exactly the next instructions, however
the emulation is cut (ticks taken, requests of the server thread, a host too slow to keep the pace). Stepping
once worked through a code hook added from inside the int3 callback; blocks translated before it could run the
first steps unseen, so the steps were taken later, at the return into the caller or at the next call's first
instruction (frames at +0, +0, +7 where +0, +7, +12 were due), about one run in six beside a busy CPU. Twenty
rounds of twenty hits each here, beside a CPU hog.
"""

from __future__ import annotations

import subprocess
import sys
import time

from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import Tracer
from kgtp_sim.tracing.patching.probes import decode

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)
SITE = IMAGE.address_of("kgtp_test_function")
STEPS = 2
ROUNDS = 20


def _next_instructions() -> list[int]:
    insns = decode(IMAGE.read_code(SITE, 32), SITE)
    return [insn.address for insn in insns[1 : STEPS + 1]]


def _one_round(expected: list[int]) -> list[list[int]]:
    machine = Machine(IMAGE, hz=1000, pace=200)
    tracer = Tracer(machine, "opt")
    tracer.definitions.define(t.DefineTracepoint.parse(b"1:%x:E:%x:0-" % (SITE, STEPS)))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"1:%x:R01-" % SITE))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"1:%x:SR01" % SITE))
    tracer.start()
    machine.start()
    try:
        deadline = time.monotonic() + 30
        while tracer.status().created < 60:  # twenty hits with their steps: an event, not a time window
            assert time.monotonic() < deadline, tracer.status()
            time.sleep(0.01)
        tracer.stop(t.StopReason.STOP_COMMAND)
    finally:
        machine.shutdown()
    pcs = [frame.registers["rip"] for frame in tracer.frames()]
    groups, wrong = [], []
    for i, pc in enumerate(pcs):
        if pc == SITE:
            groups.append([pc])
        elif groups:
            groups[-1].append(pc)
    for group in groups[:-1]:  # the last hit may have been cut by tstop
        if group[1:] != expected:
            wrong.append(group)
    return wrong


def test_while_stepping_frames_are_the_next_instructions_beside_a_cpu_hog():
    expected = _next_instructions()
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        wrong = [g for _ in range(ROUNDS) for g in _one_round(expected)]
    finally:
        hog.kill()
        hog.wait()
    assert not wrong, f"steps after a hit should be at {[hex(a) for a in expected]}: {wrong[:5]}"
