"""Programs on the kernel, timed: what a process costs the machine (the issue's user-space speed figures).

Five measurements, each on a booted machine unless said (booted: started, and one untimed run of the program
served and ended, so boot is excluded; the kernel's own threads run as they always do, at hz 100, pace 100):

1. **hello**: a dynamic glibc hello world (fixtures/bench/hello.c, `gcc -O2`, a PIE: its dynamic linker and
   libc.so.6 packed with it, as `kgtp-sim run` packs them) from `Processes.spawn` to its exit as
   `Processes.wait` reports it, host seconds (median of the runs), and the emulated instructions of the same
   interval (separate runs): the machine's count (the program's, the kernel's work for
   it and whatever the kernel's own threads did meanwhile) and the instructions retired in user mode (the
   machine's performance counter, exact). Then `kgtp-sim run` on the same program, end to end: a new Python,
   boot, the run, shutdown (boot included), with compiled bytecode as an installed command has it.
2. **user vs kernel**: the same bytes in ring 3 and in ring 0. fixtures/bench/windows.c's ring_loop (the kernel's
   thesis loop, kgtp_bench_loop calling kgtp_test_function in fixtures/kernel/module.c, instruction for
   instruction in assembly, its counter through a register: 9 instructions a call) runs in a process, and its
   bytes, copied into kernel memory (module space) at the same offset in a page, run through `Machine.call`; the
   kernel's own kgtp_bench_loop too, for reference. Emulated instructions a call (exact, on the counting machine)
   and host ns a call, timed interleaved (rounds of: a few of the process's windows, as many calls of each kernel
   loop, of 0 calls then of n), the difference of the medians at n and at 0 over n, so the fixed cost of each
   side (the window hooks, `Machine.call`'s) drops out; then instructions per host second, and the ratio to ring
   0's copy.
3. **getpid**: a round trip through the `syscall` instruction, the kernel's entry, do_syscall and `sysretq`
   (with the user loop's own add, cmp, jne and mov: five user instructions a call), instructions a call (exact)
   and host ns a call.
4. **switch**: two processes on one CPU calling sched_yield, each call a switch to the other (the kernel's
   round-robin pick, a CR3 load each time), instructions and host ns per switch (the kernel's
   nr_context_switches, read from its symbol).
5. **rss**: the same two processes for `switches` switches on one CPU (and, `cpus=2`, two pairs, one on each
   CPU, where the machine's own CPU switches flush the TLB too: scheduler.py), the process's resident memory
   (/proc/self/status VmRSS) sampled meanwhile: flat when no sample after the first tenth of the switches is
   more than RSS_TOLERANCE_MIB above the sample taken there.

Figures 2 to 4 come from windows (fixtures/bench/windows.c, `gcc -O2 -static`): the program brackets each round
of work with window_begin() and window_end(), and a hook on the first instruction of each (`Windows`) reads the
machine's instruction count, the host's clock, the interrupts and exceptions delivered and the kernel's context
switches at that instant. Only clean windows count: no interrupt delivered inside (no tick, so none of the
kernel's threads ran and nothing but the work was emulated), which makes the instruction counts exact and the
same in every clean window (`exact` says whether they were). Each figure is taken on two booted machines (`Pair`):
instructions on one that counts from boot to shutdown, host time on one that never counts (the counting hook
costs about 12 ns an instruction); see Booted for why neither switches.

Runs on the caller's thread; the machines' CPU and tick threads run the programs, the hooks run on the CPU thread.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from elftools.elf.elffile import ELFFile
from unicorn import UC_HOOK_CODE
from unicorn import x86_const as X

from kgtp_sim.client.paths import VMLINUX
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.counters import EventAttr, HwEvent, PerfType
from kgtp_sim.machine.initramfs import Archive
from kgtp_sim.machine.layout import PAGE_SIZE, page_floor

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ROOT / "fixtures" / "bench"
#: program -> the compiler's command line before the source and -o
BUILDS = {"hello": ("gcc", "-O2"), "windows": ("gcc", "-O2", "-static")}
USER_INSTRUCTIONS = EventAttr(PerfType.HARDWARE, HwEvent.INSTRUCTIONS, exclude_kernel=True)
#: a soak is flat when no later sample is this much above the one taken after its first tenth
RSS_TOLERANCE_MIB = 8
ENV = ("PATH=/usr/bin:/bin",)
WAIT_S = 300


class Unavailable(RuntimeError):
    """The programs cannot be built here (no gcc, or no static glibc)."""


def build(workdir: Path) -> dict[str, Path]:
    """fixtures/bench/{hello,windows}.c compiled into workdir; raises Unavailable saying what is missing."""
    if shutil.which("gcc") is None:
        raise Unavailable("gcc is not installed")
    out = {}
    for name, command in BUILDS.items():
        binary = workdir / name
        result = subprocess.run([*command, str(SOURCES / f"{name}.c"), "-o", str(binary)], capture_output=True,
                                text=True)
        if result.returncode:
            raise Unavailable(f"{' '.join(command)} {name}.c failed: {result.stderr.strip()[-300:]}")
        out[name] = binary
    return out


def symbols_of(binary: Path, *names: str) -> list[int]:
    """The addresses of `names` in a static program's symbol table."""
    with open(binary, "rb") as f:
        symbols = ELFFile(f).get_section_by_name(".symtab")
        return [symbols.get_symbol_by_name(name)[0]["st_value"] for name in names]


def bytes_at(binary: Path, address: int, length: int) -> bytes:
    """`length` bytes of a static program's file image at virtual address `address`."""
    with open(binary, "rb") as f:
        elf = ELFFile(f)
        offset = next(elf.address_offsets(address, length))
        f.seek(offset)
        return f.read(length)


# ---- a booted machine ----------------------------------------------------------------------------------------


class Booted:
    """A started machine with programs packed in its initramfs (before boot, as `kgtp-sim run` packs them); the
    processes' output is kept (`output`). A counting machine counts every instruction from boot to shutdown, and
    the instructions of user mode on CPU 0 (`user`, a performance counter); the others never count. Nothing
    here switches counting off or deletes a hook once a program has run: with unicorn 2.1.4, deleting a code
    hook that a process's code ran under (`uc.hook_del`, `set_counting(False)`, closing the last performance
    counter) leaves the machine delivering no more page faults (the kernel's pagefault_test_thread spins on its
    demand page, and processes never end)."""

    def __init__(self, programs: list[Path], cpus: int = 1, image: KernelImage | None = None,
                 counting: bool = False) -> None:
        archive = Archive()
        self.inside = {program: archive.add_program(program) for program in programs}
        self.machine = Machine(image or KernelImage.load(VMLINUX), cpus=cpus)
        self.machine.processes.load_archive(archive.pack())
        self.output: list[bytes] = []
        self.machine.processes.sink = lambda fd, data: self.output.append(data)
        self.counting = counting
        self.hooks: Windows | None = None  #: installed by the first `windows_of`
        if counting:
            self.machine.set_counting(True)
            self.user = self.machine.counters.open(0, USER_INSTRUCTIONS, enabled=True)
        self.machine.start()

    def run(self, program: Path, *args: str, cpu: int = -1) -> int:
        """Start the program and wait for its end; its exit status (raises if it failed)."""
        return self.wait(self.spawn(program, *args, cpu=cpu))

    def spawn(self, program: Path, *args: str, cpu: int = -1) -> int:
        return self.machine.processes.spawn(self.inside[program], [program.name, *args], ENV, cpu=cpu)

    def wait(self, pid: int) -> int:
        ended = self.machine.processes.wait(pid, WAIT_S)
        if ended is None or ended.shell_status:
            raise RuntimeError(f"pid {pid}: {'still running' if ended is None else ended.shell_status} "
                               f"{b''.join(self.output)[-500:]!r}")
        return ended.shell_status

    def close(self) -> None:
        self.machine.shutdown()

    def __enter__(self) -> Booted:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Window:
    """One round of work between window_begin and window_end, as the hooks saw its two ends."""

    instructions: int  #: the machine's count (counting on), else 0
    ns: int  #: host nanoseconds
    interrupts: int  #: interrupts and exceptions the machine delivered meanwhile
    switches: int  #: the kernel's nr_context_switches meanwhile

    @property
    def clean(self) -> bool:
        return self.interrupts == 0


class Windows:
    """Hooks on window_begin and window_end of fixtures/bench/windows.c (static: the ELF's addresses) in a running
    machine, from `install` on; `windows(since)` pairs each process's (CR3's) begin with its next end among the
    marks from index `since`. The hooks are never deleted (see Booted): they cost nothing elsewhere."""

    def __init__(self, machine: Machine, binary: Path) -> None:
        self.begin, self.end = symbols_of(binary, "window_begin", "window_end")
        self.machine = machine
        self.switches_at = machine.image.address_of("nr_context_switches")
        self.marks: list[tuple[bool, int, int, int, int, int]] = []

        def install(uc) -> None:
            for address in (self.begin, self.end):
                uc.hook_add(UC_HOOK_CODE, self._mark, None, address, address)
            uc.ctl_flush_tb()  # code translated before (an earlier run of the program) gets the hooks too

        machine.run_on_cpu(install)

    def _mark(self, uc, address: int, _size: int, _data: object) -> None:
        now = time.perf_counter_ns()
        self.marks.append((address == self.begin, uc.reg_read(X.UC_X86_REG_CR3), self.machine.instructions(), now,
                           sum(self.machine.cpu.delivered.values()),
                           int.from_bytes(uc.mem_read(self.switches_at, 8), "little")))

    def windows(self, since: int = 0) -> list[Window]:
        opened: dict[int, tuple] = {}
        out = []
        for mark in self.marks[since:]:
            is_begin, cr3 = mark[0], mark[1]
            if is_begin:
                opened[cr3] = mark
            elif cr3 in opened:
                first = opened.pop(cr3)
                out.append(Window(max(mark[2] - first[2], 0), mark[3] - first[3], mark[4] - first[4],
                                  mark[5] - first[5]))
        return out


def windows_of(booted: Booted, binary: Path, args: tuple[str, ...], processes: int = 1) -> list[Window]:
    """Run `processes` copies of the windows program with `args` (all at once, on CPU 0); every window of all of
    them."""
    if booted.hooks is None:
        booted.hooks = Windows(booted.machine, binary)
    since = len(booted.hooks.marks)
    pids = [booted.spawn(binary, *args, cpu=0) for _ in range(processes)]
    for pid in pids:
        booted.wait(pid)
    return booted.hooks.windows(since)


@dataclass
class Pair:
    """The two machines a measurement runs on: `timed` never counts, `counted` always does (Booted)."""

    timed: Booted
    counted: Booted

    def close(self) -> None:
        self.timed.close()
        self.counted.close()


#: how often a program's rounds run again when none of its windows was clean
ATTEMPTS = 8


def clean_windows(booted: Booted, binary: Path, kind: str, calls: int, windows: int, processes: int = 1,
                  units=lambda window, n: n) -> list[Window]:
    """The clean windows, with units of work in them, of one run of `processes` copies of the windows program
    doing `windows` rounds of `calls`; the run goes again when none was (a busy host stretches windows over
    ticks), up to ATTEMPTS times."""
    seen = 0
    for _ in range(ATTEMPTS):
        got = windows_of(booted, binary, (kind, str(calls), str(windows)), processes)
        seen += len(got)
        kept = [w for w in got if w.clean and units(w, calls)]
        if kept:
            return kept
    raise RuntimeError(f"{kind} {calls}: none of {seen} windows ran without an interrupt")


def counted_per_unit(booted: Booted, binary: Path, kind: str, n: int, windows: int, processes: int = 1,
                     units=lambda window, n: n) -> dict:
    """Instructions per unit of work on a counting machine: windows of n and of 2n calls, the difference of their
    medians over the difference of their units, so the window's own instructions (its two calls, the loop's
    prologue) drop out; `exact` if every clean window of each size counted the same."""
    one = clean_windows(booted, binary, kind, n, windows, processes, units)
    two = clean_windows(booted, binary, kind, 2 * n, windows, processes, units)
    insns = (statistics.median(w.instructions for w in two) - statistics.median(w.instructions for w in one)) / (
        statistics.median(units(w, 2 * n) for w in two) - statistics.median(units(w, n) for w in one))
    exact = all(len({(w.instructions, units(w, calls)) for w in ws}) == 1 for ws, calls in ((one, n), (two, 2 * n)))
    return {"insns": insns, "exact": exact, "windows": [len(one), len(two)],
            "units_per_window": statistics.median(units(w, n) for w in one)}


#: the counting machine's windows do this share of the timing machine's calls: its hook on every instruction makes
#: each one some 30 times slower, and a window as long as a tick's period (10 ms) always holds one (none was clean
#: at 200 switches); the count per call is exact whatever the calls (the difference of two window sizes)
COUNTED_SHARE = 8


def per_unit(pair: Pair, binary: Path, kind: str, n: int, windows: int, processes: int = 1,
             units=lambda window, n: n) -> dict:
    """Instructions and host ns per unit of work (`units(window, n)` in a window: n calls unless said) over the
    clean windows: instructions as `counted_per_unit` says, from windows of n / COUNTED_SHARE and twice that; host
    ns: windows of n on the timing machine, median, min and max of each one's ns per unit."""
    counted = counted_per_unit(pair.counted, binary, kind, max(1, n // COUNTED_SHARE), windows, processes, units)
    timed = clean_windows(pair.timed, binary, kind, n, windows, processes, units)
    ns = [w.ns / units(w, n) for w in timed]
    return {**counted, "ns": statistics.median(ns), "ns_min": min(ns), "ns_max": max(ns),
            "windows": [*counted["windows"], len(timed)]}


# ---- the measurements ------------------------------------------------------------------------------------------


def hello_row(pair: Pair, hello: Path, runs: int) -> dict:
    """Spawn to exit of the dynamic hello world on booted machines: host seconds, instructions."""
    seconds, machine_insns, user_insns = [], [], []
    for booted in (pair.timed, pair.counted):
        booted.output.clear()
        booted.run(hello)  # untimed: the program's first run on this machine
        for _ in range(runs):
            if booted.counting:
                machine, user = booted.machine, booted.user
                i0, u0 = machine.run_on_cpu(lambda uc: (machine.instructions(), user.read().value))
                booted.run(hello)
                i1, u1 = machine.run_on_cpu(lambda uc: (machine.instructions(), user.read().value))
                machine_insns.append(i1 - i0)
                user_insns.append(u1 - u0)
            else:
                t0 = time.perf_counter()
                booted.run(hello)
                seconds.append(time.perf_counter() - t0)
        printed = b"".join(booted.output).count(b"hello, world\n")
        if printed != runs + 1:
            raise RuntimeError(f"hello printed {printed} times in {runs + 1} runs")
    return {"row": "hello", "what": "dynamic glibc hello world, spawn to exit (booted machine)", "runs": runs,
            "seconds_median": statistics.median(seconds), "seconds_min": min(seconds),
            "seconds_max": max(seconds), "insns_median": int(statistics.median(machine_insns)),
            "user_insns": int(statistics.median(user_insns))}


def run_command_row(hello: Path, runs: int) -> dict:
    """`kgtp-sim run hello` end to end (a new Python, boot, the run, shutdown): host seconds. As an installed
    command runs: with the package's compiled bytecode (Python's cache, in a directory of its own so the checkout
    is not written, filled by one untimed run first), whatever PYTHONDONTWRITEBYTECODE says here; without it every
    run compiles the package's modules again."""
    seconds = []
    with tempfile.TemporaryDirectory(prefix="kgtp-pycache-") as cache:
        env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "PYTHONPATH": str(ROOT),
               "PYTHONPYCACHEPREFIX": cache}
        for run in range(runs + 1):
            t0 = time.perf_counter()
            result = subprocess.run([sys.executable, "-m", "kgtp_sim", "run", "--cpus", "1", str(hello)],
                                    capture_output=True, env=env, timeout=WAIT_S, cwd=ROOT)
            if run:
                seconds.append(time.perf_counter() - t0)
            if result.returncode or result.stdout != b"hello, world\n":
                raise RuntimeError(f"kgtp-sim run: status {result.returncode}, {result.stdout!r} "
                                   f"{result.stderr[-500:]!r}")
    return {"row": "kgtp-sim run", "what": "`kgtp-sim run --cpus 1 hello`, end to end (boot included)",
            "runs": runs, "seconds_median": statistics.median(seconds), "seconds_min": min(seconds),
            "seconds_max": max(seconds)}


def ring0_copy(machine: Machine, binary: Path) -> tuple[int, int, bytes]:
    """The windows program's ring_loop, ring_loop to ring_end, copied into `machine`'s module space (executable
    kernel memory) at the offset in a page it has in the program, and a zeroed counter for it in vmalloc space:
    (the copy's address, the counter's, the bytes)."""
    loop, end = symbols_of(binary, "ring_loop", "ring_end")
    code = bytes_at(binary, loop, end - loop)
    if page_floor(loop) != page_floor(end - 1):
        raise RuntimeError(f"ring_loop at {loop:#x}..{end:#x} crosses a page")
    base = machine.alloc_code(2 * PAGE_SIZE)
    address = page_floor(base + PAGE_SIZE) + (loop - page_floor(loop))
    machine.write_memory(address, code)
    return address, machine.alloc_data(8), code


def _call_ns(machine: Machine, target: str | int, *args: int) -> int:
    """Host ns of one `Machine.call`, timed on the CPU thread with the collector off."""
    def on_cpu(_uc) -> int:
        gc.disable()
        try:
            t0 = time.perf_counter_ns()
            machine.call(target, *args)
            return time.perf_counter_ns() - t0
        finally:
            gc.enable()

    return machine.run_on_cpu(on_cpu)


def _call_insns(machine: Machine, target: str | int, *args: int) -> int:
    """Instructions of one `Machine.call` on a counting machine."""
    def on_cpu(_uc) -> int:
        i0 = machine.instructions()
        machine.call(target, *args)
        return machine.instructions() - i0

    return machine.run_on_cpu(on_cpu)


def speed_rows(pair: Pair, windows_binary: Path, calls: int, windows: int, rounds: int) -> list[dict]:
    """ring_loop's bytes in ring 3 (a process's windows) and in ring 0 (their copy, `Machine.call`), and the kernel's
    kgtp_bench_loop: instructions a call (exact: the process's windows of n / COUNTED_SHARE and twice that, calls
    of n and 2n on the counting machine), host ns a
    call (`rounds` rounds of `windows` windows or calls of 0 then n calls on each side, the difference of the
    medians over n: each side's fixed cost, its window hooks or `Machine.call`'s, drops out) and instructions per
    host second, and each one's ratio to ring 0's copy."""
    copies = {booted: ring0_copy(booted.machine, windows_binary) for booted in (pair.timed, pair.counted)}

    def kernel_call(name: str, booted: Booted, n: int) -> tuple:
        """Machine.call's arguments for `n` calls of the loop `name` on `booted`."""
        if name == "kernel":  # ring_loop(n, &counter), the copy
            return copies[booted][0], n, copies[booted][1]
        return "kgtp_bench_loop", n

    kernels = ("kernel", "kernel text")
    user = counted_per_unit(pair.counted, windows_binary, "loop", max(1, calls // COUNTED_SHARE), windows)
    insns = {"user": (user["insns"], user["exact"])}
    for name in kernels:  # two calls of n and two of 2n: the loop's prologue and return drop out
        one, two = ([_call_insns(pair.counted.machine, *kernel_call(name, pair.counted, n)) for _ in range(2)]
                    for n in (calls, 2 * calls))
        insns[name] = ((two[0] - one[0]) / calls, len(set(one)) == len(set(two)) == 1)

    sizes = (0, calls)
    ns: dict[str, dict[int, list[int]]] = {name: {n: [] for n in sizes} for name in insns}
    for name in kernels:  # translated before the first timing
        _call_ns(pair.timed.machine, *kernel_call(name, pair.timed, 1))
    for _ in range(rounds):  # interleaved, a few windows at a time: a busy host's slow spells fall on every side
        for n in sizes:
            ns["user"][n] += [w.ns for w in clean_windows(pair.timed, windows_binary, "loop", n, windows,
                                                          units=lambda window, n: 1)]
            for name in kernels:
                ns[name][n] += [_call_ns(pair.timed.machine, *kernel_call(name, pair.timed, n))
                                for _ in range(windows)]
    per_call = {name: (statistics.median(ns[name][calls]) - statistics.median(ns[name][0])) / calls
                for name in insns}
    # nan where a small run on a busy host timed n calls under 0 calls
    ips = {name: insns[name][0] / per_call[name] * 1e9 if per_call[name] > 0 else float("nan") for name in insns}
    what = {"user": f"ring_loop({calls}) in a process (ring 3)",
            "kernel": "the same bytes in kernel memory through Machine.call (ring 0)",
            "kernel text": f"the kernel's own kgtp_bench_loop({calls}) through Machine.call (ring 0)"}
    return [{"row": f"loop ({name})", "what": what[name], "insns": insns[name][0], "exact": insns[name][1],
             "ns": per_call[name], "insns_per_s": ips[name], "ratio_to_kernel": 1.0 if name == "kernel" else ips[name] / ips["kernel"],
             "fixed_ns": statistics.median(ns[name][0]), "windows": [len(ns[name][0]), len(ns[name][calls])],
             **({"bytes": copies[pair.timed][2].hex()} if name != "kernel text" else {})}
            for name in insns]


def getpid_row(pair: Pair, windows_binary: Path, calls: int, windows: int) -> dict:
    figures = per_unit(pair, windows_binary, "getpid", calls, windows)
    return {"row": "getpid", "what": "getpid round trip (syscall to sysretq, with the loop's 4 user instructions)",
            "insns_per_call": figures["insns"], "exact": figures["exact"], "ns_per_call": figures["ns"],
            "ns_min": figures["ns_min"], "ns_max": figures["ns_max"], "windows": figures["windows"]}


def switch_row(pair: Pair, windows_binary: Path, calls: int, windows: int) -> dict:
    # a window counts only where the two processes ping-ponged through it (each yield of each a switch): one whose
    # partner had not started yet, or had ended, switched less and measures something else
    figures = per_unit(pair, windows_binary, "yield", calls, windows, processes=2,
                       units=lambda window, n: window.switches if window.switches >= 2 * n else 0)
    return {"row": "switch", "what": "context switch between two processes on one CPU (sched_yield ping-pong)",
            "insns_per_switch": figures["insns"], "exact": figures["exact"], "ns_per_switch": figures["ns"],
            "ns_min": figures["ns_min"], "ns_max": figures["ns_max"], "windows": figures["windows"],
            "switches_per_window": figures["units_per_window"]}


def rss_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def rss_row(windows_binary: Path, switches: int, cpus: int = 1, interval: float = 0.25,
            image: KernelImage | None = None, progress=None) -> dict:
    """Two yielding processes on each CPU until the kernel has counted `switches` context switches (pairs started
    again with what is left, as a yield with nobody else runnable switches nothing); RSS sampled every
    `interval`."""
    with Booted([windows_binary], cpus=cpus, image=image) as booted:
        booted.run(windows_binary, "yield", "1", "1")
        machine = booted.machine
        s0 = machine.read_symbol("nr_context_switches")
        start = rss_kib()
        t0 = time.monotonic()
        samples = [(0, start)]  # (switches so far, RSS KiB)
        while samples[-1][0] < switches:
            per_process = -(-(switches - samples[-1][0]) // (2 * cpus))
            pids = [booted.spawn(windows_binary, "yield", str(per_process), "1", cpu=cpu)
                    for cpu in range(cpus) for _ in range(2)]
            while True:
                done = all(pid in machine.processes.exited() for pid in pids)
                samples.append((machine.read_symbol("nr_context_switches") - s0, rss_kib()))
                if progress and len(samples) % 40 == 0:
                    progress(f"rss soak ({cpus} CPU): {samples[-1][0]:,} switches, {samples[-1][1] / 1024:.0f} MiB")
                if done:
                    break
                time.sleep(interval)
            for pid in pids:
                booted.wait(pid)
        seconds = time.monotonic() - t0
        cpu_switches = machine.stats(count=False).cpu_switches
    total = samples[-1][0]
    later = [rss for n, rss in samples if n >= total // 10]
    base = later[0]
    return {"row": f"rss ({cpus} CPU{'s' if cpus > 1 else ''})", "cpus": cpus, "switches": total,
            "seconds": seconds, "switches_per_s": total / seconds, "cpu_switches": cpu_switches,
            "samples": len(samples), "rss_start_mib": start / 1024, "rss_base_mib": base / 1024,
            "rss_last_mib": samples[-1][1] / 1024, "rss_max_mib": max(later) / 1024,
            "tolerance_mib": RSS_TOLERANCE_MIB, "flat": max(later) - base <= RSS_TOLERANCE_MIB * 1024}


# ---- all of it ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """How much of each measurement: the default is the benchmark's, `small()` the tests'."""

    runs: int = 5  #: hello and `kgtp-sim run` runs
    loop_calls: int = 20_000  #: kgtp_bench_loop calls a window
    syscalls: int = 1_000  #: getpid calls a window
    yields: int = 100  #: sched_yield calls a window in each process (twice as many switches: a window under a tick)
    windows: int = 40
    rounds: int = 20  #: interleaved rounds of the loop's timings (the process's windows, then the kernel's calls)
    round_windows: int = 4  #: windows (calls) of each size on each side in a round
    switches: int = 100_000  #: the RSS soak's
    soak_cpus: tuple[int, ...] = (1, 2)

    @classmethod
    def small(cls) -> Sizes:
        return cls(runs=1, loop_calls=2_000, syscalls=200, yields=50, windows=8, rounds=2, round_windows=2,
                   switches=2_000, soak_cpus=(1,))


def rows(sizes: Sizes = Sizes(), run_command: bool = True, progress=None) -> list[dict]:
    """Every row; a skipped one says why (`skipped`)."""
    say = progress or (lambda message: None)
    with tempfile.TemporaryDirectory(prefix="kgtp-programs-") as tmp:
        try:
            built = build(Path(tmp))
        except Unavailable as error:
            return [{"row": "programs", "skipped": str(error)}]
        image = KernelImage.load(VMLINUX)
        out = []
        programs = [built["hello"], built["windows"]]
        pair = Pair(Booted(programs, image=image), Booted(programs, image=image, counting=True))
        try:
            for booted in (pair.timed, pair.counted):
                booted.run(built["windows"], "getpid", "1", "1")  # booted: a first program served and ended
            say("hello world on a booted machine")
            out.append(hello_row(pair, built["hello"], sizes.runs))
            say("the same loop in ring 3 and in ring 0")
            out += speed_rows(pair, built["windows"], sizes.loop_calls, sizes.round_windows, sizes.rounds)
            say("getpid round trips")
            out.append(getpid_row(pair, built["windows"], sizes.syscalls, sizes.windows))
            say("context switches")
            if sizes.yields:  # 0: no switch row
                out.append(switch_row(pair, built["windows"], sizes.yields, sizes.windows))
        finally:
            pair.close()
        if run_command:
            say("kgtp-sim run, end to end")
            out.append(run_command_row(built["hello"], sizes.runs))
        for cpus in sizes.soak_cpus:
            say(f"rss over {sizes.switches:,} switches, {cpus} CPU")
            out.append(rss_row(built["windows"], sizes.switches, cpus, image=image, progress=say))
    return out


def markdown(table: list[dict]) -> str:
    """The rows as three tables: times, per-unit figures, the soaks."""
    skipped = [r for r in table if "skipped" in r]
    if skipped:
        return f"(programs skipped: {skipped[0]['skipped']})"
    by = {r["row"]: r for r in table}
    lines = ["| what | runs | host s (median) | min..max | emulated insns | of them user mode |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in ("hello", "kgtp-sim run"):
        if name in by:
            r = by[name]
            lines.append(f"| {r['what']} | {r['runs']} | {r['seconds_median']:.3f} | {r['seconds_min']:.3f}.."
                         f"{r['seconds_max']:.3f} | {r['insns_median']:,} | {r['user_insns']:,} |"
                         if "insns_median" in r else
                         f"| {r['what']} | {r['runs']} | {r['seconds_median']:.3f} | {r['seconds_min']:.3f}.."
                         f"{r['seconds_max']:.3f} | - | - |")
    lines += ["", "| what | emulated insns (a call) | exact | host ns (a call) | emulated insns / host s | x ring 0 |",
              "|---|---:|---|---:|---:|---:|"]
    for name in ("loop (user)", "loop (kernel)", "loop (kernel text)"):
        r = by[name]
        lines.append(f"| {r['what']} | {r['insns']:,.0f} | {'yes' if r['exact'] else 'no'} | {r['ns']:,.1f} "
                     f"| {r['insns_per_s'] / 1e6:,.1f} M | {r['ratio_to_kernel']:.2f} |")
    r = by["getpid"]
    lines.append(f"| {r['what']}, per call | {r['insns_per_call']:,.1f} | {'yes' if r['exact'] else 'no'} "
                 f"| {r['ns_per_call']:,.0f} | - | - |")
    if "switch" in by:
        r = by["switch"]
        lines.append(f"| {r['what']}, per switch | {r['insns_per_switch']:,.1f} | {'yes' if r['exact'] else 'no'} "
                     f"| {r['ns_per_switch']:,.0f} | - | - |")
    soaks = [r for r in table if r["row"].startswith("rss")]
    if soaks:
        lines += ["", "| soak | switches | switches / s | CPU switches | RSS MiB: start, at 10 %, last, max | flat |",
                  "|---|---:|---:|---:|---|---|"]
        for r in soaks:
            lines.append(f"| {r['row']} | {r['switches']:,} | {r['switches_per_s']:,.0f} | {r['cpu_switches']:,} "
                         f"| {r['rss_start_mib']:.0f}, {r['rss_base_mib']:.0f}, {r['rss_last_mib']:.0f}, "
                         f"{r['rss_max_mib']:.0f} | {'yes' if r['flat'] else 'no'} (+{r['tolerance_mib']} MiB) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m kgtp_sim.bench.programs [--switches N] [--json FILE]`: this section of the benchmark alone."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m kgtp_sim.bench.programs", description=main.__doc__)
    parser.add_argument("--switches", type=int, default=Sizes.switches, help="context switches of the RSS soak")
    parser.add_argument("--runs", type=int, default=Sizes.runs, help="runs of the hello world")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the rows as JSON")
    args = parser.parse_args(argv)
    table = rows(Sizes(runs=args.runs, switches=args.switches),
                 progress=lambda message: print(f"  {message}", file=sys.stderr, flush=True))
    print(markdown(table))
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items()} for r in table], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
