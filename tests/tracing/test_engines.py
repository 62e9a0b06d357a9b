"""The three engines collect the same frames from the same workload (a differential test at the probe level)."""

from __future__ import annotations

import pytest

from kgtp_sim.agent.opcodes import assemble
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import Tracer, TraceError

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)
SITE = IMAGE.address_of("kgtp_test_function")
# 2*counter1 + 3*counter2 on the argument registers (rdi, rsi), as GDB compiles register variables
EXPR = assemble("const8 2; reg 5; ext 32; mul; const8 3; reg 4; ext 32; mul; add; ext 32; end")
COND_TRUE_ODD = assemble("reg 5; const8 1; bit_and; end")  # counter1 odd
DIV_ZERO = assemble("reg 5; const8 0; div_signed; end")


def run(engine: str, actions: bytes, condition: bytes | None = None, calls: int = 40, passcount: int = 0):
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)  # place call()'s stack before the engine allocates: same rsp for all
    tracer = Tracer(machine, engine)
    cond = b":X%x,%s" % (len(condition), condition.hex().encode()) if condition else b""
    tracer.definitions.define(t.DefineTracepoint.parse(b"1:%x:E:0:%x%s-" % (SITE, passcount, cond)))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"1:%x:%s" % (SITE, actions)))
    tracer.start()
    machine.call("kgtp_bench_loop", calls)
    frames = tracer.frames()
    status = tracer.status()
    location = tracer.location_status(1, SITE)
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert machine.read_memory(SITE, 8) == IMAGE.read_code(SITE, 8)  # removal restores the exact bytes
    return frames, status, location


def comparable(frames):
    return [(f.tracepoint, f.blocks) for f in frames]


ACTIONS = [
    b"R01ffff",  # $regs
    b"X%08x,%s" % (len(EXPR), EXPR.hex().encode()),  # an expression (evaluated, not collected)
    b"M-1,%x,8" % IMAGE.address_of("kgtp_counter"),  # a global
    b"M7,8,10",  # stack memory relative to rsp (above it: below rsp is dead memory a detour may use)
]


@pytest.mark.parametrize("actions", ACTIONS, ids=["regs", "expr", "global", "stack"])
def test_engines_collect_identical_frames(actions):
    results = {engine: run(engine, actions, COND_TRUE_ODD) for engine in ("interp", "naive", "opt")}
    reference = comparable(results["interp"][0])
    assert len(reference) == 20  # the condition let every other call through
    for engine in ("naive", "opt"):
        assert comparable(results[engine][0]) == reference, engine
        assert results[engine][2] == results["interp"][2]  # qTP hits and bytes agree


def test_register_block_is_the_site_state():
    frames, _, _ = run("opt", b"R03ffff", calls=3)
    regs = frames[0].registers
    assert regs["rip"] == SITE and regs["rdi"] == 1 and regs["eflags"] & 0x2
    # rsp at the site points at the return address into kgtp_bench_loop
    loop = IMAGE.function_bounds(IMAGE.address_of("kgtp_bench_loop"))
    frames2, _, _ = run("opt", b"M7,0,8", calls=1)
    (block,) = frames2[0].blocks
    assert block.address == regs["rsp"] and loop[1] <= int.from_bytes(block.data, "little") < loop[2]


@pytest.mark.parametrize("engine", ["interp", "naive", "opt"])
def test_condition_error_stops_the_run_with_terror(engine):
    frames, status, _ = run(engine, b"R01ffff", DIV_ZERO, calls=5)
    assert frames == [] and status.stop_reason is t.StopReason.ERROR and "division by zero" in status.stop_note


@pytest.mark.parametrize("engine", ["interp", "naive", "opt"])
def test_passcount(engine):
    frames, status, location = run(engine, b"R01ffff", calls=20, passcount=7)
    assert len(frames) == 7 and status.stop_reason is t.StopReason.PASSCOUNT and location[0] == 7


def test_fast_tracepoint_refused_where_a_jump_cannot_go():
    machine = Machine(IMAGE)
    tracer = Tracer(machine, "opt")
    ret = SITE + 12  # kgtp_test_function's last byte: `ret`, a jump would cross the function's end
    assert IMAGE.read_code(ret, 1) == b"\xc3"
    tracer.definitions.define(t.DefineTracepoint.parse(b"1:%x:E:0:0:F1" % ret))
    with pytest.raises(TraceError, match="fast tracepoint impossible"):
        tracer.start()


def test_neighbouring_probes_never_patch_over_each_other():
    """Probes on consecutive instructions: jumps that would cover a neighbour become int3s, and the kernel
    computes exactly what it computes untraced."""
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    tracer = Tracer(machine, "opt")
    loop = IMAGE.address_of("kgtp_bench_loop")
    _, start, end = IMAGE.function_bounds(loop)
    from kgtp_sim.tracing.patching.probes import decode

    sites = [i.address for i in decode(IMAGE.read_code(start, end - start), start)][:6]
    for number, address in enumerate(sites, start=1):
        tracer.definitions.define(t.DefineTracepoint.parse(b"%d:%x:E:0:0-" % (number, address)))
        tracer.definitions.add_actions(t.TracepointActions.parse(b"%d:%x:R01ffff" % (number, address)))
    before = machine.read_symbol("kgtp_counter")
    tracer.start()
    kinds = {item.site.address: item.native.kind for item in tracer.probes.installed.values()}
    machine.call("kgtp_bench_loop", 25)
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert machine.read_symbol("kgtp_counter") == before + 25
    assert "int3" in kinds.values()  # neighbours forced some probes to trap instead of jump
    assert all(machine.read_memory(a, 1) == IMAGE.read_code(a, 1) for a in sites)
    assert {f.tracepoint for f in tracer.frames()} == set(range(1, len(sites) + 1))  # every probe fired


@pytest.mark.parametrize("engine", ["interp", "opt"])
def test_two_tracepoints_at_one_address_both_collect(engine):
    """GDB allows it (a reconnecting GDB uploads the target's tracepoint, the user adds another there)."""
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    tracer = Tracer(machine, engine)
    odd = b":X%x,%s" % (len(COND_TRUE_ODD), COND_TRUE_ODD.hex().encode())
    tracer.definitions.define(t.DefineTracepoint.parse(b"1:%x:E:0:0%s-" % (SITE, odd)))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"1:%x:R01ffff" % SITE))
    tracer.definitions.define(t.DefineTracepoint.parse(b"2:%x:E:0:0-" % SITE))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"2:%x:M-1,%x,8" % (SITE, IMAGE.address_of("kgtp_counter"))))
    tracer.start()
    machine.call("kgtp_bench_loop", 10)
    frames = tracer.frames()
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert [f.tracepoint for f in frames].count(1) == 5 and [f.tracepoint for f in frames].count(2) == 10
    assert machine.read_memory(SITE, 8) == IMAGE.read_code(SITE, 8)


def test_frames_stay_whole_while_other_threads_keep_stopping_the_cpu():
    """The server's requests and the timer stop the running CPU thousands of times a second, in the middle of
    detours and ring commits too. No stop may make an instruction run twice (a double `incq` of the frame
    count, a head advanced twice over an unwritten entry): every frame created is in the buffer, readable,
    numbered without gaps."""
    import time

    machine = Machine(IMAGE)
    tracer = Tracer(machine, "opt")
    marker = next(m for m in IMAGE.markers if m.name == "kgtp_module_event")
    tracer.definitions.define(t.DefineTracepoint(number=1, address=marker.site, static=True, more=True))
    tracer.definitions.add_actions(t.TracepointActions(number=1, address=marker.site,
                                                       actions=(t.CollectStaticData(),)))
    tracer.start()
    machine.start()
    try:
        deadline = time.monotonic() + 30  # the counts, not a fixed window: a loaded host is just slower
        stops = 0
        while (stops <= 1000 or tracer.status().created <= 1000) and time.monotonic() < deadline:
            machine.run_on_cpu(lambda uc: None)
            stops += 1
        tracer.stop(t.StopReason.STOP_COMMAND)
        status = tracer.status()
        frames = tracer.frames()
    finally:
        machine.shutdown()
    assert stops > 1000 and status.created > 1000
    assert len(frames) == status.frames == status.created
    assert [f.sequence for f in frames] == list(range(status.created))


@pytest.mark.parametrize("engine", ["naive", "opt"])
def test_timer_ticks_reach_the_kernel_while_compiled_detours_run_at_full_pace(engine):
    """A compiled detour runs with interrupts off, and at full pace the workload is inside one most of the time.
    A tick that comes then must be taken where the kernel's code resumes (the CPU thread asks for a stop at the
    first block outside the stub's code), not wait for a periodic stop that happens to land outside a detour:
    that way the kernel lost about 85% of its ticks. A lost tick is one the next tick finds still waiting."""
    import time

    machine = Machine(IMAGE, hz=100, pace=1_000_000)
    tracer = Tracer(machine, engine)
    tracer.definitions.define(t.DefineTracepoint.parse(b"1:%x:E:0:0-" % SITE))
    tracer.definitions.add_actions(t.TracepointActions.parse(b"1:%x:R01" % SITE))
    tracer.definitions.buffer_size = 1 << 16
    tracer.definitions.circular = True
    tracer.start()
    machine.start()
    try:
        deadline = time.monotonic() + 60
        while (stats := machine.stats()).ticks + stats.ticks_missed < 200:  # two seconds of ticks
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        status = tracer.status()
        tracer.stop(t.StopReason.STOP_COMMAND)
    finally:
        machine.shutdown()
    assert status.created > 10_000, status  # the detour did run at full pace all along
    assert stats.ticks_missed <= 0.25 * (stats.ticks + stats.ticks_missed), stats
