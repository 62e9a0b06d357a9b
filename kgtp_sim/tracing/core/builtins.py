"""KGTP's special trace state variables: KGTP's names and numbers, uploaded to GDB through qTfV like any other.

The numbers run without a gap from 1 to the last: GDB gives a user variable the number after the count of those
it was told of, so a gap would make it reuse a special variable's number.

Each variable says who may read and write it, as KGTP's hooks do:

- a condition or action (`getv`/`tracev` and `setv` in agent bytecode): *computed* variables are evaluated at the
  hit (`$current_task_pid` in a condition sees the task of that moment); *stored* ones (`$printk_tmp`) hold what
  the tracepoint wrote. A read or write KGTP refuses (an action reading `$ignore_error`, writing `$clock`) fails
  `tstart` with a message, as KGTP's action checker does.
- GDB (`print $clock`, `info tvariables`: qTv; `tvariable $bt = 1024`: QTDV): some are read live (`$clock`), some
  are settings (`$ignore_error`, `$bt`), the rest read as unknown, as KGTP answers for them.

What each one means on the simulated machine (1 to 8 CPUs, kernel threads only, no perf events) is in its summary.
The compiled engines refresh the slots of the computed ones their bytecode reads at each hit (`native_refresh_asm`,
used by `detour.py`); the few only Python can compute run their tracepoint on the Python hit path instead
(`runs_natively`).

Why this module is long: it is KGTP's table of 48 variables, each with its access rules, its Python computation
and, for the computed ones, the native code that refreshes it in a detour; one variable's three faces are kept
together so that no engine can disagree with another about it.

Threads: the table is immutable; computations and native refreshes run on the CPU thread at hits (or when a
location is placed), GDB's reads (`gdb_value`) on the server thread.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unicorn import Uc

from ...machine import smp
from .model import TraceVariable
from .run import Run

log = logging.getLogger(__name__)

#: KGTP's version as its `$gtp_version` reports it (KGTP 20140510).
GTP_VERSION = 20140510 * 10
#: `$bt`: bytes of stack `collect $bt` records (KGTP's default).
BT_DEFAULT = 512
#: `$printk_level`'s default in KGTP (8: printk's default level).
PRINTK_LEVEL_DEFAULT = 8
#: `$watch_size`'s default in KGTP.
WATCH_SIZE_DEFAULT = 1
#: `$cpu_number` before a machine says otherwise (Tracer sets it to `Machine.cpu_count`).
CPU_NUMBER = 1
#: Linux's HARDIRQ_OFFSET: hardirq_count() grows by this for each hard interrupt being handled.
HARDIRQ_OFFSET = 1 << 16
#: `struct pt_regs` of the kernel (fixtures/kernel/include/kernel.h): 22 saved words; `vector`, `cs`, `ss` slots.
PT_REGS_SIZE = 22 * 8
PT_REGS_CS = 18 * 8  #: struct pt_regs' cs (after 15 registers, vector, orig_ax and ip)
_PT_VECTOR, _PT_IP, _PT_CS, _PT_FLAGS, _PT_SP, _PT_SS = 15, 17, 18, 19, 20, 21
_TIMER_VECTOR = 32
_KERNEL_CS, _KERNEL_SS = 0x08, 0x10
#: errno KGTP stores (negated) in `$last_errno` when a tracepoint cannot be installed: the kprobe refusal.
EINVAL = 22
_RSP = 7  # GDB's register number of rsp


@dataclass(frozen=True)
class KernelLayout:
    """Where the kernel keeps its tasks and their stacks, read from the image's symbols."""

    tasks: int
    task_size: int
    boot_stack: int  # task 0's stack (init_stack)
    thread_stacks: int  # tasks 1.. : thread_stacks[i]
    thread_size: int

    @classmethod
    def of(cls, image) -> KernelLayout:
        symbols = image.symbols
        boot = symbols["init_stack"].address
        thread_size = symbols["init_stack_top"].address - boot  # boot.S's stack: one THREAD_SIZE
        stacks = symbols["thread_stacks"]
        count = stacks.size // thread_size
        return cls(symbols["tasks"].address, symbols["tasks"].size // count,
                   boot, stacks.address, thread_size)

    def stack_base(self, task: int) -> int:
        """The lowest address of the task's kernel stack: where Linux keeps its thread_info."""
        index = (task - self.tasks) // self.task_size
        return self.boot_stack if index == 0 else self.thread_stacks + index * self.thread_size


@dataclass(frozen=True)
class BuiltinContext:
    """What a computed variable sees at a hit: live memory, the machine, the clock, and the hit itself."""

    uc: Uc
    machine: object
    tsc: object
    hit: Any = None  # hits.HitContext
    tracer: Any = None

    def kernel_u64(self, symbol: str) -> int:
        address = self.machine.image.address_of(symbol)  # type: ignore[attr-defined]
        return int.from_bytes(self.uc.mem_read(address, 8), "little")

    def current_task(self) -> int:
        """The kernel's `current` on the hitting CPU (its per-CPU area, smp.py)."""
        return smp.current_task(self.uc)

    def cached(self, key: str, compute: Callable[[], Any]) -> Any:
        """One value per hit (both halves of `$xtime_*` from one instant, one `$step_id` per hit)."""
        if self.hit is None:
            return compute()
        store = self.hit.__dict__.setdefault("_kgtp_values", {})
        if key not in store:
            store[key] = compute()
        return store[key]


@dataclass(frozen=True)
class Builtin:
    number: int
    name: str
    initial: int = 0
    compute: Callable[[BuiltinContext], int] | None = None
    summary: str = ""
    agent_read: bool = True  # a condition or action may read it
    agent_write: bool = False  # ... may write it (stored variables only)
    gdb_read: Callable[[Run], int | None] | str | None = None  # "stored": the setting; a function: live
    gdb_write: bool = False  # `tvariable $x = v` (QTDV) sets it
    refused: str = ""  # why an action may not use it at all (a feature not implemented yet)
    #: a write from a hit that Python carries out (`setv` of it puts the tracepoint on the Python hit path)
    assign: Callable[[BuiltinContext, int], None] | None = None

    @property
    def computed(self) -> bool:
        return self.compute is not None

    def definition(self) -> TraceVariable:
        return TraceVariable(self.number, self.initial, True, self.name, settable=self.gdb_write)


# ---- computed at the hit ---------------------------------------------------------------------------------


def _layout(ctx: BuiltinContext) -> KernelLayout:
    machine = ctx.machine
    layout = getattr(machine, "_kgtp_layout", None)
    if layout is None:
        layout = KernelLayout.of(machine.image)  # type: ignore[attr-defined]
        machine._kgtp_layout = layout  # type: ignore[attr-defined]
    return layout


def _current_task(ctx: BuiltinContext) -> int:
    return ctx.current_task()


def _current_pid(ctx: BuiltinContext) -> int:
    task = ctx.current_task()
    return int.from_bytes(ctx.uc.mem_read(task, 4), "little", signed=True)  # task_struct.pid is its first member


def _thread_info(ctx: BuiltinContext) -> int:
    return _layout(ctx).stack_base(ctx.current_task())


def _task_pt_regs(ctx: BuiltinContext) -> int:
    layout = _layout(ctx)
    return layout.stack_base(ctx.current_task()) + layout.thread_size - PT_REGS_SIZE


def _current_task_user(ctx: BuiltinContext) -> int:
    """user_mode(task_pt_regs(current)): the task is a process's (its saved frame's CS is ring 3's)."""
    cs = int.from_bytes(ctx.uc.mem_read(_task_pt_regs(ctx) + PT_REGS_CS, 8), "little")
    return 1 if cs & 3 == 3 else 0


def _inferior_pid(ctx: BuiltinContext) -> int:
    return ctx.tracer.inferior_pid if ctx.tracer is not None else 0


def clock_mult(tsc) -> int:
    """TSC ticks to nanoseconds as a 32.32 fixed-point factor: every engine computes `$clock` with it."""
    return max(1, round((1 << 32) / tsc.ticks_per_ns))


def tsc_to_clock(tsc, ticks: int) -> int:
    return ((ticks & (2**64 - 1)) * clock_mult(tsc)) >> 32 & (2**64 - 1)


def _rdtsc(ctx: BuiltinContext) -> int:
    return ctx.tsc.read()  # type: ignore[attr-defined]


def _clock(ctx: BuiltinContext) -> int:
    return tsc_to_clock(ctx.tsc, ctx.tsc.read())  # type: ignore[attr-defined]


def _cooked_clock(ctx: BuiltinContext) -> int:
    """KGTP's: the clock when the handler began, minus what earlier handlers took."""
    state = ctx.tracer.kgtp
    return tsc_to_clock(ctx.tsc, state.entry_tsc) - state.cost_ns()


def _cooked_rdtsc(ctx: BuiltinContext) -> int:
    state = ctx.tracer.kgtp
    return state.entry_tsc - int(state.cost_ns() * ctx.tsc.ticks_per_ns)  # type: ignore[attr-defined]


def _xtime(ctx: BuiltinContext) -> tuple[int, int]:
    return ctx.cached("xtime", lambda: divmod(time.time_ns(), 1_000_000_000))


def _hardirq_count(ctx: BuiltinContext) -> int:
    """Hard interrupts being handled: timer interrupt frames (`struct pt_regs` with vector 32, pushed by the CPU
    and the entry code) on the live part of the current task's stack, above the hit's %rsp."""
    layout = _layout(ctx)
    base = layout.stack_base(ctx.current_task())
    top = base + layout.thread_size
    rsp = ctx.hit.regs[_RSP] if ctx.hit is not None else top
    if not base <= rsp < top:
        return 0
    rsp &= ~7
    words = struct.unpack(f"<{(top - rsp) // 8}Q", bytes(ctx.uc.mem_read(rsp, top - rsp)))
    low, high = ctx.machine.image.text_range  # type: ignore[attr-defined]
    depth = 0
    for at in range(len(words) - _PT_SS):
        if (words[at + _PT_VECTOR] == _TIMER_VECTOR and words[at + _PT_CS] == _KERNEL_CS
                and words[at + _PT_SS] == _KERNEL_SS and low <= words[at + _PT_IP] < high
                and words[at + _PT_FLAGS] & 0x202 == 0x202 and rsp < words[at + _PT_SP] <= top):
            depth += 1
    return depth * HARDIRQ_OFFSET


def _step_count(ctx: BuiltinContext) -> int:
    return getattr(ctx.hit, "step", 0) if ctx.hit is not None else 0


def _step_id(ctx: BuiltinContext) -> int:
    state = ctx.tracer.kgtp
    if getattr(ctx.hit, "step", 0):
        return state.step_id
    return ctx.cached("step_id", state.next_step_id)


def _dump_stack(ctx: BuiltinContext) -> int:
    """KGTP prints the stack with printk: here on the kernel's console (printk.dump_stack). Never fails the
    hit: a stack that cannot be walked prints what was found."""

    def dump() -> None:
        try:
            ctx.tracer.dump_stack(ctx)
        except Exception:  # noqa: BLE001 (a diagnostic must not take the hit down)
            log.exception("$dump_stack")

    ctx.cached("dump_stack", dump)
    return 0


# ---- read by GDB (qTv) without a hit -------------------------------------------------------------------------


def _live_clock(tracer: Run) -> int:
    return tsc_to_clock(tracer.tsc, tracer.tsc.read())


def _discarded(tracer: Run) -> int:
    return tracer.ring.state().discards if tracer.ring is not None else 0


class BuiltinTable(tuple):
    def by_number(self, number: int) -> Builtin | None:
        return _BY_NUMBER.get(number)

    def by_name(self, name: str) -> Builtin:
        return next(b for b in self if b.name == name)


def _watch(name: str) -> Callable[[BuiltinContext], int]:
    return lambda ctx: ctx.tracer.watches.value(ctx.hit, name)


def _watch_set(name: str) -> Callable[[BuiltinContext, int], None]:
    return lambda ctx, value: ctx.tracer.watches.assign(ctx.hit, name, value)


_ZERO = lambda ctx: 0  # noqa: E731


def _p_pe_en(ctx: BuiltinContext, value: int) -> None:
    """KGTP's gtp_pc_pe_en: the hitting CPU's perf events switched (perf.py)."""
    ctx.tracer.perf.switch(smp.cpu_number(ctx.uc), value, getattr(ctx.hit, "site", None))


def _const(value: int) -> Callable[[BuiltinContext], int]:
    return lambda ctx: value


BUILTIN_VARIABLES = BuiltinTable((
    Builtin(1, "gtp_version", GTP_VERSION, _const(GTP_VERSION), "the KGTP version emulated",
            gdb_read=lambda tracer: GTP_VERSION),
    Builtin(2, "cpu_id", compute=lambda ctx: smp.cpu_number(ctx.uc),
            summary="smp_processor_id() of the hit: the CPU the hit runs on (%gs:0x8)",
            gdb_read=lambda tracer: tracer.machine.current_cpu),
    Builtin(3, "current_task", compute=_current_task, summary="`current`: the task_struct of the running task"),
    Builtin(4, "current_thread_info", compute=_thread_info,
            summary="the base of the running task's kernel stack, where Linux keeps its thread_info"),
    Builtin(5, "clock", compute=_clock, summary="nanoseconds, from the TSC", gdb_read=_live_clock),
    Builtin(6, "cooked_clock", compute=_cooked_clock,
            summary="$clock minus the time tracepoint handlers took since tstart"),
    Builtin(7, "rdtsc", compute=_rdtsc, summary="the TSC", gdb_read=lambda tracer: tracer.tsc.read()),
    Builtin(8, "cooked_rdtsc", compute=_cooked_rdtsc,
            summary="$rdtsc minus the ticks tracepoint handlers took since tstart"),
    Builtin(9, "gtp_rb_discard_page_number", agent_read=False, gdb_read=_discarded,
            summary="times the circular buffer discarded its oldest page's worth of frames to make room"),
    Builtin(10, "printk_tmp", agent_write=True, summary="scratch value to print (`collect $printk_tmp=global`)"),
    Builtin(11, "printk_level", PRINTK_LEVEL_DEFAULT, agent_read=False, agent_write=True,
            summary="below 8: `collect` prints at this level on the console instead of recording (printk.py)"),
    Builtin(12, "printk_format", agent_read=False, agent_write=True,
            summary="layout of direct output: 0 A, 1 D, 2 U, 3 X, 4 S, 5 B (printk.py)"),
    Builtin(13, "dump_stack", compute=_dump_stack, summary="reading it prints the hit's backtrace; reads 0"),
    Builtin(14, "self_trace", agent_write=True,
            summary="KGTP skips hits in its own processes unless set; no such task exists here: no effect"),
    Builtin(15, "cpu_number", CPU_NUMBER, lambda ctx: ctx.machine.cpu_count,
            "number of CPUs (KGTP's gtp_cpu_number: the highest possible CPU + 1; the machine's CPU count)",
            gdb_read=lambda tracer: tracer.machine.cpu_count),
    Builtin(16, "p_pe_en", agent_read=False, agent_write=True, assign=_p_pe_en,
            summary="set by an action: every perf event ($pe_*, $p_pe_*) of the hitting CPU on (1) or off (0)"),
    Builtin(17, "kret", agent_read=False, agent_write=True,
            summary="set in an action: the tracepoint fires when its function returns (kret.py)"),
    Builtin(18, "xtime_sec", compute=lambda ctx: _xtime(ctx)[0], summary="time of day, seconds",
            gdb_read=lambda tracer: time.time_ns() // 1_000_000_000),
    Builtin(19, "xtime_nsec", compute=lambda ctx: _xtime(ctx)[1], summary="time of day, nanoseconds part",
            gdb_read=lambda tracer: time.time_ns() % 1_000_000_000),
    Builtin(20, "ignore_error", agent_read=False, gdb_read="stored", gdb_write=True,
            summary="non-zero: tstart skips tracepoints that cannot be installed (error in $last_errno)"),
    Builtin(21, "last_errno", agent_read=False, gdb_read="stored",
            summary="-errno of the last tracepoint tstart skipped under $ignore_error, else 0"),
    Builtin(22, "hardirq_count", compute=_hardirq_count,
            summary="hardirq_count(): 0x10000 per timer interrupt being handled"),
    Builtin(23, "softirq_count", compute=_ZERO, summary="softirq_count(): the kernel has no softirqs: 0"),
    Builtin(24, "irq_count", compute=_hardirq_count, summary="irq_count(): hard + soft interrupts"),
    Builtin(25, "pipe_trace", agent_read=False, gdb_read="stored", gdb_write=True,
            summary="KGTP's gtp_frame_pipe setting (kept)"),
    Builtin(26, "current_task_pid", compute=_current_pid, summary="current->pid"),
    Builtin(27, "current_task_user", compute=_current_task_user,
            summary="user_mode(task_pt_regs(current)): 1 when the current task is a process's"),
    Builtin(28, "current", agent_write=True,
            summary="read: the hit's registers (and a user context's memory) are task_pt_regs(current)'s; set to "
                    "a struct pt_regs pointer: that context's (printk.py)"),
    Builtin(29, "bt", BT_DEFAULT, gdb_read="stored", gdb_write=True,
            summary="bytes of stack `collect $bt` records with the registers"),
    Builtin(30, "enable", agent_read=False, agent_write=True,
            summary="set to N: tracepoint N is switched on from the next hit (0: all others; printk.py)"),
    Builtin(31, "disable", agent_read=False, agent_write=True,
            summary="set to N: tracepoint N is switched off from the next hit (0: all others; printk.py)"),
    # watch tracepoints (watch.py has the rules: who may read and write which, and what each one means)
    Builtin(32, "watch_static", agent_read=False, agent_write=True,
            summary="an action setting it to 1 (0) makes its tracepoint a static (dynamic) watch tracepoint"),
    Builtin(33, "watch_type", compute=_watch("type"), agent_write=True, assign=_watch_set("type"),
            summary="0 execute, 1 write, 2 read or write: of a watch, or for the next $watch_start"),
    Builtin(34, "watch_size", WATCH_SIZE_DEFAULT, compute=_watch("size"), agent_write=True, assign=_watch_set("size"),
            summary="1, 2, 4 or 8 bytes watched: of a watch, or for the next $watch_start"),
    Builtin(35, "watch_set_id", agent_read=False, agent_write=True, assign=_watch_set("set_id"),
            summary="chooses the dynamic watch tracepoint (by number) the next $watch_start arms"),
    Builtin(36, "watch_set_addr", agent_read=False, agent_write=True, assign=_watch_set("set_addr"),
            summary="chooses the dynamic watch tracepoint (by address) the next $watch_start arms"),
    Builtin(37, "watch_start", compute=_watch("start"), agent_write=True, assign=_watch_set("start"),
            summary="set: arm the chosen dynamic watch on that address; read: 0 or -errno (-16: all 4 in use)"),
    Builtin(38, "watch_stop", compute=_watch("stop"), agent_write=True, assign=_watch_set("stop"),
            summary="set: disarm the watch on that address; read: 0 or -errno (-6: none there)"),
    *(Builtin(number, f"watch_{name}", compute=_watch(name), summary=summary) for number, name, summary in (
        (39, "trace_num", "in a watch hit: the tracepoint that armed the watch"),
        (40, "trace_addr", "in a watch hit: that tracepoint's address"),
        (41, "addr", "in a watch hit: the address watched"),
        (42, "val", "in a watch hit: the value there now (after the access)"),
        (43, "count", "in a watch hit: the number of this watch session (grows with each arming)"))),
    Builtin(44, "step_count", compute=_step_count,
            summary="in a while-stepping frame, the step's number from 1; 0 at the hit"),
    Builtin(45, "step_id", compute=_step_id,
            summary="one number per while-stepping hit, shared by its steps (`monitor replay` needs it)"),
    Builtin(46, "watch_prev_val", compute=_watch("prev_val"),
            summary="in a watch hit: the value at the watch's previous hit (or when it was armed)"),
    Builtin(47, "inferior_pid", compute=_inferior_pid, gdb_read=lambda tracer: tracer.inferior_pid,
            summary="the process GDB debugs (the gdbserver role's program), else 0"),
    Builtin(48, "task_pt_regs", compute=_task_pt_regs,
            summary="task_pt_regs(current): the register frame at the top of the task's kernel stack"),
))
_BY_NUMBER = {b.number: b for b in BUILTIN_VARIABLES}
BT = BUILTIN_VARIABLES.by_name("bt").number
IGNORE_ERROR = BUILTIN_VARIABLES.by_name("ignore_error").number
LAST_ERRNO = BUILTIN_VARIABLES.by_name("last_errno").number
STEP_ID = BUILTIN_VARIABLES.by_name("step_id").number
STEP_COUNT = BUILTIN_VARIABLES.by_name("step_count").number
CPU_ID = BUILTIN_VARIABLES.by_name("cpu_id").number
CLOCK = BUILTIN_VARIABLES.by_name("clock").number
COOKED = {BUILTIN_VARIABLES.by_name(n).number for n in ("cooked_clock", "cooked_rdtsc")}


# ---- the run's own state ---------------------------------------------------------------------------------------


@dataclass
class KgtpState:
    """What the special variables keep across hits of one run: the step id, the cost of tracing."""

    step_id: int = 0
    cooked: bool = False  # some tracepoint of the run reads $cooked_*: every hit is timed (Python path)
    entry_tsc: int = 0  # the TSC when the current handler began
    _cost_ns: int = 0
    _tsc: Any = field(default=None, repr=False)

    def start(self, tracepoints, tsc) -> None:
        self._cost_ns = 0
        self._tsc = tsc
        self.cooked = any(reads(tp, COOKED) for tp in tracepoints)

    def admit(self, tp) -> None:
        """A location armed during a run: `$cooked_*` need every hit of the run timed from tstart."""
        from .model import TraceError

        if not self.cooked and reads(tp, COOKED):
            raise TraceError(f"tracepoint {tp.number}: $cooked_clock and $cooked_rdtsc need their tracepoints "
                             "defined before tstart")

    def next_step_id(self) -> int:
        self.step_id = (self.step_id + 1) & (2**64 - 1) or 1
        return self.step_id

    def cost_ns(self) -> int:
        return self._cost_ns

    def timed(self, handler: Callable[[], None]) -> None:
        """Run a hit's handler, adding the time it took to what `$cooked_*` subtract."""
        if not self.cooked:
            handler()
            return
        begin = time.perf_counter_ns()
        self.entry_tsc = self._tsc.read()
        try:
            handler()
        finally:
            self._cost_ns += time.perf_counter_ns() - begin


# ---- checks at tstart, and which engine runs a location ----------------------------------------------------------


def _variable_ops(program):
    for insn in program.insns:
        if insn.name in ("getv", "tracev", "setv"):
            yield insn.name, insn.operands[0]


def reads(tp, numbers: set[int]) -> bool:
    """Does any bytecode of the location read one of these variables?"""
    from ...agent.verify import BytecodeError, verify

    for code in tp.expressions():
        try:
            program = verify(code)
        except BytecodeError:
            continue
        if any(op != "setv" and number in numbers for op, number in _variable_ops(program)):
            return True
    return False


def check_access(programs, where: str) -> None:
    """Refuse at tstart what KGTP's action checker refuses: reading a variable only GDB may read, writing a
    computed one or a setting, using one whose feature is not implemented."""
    from .model import TraceError

    for program in programs:
        for op, number in _variable_ops(program):
            builtin = _BY_NUMBER.get(number)
            if builtin is None:
                continue
            if builtin.refused:
                raise TraceError(f"{where}: trace state variable ${builtin.name}: {builtin.refused}")
            if op == "setv" and not builtin.agent_write:
                raise TraceError(f"{where}: trace state variable ${builtin.name} cannot be set by a tracepoint")
            if op != "setv" and not builtin.agent_read:
                raise TraceError(f"{where}: trace state variable ${builtin.name} cannot be read by a tracepoint")


def expand_bt(actions: list, tsv_slots: int, verify) -> list:
    """KGTP's `collect $bt`: also record the registers and $bt bytes of stack from %rsp (the value at the hit),
    so GDB can unwind the frame. `actions` are (action, program) pairs; returns them with what is missing."""
    from . import model as t

    if not any(p is not None and any(i.name == "tracev" and i.operands[0] == BT for i in p.insns) for _, p in actions):
        return actions
    unwind = (1 << 17) - 1  # rax..r15 and rip: what GDB's unwinder reads (a compact block holds what is named)
    out = [(t.CollectRegisters(a.mask | unwind), p) if isinstance(a, t.CollectRegisters) else (a, p)
           for a, p in actions]
    if not any(isinstance(a, t.CollectRegisters) for a, _ in out):
        out.append((t.CollectRegisters(unwind), None))
    stack = bytes((0x26, 0x00, 0x07, 0x2C)) + BT.to_bytes(2, "big") + bytes((0x0C, 0x27))  # reg rsp; getv; trace
    out.append((t.EvalExpression(stack), verify(stack, tsv_slots=tsv_slots)))
    return out


_COMPUTED = {b.number: b.name for b in BUILTIN_VARIABLES if b.computed}


def builtin_slots(programs: list[Program]) -> tuple[tuple[int, str], ...]:
    """Computed built-in variables the bytecode reads: the detour refreshes their slots at each hit."""
    found: dict[int, str] = {}
    for program in programs:
        for insn in program.insns:
            if insn.name in ("getv", "tracev") and insn.operands[0] in _COMPUTED:
                found[insn.operands[0]] = _COMPUTED[insn.operands[0]]
    return tuple(sorted(found.items()))


def runs_natively(tracer: Run, programs, native_builtins: tuple[str, ...]) -> bool:
    """Can a compiled detour run this location? Not when it reads a variable only Python computes or writes one
    only Python carries out, nor in a run that times its hits for `$cooked_*` (the Python hit path times every
    hit). Per-CPU variables run natively once their copies are in emulated memory (percpu.py)."""
    if tracer.kgtp.cooked:
        return False
    per_cpu = {number for p in programs for _, number in _variable_ops(p) if number in tracer.per_cpu}
    if per_cpu and not tracer.per_cpu.attached:
        return False  # a per-CPU variable without copies in emulated memory
    if len({tracer.per_cpu.names[number].base for number in per_cpu}) < len(per_cpu):
        return False  # two names of one variable's copies (`$p_x`, `$p_x1`): only Python sees them alias
    if any(op == "setv" and getattr(_BY_NUMBER.get(n), "assign", None) for p in programs
           for op, n in _variable_ops(p)):
        return False  # a write Python carries out ($watch_start, $p_pe_en ...)
    perf = getattr(tracer, "perf", None)
    if perf is not None and perf.reads_or_writes(programs):
        return False  # a perf event's counter is the machine's, read and switched from Python (perf.py)
    predefined = getattr(tracer, "predefined", None)
    if predefined is not None and predefined.used_by(programs):
        return False  # the target's own variables ($trace_timestamp) have a getter in Python (predefined.py)
    return all(kind in native_builtins for _, kind in builtin_slots(programs))


def percpu_slots(tracer: Run, programs) -> tuple[tuple[int, str], ...]:
    """The per-CPU variables a location reads or writes, as refresh entries: `percpu_local ADDR` (the copies of
    the base name, CPU 0's at ADDR, the hitting CPU's at ADDR + 8 * cpu) or `percpu_cpu ADDR` (the copy of the
    CPU the name gives), `_w` appended to the ones it writes. The detour loads them at entry and stores the
    written ones back at its end (a location naming one variable's copies twice runs in Python: runs_natively)."""
    ops = [(op, number) for p in programs for op, number in _variable_ops(p) if number in tracer.per_cpu]
    written = {number for op, number in ops if op == "setv"}
    out = []
    for number in sorted({number for _, number in ops}):
        kind = "percpu_local" if tracer.per_cpu.names[number].cpu is None else "percpu_cpu"
        out.append((number, f"{kind}{'_w' if number in written else ''} {tracer.per_cpu.copy_address(number):#x}"))
    return tuple(out)


def percpu_store_asm(number: int, kind: str) -> list[str]:
    """AT&T lines storing slot `number` of the variable array `(%rsi)` back into its per-CPU copy (kinds of
    `percpu_slots`). May clobber rax, rcx, rdx."""
    name, address = kind.split()
    lines = [f"mov {8 * number:#x}(%rsi), %rdx", f"movabs ${int(address, 16):#x}, %rcx"]
    if name.startswith("percpu_local"):
        return lines + [f"movl %gs:{smp.PERCPU_CPU_NUMBER:#x}, %eax", "mov %rdx, (%rcx,%rax,8)"]
    return lines + ["mov %rdx, (%rcx)"]


def native_slots(tracer: Run, slots: tuple[tuple[int, str], ...]) -> tuple[tuple[int, str], ...]:
    """The refresh list a detour gets: each kind with the numbers its code needs (hex, space separated)."""
    out = []
    for number, kind in slots:
        if kind == "clock":
            kind = f"clock {clock_mult(tracer.tsc):#x}"
        elif kind == "cpu_number":
            kind = f"cpu_number {tracer.machine.cpu_count:#x}"
        elif kind == "inferior_pid":
            kind = f"inferior_pid {tracer.inferior_pid:#x}"
        elif kind in ("current_thread_info", "task_pt_regs", "current_task_user"):
            layout = KernelLayout.of(tracer.machine.image)
            kind = (f"{kind} {layout.tasks:#x} {layout.task_size:#x} {layout.boot_stack:#x} "
                    f"{layout.thread_stacks:#x} {layout.thread_size:#x} {PT_REGS_SIZE:#x}")
        out.append((number, kind))
    return tuple(out)


def native_refresh_asm(number: int, kind: str) -> list[str]:
    """AT&T lines storing computed variable `number` in its slot, `(%rsi)` being the variable array. May clobber
    rax, rcx, rdx (the detour restores them). Numbers in hex (see DESIGN.md, the assembler trap)."""
    name, *params = kind.split()
    args = [int(p, 16) for p in params]
    slot = f"{8 * number:#x}(%rsi)"
    if name == "softirq_count":
        return [f"movq $0x0, {slot}"]
    if name == "inferior_pid":
        return [f"movq ${args[0] if args else 0:#x}, {slot}"]
    if name == "cpu_id":  # smp_processor_id(), zero-extended
        return [f"mov %gs:{smp.PERCPU_CPU_NUMBER:#x}, %eax", f"mov %rax, {slot}"]
    if name == "cpu_number":
        return [f"movq ${args[0] if args else CPU_NUMBER:#x}, {slot}"]
    if name == "gtp_version":
        return [f"movq ${GTP_VERSION:#x}, {slot}"]
    if name.startswith("percpu_"):  # the hitting CPU's copy, or the named CPU's (percpu_slots)
        lines = [f"movabs ${args[0]:#x}, %rcx"]
        if name.startswith("percpu_local"):
            lines += [f"movl %gs:{smp.PERCPU_CPU_NUMBER:#x}, %eax", "mov (%rcx,%rax,8), %rcx"]
        else:
            lines.append("mov (%rcx), %rcx")
        return lines + [f"mov %rcx, {slot}"]
    if name in ("current_task", "current_task_pid"):
        lines = [f"mov %gs:{smp.PERCPU_CURRENT_TASK:#x}, %rax"]  # `current`, as the kernel reads it
        if name == "current_task_pid":
            lines.append("movslq (%rax), %rax")  # task_struct.pid: first member
        return lines + [f"mov %rax, {slot}"]
    if name == "rdtsc":
        return ["rdtsc", "shl $0x20, %rdx", "or %rdx, %rax", f"mov %rax, {slot}"]
    if name == "clock":  # (tsc * mult) >> 32, as tsc_to_clock
        return ["rdtsc", "shl $0x20, %rdx", "or %rdx, %rax", f"movabs ${args[0]:#x}, %rcx", "mul %rcx",
                "shrd $0x20, %rdx, %rax", f"mov %rax, {slot}"]
    if name in ("current_thread_info", "task_pt_regs", "current_task_user"):
        tasks, task_size, boot_stack, thread_stacks, thread_size, pt_regs = args
        other, done = f"kgtp_v{number}_thread", f"kgtp_v{number}_done"
        lines = [f"mov %gs:{smp.PERCPU_CURRENT_TASK:#x}, %rax", f"movabs ${tasks:#x}, %rcx",
                 "sub %rcx, %rax", "xor %edx, %edx", f"mov ${task_size:#x}, %ecx", "div %rcx",
                 "test %rax, %rax", f"jne {other}", f"movabs ${boot_stack:#x}, %rax", f"jmp {done}",
                 f"{other}:", f"imul ${thread_size:#x}, %rax, %rax", f"movabs ${thread_stacks:#x}, %rcx",
                 "add %rcx, %rax", f"{done}:"]
        if name in ("task_pt_regs", "current_task_user"):
            lines.append(f"add ${thread_size - pt_regs:#x}, %rax")
        if name == "current_task_user":  # user_mode(): the saved CS's privilege is 3
            lines += [f"mov {PT_REGS_CS:#x}(%rax), %rax", "and $0x3, %eax", "xor %edx, %edx", "cmp $0x3, %eax",
                      "sete %dl", "mov %rdx, %rax"]
        return lines + [f"mov %rax, {slot}"]
    raise ValueError(f"no native refresh for ${name}")


# ---- values GDB reads ------------------------------------------------------------------------------------------


def gdb_value(tracer: Run, builtin: Builtin, stored: Callable[[], int | None]) -> int | None:
    """qTv of a special variable without a hit: live, the setting, or unknown, as KGTP answers."""
    if callable(builtin.gdb_read):
        return builtin.gdb_read(tracer)
    if builtin.gdb_read == "stored":
        value = stored()
        if value is None:
            variable = tracer.definitions.variables.get(builtin.number)
            value = variable.initial if variable is not None else builtin.initial
        return value
    return None


def setting(tracer: Run, number: int) -> int:
    """A GDB-side setting (`$ignore_error`, `$bt`) as GDB last set it, for tstart itself."""
    variable = tracer.definitions.variables.get(number)
    return variable.initial if variable is not None else _BY_NUMBER[number].initial


def gdb_settable(number: int) -> bool:
    builtin = _BY_NUMBER.get(number)
    return builtin is None or builtin.gdb_write
