"""Return probes (`$kret`): a tracepoint that fires when its function returns, as KGTP's kretprobes.

What KGTP does (gtp.c, 20140510): an action that sets `$kret` marks its tracepoint as a kretprobe and is itself
dropped (it is a flag, it never runs); the tracepoint then does nothing visible at the function's entry, and its
condition and remaining actions run when the function returns, on the registers of the return, with the PC of
the original return address in the frame. It must be placed on a function's first address (`trace *FUNCTION`).
KGTP refuses `$kret` in a condition, with while-stepping, and in a run where any tracepoint steps. All of that
holds here; what this module adds is how the simulated machine catches the return.

**Entry.** The location gets an int3 handled in Python, under every engine (`installer.ProbeSet` treats it as a
location that needs Python, so one int3 serves it and any tracepoint sharing its address, and the entry costs
what a kprobe's pre-handler costs; the return hijack dominates anyway). At the function's first instruction the
return address is at [%rsp]. That stack slot's address identifies the call: each task has its own stack and a
slot holds one live return address, so nested and recursive calls, task switches inside the function and tail
calls from one probed function into another never mix. The handler records an instance (the slot, the original
return address, the entry's argument registers) and writes a trampoline's address into the slot. A location
keeps at most `maxactive` instances pending (kretprobes' default on one CPU: 10; KGTP leaves `$kret`'s value
unused, here `teval $kret = N` with a constant N > 0 sets it); an entry beyond that is a miss, counted and
shown by `monitor probes`, and that call is not hijacked.

**Trampolines.** One per (location, original return address R), taken from a pool of `POOL_SLOTS` slots of
module space the location allocates when it is installed (a function has few callers):

    int3                    the return hit, in Python; becomes a nop when the location is removed
    push %rax
    movabs $R, %rax
    xchg %rax, (%rsp)       the dead slot holds R again, %rax is back
    ret                     to R, %rsp as the function's own `ret` left it; flags untouched

The return hit looks the instance up by slot (%rsp - 8), runs the condition and actions on the registers the
function's `ret` left (PC = R, as KGTP reports `ri->ret_addr`), then resumes after the int3. The code after the
int3 puts R back into the slot, so after the return no stack word points at the trampoline any more. Expressions
(the condition, `collect`, `teval`) that read an argument register (%rdi %rsi %rdx %rcx %r8 %r9) read its value
at the function's entry: GDB compiles a tracepoint's expressions in the scope of its address, the function's
first instruction, where the arguments live in those registers, so `collect regs->orig_ax` at `trace *do_syscall`
reads the argument; the frame's register block is the return's, exactly (`$rax` the return value).

**Stopping.** When the location is removed (tstop, a pass count, QTDisable) its trampolines' int3s become nops
and the pool is retired (`retire.RetiredCode`), so returns still pending go on to their callers natively, with
no Python and no hit, and the pool is freed only once no word of the kernel's stacks points into it: the
kernel never returns into freed memory.

**What GDB sees.** A return frame's PC is the caller's instruction after the call, so `bt` unwinds from the
caller as if nothing had been hijacked. Stack memory collected while other hijacks are pending (an outer call of
the same function, or any other return probe) holds trampoline addresses: `visible()` shows each trampoline's
original return address instead, at 8-byte aligned words of every frame GDB reads (tfind, tsave, the follow
channel), so GDB's backtraces never meet a trampoline. Live memory is shown as it is.

Threads: entries and returns run on the CPU thread, inside hits; `visible()` is pure and runs wherever frames
are read (the server and follow threads).
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass, field, replace

from unicorn import Uc
from unicorn.x86_const import UC_X86_REG_RIP

from ...agent.verify import Program
from ...arch import amd64
from ..core import model as t
from ..core.builtins import BUILTIN_VARIABLES
from ..core.frames import MemoryBlock, TraceFrame
from ..core.model import TraceError
from ..core.run import Run
from ..engines.hits import HitContext, record_hit
from ..patching.placement import Installed
from ..patching.probes import INT3, plan_probe


log = logging.getLogger(__name__)

KRET = BUILTIN_VARIABLES.by_name("kret").number
#: kretprobes' default `maxactive` on a preemptible kernel with one CPU: max(10, 2 * CPUs).
MAXACTIVE = 10
#: `teval $kret = N` sets maxactive up to this.
MAX_MAXACTIVE = 4096
#: Trampolines per location: one per distinct return address seen during the run.
POOL_SLOTS = 64
SLOT_BYTES = 0x20
POOL_BYTES = POOL_SLOTS * SLOT_BYTES
#: GDB's numbers of the SysV argument registers: rdi rsi rdx rcx r8 r9.
ARGUMENT_REGNUMS = (5, 4, 3, 2, 8, 9)
_RSP = amd64.SP_REGNUM
_PC = amd64.PC_REGNUM
_EFLAGS = amd64.REGISTER_INDEX["eflags"]
_NOP = b"\x90"
_QWORD = struct.Struct("<Q")


def trampoline_code(original: int) -> bytes:
    """int3; push %rax; movabs $original, %rax; xchg %rax, (%rsp); ret (padded with int3)."""
    code = INT3 + b"\x50" + b"\x48\xb8" + _QWORD.pack(original) + b"\x48\x87\x04\x24" + b"\xc3"
    return code.ljust(SLOT_BYTES, INT3)


def sets_kret(program: Program) -> bool:
    return any(insn.name == "setv" and insn.operands[0] == KRET for insn in program.insns)


def constant_setting(program: Program) -> int:
    """N of `teval $kret = N` when N is a constant (GDB 13: `const8 N; setv 0x11; end`), else 0."""
    insns = program.insns
    for index, insn in enumerate(insns):
        if insn.name != "setv" or insn.operands[0] != KRET:
            continue
        before = index - 1
        while before >= 0 and insns[before].name in ("ext", "zero_ext"):
            before -= 1
        if before >= 0 and insns[before].name.startswith("const"):
            return insns[before].operands[0]
    return 0


@dataclass
class Instance:
    """One pending call: the word written into its slot, the word it replaced, the entry's argument registers."""

    trampoline: int
    original: int
    arguments: dict[int, int]


@dataclass(eq=False)  # compared by identity: it and its location refer to each other
class KretProbe:
    """The return side of one location: its trampolines, its pending calls, its figures."""

    maxactive: int = MAXACTIVE
    item: Installed | None = None
    pool: int = 0
    armed: bool = False
    trampolines: dict[int, int] = field(default_factory=dict)  # original return address -> trampoline
    pending: dict[int, list[Instance]] = field(default_factory=dict)  # slot -> instances (tail re-entry: more)
    count: int = 0  # instances pending
    entered: int = 0
    missed: int = 0  # entries not hijacked: maxactive reached, or no trampoline left
    abandoned: int = 0  # instances whose slot was reused by a later call: their return never came
    left: int = 0  # instances pending when the location was removed (they return natively, untraced)


@dataclass
class ReturnHit(HitContext):
    """A return hit: registers of the return, except that expressions read argument registers as at the entry."""

    arguments: dict[int, int] = field(default_factory=dict)

    def register(self, n: int) -> int:
        value = self.arguments.get(n)
        return super().register(n) if value is None else value


class KretRun:
    """The tracer's return probes: planning at tstart, the entry and return hits, removal, and GDB's view."""

    def __init__(self, tracer: Run) -> None:
        self.tracer = tracer
        self.machine = tracer.machine
        #: trampoline -> the return address it stands for, for every pool not yet freed (frames of the run may
        #: hold them); one trampoline may stand for another's (two return probes on one call)
        self.display: dict[int, int] = {}
        self._pools: dict[int, list[int]] = {}  # pool -> its trampolines

    # ---- tstart --------------------------------------------------------------------------------------------

    def prepare(self, item: Installed) -> Installed:
        """A location whose actions set `$kret` becomes a return probe: that action goes (KGTP drops it), the
        probe is an int3 at the function's first address. Raises TraceError where KGTP refuses."""
        tp = item.tracepoint
        where = f"tracepoint {tp.number} at {tp.address:#x}"
        if item.condition is not None and sets_kret(item.condition):
            raise TraceError(f"{where}: $kret cannot be set in a condition")
        if any(program is not None and sets_kret(program) for _, program in item.stepping):
            raise TraceError(f"{where}: $kret cannot be used with while-stepping")
        flags = [index for index, (_, program) in enumerate(item.actions) if program is not None and sets_kret(program)]
        if not flags:
            return item
        if tp.step_count:
            raise TraceError(f"{where}: $kret cannot be used with while-stepping")
        if tp.fast_insn_length is not None:
            raise TraceError(f"{where}: $kret needs a kprobe: use trace, not ftrace")
        if item.space is not None:
            raise TraceError(f"{where}: $kret is a return probe of a kernel function (KGTP's kretprobe): a "
                             "tracepoint in the program cannot set it")
        image = self.machine.image
        function = image.function_at(tp.address)
        if function is None or function.address != tp.address:
            raise TraceError(f"{where}: $kret needs the first address of a function (trace *FUNCTION)")
        setting = max(constant_setting(item.actions[i][1]) for i in flags)  # type: ignore[arg-type]
        item.actions = [pair for index, pair in enumerate(item.actions) if index not in flags]
        if item.site.kind != "int3":
            item.site = plan_probe(image, tp.address, "int3")
        item.want_jump = False
        item.kret = KretProbe(maxactive=min(setting, MAX_MAXACTIVE) if setting > 0 else MAXACTIVE)
        return item

    def start(self, items: list[Installed]) -> None:
        """tstart: KGTP refuses return probes in a run that single-steps; forget pools freed since."""
        self._check(items)
        alive = {low for low, _ in self.tracer.retired.regions}
        for pool in [pool for pool in self._pools if pool not in alive]:
            for trampoline in self._pools.pop(pool):
                self.display.pop(trampoline, None)

    def admit(self, item: Installed, armed: list[Installed]) -> None:
        """A location armed during a run: the same rule against the locations already armed."""
        if item.kret is not None or item.tracepoint.step_count:
            self._check([item] + [i for i in armed if (i.kret is None) == (item.kret is not None)])

    @staticmethod
    def _check(items: list[Installed]) -> None:
        kret = next((i for i in items if i.kret is not None), None)
        stepping = next((i for i in items if i.tracepoint.step_count), None)
        if kret is not None and stepping is not None:
            raise TraceError(f"tracepoint {kret.tracepoint.number}: $kret cannot be used in a run with "
                             f"while-stepping (tracepoint {stepping.tracepoint.number}), as in KGTP")

    def install(self, item: Installed) -> None:
        """Before the site is patched: the location's trampoline pool."""
        probe = item.kret
        probe.item = item
        probe.pool = self.machine.alloc_code(POOL_BYTES)
        self._pools[probe.pool] = []
        probe.armed = True

    # ---- the entry: hijack the return address (CPU thread, in the int3 hook) -------------------------------------

    def enter(self, tracer: Run, uc: Uc, item: Installed) -> None:
        uc.reg_write(UC_X86_REG_RIP, item.out_of_line)  # whatever happens, the function runs on
        probe: KretProbe = item.kret
        if not tracer.running or not probe.armed:
            return
        regs = tracer.registers.read(uc)
        slot = regs[_RSP]
        word = _QWORD.unpack(bytes(uc.mem_read(slot, 8)))[0]
        probe.entered += 1
        stack = probe.pending.get(slot)
        if stack and stack[-1].trampoline not in self._chain(word):  # that call's frame is gone
            probe.abandoned += len(stack)
            probe.count -= len(stack)
            del probe.pending[slot]
        if probe.count >= probe.maxactive:
            probe.missed += 1
            return
        trampoline = self._trampoline(probe, word)
        if trampoline is None:
            probe.missed += 1
            return
        uc.mem_write(slot, _QWORD.pack(trampoline))
        probe.pending.setdefault(slot, []).append(
            Instance(trampoline, word, {n: regs[n] for n in ARGUMENT_REGNUMS}))
        probe.count += 1

    def _trampoline(self, probe: KretProbe, original: int) -> int | None:
        trampoline = probe.trampolines.get(original)
        if trampoline is not None:
            return trampoline
        if len(probe.trampolines) >= POOL_SLOTS:
            return None
        trampoline = probe.pool + SLOT_BYTES * len(probe.trampolines)
        self.machine.write_memory(trampoline, trampoline_code(original))  # never run before: nothing translated
        self.machine.breakpoints[trampoline] = lambda uc, probe=probe, at=trampoline: self._return(uc, probe, at)
        probe.trampolines[original] = trampoline
        self._pools[probe.pool].append(trampoline)
        self.display[trampoline] = original
        return trampoline

    def _chain(self, word: int) -> list[int]:
        return _chain(self.display, word)

    def resolve(self, word: int) -> int:
        """The return address a word of a stack stands for (itself, when it is no trampoline)."""
        return _chain(self.display, word)[-1]

    # ---- the return (CPU thread, in the trampoline's int3 hook) ------------------------------------------------

    def _return(self, uc: Uc, probe: KretProbe, trampoline: int) -> None:
        uc.reg_write(UC_X86_REG_RIP, trampoline + len(INT3))  # on to the original return address, natively
        tracer = self.tracer
        regs = tracer.registers.read(uc)
        slot = regs[_RSP] - 8
        stack = probe.pending.get(slot)
        if not stack or stack[-1].trampoline != trampoline:
            return  # not a call this location still counts as pending (abandoned, or removed meanwhile)
        instance = stack.pop()
        if not stack:
            del probe.pending[slot]
        probe.count -= 1
        item = probe.item
        if not tracer.running or not probe.armed or item is None:
            return
        tracer.kgtp.timed(lambda: self._hit(uc, item, instance, regs))

    def _hit(self, uc: Uc, item: Installed, instance: Instance, regs: list[int]) -> None:
        """As `hits.interpreted_hit`, at the return: condition, actions, a frame, the pass count."""
        tracer = self.tracer
        regs[_PC] = self.resolve(instance.original)
        regs[_EFLAGS] &= 0xFFFFFFFF
        item.fired += 1
        tp = item.tracepoint
        hit = ReturnHit(uc, regs, tracer, room=tracer.room, tracepoint=tp, arguments=instance.arguments)
        if record_hit(tracer, hit, item):
            tracer.stop(t.StopReason.PASSCOUNT, tracepoint=tp.number)

    # ---- removal ---------------------------------------------------------------------------------------------

    def remove(self, item: Installed) -> None:
        """The location goes (CPU thread, no hit in flight): pending returns go on natively through their
        trampolines, now starting with a nop; the pool waits in `retired` until no stack points into it."""
        probe: KretProbe = item.kret
        if not probe.armed:
            return
        probe.armed = False
        if probe.count:
            log.info("tracepoint %d: %d calls in flight return untraced", item.tracepoint.number, probe.count)
        probe.left += probe.count
        probe.pending.clear()
        probe.count = 0
        for trampoline in probe.trampolines.values():
            self.machine.write_memory(trampoline, _NOP)
            self.machine.breakpoints.pop(trampoline, None)
        self.tracer.retired.add([(probe.pool, probe.pool + POOL_BYTES)])

    # ---- what GDB reads ----------------------------------------------------------------------------------------

    def visible(self, frames: list[TraceFrame]) -> list[TraceFrame]:
        """Frames as GDB should read them: in collected memory, each 8-byte aligned word holding a trampoline's
        address shows the return address it stands for."""
        display = dict(self.display)  # one snapshot: the CPU thread adds trampolines meanwhile
        if not display:
            return frames
        words = [(_QWORD.pack(trampoline), _QWORD.pack(_resolve(display, trampoline))) for trampoline in display]
        out = []
        for frame in frames:
            blocks = tuple(_shown(block, words) if isinstance(block, MemoryBlock) else block
                           for block in frame.blocks)
            changed = any(new is not old for new, old in zip(blocks, frame.blocks))
            out.append(replace(frame, blocks=blocks) if changed else frame)
        return out

    def describe(self, item: Installed, function: str) -> str:
        """`monitor probes`' last column for a return probe."""
        probe: KretProbe = item.kret
        text = (f"{function}, return probe: {probe.entered} entered, {probe.count} pending, {probe.missed} missed "
                f"(maxactive {probe.maxactive})")
        if probe.abandoned:
            text += f", {probe.abandoned} abandoned"
        if probe.left:
            text += f", {probe.left} pending at removal (they return untraced)"
        return text


def _chain(display: dict[int, int], word: int) -> list[int]:
    """`word` and, while it is a trampoline, the word it stands for, and so on (a return probe's trampoline may
    stand for another's, when two return probes caught one call)."""
    chain = [word]
    while word in display and len(chain) <= len(display):
        word = display[word]
        chain.append(word)
    return chain


def _resolve(display: dict[int, int], word: int) -> int:
    return _chain(display, word)[-1]


def _shown(block: MemoryBlock, words: list[tuple[bytes, bytes]]) -> MemoryBlock:
    data = block.data
    patched: bytearray | None = None
    for hidden, shown in words:
        at = data.find(hidden)
        while at >= 0:
            if (block.address + at) % 8 == 0:
                if patched is None:
                    patched = bytearray(data)
                patched[at : at + 8] = shown
            at = data.find(hidden, at + 1)
    return block if patched is None else MemoryBlock(block.address, bytes(patched))
