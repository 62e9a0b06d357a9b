"""The machine's performance counters: per CPU, the instructions it retired, its branches, its cycles and the
software events of Linux's perf (context switches, CPU migrations, page faults, task clock, CPU clock), split
by mode (ring 0 / ring 3) where the machine can tell, kept by the machine (`Counters`) and read by the tracer's
`$pe_*` variables, by `monitor perf` and by kernel code (ports 0xea-0xec).

Owns the counting hooks, the per-CPU raw counts and the open counters (`Counter`, one perf event each). Runs on
the CPU thread: counters are opened, switched and read from hits or from requests (`Machine.run_on_cpu`); the
CPU and the scheduler report runs, exceptions, page faults and CPU switches to it (`Cpu.observer`, only while a
counter is open).

Why this module is long: it is the machine's whole PMU, one device: the decoded map of the kernel's code, the two
counting hooks and their take-backs after exceptions, the per-CPU raw counts every event reads, perf's event
types and configs, the counters opened on them and the ports kernel code reads them through; split, each piece
would reach into the others' state on every run of the CPU.

Unicorn 2.1.4 has no PMU (`rdpmc` is an invalid instruction, CPUID leaf 0xA is empty, the counter MSRs read 0),
so these are the machine's own device, like its ports, and count exactly:

- **Instructions and branches of the kernel** come from its code, decoded once: for every byte of the image's
  text, how many instructions start before it and whether the instruction holding it is a branch (`CodeMap`).
  A native block hook over the text adds, for each translated block run, the instructions that start in it and
  the branch that ends it (measured on `kgtp_bench_loop`, three blocks and nine instructions a call: 40 ns a
  call untraced, +30 ns with the block hook, +150 ns with a native hook on every instruction). A block left
  early by an exception did not run to its end: the CPU reports where (`fault_at`), and the instructions from
  there to the block's end are taken back (the faulting one retires when it runs again).
- **The tracer's own code is never counted** (module space: detours, compiled expressions, trampolines,
  out-of-line copies). A probe stands for what it displaced: an int3 is counted as the instruction it replaced,
  a 5-byte jump (or an int3 entering the same detour) as the instructions of its window (`stand_in`), so counts
  under probes are the kernel's exactly. A hit sees the counts as they were before the probed instruction
  (`at=site`), as KGTP's handler runs before it, with the counters off for the handler's duration.
- **Code outside the image's text** (user programs, ring 3, the lower half): a native hook on each of their
  instructions counts them (exact). Their branches are counted by a block hook on the lower half, armed only
  while a counter of user branches is open (a Python call a block): a translated block ends at its first branch,
  so each block run adds one if its last instruction is a branch, decoded once per (CR3, address, size) and
  remembered until the process's code can have changed (the kernel unmapping or reprotecting memory or releasing
  an address space, the host writing into the lower half; a block on a writable page is decoded at each run). An
  int3 is not counted: in a program it is a debugger's breakpoint or the tracer's probe, standing for the
  instruction it displaced, which is counted when it runs (as a probe in the kernel stands for its instruction).
- **Cycles** are the TSC's ticks while the CPU runs (its turns on the emulator, the tracer's Python handlers
  excluded), `task-clock` the same in nanoseconds, `cpu-clock` the wall time a counter was enabled. Cycles in
  user mode are the ticks from each user instruction to the next one when no kernel code ran between them (the
  user instruction hook reads the TSC; the kernel's block hook, a CPU switch and a handler end the user span);
  cycles in kernel mode are the rest. `task-clock` counts both modes whatever the exclusions, as Linux's does.
- **Software events** are counted where the machine or the kernel knows them: page faults when the machine
  delivers a #PF to the kernel (each is resolved from memory: minor; major faults would need storage the machine
  has not), context switches at the kernel's own `sched_switch` marker site (a hook on that one address), a CPU
  migration when a task switched to last ran on another CPU.

Counting costs nothing until a counter is first enabled: then the hooks go in (translated code is dropped so every
block gets them) and stay until the last counter is closed.
"""

from __future__ import annotations

import ctypes
import errno
import enum
import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from unicorn import UC_HOOK_BLOCK, UC_HOOK_CODE, Uc
from unicorn import x86_const as X

from ..uc_native import add_native_hook, native_function
from .clock import native_rdtsc
from .errors import MachineError

if TYPE_CHECKING:
    from capstone import Cs, CsInsn

    from .image import KernelImage

# ---- Linux's perf ABI: attr.type and attr.config (include/uapi/linux/perf_event.h) --------------------------


class PerfType(enum.IntEnum):
    HARDWARE = 0
    SOFTWARE = 1
    TRACEPOINT = 2
    HW_CACHE = 3
    RAW = 4
    BREAKPOINT = 5


class HwEvent(enum.IntEnum):
    CPU_CYCLES = 0
    INSTRUCTIONS = 1
    CACHE_REFERENCES = 2
    CACHE_MISSES = 3
    BRANCH_INSTRUCTIONS = 4
    BRANCH_MISSES = 5
    BUS_CYCLES = 6
    STALLED_CYCLES_FRONTEND = 7
    STALLED_CYCLES_BACKEND = 8
    REF_CPU_CYCLES = 9


class SwEvent(enum.IntEnum):
    CPU_CLOCK = 0
    TASK_CLOCK = 1
    PAGE_FAULTS = 2
    CONTEXT_SWITCHES = 3
    CPU_MIGRATIONS = 4
    PAGE_FAULTS_MIN = 5
    PAGE_FAULTS_MAJ = 6
    ALIGNMENT_FAULTS = 7
    EMULATION_FAULTS = 8
    DUMMY = 9


#: perf's names of the events the machine counts (`perf list`)
EVENT_NAMES: dict[tuple[int, int], str] = {
    (PerfType.HARDWARE, HwEvent.CPU_CYCLES): "cycles",
    (PerfType.HARDWARE, HwEvent.INSTRUCTIONS): "instructions",
    (PerfType.HARDWARE, HwEvent.BRANCH_INSTRUCTIONS): "branches",
    (PerfType.HARDWARE, HwEvent.REF_CPU_CYCLES): "ref-cycles",
    (PerfType.SOFTWARE, SwEvent.CPU_CLOCK): "cpu-clock",
    (PerfType.SOFTWARE, SwEvent.TASK_CLOCK): "task-clock",
    (PerfType.SOFTWARE, SwEvent.PAGE_FAULTS): "page-faults",
    (PerfType.SOFTWARE, SwEvent.CONTEXT_SWITCHES): "context-switches",
    (PerfType.SOFTWARE, SwEvent.CPU_MIGRATIONS): "cpu-migrations",
    (PerfType.SOFTWARE, SwEvent.PAGE_FAULTS_MIN): "minor-faults",
    (PerfType.SOFTWARE, SwEvent.PAGE_FAULTS_MAJ): "major-faults",
}

# ---- the ports kernel code reads them through -------------------------------------------------------------

#: outl: which count the next read returns: config | type << 8 | exclude_user << 16 | exclude_kernel << 17
PORT_PERF_SELECT = 0xEA
PORT_PERF_LO = 0xEB  #: inl: the selected count of the calling CPU since the machine began counting, low half (latches)
PORT_PERF_HI = 0xEC  #: inl: the latched high half
PERF_PORTS = (PORT_PERF_SELECT, PORT_PERF_LO, PORT_PERF_HI)


class Source(enum.IntEnum):
    """What the machine counts per CPU; an event is a sum of sources. The first four are native cells."""

    INSTRUCTIONS_KERNEL = 0
    BRANCHES_KERNEL = 1
    INSTRUCTIONS_USER = 2
    CYCLES_USER = 3
    CYCLES = 4
    BUSY_NS = 5
    CONTEXT_SWITCHES = 6
    MIGRATIONS = 7
    FAULTS_KERNEL = 8
    FAULTS_USER = 9
    MAJOR_FAULTS_KERNEL = 10
    MAJOR_FAULTS_USER = 11
    BRANCHES_USER = 12
    CYCLES_KERNEL = 13  #: not kept: CYCLES less CYCLES_USER


NATIVE_SOURCES = (Source.INSTRUCTIONS_KERNEL, Source.BRANCHES_KERNEL, Source.INSTRUCTIONS_USER, Source.CYCLES_USER)
_CELLS = 4  # u64 cells per CPU the native hooks write: the native sources
_SWITCH_SOURCES = (Source.CONTEXT_SWITCHES, Source.MIGRATIONS)


@dataclass(frozen=True)
class EventAttr:
    """A perf event as `perf_event_attr` describes it: type, config and the mode exclusions."""

    type: int
    config: int
    exclude_user: bool = False
    exclude_kernel: bool = False

    @property
    def name(self) -> str:
        base = EVENT_NAMES.get((self.type, self.config), f"type {self.type} config {self.config:#x}")
        if self.exclude_user and not self.exclude_kernel:
            return base + ":k"
        if self.exclude_kernel and not self.exclude_user:
            return base + ":u"
        return base


class CounterError(MachineError):
    """An event the machine does not count (perf_event_open's error), with its errno."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.errno = code


def sources_of(attr: EventAttr) -> tuple[Source, ...] | None:
    """The sources an event sums (None: cpu-clock, the time the counter was enabled). Raises CounterError for an
    event the machine does not count, as perf_event_open fails with ENOENT."""
    kernel, user = not attr.exclude_kernel, not attr.exclude_user
    if attr.type == PerfType.HARDWARE:
        if attr.config == HwEvent.INSTRUCTIONS:
            return (Source.INSTRUCTIONS_KERNEL,) * kernel + (Source.INSTRUCTIONS_USER,) * user
        if attr.config == HwEvent.BRANCH_INSTRUCTIONS:
            return (Source.BRANCHES_KERNEL,) * kernel + (Source.BRANCHES_USER,) * user
        if attr.config in (HwEvent.CPU_CYCLES, HwEvent.REF_CPU_CYCLES):
            if kernel and user:
                return (Source.CYCLES,)
            return (Source.CYCLES_KERNEL,) * kernel + (Source.CYCLES_USER,) * user
    elif attr.type == PerfType.SOFTWARE:
        if attr.config == SwEvent.CPU_CLOCK:
            return None
        if attr.config == SwEvent.TASK_CLOCK:
            return (Source.BUSY_NS,)
        if attr.config in (SwEvent.PAGE_FAULTS, SwEvent.PAGE_FAULTS_MIN):
            return (Source.FAULTS_KERNEL,) * kernel + (Source.FAULTS_USER,) * user
        if attr.config == SwEvent.PAGE_FAULTS_MAJ:
            return (Source.MAJOR_FAULTS_KERNEL,) * kernel + (Source.MAJOR_FAULTS_USER,) * user
        if attr.config in (SwEvent.CONTEXT_SWITCHES, SwEvent.CPU_MIGRATIONS):  # they happen in the kernel
            source = Source.CONTEXT_SWITCHES if attr.config == SwEvent.CONTEXT_SWITCHES else Source.MIGRATIONS
            return (source,) * kernel
    raise CounterError(f"the machine does not count perf event type {attr.type} config {attr.config:#x}",
                       errno.ENOENT)


@dataclass(frozen=True)
class CounterValue:
    """perf_event_read_value: the count, and nanoseconds the counter was enabled and running (the same here: the
    machine never multiplexes)."""

    value: int
    enabled_ns: int
    running_ns: int


class Counter:
    """One open perf event on one CPU: counts its sources while enabled (`Counters.open`)."""

    def __init__(self, counters: Counters, cpu: int, attr: EventAttr, sources: tuple[Source, ...] | None) -> None:
        self._counters = counters
        self.cpu = cpu
        self.attr = attr
        self.sources = sources
        self.enabled = False
        self.closed = False
        self._count = 0  # counted over the enabled spans that ended
        self._base = 0  # the sources' sum when the current span began
        self._enabled_ns = 0
        self._since = 0

    def enable(self, at: int | None = None) -> None:
        """Start counting (perf_event_enable). `at`: the probe site a hit on this counter's CPU stands at."""
        if self.enabled or self.closed:
            return
        self._counters.arm(self)
        self._base = self._counters.raw(self, at)
        self._since = time.monotonic_ns()
        self.enabled = True

    def disable(self, at: int | None = None) -> None:
        if not self.enabled:
            return
        self._count += self._counters.raw(self, at) - self._base
        self._enabled_ns += time.monotonic_ns() - self._since
        self.enabled = False

    def read(self, at: int | None = None) -> CounterValue:
        enabled_ns = self._enabled_ns + (time.monotonic_ns() - self._since if self.enabled else 0)
        if self.sources is None:  # cpu-clock
            return CounterValue(enabled_ns, enabled_ns, enabled_ns)
        value = self._count + (self._counters.raw(self, at) - self._base if self.enabled else 0)
        return CounterValue(value & (2**64 - 1), enabled_ns, enabled_ns)

    def write(self, value: int, at: int | None = None) -> None:
        """Set the count (KGTP's perf_event_set)."""
        self._count = value
        if self.enabled:
            self._base = self._counters.raw(self, at)
        if self.sources is None:
            self._enabled_ns, self._since = value, time.monotonic_ns()


class _Cell(ctypes.Structure):
    """What the native hooks read and write (their user data)."""

    _fields_ = [("current", ctypes.c_uint64), ("text_lo", ctypes.c_uint64), ("text_size", ctypes.c_uint64),
                ("prefix", ctypes.c_uint64), ("ends", ctypes.c_uint64), ("last_start", ctypes.c_uint64),
                ("last_end", ctypes.c_uint64), ("last_user", ctypes.c_uint64), ("user_tsc", ctypes.c_uint64),
                ("in_user", ctypes.c_uint64)]


# The block hook, on the kernel's text (rsi = block address, edx = its size in bytes, rcx = the _Cell):
#   in_user = 0                                                (kernel code ran: a user span of cycles ends)
#   r8 = address - text_lo; r9 = r8 + size; if r9 > text_size: last_end = 0, ret (not the image's code)
#   current->instructions_kernel += prefix[r9] - prefix[r8]   (u32 table: instructions starting before each byte)
#   e = ends[r9]                                               (u16 table, CodeMap.ends: what ending there means)
#   current->branches_kernel += e & 0xff; current->instructions_kernel += e >> 8
#   last_start = address; last_end = address + size
_BLOCK_CODE = bytes.fromhex(
    "48c7414800000000" "4989f0" "4c2b4108" "4189d1" "4d01c1" "4c3b4910" "7737"
    "4c8b5118" "438b048a" "432b0482" "4c8b19" "490103"
    "4c8b5120" "430fb7044a" "440fb6d0" "4d015308" "c1e808" "490103"
    "48897128" "89d0" "4801f0" "48894130" "c3"
    "48c7413000000000" "c3"
)
# The instruction hook, on the lower half (user code): current->instructions_user += 1; last_user = address;
#   now = rdtsc; if in_user: current->cycles_user += now - user_tsc; user_tsc = now; in_user = 1
_USER_CODE = bytes.fromhex(
    "4c8b01" "49ff4010" "48897138" "0f31" "48c1e220" "4809d0" "4883794800" "740b"
    "4889c2" "482b5140" "49015018"
    "48894140" "48c7414801000000" "c3"
)
USER_END = 0x0000_7FFF_FFFF_FFFF  #: the last address of the lower (user) half
_NOWHERE = (1 << 64) - 1




def _decoder(skipdata: bool = False) -> Cs:
    """A capstone x86_64 decoder with details; capstone is imported here, on first use: a machine whose counters
    are never opened never loads it."""
    from capstone import CS_ARCH_X86, CS_MODE_64, Cs

    cs = Cs(CS_ARCH_X86, CS_MODE_64)
    cs.detail = True
    cs.skipdata = skipdata
    return cs


@functools.cache
def _branch_kinds() -> tuple[frozenset[int], tuple[int, ...], int]:
    """The instruction ids that are branches besides the groups, the groups that are, and int3's id."""
    from capstone import x86_const as CX

    return (frozenset({CX.X86_INS_SYSCALL, CX.X86_INS_SYSRET, CX.X86_INS_SYSENTER, CX.X86_INS_SYSEXIT}),
            (CX.X86_GRP_JUMP, CX.X86_GRP_CALL, CX.X86_GRP_RET, CX.X86_GRP_IRET, CX.X86_GRP_INT), CX.X86_INS_INT3)


def _is_branch(insn: CsInsn) -> bool:
    ids, groups, _ = _branch_kinds()
    return insn.id in ids or any(insn.group(g) for g in groups)
#: the kernel's functions through which a process's code can change under a block decoded before (fixtures/kernel/
#: mm.c): unmapping (munmap, brk, a fixed mmap over a mapping), mprotect, and an address space's release
USER_CODE_CHANGES = ("do_munmap", "sys_mprotect", "mm_release")


class CodeMap:
    """The image's text decoded, per byte, into the native block hook's two tables:

    - `prefix[i]`: how many instructions start before `text_lo + i`, so a block [A, E) holds
      `prefix[E] - prefix[A]` instructions;
    - `ends[i]`: what a block ending at `text_lo + i` adds besides: its last instruction's branches (low byte) and
      instructions it stands for that start at or after the block's end (high byte). For the image as built,
      whether the instruction holding the byte before is a branch (a block ends inside an instruction only where
      a probe's int3 replaced its first byte). A probe's int3 or jump may stand for a window of instructions its
      detour runs (`stand_in`): the block it ends counts that window, and its branches.

    Decoded function by function from the symbol table (a linear sweep from each function's start, and over the
    bytes between functions), so alignment padding never shifts a function's decoding. A branch is what perf's
    branch-instructions counts on x86: jumps (conditional or not), calls, returns, software interrupts, iret,
    syscall and sysret.
    """

    def __init__(self, image: KernelImage) -> None:
        lo, hi = image.text_range
        self.lo, self.size = lo, hi - lo
        starts = bytearray(self.size)
        self.branch_at: dict[int, bool] = {}
        self.length_at: dict[int, int] = {}
        cs = _decoder(skipdata=True)
        functions = sorted({(s.address, s.end) for s in image.symbols.values()
                            if s.type == "FUNC" and s.size and lo <= s.address < hi})
        pieces, at = [], lo
        for start, end in functions:
            if start > at:
                pieces.append((at, start))
            pieces.append((max(start, at), min(end, hi)))
            at = max(at, min(end, hi))
        if at < hi:
            pieces.append((at, hi))
        for start, end in pieces:
            if end <= start:
                continue
            for insn in cs.disasm(image.read_code(start, end - start), start):
                if insn.id == 0:  # skipdata: not an instruction
                    continue
                starts[insn.address - lo] = 1
                self.length_at[insn.address] = insn.size
                self.branch_at[insn.address] = _is_branch(insn)
        self.prefix = (ctypes.c_uint32 * (self.size + 1))()
        total = 0
        for offset in range(self.size):
            self.prefix[offset] = total
            total += starts[offset]
        self.prefix[self.size] = total
        self.ends = (ctypes.c_uint16 * (self.size + 1))()
        for address, length in self.length_at.items():  # a block ends inside an instruction only at an int3
            if self.branch_at[address]:                   # standing for it: every byte says what it holds
                for end in range(address + 1 - self.lo, min(address + length - self.lo, self.size) + 1):
                    self.ends[end] = 1
        self._saved: dict[int, int] = {}  # offset -> ends there before a stand-in

    def contains(self, address: int) -> bool:
        return self.lo <= address < self.lo + self.size

    def instructions_between(self, start: int, end: int) -> int:
        """Instructions of the image starting in [start, end)."""
        return self.prefix[end - self.lo] - self.prefix[start - self.lo]

    def weight(self, end: int) -> tuple[int, int]:
        """(instructions, branches) a block ending at `end` adds besides the instructions starting in it."""
        value = self.ends[end - self.lo]
        return value >> 8, value & 0xFF

    def stand_in(self, site: int, length: int, window_end: int) -> None:
        """The `length` bytes at `site` (an int3: 1, a jump: 5) now stand for the image's instructions in
        [site, window_end), which run elsewhere."""
        end = site + length - self.lo
        window = [a for a in range(site, window_end) if a in self.length_at]
        extra = self.instructions_between(site, window_end) - self.instructions_between(site, site + length)
        branches = sum(self.branch_at[a] for a in window)
        self._saved.setdefault(end, self.ends[end])
        self.ends[end] = min(extra, 0xFF) << 8 | min(branches, 0xFF)

    def stand_in_removed(self, site: int, length: int) -> None:
        end = site + length - self.lo
        if end in self._saved:
            self.ends[end] = self._saved.pop(end)


class Counters:
    """The per-CPU counters of a machine of `cpus` CPUs sharing `uc`, and the perf events open on them."""

    def __init__(self, uc: Uc, image: KernelImage, cpus: int, current_cpu: Callable[[], int],
                 in_emulation: Callable[[], bool], set_observer: Callable[[object | None], None],
                 delete_hook: Callable[[object], None]) -> None:
        self.uc = uc
        self.image = image
        self.cpus = cpus
        self._current_cpu = current_cpu
        self._in_emulation = in_emulation
        self._set_observer = set_observer
        self._delete_hook = delete_hook  #: the CPU's (Cpu.delete_hook: the fault its removal leaves forgotten)
        self._map: CodeMap | None = None  # decoded when first needed (`map`): 60 ms for this kernel
        self._stand_ins: dict[tuple[int, int], int] = {}  # (site, length) -> window end, until the map exists
        self._native = (ctypes.c_uint64 * (_CELLS * cpus))()
        self._cell = _Cell(ctypes.addressof(self._native), 0, 0, 0, 0, 0, 0, _NOWHERE)
        self._python = [[0] * len(Source) for _ in range(cpus)]
        #: the host's TSC (what the emulated rdtsc returns); None where W+X host pages are refused
        self._rdtsc = native_rdtsc()
        self.available = self._rdtsc is not None and native_function(_BLOCK_CODE) is not None
        self.open_counters: list[Counter] = []
        self._hooks: list[object] = []
        self._switch_hook: int | None = None
        self._user_branch_hooks: list[int] = []
        self._user_blocks: dict[tuple[int, int, int], int] = {}  # (cr3, address, size) -> branches at its end
        self._last_user_block = (0, 0, 0)  # (start, end, branches) of the last user block counted
        self._user_decoder: Cs | None = None  #: made by the first user block decoded
        self._native_armed = False
        self._switches_armed = False
        self._flush_due = False
        self._detach_due = False
        self._retired_hooks: list[object] = []
        self._cpu = 0  # the CPU loaded while observing
        self._run_since: tuple[int, int] | None = None  # (tsc, ns) the current busy span began
        self._last_cpu: dict[int, int] = {}  # task -> the CPU it last ran on
        self.counted_since: int | None = None  # monotonic ns the machine began counting (armed)
        self._select = 0
        self._latched = 0
        self._marker = next((m for m in image.markers if (m.system, m.name) == ("sched", "sched_switch")), None)

    @property
    def map(self) -> CodeMap:
        """The kernel's decoded code, with the probes' stand-ins so far (the block hook's tables)."""
        if self._map is None:
            code = CodeMap(self.image)
            for (site, length), window_end in self._stand_ins.items():
                code.stand_in(site, length, window_end)
            self._stand_ins.clear()
            self._cell.text_lo, self._cell.text_size = code.lo, code.size
            self._cell.prefix, self._cell.ends = ctypes.addressof(code.prefix), ctypes.addressof(code.ends)
            self._map = code
        return self._map

    # ---- opening and closing (CPU thread) ------------------------------------------------------------------

    def open(self, cpu: int, attr: EventAttr, enabled: bool = False, at: int | None = None) -> Counter:
        """A counter of `attr` on `cpu` (perf_event_create_kernel_counter). Raises CounterError for an event the
        machine does not count or a CPU it does not have."""
        if not 0 <= cpu < self.cpus:
            raise CounterError(f"no CPU {cpu}: the machine has {self.cpus}", errno.EINVAL)
        sources = sources_of(attr)
        if not self.available and sources is not None and set(sources) & set(NATIVE_SOURCES):
            raise CounterError("native hooks are unavailable (no W+X host pages): instructions are not counted",
                               errno.ENODEV)
        counter = Counter(self, cpu, attr, sources)
        self.open_counters.append(counter)
        if len(self.open_counters) == 1:
            self._detach_due = False
            self.cpu_loaded(self._current_cpu())
            self._set_observer(self)
        if enabled:
            counter.enable(at)
        return counter

    def close(self, counter: Counter) -> CounterValue:
        """Release a counter (perf_event_release_kernel); returns its final value. The last one takes the hooks
        out again."""
        value = counter.read()
        counter.disable()
        counter.closed = True
        if counter in self.open_counters:
            self.open_counters.remove(counter)
        if not self.open_counters:
            self._disarm()
        return value

    # ---- arming: hooks compiled into translated code ---------------------------------------------------------

    def arm(self, counter: Counter) -> None:
        """Before `counter` first counts: the hooks its sources need, and translated code dropped so that every
        block runs with them (inside emulation, at the run's end: the hit asking for it stops the run)."""
        sources = counter.sources or ()
        if self.counted_since is None:
            self.counted_since = time.monotonic_ns()
        changed = False
        if not self._native_armed and set(sources) & set(NATIVE_SOURCES):
            lo, size = self.map.lo, self.map.size  # (decoded now, the first time)
            for kind, code, begin, end in ((UC_HOOK_BLOCK, _BLOCK_CODE, lo, lo + size - 1),
                                           (UC_HOOK_CODE, _USER_CODE, 0, USER_END)):
                hook = add_native_hook(self.uc, kind, code, ctypes.addressof(self._cell), begin, end)
                if hook is None:
                    raise CounterError("unicorn refused the counting hooks", errno.ENODEV)
                self._hooks.append(hook)
            self._cell.last_end = 0
            self._native_armed = changed = True
        if not self._user_branch_hooks and Source.BRANCHES_USER in sources:
            self._arm_user_branches()
            changed = True
        if not self._switches_armed and set(sources) & set(_SWITCH_SOURCES) and self._marker is not None:
            site = self._marker.site
            self._switch_hook = self.uc.hook_add(UC_HOOK_CODE, self._on_switch, None, site, site)
            self._switches_armed = changed = True
        if changed:
            self._flush()

    def _disarm(self) -> None:
        """No counter is open any more: the hooks go, and the CPU stops reporting to the counters (inside
        emulation, at the run's end, when the hooks can be deleted)."""
        self.counted_since = None
        if self._native_armed or self._switches_armed or self._user_branch_hooks:
            self._retired_hooks += self._hooks + self._user_branch_hooks
            if self._switch_hook is not None:
                self._retired_hooks.append(self._switch_hook)
            self._hooks, self._switch_hook, self._user_branch_hooks = [], None, []
            self._forget_user_blocks()
            if getattr(self.uc, "on_user_write", None) == self._user_code_written:
                self.uc.on_user_write = None
            self._native_armed = self._switches_armed = False
            self._flush()
        self._detach_due = True
        if not self._in_emulation():
            self._safe_point()

    def _arm_user_branches(self) -> None:
        """The block hook counting user code's branches, and what tells it a process's code may have changed:
        the kernel's functions that unmap, reprotect or release user memory (at their entry), and the host's writes
        into the lower half."""
        self._user_branch_hooks.append(self.uc.hook_add(UC_HOOK_BLOCK, self._on_user_block, None, 0, USER_END))
        for name in USER_CODE_CHANGES:
            symbol = self.image.symbols.get(name)
            if symbol is not None:
                self._user_branch_hooks.append(self.uc.hook_add(
                    UC_HOOK_CODE, lambda *_: self._forget_user_blocks(), None, symbol.address, symbol.address))
        if hasattr(self.uc, "on_user_write"):
            self.uc.on_user_write = self._user_code_written

    def _on_user_block(self, uc: Uc, address: int, size: int, _data: object) -> None:
        """A block of user code begins (CPU thread): the branch that ends it, if any, counts."""
        cr3 = uc.reg_read(X.UC_X86_REG_CR3)
        branches = self._user_blocks.get((cr3, address, size))
        if branches is None:
            branches = self._decode_user_block(cr3, address, size)
        self._python[self._cpu][Source.BRANCHES_USER] += branches
        self._last_user_block = (address, address + size, branches)

    def _decode_user_block(self, cr3: int, address: int, size: int) -> int:
        """Is the last instruction of the user block [address, address + size) a branch (1) or not (0)? Kept for
        the next run of the block unless one of its pages is writable (code that may change under it)."""
        tables = getattr(self.uc, "tables", None)
        if tables is None:  # a bare CPU (no page tables): what it reads is what runs
            code, writable = bytes(self.uc.mem_read(address, size)), True
        else:
            space = tables.space_at(cr3)
            code = bytes(space.read(address, size))
            entries = [space.walk(page) for page in range(address & ~0xFFF, address + size, 0x1000)]
            writable = any(entry is None or entry & 2 for entry in entries)
        if self._user_decoder is None:
            self._user_decoder = _decoder()
        last = None
        for last in self._user_decoder.disasm(code, address):
            pass
        branches = 0
        if last is not None and last.address + last.size == address + size and last.id != _branch_kinds()[2]:
            branches = int(_is_branch(last))
        if not writable:
            self._user_blocks[(cr3, address, size)] = branches
        return branches

    def _user_code_written(self, address: int, size: int) -> None:
        self._forget_user_blocks()

    def _forget_user_blocks(self) -> None:
        self._user_blocks.clear()

    def _flush(self) -> None:
        if self._in_emulation():
            self._flush_due = True
            self.uc.emu_stop()  # from a hook on the CPU thread: exact (the next block never starts)
        else:
            self.uc.ctl_flush_tb()

    def _safe_point(self) -> None:
        """Outside emulation: hooks retired inside it are deleted, translated code dropped if due."""
        for hook in self._retired_hooks:
            self._delete_hook(hook)
        self._retired_hooks = []
        if self._flush_due:
            self._flush_due = False
            self.uc.ctl_flush_tb()
        if self._detach_due and not self.open_counters:
            self._detach_due = False
            self._run_since = None
            self._set_observer(None)

    # ---- reading -------------------------------------------------------------------------------------------

    def raw(self, counter: Counter, at: int | None = None) -> int:
        """The sum of a counter's sources on its CPU now; with `at` (a probe site the loaded CPU is hitting),
        before the probed instruction: what the probe's int3 or jump stood for is not yet retired."""
        sources = counter.sources or ()
        total = sum(self.source(counter.cpu, source) for source in sources)
        if at is not None and counter.cpu == self._cpu and set(sources) & set(NATIVE_SOURCES) and \
                self.map.contains(at):
            extra, branches = self.map.weight(at + 1)  # the int3 the hit came through, and what it stands for
            if Source.INSTRUCTIONS_KERNEL in sources:
                total -= self.map.instructions_between(at, at + 1) + extra
            if Source.BRANCHES_KERNEL in sources:
                total -= branches
        return total

    def source(self, cpu: int, source: Source) -> int:
        """What the machine counted of `source` on `cpu` while counting (not only while a counter was enabled)."""
        if source < len(NATIVE_SOURCES):
            return self._native[_CELLS * cpu + source]
        if source == Source.CYCLES_KERNEL:
            return self.source(cpu, Source.CYCLES) - self.source(cpu, Source.CYCLES_USER)
        value = self._python[cpu][source]
        if cpu == self._cpu and self._run_since is not None and source in (Source.CYCLES, Source.BUSY_NS):
            tsc, ns = self._run_since
            value += (self._tsc() - tsc) if source == Source.CYCLES else time.monotonic_ns() - ns
        return value

    def total(self, cpu: int, attr: EventAttr) -> int:
        """Everything the machine counted of an event on a CPU (what the ports give kernel code)."""
        sources = sources_of(attr)
        if sources is None:
            return time.monotonic_ns() - self.counted_since if self.counted_since is not None else 0
        return sum(self.source(cpu, source) for source in sources)

    def _tsc(self) -> int:
        return self._rdtsc() if self._rdtsc is not None else time.perf_counter_ns()

    # ---- what the CPU and the scheduler report (CPU thread, only while a counter is open) --------------------

    def cpu_loaded(self, index: int) -> None:
        """The scheduler loaded CPU `index` (between runs)."""
        self._cpu = index
        self._cell.current = ctypes.addressof(self._native) + 8 * _CELLS * index
        self._cell.last_end = 0
        self._cell.last_user = _NOWHERE
        self._cell.in_user = 0
        self._last_user_block = (0, 0, 0)

    def run_begins(self) -> None:
        self._cell.current = ctypes.addressof(self._native) + 8 * _CELLS * self._cpu
        self._run_since = (self._tsc(), time.monotonic_ns())

    def run_ends(self) -> None:
        self.handler_begins()
        self._cell.last_end = 0
        self._safe_point()

    def handler_begins(self) -> None:
        """The stub's Python handler (a hit) begins: the CPU's busy time stops, as KGTP's handler disables its
        per-CPU counters."""
        self._cell.in_user = 0  # the handler's time is nobody's
        if self._run_since is None:
            return
        tsc, ns = self._run_since
        counts = self._python[self._cpu]
        counts[Source.CYCLES] += self._tsc() - tsc
        counts[Source.BUSY_NS] += time.monotonic_ns() - ns
        self._run_since = None

    def handler_ends(self) -> None:
        self._run_since = (self._tsc(), time.monotonic_ns())

    def fault_at(self, rip: int) -> None:
        """An exception stopped the instruction at `rip` before it retired (it runs again after the handler):
        what the current block's count included from there on did not run."""
        cell = self._cell
        if cell.last_end and cell.last_start <= rip < cell.last_end and self.map.contains(rip):
            base = _CELLS * self._cpu
            extra, branches = self.map.weight(cell.last_end)
            undone = self.map.instructions_between(rip, cell.last_end) + extra
            self._native[base + Source.INSTRUCTIONS_KERNEL] -= undone
            self._native[base + Source.BRANCHES_KERNEL] -= branches
        elif rip <= USER_END and rip == cell.last_user:
            self._native[_CELLS * self._cpu + Source.INSTRUCTIONS_USER] -= 1
            start, end, branches = self._last_user_block
            if start <= rip < end:  # the block's branch, at its end, did not run either
                self._python[self._cpu][Source.BRANCHES_USER] -= branches
        self._last_user_block = (0, 0, 0)
        cell.last_end = 0
        cell.last_user = _NOWHERE

    def page_fault(self, from_user: bool) -> None:
        """The machine delivers a #PF to the kernel: a fault resolved from memory (minor)."""
        self._python[self._cpu][Source.FAULTS_USER if from_user else Source.FAULTS_KERNEL] += 1

    def _on_switch(self, uc: Uc, _address: int, _size: int, _data: object) -> None:
        """The kernel's sched_switch marker site: this CPU switches tasks (the next one in its TP_ARGS)."""
        counts = self._python[self._cpu]
        counts[Source.CONTEXT_SWITCHES] += 1
        location = self._marker.arg_locations[1] if self._marker and len(self._marker.arg_locations) > 1 else ""
        register = getattr(X, f"UC_X86_REG_{location.lstrip('%').upper()}", None)
        if register is None:
            return
        task = uc.reg_read(register)
        last = self._last_cpu.get(task)
        if last is not None and last != self._cpu:
            counts[Source.MIGRATIONS] += 1
        self._last_cpu[task] = self._cpu

    # ---- probes: what a patch stands for --------------------------------------------------------------------

    def stand_in(self, site: int, length: int, window_end: int) -> None:
        """The tracer patched `length` bytes at `site` (an int3: 1, a jump: 5) whose detour runs the image's
        instructions in [site, window_end): they count when the patch runs (CPU thread, as it patches)."""
        if self._map is None:
            self._stand_ins[(site, length)] = window_end
        elif self._map.contains(site):
            self._map.stand_in(site, length, window_end)

    def stand_in_removed(self, site: int, length: int) -> None:
        if self._map is None:
            self._stand_ins.pop((site, length), None)
        elif self._map.contains(site):
            self._map.stand_in_removed(site, length)

    # ---- the ports ------------------------------------------------------------------------------------------

    def port_out(self, port: int, value: int) -> None:
        if port == PORT_PERF_SELECT:
            self._select = value

    def port_in(self, port: int) -> int:
        if port == PORT_PERF_LO:
            select = self._select
            attr = EventAttr(select >> 8 & 0xFF, select & 0xFF, bool(select >> 16 & 1), bool(select >> 17 & 1))
            try:
                count = self.total(self._current_cpu(), attr)
            except CounterError:
                count = (1 << 64) - 1
            self._latched = count >> 32 & 0xFFFF_FFFF
            return count & 0xFFFF_FFFF
        if port == PORT_PERF_HI:
            return self._latched
        return 0xFFFF_FFFF
