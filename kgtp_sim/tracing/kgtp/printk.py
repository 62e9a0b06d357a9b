"""What KGTP's actions do at the hit besides recording: direct output (`$printk_level`, `$printk_format`,
`$printk_tmp`, `$dump_stack`), switching tracepoints (`$enable`, `$disable`) and the registers of another
context (`$current`).

**Direct output.** Each hit starts with `$printk_level` 8 and `$printk_format` 0 (KGTP clears its per-hit state).
While the level is below 8, a `collect` expression prints on the kernel's console instead of recording: the
last value it traces is printed, the others it traces are dropped, nothing of it reaches the frame. An expression
that traces nothing (GDB computes `counter1 + 0` of a register variable from the `R` registers and pops it) prints
the value it computed, 8 bytes in the format: gtp.c prints nothing there (and drops the registers). One line per
collect, as KGTP's `gtp_action_printk` writes it:

    <0>CPU0 gtp 1 ffffffff81001110:$c=$c+1=41

(the level, the CPU, the tracepoint's number and address as printk's `%p` shows them, the expression as the
user wrote it, the value in `$printk_format`'s layout). A hit that printed and recorded nothing makes no frame
(KGTP makes a frame when the first block is written). GDB sends registers and memory ranges (`R`, `M`: `$regs`,
a register variable, a global) before any expression: ranges are recorded (KGTP refuses them; as its howto says,
`collect $printk_tmp=jiffies` prints a global), and the one `R` action, where GDB merges the registers of every
collect, is dropped when every collect of the hit printed (KGTP drops it always). Conditional expressions and
loops work in such a tracepoint (KGTP refuses them there); while-stepping actions cannot print (as in KGTP).

`$printk_format` (gtp.c's `GTP_PRINTK_FORMAT_*`): 0 A: 1, 2, 4 or 8 bytes as U, else as B; 1 D signed decimal;
2 U unsigned decimal; 3 X `0x` hexadecimal; 4 S a string; 5 B the bytes in hexadecimal. A value is at most 8
bytes (255 for S and B); D, U and X of 3, 5, 6 or 7 bytes, or another format, stop the run with an error, as
KGTP stops the tracepoint. KGTP's buffer is a `char` array, signed on x86: a byte or a 16-bit value with its top
bit set prints sign-extended to 32 bits under U and X (`4294967295`, `0xffffffff`), each such byte as `ffffff80`
under B. That is what KGTP prints, and so it is printed here.

**The expression's text** comes from the action lines GDB sends with `QTDPsrc` (the bytecode has none). GDB
sends registers, memory ranges, then expressions (one `X` per expression of a `collect` line or of a `teval`
line, in line order); a `collect` item becomes an `X` unless it is `$regs`, `$_sdata`, a register or a global
variable. When the items counted that way match the `X` actions, each expression gets its own text; otherwise
each printed line takes the next `collect` item, as KGTP does. Without any text the line names what was traced
(`$name` of a variable, `*0xADDR@N` of memory).

**`$enable = N`, `$disable = N`** (in a condition or an action) switch tracepoint N on or off, all of its
locations, from the next hit on; 0 means every tracepoint but the one whose action runs. A disabled location's
probe comes out of the kernel and a re-enabled one goes back in, compiled or not (`Tracer.disarm`/`arm`, the
same path as GDB's `disable`/`enable` during a run), so a tracepoint that never switches keeps its instruction
counts; a compiled location switched on again goes back to the detour it had (`ProbeSet.resume`: no compiling,
no new module space, however often it switches). As with KGTP, a reconnecting GDB is told the new state (`qTfP`); GDB's own `info tracepoints` keeps
GDB's.

**`$current = P`** (an action, KGTP's `get_regs`; GDB compiles `teval $current = (unsigned long)regs`, not
the assignment of a pointer variable): that action runs first at each hit, before the condition, and every
register the hit reads or records is then the `struct pt_regs` at P (an interrupt's, a trap's, a system call's
frame), as KGTP reads the registers of another context.

**`collect $current`** (any read of it in a condition or an action; KGTP's GTP_ENTRY_FLAGS_CURRENT_TASK): the
registers of the hit are `task_pt_regs(current)`'s, the frame the kernel saved when the current task entered it
from ring 3 (a system call, a fault, an interrupt of the process), and the frame records them as its register
block (all of them: GDB sends no `R` action for a variable), so that `tfind` shows the process where it entered
the kernel. The value recorded for `$current` is the address of that `struct pt_regs` (KGTP drops the action).
When those registers are a user context (their CS is ring 3's), every memory read of the hit is the process's, as
gtp.c switches to gtp_task_handler_read: a `$sp`-relative range, `$bt` (the howto's `collect $current` and
`collect $bt`: the user stack from the user %rsp, what `bt` walks with the program's symbols) read the program's
pages through the page tables the hitting CPU has loaded (the current task's; kernel addresses read the same in
every space). At a kernel thread's hit the registers are still those at the top of its kernel stack, as gtp.c
takes them without asking (whatever that area holds: a kernel thread never entered from user mode), and memory is
the kernel's: put `$current_task_user` in the condition, as the howto does. Reading `$current` in while-stepping
actions is refused: the steps are the kernel's own instructions, not the process's.

Tracepoints using any of these run on the Python hit path (`hits.interpreted_hit` with a `DirectHit`) under
every engine; the others keep their native paths.

Threads: `attach` runs on the CPU thread when a location is placed (tstart, or armed during a run); the hit
context and `switch` run on the CPU thread inside hits; `dump_stack` at a hit too.
"""

from __future__ import annotations

import functools
import logging
import re
import struct
from dataclasses import dataclass, field

from ...agent.errors import BytecodeError, ErrorCode, EvalError, EvalResult, UnreadableMemory
from ...agent.interp import evaluate
from ...agent.opcodes import OpClass
from ...agent.verify import Program, verify
from ...arch import amd64
from ...machine import smp
from ..core import model as t
from ..core.builtins import BUILTIN_VARIABLES, PRINTK_LEVEL_DEFAULT, PT_REGS_SIZE
from ..core.frames import ALL_GENERAL
from ..core.model import TraceError
from ..core.run import Run
from ..engines.hits import HitContext
from ..patching.placement import Installed


log = logging.getLogger(__name__)

_N = {b.name: b.number for b in BUILTIN_VARIABLES}
PRINTK_LEVEL, PRINTK_FORMAT = _N["printk_level"], _N["printk_format"]
ENABLE, DISABLE, CURRENT = _N["enable"], _N["disable"], _N["current"]
TASK_PT_REGS = _N["task_pt_regs"]

#: gtp.c's GTP_PRINTK_FORMAT_* numbers.
FORMAT_A, FORMAT_D, FORMAT_U, FORMAT_X, FORMAT_S, FORMAT_B = range(6)
#: gtp.c's GTP_PRINTF_MAX: KGTP's print buffer; a value prints at most one byte less.
PRINTF_MAX = 256
_U32, _U64 = 2**32 - 1, 2**64 - 1

#: `struct pt_regs` of the kernel (fixtures/kernel/include/kernel.h), word index of each register GDB numbers
#: 0..19 (rax rbx rcx rdx rsi rdi rbp rsp r8-r15 rip eflags cs ss); ds, es, fs, gs are not saved there.
_PT_REGS = (8, 5, 7, 11, 10, 9, 4, 20, 13, 14, 12, 6, 3, 2, 1, 0, 17, 19, 18, 21)
_REGISTER_NAMES = {r.name for r in amd64.REGISTERS} | {"pc", "sp", "fp", "ps"}


class PrintkError(Exception):
    """A value `$printk_format` cannot print (KGTP stops the tracepoint)."""


def render(fmt: int, data: bytes) -> bytes:
    """The value part of a direct-output line, as gtp.c's gtp_action_printk prints `data` (a traced range, or
    the 8 bytes of a variable) in format `fmt`."""
    size = min(len(data), PRINTF_MAX - 1)
    if fmt not in (FORMAT_S, FORMAT_B) and size > 8:
        size = 8
    data = data[:size]
    if fmt == FORMAT_A:
        fmt = FORMAT_U if size in (1, 2, 4, 8) else FORMAT_B
    if fmt in (FORMAT_D, FORMAT_U, FORMAT_X):
        if size not in (1, 2, 4, 8):
            raise PrintkError(f"format {fmt} cannot print {size} bytes")
        value = int.from_bytes(data, "little", signed=True)  # char and short are promoted to a signed int
        if fmt != FORMAT_D:
            value &= _U64 if size == 8 else _U32
        return (f"0x{value:x}" if fmt == FORMAT_X else str(value)).encode()
    if fmt == FORMAT_S:
        return data.split(b"\0", 1)[0]
    if fmt == FORMAT_B:
        return "".join(f"{(byte - 256 if byte > 127 else byte) & _U32:02x}" for byte in data).encode()
    raise PrintkError(f"format {fmt} is not one of KGTP's (0 to 5)")


def kernel_print(tracer: Run, text: bytes) -> None:
    """Print on the kernel's console (`monitor console`; the stub's log shows each line)."""
    tracer.machine.console_write(text)


# ---- the expressions' text ---------------------------------------------------------------------------------


def _lines(sources: list[t.TracepointSource]) -> list[str]:
    """The action lines (`cmd` sources) before any while-stepping block, each string joined from its pieces."""
    texts: list[str] = []
    for source in sources:
        if source.kind != "cmd":
            continue
        if source.start and texts:
            texts[-1] += source.source
        else:
            texts.append(source.source)
    lines, stepping = [], False
    for text in texts:
        text = text.strip()
        word = re.split(r"[\s/]", text, maxsplit=1)[0]
        if word in ("while-stepping", "stepping", "ws"):
            stepping = True
        elif word == "end":
            stepping = False
        elif not stepping:
            lines.append(text)
    return lines


def split_items(text: str) -> list[str]:
    """`a, f(b, c), "x,y"` -> the comma-separated expressions at the top level."""
    items, depth, quote, start = [], 0, "", 0
    for at, char in enumerate(text):
        if quote:
            if char == quote and text[at - 1] != "\\":
                quote = ""
        elif char in "\"'":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:at].strip())
            start = at + 1
    items.append(text[start:].strip())
    return [item for item in items if item]


def _x_actions(item: str, image) -> int | None:
    """How many `X` actions GDB sends for one `collect` item (None: it depends on the scope)."""
    low = item.lower()
    if low.startswith("$reg") or low.startswith("$_sdata"):
        return 0  # all registers (R), static data (L)
    if low.startswith("$arg") or low.startswith("$loc"):
        return None
    if re.fullmatch(r"\$\w+", item):
        return 0 if item[1:] in _REGISTER_NAMES else 1  # a register (R), else a variable (X)
    if re.fullmatch(r"[A-Za-z_]\w*", item):
        symbol = image.symbols.get(item)
        return 0 if symbol is not None and symbol.type == "OBJECT" else 1  # a global is a memory range (M)
    return 1


@dataclass(frozen=True)
class Names:
    """The text of each expression: by `X` action (exact), or one `collect` item per printed line (KGTP's)."""

    by_action: tuple[str | None, ...] = ()
    in_turn: tuple[str, ...] = ()


def expression_names(tp: t.Tracepoint, image) -> Names:
    entries: list[tuple[str, int | None, bool]] = []  # (text, X actions, from a collect line)
    for line in _lines(tp.sources):
        word, _, rest = line.partition(" ")
        command = word.split("/")[0]
        if len(command) >= 3 and "collect".startswith(command):
            entries += [(item, _x_actions(item, image), True) for item in split_items(rest)]
        elif len(command) >= 2 and "teval".startswith(command):
            entries += [(item, 1, False) for item in split_items(rest)]
    actions = sum(isinstance(a, t.EvalExpression) for a in tp.actions)
    counts = [count for _, count, _ in entries]
    if None not in counts and sum(counts) == actions:  # type: ignore[arg-type]
        return Names(by_action=tuple(text for text, count, _ in entries for _ in range(count or 0)))
    return Names(in_turn=tuple(text for text, count, collect in entries if collect and count != 0))


# ---- at tstart ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DirectPlan:
    """What a location's hits do besides recording (fixed at tstart)."""

    header: str  # "gtp 1 ffffffff81001110:"
    names: Names
    current: Program | None = None  # the action setting $current (KGTP's get_regs), run first at each hit
    variables: dict[int, str] = field(default_factory=dict)  # trace state variable number -> name
    #: a condition or action reads $current: without `current`, the hit's registers are task_pt_regs(current)'s
    reads_current: bool = False


def _ops(program: Program | None):
    for insn in program.insns if program is not None else ():
        if insn.name in ("getv", "tracev", "setv"):
            yield insn.name, insn.operands[0]


def _writes(programs) -> set[int]:
    return {number for program in programs for op, number in _ops(program) if op == "setv"}


def _reads(programs, number: int) -> bool:
    return any(op != "setv" and n == number for program in programs for op, n in _ops(program))


def attach(item: Installed, tracer: Run) -> None:
    """tstart (or a location armed during a run): refuse what KGTP refuses about these variables, and give a
    location that uses them the hit context that does what they mean (None keeps the ordinary one, and the
    location its native path)."""
    where = f"tracepoint {item.tracepoint.number} at {item.tracepoint.address:#x}"
    actions = [p for _, p in item.actions if p is not None]
    stepping = [p for _, p in item.stepping if p is not None]
    if {PRINTK_LEVEL, PRINTK_FORMAT} & _writes(stepping):
        raise TraceError(f"{where}: while-stepping actions cannot print ($printk_level), as in KGTP")
    if _reads([*stepping], CURRENT):
        raise TraceError(f"{where}: while-stepping actions cannot read $current (the steps are the kernel's "
                         "instructions, not the current task's user context)")
    reads_current = _reads([item.condition, *actions], CURRENT)
    if item.space is not None and (reads_current or CURRENT in _writes(actions)):
        raise TraceError(f"{where}: a tracepoint in a program cannot use $current: its registers are the "
                         "program's already (KGTP refuses $current in its uprobes too)")
    if CURRENT in _writes([item.condition, *stepping]):
        raise TraceError(f"{where}: $current can only be set in an action, as in KGTP")
    setting_current = [(a, p) for a, p in item.actions if p is not None and CURRENT in _writes([p])]
    if len(setting_current) > 1:
        raise TraceError(f"{where}: $current is set by more than one action")
    used = _writes([item.condition, *actions]) & {PRINTK_LEVEL, PRINTK_FORMAT, ENABLE, DISABLE, CURRENT}
    used |= _writes(stepping) & {ENABLE, DISABLE}
    if not used and not reads_current:
        return
    current = None
    if setting_current:
        item.actions = [pair for pair in item.actions if pair is not setting_current[0]]
        current = setting_current[0][1]
    if reads_current:  # the frame's register block is the context's, every register of it (GDB sends R first)
        item.actions = [(t.CollectRegisters(a.mask | ALL_GENERAL), p) if isinstance(a, t.CollectRegisters) else (a, p)
                        for a, p in item.actions]
        if not any(isinstance(action, t.CollectRegisters) for action, _ in item.actions):
            item.actions = [(t.CollectRegisters(ALL_GENERAL), None), *item.actions]
    tp = item.tracepoint
    plan = DirectPlan(f"gtp {tp.number} {tp.address & _U64:016x}:", expression_names(tp, tracer.machine.image),
                      current, {n: v.name for n, v in tracer.definitions.variables.items()}, reads_current)
    item.hit_context = functools.partial(DirectHit, plan=plan)


# ---- at the hit --------------------------------------------------------------------------------------------


@dataclass
class DirectHit(HitContext):
    """A hit of a location using direct output, `$enable`/`$disable` or `$current` (Python hit path)."""

    plan: DirectPlan | None = None
    level: int = PRINTK_LEVEL_DEFAULT
    format: int = FORMAT_A
    printed: bool = False
    _held: list[bytes] = field(default_factory=list)
    _actions_run: int = 0
    _names_used: int = 0
    _current: int | None = None
    _recorded_collects: int = 0

    # ---- the hooks of hits.interpreted_hit --------------------------------------------------------------

    def begin(self) -> bool:
        """`$current`: run the action setting it (or take `task_pt_regs(current)` when the location only reads
        it), then read the hit's registers from that `struct pt_regs`; a user context's hit reads the process's
        memory (gtp.c's gtp_task_handler_read), through the page tables the hitting CPU has loaded."""
        assert self.plan is not None
        if self.plan.current is not None:
            result = evaluate(self.plan.current, self)
            if not self.tracer.check(result.error, self.tracepoint):
                return False
            if self._current is None:
                return self._fail("$current was not set")
        elif self.plan.reads_current:
            self._current = self.tsv_get(TASK_PT_REGS)
        else:
            return True
        try:
            raw = self.read_memory(self._current, PT_REGS_SIZE)
        except UnreadableMemory as error:
            return self._fail(f"$current: cannot read the struct pt_regs at {self._current:#x}", error.address)
        words = struct.unpack(f"<{PT_REGS_SIZE // 8}Q", raw)
        registers = [words[i] for i in _PT_REGS]
        registers[amd64.REGISTER_INDEX["eflags"]] &= _U32
        registers[amd64.REGISTER_INDEX["cs"]] &= _U32
        registers[amd64.REGISTER_INDEX["ss"]] &= _U32
        self.regs = registers + self.regs[len(registers):]  # ds, es, fs, gs: the hit's
        if registers[amd64.REGISTER_INDEX["cs"]] & 3 == 3:  # user_mode(regs)
            self.space = self.tracer.machine.cpu_space()
        return True

    def run(self, program: Program) -> EvalResult:
        """One expression action: what it traces while the level is below 8 is held, and the last of it
        printed once the expression ends."""
        ordinal, self._actions_run = self._actions_run, self._actions_run + 1
        self._held = []
        computed = _computed(program) if self.level < 8 else None
        result = evaluate(computed or program, self)
        held, self._held = self._held, []
        if result.error is not None:
            return result
        try:
            if held:
                self._print(_last_traced(held), ordinal)
            elif computed is not None:  # nothing traced: the value the expression computed
                self._print_value(result.value.to_bytes(8, "little"), f"{result.value:#x}", ordinal)
                return EvalResult(None, steps=result.steps)
        except PrintkError as error:
            return EvalResult(None, EvalError(ErrorCode.NONE, 0, f"direct output: $printk_{error}"))
        if not held and self.level >= 8 and _is_collect(program):
            self._recorded_collects += 1
        return result

    def finish(self) -> bool:
        """GDB merges the registers of every collect into one `R` action, sent first: when every collect that
        ran printed (none recorded, not even a register variable's, whose `X` is empty), they go too. A hit
        that printed and recorded nothing makes no frame."""
        if self.printed and not self._recorded_collects:
            self.blocks = [block for block in self.blocks if block[:1] not in (b"R", b"r")]  # full or compact
        return bool(self.blocks) or not self.printed

    # ---- the agent context ------------------------------------------------------------------------------

    def tsv_get(self, n: int) -> int:
        if n == CURRENT:
            return self._current or 0  # the struct pt_regs the hit's registers come from
        return super().tsv_get(n)

    def tsv_set(self, n: int, value: int) -> None:
        if n == PRINTK_LEVEL:
            self.level = value & _U32
        elif n == PRINTK_FORMAT:
            self.format = value & _U32
        elif n in (ENABLE, DISABLE):
            switch(self.tracer, self.tracepoint, value & _U64, n == ENABLE)
        elif n == CURRENT:
            self._current = value & _U64
        else:
            super().tsv_set(n, value)

    def trace_room(self) -> int | None:
        return None if self.level < 8 else super().trace_room()

    def trace_block(self, block: bytes) -> None:
        if self.level < 8:
            self._held.append(block)
        else:
            super().trace_block(block)

    # ---- printing ---------------------------------------------------------------------------------------

    def _print(self, block: bytes, ordinal: int) -> None:
        assert self.plan is not None
        if block[:1] == b"V":
            number, value = struct.unpack_from("<iq", block, 1)
            data, traced = (value & _U64).to_bytes(8, "little"), f"${self.plan.variables.get(number, number)}"
        else:
            address, length = struct.unpack_from("<QH", block, 1)
            data, traced = block[11:11 + length], f"*{address:#x}@{length}"
        self._print_value(data, traced, ordinal)

    def _print_value(self, data: bytes, traced: str, ordinal: int) -> None:
        """One line: the expression's text (or `traced`, what was traced) and `data` in `$printk_format`."""
        assert self.plan is not None
        value = render(self.format, data)
        names = self.plan.names
        name = names.by_action[ordinal] if ordinal < len(names.by_action) else None
        if name is None and self._names_used < len(names.in_turn):
            name = names.in_turn[self._names_used]
            self._names_used += 1
        line = f"<{self.level}>CPU{smp.cpu_number(self.uc)} {self.plan.header}{name or traced}=".encode() + value + b"\n"
        kernel_print(self.tracer, line)
        self.printed = True

    def _fail(self, message: str, address: int | None = None) -> bool:
        assert self.tracepoint is not None
        self.tracer.check(EvalError(ErrorCode.NONE, 0, message, address), self.tracepoint)
        return False


def _is_collect(program: Program) -> bool:
    """A `collect` expression: it traces, or it is empty (a register variable: GDB put its register in `R`)."""
    return any(insn.op.cls is OpClass.TRACE for insn in program.insns) or len(program.insns) == 1


def _computed(program: Program) -> Program | None:
    """A `collect` of an expression that reads only registers and constants (`counter1 + 0` of a register
    variable: GDB's bytecode computes the value, then `pop`s it, tracing nothing, the registers going in the `R`
    action): the same bytecode keeping the value for `end`, which direct output prints. None for anything else.
    gtp.c prints nothing for such an expression (it prints the last value traced, and there is none); printing
    the value is what the user asked for and costs nothing else."""
    insns = program.insns
    if len(insns) < 3 or insns[-1].name != "end" or insns[-2].name != "pop" or program.jump_targets or \
            any(insn.op.cls is OpClass.TRACE for insn in insns) or insns[-2].offset != len(program.code) - 2:
        return None
    return _keeping_value(program.code)


@functools.lru_cache(maxsize=256)
def _keeping_value(code: bytes) -> Program | None:
    try:
        return verify(code[:-2] + code[-1:], require_value=True)
    except BytecodeError:  # not one whose value can be kept: printed as gtp.c would (nothing)
        return None


def _last_traced(held: list[bytes]) -> bytes:
    """The first block of the last thing traced (a range over 65535 bytes comes as consecutive blocks)."""
    at = len(held) - 1
    while at > 0 and held[at][:1] == held[at - 1][:1] == b"M":
        previous, length = struct.unpack_from("<QH", held[at - 1], 1)
        if length != 0xFFFF or (previous + length) & _U64 != struct.unpack_from("<Q", held[at], 1)[0]:
            break
        at -= 1
    return held[at]


def switch(tracer: Run, setter: t.Tracepoint | None, number: int, enable: bool) -> None:
    """`$enable`/`$disable` = number: every location of tracepoint `number` (0: all but the setter's), from the
    next hit on. Runs inside a hit, which never raises: a location that cannot go back in is logged."""
    mine = setter.number if setter is not None else None
    what = "$enable" if enable else "$disable"
    for tp in list(tracer.definitions.tracepoints.values()):
        if not (tp.number == number or (number == 0 and tp.number != mine)):
            continue
        if tp.enabled == enable and tracer.is_armed(tp.key) == enable:
            continue
        tp.enabled = enable
        try:
            if enable:
                tracer.arm(tp)
            else:
                tracer.disarm(tp.key)
        except Exception as error:  # noqa: BLE001 (a hit never raises)
            log.warning("tracepoint %s: %s of tracepoint %d at %#x failed: %s", mine, what, tp.number, tp.address,
                        error)
            continue
        log.info("tracepoint %s: %s tracepoint %d at %#x", mine, what, tp.number, tp.address)


# ---- $dump_stack ---------------------------------------------------------------------------------------------


def dump_stack(ctx, dwarf) -> None:
    """KGTP prints `CPU0 gtp 1 ffffffff81001110:` and then Linux's dump_stack() follows: the task, then the
    call trace, one `[<address>] function+offset/size` a line (here unwound with the kernel's CFI)."""
    machine = ctx.machine
    image = machine.image
    hit = ctx.hit
    regs = dict(zip((r.name for r in amd64.GENERAL_REGISTERS[:17]), hit.regs[:17]))

    def read(address: int, length: int) -> bytes | None:
        try:
            return bytes(machine.read_memory(address, length))
        except Exception:  # noqa: BLE001 (an unreadable word ends the walk)
            return None

    tp = hit.tracepoint
    task = ctx.current_task()
    pid = int.from_bytes(read(task, 4) or bytes(4), "little", signed=True)
    comm_at = dwarf.task_comm_offset() or 4  # task_struct.comm
    comm = (read(task + comm_at, 16) or b"").split(b"\0", 1)[0].decode("latin-1")
    header = f"gtp {tp.number} {tp.address & _U64:016x}:" if tp is not None else f"gtp 0 {regs['rip']:016x}:"
    cpu = smp.cpu_number(ctx.uc)
    lines = [f"CPU{cpu} {header}CPU: {cpu} PID: {pid} Comm: {comm} Not tainted", "Call Trace:"]
    for pc in dwarf.unwind(regs, read):
        bounds = image.function_bounds(pc)
        if bounds is not None:
            name, low, high = bounds
            where = f"{name}+{pc - low:#x}/{high - low:#x}"
        else:
            symbol = dwarf.symbolize(pc)
            where = f"{symbol[0]}+{symbol[1]:#x}" if symbol else "?"
        lines.append(f" [<{pc:016x}>] {where}")
    text = "\n".join(lines) + "\n"
    kernel_print(ctx.tracer, text.encode())
    ctx.tracer.printed.append(text)
