"""The machine: its public API, for the stub, the tracer, the tools and the tests.

Owns the kernel image's CPUs (cpu.py, one unicorn instance; their scheduling on the CPU thread: scheduler.py; their
run control for a debugger: runcontrol.py), the machine's clock (clock.py), the devices (devices.py), the stub's
allocations of module and vmalloc space, and the host's access to the machine: memory read and written through an
address space (the kernel's unless a space is named), registers, kernel function calls, counting, statistics.
Every method may be called from any thread: what touches unicorn runs on the CPU thread through `run_on_cpu`
(directly on the caller's before `start()`).
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from unicorn import Uc, UcError
from unicorn import x86_const as X

from ..uc_paging import AddressSpace
from . import process, smp
from .clock import MachineClock
from .counters import PERF_PORTS, Counters
from .cpu import ARGUMENT_REGISTERS, REGISTER_IDS, Cpu, CpuObserver, Stop
from .devices import Devices
from .errors import MachineError, MemoryFault
from .image import KernelImage
from .gates import CallGates
from .int3s import Int3s
from .layout import MODULE_BASE, MODULE_SIZE, PAGE_SIZE, VMALLOC_BASE, VMALLOC_SIZE, RegionAllocator, page_ceil
from .process import Processes
from .runcontrol import RunControl
from .scheduler import Scheduler
from .tracee import PORT_PTRACE, Ptrace
from .watchpoints import DebugRegisters

T = TypeVar("T")

TRAP_VECTORS = (0, 3, 6)
DEFAULT_PACE = 100
PACE_SYMBOL = "kgtp_test_pace"  #: kernel global: kgtp_test_function calls per tick by the workload thread
CALL_STACK_SIZE = 64 * 1024
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class MachineStats:
    """What `monitor stats` shows. Kernel-side figures are read from the kernel's own globals when present."""

    state: str  #: "stopped" (not started), "running", "idle", "halted", "stopped by the debugger", "crashed: <why>"
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
    ticks_held: int = 0  #: ticks not given because a debugger had stopped the machine (its time stood still)


class Machine:
    """A simulated x86_64 machine of `cpus` CPUs (1..8) running `image`."""

    #: machines built ahead of their use (`prepare`), by (kernel file, hz, pace, cpus)
    _prepared: dict[tuple, Machine] = {}

    @classmethod
    def prepare(cls, path: str | Path, hz: int = 100, pace: int = DEFAULT_PACE, cpus: int = 1) -> None:
        """Build a machine of the kernel file at `path` now, not started, for a later `prepared` with the same
        arguments in a fork of this process (warm.py: each fork's server takes the machine its parent built, some
        15 ms of its start; the parent's own copy is never used nor started, so the next fork gets it as built).
        Building one runs no instruction and starts no thread: nothing of it but memory crosses the fork."""
        key = KernelImage.file_key(Path(path))
        if key is not None:
            cls._prepared[(key, hz, pace, cpus)] = cls(KernelImage.load(path), hz=hz, pace=pace, cpus=cpus)

    @classmethod
    def prepared(cls, path: str | Path, hz: int = 100, pace: int = DEFAULT_PACE, cpus: int = 1) -> Machine | None:
        """The machine `prepare` built with these arguments, its clock counting from now, if the kernel file is
        still the one it read; None otherwise (the caller builds its own). Each is handed out once."""
        key = KernelImage.file_key(Path(path))
        machine = cls._prepared.pop((key, hz, pace, cpus), None) if key is not None else None
        if machine is not None:
            machine.clock.restart()
        return machine

    def __init__(self, image: KernelImage, hz: int = 100, pace: int = DEFAULT_PACE, cpus: int = 1) -> None:
        if not 1 <= cpus <= smp.MAX_CPUS:
            raise ValueError(f"cpus must be between 1 and {smp.MAX_CPUS}, not {cpus}")
        self.image = image
        self.cpu = Cpu(image, self._port_out, self._port_in)
        #: the kernel's time (clock port, TSC), which does not run while a debugger stops the machine
        self.clock = MachineClock()
        self.devices = Devices(self.cpu.memory.alloc_frame, self.cpu.memory.free_frame, self.clock,
                               lambda: self._sched.current_cpu)
        #: programs on the kernel: the initramfs, starting them, their streams and ends (process.py)
        self.processes = Processes(self)
        #: the debugger's side of the kernel's ptrace: traced processes, their stops (tracee.py)
        self.ptrace = Ptrace(self)
        self.cpu_count = cpus
        self._sched = Scheduler(self.cpu, image, cpus, self.clock)
        #: the performance counters (counters.py): call on the CPU thread (`run_on_cpu`, or from a hit)
        self.counters = Counters(self.cpu.uc, image, cpus, lambda: self._sched.current_cpu,
                                 lambda: self.cpu.in_emulation, self._observe, self.cpu.delete_hook)
        #: int3 address -> handler(uc), consulted before the kernel's #BP (see cpu.py)
        self.breakpoints = self.cpu.breakpoints
        #: the int3s in processes' memory, the debugger's and the tracer's: the bytes under them (int3s.py)
        self.int3s = Int3s()
        #: stub-code ranges -> handler(uc, fault_address), consulted before the kernel's #PF (see cpu.py)
        self.fault_fixups = self.cpu.fault_fixups
        self._code = RegionAllocator(MODULE_BASE, MODULE_SIZE, 16)
        self._aligned: dict[int, int] = {}  # alloc_code(data_pages=...) address -> the allocation
        self._data = RegionAllocator(VMALLOC_BASE, VMALLOC_SIZE, 16)
        self._call_frame: tuple[int, int] | None = None  # (stack top, return sentinel) for call()
        #: call gates by which a program's code enters the stub's (a compiled hit in a program: gates.py)
        self.gates = CallGates(self.alloc_data, self.alloc_code, self._sched.every_cpu)
        self.cpu.gate_step = self.gates.step_through

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
        return self._sched.started

    def start(self) -> None:
        """Boot: the kernel runs from now on, on its own thread, until shutdown()."""
        self._sched.start()

    def shutdown(self) -> None:
        self._sched.shutdown()

    def __enter__(self) -> Machine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- the CPUs ---------------------------------------------------------------------------------------------

    @property
    def current_cpu(self) -> int:
        """The CPU whose registers are in the unicorn instance: the one that runs, whose hooks run."""
        return self._sched.current_cpu

    def _port_out(self, port: int, size: int, value: int, rdi: int) -> None:
        if port in process.PORTS:
            self.processes.port_out(port, value, rdi)
        elif port == PORT_PTRACE:
            self.ptrace.port_out(value, rdi)
        elif port in smp.SMP_PORTS:
            self._sched.port_out(port, value, rdi)
        elif port in PERF_PORTS:
            self.counters.port_out(port, value)
        else:
            self.devices.port_out(port, size, value, rdi)

    def _port_in(self, port: int, size: int) -> int:
        if port == smp.PORT_SMP_CPUS:
            return self.cpu_count
        if port in PERF_PORTS:
            return self.counters.port_in(port)
        return self.devices.port_in(port, size)

    def _observe(self, observer: CpuObserver | None) -> None:
        """The performance counters start or stop hearing from the CPU (counters.Counters.open / close)."""
        self.cpu.observer = observer

    # ---- access from other threads -----------------------------------------------------------------------

    def thread_ids(self) -> set[int]:
        """The identities of the machine's own threads (its CPU thread and its timer): what tells its log
        records from another machine's in one process."""
        return self._sched.thread_ids()

    def run_on_cpu(self, fn: Callable[[Uc], T]) -> T:
        """Run fn(uc) on the CPU thread between two instructions and return its result (or raise its error)."""
        return self._sched.run_on_cpu(fn)

    def access(self, fn: Callable[[Uc], T]) -> T:
        """run_on_cpu for an fn that only reads or writes the machine's state (no emulation, no waiting): on the
        caller's thread while the CPU thread is parked (Scheduler.access)."""
        return self._sched.access(fn)

    def send_interrupt(self, cpu: int, vector: int) -> None:
        """Raise `vector` on `cpu` from outside, as another CPU's IPI would (the debugger's wake-up of a task)."""
        self._sched.send_interrupt(cpu, vector)

    # ---- run control for a debugger (runcontrol.py) ------------------------------------------------------

    @property
    def control(self) -> RunControl:
        """Stop every CPU, step one, resume; breakpoints and watchpoints that stop the machine."""
        return self._sched.control

    @property
    def debug_registers(self) -> DebugRegisters:
        """The machine's DR0-DR3 (watchpoints.py), shared by the debugger and KGTP's watch tracepoints."""
        return self._sched.control.debug_registers

    # ---- memory, in an address space ----------------------------------------------------------------------

    @property
    def kernel_space(self) -> AddressSpace:
        """The kernel's address space (its page tables): the space of every access that names none."""
        return self.cpu.tables

    def new_space(self) -> AddressSpace:
        """A new address space, as Linux's pgd_alloc makes a process's: the kernel half shared with the kernel's
        space (what the kernel maps there later too), the user half empty. Its pages are mapped on the CPU
        thread with `space.map(virtual, physical, size, flags)` (flags: uc_paging's USER_TEXT, USER_DATA)."""
        return self.run_on_cpu(lambda uc: self.cpu.memory.new_space())

    def cpu_space(self, cpu: int | None = None) -> AddressSpace:
        """The address space CPU `cpu` has loaded (its CR3; None: the loaded CPU's): a process's while the CPU
        runs one of its tasks (or a kernel thread that came after it: the kernel keeps CR3, Linux's lazy TLB),
        else the kernel's. The user half reads as that CPU's code sees it, as QEMU's gdbstub reads memory through
        the selected CPU's page tables."""
        return self.on_cpu(cpu, lambda uc: self.cpu.memory.loaded_space(), stay=False)

    def read_memory(self, address: int, length: int, space: AddressSpace | None = None) -> bytes:
        """Read memory as `space` (None: the kernel's) maps it, at an instruction boundary, through the space's
        own tables whichever space the CPU has loaded (as gdbserver reads a process that is not running).
        Raises MemoryFault if any byte's page is not present; the read maps nothing and leaves the CPU as it
        was."""
        if length == 0:
            return b""
        space = space or self.kernel_space

        def read(uc: Uc) -> bytes:
            try:
                return bytes(space.read(address, length))
            except UcError:
                raise MemoryFault(address, length) from None

        return self.access(read)

    def write_memory(self, address: int, data: bytes, space: AddressSpace | None = None) -> None:
        """Write memory as `space` (None: the kernel's) maps it (read-only text too, as a debugger does) and drop
        any translated code over the range, so patched code runs as patched. Raises MemoryFault, writing
        nothing, if any byte's page is not present."""
        if not data:
            return
        space = space or self.kernel_space

        def write(uc: Uc) -> None:
            try:
                space.write(address, bytes(data))
            except UcError:
                raise MemoryFault(address, len(data), write=True) from None
            self.cpu.remove_cache(address, len(data), space)

        self.access(write)

    def on_cpu(self, index: int | None, fn: Callable[[Uc], T], stay: bool = True) -> T:
        """Run fn(uc) on the CPU thread with CPU `index`'s registers loaded (None: whichever is loaded). The CPU
        stays loaded (a `call` then runs on it) unless stay=False."""
        if index is not None and not 0 <= index < self.cpu_count:
            raise ValueError(f"no CPU {index}: the machine has {self.cpu_count}")

        def run(uc: Uc) -> T:
            before = self.current_cpu
            if index is not None:
                self._sched.load(index)
            try:
                return fn(uc)
            finally:
                if not stay:
                    self._sched.load(before)

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
        for slot in self._sched.slots:
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
            for slot in self._sched.slots:
                self._sched.load(slot.index)
                state = "offline" if not slot.online else "idle" if slot.halted else "running"
                states.append(smp.CpuState(slot.index, state, self.cpu.rip, smp.current_task(uc)))
            self._sched.load(loaded)
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
        self._sched.set_period(1.0 / hz)

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
                self.cpu.memory.map_stub_pages(address, data_end - address, data=True)
                if raw < address:
                    self.cpu.memory.map_stub_pages(raw, address - raw)
            self.cpu.memory.map_stub_pages(data_end, end - data_end)

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
        size = self._data.size_of(address)

        def place(uc: Uc) -> None:
            self.cpu.memory.map_stub_pages(address, size)
            self.cpu.memory.zero_stub_data(address, size)

        self.run_on_cpu(place)
        return address

    def free_data(self, address: int) -> None:
        self._data.free(address)

    # ---- running a kernel function -----------------------------------------------------------------------

    def call(self, target: str | int, *args: int, max_instructions: int | None = None) -> int:
        """Run a kernel function to completion with SysV arguments; returns %rax (unsigned 64-bit).

        No timer interrupt is injected meanwhile, so the run is deterministic (the benchmark relies on it);
        with `max_instructions`, instructions are counted for the call's duration (see `set_counting`);
        exceptions are still delivered through the IDT. The CPU state is restored afterwards; memory is not.
        On a started machine the kernel pauses for the duration of the call, wherever it was, and the call runs
        as the task it paused: a function that takes a lock that task holds spins on it and never returns (make
        such calls from `run_on_cpu` once the lock is seen free there, as tests/machine/test_tlb_flush_memory.py).
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
            with self.control.quiet():  # the debugger's breakpoints are not the caller's business
                return run_quietly(uc)

        def run_quietly(uc: Uc) -> int:
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
            self.cpu.forget_fault_in_flight()  # the counter's hook went: see Cpu.delete_hook
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

        delivered, sched = self.cpu.delivered, self._sched
        if sched.crash:
            state = f"crashed: {sched.crash}"
        elif not self.started:
            state = "stopped"
        elif self.devices.power_off_code is not None:
            state = "halted"
        elif self.control.stopped:
            state = "stopped by the debugger"
        else:
            state = "running" if sched.any_runnable() else "idle"
        return MachineStats(
            state=state,
            instructions=self.instructions(),
            uptime_s=round(time.monotonic() - sched.started_at, 3) if sched.started_at else 0.0,
            idle_s=round(sched.idle_s, 3),
            hz=self.hz,
            pace=self.pace,
            ticks=sched.ticks,
            ticks_missed=sched.ticks_missed,
            jiffies=kernel("jiffies"),
            context_switches=kernel("nr_context_switches"),
            syscalls=delivered[0x80],
            page_faults=delivered[14],
            traps=sum(delivered[v] for v in TRAP_VECTORS),
            demand_pages_mapped=self.cpu.memory.frames_in_use,
            breakpoint_hits=self.cpu.breakpoint_hits + self.cpu.jumps.hits,
            fault_fixups=self.cpu.fixup_hits,
            cpus=self.cpu_count,
            cpus_online=sum(slot.online for slot in sched.slots),
            ticks_per_cpu=tuple(slot.ticks for slot in sched.slots),
            ipis=sched.ipis,
            yields=sched.yields,
            cpu_switches=sched.switches,
            ticks_held=sched.ticks_held,
        )
