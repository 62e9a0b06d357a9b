"""Probes inserted and removed thousands of times while every CPU runs the probed function at full pace
(issue 15, item 3): each insertion and removal goes through text_poke_bp's steps (tracing/engines/native.py), with the
kernel running between them on every CPU. The kernel must compute exactly what it computes unprobed: every call
of kgtp_test_function bumps kgtp_counter once, so once the workload is quiet, kgtp_counter is 1 plus the calls
each CPU's kgtp_bench thread says it made (its per-CPU `stats.bench_calls`); a torn instruction would have
crashed the machine, panicked the kernel, or lost or doubled an increment.
"""

from __future__ import annotations

import threading

import pytest

from kgtp_sim.agent.opcodes import assemble
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import Tracer
from kgtp_sim.machine.dwarf import KernelDwarf

from ..conftest import VMLINUX, wait_until

IMAGE = KernelImage.load(VMLINUX)
SITE = IMAGE.address_of("kgtp_test_function")
EXPR = assemble("const8 2; reg 5; ext 32; mul; const8 3; reg 4; ext 32; mul; add; ext 32; end")
TOGGLES = 1000  #: disable + enable: 2000 patches, each in five steps with the CPUs running between them


def bench_calls_offsets() -> tuple[int, int]:
    """(address of cpu_data, offset of stats.bench_calls in an element, element size) from the DWARF."""
    dwarf = KernelDwarf(VMLINUX)
    try:
        address, array = dwarf.global_variable("cpu_data")
        element = array.target
        stats_at, stats = element.member("stats")
        calls_at, _ = stats.member("bench_calls")
        return address, stats_at + calls_at, element.size
    finally:
        dwarf.close()


CPU_DATA, BENCH_CALLS, CPU_DATA_SIZE = bench_calls_offsets()


def calls(machine: Machine, cpu: int) -> int:
    return int.from_bytes(machine.read_memory(CPU_DATA + cpu * CPU_DATA_SIZE + BENCH_CALLS, 8), "little")


def consistent(machine: Machine, cpus: int) -> bool:
    """kgtp_counter == 1 + every CPU's calls (read in one trip to the CPU thread: nothing runs meanwhile)."""
    def read(_uc) -> bool:
        counter = machine.read_symbol("kgtp_counter")
        return counter == (1 + sum(calls(machine, cpu) for cpu in range(cpus))) & 0xFFFFFFFF

    return machine.run_on_cpu(read)


@pytest.mark.slow
@pytest.mark.parametrize("engine,cpus", [("opt", 2), ("naive", 4), ("interp", 2)])
def test_probes_toggled_thousands_of_times_under_full_load_change_nothing(engine, cpus):
    with Machine(IMAGE, cpus=cpus, pace=300) as machine:
        machine.start()
        wait_until(lambda: machine.stats(count=False).cpus_online == cpus, "every CPU online")
        wait_until(lambda: all(calls(machine, cpu) > 1000 for cpu in range(cpus)), "every CPU's workload running")
        tracer = Tracer(machine, engine)
        tracer.definitions.circular = True
        tracer.definitions.buffer_size = 0x10000
        tracer.definitions.define(t.DefineTracepoint.parse(b"1:%x:E:0:0-" % SITE))
        tracer.definitions.add_actions(t.TracepointActions.parse(
            b"1:%x:R30X%x,%s" % (SITE, len(EXPR), EXPR.hex().encode())))
        tracer.start()
        (tp,) = tracer.definitions.tracepoints.values()
        kinds = set()
        for _ in range(TOGGLES):
            tracer.disarm(tp.key)
            tracer.arm(tp)
            kinds.add(tracer.probe_rows()[0].kind)
        frames = tracer.frames()
        assert tracer.status().running
        assert {frame.cpu for frame in frames} == set(range(cpus))  # every CPU went through the probe
        tracer.stop(t.StopReason.STOP_COMMAND)
        assert machine.read_memory(SITE, 8) == IMAGE.read_code(SITE, 8)
        machine.set_pace(0)  # quiet: each CPU's thread finishes the calls it counted, then makes none
        wait_until(lambda: consistent(machine, cpus), "kgtp_counter to equal the calls every CPU made")
        stats = machine.stats(count=False)
        assert stats.state in ("running", "idle"), stats.state
        assert "panic" not in machine.console_text().lower()
    # compiled engines patch a jump (an int3 only while a CPU sat inside the window), the interpreter an int3
    assert kinds == {"int3"} if engine == "interp" else "jump" in kinds, kinds


@pytest.mark.parametrize("engine", ["opt", "interp"])
def test_a_location_armed_during_a_run_is_placed_on_the_cpu_thread(engine):
    """InstallInTrace and QTEnable arm a location from the server thread while CPUs run it: verifying, compiling
    and patching happen on the CPU thread with no hit in flight (`Tracer._between_hits`), where hits read the
    probe set and the int3 table, never beside them."""
    with Machine(IMAGE, cpus=2, pace=300) as machine:
        machine.start()
        wait_until(lambda: all(calls(machine, cpu) > 100 for cpu in range(2)), "every CPU's workload running")
        tracer = Tracer(machine, engine)
        tracer.definitions.define(t.DefineTracepoint.parse(b"1:%x:E:0:0-" % SITE))
        tracer.definitions.add_actions(t.TracepointActions.parse(
            b"1:%x:R30X%x,%s" % (SITE, len(EXPR), EXPR.hex().encode())))
        tracer.start()
        (tp,) = tracer.definitions.tracepoints.values()
        tracer.disarm(tp.key)
        threads = []
        prepare = tracer._prepare
        tracer._prepare = lambda tp: threads.append(threading.current_thread().name) or prepare(tp)
        tracer.probes.removed.clear()  # placed and compiled afresh, not resumed from the detour it had
        tracer.arm(tp)
        assert threads == ["kgtp-cpu"], threads
        assert tracer.is_armed(tp.key)
        before = len(tracer.frames())
        wait_until(lambda: len(tracer.frames()) > before, "hits of the re-armed location")
        tracer.stop(t.StopReason.STOP_COMMAND)
