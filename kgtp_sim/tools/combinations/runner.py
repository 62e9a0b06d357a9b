"""The combination suite's kernel runner: one booted machine per CPU count, reused across combinations, an
in-process KGTP stub fed RSP packets exactly as the TCP server feeds it (the fuzzer's `Harness`); and what a run
saw (`Halt`, `Window`, `Frame`, `Observed`), which the oracle reads.

With every CPU stopped (`monitor stop`, at an instruction boundary, never in the stub's code) the runner reads
kgtp_counter and each CPU's pc, starts the run, lets the kernel go until the counter has moved enough (events, never
a time window), stops every CPU again, reads the counter and pcs, stops the run, and reads every frame back
(QTFrame, `g`, `m`, qTV, `monitor frames`). A call between the function's entry and the probed place when every CPU
stopped is counted from where it is: its CPU's pc, or the interrupted pc on its thread's stack when the tick
preempted it there (`Stacks`, `interrupted`). The packet helpers and the frames' read-back (`Driver`) serve the
process runner (process.py) too.

Runs on the caller's thread (the command's main thread, or a test's), which feeds the session in place of the
server thread while each machine's CPU and tick threads run its kernel.
"""

from __future__ import annotations

import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ...client import console_text
from ...machine import KernelImage
from ...machine.cpu import KERNEL_CS, KERNEL_DS
from ...machine.dwarf import KernelDwarf
from ...rsp.packets.data import MAX_READ
from ..fuzz_harness import FuzzFailure, Harness, build_stub
from .space import (
    ADDED, FILL_CALLS, IMAGE_PATH, MAIN, N, SHARED, WAIT_S, WARM_CALLS, WINDOW_CALLS, Combination, Sites,
    added_address, added_definition, address_of, definitions, hits_variable, p_hits_variable,
)

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
    #: the variables every frame is asked for: `hits`, `p_hits`, KGTP's `cpu_id` and `current_task`
    variables: dict[str, int | None] = field(default_factory=dict)
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
    #: where the run's tracepoints were, when they differ from the runner's (a process's jump pad, `Sites.relocated`)
    sites: Sites | None = None
    #: a process's sleeps that ended early (callers.c's interrupted_sleeps): the debugger's stops must not show any
    interrupted_sleeps: int | None = None


class CombinationFailure(AssertionError):
    """The runner could not run a combination as it must be run (no answer, a stalled kernel or program)."""


# ---- the benchmark threads' stacks ------------------------------------------------------------------------------


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


# ---- the runners ---------------------------------------------------------------------------------------------


_PROBE_ROW = re.compile(r"^\s*(\d+)\s+0x([0-9a-f]+)\s+\S+\s+\S+\s+fired (\d+)\s+hits (\d+)", re.M)
_FRAME_ROW = re.compile(r"^frame\s+(\d+)\s+tp\s+(\d+)\s+\+\s*(-?[\d.]+) us\s+cpu (\d+)\s+seq (\d+)", re.M)
_GENERAL = ("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10", "r11", "r12", "r13", "r14",
            "r15", "rip")


def _little(hex_text: bytes) -> int | None:
    return None if b"x" in hex_text else int.from_bytes(bytes.fromhex(hex_text.decode()), "little")


class Driver:
    """What a runner of either space does over RSP: one combination's packets from QTinit to the last frame read
    back (`run`), the harness of each CPU count, and the checks after a run (`healthy`). A space's runner says how
    its target stops and goes (`halt`, `_run_until`), what GDB sets up before a run (`_prepare`), and what its
    tracepoints' places are (`sites`)."""

    sites: Sites
    image: KernelImage

    def __init__(self) -> None:
        self.harnesses: dict[int, Harness] = {}

    # -- what a space's runner says --

    def harness(self, cpus: int) -> Harness:
        raise NotImplementedError

    def halt(self, h: Harness, cpus: int) -> Halt:
        """The target stopped (it stays so), and what the oracle counts from."""
        raise NotImplementedError

    def _run_until(self, h: Harness, done: Callable[[], bool], what: str) -> None:
        """Let the target go until `done` (asked with the target stopped)."""
        raise NotImplementedError

    def _prepare(self, h: Harness, c: Combination) -> None:
        self._monitor(h, f"engine {c.engine}")

    def _started(self, h: Harness, c: Combination, seen: Observed) -> None:
        """The run started (the target stopped)."""

    def _left(self, h: Harness) -> None:
        """GDB left and another came (the run stopped by the disconnection)."""

    def _ended(self, h: Harness, c: Combination, seen: Observed) -> None:
        """The run stopped (the target stopped): before the frames are read back."""

    def _count(self, h: Harness) -> int:
        counter = self._u32(h, self.sites.counter)
        if counter is None:
            raise CombinationFailure(f"the count at {self.sites.counter:#x} cannot be read")
        return counter

    def close(self) -> None:
        for cpus in list(self.harnesses):
            self.retire(cpus)

    def console_tail(self, cpus: int, lines: int = 20) -> str:
        """The last lines of the kernel's console on the machine of `cpus` CPUs ("" with none): what a failure's
        report shows when the kernel said something (a panic's message and its registers)."""
        harness = self.harnesses.get(cpus)
        if harness is None:
            return ""
        return "\n".join(harness.machine.console_text().splitlines()[-lines:])

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
        if not re.fullmatch(rb"(?:[0-9a-fx]{2})+", reply) or len(reply) < 16 * len(_GENERAL):
            raise CombinationFailure(f"g answered {reply[:80]!r}")
        return {name: _little(reply[16 * i: 16 * i + 16]) for i, name in enumerate(_GENERAL)}

    def _status(self, h: Harness) -> dict[str, str]:
        reply = self._one(h, b"qTStatus")
        return dict(part.split(":", 1) for part in reply.decode()[2:].split(";") if ":" in part) | {
            "running": reply[1:2].decode()}

    def _variable(self, h: Harness, number: int) -> int | None:
        reply = self._one(h, b"qTV:%x" % number)
        return int(reply[1:], 16) if reply.startswith(b"V") else None

    def _window(self, h: Harness, cpus: int, calls: int, start: Halt,
                ended: Callable[[], bool] = lambda: False) -> Window:
        self._run_until(h, lambda: ended() or self._count(h) - start.counter >= calls, f"{calls} calls counted")
        return Window.between(start, self.halt(h, cpus))

    # -- one combination --

    def run(self, c: Combination) -> Observed:
        h = self.harness(c.cpus)
        h.request(b"QTFrame:ffffffff")
        self._prepare(h, c)
        self._ok(h, b"QTinit")
        for packet in definitions(c, self.sites):
            self._ok(h, packet)
        seen = Observed()
        start = self.halt(h, c.cpus)
        seen.reply = self._one(h, b"QTStart")
        if seen.reply != b"OK":
            self._ended(h, c, seen)
            seen.status = self._status(h)
            return seen
        self._started(h, c, seen)
        calls = WINDOW_CALLS * (8 if c.buffer == "circular" else 1)
        ends_itself = c.buffer == "fill" or c.passcount or c.condition == "fault"
        stopped = lambda: self._status(h).get("running") == "0"  # noqa: E731
        address = address_of(c, self.sites)
        if c.change == "toggle":
            seen.windows.append(self._window(h, c.cpus, calls, start))
            self._ok(h, b"QTDisable:%x:%x" % (MAIN, address))
            gap = self._window(h, c.cpus, calls, seen.windows[-1].end())
            self._ok(h, b"QTEnable:%x:%x" % (MAIN, address))
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
        if c.ending == "disconnect":  # GDB leaves: the stub stops the run
            h.reconnect()
            self._left(h)
        else:
            self._ok(h, b"QTStop")
        self._ended(h, c, seen)
        self._read_back(h, c, seen)
        return seen

    def _read_back(self, h: Harness, c: Combination, seen: Observed) -> None:
        """Every frame, as GDB reads it: QTFrame, `g`, the count (`m`), the variables (qTV), the stack's first
        word; hits (qTP) and the variables after the run."""
        sites = seen.sites or self.sites
        seen.status = self._status(h)
        for number, where in ((MAIN, address_of(c, sites)), (SHARED, sites.function), (ADDED, added_address(c, sites))):
            reply = self._one(h, b"qTP:%x:%x" % (number, where))
            found = re.fullmatch(rb"V([0-9a-f]+):([0-9a-f]+)", reply)
            if found:
                seen.hits[number] = int(found.group(1), 16)
        hits, p_hits = hits_variable(c), p_hits_variable(c)
        seen.hits_variable = self._variable(h, hits)
        seen.p_hits = [self._variable(h, p_hits + 1 + cpu) for cpu in range(c.cpus)]
        count = int(seen.status.get("tframes", "0"), 16)
        rows = []
        for first in range(0, count, 10000):
            rows += _FRAME_ROW.findall(self._monitor(h, f"frames {first} 10000"))
        sdata = {}
        if c.action == "sdata":
            for first in range(0, count, 10000):
                text = self._monitor(h, f"sdata {first} 10000")
                sdata.update({int(n): v for n, v in re.findall(r"^frame\s+(\d+)\s+tp\s+\d+\s+(.*)$", text, re.M)})
        variables = {"hits": hits, "p_hits": p_hits, "cpu_id": N["cpu_id"], "current_task": N["current_task"]}
        for number, tp, stamp, cpu, seq in rows:
            number = int(number)
            reply = self._one(h, b"QTFrame:%x" % number)
            if not reply.startswith(b"F"):
                raise CombinationFailure(f"QTFrame:{number:x} answered {reply!r}")
            frame = Frame(number, int(tp), int(cpu), int(seq), float(stamp), self._registers(h))
            frame.counter = self._variable(h, N["watch_val"]) if c.path == "watch" and int(tp) == MAIN else \
                self._u32(h, sites.counter)
            frame.variables = {name: self._variable(h, n) for name, n in variables.items()}
            sp = frame.registers.get("rsp")
            if sp is not None and c.action in ("memory", "bt"):
                low, high = self._u32(h, sp), self._u32(h, sp + 4)
                frame.stack = None if low is None or high is None else low | high << 32
            frame.sdata = sdata.get(number)
            seen.frames.append(frame)
        self._ok(h, b"QTFrame:ffffffff")

    def healthy(self, cpus: int) -> None:
        """The stub serves, the kernel runs, nothing was logged as an error (the harness' checks)."""
        h = self.harness(cpus)
        try:
            h.kernel_alive()
        except FuzzFailure as failure:
            raise CombinationFailure(f"after the run: {failure}") from None
        h.first_jiffies = h.read_jiffies()


class Runner(Driver):
    """The kernel's space: one booted machine per CPU count, reused across combinations; its CPUs stopped and let
    go with `monitor stop` and `monitor go`."""

    def __init__(self, cold: bool = False) -> None:
        super().__init__()
        #: run the first combination on a machine as soon as it booted, before its benchmark threads made a call
        #: (see `warm`)
        self.cold = cold
        self.image = KernelImage.load(IMAGE_PATH)
        self.sites = Sites.of(self.image)
        self.stacks = Stacks.of(self.image)

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

    def _prepare(self, h: Harness, c: Combination) -> None:
        super()._prepare(h, c)
        h.stub.tracer.probe = "int3" if c.path == "int3" else "auto"  # no packet chooses it: `serve --probe`'s

    def _left(self, h: Harness) -> None:
        self._monitor(h, "stop")  # the departing GDB's release let the CPUs run: counted as at most that

    def _ended(self, h: Harness, c: Combination, seen: Observed) -> None:
        self._monitor(h, "go")

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
        counter = self._count(h)
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
