"""The combination suite: seeded random combinations of what the tracer offers, each run against a live kernel and
checked against what the kernel counted itself (`scripts/combinations [--seconds N] [--seed S] [--only SPEC]`).

A combination picks one value on every dimension (`DIMENSIONS`): the engine, the probe path (a jump, an int3, two
tracepoints at one address, the static marker, while-stepping, a `$kret` return probe, a watch tracepoint), the
CPUs, the buffer (large linear, small circular, small linear that fills), the condition (none, true, false,
faulting), what the tracepoint does (registers, `$regs`, `$args`, a global, a stack range, `$_sdata`, `$bt`, a
`teval` of a plain or a per-CPU variable, KGTP's `$cpu_id`/`$current_task`, `$disable`), a pass count, a change
during the run (none, QTDisable then QTEnable, a tracepoint added with InstallInTrace), what stands beside it (a
while-stepping tracepoint elsewhere, four watches) and how the run ends (tstop, or GDB leaving). Some choices
make others moot (a pass count ends the run; `$_sdata` exists only at a marker); `normalize` settles them, so
the spec a failure prints is the combination that ran. Pairs KGTP refuses (`refusal`: a `$kret` run with
while-stepping, a fifth watch, watches beside while-stepping) must be refused at tstart with KGTP's reason.

Every tracepoint is at kgtp_test_function, whose first instruction is `addl $1, kgtp_counter(%rip)`, or at
something that fires with it (its `kgtp_module_event` marker, its return, the write of kgtp_counter). So
kgtp_counter is the kernel's own count of the calls. The runner (`Runner`) drives an in-process stub through RSP
packets, exactly as the TCP server feeds it (the fuzzer's `Harness`): with every CPU stopped (`monitor stop`, at
an instruction boundary, never in the stub's code) it reads kgtp_counter and each CPU's pc, starts the run, lets
the kernel go until the counter has moved enough (events, never a time window), stops every CPU again, reads the
counter and pcs, stops the run, and reads every frame back (QTFrame, `g`, `m`, qTV, `monitor frames`). The
oracle (`check`) expects the calls between the two stops (a call between the function's entry and the probed
place when every CPU stopped is counted from where it is: its CPU's pc, or the interrupted pc on its thread's stack
when the tick preempted it there, `Halt`): that many fired hits (`monitor probes`), that many hits (qTP) unless the
condition, pass count, `$disable` or a full buffer says less, frames whose collected kgtp_counter are exactly
those calls' values, registers that agree with them (the soak's `check_frame_values`), each CPU's sequence
numbers consecutive (the soak's `check_sequence`), `$hits` and `$p_hits` counting 1, 2, 3... The stub and the
kernel must then be healthy for the next combination (the harness' health check; no error logged); one machine
per CPU count is booted once and reused.

Why this module is long: the space, the runner and the oracle change together (a new dimension is a definition,
a way to run it and what the kernel's count says of it), and reading them side by side is how a failure's spec
is understood; it is meant to be split along those three lines when the user-space dimension comes.

Runs on the caller's thread (the command's main thread, or a test's), which feeds the session in place of the
server thread while each machine's CPU and tick threads run its kernel.
"""

from __future__ import annotations

import argparse
import logging
import random
import re
import struct
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, replace

from ..agent.opcodes import assemble
from ..client import VMLINUX, console_text
from ..machine import KernelImage
from ..machine.cpu import KERNEL_CS, KERNEL_DS
from ..machine.dwarf import KernelDwarf
from ..rsp.packets.data import MAX_READ
from ..tracing.core.builtins import BUILTIN_VARIABLES
from .fuzz_harness import FuzzFailure, Harness, build_stub
from .soak_checks import FrameRecord, TracepointSpec, check_frame_values, check_sequence

# ---- the space -----------------------------------------------------------------------------------------------

DIMENSIONS: dict[str, tuple] = {
    "engine": ("interp", "naive", "opt"),
    "path": ("jump", "int3", "shared", "marker", "stepping", "kret", "watch"),
    "cpus": (1, 2, 4),
    "buffer": ("linear", "circular", "fill"),
    "condition": ("none", "true", "false", "fault"),
    "action": ("registers", "$regs", "$args", "global", "memory", "sdata", "bt", "teval", "percpu", "kgtp",
               "disable"),
    "passcount": (0, 3),
    "change": ("none", "toggle", "add"),
    "beside": ("none", "stepping", "watches"),
    "ending": ("tstop", "disconnect"),
}


@dataclass(frozen=True)
class Combination:
    engine: str = "opt"
    path: str = "jump"
    cpus: int = 2
    buffer: str = "linear"
    condition: str = "none"
    action: str = "global"
    passcount: int = 0
    change: str = "none"
    beside: str = "none"
    ending: str = "tstop"

    def spec(self) -> str:
        """One line: `engine=opt path=jump cpus=2 ...`, what `--only` takes back."""
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    @classmethod
    def parse(cls, spec: str) -> Combination:
        values: dict[str, object] = {}
        for word in spec.replace(",", " ").split():
            name, _, value = word.partition("=")
            if name not in DIMENSIONS:
                raise ValueError(f"no dimension {name!r} (dimensions: {', '.join(DIMENSIONS)})")
            choice = int(value) if isinstance(DIMENSIONS[name][0], int) else value
            if choice not in DIMENSIONS[name]:
                raise ValueError(f"{name}={value}: not one of {DIMENSIONS[name]}")
            values[name] = choice
        return cls(**values)  # type: ignore[arg-type]


def normalize(c: Combination) -> Combination:
    """Settle the choices another choice makes moot, so a spec says what ran.

    A run that ends itself (a pass count, a faulting condition, a buffer that fills, `$disable`) has no change
    during it and ends with tstop; `$_sdata` exists only at a marker (elsewhere the action is a global); a watch
    tracepoint collects `$watch_val`, so the action kinds that need the hit's own registers at the function
    (`$args`, `memory`, `bt`) become a global there, as for a return probe (whose registers are the return's)."""
    if c.action == "sdata" and c.path != "marker":
        c = replace(c, action="global")
    if c.path in ("watch", "kret") and c.action in ("$args", "memory", "bt", "disable"):
        c = replace(c, action="global")
    if c.condition == "fault" or c.buffer == "fill" or c.passcount or c.action == "disable":
        c = replace(c, change="none")
    if c.condition in ("false", "fault") and c.buffer == "fill":  # a buffer that never fills
        c = replace(c, buffer="linear")
    if c.condition in ("false", "fault") or c.action == "disable" or c.buffer == "fill":
        c = replace(c, passcount=0)
    if c.condition == "fault" or c.action == "disable":
        c = replace(c, buffer="linear" if c.buffer == "fill" else c.buffer)
    return c


def refusal(c: Combination) -> str | None:
    """KGTP's reason for refusing this combination at tstart (a regular expression), or None."""
    if c.path == "kret" and c.beside == "stepping":
        return r"\$?kret cannot be used in a run with while-stepping"
    if c.path == "watch" and c.beside == "watches":
        return r"no free hardware breakpoint .* x86 has 4 debug registers"
    if (c.path, c.beside) in (("watch", "stepping"), ("stepping", "watches")):
        return r"cannot work together with while-stepping"
    return None


def generate(rng: random.Random) -> Combination:
    """One combination, every dimension drawn uniformly, then normalized."""
    return normalize(Combination(**{name: rng.choice(values) for name, values in DIMENSIONS.items()}))


def walk(seed: int) -> Iterable[Combination]:
    """The combinations of a seed, in order, without end."""
    rng = random.Random(seed)
    while True:
        yield generate(rng)


# ---- what the tracepoints are -----------------------------------------------------------------------------------

IMAGE_PATH = VMLINUX
N = {b.name: b.number for b in BUILTIN_VARIABLES}
HITS = max(N.values()) + 1  # the first number GDB gives a user variable: `$hits`
P_HITS = HITS + 1  # `$p_hits`: KGTP's per-CPU variable
MAIN, SHARED, ADDED, STEPPER = 1, 2, 3, 4  # tracepoint numbers; the four watches beside are 5..8
WATCHED = ("jiffies", "kgtp_test_pace", "nr_modules_loaded", "nr_context_switches")
STEPS = 2
ALL_REGS = 0xFFFFFF
SMALL_BUFFER = 0x1000
#: calls to let happen in each window of a run (more for a circular buffer, which must wrap)
WINDOW_CALLS = 24
#: calls a new machine makes before its first combination, per CPU (two ticks of each benchmark thread)
WARM_CALLS = 200
#: calls after which a small linear buffer must have filled (a frame takes at least 32 bytes of a 4 KiB ring)
FILL_CALLS = 20000
WAIT_S = 60.0  # a kernel that makes no progress for this long is a failure


def _mask(registers: int) -> bytes:
    """A register-collection action as GDB writes it: the mask's bytes in hex."""
    text = b"%x" % registers
    return b"R" + b"0" * (len(text) % 2) + text


def _x(code: str) -> bytes:
    program = assemble(code)
    return b"X%x,%s" % (len(program), program.hex().encode())


@dataclass(frozen=True)
class Sites:
    function: int
    counter: int
    marker: int
    load_module: int
    watched: tuple[int, ...]
    bench: tuple[range, ...]  # the callers kgtp_test_function returns into

    @classmethod
    def of(cls, image: KernelImage) -> Sites:
        marker = next(m.site for m in image.markers if m.name == "kgtp_module_event")
        callers = [image.function_at(image.address_of(name)) for name in ("kgtp_bench_thread", "kgtp_bench_loop")]
        return cls(image.address_of("kgtp_test_function"), image.address_of("kgtp_counter"), marker,
                   image.address_of("load_module"), tuple(image.address_of(n) for n in WATCHED),
                   tuple(range(f.address, f.address + f.size) for f in callers))


@dataclass(frozen=True)
class Stacks:
    """Where the benchmark threads, the only callers of kgtp_test_function, keep their stacks: kernel thread i's
    is the i-th of the equal stacks of `thread_stacks[]`, and `tasks[i].thread.sp` holds its stack pointer while
    it is switched out (fixtures/kernel/sched.c). `saved` are the addresses of those pointers, one per benchmark
    thread (a thread of a CPU the machine does not have never runs)."""

    saved: tuple[int, ...]
    base: int
    each: int  #: THREAD_SIZE
    count: int

    @classmethod
    def of(cls, image: KernelImage) -> Stacks:
        dwarf = KernelDwarf(image.path)
        try:
            found = dwarf.global_variable("tasks")
            if found is None or found[1].target is None or not found[1].count:
                raise CombinationFailure("the kernel's DWARF has no tasks[]: its threads' stacks cannot be read")
            address, array = found
            task = array.target
            thread, kind = task.member("thread")
            sp, entry = thread + kind.member("sp")[0], task.member("entry")[0]
        finally:
            dwarf.close()
        bench = image.address_of("kgtp_bench_thread")
        at = [address + i * task.size for i in range(array.count)]  # the kernel threads' entries are static
        stacks = image.symbols["thread_stacks"]
        return cls(tuple(a + sp for a in at if int.from_bytes(image.read(a + entry, 8), "little") == bench),
                   stacks.address, stacks.size // array.count, array.count)

    def call(self, sp: int | None, rdi: int | None) -> tuple[int, int] | None:
        """Which call of kgtp_test_function a context inside it holds: its benchmark thread (the stack `sp` is
        in) and its first argument, that thread's counter1, which goes up by one each call (module.c); None
        off the benchmark threads' stacks."""
        if sp is None or rdi is None:
            return None
        index = (sp - self.base - 1) // self.each
        return (index, rdi & 0xFFFFFFFF) if 0 <= index < self.count else None

    def live(self, saved: list[int], running: list[int]) -> list[tuple[int, int]]:
        """The live part [sp, top) of the benchmark threads' stacks, from their saved stack pointers and those of
        the CPUs (`running`: a CPU's is the one that counts for the thread it runs, whose saved one is stale; a
        CPU on any other stack is left out)."""
        start: dict[int, int] = {}
        for sp in saved:
            index = (sp - self.base - 1) // self.each  # an empty stack's pointer is at its top
            if 0 <= index < self.count:
                start[index] = (sp + 7) & ~7
        for sp in running:
            index = (sp - self.base - 1) // self.each
            if index in start:
                start[index] = (sp + 7) & ~7
        return [(sp, self.base + (index + 1) * self.each) for index, sp in sorted(start.items())]


def interrupted(data: bytes, address: int) -> list[int]:
    """The pcs of the kernel contexts interrupted in live stack memory `data` (read at `address`, 8-byte aligned):
    each is an interrupt frame as x86_64 pushes one on the kernel's own stack (ip, the kernel's cs, flags, sp, the
    kernel's ss), right below the interrupted stack pointer aligned down to 16 bytes (`Cpu.deliver`).

    Only the live part of a stack is read, but a frame of a returned interrupt could survive in words a later
    call left unwritten. Not one taken inside kgtp_test_function: the live part of a benchmark thread back in its
    loop ends above that place, an interrupt in the loop writes its own frame and registers over it, and
    msleep_ticks and schedule, the calls the thread sleeps in, push registers over its cs and ss."""
    return [pc for _, pc in interrupt_frames(data, address)]


def interrupt_frames(data: bytes, address: int) -> list[tuple[int, int]]:
    """`interrupted`'s frames: each one's address and the pc it holds."""
    words = struct.unpack(f"<{len(data) // 8}Q", data[:len(data) // 8 * 8])
    return [(address + 8 * k, words[k]) for k in range(len(words) - 4)
            if words[k + 1] == KERNEL_CS and words[k + 4] == KERNEL_DS and address + 8 * k + 40 == words[k + 3] & ~0xF]


#: where common_entry (boot.S) saved %rdi, below an interrupt frame: the error code slot, the vector, then r9, r8,
#: r10, rdx, rsi, rdi
_SAVED_RDI = 64


def main_actions(c: Combination, s: Sites) -> list[bytes]:
    """The QTDP action pieces of the combination's tracepoint (each one packet, as GDB sends them)."""
    counter = b"M-1,%x,4" % s.counter
    if c.path == "watch":
        setup = [_x(f"const8 1; setv {N['watch_static']:#x}; end"), _x(f"const8 1; setv {N['watch_type']:#x}; end"),
                 _x(f"const8 4; setv {N['watch_size']:#x}; end")]
        collect = [_x(f"tracev {N['watch_val']:#x}; end")]
    elif c.path == "kret":
        setup, collect = [_x(f"const8 0; setv {N['kret']:#x}; end")], [counter]
    else:
        setup, collect = [], [counter]
    kind = {
        "registers": [_mask(1 << 4 | 1 << 5 | 1 << 16)],
        "$regs": [_mask(ALL_REGS)],
        "$args": [_mask(1 << 4 | 1 << 5)],
        "global": [],
        "memory": [_mask(1 << 7), b"M7,0,10"],
        "sdata": [b"L", _mask(1 << 4 | 1 << 5)],
        "bt": [_x(f"tracev {N['bt']:#x}; end")],
        "teval": [_x(f"getv {HITS}; const8 1; add; ext 64; setv {HITS}; pop; end"), _x(f"tracev {HITS}; end")],
        "percpu": [_x(f"getv {P_HITS}; const8 1; add; ext 64; setv {P_HITS}; pop; end"), _x(f"tracev {P_HITS}; end")],
        "kgtp": [_x(f"tracev {N['cpu_id']:#x}; tracev {N['current_task']:#x}; end")],
        "disable": [_x(f"const8 {MAIN}; setv {N['disable']:#x}; end")],
    }[c.action]
    return setup + collect + kind


CONDITIONS = {
    "none": None,
    "true": "const8 0; reg 5; ext 32; less_signed; end",  # counter1 > 0: the bench threads count from 1
    "false": "reg 5; ext 32; const8 0; less_signed; end",
    "fault": "const8 8; ref32; end",  # a read of address 8: never mapped
}


def address_of(c: Combination, s: Sites) -> int:
    """Where the combination's own tracepoint is: the marker, the watched kgtp_counter, or the function."""
    return {"marker": s.marker, "watch": s.counter}.get(c.path, s.function)


def definitions(c: Combination, s: Sites) -> list[bytes]:
    """Every packet GDB would send between QTinit and QTStart for this combination."""
    address = address_of(c, s)
    condition = CONDITIONS[c.condition]
    step = STEPS if c.path == "stepping" else 0
    packets = [b"QTBuffer:size:%x" % (SMALL_BUFFER if c.buffer in ("circular", "fill") else 0x100000),
               b"QTBuffer:circular:%x" % (c.buffer == "circular"), b"QTDisconnected:0",
               b"QTDV:%x:0:0:%s" % (HITS, b"hits".hex().encode()), b"QTDV:%x:0:0:%s" % (P_HITS, b"p_hits".hex().encode())]
    packets += [b"QTDV:%x:0:0:%s" % (P_HITS + 1 + cpu, (b"p_hits%d" % cpu).hex().encode()) for cpu in range(c.cpus)]  # each copy
    packets.append(b"QTDP:%x:%x:E:%x:%x%s%s-" % (MAIN, address, step, c.passcount, b":S" if c.path == "marker" else b"",
                                                b":" + _x(condition) if condition else b""))
    pieces = main_actions(c, s)
    for index, piece in enumerate(pieces):
        more = index < len(pieces) - 1 or step
        packets.append(b"QTDP:-%x:%x:%s%s" % (MAIN, address, piece, b"-" if more else b""))
    if step:
        packets.append(b"QTDP:-%x:%x:S%sM-1,%x,4" % (MAIN, address, _mask(1 << 16 | 1 << 5), s.counter))
    if c.path == "shared":  # a second tracepoint at the same address, on its own: every call
        packets += [b"QTDP:%x:%x:E:0:0-" % (SHARED, s.function), b"QTDP:-%x:%x:M-1,%x,4" % (SHARED, s.function, s.counter)]
    if c.beside == "stepping":  # while-stepping elsewhere (a module load now and then)
        packets += [b"QTDP:%x:%x:E:%x:0-" % (STEPPER, s.load_module, STEPS),
                    b"QTDP:-%x:%x:S%s" % (STEPPER, s.load_module, _mask(1 << 16))]
    if c.beside == "watches":
        for number, watched in enumerate(s.watched, start=5):
            packets += [b"QTDP:%x:%x:E:0:0-" % (number, watched),
                        b"QTDP:-%x:%x:%s-" % (number, watched, _x(f"const8 1; setv {N['watch_static']:#x}; end")),
                        b"QTDP:-%x:%x:%s" % (number, watched, _x(f"const8 4; setv {N['watch_size']:#x}; end"))]
    return packets


def added_address(c: Combination, s: Sites) -> int:
    """Where the tracepoint added during the run goes: the marker, or the function when the combination's own
    is at the marker (the stub refuses a second location at a compiled probe once the run started)."""
    return s.function if c.path == "marker" else s.marker


def added_definition(c: Combination, s: Sites) -> list[bytes]:
    """The tracepoint GDB downloads during the run (InstallInTrace): every call, its counter."""
    at = added_address(c, s)
    return [b"QTDP:%x:%x:E:0:0:S-" % (ADDED, at) if at == s.marker else b"QTDP:%x:%x:E:0:0-" % (ADDED, at),
            b"QTDP:-%x:%x:M-1,%x,4" % (ADDED, at, s.counter)]


# ---- what a run saw ----------------------------------------------------------------------------------------------


@dataclass
class Halt:
    """The kernel with every CPU stopped: kgtp_counter, every CPU's pc, and the pcs at which the benchmark threads'
    interrupted contexts wait (`interrupted`: a thread the tick preempted, switched out by schedule(), or the one
    whose interrupt handler a CPU runs)."""

    counter: int
    pcs: list[int]
    waiting: list[int] = field(default_factory=list)
    #: which call each place holds (`Stacks.call`), CPUs' then waiting contexts', in the order of `pcs + waiting`
    calls: list[tuple[int, int] | None] = field(default_factory=list)


@dataclass
class Window:
    """Calls counted between two stops of every CPU: kgtp_counter, every CPU's pc and the interrupted contexts'
    pcs (`Halt`) at both."""

    first: int
    last: int
    pcs_before: list[int]
    pcs_after: list[int]
    waiting_before: list[int] = field(default_factory=list)
    waiting_after: list[int] = field(default_factory=list)
    calls_before: list[tuple[int, int] | None] = field(default_factory=list)
    calls_after: list[tuple[int, int] | None] = field(default_factory=list)

    @classmethod
    def between(cls, start: Halt, end: Halt) -> Window:
        return cls(start.counter, end.counter, start.pcs, end.pcs, start.waiting, end.waiting, start.calls,
                   end.calls)

    def start(self) -> Halt:
        return Halt(self.first, self.pcs_before, self.waiting_before, self.calls_before)

    def end(self) -> Halt:
        return Halt(self.last, self.pcs_after, self.waiting_after, self.calls_after)

    def unmoved(self, inside: Callable[[int], bool]) -> int:
        """Calls in flight at `inside` places at both ends that are one and the same call, whether its thread ran
        on a CPU or waited switched out at either end: with four CPUs on a busy host a short window may give a CPU,
        or a thread, no instruction at all."""
        before = {call for pc, call in zip(self.pcs_before + self.waiting_before, self.calls_before)
                  if inside(pc) and call is not None}
        return sum(1 for pc, call in zip(self.pcs_after + self.waiting_after, self.calls_after)
                   if inside(pc) and call in before)


@dataclass
class Frame:
    number: int
    tracepoint: int
    cpu: int
    sequence: int
    stamp: float
    registers: dict[str, int | None]
    counter: int | None = None  # kgtp_counter (or $watch_val) as collected
    variables: dict[int, int | None] = field(default_factory=dict)
    stack: int | None = None  # the first word at the collected rsp
    sdata: str | None = None


@dataclass
class Observed:
    reply: bytes = b""  # QTStart's
    windows: list[Window] = field(default_factory=list)  # of the main tracepoint (QTDisable splits them)
    added_windows: list[Window] = field(default_factory=list)
    status: dict[str, str] = field(default_factory=dict)
    hits: dict[int, int] = field(default_factory=dict)
    fired: dict[int, int] = field(default_factory=dict)
    frames: list[Frame] = field(default_factory=list)
    hits_variable: int | None = None
    p_hits: list[int | None] = field(default_factory=list)
    tasks: dict[int, int] = field(default_factory=dict)  # what the frames' CPUs were running (per CPU: one task)


class CombinationFailure(AssertionError):
    pass


# ---- the runner ----------------------------------------------------------------------------------------------


_PROBE_ROW = re.compile(r"^\s*(\d+)\s+0x([0-9a-f]+)\s+\S+\s+\S+\s+fired (\d+)\s+hits (\d+)", re.M)
_FRAME_ROW = re.compile(r"^frame\s+(\d+)\s+tp\s+(\d+)\s+\+\s*(-?[\d.]+) us\s+cpu (\d+)\s+seq (\d+)", re.M)
_GENERAL = ("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10", "r11", "r12", "r13", "r14",
            "r15", "rip")


def _little(hex_text: bytes) -> int | None:
    return None if b"x" in hex_text else int.from_bytes(bytes.fromhex(hex_text.decode()), "little")




class Runner:
    """One booted machine per CPU count, reused across combinations; `run` drives one combination over RSP."""

    def __init__(self, cold: bool = False) -> None:
        #: run the first combination on a machine as soon as it booted, before its benchmark threads made a call
        #: (see `warm`)
        self.cold = cold
        self.harnesses: dict[int, Harness] = {}
        self.image = KernelImage.load(IMAGE_PATH)
        self.sites = Sites.of(self.image)
        self.stacks = Stacks.of(self.image)

    def close(self) -> None:
        for harness in self.harnesses.values():
            harness.close()
            harness.machine.shutdown()
        self.harnesses.clear()

    def harness(self, cpus: int) -> Harness:
        if cpus not in self.harnesses:
            harness = Harness(build_stub("opt", cpus))
            self.harnesses[cpus] = harness
            if not self.cold:
                self.warm(harness, cpus)
        return self.harnesses[cpus]

    def warm(self, h: Harness, cpus: int) -> None:
        """Let the kernel run until every CPU's benchmark thread has called kgtp_test_function (each makes 100
        calls a tick: two ticks' worth per CPU), so a combination starts from a kernel in its steady state.
        `--cold` skips it (the benchmark threads' first calls are the slow ones: with the interpreting engine, a
        timer tick once came due during nearly every hit and entered the kernel between the hit and its displaced
        `addl`)."""
        deadline = time.monotonic() + WAIT_S
        while (self._u32(h, self.sites.counter) or 0) < 1 + WARM_CALLS * cpus:
            if time.monotonic() > deadline:
                raise CombinationFailure("the benchmark threads made no calls after boot")
            time.sleep(0.01)

    def retire(self, cpus: int) -> None:
        """After a failure: the next combination on these CPUs gets a new machine."""
        harness = self.harnesses.pop(cpus, None)
        if harness is not None:
            harness.close()
            harness.machine.shutdown()

    # -- packets --

    def _one(self, h: Harness, payload: bytes) -> bytes:
        replies = h.request(payload)
        if not replies:
            raise CombinationFailure(f"no answer to {payload[:80]!r}")
        return replies[-1]

    def _ok(self, h: Harness, payload: bytes) -> None:
        reply = self._one(h, payload)
        if reply != b"OK":
            raise CombinationFailure(f"{payload[:80]!r} answered {reply[:200]!r}")

    def _monitor(self, h: Harness, line: str) -> str:
        replies = h.request(b"qRcmd," + line.encode().hex().encode())
        if replies[-1:] != [b"OK"]:
            raise CombinationFailure(f"monitor {line} answered {replies[-1:]!r}")
        return "".join(console_text(r) or "" for r in replies[:-1])

    def _u32(self, h: Harness, address: int) -> int | None:
        reply = self._one(h, b"m%x,4" % address)
        return _little(reply) if re.fullmatch(rb"[0-9a-fx]{8}", reply) else None

    def _read(self, h: Harness, address: int, length: int) -> bytes:
        data = b""
        while len(data) < length:
            want = min(MAX_READ, length - len(data))
            reply = self._one(h, b"m%x,%x" % (address + len(data), want))
            if not re.fullmatch(rb"(?:[0-9a-f]{2})+", reply) or len(reply) != 2 * want:
                raise CombinationFailure(f"m{address + len(data):x},{want:x} answered {reply[:80]!r}")
            data += bytes.fromhex(reply.decode())
        return data

    def _registers(self, h: Harness) -> dict[str, int | None]:
        reply = self._one(h, b"g")
        return {name: _little(reply[16 * i: 16 * i + 16]) for i, name in enumerate(_GENERAL)}

    def _status(self, h: Harness) -> dict[str, str]:
        reply = self._one(h, b"qTStatus")
        return dict(part.split(":", 1) for part in reply.decode()[2:].split(";") if ":" in part) | {
            "running": reply[1:2].decode()}

    # -- the kernel between stops --

    def halt(self, h: Harness, cpus: int) -> Halt:
        """Stop every CPU (`monitor stop`: each at an instruction boundary) and read what the oracle counts from;
        the CPUs stay stopped."""
        self._monitor(h, "stop")
        pcs, sps, rdis, calls = [], [], [], []
        for cpu in range(cpus):
            self._ok(h, b"Hg%x" % (cpu + 1))
            registers = self._registers(h)
            pcs.append(registers["rip"] or 0)
            sps.append(registers["rsp"] or 0)
            rdis.append(registers["rdi"])
            calls.append(self.stacks.call(registers["rsp"], registers["rdi"]))
        self._ok(h, b"Hg0")
        counter = self._u32(h, self.sites.counter)
        assert counter is not None
        waiting, interrupted_calls = self._waiting(h, sps, rdis)
        return Halt(counter, pcs, waiting, calls + interrupted_calls)

    def _waiting(self, h: Harness, sps: list[int], rdis: list[int | None]) -> tuple[list[int], list[tuple[int, int] | None]]:
        """The pcs of the contexts interrupted on the benchmark threads' live stacks, and the call each holds
        (`Stacks.call`): its %rdi as the kernel's entry saved it below the frame, or, while a CPU is still in that
        entry and has not pushed it yet (its sp above the slot), the CPU's own."""
        saved = [int.from_bytes(self._read(h, at, 8), "little") for at in self.stacks.saved]
        pcs, calls = [], []
        for low, high in self.stacks.live(saved, sps):
            data = self._read(h, low - _SAVED_RDI, high - low + _SAVED_RDI)
            for at, pc in interrupt_frames(data[_SAVED_RDI:], low):
                entering = [rdi for sp, rdi in zip(sps, rdis) if at - _SAVED_RDI < sp <= at]
                rdi = entering[0] if entering else int.from_bytes(data[at - low: at - low + 8], "little")
                pcs.append(pc)
                calls.append(self.stacks.call(at, rdi))
        return pcs, calls

    def _run_until(self, h: Harness, done: Callable[[], bool], what: str) -> None:
        """Let the kernel go until `done`; a failure when kgtp_counter stood still for WAIT_S (a slow kernel, the
        interpreted path beside four watches on a loaded host, is waited for as long as it makes calls)."""
        self._monitor(h, "go")
        counter, deadline = None, time.monotonic() + WAIT_S
        while not done():
            now = self._u32(h, self.sites.counter)
            if now != counter:
                counter, deadline = now, time.monotonic() + WAIT_S
            elif time.monotonic() > deadline:
                raise CombinationFailure(f"waited {WAIT_S:.0f}s for {what}: kgtp_counter stuck at {counter}, "
                                         f"the CPUs at {self._where(h)}")
            time.sleep(0.002)

    def _where(self, h: Harness) -> str:
        """Where every CPU is, by function (what a stalled kernel is doing)."""
        machine = h.machine
        places = []
        for rip in machine.run_on_cpu(lambda _uc: machine.cpu_rips()):
            function = self.image.function_at(rip)
            places.append(f"{rip:#x} ({function.name})" if function else f"{rip:#x}")
        return ", ".join(places)

    def _window(self, h: Harness, cpus: int, calls: int, start: Halt,
                ended: Callable[[], bool] = lambda: False) -> Window:
        self._run_until(h, lambda: ended() or (self._u32(h, self.sites.counter) or 0) - start.counter >= calls,
                        f"{calls} calls of kgtp_test_function")
        return Window.between(start, self.halt(h, cpus))

    # -- one combination --

    def run(self, c: Combination) -> Observed:
        h = self.harness(c.cpus)
        h.request(b"QTFrame:ffffffff")
        self._monitor(h, f"engine {c.engine}")
        h.stub.tracer.probe = "int3" if c.path == "int3" else "auto"  # no packet chooses it: `serve --probe`'s
        self._ok(h, b"QTinit")
        for packet in definitions(c, self.sites):
            self._ok(h, packet)
        seen = Observed()
        start = self.halt(h, c.cpus)
        seen.reply = self._one(h, b"QTStart")
        if seen.reply != b"OK":
            self._monitor(h, "go")
            seen.status = self._status(h)
            return seen
        calls = WINDOW_CALLS * (8 if c.buffer == "circular" else 1)
        ends_itself = c.buffer == "fill" or c.passcount or c.condition == "fault"
        stopped = lambda: self._status(h).get("running") == "0"  # noqa: E731
        if c.change == "toggle":
            seen.windows.append(self._window(h, c.cpus, calls, start))
            self._ok(h, b"QTDisable:%x:%x" % (MAIN, self._address(c)))
            gap = self._window(h, c.cpus, calls, seen.windows[-1].end())
            self._ok(h, b"QTEnable:%x:%x" % (MAIN, self._address(c)))
            seen.windows.append(self._window(h, c.cpus, calls, gap.end()))
        elif c.change == "add":
            middle = self._window(h, c.cpus, calls, start)
            for packet in added_definition(c, self.sites):
                self._ok(h, packet)
            last = self._window(h, c.cpus, calls, middle.end())
            seen.windows.append(Window.between(middle.start(), last.end()))
            seen.added_windows.append(Window.between(middle.end(), last.end()))
        elif ends_itself:
            seen.windows.append(self._window(h, c.cpus, FILL_CALLS if c.buffer == "fill" else calls * 4, start,
                                             ended=stopped))
        else:
            seen.windows.append(self._window(h, c.cpus, calls, start))
        for number, _, fired, _ in _PROBE_ROW.findall(self._monitor(h, "probes")):
            seen.fired[int(number)] = seen.fired.get(int(number), 0) + int(fired)
        if c.ending == "disconnect":  # GDB leaves: the stub stops the run (the CPUs stay stopped until then)
            h.reconnect()
            self._monitor(h, "stop")  # the departing GDB's release let them run: counted below as at most that
        else:
            self._ok(h, b"QTStop")
        self._monitor(h, "go")
        self._read_back(h, c, seen)
        return seen

    def _address(self, c: Combination) -> int:
        return address_of(c, self.sites)

    def _read_back(self, h: Harness, c: Combination, seen: Observed) -> None:
        seen.status = self._status(h)
        address = self._address(c)
        for number, where in ((MAIN, address), (SHARED, self.sites.function), (ADDED, added_address(c, self.sites))):
            reply = self._one(h, b"qTP:%x:%x" % (number, where))
            found = re.fullmatch(rb"V([0-9a-f]+):([0-9a-f]+)", reply)
            if found:
                seen.hits[number] = int(found.group(1), 16)
        seen.hits_variable = self._variable(h, HITS)
        seen.p_hits = [self._variable(h, P_HITS + 1 + cpu) for cpu in range(c.cpus)]
        count = int(seen.status.get("tframes", "0"), 16)
        rows = []
        for first in range(0, count, 10000):
            rows += _FRAME_ROW.findall(self._monitor(h, f"frames {first} 10000"))
        sdata = {}
        if c.action == "sdata":
            for first in range(0, count, 10000):
                text = self._monitor(h, f"sdata {first} 10000")
                sdata.update({int(n): v for n, v in re.findall(r"^frame\s+(\d+)\s+tp\s+\d+\s+(.*)$", text, re.M)})
        for number, tp, stamp, cpu, seq in rows:
            number = int(number)
            reply = self._one(h, b"QTFrame:%x" % number)
            if not reply.startswith(b"F"):
                raise CombinationFailure(f"QTFrame:{number:x} answered {reply!r}")
            frame = Frame(number, int(tp), int(cpu), int(seq), float(stamp), self._registers(h))
            frame.counter = self._variable(h, N["watch_val"]) if c.path == "watch" and int(tp) == MAIN else \
                self._u32(h, self.sites.counter)
            frame.variables = {n: self._variable(h, n) for n in (HITS, P_HITS, N["cpu_id"], N["current_task"])}
            sp = frame.registers.get("rsp")
            if sp is not None and c.action in ("memory", "bt"):
                low, high = self._u32(h, sp), self._u32(h, sp + 4)
                frame.stack = None if low is None or high is None else low | high << 32
            frame.sdata = sdata.get(number)
            seen.frames.append(frame)
        self._ok(h, b"QTFrame:ffffffff")

    def _variable(self, h: Harness, number: int) -> int | None:
        reply = self._one(h, b"qTV:%x" % number)
        return int(reply[1:], 16) if reply.startswith(b"V") else None

    def healthy(self, cpus: int) -> None:
        """The stub serves, the kernel runs, nothing was logged as an error (the harness' checks)."""
        h = self.harness(cpus)
        try:
            h.kernel_alive()
        except FuzzFailure as failure:
            raise CombinationFailure(f"after the run: {failure}") from None
        h.first_jiffies = h.read_jiffies()


# ---- the oracle --------------------------------------------------------------------------------------------------


def in_flight(c: Combination, s: Sites) -> Callable[[int], bool] | None:
    """Whether a pc is between a call's add and the combination's probed place, when that is later in the call
    (a marker: after the add; a return); None when the probe fires with the add."""
    if c.path == "marker":
        return lambda pc: pc == s.marker
    if c.path == "kret":
        return lambda pc: s.function < pc < s.function + 16  # past the add, before ret ran
    return None


def expected_fired(c: Combination, w: Window, s: Sites) -> int:
    """The main tracepoint's hits the kernel's count says happened in a window (before any condition).

    kgtp_counter counts entries. The probed place of a marker (after the add) or of a return is later in the
    call: a call that was between the two when every CPU stopped entered in one window and is probed in the next.
    Such a call is where a CPU's pc is, or in a thread interrupted there (`Halt.waiting`): the kernel preempts at
    every tick, and a block boundary after the add (where the out-of-line copy or detour of a probe at the
    function's entry jumps back, or where an earlier interrupt returned) lets a tick in, so the thread can be
    switched out, or its CPU in the handler, with the call half done and no CPU's pc inside the function."""
    calls = w.last - w.first
    inside = in_flight(c, s)
    if inside is None:
        return calls
    after = sum(map(inside, w.pcs_after + w.waiting_after))
    if c.path == "kret":  # a return is probed only for entries made while the run was on
        return calls - after + w.unmoved(inside)
    return calls + sum(map(inside, w.pcs_before + w.waiting_before)) - after


def check(c: Combination, seen: Observed, s: Sites) -> list[str]:
    """Everything wrong with what a combination's run left, as the kernel's own count says it must be."""
    problems: list[str] = []
    reason = refusal(c)
    if reason is not None:
        text = seen.reply[2:].decode(errors="replace") if seen.reply.startswith(b"E.") else ""
        if not re.search(reason, text):
            problems.append(f"tstart answered {seen.reply[:160]!r}, not KGTP's refusal /{reason}/")
        if seen.status.get("running") != "0":
            problems.append("a refused run is running")
        return problems
    if seen.reply != b"OK":
        return [f"tstart answered {seen.reply[:200]!r}"]
    mine = [f for f in seen.frames if f.tracepoint == MAIN]
    stepping = c.path == "stepping"
    hit_frames = [f for f in mine if not stepping or f.registers.get("rip") == s.function]
    step_frames = [f for f in mine if stepping and f.registers.get("rip") != s.function]
    fired = sum(expected_fired(c, w, s) for w in seen.windows)
    frames, created = int(seen.status.get("tframes", "0"), 16), int(seen.status.get("tcreated", "0"), 16)
    stop = next((k for k in seen.status if k.startswith("t") and k not in ("tframes", "tcreated", "tfree", "tsize")),
                "")
    hits = seen.hits.get(MAIN)
    disconnect = c.ending == "disconnect"

    def expect(what: str, got: object, wanted: object) -> None:
        if got != wanted:
            problems.append(f"{what}: {got}, expected {wanted}")

    # the run's end
    ends = {"fault": "terror"} if c.condition == "fault" else {}
    wanted_stop = ends.get("fault") if c.condition == "fault" else (
        "tfull" if c.buffer == "fill" else "tpasscount" if c.passcount and fired >= c.passcount else
        "tdisconnected" if disconnect else "tstop")
    if c.condition == "fault":
        wanted_stop = "terror" if fired else ("tdisconnected" if disconnect else "tstop")
    expect("the run's stop reason", stop, wanted_stop)

    # hits (qTP) and fired (monitor probes) against the kernel's count
    if c.condition in ("none", "true") and not c.passcount and c.buffer != "fill" and c.action != "disable":
        if disconnect:  # GDB's leaving let the CPUs run before the stub stopped the run: at least the count
            if hits is None or hits < fired:
                problems.append(f"hits {hits}, fewer than the {fired} calls counted before GDB left")
        else:
            expect("hits (qTP)", hits, fired)
            if c.path != "watch":
                expect("fired (monitor probes)", seen.fired.get(MAIN), fired)
    elif c.condition == "false":
        expect("hits of a false condition", hits, 0)
        if not disconnect and c.buffer != "fill":  # another tracepoint's frames may fill the buffer first
            expect("fired (monitor probes)", seen.fired.get(MAIN), fired)
    elif c.condition == "fault":
        expect("frames of a faulting condition", len(mine), 0)
        if fired:
            expect("the stopping tracepoint", seen.status.get("terror", "").split(":")[-1], "%x" % MAIN)
    elif c.passcount:
        expect("hits with a pass count", hits, min(c.passcount, fired) if not disconnect else hits)
        if fired >= c.passcount:
            expect("the tracepoint that reached its pass count", seen.status.get("tpasscount"), "%x" % MAIN)
    elif c.action == "disable":
        expect("hits of a tracepoint that disables itself", hits, 1 if fired else 0)
    if c.path == "shared" and c.buffer != "fill" and c.condition != "fault" and not c.passcount:
        if not disconnect and c.action != "disable":
            windows = seen.windows[0].last - seen.windows[0].first if c.change != "toggle" else \
                seen.windows[-1].last - seen.windows[0].first
            expect("hits of the tracepoint sharing the address", seen.hits.get(SHARED), windows)
    if c.change == "add" and not disconnect:
        at = replace(c, path="jump" if c.path == "marker" else "marker")
        expect("hits of the tracepoint added during the run", seen.hits.get(ADDED),
               sum(expected_fired(at, w, s) for w in seen.added_windows))

    # the frames: the buffer's accounting and each CPU's sequence
    expect("frames listed", len(seen.frames), frames)
    rows = [(f.number, f.tracepoint, f.stamp, f.sequence) for f in seen.frames]
    problems += check_sequence(rows, frames, created, {f.number: f.cpu for f in seen.frames})
    if c.buffer != "circular":
        expect("frames kept (a linear buffer loses none)", frames, created)
    per_hit = 1 + (STEPS if stepping else 0)
    # GDB's leaving stops the run while the kernel runs: a hit whose steps were under way loses those still to
    # come, as KGTP's gtp_stop ends every CPU's while-stepping. At most one: the steps run with interrupts off
    # and no CPU is switched out or stopped while it single-steps, so one CPU at a time is in them.
    cut = STEPS if stepping and disconnect else 0
    if c.buffer == "linear" and hits is not None and c.condition != "fault":
        if not 0 <= hits * per_hit - len(mine) <= cut:
            expect("frames of the main tracepoint", len(mine), hits * per_hit)
    if stepping and c.buffer == "linear" and not 0 <= STEPS * len(hit_frames) - len(step_frames) <= cut:
        expect("while-stepping frames", len(step_frames), STEPS * len(hit_frames))

    # the values every frame collected, against the kernel's count
    values = [f.counter for f in hit_frames]
    if None in values:
        problems.append(f"frames without the collected counter: {[f.number for f in hit_frames if f.counter is None][:5]}")
        return problems
    after_add = c.path in ("marker", "kret", "watch")  # these read kgtp_counter after the call's add
    inside = in_flight(c, s)

    def begun(w: Window) -> bool:
        """A marker's call was in flight when the window began: it reads kgtp_counter as it was then, if no
        add comes first."""
        return c.path == "marker" and inside is not None and any(map(inside, w.pcs_before + w.waiting_before))

    calls = [set(range(w.first + after_add - begun(w), w.last + after_add)) for w in seen.windows]
    allowed = set().union(*calls) if calls else set()
    if inside is not None and c.cpus > 1:
        # A marker or a return reads kgtp_counter some time after its call's add: when its CPU is switched out or
        # its thread preempted in between (see expected_fired), other CPUs' adds come first, and two CPUs can
        # read one value. One CPU's calls are its benchmark thread's, one after the other: on each CPU, in the
        # order of its frames, the values strictly increase, and a call collected twice reads one value twice.
        by_cpu: dict[int, list[int]] = {}
        for f in sorted(hit_frames, key=lambda f: (f.cpu, f.sequence)):
            by_cpu.setdefault(f.cpu, []).append(f.counter)  # type: ignore[arg-type]
        for cpu, row in sorted(by_cpu.items()):
            twice = sorted({b for a, b in zip(row, row[1:]) if b <= a})
            if twice:
                problems.append(f"a call collected twice on CPU {cpu}: {twice[:5]}")
    elif len(set(values)) != len(values):
        problems.append("a call collected twice: " + str(sorted(v for v in set(values) if values.count(v) > 1)[:5]))
    if c.path != "marker" and c.path != "kret" and not disconnect:  # a marker's or return's last calls are counted from pcs
        if c.buffer == "linear" and c.condition in ("none", "true") and not c.passcount and c.action != "disable":
            expect("the calls collected (kgtp_counter of every frame)", _ranges(values), _ranges(allowed))
        elif c.passcount or c.buffer == "fill" or c.action == "disable":
            first = min(w.first for w in seen.windows) + after_add
            expect("the calls collected (the first ones of the run)", _ranges(values), _ranges(
                range(first, first + len(values))))
    top = max(allowed, default=0)
    outside = sorted(v for v in set(values) - allowed if not (disconnect and v > top))
    if c.path in ("marker", "kret"):  # at most one call per CPU probed past a window's end
        outside = [v for v in outside if not any(w.last + after_add <= v <= w.last + after_add + c.cpus
                                                 for w in seen.windows)]
    if outside and c.condition != "fault":
        problems.append(f"counters collected outside the calls counted: {outside[:5]}")

    # registers, as the soak checks them (counter2 is counter1 - 1, the expression GDB would evaluate)
    if c.action in ("registers", "$regs", "$args", "sdata") and c.path not in ("watch",):
        spec = TracepointSpec("kgtp_test_function", "", (), ("$rdi", "$rsi", "kgtp_counter", "(2*counter1+3*counter2)"))
        records = []
        for f in hit_frames:
            rdi, rsi = f.registers.get("rdi"), f.registers.get("rsi")
            readback = {"$rdi": rdi, "$rsi": rsi, "kgtp_counter": f.counter,
                        "(2*counter1+3*counter2)": None if rdi is None or rsi is None else
                        2 * _s32(rdi) + 3 * _s32(rsi)}
            records.append(FrameRecord(f.number, 1, None, {k: None if v is None else str(_s32(v) if k[0] == "$" else v)
                                                           for k, v in readback.items()}, f.cpu))
        consecutive = c.buffer == "linear" and c.condition in ("none", "true") and c.change == "none" and \
            c.path not in ("kret",)
        found = check_frame_values(records, [spec], None)
        if not consecutive:  # frames of one CPU are not every call of it: only each frame's own consistency
            found = [p for p in found if "stepped" not in p]
        problems += found
    if c.action in ("registers", "$regs") and c.path not in ("watch", "kret"):
        wanted_pc = s.marker if c.path == "marker" else s.function
        wrong = [f.number for f in hit_frames if f.registers.get("rip") != wanted_pc]
        if wrong:
            problems.append(f"frames whose pc is not the probed address {wanted_pc:#x}: {wrong[:5]}")
    if c.action in ("memory", "bt") and c.path not in ("watch", "kret"):
        wrong = [f.number for f in hit_frames if f.stack is None or not any(f.stack in r for r in s.bench)]
        if wrong:
            problems.append(f"frames whose stack does not start with a return into the benchmark: {wrong[:5]}")
    if c.action == "sdata":
        for f in hit_frames:
            found = re.fullmatch(r"counter1=(-?\d+) counter2=(-?\d+)", f.sdata or "")
            rdi = f.registers.get("rdi")
            if found is None or rdi is None or int(found.group(1)) != _s32(rdi) or \
                    int(found.group(2)) != int(found.group(1)) - 1:
                problems.append(f"frame {f.number}: $_sdata {f.sdata!r} with counter1 {rdi}")
                break
    if c.action == "teval" and c.buffer == "linear" and c.condition != "fault":
        counted = sorted(f.variables.get(HITS) or 0 for f in hit_frames)
        expect("$hits collected at each hit", counted, list(range(1, len(hit_frames) + 1)))
        expect("$hits after the run", seen.hits_variable, hits)
    if c.action == "percpu" and c.condition != "fault":
        by_cpu: dict[int, list[int]] = {}
        for f in hit_frames:
            by_cpu.setdefault(f.cpu, []).append(f.variables.get(P_HITS) or 0)
        for cpu, counted in sorted(by_cpu.items()):
            if c.buffer == "linear":
                expect(f"$p_hits collected on CPU {cpu}", sorted(counted), list(range(1, len(counted) + 1)))
            elif sorted(counted) != list(range(min(counted), min(counted) + len(counted))):
                problems.append(f"$p_hits of CPU {cpu} not consecutive: {sorted(counted)[:8]}")
        if hits is not None and c.buffer != "fill" and not disconnect:
            expect("$p_hits summed over the CPUs", sum(v or 0 for v in seen.p_hits), hits)
    if c.action == "kgtp":
        tasks: dict[int, set[int | None]] = {}
        for f in hit_frames:
            if f.variables.get(N["cpu_id"]) != f.cpu:
                problems.append(f"frame {f.number}: $cpu_id {f.variables.get(N['cpu_id'])} on CPU {f.cpu}")
                break
            tasks.setdefault(f.cpu, set()).add(f.variables.get(N["current_task"]))
        if c.path != "kret" and any(len(t) != 1 or None in t or 0 in t for t in tasks.values()):
            problems.append(f"$current_task of each CPU's benchmark thread not one task: {tasks}")
        if len({next(iter(t)) for t in tasks.values()}) != len(tasks):
            problems.append(f"two CPUs ran one task: {tasks}")
    return problems


def _s32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >> 31 else value


def _ranges(values: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted values as runs [first, last]: a short message for a long list."""
    out: list[tuple[int, int]] = []
    for v in sorted(values):
        if out and v == out[-1][1] + 1:
            out[-1] = (out[-1][0], v)
        else:
            out.append((v, v))
    return out


# ---- the campaign ------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    combination: Combination
    problems: list[str]
    seconds: float


def run_one(runner: Runner, c: Combination) -> Outcome:
    """Run and check one combination; any failure (the oracle's, the harness', an exception) is its problems, and
    the machine that saw it is replaced."""
    started = time.monotonic()
    try:
        seen = runner.run(c)
        problems = check(c, seen, runner.sites)
        runner.healthy(c.cpus)
    except (CombinationFailure, FuzzFailure, AssertionError) as failure:
        problems = [f"{type(failure).__name__}: {failure}"]
    if problems:
        runner.retire(c.cpus)
    return Outcome(c, problems, time.monotonic() - started)


def campaign(seconds: float, seed: int, *, limit: int | None = None, report: Callable[[str], None] = print,
             cold: bool = False) -> tuple[int, list[Outcome]]:
    """Combinations of `seed` until `seconds` passed (or `limit` ran); returns how many ran and the failures."""
    runner = Runner(cold)
    failures: list[Outcome] = []
    ran = 0
    started = time.monotonic()
    next_report = started + 30
    try:
        for c in walk(seed):
            if time.monotonic() - started >= seconds or (limit is not None and ran >= limit):
                break
            outcome = run_one(runner, c)
            ran += 1
            if outcome.problems:
                failures.append(outcome)
                report(f"FAILURE (seed {seed}, combination {ran}): --only '{c.spec()}'\n  "
                       + "\n  ".join(outcome.problems[:8]))
            if time.monotonic() >= next_report:
                next_report += 30
                report(f"  {time.monotonic() - started:6.0f}s  {ran} combinations, {len(failures)} failed")
    finally:
        runner.close()
    return ran, failures


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/combinations", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120, help="how long to run (default: 120)")
    parser.add_argument("--seed", type=int, default=None, help="the walk's seed (default: random, printed)")
    parser.add_argument("--only", default=None, metavar="SPEC",
                        help="run one combination, as a failure printed it ('engine=opt path=jump ...')")
    parser.add_argument("--cold", action="store_true",
                        help="start on a machine as soon as it booted, before its benchmark threads ran")
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.getLogger().addHandler(logging.NullHandler())
    if args.only is not None:
        c = normalize(Combination.parse(args.only))
        runner = Runner(cold=args.cold)
        try:
            outcome = run_one(runner, c)
        finally:
            runner.close()
        print(f"{c.spec()}: " + ("passed" if not outcome.problems else "FAILED\n  " + "\n  ".join(outcome.problems)))
        return 1 if outcome.problems else 0
    seed = args.seed if args.seed is not None else random.SystemRandom().getrandbits(32)
    print(f"combinations: {args.seconds:.0f} s, seed {seed}", flush=True)
    started = time.monotonic()
    ran, failures = campaign(args.seconds, seed, cold=args.cold)
    print(f"combinations: {ran} checked in {time.monotonic() - started:.0f} s, {len(failures)} failed (seed {seed})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
