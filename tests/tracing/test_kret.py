"""Return probes (`$kret`, kret.py) driven through the Tracer: KGTP's `trace *FUNCTION` + `teval $kret=0`.

Deterministic runs call `do_interrupt` with a `struct pt_regs` of a system call (`machine.call`, no timer), so
each return of `do_syscall` is checked against what the kernel stored in `regs->ax` right after it. Runs of the
live kernel (the machine started, its threads and timer going) check what only a live kernel does: the timer
interrupt nesting `do_interrupt` inside a system call on the same stack, task switches inside the probed
function (`nanosleep` sleeps in `schedule`), tstop with returns still pending, a pass count, a circular buffer,
the instance table filling up. Those wait for the events they need, never for a time window.
"""

from __future__ import annotations

import struct
import time

import pytest

from kgtp_sim.agent.opcodes import assemble
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import TraceError, Tracer
from kgtp_sim.tracing.core.builtins import BUILTIN_VARIABLES
from kgtp_sim.tracing.core.frames import MemoryBlock, TsvBlock
from kgtp_sim.tracing.kgtp.kret import MAXACTIVE, POOL_BYTES
from kgtp_sim.tracing.patching.probes import decode

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)
REGS = 0xFFFFFF  # `collect $regs`: every general register (fewer would make a compact block of just those)
DO_SYSCALL = IMAGE.address_of("do_syscall")
DO_INTERRUPT = IMAGE.address_of("do_interrupt")
TIMER_INTERRUPT = IMAGE.address_of("timer_interrupt")
_DI = IMAGE.function_at(DO_INTERRUPT)
#: where do_syscall returns to: the instruction after do_interrupt's call
AFTER_CALL = next(i.end for i in decode(IMAGE.read_code(_DI.address, _DI.size), _DI.address)
                  if i.mnemonic == "call" and i.branch_target == DO_SYSCALL)
ENGINES = ("interp", "naive", "opt")
N = {b.name: b.number for b in BUILTIN_VARIABLES}
#: GDB 13's bytecode for the howto's `teval $kret=0` and for `collect regs->orig_ax` at `trace *do_syscall`
#: (regs is do_syscall's first argument, in %rdi at its first instruction)
KRET = bytes.fromhex("22002d001127")
ORIG_AX = bytes.fromhex("2600052a402300800222080c27")
#: struct pt_regs (fixtures/kernel/include/kernel.h)
PT_AX, PT_DI, PT_SI, PT_DX, PT_VECTOR, PT_ORIG_AX, PT_REGS_SIZE = 0x40, 0x48, 0x50, 0x58, 0x78, 0x80, 22 * 8
GETPID, WRITE, KGTP_COUNT, NANOSLEEP = 39, 1, 500, 35


def _define(tracer: Tracer, number: int, address: int, *actions, condition: bytes | None = None,
            passcount: int = 0, step: int = 0, stepping=()) -> None:
    tracer.definitions.define(t.DefineTracepoint(number=number, address=address, condition=condition,
                                                 pass_count=passcount, step_count=step, more=True))
    tracer.definitions.add_actions(t.TracepointActions(number=number, address=address, actions=tuple(
        t.EvalExpression(a) if isinstance(a, bytes) else a for a in actions)))
    if stepping:
        tracer.definitions.add_actions(t.TracepointActions(number=number, address=address, stepping=True,
                                                           actions=tuple(stepping)))


def _u64(data: bytes, at: int = 0) -> int:
    return struct.unpack_from("<Q", data, at)[0]


def _orig_ax_block(frame) -> MemoryBlock:
    """What `collect regs->orig_ax` (ORIG_AX, each test's first memory collection) recorded."""
    return next(b for b in frame.blocks if isinstance(b, MemoryBlock))


def _orig_ax(frame) -> int:
    """The system call number, read through do_syscall's argument."""
    return _u64(_orig_ax_block(frame).data)


# ---- deterministic: machine.call(do_interrupt) with a system call's pt_regs ------------------------------------


class Syscalls:
    """System calls entered as int $0x80 would enter them, minus the CPU: do_interrupt(regs), no timer."""

    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        self.regs = machine.alloc_data(0x100)
        self.text = machine.alloc_data(0x10)  # what `write` writes
        machine.write_memory(self.text, b"kret\n")

    def __call__(self, nr: int, di: int = 0, si: int = 0, dx: int = 0) -> int:
        si = si or (self.text if nr == WRITE else 0)
        block = bytearray(PT_REGS_SIZE)
        for offset, value in ((PT_DI, di), (PT_SI, si), (PT_DX, dx), (PT_VECTOR, 0x80), (PT_ORIG_AX, nr)):
            struct.pack_into("<Q", block, offset, value)
        self.machine.write_memory(self.regs, bytes(block))
        self.machine.call("do_interrupt", self.regs)
        return struct.unpack("<q", self.machine.read_memory(self.regs + PT_AX, 8))[0]  # what do_interrupt stored


CALLS = [(KGTP_COUNT,), (GETPID,), (WRITE, 1, 0, 5), (KGTP_COUNT,), (9999,), (WRITE, 7, 0, 5)]
#: how the return probe's location gets its probe: alone (compiled engines would jump), int3 probes, or beside
#: another tracepoint at its address that collects the registers and the return address slot at the entry
PATHS = ("alone", "int3", "shared")


def _deterministic(engine: str, path: str, condition: bytes | None = None):
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    tracer = Tracer(machine, engine, probe="int3" if path == "int3" else "auto")
    _define(tracer, 1, DO_SYSCALL, KRET, t.CollectRegisters(REGS), ORIG_AX, condition=condition)
    if path == "shared":
        _define(tracer, 2, DO_SYSCALL, t.CollectRegisters(REGS), t.CollectMemory(7, 0, 8))
    plain = IMAGE.address_of("load_module")  # a tracepoint without $kret elsewhere keeps its compiled probe
    _define(tracer, 3, plain, t.CollectRegisters(REGS))
    tracer.start()
    rows = {row.number: row for row in tracer.probe_rows()}
    syscall = Syscalls(machine)
    results = [(call[0], syscall(*call)) for call in CALLS]
    frames = tracer.frames()
    raw = tracer.ring.entries()
    tracer.stop(t.StopReason.STOP_COMMAND)
    return machine, tracer, rows, results, frames, raw


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("engine", ENGINES)
def test_do_syscall_returns_what_the_kernel_stored_in_regs_ax(engine, path):
    machine, tracer, rows, results, frames, raw = _deterministic(engine, path)
    assert [nr for nr, _ in results] == [500, 39, 1, 500, 9999, 1]
    assert [value for _, value in results] == [1, 0, 5, 2, -38, -9]  # counter, swapper's pid, count, -ENOSYS, -EBADF
    returns = [f for f in frames if f.tracepoint == 1]
    assert len(returns) == len(CALLS)
    for frame, (nr, value) in zip(returns, results):
        regs = frame.registers
        assert regs["rax"] & (2**64 - 1) == value & (2**64 - 1), (nr, regs)  # $rax: the return value
        assert regs["rip"] == AFTER_CALL  # KGTP: the PC of the original return address
        assert _orig_ax(frame) == nr  # the entry argument, read through %rdi as at the entry
    assert rows[1].kind == "int3" and "return probe" in rows[1].function
    assert rows[3].kind == ("int3" if engine == "interp" or path == "int3" else "jump")
    fired = next(row for row in tracer.probe_rows() if row.number == 1)
    assert (fired.fired, fired.hits) == (len(CALLS), len(CALLS))  # counted at the return, not at the entry
    assert machine.read_memory(DO_SYSCALL, 8) == IMAGE.read_code(DO_SYSCALL, 8)  # the site is restored
    if path == "shared":
        entries = [f for f in frames if f.tracepoint == 2]
        assert len(entries) == len(CALLS)
        for entry, ret in zip(entries, returns):
            assert entry.registers["rip"] == DO_SYSCALL
            assert ret.registers["rsp"] == entry.registers["rsp"] + 8  # the caller's %rsp after the return
            slot = next(b for b in entry.blocks if isinstance(b, MemoryBlock))
            assert slot.address == entry.registers["rsp"] and _u64(slot.data) == AFTER_CALL  # GDB's view
        hijacked = [_u64(next(b for b in f.blocks if isinstance(b, MemoryBlock)).data)
                    for f in raw if f.tracepoint == 2]
        assert all(word != AFTER_CALL and tracer.kret.resolve(word) == AFTER_CALL for word in hijacked)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_condition_runs_at_the_return_on_the_return_value_and_the_entry_arguments(engine):
    # `if regs->orig_ax == 500 && $rax > 1`: an entry argument (through %rdi) and the return value
    condition = assemble("reg 5; const16 0x80; add; ref64; const16 0x1f4; equal; "
                         "const8 1; reg 0; less_signed; log_not; log_not; bit_and; end")
    _, _, _, results, frames, _ = _deterministic(engine, "alone", condition)
    assert [(f.registers["rax"], _orig_ax(f)) for f in frames if f.tracepoint == 1] == [(2, 500)]


@pytest.mark.parametrize("engine", ENGINES)
def test_entry_arguments_keep_their_entry_value_in_expressions_only(engine):
    """The frame's registers are the return's; an expression reading an argument register reads the entry's.
    load_module(name, taints) moves `name` to %rsi for strlcpy and returns with other values in both."""
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    tracer = Tracer(machine, engine)
    name = machine.alloc_data(0x10)
    machine.write_memory(name, b"kret\0")
    tmp = N["printk_tmp"]
    _define(tracer, 1, IMAGE.address_of("load_module"), KRET, t.CollectRegisters(REGS),
            assemble(f"reg 5; setv {tmp:#x}; tracev {tmp:#x}; reg 4; setv {tmp:#x}; tracev {tmp:#x}; end"),
            t.CollectMemory(5, 0, 5))
    tracer.start()
    assert machine.call("load_module", name, 0x1234) == 0
    frames = tracer.frames()
    tracer.stop(t.StopReason.STOP_COMMAND)
    (frame,) = frames
    regs = frame.registers
    assert regs["rax"] == 0 and (regs["rdi"], regs["rsi"]) != (name, 0x1234)  # the return's registers
    assert [b.value & (2**64 - 1) for b in frame.blocks if isinstance(b, TsvBlock)] == [name, 0x1234]  # entry's
    (block,) = [b for b in frame.blocks if isinstance(b, MemoryBlock)]
    assert (block.address, block.data) == (name, b"kret\0")  # a memory range based on %rdi too


def test_a_return_probe_needs_a_functions_first_address_and_kgtps_other_rules():
    machine = Machine(IMAGE)
    tracer = Tracer(machine, "opt")
    _define(tracer, 1, DO_SYSCALL + 1, KRET)  # `trace do_syscall` places it after the prologue
    with pytest.raises(TraceError, match=r"\$kret needs the first address of a function"):
        tracer.start()
    tracer.definitions.clear_tracepoints()
    _define(tracer, 1, DO_SYSCALL, condition=assemble("const8 0; setv 0x11; end"))
    with pytest.raises(TraceError, match=r"\$kret cannot be set in a condition"):
        tracer.start()
    tracer.definitions.clear_tracepoints()
    _define(tracer, 1, DO_SYSCALL, KRET, step=2, stepping=(t.CollectRegisters(REGS),))
    with pytest.raises(TraceError, match=r"\$kret cannot be used with while-stepping"):
        tracer.start()
    tracer.definitions.clear_tracepoints()
    _define(tracer, 1, DO_SYSCALL, KRET)
    _define(tracer, 2, IMAGE.address_of("load_module"), step=2, stepping=(t.CollectRegisters(REGS),))
    with pytest.raises(TraceError, match=r"\$kret cannot be used in a run with while-stepping \(tracepoint 2\)"):
        tracer.start()
    tracer.definitions.clear_tracepoints()
    _define(tracer, 1, DO_SYSCALL, assemble(f"getv {N['kret']:#x}; end"))
    with pytest.raises(TraceError, match=r"\$kret cannot be read by a tracepoint"):
        tracer.start()
    assert not tracer.running


def test_ignore_error_leaves_out_a_return_probe_that_is_not_at_a_functions_start():
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    tracer = Tracer(machine, "naive")
    tracer.definitions.define_variable(t.DefineTraceVariable(number=N["ignore_error"], value=1, builtin=True,
                                                             name="ignore_error"))
    _define(tracer, 1, DO_SYSCALL + 1, KRET)
    _define(tracer, 2, DO_SYSCALL, KRET)
    tracer.start()
    assert list(tracer.probes.installed) == [(2, DO_SYSCALL)]
    assert tracer.variable_value(N["last_errno"]) == -22
    assert Syscalls(machine)(KGTP_COUNT) == 1
    assert [f.tracepoint for f in tracer.frames()] == [2]
    tracer.stop(t.StopReason.STOP_COMMAND)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_return_probe_armed_and_disarmed_during_a_run(engine):
    """QTEnable / a new tracepoint during a run (InstallInTrace), then QTDisable: the calls it caught while armed
    return through their trampolines; after it goes, nothing more is recorded and the kernel's bytes are back."""
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    tracer = Tracer(machine, engine)
    _define(tracer, 1, IMAGE.address_of("load_module"), t.CollectRegisters(REGS))
    tracer.start()
    syscall = Syscalls(machine)
    assert syscall(KGTP_COUNT) == 1 and tracer.frames() == []
    _define(tracer, 2, DO_SYSCALL, KRET, t.CollectRegisters(REGS), ORIG_AX)
    tracer.arm(tracer.definitions.tracepoints[(2, DO_SYSCALL)])
    assert syscall(KGTP_COUNT) == 2 and syscall(GETPID) == 0
    tracer.disarm((2, DO_SYSCALL))
    assert syscall(KGTP_COUNT) == 3
    frames = tracer.frames()
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert [(f.tracepoint, _orig_ax(f), f.registers["rax"]) for f in frames] == [(2, 500, 2), (2, 39, 0)]
    assert machine.read_memory(DO_SYSCALL, 8) == IMAGE.read_code(DO_SYSCALL, 8)
    row = next(row for row in tracer.probe_rows() if row.number == 2)
    assert not row.armed and row.hits == 2 and "2 entered, 0 pending" in row.function


def test_two_return_probes_on_one_call_both_fire_innermost_first():
    """`do_interrupt` and `do_syscall`, each a return probe: the inner returns first; the stack memory the inner
    one collects holds the outer's hijacked return address, which GDB is shown as the original one."""
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    tracer = Tracer(machine, "opt")
    _define(tracer, 1, DO_INTERRUPT, KRET, t.CollectRegisters(REGS))
    _define(tracer, 2, DO_SYSCALL, KRET, t.CollectRegisters(REGS), t.CollectMemory(7, 0, 0x40))
    tracer.start()
    syscall = Syscalls(machine)
    assert syscall(GETPID) == 0 and syscall(KGTP_COUNT) == 1
    frames, raw = tracer.frames(), tracer.ring.entries()
    sentinel = machine._call_frame[1]  # where machine.call's function returns
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert [f.tracepoint for f in frames] == [2, 1, 2, 1]
    assert [f.registers["rip"] for f in frames] == [AFTER_CALL, sentinel] * 2
    for inner, outer, raw_inner in zip(frames[0::2], frames[1::2], raw[0::2]):
        stack = next(b for b in inner.blocks if isinstance(b, MemoryBlock))
        slot = outer.registers["rsp"] - 8 - stack.address  # do_interrupt's return address slot
        assert _u64(stack.data, slot) == sentinel
        word = _u64(next(b for b in raw_inner.blocks if isinstance(b, MemoryBlock)).data, slot)
        assert word != sentinel and tracer.kret.resolve(word) == sentinel  # the trampoline, in the ring


def test_returns_in_flight_at_tstop_return_natively_and_the_trampolines_are_freed_after():
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    tracer = Tracer(machine, "opt")
    _define(tracer, 1, DO_SYSCALL, KRET, t.CollectRegisters(REGS))
    tracer.start()
    probe = next(iter(tracer.probes.installed.values())).kret
    pool = probe.pool
    syscall = Syscalls(machine)
    assert syscall(KGTP_COUNT) == 1
    # a call in flight: do_syscall entered (the entry hook of its int3 ran), its return not yet come
    slot = machine.alloc_data(0x1000) + 0x800
    machine.write_memory(slot, struct.pack("<Q", AFTER_CALL))
    saved = machine.registers()
    machine.set_registers({"rsp": slot, "rip": DO_SYSCALL, "rdi": syscall.regs})
    tracer.kret.enter(tracer, machine.uc, next(iter(tracer.probes.installed.values())))
    trampoline = _u64(machine.read_memory(slot, 8))
    assert pool <= trampoline < pool + POOL_BYTES and probe.count == 1
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert "1 pending at removal" in tracer.probe_rows()[0].function
    assert machine.read_memory(trampoline, 1) == b"\x90"  # the int3 is a nop now: no Python, no hit
    assert (pool, pool + POOL_BYTES) in tracer.retired.regions  # not freed: a stack points into it
    # the function returns after the run: through the trampoline to its caller, registers and slot restored
    machine.set_registers({"rsp": slot + 8, "rip": trampoline, "rax": 0x1234, "rbx": 7})
    machine.cpu.remove_cache(AFTER_CALL, 1)  # code translated earlier would not stop at the exit
    machine.cpu.run(until=AFTER_CALL)
    after = machine.registers()
    assert (after["rip"], after["rsp"], after["rax"], after["rbx"]) == (AFTER_CALL, slot + 8, 0x1234, 7)
    assert _u64(machine.read_memory(slot, 8)) == AFTER_CALL
    machine.set_registers(saved)
    assert len(tracer.frames()) == 1  # the return after tstop recorded nothing
    tracer.start()  # frees what nothing points into any more
    assert all(low != pool for low, _ in tracer.retired.regions)
    tracer.stop(t.StopReason.STOP_COMMAND)


# ---- the live kernel ------------------------------------------------------------------------------------------


def _live(tracer: Tracer, until, timeout: float = 120):
    """Run the kernel with the tracer's run until `until(tracer)` holds; then tstop. Returns the frames."""
    machine = tracer.machine
    machine.start()
    try:
        tracer.start()
        deadline = time.monotonic() + timeout
        while not until(tracer):
            assert time.monotonic() < deadline, "the awaited events did not happen"
            assert tracer.running, tracer.status()
            time.sleep(0.01)
        tracer.stop(t.StopReason.STOP_COMMAND)
        frames = tracer.frames()
        # the kernel goes on: more system calls (each one returned from the last), no crash
        calls = machine.read_symbol("nr_syscalls")
        while machine.read_symbol("nr_syscalls") < calls + 4:
            assert time.monotonic() < deadline + 60, "the kernel stopped making system calls"
            time.sleep(0.01)
        assert not machine.stats(count=False).state.startswith("crashed"), machine.stats(count=False)
        assert "panic" not in machine.console_text()
    finally:
        machine.shutdown()
    return frames


def _task(frame) -> int:
    return next(b.value for b in frame.blocks if isinstance(b, TsvBlock) and b.number == N["current_task"])


CURRENT = assemble(f"tracev {N['current_task']:#x}; end")
VECTOR = assemble("reg 5; const8 0x78; add; const8 0x10; trace; end")  # regs->vector, regs->orig_ax


def _pairs(frames, switches: bool = True):
    """Match each return (tracepoint 2) with its entry (tracepoint 1) per task, last in first out. Returns
    (pairs, deepest nesting seen, pairs with another task's frame in between)."""
    open_calls: dict[int, list] = {}
    pairs, depth, switched = [], 0, 0
    tasks = [_task(frame) for frame in frames]
    for index, (frame, task) in enumerate(zip(frames, tasks)):
        if frame.tracepoint == 1:
            open_calls.setdefault(task, []).append((index, frame))
            depth = max(depth, len(open_calls[task]))
            continue
        start, entry = open_calls[task].pop()  # a return without its entry would be a mix-up: KeyError/IndexError
        pairs.append((entry, frame))
        switched += switches and any(other != task for other in tasks[start + 1 : index])
    return pairs, depth, switched


@pytest.mark.parametrize("engine", ENGINES)
def test_do_interrupt_nested_on_one_stack_and_across_task_switches(engine):
    """`do_interrupt` is re-entered on the system call thread's stack when the timer interrupts a system call,
    and its timer calls switch tasks inside (schedule). An entry tracepoint beside the return probe (so they
    share one probe) records each call: every return pairs with its own entry, last in first out per task."""
    tracer = Tracer(Machine(IMAGE, hz=1000), engine)
    _define(tracer, 1, DO_INTERRUPT, t.CollectRegisters(REGS), CURRENT)
    _define(tracer, 2, DO_INTERRUPT, KRET, t.CollectRegisters(REGS), VECTOR, CURRENT)

    def nested(tracer: Tracer) -> bool:
        frames = tracer.frames()
        return len(frames) > 200 and _pairs(frames, switches=False)[1] >= 2

    frames = _live(tracer, nested)
    pairs, depth, switched = _pairs(frames)
    assert depth >= 2 and switched > 0 and len(pairs) > 50
    for entry, ret in pairs:
        regs_pointer = entry.registers["rdi"]
        block = next(b for b in ret.blocks if isinstance(b, MemoryBlock))
        assert block.address == regs_pointer + PT_VECTOR  # the entry's argument, read at the return
        assert ret.registers["rsp"] == entry.registers["rsp"] + 8 == regs_pointer  # same call, same slot
        assert IMAGE.function_at(ret.registers["rip"]).name == "common_entry"
    vectors = {_u64(ret.blocks[1].data) for _, ret in pairs}
    assert {0x20, 0x80} <= vectors
    row = next(row for row in tracer.probe_rows() if row.number == 2)
    assert " 0 missed" in row.function and row.hits == len([f for f in frames if f.tracepoint == 2])


@pytest.mark.parametrize("engine", ENGINES)
def test_do_syscall_returns_across_task_switches_with_the_kernels_results(engine):
    """nanosleep sleeps inside do_syscall while the other tasks run: its return comes after a task switch, with
    %rdi long reused; the entry argument still reads the system call number. Results as the kernel computes."""
    tracer = Tracer(Machine(IMAGE, hz=1000), engine)
    counter = IMAGE.address_of("syscall_counter")
    _define(tracer, 1, DO_SYSCALL, KRET, t.CollectRegisters(REGS), ORIG_AX, t.CollectMemory(-1, counter, 8), CURRENT)

    def enough(tracer: Tracer) -> bool:
        numbers = [_orig_ax(f) for f in tracer.frames()]
        return numbers.count(NANOSLEEP) >= 3 and numbers.count(GETPID) >= 3

    frames = _live(tracer, enough)
    syscall_test = IMAGE.address_of("tasks") + 3 * (IMAGE.symbols["tasks"].size // 65)  # NR_TASKS
    clobbered = 0
    for frame in frames:
        nr, regs = _orig_ax(frame), frame.registers
        value = regs["rax"] - (1 << 64) if regs["rax"] >> 63 else regs["rax"]
        expected = {GETPID: 3, NANOSLEEP: 0, 24: 0, WRITE: 35}.get(nr)
        if nr == KGTP_COUNT:
            expected = _u64(next(b for b in frame.blocks if isinstance(b, MemoryBlock) and b.address == counter).data)
        assert value == expected, (nr, value)
        assert regs["rip"] == AFTER_CALL and _task(frame) & (2**64 - 1) == syscall_test
        argument = _orig_ax_block(frame).address - PT_ORIG_AX
        assert argument == regs["rsp"] + 0x20  # do_interrupt's pt_regs, above its own 0x18 bytes and return
        clobbered += regs["rdi"] != argument
    assert clobbered  # %rdi at the return was not the argument any more: the entry's value was read


def test_tstop_with_returns_pending_then_a_new_run():
    """syscall_test sleeps inside do_syscall most of the time: tstop finds its return hijacked. It returns after
    the run through the trampoline (a nop now), the kernel goes on, and a new run traces again."""
    machine = Machine(IMAGE, hz=1000)
    tracer = Tracer(machine, "opt")
    _define(tracer, 1, DO_SYSCALL, KRET, t.CollectRegisters(REGS))
    machine.start()
    try:
        tracer.start()
        probe = next(iter(tracer.probes.installed.values())).kret
        deadline = time.monotonic() + 120
        while not (tracer.status().frames >= 3 and probe.count):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        tracer.stop(t.StopReason.STOP_COMMAND)
        assert probe.left >= 1 and "pending at removal" in tracer.probe_rows()[0].function
        calls = machine.read_symbol("nr_syscalls")
        while machine.read_symbol("nr_syscalls") < calls + 4:  # each one after the sleeping call returned
            assert time.monotonic() < deadline
            time.sleep(0.01)
        tracer.start()  # the old trampolines are freed once no stack points at them
        assert all(low != probe.pool for low, _ in tracer.retired.regions)
        while tracer.status().frames < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        tracer.stop(t.StopReason.STOP_COMMAND)
        assert all(f.registers["rip"] == AFTER_CALL for f in tracer.frames())
        assert not machine.stats(count=False).state.startswith("crashed")
    finally:
        machine.shutdown()


@pytest.mark.parametrize("engine", ["interp", "opt"])
def test_passcount_stops_the_run_at_the_return_with_calls_in_flight(engine):
    machine = Machine(IMAGE, hz=1000)
    tracer = Tracer(machine, engine)
    _define(tracer, 1, DO_INTERRUPT, KRET, t.CollectRegisters(REGS), passcount=5)
    machine.start()
    try:
        tracer.start()
        deadline = time.monotonic() + 120
        while tracer.running:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert tracer.stop_reason is t.StopReason.PASSCOUNT and len(tracer.frames()) == 5
        jiffies = machine.read_symbol("jiffies")
        while machine.read_symbol("jiffies") < jiffies + 10:  # timer interrupts return through do_interrupt
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not machine.stats(count=False).state.startswith("crashed")
    finally:
        machine.shutdown()


def test_a_circular_buffer_keeps_the_latest_returns():
    tracer = Tracer(Machine(IMAGE, hz=1000), "naive")
    tracer.definitions.buffer_size = 0x1000
    tracer.definitions.circular = True
    _define(tracer, 1, DO_SYSCALL, KRET, t.CollectRegisters(REGS), ORIG_AX)
    frames = _live(tracer, lambda tracer: tracer.status().created > 100)
    status = tracer.status()
    assert status.created > status.frames == len(frames) > 3  # older frames made room
    assert all(f.registers["rip"] == AFTER_CALL and _orig_ax(f) in (GETPID, KGTP_COUNT, NANOSLEEP, WRITE, 24)
               for f in frames)


def test_a_full_instance_table_counts_misses():
    """`teval $kret=1`: one call pending at a time (kretprobes' maxactive); entries meanwhile are misses."""
    tracer = Tracer(Machine(IMAGE, hz=1000), "opt")
    _define(tracer, 1, DO_INTERRUPT, bytes.fromhex("22012d001127"), t.CollectRegisters(REGS), VECTOR)
    probe = []

    def missed(tracer: Tracer) -> bool:
        probe[:] = [item.kret for item in tracer.probes.installed.values()]
        return probe[0].missed >= 3 and tracer.status().frames >= 10

    frames = _live(tracer, missed)
    assert probe[0].maxactive == 1 and MAXACTIVE == 10
    row = tracer.probe_rows()[0].function
    assert "(maxactive 1)" in row and f"{probe[0].missed} missed" in row
    for frame in frames:  # the calls it caught still return with their own arguments
        block = next(b for b in frame.blocks if isinstance(b, MemoryBlock))
        assert block.address == frame.registers["rsp"] + PT_VECTOR


def test_a_return_probe_on_a_function_reached_by_a_tail_call():
    """do_interrupt jumps to timer_interrupt (a tail call): both return probes hijack the same slot, and the
    one return fires both, timer_interrupt's first, with the same registers."""
    tracer = Tracer(Machine(IMAGE, hz=1000), "opt")
    _define(tracer, 1, DO_INTERRUPT, KRET, t.CollectRegisters(REGS), VECTOR)
    _define(tracer, 2, TIMER_INTERRUPT, KRET, t.CollectRegisters(REGS))
    frames = _live(tracer, lambda tracer: len([f for f in tracer.frames() if f.tracepoint == 2]) >= 5)
    for index, frame in enumerate(frames):
        if frame.tracepoint == 2 and index + 1 < len(frames):
            outer = frames[index + 1]
            assert outer.tracepoint == 1 and outer.registers == frame.registers
            assert _u64(outer.blocks[1].data) == 0x20  # the timer vector, do_interrupt's entry argument
