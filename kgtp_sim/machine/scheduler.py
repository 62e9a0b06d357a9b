"""The machine's CPUs on one thread: which CPU runs, when it is switched out, ticks and IPIs, idle sleeping, and
requests from other threads (`run_on_cpu`).

Owns the CPU thread (`_cpu_loop`), the timer thread (`_tick_loop`), one `_Slot` per CPU, the queue of posted
requests, and the machine's run control for a debugger (`control`, runcontrol.py: the loop asks it whether a CPU
may run, stops there, and runs a stepped CPU through it). `run_on_cpu` and the ticker's `_kick` are called from
any thread; everything else runs on the CPU thread (or on the caller's before `start`).

Several CPUs, interleaved. The machine has one unicorn instance and one register context per CPU (`_Slot`); the
CPU thread runs one CPU at a time and switches between them (uc.context_save/restore, about 3 us) when a slice
ends (SLICE_S, asked by the ticker thread), when the running CPU halts or yields (port 0xe3), never inside a hook
and never while the CPU runs the stub's own code in module space or single-steps: stub code (detours, compiled
expressions, the ring routines, while-stepping) never interleaves with itself, and locked instructions are exact
because only one CPU runs at a time. Memory, the page tables' TLB and the translated code are the one instance's,
so every CPU sees every patch at once. The kernel starts its other CPUs, sends IPIs and yields through the ports
of smp.py; every online CPU gets the timer's ticks.

Threading model. Only the CPU thread touches unicorn while the machine runs. Everyone else posts a function
with `run_on_cpu(fn)`: the poster queues it and asks the CPU's BlockStopper for a stop, which ends emulation at
the next block boundary (never `uc.emu_stop()` from another thread: that can replay half a block, see
stopper.BlockStopper); the CPU thread runs the posted functions (so a read never sees half an instruction's
effects) and resumes. A ticker thread does the same for timer ticks. The request is a flag that stays set
until the CPU thread clears it on entering emulation, so it cannot be lost; posters still repeat it while
they wait (every 2 ms), which costs nothing.

Idle. `hlt` ends `emu_start`; the CPU thread then sleeps on a condition variable until a tick or a request,
so an idle kernel costs no host CPU beyond its ticks. A machine a debugger stopped sleeps the same way, serving
requests; the ticker gives no tick meanwhile (its time stands still: clock.py).

Before `start()` (tests, the benchmark) there is no thread: every call runs directly on the caller's thread.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, TypeVar

from unicorn import UC_CTL_IO_WRITE, UC_CTL_TLB_FLUSH, Uc
from unicorn import x86_const as X

from ..uc_native import old_exception_offset, write_saved_context_int
from . import smp
from .clock import MachineClock
from .cpu import EFLAGS_TF, Cpu, Stop
from .errors import MachineError
from .image import KernelImage
from .layout import MODULE_BASE, MODULE_SIZE
from .runcontrol import RunControl

log = logging.getLogger(__name__)
T = TypeVar("T")

TIMER_VECTOR = 32
_KICK_RETRY_S = 0.002
SLICE_S = 0.002  #: a CPU's turn while another one could run (and how often a pending interrupt is retried)


class _Request:
    def __init__(self, fn: Callable[[Uc], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def execute(self, uc: Uc) -> None:
        try:
            self.result = self.fn(uc)
        except BaseException as error:  # noqa: BLE001 - handed back to the poster
            self.error = error
        finally:
            self.done.set()


class _Slot:
    """One CPU of the machine: its registers while another CPU is loaded, and what waits for it."""

    def __init__(self, index: int, context: Any, online: bool) -> None:
        self.index = index
        self.context = context  #: its registers while another CPU is loaded in the unicorn instance
        self.online = online
        self.start_at: int | None = None  #: the entry the kernel started it at, applied when first loaded
        self.halted = False
        self.tick_pending = False
        self.vectors: list[int] = []  #: IPIs not yet delivered, oldest first
        self.ticks = 0

    def runnable(self) -> bool:
        return self.online and (not self.halted or self.tick_pending or bool(self.vectors))


class Scheduler:
    """The CPU thread and the timer thread of a machine of `cpus` CPUs sharing `cpu`'s unicorn instance."""

    def __init__(self, cpu: Cpu, image: KernelImage, cpus: int, clock: MachineClock) -> None:
        self.cpu = cpu
        self.cpu_count = cpus
        #: the CPU whose registers are in the unicorn instance: the one that runs, whose hooks run
        self.current_cpu = 0
        self.slots = self._boot_slots(image, cpus)
        self._rotate = False
        self.ipis = 0
        self.yields = 0
        self.switches = 0  #: times the CPU thread went from one CPU to another

        self._cond = threading.Condition()
        self._requests: list[_Request] = []
        self._kicked = False
        self._in_emu = False
        #: the CPU thread waits in its loop's wait for work, under `_cond`: a holder of `_cond` that sees it True
        #: has the machine to itself (the CPU thread cannot return from the wait before the lock is released)
        self._parked = False
        self._holder: int | None = None  #: the thread running an fn of `access` while the CPU thread is parked
        self._stopping = False
        self.crash: str | None = None  #: why the machine stopped running the kernel, once it has
        self._thread: threading.Thread | None = None
        self._ticker: threading.Thread | None = None
        self._ticker_wake = threading.Event()
        self._period = 0.01  #: seconds between ticks (`set_period`; the machine sets its hz before `start`)
        self.started_at: float | None = None
        self.idle_s = 0.0  #: host time spent asleep in hlt
        self.ticks = 0  #: timer interrupts delivered to CPU 0
        self.ticks_missed = 0  #: ticks that came while CPU 0's previous one still waited
        self.ticks_held = 0  #: ticks not given because a debugger had stopped the machine
        self.control = RunControl(self, cpu, clock)

    # ---- lifecycle ---------------------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._thread is not None

    def thread_ids(self) -> set[int]:
        """The identities of this machine's CPU and timer threads, once started."""
        return {t.ident for t in (self._thread, self._ticker) if t is not None and t.ident is not None}

    @property
    def on_cpu_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    @property
    def alive(self) -> bool:
        """The CPU thread runs (or was never started: calls run on the caller's thread)."""
        return self._thread is None or self._thread.is_alive()

    @property
    def busy(self) -> bool:
        """Something waits for the CPU thread's loop: a request, a tick or IPI, another CPU's turn, shutdown."""
        return self._kicked or self._rotate or self._stopping

    def start(self) -> None:
        """Boot: the kernel runs from now on, on its own thread, until shutdown()."""
        if self._thread is not None:
            raise MachineError("machine already started")
        self.started_at = time.monotonic()
        self._thread = threading.Thread(target=self._cpu_loop, name="kgtp-cpu", daemon=True)
        self._ticker = threading.Thread(target=self._tick_loop, name="kgtp-timer", daemon=True)
        self._thread.start()
        self._ticker.start()

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._ticker_wake.set()
        if self._thread is not None:
            while self._thread.is_alive():
                self.cpu.stopper.request()
                self._thread.join(0.05)
        if self._ticker is not None:
            self._ticker.join()

    def set_period(self, period: float) -> None:
        """Seconds between ticks, from the next tick."""
        self._period = period
        self._ticker_wake.set()

    # ---- the CPUs ---------------------------------------------------------------------------------------------

    def _boot_slots(self, image: KernelImage, cpus: int) -> list[_Slot]:
        """Every CPU in the bootloader's state, GS base on its per-CPU area (smp.py); CPU 0 loaded, at the entry,
        the others offline until the kernel starts them (port 0xe1)."""
        uc = self.cpu.uc
        slots = []
        for index in range(cpus):
            uc.reg_write(X.UC_X86_REG_GS_BASE, smp.per_cpu_area(image, index))
            slots.append(_Slot(index, uc.context_save(), online=index == 0))
        uc.context_restore(slots[0].context)
        return slots

    def load(self, index: int) -> None:
        """Put CPU `index`'s registers in the unicorn instance (on the CPU thread, outside emulation)."""
        if index == self.current_cpu:
            return
        if self.cpu.in_emulation:
            raise MachineError("CPUs can be switched only between emulation runs, not from a hook")
        uc = self.cpu.uc
        outgoing = self.slots[self.current_cpu].context
        uc.context_update(outgoing)
        # A run a stop request ended just as a fault was raised leaves the fault "in flight" (QEMU's
        # old_exception) without delivering it; the switch drops it (the instruction faults again when its CPU
        # runs), so the CPU must not keep it in flight: its next #PF would be promoted to a double fault.
        offset = old_exception_offset()
        if offset is not None:
            write_saved_context_int(outgoing, offset, -1)
        slot = self.slots[index]
        cr3 = uc.reg_read(X.UC_X86_REG_CR3)
        uc.context_restore(slot.context)
        if uc.reg_read(X.UC_X86_REG_CR3) != cr3:
            # One unicorn CPU stands for every CPU: its TLB holds the outgoing CPU's translations, which a context
            # restore keeps. Another address space loaded (a process on each CPU) must not be reached through
            # them: flushed, as the CR3 write of a real switch would (the kernel half is the same in every space,
            # so a CPU switch between kernel threads, or into the same process, keeps its TLB).
            uc.ctl(UC_CTL_TLB_FLUSH, UC_CTL_IO_WRITE)
        self.current_cpu = index
        self.switches += 1
        if self.cpu.observer is not None:  # the performance counters count on the CPU now loaded
            self.cpu.observer.cpu_loaded(index)
        if slot.start_at is not None:
            uc.reg_write(X.UC_X86_REG_RIP, slot.start_at)
            uc.reg_write(X.UC_X86_REG_RDI, index)
            slot.start_at = None

    def every_cpu(self, fn: Callable[[Uc], None]) -> None:
        """fn(uc) with each CPU's registers loaded in turn (on the CPU thread, between runs: a register only the
        stub sets, such as the call gates' LDTR); the loaded CPU stays loaded, nothing runs meanwhile."""
        if self.cpu.in_emulation:
            raise MachineError("every CPU's registers change only between emulation runs, not from a hook")
        uc = self.cpu.uc
        current = self.slots[self.current_cpu]
        uc.context_update(current.context)
        for slot in self.slots:
            if slot is not current:
                uc.context_restore(slot.context)
                fn(uc)
                uc.context_update(slot.context)
        uc.context_restore(current.context)
        fn(uc)

    def port_out(self, port: int, value: int, rdi: int) -> None:
        """The SMP ports' `out` (smp.py), from a hook on the CPU thread."""
        if port == smp.PORT_SMP_START:
            if 0 < value < self.cpu_count and not self.slots[value].online:
                with self._cond:
                    slot = self.slots[value]
                    slot.start_at, slot.online = rdi, True
                log.info("CPU %d started at %#x", value, rdi)
        elif port == smp.PORT_SMP_IPI:
            target, vector = value >> 8 & 0xFF, value & 0xFF
            if target < self.cpu_count and self.slots[target].online:
                with self._cond:
                    self.slots[target].vectors.append(vector)
                    self.ipis += 1
                    self._cond.notify_all()
                self.cpu.stopper.request()  # served at the next block: the target may be this CPU
        elif port == smp.PORT_SMP_YIELD:
            self.yields += 1
            if self.cpu_count > 1:
                self._rotate = True
                self.cpu.stopper.request()

    def send_interrupt(self, target: int, vector: int) -> None:
        """`vector` for CPU `target` from any thread (an IPI from outside the CPUs: the debugger's requests)."""
        if not 0 <= target < self.cpu_count or not self.slots[target].online:
            raise MachineError(f"CPU {target} is not running")
        with self._cond:
            self.slots[target].vectors.append(vector)
            self.ipis += 1
            self._cond.notify_all()
        self._kick()

    def _in_module_code(self) -> bool:
        """Is the loaded CPU's RIP in module space (the stub's code: detours, out-of-line copies), or in the stub's
        code in a process (`Cpu.process_stub_code`)?"""
        rip = self.cpu.regs.read(X.UC_X86_REG_RIP)
        if MODULE_BASE <= rip < MODULE_BASE + MODULE_SIZE:
            return True
        for start, end, root in self.cpu.process_stub_code:
            if start <= rip < end and self.cpu.regs.read(X.UC_X86_REG_CR3) & ~0xFFF == root:
                return True
        return False

    def _in_stub_code(self) -> bool:
        """Is the loaded CPU running the stub's code (or single-stepping), where it must not be switched out nor
        interrupted?"""
        return self._in_module_code() or bool(self.cpu.regs.read(X.UC_X86_REG_EFLAGS) & EFLAGS_TF)

    def _runnable(self, slot: _Slot) -> bool:
        """Can the CPU run now: it has work, and the debugger lets it run (runcontrol.py)?"""
        return slot.runnable() and self.control.allows(slot.index)

    def _choose(self, rotate: bool) -> _Slot | None:
        """The CPU to run next, loaded: the next runnable one after the current when its turn is over (`rotate`)
        or it cannot run, else the current one. None: no CPU can run."""
        current = self.slots[self.current_cpu]
        if self._runnable(current) and rotate and self._in_stub_code():
            self._rotate = True  # its turn ends where the kernel's code resumes
            return current
        if self._runnable(current) and not rotate:
            return current
        count = self.cpu_count
        for step in range(1, count + 1):
            slot = self.slots[(self.current_cpu + step) % count]
            if self._runnable(slot):
                self.load(slot.index)
                return slot
        return None

    def _deliver_pending(self, slot: _Slot) -> bool:
        """The loaded CPU's waiting tick or IPI, if it takes interrupts now (one: the handler runs with IF off):
        the highest vector first, as the local APIC serves its pending interrupts by priority (the vector's
        class), so the kernel's IPIs (0xf0 and up) go before the timer's tick (TIMER_VECTOR). With the tick always
        first, a CPU that seldom takes interrupts (a program whose every call is a hit stepped in place or a
        while-stepping hit, run with IF off) found a new tick waiting at each chance, and the debugger's reschedule
        IPI, which stops a thread asleep there, waited behind the ticks for tenths of a second while the program
        ran on. True when one was delivered."""
        if not (slot.tick_pending or slot.vectors):
            return False
        if self.cpu.interrupts_enabled():
            with self._cond:
                highest = max(slot.vectors, default=0)
                if highest > TIMER_VECTOR or not slot.tick_pending:
                    slot.vectors.remove(highest)
                    vector = highest
                else:
                    vector, slot.tick_pending = TIMER_VECTOR, False
                    slot.ticks += 1
                    if slot.index == 0:
                        self.ticks += 1
            self.cpu.deliver(vector)
            slot.halted = False
            return True
        if slot.halted:  # cli; hlt: nothing will ever take these
            with self._cond:
                slot.tick_pending = False
                slot.vectors.clear()
        return False

    def any_runnable(self) -> bool:
        return any(self._runnable(slot) for slot in self.slots)

    def _others_runnable(self) -> bool:
        return any(self._runnable(slot) for slot in self.slots if slot.index != self.current_cpu)

    # ---- the CPU thread ----------------------------------------------------------------------------------

    def _has_work(self) -> bool:
        """What ends the CPU thread's wait (under `_cond`)."""
        return bool(self._stopping or self._requests or self.control.stop_wanted or
                    (not self.crash and self.any_runnable()))

    def _cpu_loop(self) -> None:
        cpu, control = self.cpu, self.control
        while True:
            with self._cond:
                while not self._has_work():
                    idle_since = time.monotonic()
                    self._parked = True
                    try:
                        self._cond.wait()
                    finally:
                        self._parked = False
                    if not control.stopped:
                        self.idle_s += time.monotonic() - idle_since
                if self._stopping:
                    return
                requests, self._requests = self._requests, []
                self._kicked = False
                rotate, self._rotate = self._rotate, False
            for request in requests:
                request.execute(cpu.uc)
            if control.settle(clean=self.crash is not None or not self._in_stub_code()) or self.crash:
                continue  # stopped by the debugger (requests are still served), or crashed
            try:
                slot = self._choose(rotate)
                if slot is None:
                    continue
                # no interrupt while the stub's code runs (an int3 hit's out-of-line copy, a detour): the kernel's
                # handler would run in the middle of a hit, and the probed instruction after whatever it schedules
                if not control.masks_interrupts(slot.index, slot.halted) and not self._in_module_code() and \
                        self._deliver_pending(slot):
                    control.woke(slot.index)
            except MachineError as error:
                self._crashed(error)
                continue
            if slot.halted or control.stop_wanted and not self._in_stub_code():
                continue
            one_step = False
            with self._cond:
                if self._requests or self._stopping or self._kicked:
                    continue
                self._in_emu = True
                cpu.stopper.clear()  # every stop asked so far was served; a later kick sets it again
                if MODULE_BASE <= cpu.rip < MODULE_BASE + MODULE_SIZE and (
                        slot.tick_pending or slot.vectors or self._rotate or self._others_runnable() or
                        control.stop_wanted):
                    # an interrupt, another CPU or a stop waits while the stub's code runs (interrupts off): take
                    # the turn where the kernel's code resumes
                    cpu.stopper.stop_outside(MODULE_BASE, MODULE_BASE + MODULE_SIZE)
                elif control.stop_wanted:
                    # the tracer single-steps this CPU (TF): one instruction at a time, counted (a block stop
                    # asked before the run would end it before its first instruction, so the steps, which run
                    # with interrupts off, would never end and the stop never come)
                    one_step = True
                elif (slot.tick_pending or slot.vectors) and not control.masks_interrupts(slot.index, False) \
                        and not cpu.interrupts_enabled():
                    # an interrupt waits and the CPU runs with interrupts off (else it was just taken, and the
                    # handler runs with them off): the run ends where the kernel enables them again. Not with them
                    # on: then the stub's code in a process runs (a pad), where no interrupt is taken; a stop at
                    # its every block would never let it run
                    cpu.stopper.stop_when_interruptible()
            try:
                if control.stepping(slot.index):
                    stop = control.step_turn(slot.index)
                elif one_step:
                    stop = cpu.run(count=1)
                else:
                    stop = cpu.run(keep_stop_request=True)
            except (MachineError, Exception) as error:  # noqa: BLE001 - a crashed kernel stays inspectable
                stop = None
                self._crashed(error)
            finally:
                with self._cond:
                    self._in_emu = False
                    kicked = self._kicked
            # a hlt that coincides with a stop request is treated as a spurious wakeup: the idle loop re-halts
            if stop is Stop.HALT and not kicked:
                slot.halted = True

    def _crashed(self, error: BaseException) -> None:
        self.crash = f"{type(error).__name__}: {error}" if not isinstance(error, MachineError) else str(error)
        log.error("machine stopped: %s", self.crash)

    def _kick(self) -> None:
        """Make the CPU thread come round its loop soon: a stop at the next block boundary if it is emulating."""
        with self._cond:
            self._kicked = True
            if self._in_emu and not self.control.stepping_now:  # a step's runs end after their one instruction
                self.cpu.stopper.request()
            self._cond.notify_all()

    def _tick_loop(self) -> None:
        """Ticks every CPU at `hz`; every SLICE_S, ends the running CPU's turn when another CPU could run, and
        repeats the stop request while an interrupt waits (interrupts were off when the CPU came round)."""
        next_tick = time.monotonic() + self._period
        next_slice = time.monotonic() + SLICE_S
        while not self._stopping:
            now = time.monotonic()
            wake = min(next_tick, next_slice)
            if now < wake:
                self._ticker_wake.wait(wake - now)
                self._ticker_wake.clear()
                next_tick = min(next_tick, time.monotonic() + self._period)  # set_hz() may have shortened it
                continue
            if now >= next_tick:
                next_tick += self._period
                if next_tick < now:  # a slow host drops ticks rather than bursting them
                    next_tick = now + self._period
                with self._cond:
                    held = self.control.stopped  # a stopped machine's time stands still: no tick, none owed
                    if held:
                        self.ticks_held += 1
                    for slot in self.slots if not held else ():
                        if slot.online:
                            if slot.tick_pending and slot.index == 0:
                                self.ticks_missed += 1
                            slot.tick_pending = True
                if not held:
                    self._kick()
            if now >= next_slice:
                next_slice = now + SLICE_S
                with self._cond:
                    if not self._in_emu:
                        continue
                    waiting = self.slots[self.current_cpu]
                    turn_over = self._others_runnable()
                    if not (turn_over or waiting.tick_pending or waiting.vectors):
                        continue
                    self._rotate = self._rotate or turn_over
                self._kick()

    # ---- access from other threads -----------------------------------------------------------------------

    def run_on_cpu(self, fn: Callable[[Uc], T]) -> T:
        """Run fn(uc) on the CPU thread between two instructions and return its result (or raise its error)."""
        return self._post(fn, inline=False)

    def access(self, fn: Callable[[Uc], T]) -> T:
        """run_on_cpu for an `fn` that only reads or writes the machine's state (memory, registers, page tables:
        no emulation, no wait for another thread). Where the CPU thread is parked (idle, or the machine stopped:
        it waits for work), fn runs here instead, under the scheduler's lock, which holds the CPU thread in its
        wait: the same exclusive use of the machine without two thread switches (a debugger's read of a stopped
        process's memory took 0.18 ms through the CPU thread, 80% of it the hand-off). Where fn gave the CPU
        thread work, it is woken to do it."""
        return self._post(fn, inline=True)

    def _post(self, fn: Callable[[Uc], T], inline: bool) -> T:
        thread = self._thread
        if (thread is None or threading.current_thread() is thread or not thread.is_alive()
                or self._holder == threading.get_ident()):  # (a call made by an fn that `access` runs here)
            return fn(self.cpu.uc)
        request = _Request(fn)
        with self._cond:
            if inline and self._parked and not self._requests:
                self._holder = threading.get_ident()
                try:
                    return fn(self.cpu.uc)
                finally:
                    self._holder = None
                    if self._has_work():
                        self._cond.notify_all()
            self._requests.append(request)
        self._kick()
        while not request.done.wait(_KICK_RETRY_S):
            if not thread.is_alive():
                raise MachineError("the machine has shut down")
            self._kick()
        if request.error is not None:
            raise request.error
        return request.result
