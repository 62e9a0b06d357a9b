"""The thesis workload as a program under kgtp-sim's gdbserver role: the stub's rows for tracepoints in a program,
beside gdbserver's (peer.py), and the measurement the tests of compiled program hits count with.

The program is peer.py's (fixtures/peer/thesis_workload.c), built `gcc -O2 -static -g`, run as a process of the
simulated kernel by an in-process gdbserver role (kgtp_sim/gdbserver.py's Server, one CPU) fed RSP packets as GDB
sends them; the tracepoint is at kgtp_test_function, with the benchmark's cases in GDB 13's own bytecode
(runner.py's fixture, recorded on the kernel's copy of the function: counter1 and counter2 in %edi and %esi there as
here), as a `trace` (`int3`) or an `ftrace` (`jump`: the function's first instruction is 7 bytes).

The program stops at a breakpoint on bench_sync() between batches (as under gdbserver); a batch is one trace run
(`QTStart`, the batch, `QTStop`). A hook on kgtp_bench_loop's first instruction and on its `ret`s marks a window
around each batch's calls (the machine's instruction count, the host's clock, the interrupts delivered); only clean
windows count, those no interrupt entered, so nothing but the loop and its hits ran in them and their instruction
counts are exact (programs.py's windows, on the role's machine). Emulated instructions per hit: the traced window's
count minus the untraced one's, over the calls (exact: every clean window of a row agrees, or the row says so), on a
machine that counts from its start; host ns per hit: the same difference of the windows' medians on a machine that
never counts (the counting hook costs about 12 ns an instruction), as programs.py's Pair. Hits and frames: qTP
and qTStatus after each run; Python hits: the machine's Python int3 handler's count (`Cpu.breakpoint_hits`) over
the run, 0 when every hit ran compiled.

Runs on the caller's thread (the benchmark's, or a test's); the role's machine runs the program on its CPU thread,
whose hooks record the windows.
"""

from __future__ import annotations

import re
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from elftools.elf.elffile import ELFFile
from unicorn import UC_HOOK_CODE

from ..bench.peer import FUNCTION, SOURCE
from ..bench.programs import bytes_at
from ..bench.record import FIXTURE, load
from ..bench.runner import BUFFER_SIZE

PROBES = {"int3": "stub-trap", "jump": "stub-fast"}  #: probe kind -> row name (gdbserver's: trap, fast)
CASES = ("false-cond", "expr", "cond+expr")
#: calls per window: short enough that most windows see no tick of the kernel's timer (hz 100)
WINDOW_CALLS = 200
WAIT_S = 120


def build(workdir: Path) -> Path:
    """The workload, static (no dynamic linker to pack: the role runs it as it is)."""
    if shutil.which("gcc") is None:
        raise RuntimeError("gcc is not installed")
    binary = workdir / "thesis_workload"
    subprocess.run(["gcc", "-O2", "-static", "-g", "-o", str(binary), str(SOURCE)], check=True, capture_output=True)
    return binary


def _symbols(binary: Path, *names: str) -> list[tuple[int, int]]:
    with open(binary, "rb") as f:
        table = ELFFile(f).get_section_by_name(".symtab")
        return [(s["st_value"], s["st_size"]) for s in (table.get_symbol_by_name(n)[0] for n in names)]


def _rets(binary: Path, address: int, size: int) -> list[int]:
    from capstone import CS_ARCH_X86, CS_MODE_64, Cs

    return [i.address for i in Cs(CS_ARCH_X86, CS_MODE_64).disasm(bytes_at(binary, address, size), address)
            if i.mnemonic == "ret"]


def definition(address: int, kind: str, case: str, insn_length: int) -> list[bytes]:
    """The QTDP packets GDB sends for a case at `address` (a `ftrace` when `kind` is jump: F and the length of the
    instruction it replaces), in the recorded bytecode."""
    site = load(FIXTURE)["sites"]["dynamic"]
    fast = b":F%x" % insn_length if kind == "jump" else b""
    cond = b""
    if case != "expr":
        code = bytes.fromhex(site["false_condition" if case == "false-cond" else "true_condition"]["bytecode"])
        cond = b":X%x,%s" % (len(code), code.hex().encode())
    packets = [b"QTDP:1:%x:E:0:0%s%s%s" % (address, fast, cond, b"" if case == "false-cond" else b"-")]
    if case != "false-cond":
        collect = site["collect"]
        code = bytes.fromhex(collect["bytecode"])
        packets.append(b"QTDP:-1:%x:R%sX%08x,%s" % (address, collect["reg_mask"].encode(), len(code),
                                                      code.hex().encode()))
    return packets


@dataclass(frozen=True)
class Window:
    insns: int
    ns: int
    interrupts: int

    @property
    def clean(self) -> bool:
        return self.interrupts == 0


@dataclass
class Run:
    """One trace run's batches: their clean windows, and what the run counted."""

    windows: list[Window]
    hits: int
    frames: int
    python_hits: int
    batches: int


class RoleWorkload:
    """The workload under an in-process gdbserver role, stopped at bench_sync() between batches."""

    def __init__(self, binary: Path, engine: str = "opt", counting: bool = False, cpus: int = 1,
                 hz: int = 100) -> None:
        from kgtp_sim.gdbserver import Options, Server
        from kgtp_sim.rsp.codec import Decoder, EventKind, encode_packet

        self._decoder, self._packet, self._encode = Decoder, EventKind.PACKET, encode_packet
        self.server = Server(Options(comm="stdio", program=[str(binary)], cpus=cpus, hz=hz, engine=engine))
        self.machine = self.server.machine
        if counting:  # from the start, never off (see programs.Booted)
            self.machine.set_counting(True)
        self.server.start()
        self.session = self.server.make_session()
        self.server.on_connect()
        (loop, loop_size), (self.function, _), (sync, _), (self.calls_at, _), (self.result_at, _) = _symbols(
            binary, "kgtp_bench_loop", FUNCTION, "bench_sync", "bench_calls", "bench_result")
        self.begin, self.ends = loop, _rets(binary, loop, loop_size)
        from kgtp_sim.tracing.patching.probes import decode

        self.insn_length = decode(bytes_at(binary, self.function, 15), self.function)[0].size
        self.marks: list[tuple[bool, int, int, int]] = []

        def install(uc) -> None:
            for address in (self.begin, *self.ends):
                uc.hook_add(UC_HOOK_CODE, self._mark, None, address, address)
            uc.ctl_flush_tb()

        self.machine.run_on_cpu(install)
        self.sync = sync
        self.ok(b"Z0,%x,1" % sync)
        self.resume(b"vCont;c")  # to the first bench_sync()

    def _mark(self, uc, address: int, _size: int, _data: object) -> None:
        now = time.perf_counter_ns()
        cpu = self.machine.cpu
        self.marks.append((address == self.begin, self.machine.instructions(), now, sum(cpu.delivered.values())))

    def ask(self, payload: bytes) -> bytes:
        replies = [e.payload for e in self._decoder().feed(self.session.receive(self._encode(payload, binary=True)))
                   if e.kind is self._packet]
        if not replies:
            raise RuntimeError(f"no reply to {payload[:40]!r}")
        return replies[-1]

    def ok(self, payload: bytes) -> None:
        reply = self.ask(payload)
        if reply != b"OK":
            raise RuntimeError(f"{payload[:60]!r} answered {reply!r}")

    def resume(self, action: bytes) -> bytes:
        """Resume (`action`) to the next stop, which must be a SIGTRAP; its stop reply."""
        assert not self.session.receive(self._encode(action)).strip(b"+")
        deadline = time.monotonic() + WAIT_S
        while True:
            out = self.session.poll()
            if out:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"no stop after {action.decode()} in {WAIT_S} s")
            time.sleep(0.002)
        stop = [e.payload for e in self._decoder().feed(out) if e.kind is self._packet][-1]
        if not stop.startswith(b"T05"):
            raise RuntimeError(f"the workload stopped with {stop[:60]!r}")
        return stop

    def _continue(self) -> None:
        """From the breakpoint at bench_sync() to its next hit, as GDB goes on over a breakpoint: out, one step,
        back in, continue."""
        self.ok(b"z0,%x,1" % self.sync)
        self.resume(b"vCont;s")
        self.ok(b"Z0,%x,1" % self.sync)
        self.resume(b"vCont;c")

    def batch(self, calls: int) -> list[Window]:
        """One batch of `calls` calls; its windows (one, unless the loop's code ran elsewhere meanwhile)."""
        since = len(self.marks)
        self.ok(b"M%x,8:%s" % (self.calls_at, calls.to_bytes(8, "little").hex().encode()))
        self._continue()
        result = int.from_bytes(bytes.fromhex(self.ask(b"m%x,8" % self.result_at).decode()), "little")
        if result != calls:
            raise RuntimeError(f"kgtp_bench_loop({calls}) returned {result}")
        out, opened = [], None
        for begin, insns, ns, interrupts in self.marks[since:]:
            if begin:
                opened = (insns, ns, interrupts)
            elif opened is not None:
                out.append(Window(insns - opened[0], ns - opened[1], interrupts - opened[2]))
                opened = None
        return out

    def run(self, batches: int, calls: int = WINDOW_CALLS, packets: list[bytes] = (), armed=None) -> Run:
        """`batches` batches in one trace run of `packets` (none: untraced); `armed(self)` is called once the run
        has started, before the batches."""
        if packets:
            self.ok(b"QTinit")
            self.ok(b"QTBuffer:size:%x" % BUFFER_SIZE)
            for packet in packets:
                self.ok(packet)
            self.ok(b"QTStart")
        if armed is not None:
            armed(self)
        python = self.machine.cpu.breakpoint_hits
        windows = [w for _ in range(batches) for w in self.batch(calls)]
        python = self.machine.cpu.breakpoint_hits - python
        hits = frames = 0
        if packets:
            hits, frames = self.counts()
            self.ok(b"QTStop")
        return Run([w for w in windows if w.clean], hits, frames, python, batches)

    def counts(self) -> tuple[int, int]:
        """The tracepoint's hits (qTP) and the frames the run created (qTStatus)."""
        hits = int(self.ask(b"qTP:1:%x" % self.function)[1:].split(b":")[0], 16)
        status = self.ask(b"qTStatus")
        return hits, int(re.search(rb"tcreated:([0-9a-f]+)", status).group(1), 16)

    def close(self) -> None:
        self.server.shutdown()


def per_hit(traced: Run, untraced: Run, calls: int) -> tuple[float | None, list[float]]:
    """(instructions per hit: exact, or None unless every clean window of each run ran the same count; host ns per
    hit of each traced window, less the untraced windows' median)."""
    base = statistics.median(w.ns for w in untraced.windows)
    counts, bases = {w.insns for w in traced.windows}, {w.insns for w in untraced.windows}
    insns = (counts.pop() - bases.pop()) / calls if len(counts) == 1 and len(bases) == 1 else None
    return insns, [(w.ns - base) / calls for w in traced.windows]


# ---- the benchmark's rows ------------------------------------------------------------------------------------


def rows(windows: int = 20, calls: int = WINDOW_CALLS, engine: str = "opt", progress=None) -> list[dict]:
    """The stub's rows: `stub-none` (the untraced program, per call, absolute), then `stub-trap` (`trace`) and
    `stub-fast` (`ftrace`) for each case, in the benchmark's row schema (bench/runner.py's FIELDS) with peer.py's
    extra fields: instructions per hit from a counting machine (exact), host ns per hit from `windows` clean
    windows of `calls` calls each on a machine that never counts (median, min, max), frames and hits of the timed
    run, and its Python hits (0: every hit compiled)."""
    import tempfile

    from ..bench.runner import FIELDS

    with tempfile.TemporaryDirectory(prefix="kgtp-program-hits-") as tmp:
        binary = build(Path(tmp))
        counted = RoleWorkload(binary, engine=engine, counting=True)
        try:
            timed = RoleWorkload(binary, engine=engine, counting=False)
        except BaseException:
            counted.close()
            raise
        try:
            base_count, base_time = counted.run(3, calls), _clean(timed, windows, calls, ())
            base_ns = statistics.median(w.ns for w in base_time.windows) / calls
            (base_insns,) = {w.insns for w in base_count.windows} or {None}
            out = [_row("stub-none", "none", "none", None if base_insns is None else base_insns / calls,
                        [w.ns / calls for w in base_time.windows], base_time, calls)]
            for kind, probe in PROBES.items():
                for case in CASES:
                    packets = definition(counted.function, kind, case, counted.insn_length)
                    insns, _ = per_hit(counted.run(3, calls, packets), base_count, calls)
                    run = _clean(timed, windows, calls, packets)
                    _, ns = per_hit(run, base_time, calls)
                    row = _row(probe, case, engine, insns, ns, run, calls)
                    out.append(row)
                    if progress:
                        progress(row)
        finally:
            counted.close()
            timed.close()
    return [{k: row[k] for k in (*FIELDS, *EXTRA)} for row in out]


#: what only these rows carry: the calls of the timed run (all its batches, clean windows or not: its frames and
#: hits are theirs), the Python hits among them, and the clean windows timed
EXTRA = ("calls", "hits", "python_hits", "windows")


def _clean(w: RoleWorkload, windows: int, calls: int, packets) -> Run:
    """A run of at least `windows` clean windows (batches go on until there are; at most four times as many)."""
    run = w.run(windows, calls, packets)
    for _ in range(3):
        if len(run.windows) >= windows:
            break
        more = w.run(windows - len(run.windows), calls, packets)
        run = Run(run.windows + more.windows, run.hits + more.hits, run.frames + more.frames,
                  run.python_hits + more.python_hits, run.batches + more.batches)
    if not run.windows:
        raise RuntimeError("no window ran without an interrupt")
    return run


def _row(probe: str, case: str, engine: str, insns: float | None, ns: list[float], run: Run, calls: int) -> dict:
    return {"probe": probe, "case": case, "engine": engine,
            "insns_per_hit": None if insns is None else round(insns, 3),
            "ns_per_hit_median": round(statistics.median(ns), 1), "ns_per_hit_min": round(min(ns), 1),
            "ns_per_hit_max": round(max(ns), 1), "frames": run.frames, "calls": run.batches * calls,
            "hits": run.hits, "python_hits": run.python_hits, "windows": len(run.windows)}


def markdown(table: list[dict]) -> str:
    lines = ["| probe | case | engine | insns/hit | ns/hit median | ns/hit min..max | frames | hits | Python hits "
             "| windows |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in table:
        insns = "-" if r["insns_per_hit"] is None else f"{r['insns_per_hit']:g}"
        lines.append(f"| {r['probe']} | {r['case']} | {r['engine']} | {insns} | {r['ns_per_hit_median']:,.0f} "
                     f"| {r['ns_per_hit_min']:,.0f}..{r['ns_per_hit_max']:,.0f} | {r['frames']:,} | {r['hits']:,} "
                     f"| {r['python_hits']:,} | {r['windows']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(prog="python -m kgtp_sim.tools.program_hits",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=20, help="clean windows timed per row (default 20)")
    parser.add_argument("--calls", type=int, default=WINDOW_CALLS, help=f"calls per window (default {WINDOW_CALLS})")
    parser.add_argument("--engine", choices=("naive", "opt"), default="opt")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")
    args = parser.parse_args(argv)
    table = rows(args.windows, args.calls, args.engine,
                 progress=lambda r: print(f"  {r['probe']:>10} {r['case']:>10}: {r['insns_per_hit']} insns/hit, "
                                          f"{r['ns_per_hit_median']:,.0f} ns/hit", file=sys.stderr))
    print(markdown(table))
    if args.json:
        args.json.write_text(json.dumps(table, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
