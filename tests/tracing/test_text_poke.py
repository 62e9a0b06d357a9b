"""Patching a probe site while other CPUs run it, text_poke_bp's way (tracing/engines/native.py `patch_to`,
`unpatch_site`): an int3 first, every CPU synchronised, the jump's tail only when no CPU is inside the window,
synchronised, the first byte; removal in the same three steps.

Deterministic, on an unbooted two-CPU machine: CPU 1 is parked part-way into kgtp_bench_loop (whose first
instructions are shorter than a jump) with `Cpu.run(count=...)`, and `Machine.synchronize` is where the test lets
CPU 1 run while a patch is half done, as a CPU would between the steps.
"""

from __future__ import annotations

import struct

import pytest

from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.cpu import Stop
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import Tracer

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)
LOOP = IMAGE.address_of("kgtp_bench_loop")
COUNTER = IMAGE.address_of("kgtp_counter")
FIRST = 3  # kgtp_bench_loop's first instruction, `mov %rdi, %rax`: shorter than the 5-byte jump
REGS_AND_RIP = b"R30"  # rdi, rsi (a compact block: every frame also records rip)


class Parked:
    """A kgtp_bench_loop(n) call on CPU `cpu`, run `steps` instructions so far."""

    def __init__(self, machine: Machine, cpu: int, n: int) -> None:
        self.machine, self.cpu, self.n = machine, cpu, n
        stack = machine.alloc_data(0x4000)
        self.sentinel = machine.alloc_code(32) + 16
        machine.write_memory(self.sentinel, b"\xf4")

        def enter(uc) -> None:
            rsp = stack + 0x4000 - 8
            uc.mem_write(rsp, struct.pack("<Q", self.sentinel))
            machine.set_registers({"rsp": rsp, "rip": LOOP, "rdi": n})

        machine.on_cpu(cpu, enter)

    def step(self, count: int) -> int:
        """Run `count` more instructions on the parked CPU; its RIP after them."""
        def run(_uc) -> int:
            self.machine.cpu.run(count=count)
            return self.machine.cpu.rip

        return self.machine.on_cpu(self.cpu, run)

    def finish(self) -> int:
        def run(uc) -> int:
            while self.machine.cpu.run(until=self.sentinel) is not Stop.UNTIL:
                pass
            return self.machine.registers()["rax"]

        return self.machine.on_cpu(self.cpu, run)


def tracer_at_loop(machine: Machine, engine: str) -> Tracer:
    tracer = Tracer(machine, engine)
    tracer.definitions.define(t.DefineTracepoint.parse(b"1:%x:E:0:0-" % LOOP))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"1:%x:%s" % (LOOP, REGS_AND_RIP)))
    return tracer


def kind(tracer: Tracer) -> str:
    (row,) = tracer.probe_rows()
    return row.kind


def counter(machine: Machine) -> int:
    return machine.read_symbol("kgtp_counter")


@pytest.mark.parametrize("engine", ["naive", "opt"])
def test_a_cpu_inside_the_window_keeps_the_site_an_int3(engine):
    """CPU 1 stopped after the site's first instruction: writing the jump's tail would hand it the middle of
    a jump. The patch stops at the int3, and both CPUs compute what they compute unprobed."""
    machine = Machine(IMAGE, cpus=2)
    parked = Parked(machine, 1, 7)
    assert parked.step(1) == LOOP + FIRST  # inside [LOOP + 1, LOOP + 5)
    before = counter(machine)
    tracer = tracer_at_loop(machine, engine)
    tracer.start()
    assert kind(tracer) == "int3"
    assert machine.read_memory(LOOP + 1, 4) == IMAGE.read_code(LOOP + 1, 4)  # the tail untouched
    machine.on_cpu(0, lambda uc: None)
    assert machine.call("kgtp_bench_loop", 5) == 5  # CPU 0 enters through the int3: one frame
    assert parked.finish() == 7  # CPU 1 resumes the original instructions
    assert counter(machine) == before + 12
    frames = tracer.frames()
    assert len(frames) == 1
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert machine.read_memory(LOOP, 8) == IMAGE.read_code(LOOP, 8)


@pytest.mark.parametrize("engine", ["naive", "opt"])
def test_with_the_window_free_the_site_gets_its_jump(engine):
    machine = Machine(IMAGE, cpus=2)
    parked = Parked(machine, 1, 7)
    assert parked.step(4) not in range(LOOP + 1, LOOP + 5)  # past the window
    tracer = tracer_at_loop(machine, engine)
    tracer.start()
    assert kind(tracer) == "jump" and machine.read_memory(LOOP, 1) == b"\xe9"
    assert parked.finish() == 7
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert machine.read_memory(LOOP, 8) == IMAGE.read_code(LOOP, 8)


@pytest.mark.parametrize("engine", ["naive", "opt"])
def test_a_cpu_meeting_the_int3_while_the_jump_goes_in_or_out_is_sent_on(engine, monkeypatch):
    """CPU 1 sits at the site. While the jump is written (and again while it is removed) it runs on between
    the steps, as another CPU would: it meets the first step's int3 and goes through the detour (one frame
    each time); it never sees half a jump, and its calls return what they return unprobed."""
    machine = Machine(IMAGE, cpus=2)
    parked = [Parked(machine, 1, 3)]
    seen = []
    real_synchronize = machine.synchronize

    def synchronize() -> None:
        if parked:
            call = parked.pop()
            seen.append(bytes(machine.read_memory(LOOP, 5)))
            assert call.finish() == call.n  # through the int3, the detour, the relocated instructions
        real_synchronize()

    monkeypatch.setattr(machine, "synchronize", synchronize)
    before = counter(machine)
    tracer = tracer_at_loop(machine, engine)
    tracer.start()
    assert kind(tracer) == "jump"
    assert seen == [b"\xcc" + IMAGE.read_code(LOOP + 1, 4)]  # CPU 1 ran while only the int3 was in
    assert len(tracer.frames()) == 1  # ... and was traced through it
    parked.append(Parked(machine, 1, 4))
    machine.on_cpu(0, lambda uc: None)
    jump = bytes(machine.read_memory(LOOP, 5))
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert seen[1] == b"\xcc" + jump[1:]  # CPU 1 ran while the int3 stood before the jump's tail
    assert machine.read_memory(LOOP, 8) == IMAGE.read_code(LOOP, 8)
    assert counter(machine) == before + 3 + 4
