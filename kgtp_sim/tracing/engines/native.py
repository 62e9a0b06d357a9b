"""Installing compiled probes: code placement, the jump patch and its safety check, hypercalls, fault fixups.

Patching a 5-byte jump over several instructions is only safe when no task can resume inside them. The kernel is
preemptive, so a task may sit interrupted anywhere: before patching, with the CPU stopped between two
instructions, we check the current RIP and scan the kernel's writable memory (where every task stack and saved
register frame lives) for a return address inside the window. If one is found the site gets an int3 into the
same detour instead, which is always safe. Detour memory is likewise never reused while a stack may still point
into it (retire.py).

Runs on the CPU thread: building and patching happen inside a run change (`Tracer._between_hits`), the
detours' hypercalls inside a hit; the variable array is read and written through the machine's coherent
memory access, from the server thread too (qTv).
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass, field, replace

from unicorn import Uc

from ...agent import abi
from ...agent.blocks import MEMORY_BLOCK_OVERHEAD, TSV_BLOCK_SIZE
from ...agent.compile_naive import compile_naive
from ...agent.compile_opt import compile_opt
from ...agent.compiled import CompiledExpr, fault_fixup
from ...agent.interp import DEFAULT_LOOP_BUDGET
from ...agent.opcodes import OpClass
from ...agent.verify import Program
from ...arch import amd64
from ...machine import FieldKind, Machine
from ..core import model as t
from ..core.builtins import BUILTIN_VARIABLES
from ..core.frames import ALL_GENERAL, compact_mask
from ..core.sdata import SdataError, argument_register
from ..patching import detour as d
from ..patching import fastpath
from ..patching.probes import INT3, JUMP_SIZE, ProbeSite, jump, relocate, relocated_size_bound
from ..patching.retire import in_use
from ..patching.userpad import PadCondition

log = logging.getLogger(__name__)


def faults_lose_a_block(program: Program) -> bool:
    """An action that only *traces* memory (no `ref`) cannot need what it failed to read: a memory fault then
    loses that block (GDB shows <unavailable>, like a DProbes fault token) instead of stopping the run. Any
    `ref` makes a fault an error: the value the expression needed does not exist. Same rule in every engine."""
    return not any(insn.op.cls is OpClass.MEMORY for insn in program.insns)


def traced_bytes_bound(program: Program) -> int | None:
    """The most bytes of blocks one evaluation can add to a frame, or None when only the frame's room bounds it
    (`trace`/`tracenz` of a computed length, or a loop that may trace again).

    A compiled hit reserves its frame before it runs, and in a circular buffer every reserved byte is evicted
    first: reserving the whole frame room (half the ring) for `teval` or a register expression that traces a
    few bytes at most would leave one frame in the buffer right after each lap."""
    traces = [i for i, insn in enumerate(program.insns) if insn.op.cls is OpClass.TRACE]
    if traces and program.backward_jumps:
        return None
    total = 0
    for i in traces:
        insn = program.insns[i]
        if insn.name in ("trace_quick", "trace16"):
            total += MEMORY_BLOCK_OVERHEAD + insn.operands[0]
        elif insn.name == "tracev":
            total += TSV_BLOCK_SIZE
        elif (length := _constant_length(program, i)) is not None:  # GDB's `const16 176; trace` (struct, array)
            total += MEMORY_BLOCK_OVERHEAD + length
        else:
            return None
    return total


def _constant_length(program: Program, index: int) -> int | None:
    """The length a `trace`/`tracenz` at insns[index] pops, when the instruction before pushed a constant and
    no jump lands on the trace (so that constant is what it pops)."""
    insn = program.insns[index]
    previous = program.insns[index - 1] if index else None
    if previous is None or not previous.name.startswith("const") or insn.offset in program.jump_targets:
        return None
    return previous.operands[0]


def sdata_in_place(marker) -> d.SdataPlan | None:
    """The marker's entry as generated code can build it, or None when a field needs memory (LOAD, ARRAY,
    STRING: a read that may fault, left to the hypercall, which zero-fills what it cannot read)."""
    fields = []
    for entry_field in marker.fields:
        if entry_field.kind is not FieldKind.VALUE or entry_field.size not in (1, 2, 4, 8):
            return None
        try:
            number, width = argument_register(marker.arg_locations[entry_field.arg])
        except SdataError:
            return None
        fields.append((entry_field.offset, entry_field.size, amd64.OFFSETS[number], width))
    return d.SdataPlan(marker.entry_size, tuple(fields))


ENGINES = ("interp", "naive", "opt")
#: `jmp *0x0(%rip)`: an absolute jump through the quadword that follows it.
_LINK = bytes.fromhex("ff2500000000")
COMPUTED_BUILTINS = {b.number for b in BUILTIN_VARIABLES if b.computed}
#: Where code is assembled once to learn its size before space is allocated (any module-space address will do:
#: only the length is kept).
_TRIAL_BASE = 0xFFFFFFFFA0000000


@dataclass
class NativeProbe:
    """What one compiled location put into the machine."""

    kind: str  # "jump" or "int3"
    detour: d.Detour
    counters: int
    compiled: list[CompiledExpr]
    regions: list[int] = field(default_factory=list)  # code allocations, retired when removed


@dataclass
class CompiledRun:
    """Per-run shared state in emulated memory: ring routines, the agent context and the TSV array."""

    machine: Machine
    engine: str
    ring_ctl: int  # the per-CPU rings' control area (ring.py)
    tsv_slots: int
    cpus: int = 1
    #: one ring for every CPU (ring.py's `shared`, the gdbserver role's buffer): the ring routines write it, and
    #: no detour takes the short path (it writes the hitting CPU's ring in place)
    shared_ring: bool = False

    def __post_init__(self) -> None:
        machine = self.machine
        size = len(d.Runtime.build(_TRIAL_BASE, self.ring_ctl, self.shared_ring).code)
        base = machine.alloc_code(size)
        self.runtime = d.Runtime.build(base, self.ring_ctl, self.shared_ring)
        machine.write_memory(base, self.runtime.code)
        self.ctx = machine.alloc_data(abi.CTX_SIZE + 8 * self.tsv_slots)
        self.tsv_array = self.ctx + abi.CTX_SIZE
        self.code_regions = [(base, base + size)]
        #: where kernel instructions run displaced (detour tails, shared tails): inside `code_regions`, but the
        #: kernel's accesses, not the tracer's (watch.py)
        self.displaced: list[tuple[int, int]] = []

    def reset(self, initial: dict[int, int]) -> None:
        context = abi.AgentCtx(tsv_base=self.tsv_array, loop_budget=DEFAULT_LOOP_BUDGET)
        values = [initial.get(n, 0) & (2**64 - 1) for n in range(self.tsv_slots)]
        self.machine.write_memory(self.ctx, context.pack() + struct.pack(f"<{self.tsv_slots}Q", *values))

    def read_tsv(self, number: int) -> int:
        raw = self.machine.read_memory(self.tsv_array + 8 * number, 8)
        return struct.unpack("<q", raw)[0]

    def write_tsv(self, number: int, value: int) -> None:
        """The one store of this run's variables: a Python hit (int3 of a shared address, while-stepping) writes
        where the compiled detours read. Data, not code: no translated block to drop."""
        data = struct.pack("<Q", value & (2**64 - 1))
        self.machine.run_on_cpu(lambda uc: uc.mem_write(self.tsv_array + 8 * number, data))

    def counters(self, probe: NativeProbe) -> tuple[int, int, int]:
        fired, hits, usage, _ = d.COUNTERS.unpack(self.machine.read_memory(probe.counters, d.COUNTERS.size))
        return fired, hits, usage

    # ---- building ---------------------------------------------------------------------------------------

    def _compile(self, program: Program) -> CompiledExpr:
        compiler = compile_opt if self.engine == "opt" else compile_naive
        trial = compiler(program, _TRIAL_BASE)
        base = self.machine.alloc_code(len(trial.code) + 16)
        compiled = compiler(program, base)
        assert len(compiled.code) <= len(trial.code) + 16
        self.machine.write_memory(base, compiled.code)
        self._fault_fixup(compiled)
        return compiled

    def _fault_fixup(self, compiled: CompiledExpr) -> None:
        self.machine.fault_fixups.add(
            compiled.base, compiled.end,
            lambda uc, address, compiled=compiled: fault_fixup(uc, compiled, self.ctx, address),
        )

    def build(
        self,
        site: ProbeSite,
        number: int,
        condition: Program | None,
        actions: list[tuple[t.Action, Program | None]],
        pass_count: int,
        builtin_slots: tuple[tuple[int, str], ...],
        verify,
        marker=None,
        frame_room: int = 0x1000,
        continue_to: int | None = None,
        from_user: bool = False,
    ) -> NativeProbe:
        """Compile a location's condition and actions and assemble its detour. The detour ends with the site's
        displaced instructions and a jump back, or, with `continue_to` (a location sharing its address with
        others), with a jump there: the next location's detour, or the shared tail (`chain_link`). `from_user`: a
        program's location, entered through a call gate from its pad and going back there (detour.DetourPlan's
        `from_user`; the pad runs the displaced instruction and the false condition: `pad_condition`)."""
        compiled: list[CompiledExpr] = []
        cond_entry = None
        if condition is not None:
            compiled.append(self._compile(condition))
            cond_entry = compiled[-1].entry
        gdb_mask = 0
        silent_builtins = {number for number, _ in builtin_slots} | COMPUTED_BUILTINS
        entries: list[tuple[int | None, bool, bool]] = []
        max_frame = 0
        for action, program in actions:
            if isinstance(action, t.CollectRegisters):
                gdb_mask |= action.mask  # GDB sends one per action list; several would share one block
                continue
            if isinstance(action, t.CollectMemory):
                program = verify(d.collect_memory_bytecode(action.basereg, action.offset, action.length))
                max_frame += 11 + min(action.length, 0xFFFF)
            elif isinstance(action, t.EvalExpression):
                if self.engine == "opt" and fastpath.silent(program, silent_builtins):
                    continue
                bound = traced_bytes_bound(program)
                max_frame += frame_room if bound is None else bound  # the room: what the interpreter allows
            elif isinstance(action, t.CollectStaticData) and marker is not None:
                # built in place when every field is a register value; else a hypercall builds it (Python)
                entries.append((sdata_in_place(marker), False, False))
                max_frame += 3 + marker.entry_size
                continue
            else:
                continue
            compiled.append(self._compile(program))
            entries.append((compiled[-1].entry, isinstance(action, t.CollectMemory) or faults_lose_a_block(program),
                            bool(program.backward_jumps)))
        register_mask = compact_mask(gdb_mask) if any(isinstance(a, t.CollectRegisters) for a, _ in actions) else 0
        max_frame += d.register_bytes(register_mask)
        plan = d.DetourPlan(
            site.address, number, self.ctx, self.runtime, cond_entry, register_mask,
            tuple(entries), max(min(max_frame, frame_room), 8), pass_count, builtin_slots,
            condition_loops=condition is not None and bool(condition.backward_jumps),
            loop_budget=DEFAULT_LOOP_BUDGET,
            reads_segments=any(
                insn.name == "reg" and insn.operands[0] >= amd64.REGISTER_INDEX["cs"]
                for program in ([condition] if condition else []) + [p for _, p in actions if p]
                for insn in program.insns
            ),
        )
        fast = self._fast_path(condition, compiled[0] if condition is not None and not from_user else None, site,
                               builtin_slots, flags_recorded=bool(register_mask >> amd64.REGISTER_INDEX["eflags"] & 1)
                               or plan.reads_segments or any(
                                   insn.name == "reg" and insn.operands[0] == amd64.REGISTER_INDEX["eflags"]
                                   for program in [p for _, p in actions if p] for insn in program.insns))
        # the short path: a frame of registers and register-built `$_sdata` only, after a condition known true (a
        # fast path that may fail leaves the error to the full path), nothing that could fail, count or call
        lean = (self.engine == "opt" and not self.shared_ring and not from_user and register_mask != ALL_GENERAL
                and bool(register_mask or entries)
                and all(isinstance(entry, d.SdataPlan) for entry, _, _ in entries) and not pass_count
                and not builtin_slots and (condition is None or (fast is not None and not fast.can_fail)))
        plan = replace(plan, ring_ctl=self.ring_ctl, lean=lean, from_user=from_user)
        tail_bound = 0 if from_user else relocated_size_bound(site.displaced) + JUMP_SIZE
        if fast is not None:
            plan = replace(plan, fast=fast)
            # nops hold the tail's place: build finds its hypercalls by decoding, and zeros (`add %al, (%rax)`,
            # two bytes) can leave the decoder out of step past an odd-sized tail
            trial = d.build(replace(plan, fast=replace(fast, tail=b"\x90" * tail_bound)), _TRIAL_BASE)
            base = self._alloc_detour(len(trial.code) + 16)
            tail_at = base + d.fast_path_offset(plan, base, "tail")
            tail = self._tail(site, tail_at, continue_to)
            if fast.inline is not None:  # the condition's branch, linked where it goes, to fast_slow after the tail
                inline_at = base + d.fast_path_offset(plan, base, "inline")
                branch = compile_opt(condition, inline_at, fastpath.regnums_read(condition), pointerless=True,
                                     true_exit=tail_at + len(tail))
                assert len(branch.code) == len(fast.inline)
                fast = replace(fast, inline=branch.code)
            built = d.build(replace(plan, fast=replace(fast, tail=tail), fast_tail_address=tail_at), base)
            code = built.code
            end = base + len(code)
        else:
            trial = d.build(plan, _TRIAL_BASE)
            base = self._alloc_detour(len(trial.code) + 16 + tail_bound)
            built = d.build(plan, base)
            tail_at = base + len(built.code)
            tail = b"" if from_user else self._tail(site, tail_at, continue_to)
            code = built.code + tail
            end = tail_at + len(tail)
        self.machine.write_memory(base, code)
        regions = [c.base for c in compiled] + [base]
        self.code_regions += [(c.base, c.end) for c in compiled] + [(base, end)]
        if continue_to is None and not from_user:
            self.displaced.append((tail_at, tail_at + len(tail)))
        return NativeProbe("int3", built, built.counters, compiled, regions)

    def pad_condition(self, condition: Program | None, builtin_slots) -> PadCondition | None:
        """A program's false condition decided in its pad, in ring 3 (patching/userpad.py): for the optimizing
        engine, a pure condition on registers only that compiles without pointers (no memory, no variables, no
        context: fastpath.py's inline branch, the same as a kernel detour's). None: the detour decides."""
        if self.engine != "opt" or condition is None:
            return None
        if not fastpath.eligible(condition, {number for number, _ in builtin_slots} | COMPUTED_BUILTINS):
            return None
        regnums = fastpath.regnums_read(condition)
        try:
            branch = compile_opt(condition, _TRIAL_BASE, regnums, pointerless=True, true_exit=_TRIAL_BASE)
        except ValueError:
            return None
        written, _ = fastpath.code_registers(branch)
        order = [r.name for r in amd64.GENERAL_REGISTERS[:16]]
        return PadCondition(
            lambda at, true_exit: compile_opt(condition, at, regnums, pointerless=True, true_exit=true_exit).code,
            tuple(n for n in order if n in written))

    def _alloc_detour(self, length: int) -> int:
        """`length` bytes of detour (its counters' page first, detour.DATA_PAGE): that page is data, no-execute,
        and holds nothing of another allocation's code (Machine.alloc_code)."""
        return self.machine.alloc_code(length - d.DATA_PAGE, data_pages=d.DATA_PAGE // 0x1000)

    @staticmethod
    def _tail(site: ProbeSite, at: int, continue_to: int | None) -> bytes:
        if continue_to is not None:
            return jump(at, continue_to)
        tail = relocate(site.displaced, at)
        return tail + jump(at + len(tail), site.resume_address)

    # ---- several locations at one address: a chain of detours --------------------------------------------

    def chain_link(self, target: int) -> int:
        """A jump whose target can change while the kernel runs (`jmp *0(%rip)` and its 8-byte target): what the
        site and each detour of a chain jump to, so that a location joins or leaves the chain by rewriting one
        quadword, never code a task may be executing."""
        link = self.machine.alloc_code(len(_LINK) + 8)
        self.machine.write_memory(link, _LINK + struct.pack("<Q", target))
        self.code_regions.append((link, link + len(_LINK) + 8))
        return link

    def relink(self, link: int, target: int) -> None:
        data = struct.pack("<Q", target)
        self.machine.run_on_cpu(lambda uc: uc.mem_write(link + len(_LINK), data))  # data: nothing to re-translate

    @staticmethod
    def link_target(machine: Machine, link: int) -> int:
        return struct.unpack("<Q", machine.read_memory(link + len(_LINK), 8))[0]

    def shared_tail(self, site: ProbeSite) -> int:
        """The site's displaced instructions and the jump back, run once after the last detour of a chain."""
        at = self.machine.alloc_code(relocated_size_bound(site.displaced) + JUMP_SIZE)
        code = self._tail(site, at, None)
        self.machine.write_memory(at, code)
        self.code_regions.append((at, at + len(code)))
        self.displaced.append((at, at + len(code)))
        return at

    def _fast_path(self, condition, compiled: CompiledExpr | None, site, builtin_slots,
                   flags_recorded: bool) -> d.FastPath | None:
        """The false-condition fast path, for the optimizing engine and pure conditions (fastpath.py). When the
        condition compiles without pointers, it runs inline as a branch on the site's registers (`inline` holds a
        placeholder of its size here: `build` links it once the detour's layout is known)."""
        if self.engine != "opt" or condition is None or compiled is None:
            return None
        if not fastpath.eligible(condition, {number for number, _ in builtin_slots} | COMPUTED_BUILTINS):
            return None
        flags_live = fastpath.flags_live_at(site.displaced)
        order = [r.name for r in amd64.GENERAL_REGISTERS[:16]]
        try:
            branch = compile_opt(condition, _TRIAL_BASE, fastpath.regnums_read(condition), pointerless=True,
                                 true_exit=_TRIAL_BASE)
        except ValueError:
            pass  # it needs the block or the context: the fast path below stores what it reads
        else:
            written, _ = fastpath.code_registers(branch)
            return d.FastPath(stores=(), restores=tuple(n for n in order if n in written), needs_ctx=False,
                              can_fail=False, flags_live=flags_live, save_flags=flags_recorded, tail=b"",
                              inline=b"\x90" * len(branch.code))  # nops: the trial build decodes
        written, reads_rsi = fastpath.code_registers(compiled)
        clobbered = written | {"rdi"} | ({"rsi"} if reads_rsi else set())
        stores = fastpath.registers_read(condition) | clobbered
        return d.FastPath(
            stores=tuple(n for n in order if n in stores),
            restores=tuple(n for n in order if n in clobbered),
            needs_ctx=reads_rsi,
            can_fail=fastpath.can_fail(condition) or bool(condition.backward_jumps),
            flags_live=flags_live,
            save_flags=flags_recorded,
            tail=b"",
        )

    # ---- patching -----------------------------------------------------------------------------------------

    def patch(self, site: ProbeSite, probe: NativeProbe, want_jump: bool) -> str:
        """Send the site to the detour: a jump when safe right now, else an int3. Returns the kind used."""
        probe.kind = self.patch_to(site, probe.detour.base, want_jump)
        return probe.kind

    def patch_to(self, site: ProbeSite, target: int, want_jump: bool) -> str:
        """Send the site to `target` while every CPU may be running it, as Linux's text_poke_bp does: an int3 on
        the first byte (a CPU meeting it goes to `target` natively, cpu.InterruptDispatch), every CPU
        synchronised, the jump's tail written if no CPU is and no task will resume inside the window,
        synchronised, the first byte written. Without a free window the site stays an int3 probe."""
        machine = self.machine
        counters = machine.counters  # the machine's performance counters count what the patch stands for

        def to_int3(uc: Uc) -> None:
            self._poke_int3(uc, site.address, target)
            counters.stand_in(site.address, len(INT3), site.resume_address)

        machine.run_on_cpu(to_int3)
        if not (want_jump and site.kind == "jump"):
            return "int3"
        machine.synchronize()
        patch = jump(site.address, target).ljust(site.length, b"\x90")

        def tail(uc: Uc) -> bool:
            if not self._window_is_free(uc, site):
                return False
            self._poke(uc, site.address + 1, patch[1:])
            return True

        if not machine.run_on_cpu(tail):
            return "int3"
        machine.synchronize()

        def first(uc: Uc) -> None:
            self._poke_first(uc, site.address, patch[:1])
            counters.stand_in_removed(site.address, len(INT3))
            counters.stand_in(site.address, JUMP_SIZE, site.resume_address)

        machine.run_on_cpu(first)
        return "jump"

    def unpatch(self, site: ProbeSite, probe: NativeProbe) -> None:
        self.unpatch_site(site, probe.kind)
        self.release(probe)

    def unpatch_site(self, site: ProbeSite, kind: str) -> None:
        """Give the site its original bytes back while every CPU may be running it, text_poke_bp's way: an int3
        on the first byte that keeps sending CPUs where the jump did, synchronised, the original tail,
        synchronised, the original first byte."""
        machine = self.machine
        counters = machine.counters
        original = machine.image.read_code(site.address, site.length if kind == "jump" else 1)
        if kind == "jump":
            def to_int3(uc: Uc) -> None:
                rel32 = struct.unpack("<i", bytes(uc.mem_read(site.address + 1, 4)))[0]
                self._poke_int3(uc, site.address, (site.address + JUMP_SIZE + rel32) % (1 << 64))
                counters.stand_in_removed(site.address, JUMP_SIZE)
                counters.stand_in(site.address, len(INT3), site.resume_address)

            machine.run_on_cpu(to_int3)
            machine.synchronize()
            machine.run_on_cpu(lambda uc: self._poke(uc, site.address + 1, original[1:]))
            machine.synchronize()

        def restore(uc: Uc) -> None:
            self._poke_first(uc, site.address, original[:1])
            counters.stand_in_removed(site.address, len(INT3))

        machine.run_on_cpu(restore)

    def _poke_int3(self, uc: Uc, address: int, target: int) -> None:
        """The first step of a patch: an int3 the machine sends on to `target` without Python."""
        self.machine.cpu.jumps.set(address, target)
        self._poke(uc, address, INT3)

    def _poke_first(self, uc: Uc, address: int, first: bytes) -> None:
        """The last step: the first byte, and the int3's entry in the machine's table goes."""
        self._poke(uc, address, first)
        self.machine.cpu.jumps.remove(address)

    def _poke(self, uc: Uc, address: int, data: bytes) -> None:
        """Write kernel text and drop its translated code the machine's way (`Cpu.remove_cache`: a CPU loaded in
        user mode cannot look kernel code up, so every block goes then)."""
        uc.mem_write(address, data)
        self.machine.cpu.remove_cache(address, len(data))

    def release(self, probe: NativeProbe) -> None:
        """The probe's compiled code no longer runs from now on: its fault fixups go (the code itself stays in
        `code_regions` until the run ends: `resume` may send the site to it again)."""
        for compiled in probe.compiled:
            self.machine.fault_fixups.remove(compiled.base)

    def resume(self, site: ProbeSite, probe: NativeProbe, want_jump: bool) -> str:
        """A probe unpatched during this run goes back in as it was built: fault fixups, then the site."""
        for compiled in probe.compiled:
            self._fault_fixup(compiled)
        return self.patch(site, probe, want_jump)

    def _window_is_free(self, uc: Uc, site: ProbeSite) -> bool:
        return not in_use(self.machine, uc, site.address + 1, site.address + site.length)

