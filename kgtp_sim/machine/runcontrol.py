"""Run control of the machine for a debugger, as QEMU's gdbstub gives it: every CPU stopped at an instruction
boundary and resumed, one CPU stepped (the others running or not), breakpoints that stop the whole machine, and time
that does not run while it is stopped.

Owns the stop state (`stopped`, the `event` that stopped the machine), the resumption in progress (which CPUs may
run, the CPU being stepped and its range), the debugger's breakpoints and watchpoints, the machine's one set of
debug registers (shared with KGTP's watch tracepoints, tracing/kgtp/watch.py), and the listeners told of each stop.

- **Stopping.** A stop is entered on the CPU thread, between two runs, at a clean point: the loaded CPU is not in
  the stub's own code (module space: detours, out-of-line copies) nor single-stepped by the tracer (EFLAGS.TF), the
  points where the scheduler never switches CPUs either. The other CPUs are switched out at block boundaries, so
  every CPU is at an instruction boundary. `stop()` (Ctrl-C, `monitor stop`) asks for one and waits; a breakpoint
  or watchpoint hit inside emulation ends the run and is stopped on at the run's end (a data trap whose
  instruction ran displaced in module space once the CPU is back in the kernel's code).
- **Stopped.** No CPU runs; requests of other threads (`run_on_cpu`: GDB's reads, patching) are still served. The
  clock is frozen (clock.py): no tick is given (scheduler.py), the clock port and the TSC stand still.
- **Resuming** (`resume`): every CPU, or only some (GDB's `vCont` with scheduler-locking on), optionally with one
  CPU stepped: one instruction (the stub's code a probed instruction leads into runs as part of it, so a step never
  stops inside a detour; at a jump probe's site the instructions it displaced run in that one step), or
  instructions while RIP stays in a range (GDB's range stepping). A stepped CPU takes no
  interrupt meanwhile (QEMU's SSTEP_NOIRQ), except that a halted one is woken by its next interrupt and the step ends
  at the handler's first instruction. The step ends the resumption with a stop (reason STEP).
- **Breakpoints** are QEMU's: in the translator, not in memory. Each is a code hook on one address, so the
  instruction there is reported before it runs and memory is never patched: GDB reads the kernel's bytes, and a
  tracepoint's probe at the same address (an int3 or a jump into a detour) runs when the CPU goes on. Hardware
  breakpoints and watchpoints take the debug registers (watchpoints.py): four at most, tracepoints' watches
  included; a watchpoint traps after the access (RIP at the next instruction), as x86's do.
- **A process's breakpoints.** A breakpoint (software or hardware) at a user address names the address space it
  belongs to (a process's page tables): the hook sees every CPU that runs code at that virtual address, whichever
  process it is, and stops the machine only when the CPU's CR3 holds that space's root, so another process
  mapping the same address runs on. Neither the process's memory nor its translated code as seen by other spaces
  changes. A watchpoint in a process's data watches the frame its space maps there (watchpoints.py).

A breakpoint is not taken while the tracer single-steps the CPU (TF set: while-stepping, or a watchpoint's replay of
the instruction) nor during `Machine.call` (`quiet`).

Threads: `stop`, `resume`, the breakpoint and watchpoint calls and `wait` run on any thread (the server's) and do
their work on the CPU thread through `run_on_cpu`; `settle`, `step_turn` and the hooks run on the CPU thread. The
scheduler's condition guards the state both read. Listeners are called on the CPU thread, right after the stop.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from unicorn import UC_HOOK_CODE, Uc
from unicorn import x86_const as X

from ..uc_native import tsc_offset_field, write_context_u64
from ..uc_paging import PTE_ADDRESS, AddressSpace, kernel_half
from .clock import MachineClock
from .cpu import EFLAGS_TF, Cpu, Stop
from .errors import MachineError
from .layout import MODULE_BASE, MODULE_SIZE
from .watchpoints import COUNT, EXECUTE, SIZES, DebugRegisters, WatchpointError, aligned_pieces, busy_message

HLT = 0xF4
_STOP_RETRY_S = 0.002


class Reason(enum.Enum):
    """Why the machine stopped."""

    REQUEST = "stop requested"  #: `stop()`: the user's Ctrl-C, `monitor stop`
    BREAKPOINT = "breakpoint"  #: a software breakpoint (before the instruction)
    HARDWARE_BREAKPOINT = "hardware breakpoint"  #: an instruction breakpoint on a debug register (before it)
    WATCHPOINT = "watchpoint"  #: a data breakpoint on a debug register (after the accessing instruction)
    STEP = "step"  #: the stepped CPU finished its step


@dataclass(frozen=True)
class StopEvent:
    """One stop of the machine: the CPU it names (the one that hit, stepped, or was running when asked), the
    breakpoint's code address or the watched data address, and the watchpoint's kind (watchpoints.WRITE or
    READ_WRITE). `serial` counts the stops."""

    reason: Reason
    cpu: int
    address: int = 0
    kind: int = 0
    serial: int = 0


@dataclass
class _Step:
    cpu: int
    within: tuple[int, int] | None  #: range stepping: on while RIP is in [low, high)


class RunControl:
    """The machine under a debugger. `scheduler` is the machine's (scheduler.py: its CPU thread, slots and lock)."""

    def __init__(self, scheduler: Any, cpu: Cpu, clock: MachineClock) -> None:
        self._sched = scheduler
        self.cpu = cpu
        self.clock = clock
        self._cond: threading.Condition = scheduler._cond
        self._stopped = False
        self._stop_requested = False
        self._allowed: frozenset[int] | None = None  #: CPUs that may run while resumed; None: all
        self._step: _Step | None = None
        self._pending: tuple[Reason, int, int, int] | None = None  # (reason, cpu, address, kind) met in a run
        self.event: StopEvent | None = None  #: the last stop
        self.serial = 0  #: stops so far
        self.listeners: list[Callable[[StopEvent], None]] = []
        self._breakpoints: dict[int, int] = {}  # address -> code hook
        #: address -> the spaces it stops in, by root (None: the kernel's, which stops in any)
        self._owners: dict[int, dict[int | None, AddressSpace | None]] = {}
        #: (kind, address, size, root) -> debug registers; root None: a kernel address (any space)
        self._hardware: dict[tuple[int, int, int, int | None], list[int]] = {}
        self._slot_roots: dict[int, int | None] = {}  # debug register -> the root of the space its breakpoint is in
        self._registers: DebugRegisters | None = None
        self._quiet = 0
        #: the stepped CPU runs (step_turn): other threads' wake-ups must not cut its runs short (scheduler._kick)
        self.stepping_now = False
        self._tsc_field = tsc_offset_field()

    # ---- state ---------------------------------------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def breakpoints(self) -> frozenset[int]:
        """Addresses of the software breakpoints set."""
        return frozenset(self._breakpoints)

    @property
    def hardware(self) -> frozenset[tuple[int, int, int]]:
        """(kind, address, size) of the hardware breakpoints and watchpoints set."""
        return frozenset(key[:3] for key in self._hardware)

    @property
    def debug_registers(self) -> DebugRegisters:
        """DR0-DR3, shared by the debugger's hardware breakpoints and the tracer's watch tracepoints."""
        if self._registers is None:
            self._registers = DebugRegisters(self.cpu)
        return self._registers

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """Breakpoints and watchpoints are not taken meanwhile (`Machine.call` runs a function to its end)."""
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    # ---- from any thread ------------------------------------------------------------------------------------

    def stop(self) -> StopEvent:
        """Stop every CPU at an instruction boundary; returns the stop (the one already in force if stopped)."""
        sched = self._sched
        if sched.on_cpu_thread:
            raise MachineError("the machine cannot be asked to stop from its own CPU thread (it would wait for itself)")
        if not sched.started:
            if not self._stopped:
                self._enter(Reason.REQUEST, sched.current_cpu)
            assert self.event is not None
            return self.event
        with self._cond:
            if self._stopped:
                assert self.event is not None
                return self.event
            self._stop_requested = True
            self._cond.notify_all()
        while True:
            sched._kick()
            with self._cond:
                if self._stopped:
                    assert self.event is not None
                    return self.event
                self._cond.wait(_STOP_RETRY_S)
                if self._stopped:
                    assert self.event is not None
                    return self.event
            if not sched.alive:
                raise MachineError("the machine has shut down")

    def resume(self, cpus: Iterable[int] | None = None, step: int | None = None,
               within: tuple[int, int] | None = None) -> int:
        """Let `cpus` (None: every CPU) run again; with `step`, that CPU steps (one instruction, or while RIP stays
        in `within`) and the machine stops when it is done. Returns the serial of the stop in force, so that
        `wait(serial)` waits for the next one. Resuming a running machine changes nothing."""
        allowed = None if cpus is None else frozenset(cpus) | ({step} if step is not None else set())
        count = self._sched.cpu_count
        if step is not None and not 0 <= step < count:
            raise MachineError(f"no CPU {step}: the machine has {count}")
        if step is not None and not self._sched.slots[step].online:
            raise MachineError(f"CPU {step} is offline: the kernel has not started it")

        def apply(uc: Uc) -> int:
            with self._cond:
                if not self._stopped:
                    return self.serial
                self._stopped = False
                self._allowed = allowed
                self._step = _Step(step, within) if step is not None else None
                self._pending = None
            if step is not None:
                self._sched.load(step)
            self.clock.thaw()
            self._apply_tsc_offset()
            with self._cond:
                self._cond.notify_all()
            return self.serial

        return self._sched.run_on_cpu(apply)

    def wait(self, after: int, timeout: float | None = None) -> StopEvent | None:
        """The first stop after the one numbered `after`, once it happens (None: not within `timeout`)."""
        with self._cond:
            self._cond.wait_for(lambda: self.serial > after and self._stopped, timeout)
            return self.event if self.serial > after and self._stopped else None

    # ---- breakpoints and watchpoints (any thread; the work on the CPU thread) -------------------------------

    def insert_breakpoint(self, address: int, space: AddressSpace | None = None) -> None:
        """A software breakpoint: the machine stops before any CPU runs the instruction at `address` (of a
        process's `space`: only a CPU with that space loaded). Raises MachineError where there is no code to stop
        in (the caller checks instruction boundaries, and for a process that the address is in one of its
        executable areas: its page may not have been faulted in yet, which a code hook does not need)."""
        self._check_code(address, space)
        root = None if space is None else space.root

        def insert(uc: Uc) -> None:
            owners = self._owners.setdefault(address, {})
            if root in owners:
                return
            owners[root] = space
            if address not in self._breakpoints:
                self._breakpoints[address] = uc.hook_add(UC_HOOK_CODE, self._on_breakpoint, None, address, address)
            self.cpu.remove_cache(address, 1, space)  # translated code gets the hook when translated again

        self._sched.run_on_cpu(insert)

    def remove_breakpoint(self, address: int, space: AddressSpace | None = None) -> None:
        root = None if space is None else space.root

        def remove(uc: Uc) -> None:
            owners = self._owners.get(address, {})
            if root not in owners:
                return
            del owners[root]
            if not owners:
                del self._owners[address]
                self.cpu.delete_hook(self._breakpoints.pop(address), code_at=address)
                self.cpu.remove_cache(address, 1, space)

        self._sched.run_on_cpu(remove)

    def insert_hardware(self, kind: int, address: int, size: int, space: AddressSpace | None = None) -> None:
        """An instruction breakpoint (`kind` EXECUTE, size 1) or a watchpoint (WRITE, READ_WRITE) over
        [address, address + size) on the debug registers: an unaligned or odd-sized range takes one register per
        aligned piece, as x86's debuggers split it. `space`: a process's, whose code (only a CPU with it loaded
        stops) or data (the frames it maps there) it is. Raises WatchpointError when the registers free do not
        suffice or the memory is not mapped."""
        if kind == EXECUTE:
            self._check_code(address, space)
            pieces = [(address, 1)]
        else:
            pieces = aligned_pieces(address, size)
        if len(pieces) > COUNT:
            raise WatchpointError(f"{size} bytes at {address:#x} need {len(pieces)} debug registers; x86 has "
                                  f"{COUNT}")
        root = None if space is None else space.root
        key = (kind, address, size, root)

        def insert(uc: Uc) -> None:
            if key in self._hardware:
                return
            registers = self.debug_registers
            taken: list[int] = []
            try:
                for piece, length in pieces:
                    slot = registers.free_slot()
                    if slot is None:
                        raise WatchpointError(busy_message(registers, len(pieces)))
                    registers.set(slot, piece, length, kind, self._on_debug_register, space=space)
                    taken.append(slot)
            except WatchpointError:
                registers.release(taken)
                raise
            self._hardware[key] = taken
            self._slot_roots.update(dict.fromkeys(taken, root))

        self._sched.run_on_cpu(insert)

    def remove_hardware(self, kind: int, address: int, size: int, space: AddressSpace | None = None) -> None:
        root = None if space is None else space.root

        def remove(uc: Uc) -> None:
            slots = self._hardware.pop((kind, address, size, root), None)
            if slots:
                self.debug_registers.release(slots)
                for slot in slots:
                    self._slot_roots.pop(slot, None)

        self._sched.run_on_cpu(remove)

    def clear(self) -> None:
        """Every breakpoint and watchpoint of the debugger goes (the tracer's watches stay). Nothing to do, no trip
        to the CPU thread (a debugger that leaves without having set any is let go at once)."""
        if not self._breakpoints and not self._hardware:
            return

        def clear(uc: Uc) -> None:
            for address, hook in self._breakpoints.items():
                self.cpu.delete_hook(hook, code_at=address)
            for address, owners in self._owners.items():
                for space in owners.values():
                    self.cpu.remove_cache(address, 1, space)
            self._breakpoints, self._owners = {}, {}
            slots = [slot for taken in self._hardware.values() for slot in taken]
            self._hardware, self._slot_roots = {}, {}
            if slots:
                self.debug_registers.release(slots)

        self._sched.run_on_cpu(clear)

    def _check_code(self, address: int, space: AddressSpace | None = None) -> None:
        if MODULE_BASE <= address < MODULE_BASE + MODULE_SIZE:
            raise MachineError(f"{address:#x} is in module space, the stub's own code (tracepoint detours, "
                               "compiled expressions): the machine cannot stop there")
        if space is not None:
            if kernel_half(address):
                raise MachineError(f"{address:#x} is a kernel address, not one of a process's")
            return  # the caller found it in an executable area of the process, whose page may not be there yet
        if not self._sched.run_on_cpu(lambda uc: self.cpu.memory.executable(address)):
            raise MachineError(f"{address:#x} is not mapped as code in the kernel's address space (no process maps "
                               "it)")

    def _in_space(self, uc: Uc, root: int | None) -> bool:
        """Does the loaded CPU run in the space of this root (None: the kernel's address, the same in all)?"""
        return root is None or uc.reg_read(X.UC_X86_REG_CR3) & PTE_ADDRESS == root

    # ---- the hooks (CPU thread, inside emulation) ------------------------------------------------------------

    def _taken(self) -> bool:
        """May a breakpoint stop the machine now? Not twice in a run, not during Machine.call, not while the tracer
        single-steps the CPU (while-stepping, a watchpoint's replay)."""
        return self._pending is None and not self._quiet and not self.cpu.regs.read(X.UC_X86_REG_EFLAGS) & EFLAGS_TF

    def _on_breakpoint(self, uc: Uc, address: int, _size: int, _data: object) -> None:
        owners = self._owners.get(address)
        if owners and self._taken() and any(self._in_space(uc, root) for root in owners):
            self._pending = (Reason.BREAKPOINT, self._sched.current_cpu, address, 0)
            uc.emu_stop()  # from a code hook: before the instruction runs

    def _on_debug_register(self, uc: Uc, slot: int) -> None:
        watch = self.debug_registers.slots[slot]
        if watch is None or self._pending is not None or self._quiet:
            return
        if watch.kind == EXECUTE:
            if self.cpu.regs.read(X.UC_X86_REG_EFLAGS) & EFLAGS_TF:
                return
            if not self._in_space(uc, self._slot_roots.get(slot)):
                return  # another process's code at the address
            self._pending = (Reason.HARDWARE_BREAKPOINT, self._sched.current_cpu, watch.address, EXECUTE)
            uc.emu_stop()  # a code hook: before the instruction
        else:
            self._pending = (Reason.WATCHPOINT, self._sched.current_cpu, watch.address, watch.kind)
            self.cpu.stopper.request()  # after the instruction: at the next block, whichever hook this is

    # ---- the scheduler's side (CPU thread, between runs) ------------------------------------------------------

    @property
    def stop_wanted(self) -> bool:
        """A stop is asked for or met and waits for a clean point."""
        return self._stop_requested or self._pending is not None

    def allows(self, index: int) -> bool:
        """May CPU `index` run (the machine is not stopped, and the resumption includes it)?"""
        return not self._stopped and (self._allowed is None or index in self._allowed)

    def settle(self, clean: bool) -> bool:
        """At the top of the CPU thread's loop: enter the stop asked for or met, if the loaded CPU is at a `clean`
        point. True while the machine is stopped (no CPU runs)."""
        if self._stopped:
            return True
        if not clean:
            return False
        pending = self._pending
        if pending is not None:
            self._enter(pending[0], pending[1], pending[2], pending[3])
        elif self._stop_requested:
            self._enter(Reason.REQUEST, self._sched.current_cpu)
        return self._stopped

    def stepping(self, index: int) -> bool:
        step = self._step
        return step is not None and step.cpu == index

    def masks_interrupts(self, index: int, halted: bool) -> bool:
        """A stepped CPU takes no interrupt (QEMU's SSTEP_NOIRQ), unless halted: then one wakes it."""
        return self.stepping(index) and not halted

    def woke(self, index: int) -> None:
        """The stepped CPU, halted, took an interrupt: the step ends at the handler's first instruction."""
        if self.stepping(index):
            self._pending = (Reason.STEP, index, 0, 0)

    def step_turn(self, index: int) -> Stop:
        """The stepped CPU's turn (it is loaded and not halted): one instruction, or instructions while RIP stays in
        the step's range. A turn of a range step ends early when the scheduler has something to do (a request, a
        stop, another CPU's turn); the step goes on at the CPU's next turn."""
        step = self._step
        assert step is not None and step.cpu == index
        with self._cond:
            self.stepping_now = True
        try:
            return self._step_turn(step, index)
        finally:
            with self._cond:
                self.stepping_now = False

    def _step_turn(self, step: _Step, index: int) -> Stop:
        """A run ends after one instruction, never before it (no stop request reaches it: the block stopper would
        end it before the instruction, indistinguishable from `jmp .`); the scheduler is asked between them."""
        cpu, sched = self.cpu, self._sched
        while True:
            rip = cpu.rip
            halts = cpu.read_byte(rip) == HLT
            stop = cpu.run(count=1)
            if self._pending is None:
                stop = self._leave_stub_code(stop)
            if self._pending is not None:
                return stop
            if halts and cpu.rip == rip + 1:
                stop = Stop.HALT  # the step was the hlt: the CPU sleeps until an interrupt
            low, high = step.within or (0, 0)
            if stop is Stop.HALT or not low <= cpu.rip < high:
                self._pending = (Reason.STEP, index, 0, 0)
                return stop
            if self._stop_requested or sched.busy:
                return stop

    def _leave_stub_code(self, stop: Stop) -> Stop:
        """After a stepped instruction: run on through the stub's code it led into (a probe's detour or
        out-of-line copy) and the tracer's single steps (while-stepping), back to the kernel's code."""
        cpu = self.cpu
        while self._pending is None:
            if MODULE_BASE <= cpu.rip < MODULE_BASE + MODULE_SIZE:
                cpu.stopper.stop_outside(MODULE_BASE, MODULE_BASE + MODULE_SIZE)
                stop = cpu.run(keep_stop_request=True)
                cpu.stopper.clear()
            elif cpu.regs.read(X.UC_X86_REG_EFLAGS) & EFLAGS_TF:
                stop = cpu.run(count=1)
            else:
                break
        return stop

    # ---- entering and leaving the stop (CPU thread) -----------------------------------------------------------

    def _enter(self, reason: Reason, cpu: int, address: int = 0, kind: int = 0) -> None:
        with self._cond:
            self.serial += 1
            self.event = StopEvent(reason, cpu, address, kind, self.serial)
            self._stopped = True
            self._stop_requested = False
            self._pending = None
            self._step = None
            self._allowed = None
            self._cond.notify_all()
        self.clock.freeze()
        event = self.event
        for listener in list(self.listeners):
            listener(event)

    def _apply_tsc_offset(self) -> None:
        """Every CPU's `tsc_offset` = the clock's, so that `rdtsc` skips the time the machine stood still: the
        loaded CPU's context and the saved ones of the others (switching CPUs restores a saved context)."""
        field = self._tsc_field
        if field is None:
            return
        offset = self.clock.tsc_offset
        uc, sched = self.cpu.uc, self._sched
        for slot in sched.slots:
            if slot.index != sched.current_cpu:
                write_context_u64(slot.context, field, offset)
        context = uc.context_save()
        write_context_u64(context, field, offset)
        uc.context_restore(context)
