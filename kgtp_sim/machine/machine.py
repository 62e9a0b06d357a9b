"""The machine: its CPUs on one thread, a timer per CPU, idle sleeping, and coherent access for the debugger.

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
cpu.BlockStopper); the CPU thread runs the posted functions (so a read never sees half an instruction's
effects) and resumes. A ticker thread does the same for timer ticks. The request is a flag that stays set
until the CPU thread clears it on entering emulation, so it cannot be lost; posters still repeat it while
they wait (every 2 ms), which costs nothing.

Idle. `hlt` ends `emu_start`; the CPU thread then sleeps on a condition variable until a tick or a request,
so an idle kernel costs no host CPU beyond its ticks.

Before `start()` (tests, the benchmark) there is no thread: every call runs directly on the caller's thread.

Why this module is long: it is the machine's whole public API (start and stop, coherent memory and registers,
allocation of module and vmalloc space, calls, counting, statistics), every part of it built on the same
request-to-the-CPU-thread mechanism.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from unicorn import Uc, UcError
from unicorn import x86_const as X

from . import smp
from .cpu import ARGUMENT_REGISTERS, EFLAGS_TF, REGISTER_IDS, Cpu, Stop
from . import process
from .devices import Devices
from .process import Processes
from .errors import MachineError, MemoryFault
from .image import KernelImage
from .layout import (
    MODULE_BASE,
    MODULE_SIZE,
    PAGE_SIZE,
    VMALLOC_BASE,
    VMALLOC_SIZE,
    RegionAllocator,
    page_ceil,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

TIMER_VECTOR = 32
TRAP_VECTORS = (0, 3, 6)
DEFAULT_PACE = 100
PACE_SYMBOL = "kgtp_test_pace"  #: kernel global: kgtp_test_function calls per tick by the workload thread
CALL_STACK_SIZE = 64 * 1024
_KICK_RETRY_S = 0.002
SLICE_S = 0.002  #: a CPU's turn while another one could run (and how often a pending interrupt is retried)
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class MachineStats:
    """What `monitor stats` shows. Kernel-side figures are read from the kernel's own globals when present."""

    state: str  #: "stopped" (not started), "running", "idle", "halted", or "crashed: <why>"
    instructions: int  #: executed while counting was on (exact; -1 if the counter is unavailable)
    uptime_s: float
    idle_s: float  #: host time spent asleep in hlt
    hz: int
    pace: int
    ticks: int  #: timer interrupts delivered to CPU 0 (the one that advances jiffies)
    ticks_missed: int  #: ticks that came while the previous one still waited (the kernel lost them)
    jiffies: int
    context_switches: int
    syscalls: int  #: int $0x80 delivered
    page_faults: int  #: #PF delivered to the kernel
    traps: int  #: #DE, #BP, #UD delivered to the kernel
    demand_pages_mapped: int  #: demand frames the kernel holds (each mapped at one of its demand pages)
    breakpoint_hits: int  #: int3 taken by the stub's breakpoint table
    fault_fixups: int  #: faults in stub code resolved by the fixup table
    cpus: int = 1  #: CPUs of the machine
    cpus_online: int = 1  #: CPUs the kernel has started
    ticks_per_cpu: tuple[int, ...] = ()  #: timer interrupts delivered to each CPU
    ipis: int = 0  #: inter-processor interrupts sent
    yields: int = 0  #: turns given up through the yield port
    cpu_switches: int = 0  #: times the CPU thread went from one CPU to another


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


class Machine:
    """A simulated x86_64 machine of `cpus` CPUs (1..8) running `image`."""

    def __init__(self, image: KernelImage, hz: int = 100, pace: int = DEFAULT_PACE, cpus: int = 1) -> None:
        if not 1 <= cpus <= smp.MAX_CPUS:
            raise ValueError(f"cpus must be between 1 and {smp.MAX_CPUS}, not {cpus}")
        self.image = image
        self.devices = Devices(self._alloc_frame, self._free_frame)
        self.cpu = Cpu(image, self._port_out, self._port_in)
        #: programs on the kernel: the initramfs, starting them, their streams and ends (process.py)
        self.processes = Processes(self)
        self.cpu_count = cpus
        #: the CPU whose registers are in the unicorn instance: the one that runs, whose hooks run
        self.current_cpu = 0
        self._slots = self._boot_slots(cpus)
        self._rotate = False
        self._ipis = 0
        self._yields = 0
        self._switches = 0
        #: int3 address -> handler(uc), consulted before the kernel's #BP (see cpu.py)
        self.breakpoints = self.cpu.breakpoints
        #: stub-code ranges -> handler(uc, fault_address), consulted before the kernel's #PF (see cpu.py)
        self.fault_fixups = self.cpu.fault_fixups
        self._code = RegionAllocator(MODULE_BASE, MODULE_SIZE, 16)
        self._aligned: dict[int, int] = {}  # alloc_code(data_pages=...) address -> the allocation
        self._data = RegionAllocator(VMALLOC_BASE, VMALLOC_SIZE, 16)
        self._call_frame: tuple[int, int] | None = None  # (stack top, return sentinel) for call()

        self._cond = threading.Condition()
        self._requests: list[_Request] = []
        self._kicked = False
        self._in_emu = False
        self._stopping = False
        self._crash: str | None = None
        self._thread: threading.Thread | None = None
        self._ticker: threading.Thread | None = None
        self._ticker_wake = threading.Event()
        self._started_at: float | None = None
        self._idle_s = 0.0
        self._ticks = 0
        self._ticks_missed = 0

        self.hz = 0
        self.set_hz(hz)
        self.pace = 0
        self.set_pace(pace)

    # ---- lifecycle ---------------------------------------------------------------------------------------

    @property
    def uc(self) -> Uc:
        return self.cpu.uc

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Boot: the kernel runs from now on, on its own thread, until shutdown()."""
        if self._thread is not None:
            raise MachineError("machine already started")
        self._started_at = time.monotonic()
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

    def __enter__(self) -> Machine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- the CPUs ---------------------------------------------------------------------------------------------

    def _boot_slots(self, cpus: int) -> list[_Slot]:
        """Every CPU in the bootloader's state, GS base on its per-CPU area (smp.py); CPU 0 loaded, at the entry,
        the others offline until the kernel starts them (port 0xe1)."""
        uc = self.cpu.uc
        slots = []
        for index in range(cpus):
            uc.reg_write(X.UC_X86_REG_GS_BASE, smp.per_cpu_area(self.image, index))
            slots.append(_Slot(index, uc.context_save(), online=index == 0))
        uc.context_restore(slots[0].context)
        return slots

    def _load(self, index: int) -> None:
        """Put CPU `index`'s registers in the unicorn instance (on the CPU thread, outside emulation)."""
        if index == self.current_cpu:
            return
        if self.cpu.in_emulation:
            raise MachineError("CPUs can be switched only between emulation runs, not from a hook")
        uc = self.cpu.uc
        uc.context_update(self._slots[self.current_cpu].context)
        slot = self._slots[index]
        uc.context_restore(slot.context)
        self.current_cpu = index
        self._switches += 1
        if slot.start_at is not None:
            uc.reg_write(X.UC_X86_REG_RIP, slot.start_at)
            uc.reg_write(X.UC_X86_REG_RDI, index)
            slot.start_at = None

    def _port_out(self, port: int, size: int, value: int, rdi: int) -> None:
        if port in process.PORTS:
            self.processes.port_out(port, value, rdi)
        elif port not in smp.SMP_PORTS:
            self.devices.port_out(port, size, value, rdi)
        elif port == smp.PORT_SMP_START:
            if 0 < value < self.cpu_count and not self._slots[value].online:
                with self._cond:
                    slot = self._slots[value]
                    slot.start_at, slot.online = rdi, True
                log.info("CPU %d started at %#x", value, rdi)
        elif port == smp.PORT_SMP_IPI:
            target, vector = value >> 8 & 0xFF, value & 0xFF
            if target < self.cpu_count and self._slots[target].online:
                with self._cond:
                    self._slots[target].vectors.append(vector)
                    self._ipis += 1
                    self._cond.notify_all()
                self.cpu.stopper.request()  # served at the next block: the target may be this CPU
        elif port == smp.PORT_SMP_YIELD:
            self._yields += 1
            if self.cpu_count > 1:
                self._rotate = True
                self.cpu.stopper.request()

    def _port_in(self, port: int, size: int) -> int:
        if port == smp.PORT_SMP_CPUS:
            return self.cpu_count
        return self.devices.port_in(port, size)

    def _in_stub_code(self) -> bool:
        """Is the loaded CPU running the stub's code (or single-stepping), where it must not be switched out nor
        interrupted?"""
        regs = self.cpu.regs
        rip = regs.read(X.UC_X86_REG_RIP)
        return MODULE_BASE <= rip < MODULE_BASE + MODULE_SIZE or bool(regs.read(X.UC_X86_REG_EFLAGS) & EFLAGS_TF)

    def _choose(self, rotate: bool) -> _Slot | None:
        """The CPU to run next, loaded: the next runnable one after the current when its turn is over (`rotate`)
        or it cannot run, else the current one. None: no CPU can run."""
        current = self._slots[self.current_cpu]
        if current.runnable() and rotate and self._in_stub_code():
            self._rotate = True  # its turn ends where the kernel's code resumes
            return current
        if current.runnable() and not rotate:
            return current
        count = self.cpu_count
        for step in range(1, count + 1):
            slot = self._slots[(self.current_cpu + step) % count]
            if slot.runnable():
                self._load(slot.index)
                return slot
        return None

    def _deliver_pending(self, slot: _Slot) -> None:
        """The loaded CPU's waiting tick or IPI, if it takes interrupts now (one: the handler runs with IF off)."""
        if not (slot.tick_pending or slot.vectors):
            return
        if self.cpu.interrupts_enabled():
            with self._cond:
                if slot.tick_pending:
                    vector, slot.tick_pending = TIMER_VECTOR, False
                    slot.ticks += 1
                    if slot.index == 0:
                        self._ticks += 1
                else:
                    vector = slot.vectors.pop(0)
            self.cpu.deliver(vector)
            slot.halted = False
        elif slot.halted:  # cli; hlt: nothing will ever take these
            with self._cond:
                slot.tick_pending = False
                slot.vectors.clear()

    def _others_runnable(self) -> bool:
        return any(slot.runnable() for slot in self._slots if slot.index != self.current_cpu)

    # ---- the CPU thread ----------------------------------------------------------------------------------

    def _cpu_loop(self) -> None:
        cpu = self.cpu
        while True:
            with self._cond:
                while not (self._stopping or self._requests or (not self._crash and any(
                        slot.runnable() for slot in self._slots))):
                    idle_since = time.monotonic()
                    self._cond.wait()
                    self._idle_s += time.monotonic() - idle_since
                if self._stopping:
                    return
                requests, self._requests = self._requests, []
                self._kicked = False
                rotate, self._rotate = self._rotate, False
            for request in requests:
                request.execute(cpu.uc)
            if self._crash:
                continue
            try:
                slot = self._choose(rotate)
                if slot is None:
                    continue
                self._deliver_pending(slot)
            except MachineError as error:
                self._crashed(error)
                continue
            if slot.halted:
                continue
            with self._cond:
                if self._requests or self._stopping or self._kicked:
                    continue
                self._in_emu = True
                cpu.stopper.clear()  # every stop asked so far was served; a later kick sets it again
                if (slot.tick_pending or slot.vectors or self._rotate or self._others_runnable()) and \
                        MODULE_BASE <= cpu.rip < MODULE_BASE + MODULE_SIZE:
                    # an interrupt or another CPU waits while the stub's code runs (interrupts off): take the
                    # turn where the kernel's code resumes
                    cpu.stopper.stop_outside(MODULE_BASE, MODULE_BASE + MODULE_SIZE)
            try:
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
        self._crash = f"{type(error).__name__}: {error}" if not isinstance(error, MachineError) else str(error)
        log.error("machine stopped: %s", self._crash)

    def _kick(self) -> None:
        """Make the CPU thread come round its loop soon: a stop at the next block boundary if it is emulating."""
        with self._cond:
            self._kicked = True
            if self._in_emu:
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
                    for slot in self._slots:
                        if slot.online:
                            if slot.tick_pending and slot.index == 0:
                                self._ticks_missed += 1
                            slot.tick_pending = True
                self._kick()
            if now >= next_slice:
                next_slice = now + SLICE_S
                with self._cond:
                    if not self._in_emu:
                        continue
                    waiting = self._slots[self.current_cpu]
                    turn_over = self._others_runnable()
                    if not (turn_over or waiting.tick_pending or waiting.vectors):
                        continue
                    self._rotate = self._rotate or turn_over
                self._kick()

    # ---- access from other threads -----------------------------------------------------------------------

    def run_on_cpu(self, fn: Callable[[Uc], T]) -> T:
        """Run fn(uc) on the CPU thread between two instructions and return its result (or raise its error)."""
        thread = self._thread
        if thread is None or threading.current_thread() is thread or not thread.is_alive():
            return fn(self.uc)
        request = _Request(fn)
        with self._cond:
            self._requests.append(request)
        self._kick()
        while not request.done.wait(_KICK_RETRY_S):
            if not thread.is_alive():
                raise MachineError("the machine has shut down")
            self._kick()
        if request.error is not None:
            raise request.error
        return request.result

    def read_memory(self, address: int, length: int) -> bytes:
        """Read guest memory at an instruction boundary. Raises MemoryFault if any byte is unmapped."""
        if length == 0:
            return b""

        def read(uc: Uc) -> bytes:
            try:
                return bytes(uc.mem_read(address, length))  # through the page tables (paging.PagedUc)
            except UcError:
                raise MemoryFault(address, length) from None

        return self.run_on_cpu(read)

    def write_memory(self, address: int, data: bytes) -> None:
        """Write guest memory and drop any translated code over the range, so patched code runs as patched."""
        if not data:
            return

        def write(uc: Uc) -> None:
            try:
                uc.mem_write(address, bytes(data))  # through the page tables; text is written as a debugger does
            except UcError:
                raise MemoryFault(address, len(data), write=True) from None
            self.cpu.remove_cache(address, len(data))

        self.run_on_cpu(write)

    def on_cpu(self, index: int | None, fn: Callable[[Uc], T], stay: bool = True) -> T:
        """Run fn(uc) on the CPU thread with CPU `index`'s registers loaded (None: whichever is loaded). The CPU
        stays loaded (a `call` then runs on it) unless stay=False."""
        if index is not None and not 0 <= index < self.cpu_count:
            raise ValueError(f"no CPU {index}: the machine has {self.cpu_count}")

        def run(uc: Uc) -> T:
            before = self.current_cpu
            if index is not None:
                self._load(index)
            try:
                return fn(uc)
            finally:
                if not stay:
                    self._load(before)

        return self.run_on_cpu(run)

    def registers(self, cpu: int | None = None) -> dict[str, int]:
        """A CPU's registers, named as in kgtp_sim/arch/amd64.py (rax … r15, rip, eflags, cs ss ds es fs gs);
        cpu=None: the loaded CPU's (the one whose hooks run)."""
        return self.on_cpu(cpu, lambda uc: self.cpu.registers(), stay=False)

    def set_registers(self, values: dict[str, int], cpu: int | None = None) -> None:
        """Write some registers (names as in `registers()`) of a CPU (None: the loaded one)."""
        unknown = set(values) - set(REGISTER_IDS)
        if unknown:
            raise KeyError(f"unknown registers: {', '.join(sorted(unknown))}")

        def write(uc: Uc) -> None:
            for name, value in values.items():
                uc.reg_write(REGISTER_IDS[name], value & _MASK64)

        self.on_cpu(cpu, write, stay=False)

    def current_task(self, cpu: int | None = None) -> int:
        """The kernel's `current` on a CPU (None: the loaded one): its per-CPU `current_task`."""
        return self.on_cpu(cpu, smp.current_task, stay=False)

    def cpu_rips(self) -> list[int]:
        """Where every CPU is (on the CPU thread, between instructions): the loaded one's RIP, the others' saved
        ones. A CPU the kernel has not started yet counts too: its RIP is where it will start."""
        rips = []
        for slot in self._slots:
            if slot.index == self.current_cpu and slot.start_at is None:
                rips.append(self.cpu.rip)
            else:
                rips.append(slot.start_at if slot.start_at is not None else
                            slot.context.reg_read(X.UC_X86_REG_RIP))
        return rips

    def synchronize(self) -> None:
        """text_poke_sync: return once every CPU is at an instruction boundary and will fetch its next
        instruction from memory as it is now. With the CPUs interleaved on one emulator this is one trip to
        the CPU thread (while it runs a request, no CPU is inside an instruction, and a patched range's
        translated code was dropped by whoever patched it: the one translation cache serves every CPU)."""
        self.run_on_cpu(lambda uc: None)

    def cpu_states(self) -> list[smp.CpuState]:
        """Every CPU as of one instant: running, idle (in hlt) or offline, where it is, the task it runs."""
        def gather(uc: Uc) -> list[smp.CpuState]:
            states, loaded = [], self.current_cpu
            for slot in self._slots:
                self._load(slot.index)
                state = "offline" if not slot.online else "idle" if slot.halted else "running"
                states.append(smp.CpuState(slot.index, state, self.cpu.rip, smp.current_task(uc)))
            self._load(loaded)
            return states

        return self.run_on_cpu(gather)

    def read_symbol(self, name: str, size: int | None = None, signed: bool = False) -> int:
        """Current value of a kernel global (its ELF size unless `size` is given)."""
        sym = self.image.symbols[name]
        size = size or sym.size or 8
        return int.from_bytes(self.read_memory(sym.address, size), "little", signed=signed)

    def console_text(self) -> str:
        return self.devices.console_text()

    def console_write(self, data: bytes) -> None:
        """Print on the kernel's console from the host (a tracepoint's printk); call on the CPU thread."""
        self.run_on_cpu(lambda uc: self.devices.console_write(data))

    # ---- settings ----------------------------------------------------------------------------------------

    def set_hz(self, hz: int) -> None:
        """Timer tick rate, 1..10000 Hz; takes effect from the next tick."""
        if not 1 <= hz <= 10000:
            raise ValueError(f"hz must be between 1 and 10000, not {hz}")
        self.hz = hz
        self._period = 1.0 / hz
        self._ticker_wake.set()

    def set_pace(self, pace: int) -> None:
        """kgtp_test_function calls per tick by the kernel's workload thread (kernel global kgtp_test_pace)."""
        if pace < 0:
            raise ValueError(f"pace must not be negative, not {pace}")
        sym = self.image.symbols.get(PACE_SYMBOL)
        if sym is not None:
            self.write_memory(sym.address, pace.to_bytes(sym.size or 8, "little"))
        self.pace = pace

    # ---- stub-owned memory -------------------------------------------------------------------------------

    def alloc_code(self, length: int, data_pages: int = 0) -> int:
        """Executable memory in module space (detours, compiled expressions). Contents start zeroed.

        With `data_pages`, the allocation starts on a page boundary with that many no-execute pages, for data
        the code reaches RIP-relative (a detour's counters): the emulator stores to a page it may execute the
        slow way, every time, and drops translated code of a page its guest writes."""
        size = length + data_pages * PAGE_SIZE
        raw = self._code.alloc(size + (PAGE_SIZE - 1 if data_pages else 0))
        address = page_ceil(raw) if data_pages else raw

        def map_pages(uc) -> None:
            end = raw + self._code.size_of(raw)
            data_end = address + data_pages * PAGE_SIZE
            if data_pages:
                self.cpu.map_stub_pages(address, data_end - address, data=True)
                if raw < address:
                    self.cpu.map_stub_pages(raw, address - raw)
            self.cpu.map_stub_pages(data_end, end - data_end)

        self.run_on_cpu(map_pages)
        self.write_memory(raw, bytes(self._code.size_of(raw)))
        if data_pages:
            self._aligned[address] = raw
        return address

    def free_code(self, address: int) -> None:
        self._code.free(self._aligned.pop(address, address))

    def alloc_data(self, length: int) -> int:
        """Read-write memory in vmalloc space (trace buffer, agent contexts). Contents start zeroed."""
        address = self._data.alloc(length)
        self.run_on_cpu(lambda uc: self.cpu.map_stub_pages(address, self._data.size_of(address)))
        self.write_memory(address, bytes(self._data.size_of(address)))
        return address

    def free_data(self, address: int) -> None:
        self._data.free(address)

    # ---- running a kernel function -----------------------------------------------------------------------

    def call(self, target: str | int, *args: int, max_instructions: int | None = None) -> int:
        """Run a kernel function to completion with SysV arguments; returns %rax (unsigned 64-bit).

        No timer interrupt is injected meanwhile, so the run is deterministic (the benchmark relies on it);
        with `max_instructions`, instructions are counted for the call's duration (see `set_counting`);
        exceptions are still delivered through the IDT. The CPU state is restored afterwards; memory is not.
        On a started machine the kernel pauses for the duration of the call.
        """
        address = self.image.address_of(target) if isinstance(target, str) else target
        if len(args) > len(ARGUMENT_REGISTERS):
            raise ValueError(f"at most {len(ARGUMENT_REGISTERS)} register arguments")
        if self._call_frame is None:
            stack = self.alloc_data(CALL_STACK_SIZE)
            # never executed: emulation ends when RIP gets there. Not at its block's first byte: when a run ends,
            # unicorn invalidates the code around exit - 1, which must be mapped and executable (cpu.Cpu)
            sentinel = self.alloc_code(32) + 16
            self.write_memory(sentinel, b"\xf4")
            self._call_frame = (stack + CALL_STACK_SIZE, sentinel)
        stack_top, sentinel = self._call_frame

        def run(uc: Uc) -> int:
            saved = uc.context_save()
            # a budget needs the count: switched on for the call if nobody else asked for it
            counted_here = max_instructions is not None and not self.cpu.counter.enabled and self.cpu.counter.enable()
            try:
                for reg, value in zip(ARGUMENT_REGISTERS, args):
                    uc.reg_write(reg, value & _MASK64)
                rsp = stack_top - 8  # as after `call`: return address on a 16-byte aligned stack
                uc.mem_write(rsp, struct.pack("<Q", sentinel))
                uc.reg_write(X.UC_X86_REG_RSP, rsp)
                uc.reg_write(X.UC_X86_REG_RIP, address)
                start = self.cpu.counter.value
                while True:
                    budget = 0
                    if max_instructions is not None:
                        used = self.cpu.counter.value - start if self.cpu.counter.available else 0
                        budget = max_instructions - used
                        if budget <= 0:
                            raise MachineError(f"{target} did not return within {max_instructions} instructions")
                    stop = self.cpu.run(until=sentinel, count=budget)
                    if stop is Stop.UNTIL:
                        return uc.reg_read(X.UC_X86_REG_RAX)
                    if stop is Stop.HALT:
                        raise MachineError(f"{target} executed hlt at {self.cpu.rip - 1:#x}")
                    if stop is Stop.STOPPED and max_instructions is not None and not self.cpu.counter.available:
                        raise MachineError(f"{target} did not return within {max_instructions} instructions")
            finally:
                uc.context_restore(saved)
                if counted_here:
                    self.cpu.counter.disable()

        return self.run_on_cpu(run)

    # ---- figures -----------------------------------------------------------------------------------------

    def instructions(self) -> int:
        """Instructions executed while counting was on (native counter), or -1 if it cannot be installed."""
        return self.cpu.counter.value if self.cpu.counter.available else -1

    @property
    def counting(self) -> bool:
        """Is every executed instruction being counted? Off until someone asks (`set_counting`)."""
        return self.cpu.counter.enabled

    def set_counting(self, on: bool = True) -> bool:
        """Count every executed instruction from now on (on=True), or stop counting (the count is kept).

        The counter is a native hook on every instruction (about 12 ns each), so a serving kernel runs without
        it until the benchmark, `monitor stats`, the soak or a test asks. Switching flushes translated code
        (instrumentation is compiled into it), so the counts of a counted run are exact. Returns whether
        counting is on (False where native hooks are unavailable).
        """
        def switch(_uc: Uc) -> bool:
            if self.cpu.in_emulation:  # a hook: translated code cannot be flushed under the running block
                raise MachineError("counting can be switched only between emulation runs, not from a hook")
            if on:
                return self.cpu.counter.enable()
            self.cpu.counter.disable()
            return False

        return self.run_on_cpu(switch)

    def stats(self, count: bool = True) -> MachineStats:
        """The figures of one instant: gathered on the CPU thread in one trip, so the kernel's counters and the
        machine's own (ticks delivered, instructions) agree with each other.

        Asking for them asks for the instruction count too: the first call switches counting on (`set_counting`)
        and its `instructions` counts from then, so `monitor stats` and the soak's samples see a running count.
        count=False leaves counting as it is (for callers that want only the state)."""
        def gather(_uc: Uc) -> MachineStats:
            if count and not self.cpu.counter.enabled and not self.cpu.in_emulation:
                self.cpu.counter.enable()
            return self._stats_now()

        return self.run_on_cpu(gather)

    def _stats_now(self) -> MachineStats:
        def kernel(name: str) -> int:
            try:
                return self.read_symbol(name) if name in self.image.symbols else 0
            except (MemoryFault, MachineError):
                return 0

        delivered = self.cpu.delivered
        if self._crash:
            state = f"crashed: {self._crash}"
        elif not self.started:
            state = "stopped"
        elif self.devices.power_off_code is not None:
            state = "halted"
        else:
            state = "running" if any(slot.runnable() for slot in self._slots) else "idle"
        return MachineStats(
            state=state,
            instructions=self.instructions(),
            uptime_s=round(time.monotonic() - self._started_at, 3) if self._started_at else 0.0,
            idle_s=round(self._idle_s, 3),
            hz=self.hz,
            pace=self.pace,
            ticks=self._ticks,
            ticks_missed=self._ticks_missed,
            jiffies=kernel("jiffies"),
            context_switches=kernel("nr_context_switches"),
            syscalls=delivered[0x80],
            page_faults=delivered[14],
            traps=sum(delivered[v] for v in TRAP_VECTORS),
            demand_pages_mapped=self.cpu.frames_in_use,
            breakpoint_hits=self.cpu.breakpoint_hits + self.cpu.jumps.hits,
            fault_fixups=self.cpu.fixup_hits,
            cpus=self.cpu_count,
            cpus_online=sum(slot.online for slot in self._slots),
            ticks_per_cpu=tuple(slot.ticks for slot in self._slots),
            ipis=self._ipis,
            yields=self._yields,
            cpu_switches=self._switches,
        )

    # ---- devices -----------------------------------------------------------------------------------------

    def _alloc_frame(self) -> int:
        return self.cpu.alloc_frame()

    def _free_frame(self, frame: int) -> bool:
        return self.cpu.free_frame(frame)
