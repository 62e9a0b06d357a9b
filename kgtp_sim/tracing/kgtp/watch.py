"""KGTP's watch tracepoints: tracepoints that fire when an address is written (or read or written, or executed)
instead of when an instruction is reached, on the machine's four hardware breakpoints (machine/watchpoints.py).

What makes a tracepoint a watch tracepoint, and the two forms, as KGTP has them:

- An action `teval $watch_static=1` (a constant) makes a **static watch**: the tracepoint's own address is the
  address watched (`trace *&jiffies`), and the run watches it from tstart. `teval $watch_type=N` (0 execute,
  1 write, 2 read or write; default 1) and `teval $watch_size=N` (1, 2, 4, 8; default 1) in its actions, also
  constants, say how. These setting actions are consumed at tstart (KGTP drops them from the action list); the
  other actions and the condition run at each hit.
- `teval $watch_static=0` makes a **dynamic watch**: its address only names it (`trace *1`). Another, ordinary,
  tracepoint points it at an address while the kernel runs: `$watch_set_id=N` (or `$watch_set_addr=A`, the
  dynamic watch's tracepoint address) chooses it and resets `$watch_type`/`$watch_size` for this hit to the
  dynamic watch's own (as KGTP's manual says; KGTP's code resets them to 1 and 1, which is the same unless the
  dynamic watch sets them), `$watch_type=`/`$watch_size=` change them, `$watch_start=ADDRESS` arms a hardware
  breakpoint there and `$watch_start` then reads its result (0, -EBUSY when all four are in use, -EFAULT for an
  unmapped address), `$watch_stop=ADDRESS` disarms the breakpoint on that address (0, or -ENXIO). A setting
  tracepoint runs on the Python hit path in every engine: each start and stop is a side effect in the order the
  actions give, which compiled code has no way to call out for.

At a hit, the watch tracepoint's condition and actions run on the Python hit path in every engine, with the
registers as the trap leaves them: after the accessing instruction for data (RIP at the next instruction, the new
value in memory; a trap, as x86 data breakpoints are), before the instruction for execution (a fault). They read:
`$watch_addr` (the address watched), `$watch_val` (its `$watch_size` bytes now, zero-extended, read once per hit),
`$watch_prev_val` (the value at the previous hit of this breakpoint, or when it was armed; KGTP updates it after
every trap, whatever the condition said), `$watch_type`, `$watch_size`, `$watch_count` (KGTP's "special count for
this watch session": a counter of the run's arm and dynamic disarm operations, taken when the breakpoint was
armed, so every session of a dynamic watch has a larger one and every hit of one session the same),
`$watch_trace_num`/`$watch_trace_addr` (the tracepoint that armed it: the watch itself when static). A watch hit
may `$watch_stop` (itself, with `$watch_stop=$watch_addr`).

Limits, as KGTP: four breakpoints for static and dynamic together (a fifth static watch fails tstart, or is left
out with `$last_errno` = -EBUSY under `$ignore_error`; a fifth start reads -EBUSY), no while-stepping in a run with
a watch tracepoint. Accesses by the tracer's own compiled code (collections, the ring) never trap; a probed
instruction that runs displaced (an int3's out-of-line copy, a detour's tail) traps with RIP in that copy, as
under kprobes.

Runs on the CPU thread (planning at tstart through `Tracer._between_hits`, hits inside the machine's hooks).

Why this module is long: it is KGTP's whole watch feature on the tracer's side, the checker that tells watch
tracepoints from the others at tstart, the four breakpoints' bookkeeping, the hit, and the thirteen variables'
reads and writes; they share the run's plans and slots, which splitting would pass around.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from unicorn import Uc
from unicorn.x86_const import UC_X86_REG_RIP

from ...agent.errors import BytecodeError
from ...agent.interp import evaluate
from ...agent.verify import Program, verify
from ...machine import MODULE_BASE, MODULE_SIZE, MemoryFault
from ...machine.watchpoints import COUNT, EXECUTE, READ_WRITE, SIZES, WRITE, DebugRegisters, WatchpointError
from ..core import model as t
from ..core.builtins import BUILTIN_VARIABLES, check_access, expand_bt
from ..core.model import ProbeRow, StopReason, TraceError, Tracepoint
from ..core.run import Run
from ..engines.hits import HitContext, hit_registers, record_hit
from ..patching.placement import verified_actions
from ..patching.placement import Installed
from .kret import sets_kret


log = logging.getLogger(__name__)

EFAULT, EBUSY, ENXIO, EINVAL = 14, 16, 6, 22
TYPES = (EXECUTE, WRITE, READ_WRITE)
_N = {b.name: b.number for b in BUILTIN_VARIABLES}
STATIC, TYPE, SIZE = _N["watch_static"], _N["watch_type"], _N["watch_size"]
SET_ID, SET_ADDR, START, STOP = _N["watch_set_id"], _N["watch_set_addr"], _N["watch_start"], _N["watch_stop"]
#: what only a watch tracepoint's hit can read
HIT_ONLY = {_N[name] for name in ("watch_trace_num", "watch_trace_addr", "watch_addr", "watch_val", "watch_count",
                                  "watch_prev_val")}
WATCH_VARIABLES = {STATIC, TYPE, SIZE, SET_ID, SET_ADDR, START, STOP} | HIT_ONLY
_MASK = 2**64 - 1


@dataclass
class WatchPlan:
    """A watch tracepoint of the run: how it watches, its verified condition and actions, its counters."""

    tracepoint: Tracepoint
    static: bool
    type: int = WRITE
    size: int = 1
    condition: Program | None = None
    actions: list[tuple[t.Action, Program | None]] = field(default_factory=list)
    armed: bool = True  # enabled in the run (a disabled dynamic watch cannot be started)
    fired: int = 0
    hits: int = 0
    usage: int = 0


@dataclass
class Slot:
    """One hardware breakpoint in use (KGTP's gtp_hwb_s)."""

    index: int
    address: int
    size: int
    type: int
    watch: WatchPlan
    trace_num: int
    trace_addr: int
    count: int
    prev_val: int


@dataclass
class WatchHit:
    """A watch tracepoint's hit: the breakpoint that trapped and `$watch_val`, read once."""

    slot: Slot
    val: int | None = None
    stop_result: int = 0


@dataclass
class SettingState:
    """What a hit of an ordinary tracepoint builds up with `$watch_set_*`, `$watch_type`, `$watch_size`, and the
    results of its starts and stops (KGTP keeps them in the hit's gtp_trace_s: they start at 0 for each hit)."""

    watch: WatchPlan | None = None
    type: int = 0
    size: int = 0
    start_result: int = 0
    stop_result: int = 0


# ---- tstart: which tracepoints are watches ----------------------------------------------------------------


class _NotConstant(Exception):
    pass


class _Assigned(Exception):
    def __init__(self, number: int, value: int) -> None:
        self.number, self.value = number, value


class _ConstantContext:
    """Runs an action's bytecode up to its first write of a watch variable, refusing anything not constant."""

    def __init__(self, watching: set[int]) -> None:
        self.watching = watching

    def read_memory(self, addr: int, n: int) -> bytes:
        raise _NotConstant

    def register(self, n: int) -> int:
        raise _NotConstant

    def tsv_get(self, n: int) -> int:
        raise _NotConstant

    def tsv_set(self, n: int, value: int) -> None:
        if n in self.watching:
            raise _Assigned(n, value)

    def trace_room(self) -> int | None:
        return None

    def trace_block(self, block: bytes) -> None:
        pass

    def printf(self, text: str) -> None:
        raise _NotConstant


def _first_write(program: Program, numbers: set[int]) -> tuple[int, int | None] | None:
    """(variable, its constant value or None) of the first write of one of `numbers` in `program`, or None."""
    first = next((i for i in program.insns if i.name == "setv" and i.operands[0] in numbers), None)
    if first is None:
        return None
    try:
        evaluate(program, _ConstantContext(numbers), loop_budget=0)
    except _Assigned as assigned:
        return assigned.number, assigned.value
    except _NotConstant:
        pass
    return first.operands[0], None


def _writes(program: Program) -> set[int]:
    return {i.operands[0] for i in program.insns if i.name == "setv"}


def _reads(program: Program) -> set[int]:
    return {i.operands[0] for i in program.insns if i.name in ("getv", "tracev")}


def _verify(code: bytes, tsv_slots: int, where: str, value: bool = False) -> Program:
    try:
        return verify(code, tsv_slots=tsv_slots, require_value=value)
    except BytecodeError as error:
        raise TraceError(f"{where} rejected: {error}") from None


def _name(number: int) -> str:
    return BUILTIN_VARIABLES.by_number(number).name  # type: ignore[union-attr]


def classify(tp: Tracepoint, tsv_slots: int) -> WatchPlan | None:
    """The watch plan of a watch tracepoint (its setting actions consumed), None for an ordinary one; raises
    TraceError for what KGTP's checker refuses."""
    where = f"tracepoint {tp.number} at {tp.address:#x}"
    setting = []  # (index in tp.actions, variable, value)
    for index, action in enumerate(tp.actions):
        if not isinstance(action, t.EvalExpression):
            continue
        program = _verify(action.bytecode, tsv_slots, f"{where}: action")
        found = _first_write(program, {STATIC, TYPE, SIZE})
        if found is not None:
            setting.append((index, *found))
    statics = [(i, value) for i, number, value in setting if number == STATIC]
    if tp.condition is not None:
        condition = _verify(tp.condition, tsv_slots, f"{where}: condition")
        if _writes(condition) & WATCH_VARIABLES:
            raise TraceError(f"{where}: a condition cannot set a watch variable")
    if not statics:
        return None
    plan = WatchPlan(tp, static=False)
    consumed = set()
    for index, number, value in setting:
        if value is None:
            raise TraceError(f"{where}: {_name(number)} must be set to a constant")
        value = value & _MASK
        if number == STATIC:
            if value not in (0, 1):
                raise TraceError(f"{where}: watch_static is set to 0 or 1, not {value}")
            plan.static = value == 1
        elif number == TYPE:
            if value not in TYPES:
                raise TraceError(f"{where}: watch_type is 0 (execute), 1 (write) or 2 (read or write), not {value}")
            plan.type = value
        elif value not in SIZES:
            raise TraceError(f"{where}: watch_size is 1, 2, 4 or 8, not {value}")
        else:
            plan.size = value
        consumed.add(index)
    if tp.step_count or tp.stepping_actions:
        raise TraceError(f"{where}: a watch tracepoint cannot single-step (while-stepping)")
    if tp.static or tp.fast_insn_length is not None:
        raise TraceError(f"{where}: a watch tracepoint is defined with trace, not strace or ftrace")
    actions = [a for i, a in enumerate(tp.actions) if i not in consumed]
    if any(isinstance(a, t.CollectStaticData) for a in actions):
        raise TraceError(f"{where}: $_sdata exists only at static tracepoints (strace)")
    plan.condition = _verify(tp.condition, tsv_slots, f"{where}: condition", True) if tp.condition else None
    plan.actions = verified_actions(actions, tsv_slots, f"{where}: action")
    programs = [p for p in (plan.condition, *(p for _, p in plan.actions)) if p is not None]
    for program in programs:
        for number in sorted(_writes(program) & WATCH_VARIABLES - {STOP}):
            raise TraceError(f"{where}: a watch tracepoint cannot set variable {_name(number)} at its hit")
        for number in sorted(_reads(program) & {STATIC, SET_ID, SET_ADDR}):
            raise TraceError(f"{where}: variable {_name(number)} cannot be read by a tracepoint")
        if sets_kret(program):  # KGTP: a return probe is a kprobe, never a watch
            raise TraceError(f"{where}: $kret cannot be used with while-stepping or watch")
    check_access(programs, where)
    plan.actions = expand_bt(plan.actions, tsv_slots, verify)
    return plan


def check_ordinary(tp: Tracepoint, tsv_slots: int) -> None:
    """An ordinary tracepoint may set up dynamic watches, not read what only a watch hit has."""
    where = f"tracepoint {tp.number} at {tp.address:#x}"
    for code in tp.expressions():
        try:
            program = verify(code, tsv_slots=tsv_slots)
        except BytecodeError:
            continue  # placement reports it
        for number in sorted(_reads(program) & HIT_ONLY):
            raise TraceError(f"{where}: variable {_name(number)} is read only by a watch tracepoint "
                             "(one whose actions set watch_static)")


class ArmError(TraceError):
    """A static watch that cannot be armed; `errno` is what KGTP leaves in `$last_errno` under `$ignore_error`."""

    def __init__(self, message: str, errno: int) -> None:
        super().__init__(message)
        self.errno = errno


# ---- the run ------------------------------------------------------------------------------------------------


class Watches:
    """The watch tracepoints of the tracer's run and the hardware breakpoints they hold."""

    def __init__(self, tracer: Run) -> None:
        self.tracer = tracer
        self.plans: dict[tuple[int, int], WatchPlan] = {}
        self.slots: list[Slot | None] = [None] * COUNT
        self._registers: DebugRegisters | None = None
        self._sessions = 0  # KGTP's gtp_hwb_sync_count: $watch_count

    @property
    def registers(self) -> DebugRegisters:
        """The machine's debug registers, shared with the debugger's hardware breakpoints and watchpoints
        (machine/runcontrol.py): the tracer's own code never traps, for either."""
        if self._registers is None:
            self._registers = self.tracer.machine.debug_registers
            self._registers.ignore = self._own_code
        return self._registers

    # ---- tstart and tstop --------------------------------------------------------------------------------

    def reset(self) -> None:
        self.plans = {}
        self._sessions = 0

    def admit(self, tp: Tracepoint, tsv_slots: int) -> bool:
        """tstart: is `tp` a watch tracepoint (then it is the run's, with no probe)? Raises TraceError."""
        plan = classify(tp, tsv_slots)
        if plan is None:
            check_ordinary(tp, tsv_slots)
            return False
        user = self.tracer.user_space
        if plan.static and user is not None and user.holds(tp.address):
            raise TraceError(f"tracepoint {tp.number}: a watch tracepoint is a hardware breakpoint of the kernel's "
                             f"(KGTP's), on the kernel's memory: {tp.address:#x} is the program's")
        self.plans[tp.key] = plan
        return True

    def check_run(self, tracepoints: list[Tracepoint]) -> None:
        """Data breakpoints and while-stepping take the CPU's one single-step trap: not in one run, the watch
        tracepoints' nor GDB's watchpoints (machine/runcontrol.py), which hold the same debug registers."""
        if not any(tp.step_count for tp in tracepoints):
            return
        if self.plans:
            raise TraceError("watch tracepoints cannot work together with while-stepping in one run")
        if any(watch is not None and watch.kind != EXECUTE for watch in self.registers.slots):
            raise TraceError("while-stepping cannot work together with GDB's watchpoints (they hold debug "
                             "registers): delete them first")

    def tracepoints(self) -> list[Tracepoint]:
        return [plan.tracepoint for plan in self.plans.values()]

    def start(self, ignore_error: bool) -> int:
        """Arm the static watches, in definition order. Returns -errno of the last one left out (`$ignore_error`),
        else 0; raises TraceError when one cannot be armed."""
        last_errno = 0
        for plan in self.plans.values():
            if plan.static:
                try:
                    self._arm_static(plan)
                except ArmError as error:
                    if not ignore_error:
                        self.stop()
                        raise
                    log.warning("tstart left out %s", error)
                    last_errno = -error.errno
        return last_errno

    def _arm_static(self, plan: WatchPlan) -> None:
        tp = plan.tracepoint
        result = self._register(plan, tp.address, plan.size, plan.type, tp.number, tp.address)
        if result == -EBUSY:
            mine = [str(s.watch.tracepoint.number) for s in self.slots if s is not None]
            holders = [f"tracepoints {', '.join(mine)}"] if mine else []
            debugger = self.registers.in_use - len(mine)
            holders += [f"{debugger} by GDB's hardware breakpoints and watchpoints"] if debugger else []
            raise ArmError(f"tracepoint {tp.number}: no free hardware breakpoint for the watch at {tp.address:#x}: "
                           f"x86 has {COUNT} debug registers, all in use ({'; '.join(holders)})", EBUSY)
        if result:
            raise ArmError(f"tracepoint {tp.number}: cannot watch {tp.address:#x}: not mapped", -result)

    def stop(self) -> None:
        """tstop: every breakpoint of the run goes (the debugger's stay), and the hooks with the last one; plans
        stay for qTP."""
        own = [slot.index for slot in self.slots if slot is not None]
        self.slots = [None] * COUNT
        if self._registers is not None:
            self._registers.release(own)

    def arm(self, tp: Tracepoint, tsv_slots: int) -> bool:
        """A watch tracepoint enabled or defined during the run (server thread; the change is made on the CPU
        thread, where hits read the plans). False: not a watch tracepoint."""
        plan = classify(tp, tsv_slots)
        if plan is None:
            check_ordinary(tp, tsv_slots)
            return False

        def install(uc: Uc) -> None:
            earlier = self.plans.get(tp.key)
            if earlier is not None and earlier.armed:
                return  # enabled again while armed: nothing to do
            if earlier is not None:
                plan.fired, plan.hits, plan.usage = earlier.fired, earlier.hits, earlier.usage
            self.plans[tp.key] = plan
            if plan.static:
                try:
                    self._arm_static(plan)
                except ArmError:
                    plan.armed = False  # refused: enabling it again tries again
                    raise

        self.tracer.machine.run_on_cpu(install)
        return True

    def disarm(self, key: tuple[int, int]) -> bool:
        """A watch tracepoint disabled during the run: its breakpoints go. False: not a watch tracepoint."""
        plan = self.plans.get(key)
        if plan is None:
            return False
        plan.armed = False
        for slot in list(self.slots):
            if slot is not None and slot.watch is plan:
                self._free(slot)
        return True

    # ---- breakpoints --------------------------------------------------------------------------------------

    def _register(self, plan: WatchPlan, address: int, size: int, kind: int, trace_num: int,
                  trace_addr: int) -> int:
        """Arm a free breakpoint: 0, -EBUSY (none free), -EFAULT (not mapped)."""
        registers = self.registers
        index = registers.free_slot()
        if index is None:
            return -EBUSY
        try:
            prev = self._read(address, size)
            registers.set(index, address & _MASK, size, kind, self._trap)
        except (MemoryFault, WatchpointError) as error:
            log.info("watch on %#x refused: %s", address, error)
            return -EFAULT
        self._sessions += 1
        self.slots[index] = Slot(index, address & _MASK, size, kind, plan, trace_num, trace_addr, self._sessions,
                                 prev)
        return 0

    def _unregister(self, address: int) -> int:
        """Disarm the newest breakpoint on `address` (KGTP's used list is newest first): 0 or -ENXIO."""
        found = [s for s in self.slots if s is not None and s.address == address & _MASK]
        if not found:
            return -ENXIO
        self._free(max(found, key=lambda s: s.count))
        self._sessions += 1
        return 0

    def _free(self, slot: Slot) -> None:
        self.slots[slot.index] = None
        self.registers.clear(slot.index)

    def _read(self, address: int, size: int) -> int:
        return int.from_bytes(self.tracer.machine.read_memory(address & _MASK, size), "little")

    def _own_code(self, rip: int) -> bool:
        """The tracer's compiled code (detours, compiled expressions, ring routines): its accesses never trap
        (a frame may be reserved in the ring meanwhile). Kernel instructions it runs displaced (detour tails) and
        the int3 path's out-of-line copies are the kernel's: theirs do."""
        native = self.tracer.native
        if native is None or not MODULE_BASE <= rip < MODULE_BASE + MODULE_SIZE:
            return False
        inside = any(low <= rip < high for low, high in native.code_regions)
        return inside and not any(low <= rip < high for low, high in native.displaced)

    # ---- a hit --------------------------------------------------------------------------------------------

    def _trap(self, uc: Uc, index: int) -> None:
        slot = self.slots[index]
        if slot is None or not self.tracer.running:
            return
        state = WatchHit(slot)
        try:
            self.tracer.kgtp.timed(lambda: self._hit(uc, state))
        except Exception:  # noqa: BLE001 (a hit must not take the kernel down)
            log.exception("watch tracepoint %d", slot.watch.tracepoint.number)
        if self.slots[index] is slot:  # KGTP: after the handler, whatever it decided
            slot.prev_val = state.val if state.val is not None else self._value(slot)

    def _hit(self, uc: Uc, state: WatchHit) -> None:
        tracer = self.tracer
        plan = state.slot.watch
        tp = plan.tracepoint
        hit = HitContext(uc, hit_registers(tracer, uc, uc.reg_read(UC_X86_REG_RIP)), tracer, room=tracer.room,
                         tracepoint=tp, watch=state)
        plan.fired += 1
        if record_hit(tracer, hit, plan):
            tracer.stop(StopReason.PASSCOUNT, tracepoint=tp.number)

    def _value(self, slot: Slot) -> int:
        try:
            return self._read(slot.address, slot.size)
        except MemoryFault:
            return slot.prev_val

    # ---- the variables, as a hit reads and writes them (builtins.py) --------------------------------------

    def value(self, hit: HitContext | None, name: str) -> int:
        state: Any = getattr(hit, "watch", None)
        if isinstance(state, WatchHit):
            slot = state.slot
            if name == "val":
                if state.val is None:
                    state.val = self._value(slot)
                return state.val
            if name == "stop":
                return state.stop_result
            return {"type": slot.type, "size": slot.size, "addr": slot.address, "prev_val": slot.prev_val,
                    "count": slot.count, "trace_num": slot.trace_num, "trace_addr": slot.trace_addr}.get(name, 0)
        if isinstance(state, SettingState):
            return {"type": state.type, "size": state.size, "start": state.start_result,
                    "stop": state.stop_result}.get(name, 0)
        return 0

    def assign(self, hit: HitContext | None, name: str, value: int) -> None:
        if hit is None:
            return
        value &= _MASK
        tp = hit.tracepoint
        number = tp.number if tp is not None else 0
        if isinstance(hit.watch, WatchHit):
            if name == "stop":
                hit.watch.stop_result = self._unregister(value)
            return
        if hit.watch is None:
            hit.watch = SettingState()
        state: SettingState = hit.watch
        if name in ("set_id", "set_addr"):
            plan = next((p for p in list(self.plans.values()) if p.armed and not p.static and (
                p.tracepoint.number if name == "set_id" else p.tracepoint.address) == value), None)
            if plan is None:
                what = "number" if name == "set_id" else "address"
                self._error(number, f"no dynamic watch tracepoint with {what} {value:#x} in this run")
                return
            state.watch, state.type, state.size = plan, plan.type, plan.size
        elif name == "type":
            if value not in TYPES:
                self._error(number, f"watch_type is 0 (execute), 1 (write) or 2 (read or write), not {value}")
                return
            state.type = value
        elif name == "size":
            if value not in SIZES:
                self._error(number, f"watch_size is 1, 2, 4 or 8, not {value}")
                return
            state.size = value
        elif name == "start":
            if state.watch is None:
                self._error(number, "watch_start before watch_set_id or watch_set_addr chose a dynamic watch")
                return
            if state.size not in SIZES or state.type not in TYPES:
                self._error(number, "watch_start with no watch_type or watch_size")
                return
            state.start_result = self._register(state.watch, value, state.size, state.type, number,
                                                tp.address if tp is not None else 0)
            if state.start_result == -EBUSY:
                log.warning("tracepoint %d: watch_start at %#x: all %d hardware breakpoints are in use (-EBUSY)",
                            number, value, COUNT)
        elif name == "stop":
            state.stop_result = self._unregister(value)

    def _error(self, number: int, message: str) -> None:
        self.tracer.stop(StopReason.ERROR, note=f"tracepoint {number}: {message}", tracepoint=number)

    # ---- what GDB asks --------------------------------------------------------------------------------------

    def find(self, key: tuple[int, int]) -> WatchPlan | None:
        return self.plans.get(key)

    def rows(self) -> list[ProbeRow]:
        image = self.tracer.machine.image
        armed = {id(s.watch) for s in self.slots if s is not None}
        rows = []
        for plan in list(self.plans.values()):  # the CPU thread may add one (arm)
            tp = plan.tracepoint
            symbol = image.symbol_at(tp.address) if plan.static else None
            rows.append(ProbeRow(tp.number, tp.address, "watch", id(plan) in armed and self.tracer.running,
                                 plan.fired, plan.hits, plan.usage, symbol.name if symbol else ""))
        return rows
