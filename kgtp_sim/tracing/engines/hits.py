"""The hit path in Python: what runs when an int3 of the interpreting engine (or a shared address, or a
while-stepping location) fires, and the single-stepping that follows a while-stepping hit.

Runs on the CPU thread, inside the machine's int3 hook (or, while stepping, inside a code hook). A hit never
raises: a failing condition or action records `terror` on its tracepoint through `Tracer.check`, and the kernel
continues as if the probe were not there. The compiled engines' hits never come here: their detours run in the
emulated kernel (`native.py`, `detour.py`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from unicorn import Uc
from unicorn.x86_const import UC_X86_REG_CS, UC_X86_REG_EFLAGS, UC_X86_REG_RIP

from ...agent.errors import EvalResult, UnreadableMemory
from ...agent.interp import evaluate
from ...arch import amd64
from ...machine import Marker, MemoryFault, smp
from ..core import model as t
from ..core.frames import MemoryBlock, StaticBlock, encode_block, register_collection
from ..core.run import Run
from ..core.sdata import build_entry
from ..patching.placement import Installed
from ..patching.probes import INT3


log = logging.getLogger(__name__)

EFLAGS_TF = 1 << 8
EFLAGS_IF = 1 << 9
#: what gtp_step_check_insn passes over before an opcode: the legacy prefixes and REX
_PREFIXES = frozenset((0x26, 0x2E, 0x36, 0x3E, 0x64, 0x65, 0x66, 0x67, 0xF0, 0xF2, 0xF3, *range(0x40, 0x50)))
_STI, _CLI = 0xFB, 0xFA
#: Largest memory range one `collect` may record in a frame (GDB never asks for more than 64 KiB at once).
MAX_COLLECT = 0xFFFF


@dataclass
class HitContext:
    """What one evaluation of agent bytecode sees at a hit: live memory, the hit's registers, trace variables."""

    uc: Uc
    regs: list[int]
    tracer: Run
    blocks: list[bytes] = field(default_factory=list)
    room: int = MAX_COLLECT * 4
    marker: Marker | None = None
    tracepoint: t.Tracepoint | None = None  # whose hit this is ($dump_stack names it)
    step: int = 0  # while-stepping: the step's number from 1 ($step_count); 0 at the hit
    watch: Any = None  # watch.py's state of this hit: the breakpoint that trapped, or $watch_* settings
    #: the probe site the CPU stands at, before its probed instruction (the machine's performance counters
    #: count what the site's int3 stands for when it traps: a hit reads them as before it, perf.py); None for a
    #: return, a step or a watch
    site: int | None = None
    #: the address space memory is read in: a program's for a hit of a tracepoint in it; None: the kernel's
    space: Any = None

    def try_read(self, addr: int, n: int) -> bytes | None:
        try:
            return self.read_memory(addr, n)
        except UnreadableMemory:
            return None

    def read_memory(self, addr: int, n: int) -> bytes:
        # Through the machine, not uc.mem_read: absent demand pages read as zeros from unicorn but must fault.
        try:
            return self.tracer.machine.read_memory(addr, n, space=self.space)
        except MemoryFault:
            raise UnreadableMemory(addr, n) from None

    def register(self, n: int) -> int:
        return self.regs[n] if n < len(self.regs) else 0

    def tsv_get(self, n: int) -> int:
        return self.tracer.variable_value(n, self) or 0

    def tsv_set(self, n: int, value: int) -> None:
        self.tracer.set_variable(n, value, self)

    def trace_room(self) -> int | None:
        return self.room - sum(len(b) for b in self.blocks)

    def trace_block(self, block: bytes) -> None:
        self.blocks.append(block)

    def printf(self, text: str) -> None:
        self.tracer.printed.append(text)
        log.info("tracepoint printf: %s", text.rstrip("\n"))

    # What a hit does besides recording (`printk.DirectHit`: direct output, $enable/$disable, $current).

    def begin(self) -> bool:
        """Before the condition; False ends the hit."""
        return True

    def run(self, program) -> EvalResult:
        """One expression action."""
        return evaluate(program, self)

    def finish(self) -> bool:
        """After the actions: is the hit's frame committed?"""
        return True


def hit_registers(tracer: Run, uc: Uc, pc: int) -> list[int]:
    """The hit's registers in GDB's order, with the PC GDB must see and eflags as the 32 bits GDB reads."""
    regs = tracer.registers.read(uc)
    regs[amd64.PC_REGNUM] = pc
    regs[amd64.REGISTER_INDEX["eflags"]] &= 0xFFFFFFFF
    return regs


def interpreted_hit(tracer: Run, uc: Uc, item: Installed, write_site: Any = None, may_step: bool = True) -> None:
    """One int3 hit: condition, actions, a frame in the ring, then passcount or while-stepping. `write_site(uc,
    data)`: how the steps lift the probe and put it back where it is not the kernel's code (a program's int3:
    userprobes.py); `may_step` False: no steps at this hit (a debugger single-steps the program: TF is its)."""
    uc.reg_write(UC_X86_REG_RIP, item.out_of_line)  # whatever happens, the kernel goes on
    if not tracer.running:
        return
    item.fired += 1
    tp = item.tracepoint
    hit = (item.hit_context or HitContext)(uc, hit_registers(tracer, uc, item.site.address), tracer,
                                           room=tracer.room, marker=item.marker, tracepoint=tp,
                                           site=item.site.address, space=item.space)
    if not hit.begin():
        return
    passed = record_hit(tracer, hit, item)
    if passed is None:
        return
    if tp.step_count and may_step and tracer.running and not tracer.stepper.active:
        tracer.stepper.start(uc, item, stop_after=passed, write_site=write_site)  # KGTP records the last hit's steps, then stops
    elif passed:
        tracer.stop(t.StopReason.PASSCOUNT, tracepoint=tp.number)


def record_hit(tracer: Run, hit: HitContext, item) -> bool | None:
    """The condition, the actions and the frame of one hit on the Python path, for any location that has a
    tracepoint, condition, actions and counters (an int3's `Installed`, a return probe's, a watch tracepoint's).
    None: nothing recorded (the condition false, an error recorded, the buffer full, the run over); else
    whether the pass count is now reached."""
    tp = hit.tracepoint
    assert tp is not None
    if item.condition is not None:
        result = evaluate(item.condition, hit)
        if not tracer.check(result.error, tp) or not result.value:
            return None
    item.hits += 1
    for action, program in item.actions:
        if program is not None:
            result = hit.run(program)
            if tracer.lost_block(result.error, program):
                continue
            if not tracer.check(result.error, tp):
                return None
        else:
            collect(action, hit)
    if hit.finish() and (not tracer.running or not commit(tracer, tp.number, hit, item)):
        return None
    return bool(tp.pass_count and item.hits >= tp.pass_count)


def commit(tracer: Run, number: int, hit: HitContext, item: Installed) -> bool:
    """Append the hit's blocks as one frame to the hitting CPU's ring; a full linear buffer, or a frame the ring
    can never hold, ends the run (`tfull`: the ring's `full`, as the native writers' hypercall reads it)."""
    blocks = b"".join(hit.blocks)
    assert tracer.ring is not None
    if not tracer.ring.append(number, blocks, tracer.tsc.read(), smp.cpu_number(hit.uc)):
        if tracer.ring.state().full:
            tracer.stop(t.StopReason.BUFFER_FULL)
        return False
    item.usage += len(blocks) + 6
    return True


def collect(action: t.Action, hit: HitContext) -> None:
    """A collection that is not bytecode: registers, a memory range, or the marker's static data."""
    if isinstance(action, t.CollectRegisters):
        hit.blocks.append(encode_block(register_collection(action.mask, hit.regs)))
    elif isinstance(action, t.CollectMemory):
        base = 0 if action.basereg < 0 else hit.register(action.basereg)
        address = (base + action.offset) & ((1 << 64) - 1)
        length = min(action.length, MAX_COLLECT)
        try:
            data = hit.read_memory(address, length)
        except UnreadableMemory:
            return  # not collected: GDB shows <unavailable>, like a DProbes fault token
        hit.blocks.append(encode_block(MemoryBlock(address, data)))
    elif isinstance(action, t.CollectStaticData) and hit.marker is not None:
        entry = build_entry(hit.marker, hit.regs, hit.try_read)
        hit.blocks.append(encode_block(StaticBlock(entry)))


class Stepper:
    """While-stepping: after a hit, collect before each of the next `step_count` instructions of the hit task.

    As a CPU single-steps: the int3 is lifted so the probed instruction runs in place, and EFLAGS.TF makes the CPU
    trap (#DB, `Cpu.debug_trap`) after every instruction with RIP at the next one, where the step is collected.
    The emulator translates code run with TF apart from code run without it, so no translated block can skip a
    step, however emulation is cut between instructions. As KGTP's gtp_kp_post_handler does, the steps run with
    interrupts off (IF cleared at the hit, put back as it was when they end, gtp_step_stop), and a `sti` or
    `cli` among them is passed over and only noted for that end (gtp_step_check_insn). So no tick comes between
    a hit and its probed instruction or between two steps: none can preempt the hit task, switch the CPU to
    another while the int3 is lifted (whose calls would go unseen, or, beside another while-stepping
    tracepoint, hit with no steps), or stop the machine with the steps half done (the scheduler stops and
    switches CPUs only without TF, so a sequence of steps is one piece). The kernel's context switch keeps the
    flags, so a task switch inside the steps (a call of schedule() among them) would hand TF to the next task:
    the first trap in another task ends the stepping (the steps taken so far stay recorded) and clears TF there.

    A program's site (the gdbserver role's process) steps the same way in ring 3, its bytes written by the
    program's probes into the program's own memory (`write_site`), whichever space the CPU has loaded when the
    steps end; the #DB hook that was there before the steps is put back after them (a debugger's single step of
    the program goes on reaching the kernel).
    """

    def __init__(self, tracer: Run) -> None:
        self.tracer = tracer
        self._item: Installed | None = None
        self._task = b""
        self._remaining = 0
        self._write_site: Any = None
        self._previous_trap: Any = None
        self._irq_need_open = False  # IF before the steps (KGTP's gtp_step.irq_need_open)

    @property
    def active(self) -> bool:
        return self._item is not None

    def start(self, uc: Uc, item: Installed, stop_after: bool = False, write_site: Any = None) -> None:
        """`stop_after`: the hit reached its pass count; the run stops once its steps are recorded. `write_site`:
        see `interpreted_hit` (None: the kernel's code, written through the loaded space)."""
        self._stop_after = stop_after
        machine = self.tracer.machine
        site = item.site
        self._write_site = write_site
        self._write(uc, site.address, site.original)
        if write_site is None:
            machine.counters.stand_in_removed(site.address, len(INT3))  # the steps run the site's own code
        self._item = item
        self._task = smp.current_task(uc)
        self._remaining = item.tracepoint.step_count
        if machine.cpu.debug_trap != self._trap:
            self._previous_trap = machine.cpu.debug_trap
        machine.cpu.debug_trap = self._trap
        eflags = uc.reg_read(UC_X86_REG_EFLAGS)
        self._irq_need_open = bool(eflags & EFLAGS_IF)
        uc.reg_write(UC_X86_REG_EFLAGS, (eflags | EFLAGS_TF) & ~EFLAGS_IF)
        uc.reg_write(UC_X86_REG_RIP, site.address)

    def _trap(self, uc: Uc) -> None:
        item = self._item
        if item is None or not self.tracer.running:
            self._stop_stepping(uc)
            return
        if smp.current_task(uc) != self._task:
            self._stop_stepping(uc)  # TF followed a context switch into another task
            return
        self._pass_interrupt_flag_change(uc, item)
        self.tracer.kgtp.timed(lambda: self._collect(uc, item, uc.reg_read(UC_X86_REG_RIP)))
        self._remaining -= 1
        if self._remaining <= 0:
            self._stop_stepping(uc)

    def _pass_interrupt_flag_change(self, uc: Uc, item: Installed) -> None:
        """The next instruction a `sti` or `cli` of the kernel: not run (interrupts stay off through the steps),
        only noted for their end (gtp_step_check_insn; a program's faults in ring 3, as without steps)."""
        if uc.reg_read(UC_X86_REG_CS) & 3:
            return
        rip = uc.reg_read(UC_X86_REG_RIP)
        try:  # the instruction's bytes up to its page's end: the next page may be absent
            code = self.tracer.machine.read_memory(rip, min(16, 0x1000 - (rip & 0xFFF)), space=item.space)
        except MemoryFault:
            return
        at = 0
        while at < len(code) - 1 and code[at] in _PREFIXES:
            at += 1
        if code[at] in (_STI, _CLI):
            self._irq_need_open = code[at] == _STI
            uc.reg_write(UC_X86_REG_RIP, rip + at + 1)

    def _stop_stepping(self, uc: Uc) -> None:
        eflags = uc.reg_read(UC_X86_REG_EFLAGS) & ~EFLAGS_TF
        if self._item is not None and self._irq_need_open:
            eflags |= EFLAGS_IF  # interrupts back on as they were before the steps (gtp_step_stop)
        self._irq_need_open = False
        uc.reg_write(UC_X86_REG_EFLAGS, eflags)
        item, self._item = self._item, None
        cpu = self.tracer.machine.cpu
        if item is not None and item.space is not None and cpu.debug_trap == self._trap:
            cpu.debug_trap, self._previous_trap = self._previous_trap, None  # a program's: the hook before ours
        if item is not None and self._write_site is not None:
            self._write_site(uc, INT3)  # a program's: its int3 back while anyone holds the address (userprobes.py)
        if item is not None and self.tracer.running and getattr(self, "_stop_after", False):
            self.tracer.stop(t.StopReason.PASSCOUNT, tracepoint=item.tracepoint.number)
        elif item is not None and self.tracer.running and self.tracer.is_armed(item.tracepoint.key) and \
                self._write_site is None:
            self._write(uc, item.site.address, INT3)
            self.tracer.machine.counters.stand_in(item.site.address, len(INT3), item.site.resume_address)

    def _write(self, uc: Uc, address: int, data: bytes) -> None:
        """The site's bytes: the kernel's code through the loaded space, or the program's through `write_site`."""
        if self._write_site is not None:
            self._write_site(uc, data)
            return
        uc.mem_write(address, data)
        uc.ctl_remove_cache(address, address + len(data))

    def _collect(self, uc: Uc, item: Installed, address: int) -> None:
        tracer = self.tracer
        regs = hit_registers(tracer, uc, address)
        hit = (item.hit_context or HitContext)(uc, regs, tracer, room=tracer.room, tracepoint=item.tracepoint,
                                               step=item.tracepoint.step_count - self._remaining + 1,
                                               space=item.space)
        has_registers = False
        for action, program in item.stepping:
            if program is not None:
                result = evaluate(program, hit)
                if not tracer.check(result.error, item.tracepoint):
                    return
            else:
                has_registers |= isinstance(action, t.CollectRegisters)
                collect(action, hit)
        if not has_registers:  # GDB tells a stepping frame from the hit by its PC: always record it
            hit.blocks.insert(0, b"R" + amd64.encode_general(regs))
        commit(tracer, item.tracepoint.number, hit, item)
