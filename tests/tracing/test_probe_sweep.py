"""Probe safety sweep: a probe on every instruction of the kernel's hot paths must never change what the kernel
computes.

The workload is deterministic: the kernel boots (`_start` to the idle loop's `hlt`) without the machine's
threads, then each "tick" is `machine.call("timer_interrupt", 0)`: jiffies advances, sleepers wake, and
`schedule()` runs every runnable kernel thread (benchmark calls, module loads, system calls through
`int $0x80`, demand-page faults and traps through the IDT) until all sleep again and the idle task is back.
Two runs of it give the same kernel state to the byte, so a run with probes is compared against one without:
counters, every task's scheduling fields and saved stack pointer, the module table, the console.

Each placement is refused at tstart (ProbePlacementError -> TraceError) or installed; installed probes fire
on the very same instructions the same number of times whatever their kind (int3 for the interpreter, 5-byte
jumps where optprobes would allow them for the compiled engines). Jump windows of neighbouring instructions
overlap, so the compiled engines' sweep is split into rounds of disjoint windows; overlapping windows have a
test of their own, and probes over instructions with an exception-table fixup are refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from kgtp_sim.agent.opcodes import assemble
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.cpu import Stop
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import TraceError, Tracer
from kgtp_sim.tracing.patching.probes import ProbePlacementError, decode, plan_probe
from kgtp_sim.machine.dwarf import KernelDwarf

from ..conftest import VMLINUX

pytestmark = pytest.mark.slow

IMAGE = KernelImage.load(VMLINUX)
DWARF = KernelDwarf(VMLINUX)
TICKS = 30
PACE = 5
BENCH_CALLS = 2  # kgtp_bench_loop(2) after each tick: the benchmark's own loop, called as the bench does
COUNTERS = ("jiffies", "nr_context_switches", "nr_syscalls", "nr_traps", "nr_page_faults", "syscall_counter",
            "nr_modules_loaded", "kgtp_counter")
#: The scheduler, timer, system call, page fault and trap paths, the assembly entry code, the kernel threads,
#: and the module loader: everything the workload executes except the exception-fixup sites (refused, tested below).
FUNCTIONS = (
    "kgtp_test_function", "kgtp_bench_loop", "kgtp_bench_thread", "load_module", "kmodload_thread", "strlcpy",
    "schedule", "msleep_ticks", "timer_interrupt", "sched_clock", "switch_stacks", "ret_from_kthread",
    "common_entry", "asm_timer_interrupt", "asm_int80_syscall", "asm_exc_page_fault", "asm_exc_divide_error",
    "asm_exc_invalid_op", "asm_exc_int3", "do_interrupt", "do_syscall", "syscall_test_thread", "do_page_fault",
    "do_trap", "do_error_trap", "pagefault_test_thread", "trap_breakpoint",
)
#: naive and opt place the same probes and detours; naive is swept over the paths that switch stacks, take
#: interrupts and traps, with actions that run compiled code at every hit ($regs and the word at %rsp).
HOT = ("schedule", "switch_stacks", "common_entry", "asm_int80_syscall", "do_page_fault")
#: Instructions listed in the kernel's __ex_table (a fault there resumes at the fixup address).
EX_TABLE_SITES = ("trap_divide_error.isra.0", "trap_invalid_op")


def instructions(name: str) -> list[int]:
    _, low, high = IMAGE.function_bounds(IMAGE.address_of(name))
    return [insn.address for insn in decode(IMAGE.read_code(low, high - low), low)]


def booted(pace: int = PACE, cpus: int = 1) -> Machine:
    """A machine whose kernel ran `_start` to the idle `hlt` on this thread, and then each other CPU from where
    the boot CPU started it to its own idle `hlt`: IDT, tasks, run queues and scheduler set up."""
    machine = Machine(IMAGE, pace=pace, cpus=cpus)
    halted: set[int] = set()
    for _ in range(1000):  # CPUs take turns as the machine's loop gives them (a CPU waiting for another yields)
        for cpu in range(cpus):
            if cpu in halted or machine.cpu_states()[cpu].state == "offline":
                continue
            machine.on_cpu(cpu, lambda uc: None)
            if machine.cpu.run() is Stop.HALT:
                halted.add(cpu)
        if len(halted) == cpus:
            break
    else:
        raise AssertionError(f"CPUs {sorted(set(range(cpus)) - halted)} did not reach their idle loop")
    machine.on_cpu(0, lambda uc: None)
    # place call()'s stack now, before a tracer allocates: the idle task's saved %rsp points into it
    machine.call("kgtp_bench_loop", 0)
    return machine


def cpu_area(machine: Machine, cpu: int) -> bytes:
    """A CPU's per-CPU area without what comes from the clock (its run queue's clock and the time it charged)."""
    address, array = DWARF.global_variable("cpu_data")
    area = array.target
    raw = bytearray(machine.read_memory(address + cpu * area.size, area.size))
    rq_offset, rq = area.member("rq")
    for name in ("clock", "exec_charged"):
        offset, field = rq.member(name)
        raw[rq_offset + offset:rq_offset + offset + field.size] = bytes(field.size)
    return bytes(raw)


def kernel_state(machine: Machine) -> dict[str, object]:
    state: dict[str, object] = {name: machine.read_symbol(name) for name in COUNTERS}
    for cpu in range(machine.cpu_count):
        state[f"cpu_data{cpu}"] = cpu_area(machine, cpu)
    tasks = machine.read_memory(IMAGE.address_of("tasks"), IMAGE.symbols["tasks"].size)
    size = len(tasks) // 65  # NR_TASKS (include/kernel.h): CPU 0 has tasks 0..5, each other CPU 5 more, 24 process slots
    for i in range(5 + 5 * (machine.cpu_count - 1)):
        task = tasks[i * size : (i + 1) * size]
        # pid, comm, prio, state, wakeup | nvcsw, nivcsw, entry, thread.sp (exec_start/runtime come from the clock)
        state[f"task{i}"] = (task[:40], task[64:96])
    state["modules"] = machine.read_memory(IMAGE.address_of("modules"), IMAGE.symbols["modules"].size)
    stats = machine.stats()
    state["delivered"] = (stats.syscalls, stats.page_faults, stats.traps, stats.demand_pages_mapped)
    state["console"] = machine.console_text()
    return state


def workload(machine: Machine, ticks: int = TICKS) -> dict[str, object]:
    """Each tick, on every CPU in turn: its timer interrupt (its threads run, the scheduler switches) and the
    benchmark's loop."""
    for _ in range(ticks):
        for cpu in range(machine.cpu_count):
            machine.on_cpu(cpu, lambda uc: None)
            machine.call("timer_interrupt", 0, max_instructions=20_000_000)
            assert machine.call("kgtp_bench_loop", BENCH_CALLS) == BENCH_CALLS
    machine.on_cpu(0, lambda uc: None)
    return kernel_state(machine)


REFERENCE: dict[int, dict[str, object]] = {}


def reference_state(cpus: int = 1) -> dict[str, object]:
    if cpus not in REFERENCE:
        REFERENCE[cpus] = workload(booted(cpus=cpus))
        assert REFERENCE[cpus] == workload(booted(cpus=cpus)), "the workload itself is not deterministic"
    return REFERENCE[cpus]


def window(engine: str, address: int) -> tuple[int, int] | None:
    """The bytes a probe at `address` patches, as the tracer plans it (jump, else int3), or None if refused."""
    if engine != "interp":
        try:
            return address, address + plan_probe(IMAGE, address, "jump").length
        except ProbePlacementError:
            pass
    try:
        plan_probe(IMAGE, address, "int3")
    except ProbePlacementError:
        return None
    return address, address + 1


def rounds_of_disjoint_windows(engine: str, addresses: list[int]) -> tuple[list[list[int]], list[int]]:
    rounds: list[list[tuple[int, int]]] = []
    refused = []
    for address in addresses:
        span = window(engine, address)
        if span is None:
            refused.append(address)
            continue
        for placed in rounds:
            if all(span[1] <= lo or hi <= span[0] for lo, hi in placed):
                placed.append(span)
                break
        else:
            rounds.append([span])
    return [[lo for lo, _ in placed] for placed in rounds], refused


@dataclass
class Traced:
    state: dict[str, object]
    hits: dict[int, int]
    kinds: dict[str, int]
    running: bool


def traced_workload(engine: str, addresses: list[int], actions: bytes = b"", cpus: int = 1) -> Traced:
    machine = booted(cpus=cpus)
    tracer = Tracer(machine, engine)
    tracer.definitions.circular = True  # keep every probe firing however many frames the workload makes
    for number, address in enumerate(addresses, 1):
        tracer.definitions.define(t.DefineTracepoint.parse(b"%x:%x:E:0:0%s" % (number, address, b"-" * bool(actions))))
        if actions:
            tracer.definitions.add_actions(t.TracepointActions.parse(b"%x:%x:%s" % (number, address, actions)))
    tracer.start()
    kinds: dict[str, int] = {}
    for item in tracer.probes.installed.values():
        kind = item.native.kind if item.native is not None else "int3"
        kinds[kind] = kinds.get(kind, 0) + 1
    assert len(tracer.probes.installed) == len(addresses)
    state = workload(machine)
    running = tracer.running
    hits = {address: tracer.location_status(number, address)[0] for number, address in enumerate(addresses, 1)}
    tracer.stop(t.StopReason.STOP_COMMAND)
    for name in FUNCTIONS:  # every patched byte is the image's again
        _, low, high = IMAGE.function_bounds(IMAGE.address_of(name))
        assert machine.read_memory(low, high - low) == IMAGE.read_code(low, high - low), name
    return Traced(state, hits, kinds, running)


SWEPT = [address for name in FUNCTIONS for address in instructions(name)]


@pytest.fixture(scope="module")
def interp_hits() -> dict[int, int]:
    """Every swept instruction probed at once with int3 (windows of one byte never overlap)."""
    (addresses,), _ = rounds_of_disjoint_windows("interp", SWEPT)
    run = traced_workload("interp", addresses)
    assert run.running and run.kinds == {"int3": len(run.hits)}
    assert run.state == reference_state()
    return run.hits


def test_the_refused_placements_are_refused_by_the_tracer_too():
    for engine in ("interp", "opt"):
        _, refused = rounds_of_disjoint_windows(engine, SWEPT)
        # the kernel's own int3, and the instructions its exception table names (they fault by design)
        faulting = {insn for insn, _ in IMAGE.exception_table}
        assert refused == sorted({IMAGE.address_of("trap_breakpoint")} | (faulting & set(SWEPT)))
        machine = Machine(IMAGE)
        tracer = Tracer(machine, engine)
        tracer.definitions.define(t.DefineTracepoint(number=1, address=refused[0]))
        with pytest.raises(TraceError, match="already a breakpoint"):
            tracer.start()
        assert not tracer.probes.installed and machine.read_memory(refused[0], 1) == b"\xcc"
    # and every byte that is not an instruction boundary, in the functions of the hot paths
    boundaries = set(SWEPT)
    for name in HOT:
        _, low, high = IMAGE.function_bounds(IMAGE.address_of(name))
        for address in sorted(set(range(low, high)) - boundaries):
            with pytest.raises(ProbePlacementError, match="middle of an instruction"):
                plan_probe(IMAGE, address, "jump" if address & 1 else "int3")


def test_int3_on_every_instruction_leaves_the_kernel_computing_the_same(interp_hits):
    assert len(interp_hits) > 400
    executed = {address for address, hits in interp_hits.items() if hits}
    # the workload really goes through all of it: every function of the sweep has probes that fired
    for name in FUNCTIONS:
        # sched_clock is inlined into its callers; the timer is called directly, not through its IDT entry
        # trap_breakpoint is all refused: its int3 is the kernel's own, its ret is in the exception table
        if name not in ("sched_clock", "asm_timer_interrupt", "trap_breakpoint"):
            assert executed & set(instructions(name)), name
    assert interp_hits[IMAGE.address_of("kgtp_test_function")] == TICKS * (PACE + BENCH_CALLS)


@pytest.mark.parametrize("engine, functions, actions", [
    ("opt", FUNCTIONS, b""),
    ("naive", HOT, b"R01ffffM7,0,8"),
])
def test_jump_probes_on_every_instruction_leave_the_kernel_computing_the_same(engine, functions, actions,
                                                                              interp_hits):
    swept = [address for name in functions for address in instructions(name)]
    rounds, refused = rounds_of_disjoint_windows(engine, swept)
    assert 2 <= len(rounds) <= 8
    reference = reference_state()
    hits: dict[int, int] = {}
    jumps = 0
    for addresses in rounds:
        run = traced_workload(engine, addresses, actions)
        assert run.running
        assert run.state == reference, [k for k in reference if run.state[k] != reference[k]]
        hits.update(run.hits)
        jumps += run.kinds.get("jump", 0)
    assert jumps > len(hits) // 2  # most placements are 5-byte jumps, the rest int3 into the same detour
    # every instruction ran exactly as often under a jump as under an int3
    assert set(hits) == set(swept) - set(refused)
    assert hits == {address: interp_hits[address] for address in hits}


@pytest.mark.parametrize("engine", ["interp", "opt"])
def test_probes_on_every_hot_instruction_with_two_cpus_leave_the_kernel_computing_the_same(engine):
    """The sweep on a two-CPU kernel, both CPUs taking their ticks and running the loop through the same
    probes: per-CPU run queues, the IPIs and spinlocks of the SMP kernel's hot paths compute as unprobed, and
    every instruction fires as often as without the second CPU, twice over where both CPUs run it alike."""
    swept = [address for name in HOT + ("kgtp_test_function",) for address in instructions(name)]
    rounds, _ = rounds_of_disjoint_windows(engine, swept)
    reference = reference_state(cpus=2)
    hits: dict[int, int] = {}
    for addresses in rounds:
        run = traced_workload(engine, addresses, cpus=2)
        assert run.running
        assert run.state == reference, [k for k in reference if run.state[k] != reference[k]]
        hits.update(run.hits)
    loop = IMAGE.address_of("kgtp_test_function")
    assert hits[loop] == 2 * TICKS * (PACE + BENCH_CALLS)  # both CPUs' threads and the benchmark loop on each


# ---- known bugs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["naive", "opt"])
def test_overlapping_jump_windows_leave_the_kernel_computing_the_same(engine):
    # `trace load_module` and `trace *(load_module+1)`: two 5-byte jumps would patch over each other
    sites = instructions("load_module")[:4]  # 2, 3, 2 and 1 bytes long: every jump window covers the next sites
    run = traced_workload(engine, sites)
    assert run.running and run.state == reference_state()
    assert run.hits == traced_workload("interp", sites).hits


@pytest.mark.parametrize("engine", ["interp", "opt"])
@pytest.mark.parametrize("function", EX_TABLE_SITES)
def test_probes_over_exception_fixup_sites_are_refused_or_harmless(engine, function):
    for address in instructions(function):
        machine = booted()
        tracer = Tracer(machine, engine)
        tracer.definitions.define(t.DefineTracepoint(number=1, address=address))
        try:
            tracer.start()
        except TraceError as error:
            assert re.search(r"exception|fixup", str(error)), error
            continue
        state = workload(machine)
        tracer.stop(t.StopReason.STOP_COMMAND)
        assert state == reference_state(), f"probe at {address:#x}"


@pytest.mark.parametrize("engine", ["interp", "opt"])
def test_two_tracepoints_at_one_address_both_collect_or_are_refused(engine):
    # GDB sends both when the user types `trace kgtp_test_function` twice: one must not silently shadow the other
    machine = Machine(IMAGE)
    tracer = Tracer(machine, engine)
    site = IMAGE.address_of("kgtp_test_function")
    for number in (1, 2):
        tracer.definitions.define(t.DefineTracepoint(number=number, address=site))
    try:
        tracer.start()
    except TraceError as error:
        assert "already" in str(error) and f"{site:#x}" in str(error), error
        assert not tracer.probes.installed and machine.read_memory(site, 8) == IMAGE.read_code(site, 8)
        return
    assert machine.call("kgtp_bench_loop", 5) == 5
    assert tracer.location_status(1, site)[0] == 5 and tracer.location_status(2, site)[0] == 5
    assert sorted(f.tracepoint for f in tracer.frames()) == [1] * 5 + [2] * 5


# ---- known bugs: a run stopped or restarted while a hit is in flight -----------------------------------------
#
# The CPU thread serves the stub's requests between two translation blocks, which can be in the middle of a
# probe's out-of-line code or detour: `tstart` during a run (GDB sends QTinit ... QTStart), QTinit, QTStop and a
# disconnect all stop the run right then. The tests below put the CPU exactly there by running the kernel on
# this thread one instruction at a time, as the CPU thread would between two requests.


class SteppedCall:
    """`kgtp_bench_loop(n)` run by hand on a booted, unstarted machine (the kernel's threads never run)."""

    def __init__(self, machine: Machine, n: int) -> None:
        import struct

        from unicorn.x86_const import UC_X86_REG_RDI, UC_X86_REG_RIP, UC_X86_REG_RSP

        self.machine, self.n = machine, n
        self.rip_reg = UC_X86_REG_RIP
        stack = machine.alloc_data(0x4000)
        self.sentinel = machine.alloc_code(16)
        machine.write_memory(self.sentinel, b"\xf4")
        rsp = stack + 0x4000 - 8
        machine.write_memory(rsp, struct.pack("<Q", self.sentinel))
        uc = machine.uc
        uc.reg_write(UC_X86_REG_RSP, rsp)
        uc.reg_write(UC_X86_REG_RDI, n)
        uc.reg_write(UC_X86_REG_RIP, IMAGE.address_of("kgtp_bench_loop"))
        self.counter = machine.read_symbol("kgtp_counter")

    @property
    def rip(self) -> int:
        return self.machine.uc.reg_read(self.rip_reg)

    def step_until(self, predicate, limit: int = 20000) -> None:
        self.machine.uc.ctl_flush_tb()  # blocks translated by an earlier full-speed run ignore `count`
        for _ in range(limit):
            if predicate(self.rip):
                return
            self.machine.cpu.run(until=self.sentinel, count=1)
        raise AssertionError(f"never got there (rip {self.rip:#x})")

    def finish(self) -> None:
        """Run to the return; the kernel must have computed exactly what it computes without probes."""
        for _ in range(1000):
            stop = self.machine.cpu.run(until=self.sentinel)
            if stop is Stop.UNTIL:
                break
            assert stop is not Stop.HALT, f"the kernel stopped: {self.machine.console_text()[-200:]!r}"
        else:
            raise AssertionError("kgtp_bench_loop never returned")
        from unicorn.x86_const import UC_X86_REG_RAX

        assert self.machine.uc.reg_read(UC_X86_REG_RAX) == self.n
        assert self.machine.read_symbol("kgtp_counter") == self.counter + self.n


MODULE_SPACE = 0xFFFFFFFFA0000000


def test_restarting_while_the_cpu_is_in_an_out_of_line_copy_keeps_the_kernel_intact():
    machine = booted()
    tracer = Tracer(machine, "interp")
    site = IMAGE.address_of("kgtp_test_function")
    tracer.definitions.define(t.DefineTracepoint(number=1, address=site))
    tracer.start()
    call = SteppedCall(machine, 3)
    call.step_until(lambda rip: rip >= MODULE_SPACE and rip != call.sentinel)  # the hit: in the copy now
    tracer.definitions.clear_tracepoints()  # `tstart` again, with another tracepoint (QTinit, QTDP, QTStart)
    tracer.definitions.define(t.DefineTracepoint(number=1, address=IMAGE.address_of("load_module")))
    tracer.start()
    call.finish()


@pytest.mark.parametrize("change", ["tstop", "disable"])
@pytest.mark.parametrize("engine", ["naive", "opt"])
def test_stopping_while_a_hit_is_in_a_detour_keeps_the_kernel_intact(engine, change):
    machine = booted()
    tracer = Tracer(machine, engine)
    site = IMAGE.address_of("kgtp_test_function")
    divide_by_zero = assemble("reg 5; const8 0; div_signed; end")  # the detour ends in its error hypercall
    tracer.definitions.define(t.DefineTracepoint(number=1, address=site, condition=divide_by_zero))
    tracer.start()
    call = SteppedCall(machine, 3)
    call.step_until(lambda rip: rip >= MODULE_SPACE and rip != call.sentinel)  # entered the detour
    if change == "tstop":
        tracer.stop(t.StopReason.STOP_COMMAND)  # QTStop (or a disconnect) right then
    else:
        tracer.disarm((1, site))  # QTDisable right then
    call.finish()
    assert tracer.status().frames == 0 and tracer.stop_reason is t.StopReason.ERROR  # the hit ended as it began


def _publishing_store(tracer: Tracer, site: int) -> int:
    """The short path's last store to the ring: the one that publishes its entry (`mov %rax, head`)."""
    from kgtp_sim.tracing.patching.probes import decode
    from kgtp_sim.tracing.core.ring import CTL_HEAD, field_address

    item = next(iter(tracer.probes.installed.values()))
    detour = item.native.detour
    code = tracer.machine.read_memory(detour.base, detour.full_call - detour.base)
    head = f"qword ptr [r8*8 - {(1 << 64) - field_address(tracer.ring.ctl, CTL_HEAD, 0):#x}], rax"
    return next(i.address for i in decode(code, detour.base) if i.op_str == head)


@pytest.mark.parametrize("engine,mask", [("naive", 0xFFFF), ("opt", 0xFFFFFF), ("opt", 0xFFFF)],
                         ids=["naive", "opt", "opt-short-path"])
def test_restarting_between_reserve_and_commit_leaves_the_new_run_readable(engine, mask):
    machine = booted()
    tracer = Tracer(machine, engine)
    site = IMAGE.address_of("kgtp_test_function")
    tracer.definitions.define(t.DefineTracepoint(number=1, address=site, more=True))
    tracer.definitions.add_actions(t.TracepointActions(number=1, address=site, actions=(t.CollectRegisters(mask),)))
    tracer.start()
    assert machine.call("kgtp_bench_loop", 5) == 5  # five frames: the next one is reserved further on
    # the frame is reserved and filled, not yet committed (published, on the short path)
    commit = tracer.native.runtime.commit if mask != 0xFFFF or engine != "opt" else _publishing_store(tracer, site)
    call = SteppedCall(machine, 3)
    call.step_until(lambda rip: rip == commit)
    tracer.start()  # `tstart` again
    call.finish()
    frames = tracer.frames()  # the new run's frames are readable ...
    status = tracer.status()
    assert len(frames) == status.frames == status.created  # ... and the old hit did not count in it
    assert all(f.tracepoint == 1 and f.registers["rip"] == site for f in frames)
