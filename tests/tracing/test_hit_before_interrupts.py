"""An interpreted int3 hit and its probed instruction are one step of the kernel: no interrupt comes between them.

The Python hit path moves the CPU to the probe's out-of-line copy of the probed instruction (the stub's code, in
module space), which the scheduler (machine/scheduler.py) neither switches out nor interrupts. A timer tick that
came due during a hit was once delivered right there: the kernel's handler ran with the hit recorded and its
`addl $1, kgtp_counter` not yet done, and could schedule another task, so a stop of every CPU found more hits than
calls, and two hits read one kgtp_counter (the benchmark threads of a freshly booted machine, whose first hits are
slow, made it likely).
"""

from __future__ import annotations

import time

import pytest

from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.layout import MODULE_BASE, MODULE_SIZE
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import Tracer
from kgtp_sim.tracing.core.frames import MemoryBlock

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)
SITE = IMAGE.address_of("kgtp_test_function")
COUNTER = IMAGE.address_of("kgtp_counter")


def _counter(machine: Machine) -> int:
    return int.from_bytes(machine.read_memory(COUNTER, 4), "little")


@pytest.mark.parametrize("cpus", [1, 2])
def test_every_hit_has_run_its_probed_instruction_when_the_cpus_stop(cpus):
    machine = Machine(IMAGE, cpus=cpus, hz=1000)
    tracer = Tracer(machine, "interp", probe="int3")
    tracer.definitions.define(t.DefineTracepoint(number=1, address=SITE, more=True))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"1:%x:M-1,%x,4" % (SITE, COUNTER)))
    machine.start()
    problems: list[str] = []
    try:
        machine.control.stop()
        first = _counter(machine)
        tracer.start()  # at once after boot: the first hits are the slow ones
        for window in range(40):
            machine.control.resume()
            time.sleep(0.01)
            machine.control.stop()
            rips = machine.run_on_cpu(lambda _uc: machine.cpu_rips())
            stub = [cpu for cpu, rip in enumerate(rips) if MODULE_BASE <= rip < MODULE_BASE + MODULE_SIZE]
            calls, hits = _counter(machine) - first, tracer.probes.installed[(1, SITE)].hits
            if stub or hits != calls:
                problems.append(f"stop {window}: {hits} hits, {calls} calls, CPUs {stub} in the stub's code")
        tracer.stop(t.StopReason.STOP_COMMAND)
        values = [int.from_bytes(b.data, "little") for f in tracer.frames() for b in f.blocks
                  if isinstance(b, MemoryBlock)]
    finally:
        machine.shutdown()
    assert not problems, problems[:5]
    assert sorted(values) == list(range(first, first + len(values))), "a kgtp_counter read by two hits"
    assert len(values) > 50
