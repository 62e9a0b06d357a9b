"""While-stepping runs with interrupts off, as KGTP's does: no interrupt comes between a hit and its steps.

The steps run the probed instruction in place, with the probe's int3 lifted until they end. An interrupt taken
between them (a timer tick came due during the hit) once ran the kernel's handler with the hit counted and its
`addl $1, kgtp_counter` not done, let the handler preempt the hit task or the scheduler switch to another CPU,
whose calls then ran past the lifted int3 unseen (or, beside a second while-stepping tracepoint, hit with no
steps), and let a stop of every CPU land with the steps half done: the combination suite found hits a third of
the calls, one hit more than the calls, and hits without their step frames. KGTP clears IF at the hit and puts it
back when the steps end (gtp_kp_post_handler, gtp_step_stop); an interrupt that comes due meanwhile is taken
after them.
"""

from __future__ import annotations

import time

from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.scheduler import TIMER_VECTOR
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import Tracer
from kgtp_sim.tracing.core.frames import MemoryBlock
from kgtp_sim.tracing.patching.probes import decode

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)
SITE = IMAGE.address_of("kgtp_test_function")
COUNTER = IMAGE.address_of("kgtp_counter")
STEPS = 2
HITS = 20


def test_an_interrupt_due_at_a_while_stepping_hit_is_taken_after_the_steps():
    """At a hit a timer interrupt is sent to the hitting CPU (due at once: the CPU's run is cut at the next
    instruction), one at a time, until twenty were taken; none may be delivered before the steps ended."""
    machine = Machine(IMAGE, hz=100)
    tracer = Tracer(machine, "interp")
    tracer.definitions.define(t.DefineTracepoint.parse(b"1:%x:E:%x:0-" % (SITE, STEPS)))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"1:%x:R010000-" % SITE))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"1:%x:M-1,%x,4-" % (SITE, COUNTER)))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"1:%x:SR010000" % SITE))
    stepper = tracer.stepper
    sent: list[int] = []
    delivered: list[tuple[bool, int]] = []  # timer interrupts (ours or the ticker's): during the steps?, rip
    start, deliver = stepper.start, machine.cpu.deliver

    def start_and_interrupt(uc, item, **kwargs):
        start(uc, item, **kwargs)
        if len(sent) < HITS and len(sent) <= len(delivered):  # the one sent before was taken
            sent.append(item.hits)
            machine.send_interrupt(0, TIMER_VECTOR)

    def noting_deliver(vector, error_code=None):
        if vector == TIMER_VECTOR:
            delivered.append((stepper.active, machine.cpu.rip))
        deliver(vector, error_code)

    stepper.start = start_and_interrupt
    machine.cpu.deliver = noting_deliver
    tracer.start()
    machine.start()
    try:
        deadline = time.monotonic() + 60
        while len(sent) < HITS or len(delivered) < HITS:  # events, not a time window
            assert time.monotonic() < deadline, (len(sent), len(delivered), tracer.status())
            assert not any(active for active, _ in delivered), "an interrupt delivered during the steps"
            time.sleep(0.01)
        machine.control.stop()
        calls = int.from_bytes(machine.read_memory(COUNTER, 4), "little")
        tracer.stop(t.StopReason.STOP_COMMAND)
    finally:
        machine.shutdown()
    during = [rip for active, rip in delivered if active]
    assert not during, f"interrupts delivered between a hit and its steps, at {[hex(r) for r in during[:5]]}"

    # every hit has its steps at the next instructions, and read a kgtp_counter of its own
    following = [insn.address for insn in decode(IMAGE.read_code(SITE, 32), SITE)[1: STEPS + 1]]
    groups: list[list[int]] = []
    values = []
    for frame in tracer.frames():
        rip = frame.registers["rip"]
        if rip == SITE:
            groups.append([])
            values += [int.from_bytes(b.data, "little") for b in frame.blocks if isinstance(b, MemoryBlock)]
        elif groups:
            groups[-1].append(rip)
    assert all(group == following for group in groups), groups[:5]
    assert len(values) == len(set(values)) and max(values) < calls
