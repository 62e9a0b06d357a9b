"""The combination suite's process space: a program of the repository's own (fixtures/combinations/callers.c, built
with the host's gcc) under the gdbserver role, run in this process (kgtp_sim/gdbserver.py's `Server`) and fed RSP
packets exactly as its TCP server feeds it, through the fuzzer's `Harness`, as the kernel's runner feeds KGTP mode.

The program's threads, one per CPU, call counted_function in rounds, a tick's sleep between them; the function's
first instruction counts the call in `counter`, the program's own count, which every tracepoint is checked against
(oracle.py). One server per CPU count is started once, its program run until every thread has made calls, and
reused: between combinations the process stays stopped.

A window of a run, all-stop as GDB has it: with the process stopped (every thread), the runner reads `counter` and
every thread's pc (`Hg` + `g`); the run starts (QTStart); the process goes on (`vCont;c`) and is stopped with
Ctrl-C every POLL_S until `counter` has moved enough (events, never a time window: a stop that finds too few calls
lets the process go on again); then `counter` and the pcs again. Then QTStop (or GDB leaves: the process stays
stopped) and every frame is read back as in the kernel (QTFrame, `g`, `m`, qTV). A stop that is not the Ctrl-C's
(a SIGTRAP from an int3 left behind, the program's end) is a failure. A fast tracepoint's pad is where the stub put
it (no packet tells GDB), and so is a compiled hit's: read from the run's probes once installed (`Sites.relocated`).

Runs on the caller's thread (a test's, or the command's main thread), which feeds the sessions in place of the
servers' connection threads, while each machine's CPU and tick threads run its kernel and the program.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from elftools.elf.elffile import ELFFile

from ...client.paths import FIXTURES
from ...gdbserver import Options, Server
from ...machine import KernelImage
from ..fuzz_harness import FuzzFailure, Harness
from .runner import CombinationFailure, Driver, Halt, Observed
from .space import FAST_LENGTH, IMAGE_PATH, MAIN, WAIT_S, Combination, Sites, address_of, watched

SOURCE = FIXTURES / "combinations" / "callers.c"
#: the program's symbols the suite reads
SYMBOLS = ("counted_function", "round_end", "caller", "counter", "rounds", "interrupted_sleeps")
#: counted_function's first instruction, `addl $1, counter(%rip)` (83 05 disp32 01): the count
ADD_COUNTER = re.compile(rb"\x83\x05(....)\x01", re.S)
#: how long the process runs between two Ctrl-C stops while the runner waits for calls
POLL_S = 0.003
#: rounds of calls each thread makes before the first combination (past the first sleeps)
WARM_ROUNDS = 3
#: the stop reply of GDB's Ctrl-C (SIGINT), any thread
INTERRUPTED = re.compile(rb"T02(?:[0-9a-z]+:[0-9a-f.p]+;)*")


def build_program(out_dir: Path) -> Path:
    """callers.c compiled into out_dir (`gcc -O2 -static -pthread`: not PIE, its addresses those of its symbols)."""
    if shutil.which("gcc") is None:
        raise CombinationFailure("the process space needs gcc to build its program (fixtures/combinations/callers.c)")
    binary = out_dir / "callers"
    result = subprocess.run(["gcc", "-O2", "-static", "-pthread", str(SOURCE), "-o", str(binary)],
                            capture_output=True, text=True)
    if result.returncode:
        raise CombinationFailure(f"gcc callers.c failed: {result.stderr.strip()[-400:]}")
    return binary


def program_symbols(binary: Path) -> dict[str, int]:
    """The addresses of SYMBOLS in the built program (and the size of `caller`, as `caller_size`), once its
    counted_function is seen to begin with the count (`ADD_COUNTER`, of FAST_LENGTH bytes, at `counter`)."""
    with binary.open("rb") as f:
        elf = ELFFile(f)
        table = elf.get_section_by_name(".symtab")
        found = {}
        for name in SYMBOLS:
            symbol = table.get_symbol_by_name(name)
            if not symbol:
                raise CombinationFailure(f"{binary}: no symbol {name}")
            found[name] = symbol[0]["st_value"]
            if name == "caller":
                found["caller_size"] = symbol[0]["st_size"]
        text = elf.get_section_by_name(".text")
        at = found["counted_function"] - text["sh_addr"]
        code = text.data()[at:at + FAST_LENGTH]
    count = ADD_COUNTER.fullmatch(code)
    if count is None or found["counted_function"] + FAST_LENGTH + int.from_bytes(count.group(1), "little",
                                                                                 signed=True) != found["counter"]:
        raise CombinationFailure(f"{binary}: counted_function does not begin with `addl $1, counter(%rip)`: "
                                 f"{code.hex()}")
    return found


class ProcessRunner(Driver):
    """The process space: one gdbserver role per CPU count, its program's threads one per CPU."""

    def __init__(self) -> None:
        super().__init__()
        self._workdir = tempfile.TemporaryDirectory(prefix="kgtp-combinations-")
        self.binary = build_program(Path(self._workdir.name))
        symbols = program_symbols(self.binary)
        self.image = KernelImage.load(IMAGE_PATH)
        function = symbols["counted_function"]
        self.sites = Sites(function, symbols["counter"], function + FAST_LENGTH, symbols["round_end"],
                           watched(self.image), (range(symbols["caller"], symbols["caller"] + symbols["caller_size"]),))
        self.interrupted_sleeps = symbols["interrupted_sleeps"]
        self.rounds = symbols["rounds"]
        #: CPU count -> the relocated counts in its process's pads (`_learn_pads`)
        self.relocated: dict[int, set[int]] = {}

    def close(self) -> None:
        super().close()
        self._workdir.cleanup()

    def retire(self, cpus: int) -> None:
        self.relocated.pop(cpus, None)
        super().retire(cpus)

    def harness(self, cpus: int) -> Harness:
        if cpus not in self.harnesses:
            # KGTP's variables by KGTP's numbers (the walk's bytecode names them so): `--kgtp-variables`
            server = Server(Options(comm="stdio", program=[str(self.binary), str(cpus)], cpus=cpus,
                                    kgtp_variables=True))
            try:
                server.start()
                harness = Harness(server)
            except Exception:
                server.shutdown()
                raise
            self.harnesses[cpus] = harness
            self._run_until(harness, lambda: self._u32(harness, self.rounds) >= WARM_ROUNDS * cpus,
                            f"{WARM_ROUNDS} rounds of each of the program's {cpus} threads")
        return self.harnesses[cpus]

    # -- the process between stops --

    def _threads(self, h: Harness) -> list[bytes]:
        reply, threads = self._one(h, b"qfThreadInfo"), []
        while reply.startswith(b"m"):
            threads += reply[1:].split(b",")
            reply = self._one(h, b"qsThreadInfo")
        if reply != b"l" or not threads:
            raise CombinationFailure(f"the program's threads: qfThreadInfo/qsThreadInfo answered {reply!r}")
        return threads

    def halt(self, h: Harness, cpus: int) -> Halt:
        """The process is stopped (all-stop: every thread); every thread's pc and the count."""
        pcs, calls = [], []
        for thread in self._threads(h):
            self._ok(h, b"Hg" + thread)
            registers = self._registers(h)
            pcs.append(registers["rip"] or 0)
            calls.append((int(thread, 16), (registers["rdi"] or 0) & 0xFFFFFFFF))
        self._ok(h, b"Hg0")
        self._learn_pads(h, cpus)  # (a tracepoint added during the run may have made one)
        return Halt(self._count(h), pcs, [], calls)

    def _run_until(self, h: Harness, done: Callable[[], bool], what: str) -> None:
        """Let the process go and stop it (Ctrl-C) until `done`, asked while it is stopped; a failure when the
        program stops otherwise or its count stood still for WAIT_S."""
        counter, deadline = None, time.monotonic() + WAIT_S
        while not done():
            now = self._count(h)
            if now != counter:
                counter, deadline = now, time.monotonic() + WAIT_S
            elif time.monotonic() > deadline:
                raise CombinationFailure(f"waited {WAIT_S:.0f}s for {what}: the program's count stuck at {counter}")
            try:
                reply = h.resume(b"vCont;c")
                if reply is None:
                    time.sleep(POLL_S)
                    reply = h.stop()
            except FuzzFailure as failure:
                raise CombinationFailure(str(failure)) from None
            if not INTERRUPTED.fullmatch(reply):
                raise CombinationFailure(f"waiting for {what}, the program stopped with {reply[:120]!r}, not the "
                                         "Ctrl-C's SIGINT")

    # -- one combination --

    def _started(self, h: Harness, c: Combination, seen: Observed) -> None:
        self._learn_pads(h, c.cpus)
        seen.sites = self.sites_of(c.cpus)

    def _learn_pads(self, h: Harness, cpus: int) -> None:
        """The pads of the counted function's first instruction among the run's installed locations: where each's
        relocated count is (the stub chose the place, a fast tracepoint's pad or a compiled hit's: the location's
        `out_of_line` when it is not the instruction's own place; a pad stays the program's for the process's
        life, and a thread may be left in any)."""
        known = self.relocated.setdefault(cpus, set())
        for installed in list(h.stub.tracer.probes.installed.values()):
            if installed.site.address == self.sites.function and installed.out_of_line not in (0, self.sites.function):
                known.add(installed.out_of_line)

    def _ended(self, h: Harness, c: Combination, seen: Observed) -> None:
        seen.sites = self.sites_of(c.cpus)
        seen.interrupted_sleeps = self._u32(h, self.interrupted_sleeps)

    def sites_of(self, cpus: int) -> Sites:
        return replace(self.sites, relocated=tuple(sorted(self.relocated.get(cpus, ()))))

    def healthy(self, cpus: int) -> None:
        """The kernel's checks (the stub serves, the kernel runs, nothing logged as an error), and the program
        lives on, stopped."""
        super().healthy(cpus)
        target = self.harnesses[cpus].stub.target
        if target.live() is None:
            raise CombinationFailure("the program has ended")
