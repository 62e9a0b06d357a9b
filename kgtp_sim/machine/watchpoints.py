"""The machine's four hardware breakpoints: data breakpoints (a write, or a read or write, of 1, 2, 4 or 8 bytes)
and instruction breakpoints, as x86's debug registers DR0-DR3 give them, built on unicorn hooks.

x86 semantics kept:

- **Data breakpoints are traps.** The handler runs after the accessing instruction completed, RIP at the next
  instruction and every register and byte of memory as the instruction left them (the value written is in
  memory). An access matches when any of its bytes falls in the watched range; the range is aligned down to its
  size, as DR0-DR3 ignore the low address bits.
- **Instruction breakpoints are faults.** The handler runs before the instruction at the address executes, RIP
  there.
- **At most four**, shared by every kind (`COUNT`).

How a data trap is made exact on unicorn. Memory hooks fire *before* the access lands, in the middle of the
instruction, and unicorn gives no hook at the next instruction boundary without instrumenting every instruction
(measured: about twice as slow). So the first matching access of an instruction R does three things: it notes the
bytes about to be overwritten, sets EFLAGS.TF and writes RIP = R (unicorn then leaves the translated block right
after this access and goes on at R, without ending the run). Before R runs again, in a block of one instruction
(TF), a small gate hook at R puts the noted bytes back: R is replayed from its original state, its accesses are
collected, and the single-step #DB after it (`Cpu.debug_trap`) is the trap. QEMU writes an instruction's
registers back only after its last memory access (so that a fault can restart it), which is what makes the
replay start from R's real state. If the run ends between the two (a stop at the block boundary), the machine
finishes the replay before anything else runs (`Cpu.after_run`), so a timer tick is taken after the trap, as the
hardware orders them. While any data breakpoint is in use every load and store of the kernel takes unicorn's
slow path (memory hooks are compiled into translated code), from the first one armed until `clear_all`.

A few instructions QEMU carries out in helper functions (iretq, far transfers, fxsave/xsave, cmpxchg16b, system
instructions) cannot be cut after one access: an access of theirs traps at once, before the instruction ends, RIP
at it and the registers as it found them (`HELPER_INSTRUCTIONS`).

The hooks see physical addresses (unicorn 2.1 reports those): a range is watched in the frame mapped at its
virtual address when it was armed. A demand page the kernel later maps to another frame escapes the watch, and a
second mapping of the same frame (the page tables' self-map) is watched too.

Accesses made by code for which `ignore(rip)` is true (the tracer's own compiled code) never trap. An instruction
that both writes a watched range and is interrupted between the two halves of its replay by something the
machine does (`Machine.call`'s budget) is replayed once more: reads and plain stores are idempotent.

The machine has one set (`Machine.debug_registers`), shared by the debugger's hardware breakpoints and watchpoints
(runcontrol.py) and KGTP's watch tracepoints: each owner frees only its own slots (`release`).

Runs on the CPU thread: `set`/`clear` from tracepoint hits (inside emulation) or between runs; handlers inside
the #DB or code hook.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from unicorn import UC_HOOK_CODE, UC_HOOK_MEM_READ, UC_HOOK_MEM_WRITE, UC_MEM_WRITE, Uc, UcError
from unicorn import x86_const as X
from unicorn.unicorn_py3.unicorn import HOOK_CODE_CFUNC

from ..uc_native import add_native_hook
from ..uc_paging import AddressSpace
from .cpu import EFLAGS_TF, Cpu
from .errors import MachineError

if TYPE_CHECKING:
    from capstone import Cs

log = logging.getLogger(__name__)

#: x86 has four debug address registers
COUNT = 4
#: kinds, numbered as KGTP's `$watch_type` (DR7's R/W field encodes them 00, 01, 11)
EXECUTE, WRITE, READ_WRITE = 0, 1, 2
SIZES = (1, 2, 4, 8)
#: widest single access unicorn hands a memory hook (wider ones are split): how far before a range a matching
#: access may start
_WIDEST_ACCESS = 16
#: a physical address nothing maps: the hook there only makes unicorn translate loads and stores on its slow path
_NOWHERE = 0

#: the gate's native code, called with rcx = its cell {armed, python}: `cmp $0,(%rcx); jne 1f; ret; 1: jmp *8(%rcx)`
_GATE_CODE = bytes.fromhex("48833900" "7501" "c3" "ff6108")

TrapHandler = Callable[[Uc, int], None]  # (uc, slot)

#: instructions whose memory accesses QEMU makes from helper functions (capstone's names): no exit is possible
#: between such an access and the rest of the instruction, so they trap when the access happens
HELPER_INSTRUCTIONS = frozenset("""
    iret iretd iretq retf retfq lret ljmp lcall int int1 int3 into syscall sysret sysretq sysenter sysexit
    ltr lldt lar lsl verr verw fxsave fxsave64 fxrstor fxrstor64 xsave xsave64 xsaveopt xsaveopt64 xsavec
    xsavec64 xrstor xrstor64 cmpxchg8b cmpxchg16b fsave fnsave frstor fstenv fnstenv fldenv bound
""".split())


@functools.cache
def _disassembler() -> Cs:
    from capstone import CS_ARCH_X86, CS_MODE_64, Cs  # on first use: a machine that sets no watchpoint never loads it

    cs = Cs(CS_ARCH_X86, CS_MODE_64)
    cs.detail = True
    return cs


class WatchpointError(MachineError):
    """A breakpoint cannot be set: bad size or kind, no free register, or an address that is not mapped."""


class _GateCell(ctypes.Structure):
    _fields_ = [("armed", ctypes.c_uint64), ("python", ctypes.c_void_p)]


@dataclass
class Watchpoint:
    slot: int
    address: int
    size: int
    kind: int
    handler: TrapHandler
    physical: int = 0  # data kinds: where the (aligned) range is in physical memory
    hook: int | None = None


@dataclass
class _Replay:
    """One instruction caught accessing a watched range, between its first pass and its trap."""

    rip: int
    slots: set[int]
    undo: tuple[int, bytes] | None  # (physical address, bytes) a first-pass store overwrote
    tf: int  # EFLAGS.TF before we set it
    replaying: bool = False


class DebugRegisters:
    """DR0-DR3 of the machine's one CPU. `set` arms a slot with a handler(uc, slot), `clear` frees it; when one
    instruction touched several ranges, each slot's handler runs, in slot order."""

    def __init__(self, cpu: Cpu, ignore: Callable[[int], bool] = lambda rip: False) -> None:
        self.cpu = cpu
        self.uc = cpu.uc
        self.ignore = ignore
        self.slots: list[Watchpoint | None] = [None] * COUNT
        self.traps = 0  #: data and instruction traps delivered
        self.replays = 0  #: instructions replayed (a data trap each)
        self._engaged = False  # the slow-path hook is in, the #DB and after-run handlers are ours
        self._sentinel: int | None = None
        self._previous_trap = None  # the #DB handler before ours in the CPU's chain (Cpu.debug_trap)
        self._chained = False  # ours is in that chain (on top, or under a handler put over it since)
        self._previous_after_run = None
        self._flush_due = False
        self._retire_due: list[tuple[object, int | None]] = []  # (hook, code_at) to delete at the next safe point
        self._gates: dict[int, object] = {}  # rip -> gate hook (native handle or Python hook id)
        self._gate_cell = _GateCell(0, None)
        self._gate_python = HOOK_CODE_CFUNC(lambda _uc, address, _size, _data: self._replay_begins(address))
        self._gate_cell.python = ctypes.cast(self._gate_python, ctypes.c_void_p).value
        self._replay: _Replay | None = None
        self._finishing = False
        self._inline: dict[int, bool] = {}  # rip -> its accesses are cut after one (_cuttable)

    # ---- arming --------------------------------------------------------------------------------------

    def free_slot(self) -> int | None:
        return next((i for i, w in enumerate(self.slots) if w is None), None)

    @property
    def in_use(self) -> int:
        return sum(w is not None for w in self.slots)

    def set(self, slot: int, address: int, size: int, kind: int, handler: TrapHandler,
            space: AddressSpace | None = None) -> Watchpoint:
        """Arm `slot` on [address, address + size) of `space` (None: the kernel's) for `kind`; raises
        WatchpointError. Between runs, or inside emulation from an interrupt hook (a tracepoint's int3): the first
        data breakpoint then ends the run. An instruction breakpoint is on the virtual address in every space (the
        handler tells them apart; in a process's `space` the caller has checked the address is code of it, its page
        perhaps not faulted in yet); a data breakpoint on the frame `space` maps there."""
        if size not in SIZES:
            raise WatchpointError(f"a hardware breakpoint covers 1, 2, 4 or 8 bytes, not {size}")
        if kind not in (EXECUTE, WRITE, READ_WRITE):
            raise WatchpointError(f"breakpoint kind {kind}: 0 (execute), 1 (write) or 2 (read or write)")
        if self.slots[slot] is not None:
            raise WatchpointError(f"debug register {slot} is in use")
        watch = Watchpoint(slot, address, size, kind, handler)
        uc = self.uc
        if kind == EXECUTE:
            tables = space or self.cpu.tables
            if not tables.executable(address) and (space is None or tables.translate(address) is not None):
                raise WatchpointError(f"{address:#x} is not mapped executable")  # a page not there yet: the caller's
            watch.hook = uc.hook_add(UC_HOOK_CODE, self._on_execute, slot, address, address)
            self.cpu.remove_cache(address, 1, space)  # translated code gets the hook when translated again
        else:
            low = address & ~(size - 1)
            physical = (space or self.cpu.tables).translate(low, size)
            if physical is None:
                raise WatchpointError(f"{address:#x} is not mapped")
            watch.physical = physical
            self._engage()
            kinds = UC_HOOK_MEM_WRITE | (UC_HOOK_MEM_READ if kind == READ_WRITE else 0)
            watch.hook = uc.hook_add(kinds, self._on_access, slot, max(0, physical - _WIDEST_ACCESS + 1),
                                     physical + size - 1)
        self.slots[slot] = watch
        return watch

    def clear(self, slot: int) -> None:
        """Free `slot`: it stops trapping at once (its hook goes at the next safe point)."""
        watch = self.slots[slot]
        if watch is None:
            return
        self.slots[slot] = None
        if watch.hook is not None:
            self._retire(watch.hook, watch.address if watch.kind == EXECUTE else None)
        if self._replay is not None:
            self._replay.slots.discard(slot)

    def release(self, slots: list[int]) -> None:
        """Free `slots`, one owner's (the debugger's breakpoints, or the tracer's watch tracepoints: they share the
        four); once no slot is in use, every hook goes, as with `clear_all`."""
        for slot in slots:
            self.clear(slot)
        if self.in_use == 0:
            self.clear_all()

    def clear_all(self) -> None:
        """Free every slot and take every hook out (tstop); translated code is dropped where it is safe."""
        for slot in range(COUNT):
            self.clear(slot)
        if self._replay is not None and not self._replay.replaying:
            self._abandon()
        for rip, hook in self._gates.items():  # a native gate's code is never freed: a block left calling it finds
            self._retire(hook, rip if isinstance(hook, int) else None)  # it disarmed; a Python gate's callback goes
        self._gates = {}
        self._inline = {}  # code may be patched, module space reused, before the next run
        self._disengage()

    # ---- engaging: hooks that change how code is translated -------------------------------------------

    def _engage(self) -> None:
        if self._engaged:
            return
        self._engaged = True
        uc = self.uc
        self._sentinel = uc.hook_add(UC_HOOK_MEM_WRITE, lambda *_: None, None, _NOWHERE, _NOWHERE)
        if not self._chained:  # (still in the chain since the last run, under a handler that came after us)
            self._previous_trap, self.cpu.debug_trap = self.cpu.debug_trap, self._on_debug_trap
            self._chained = True
        if self.cpu.after_run != self._after_run:  # still ours when the last run did not end since disengaging
            self._previous_after_run, self.cpu.after_run = self.cpu.after_run, self._after_run
        self._flush(now=True)  # code translated before runs no load or store through the hooks

    def _disengage(self) -> None:
        if not self._engaged:
            self._safe_point()
            return
        self._engaged = False
        if self._sentinel is not None:
            self._retire(self._sentinel)
            self._sentinel = None
        # The #DB handlers form a chain, each keeping the one before it (the tracer's step in place, while-stepping
        # and fast tracepoints' pads put theirs over ours while a step is under way). Ours leaves the chain only
        # from its top; under another it stays, passing every trap on, until it is on top again: taking the
        # chain back to ours' predecessor there would drop the handler above, whose single step's #DB would then
        # reach the kernel as a stray SIGTRAP for a traced program.
        if self.cpu.debug_trap == self._on_debug_trap:
            self.cpu.debug_trap, self._chained = self._previous_trap, False
        self._flush()
        self._safe_point()

    def _flush(self, now: bool = False) -> None:
        """Drop translated code (hooks compiled in or out); inside emulation only at the run's end. With `now`,
        that end comes at once: a stop, which only an interrupt hook may ask (it runs between translated
        blocks; asked from a memory hook, unicorn would leave the block after a later access and run that
        instruction again from its start)."""
        if not self.cpu.in_emulation:
            self.uc.ctl_flush_tb()
            return
        self._flush_due = True
        if now:
            self.uc.emu_stop()

    def _retire(self, hook: object, code_at: int | None = None) -> None:
        """Delete `hook` (an instruction breakpoint's: `code_at` its address) now, or at the next safe point."""
        if self.cpu.in_emulation:
            self._retire_due.append((hook, code_at))
        else:
            self._delete(hook, code_at)

    def _delete(self, hook: object, code_at: int | None = None) -> None:
        self.cpu.delete_hook(hook, code_at)  # with the code translated under it, and the #PF it can leave in flight

    def _safe_point(self) -> None:
        """Outside emulation: delete retired hooks, drop translated code if due, hand the run end back."""
        if self.cpu.in_emulation:
            return
        for hook, code_at in self._retire_due:
            self._delete(hook, code_at)
        self._retire_due = []
        if self._flush_due:
            self._flush_due = False
            self.uc.ctl_flush_tb()
        if not self._engaged and self.cpu.after_run == self._after_run:
            self.cpu.after_run = self._previous_after_run

    # ---- the hooks -------------------------------------------------------------------------------------

    def _on_execute(self, uc: Uc, address: int, _size: int, slot: int) -> None:
        watch = self.slots[slot]
        if watch is None or watch.kind != EXECUTE:
            return
        if self._replay is not None and self._replay.rip == address:
            return  # the replay of an instruction whose breakpoint fired before its first pass
        self.traps += 1
        watch.handler(uc, slot)

    def _on_access(self, uc: Uc, access: int, address: int, size: int, _value: int, slot: int) -> None:
        watch = self.slots[slot]
        if watch is None or watch.kind == EXECUTE:
            return
        if not (address < watch.physical + watch.size and watch.physical < address + size):
            return
        replay = self._replay
        if replay is not None:
            if replay.replaying:
                replay.slots.add(slot)
                return
            rip = self.cpu.regs.read(X.UC_X86_REG_RIP)
            if rip == replay.rip:  # another range touched by the same first pass
                replay.slots.add(slot)
                return
            log.warning("watchpoint: instruction at %#x was never replayed; its trap is lost", replay.rip)
            self._abandon()
        rip = self.cpu.regs.read(X.UC_X86_REG_RIP)  # unicorn brought it to the accessing instruction
        if self.ignore(rip):
            return
        if not self._cuttable(rip):
            self.traps += 1
            watch.handler(uc, slot)
            return
        undo = (address, bytes(uc.phys_read(address, size))) if access == UC_MEM_WRITE else None
        regs = self.cpu.regs
        eflags = regs.read(X.UC_X86_REG_EFLAGS)
        self._replay = _Replay(rip, {slot}, undo, eflags & EFLAGS_TF)
        self._gate(rip)
        self._gate_cell.armed = 1
        regs.write(X.UC_X86_REG_EFLAGS, eflags | EFLAGS_TF)
        regs.write(X.UC_X86_REG_RIP, rip)  # leave the block after this access; go on at rip, in a TF block
        if self.cpu.observer is not None:  # this first pass does not retire: the replay does
            self.cpu.observer.fault_at(rip)

    def _cuttable(self, rip: int) -> bool:
        """Are the instruction's accesses translated inline (so that unicorn can leave it after one)?"""
        known = self._inline.get(rip)
        if known is None:
            insn = None
            for length in (15, 8, 1):  # near the end of a page, what is there
                try:
                    insn = next(_disassembler().disasm(bytes(self.uc.mem_read(rip, length)), rip, 1), None)
                    break
                except UcError:
                    continue
            known = insn is not None and insn.mnemonic not in HELPER_INSTRUCTIONS and not (
                insn.opcode[0] == 0xFF and (insn.modrm >> 3) & 7 in (3, 5))  # call/jmp far through memory
            self._inline[rip] = known
        return known

    def _gate(self, rip: int) -> None:
        if rip in self._gates:
            return
        hook = add_native_hook(self.uc, UC_HOOK_CODE, _GATE_CODE, ctypes.addressof(self._gate_cell), rip, rip)
        if hook is None:  # no W+X host pages: the same gate in Python
            hook = self.uc.hook_add(UC_HOOK_CODE, lambda _uc, address, _size, _data: self._replay_begins(address),
                                    None, rip, rip)
        self._gates[rip] = hook

    def _replay_begins(self, address: int) -> None:
        """The gate at R, in the one-instruction block that replays it: undo the first pass's store."""
        replay = self._replay
        if replay is None or replay.replaying or address != replay.rip:
            return
        self._gate_cell.armed = 0
        if replay.undo is not None:
            self.uc.phys_write(*replay.undo)
        replay.replaying = True

    def _on_debug_trap(self, uc: Uc) -> None:
        replay, self._replay = self._replay, None
        self._gate_cell.armed = 0
        regs = self.cpu.regs
        eflags = regs.read(X.UC_X86_REG_EFLAGS)
        if replay is not None and not replay.replaying and regs.read(X.UC_X86_REG_RIP) != replay.rip:
            # the first pass ran the whole instruction (a block of one instruction: the CPU was single-stepped
            # already): the store has landed and RIP is past it, so this #DB is the exact trap
            regs.write(X.UC_X86_REG_EFLAGS, (eflags & ~EFLAGS_TF) | replay.tf)
            self.replays += 1
            self._deliver(uc, replay.slots)
            if self._finishing:
                uc.emu_stop()
            return
        if replay is None or not replay.replaying:
            if replay is not None:
                regs.write(X.UC_X86_REG_EFLAGS, eflags & ~EFLAGS_TF)
                log.warning("watchpoint: trap at %#x before its replay; lost", regs.read(X.UC_X86_REG_RIP))
            elif self._previous_trap is not None:  # not ours: the tracer's single steps'
                self._previous_trap(uc)
            else:  # not ours: a single step the kernel asked for (a traced process's), its #DB
                self.cpu.deliver(1)
            return
        regs.write(X.UC_X86_REG_EFLAGS, (eflags & ~EFLAGS_TF) | replay.tf)
        self.replays += 1
        self._deliver(uc, replay.slots)
        if self._finishing:
            uc.emu_stop()

    def _deliver(self, uc: Uc, slots: set[int]) -> None:
        for slot in sorted(slots):  # as DR6 reports them: every register that matched, in order
            watch = self.slots[slot]
            if watch is not None:
                self.traps += 1
                watch.handler(uc, slot)

    def _abandon(self) -> None:
        """A first pass whose replay cannot come: leave the CPU as it is (the access happened once) without TF."""
        replay, self._replay = self._replay, None
        self._gate_cell.armed = 0
        if replay is not None:
            regs = self.cpu.regs
            regs.write(X.UC_X86_REG_EFLAGS, (regs.read(X.UC_X86_REG_EFLAGS) & ~EFLAGS_TF) | replay.tf)

    def _after_run(self, uc: Uc) -> None:
        """The run ended: finish a replay the stop cut in two (before the machine delivers anything), then do what
        could not be done inside emulation."""
        previous = self._previous_after_run
        if previous is not None:
            previous(uc)
        replay = self._replay
        if replay is not None and not self._finishing:
            rip = self.cpu.regs.read(X.UC_X86_REG_RIP)
            if rip != replay.rip or not self.cpu.regs.read(X.UC_X86_REG_EFLAGS) & EFLAGS_TF:
                log.warning("watchpoint: instruction at %#x left before its replay; its trap is lost", replay.rip)
                self._abandon()
            else:
                self._replay_begins(rip)  # no instruction ran since the first pass: R runs from its own state
                self._finishing = True
                try:
                    for _ in range(100):
                        self.cpu.run()
                        if self._replay is None:
                            break
                    else:
                        raise MachineError(f"watchpoint: the replay of {rip:#x} did not complete")
                finally:
                    self._finishing = False
        self._safe_point()


def aligned_pieces(address: int, size: int) -> list[tuple[int, int]]:
    """[address, address + size) as naturally aligned pieces of 1, 2, 4 or 8 bytes, largest first (gdbserver's
    x86_handle_nonaligned_watchpoint)."""
    if size <= 0:
        raise WatchpointError(f"a watchpoint covers at least one byte, not {size}")
    pieces = []
    end = address + size
    while address < end:
        length = next(n for n in reversed(SIZES) if address % n == 0 and address + n <= end)
        pieces.append((address, length))
        address += length
    return pieces


def busy_message(registers: DebugRegisters, needed: int) -> str:
    return (f"no free debug register ({needed} needed): x86 has {COUNT}, {registers.in_use} in use by hardware "
            "breakpoints, watchpoints and watch tracepoints")
