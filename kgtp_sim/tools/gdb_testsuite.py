"""GDB's own testsuite judges a gdbserver: Debian's, or the stub's gdbserver role, side by side.

    python -m kgtp_sim.tools.gdb_testsuite [--server kgtp-sim|gdbserver|both]
        [--board native-gdbserver|native-extended-gdbserver|both] [--out DIR] [FILES...]
    python -m kgtp_sim.tools.gdb_testsuite --install-only

(`scripts/gdb-testsuite` sets up the venv and runs this; `--install-only` installs the Debian packages NEEDS names
and exits, for `scripts/test`; the regression gate over a few of these files is gdb_testsuite_gate's.) FILES are
testsuite files or shell patterns relative to the testsuite (`gdb.trace/tfind.exp`, `gdb.base/watch*.exp`) or the
named sets `@trace` (every gdb.trace file, the default) and `@run-control` (RUN_CONTROL). Each board runs the files
once per server with the same GDB (/usr/bin/gdb), the same board and the same flags; only `GDBSERVER=` differs:
/usr/bin/gdbserver, or a wrapper script this module writes that runs `python -m kgtp_sim gdbserver "$@"` from this
checkout. The stub's servers start warm (kgtp_sim/warm.py): a `kgtp-sim warm` server runs beside each of its runs
(its start counted in the run's wall time) and every `kgtp-sim gdbserver` the board starts is a fork of it, the
same command line and streams, some 0.25 s sooner than a cold start, 447 times in gdb.trace; `--cold` starts each
one from scratch. Each run's gdb.sum and gdb.log are copied to OUT/BOARD/SERVER/; the per-file counts of both servers side
by side, the tests that pass with one and not with the other (by name) and both wall times are printed and written
to OUT/BOARD/summary.txt (and the table as Markdown to OUT/BOARD/summary.md).

The testsuite is GPL code of another project. It is never part of this repository: Debian's gdb-source package
(the version of the installed /usr/bin/gdb) ships the GDB tree as /usr/src/gdb.tar.xz, and the members MEMBERS
are extracted from it at run time into a cache outside the repository, one per gdb-source version, reused:

    CACHE/src/gdb/...                                  the extracted members
    CACHE/build/BOARD-SERVER/gdb/testsuite/            a build directory, configured by the testsuite's configure
    CACHE/build/BOARD-SERVER/gdbserver/libinproctrace.so -> /usr/lib/libinproctrace.so
    CACHE/bin/kgtp-sim-gdbserver                       the stub's wrapper (rewritten at each run)

The build directories sit where they sit in a GDB build tree because lib/trace-support.exp's get_in_proc_agent
looks for the in-process agent at `$objdir/../../gdbserver/libinproctrace.so`: Debian's gdbserver package ships
the agent, and a symlink there is all that the files trying fast tracepoints (ftrace, ftrace-lock, change-loc,
pending, range-stepping, trace-break, trace-condition, trace-enable-disable, trace-mt, tspeed; strace too, before
it finds no UST) need to find it. They link their program against it (`shlib=`, with an rpath to that directory,
so `info sharedlibrary` shows the path they look for) and leave the rest to the server: it looks the agent's
symbols up through qSymbol, and its helper thread and jump pads do the work. Only ftrace.exp builds its program
without PIE; the others get Debian's default PIE, where gdbserver 13 refuses every fast tracepoint at tstart (its
jump pads are mapped too far from the program for a 32-bit jump back), so those FAILs are gdbserver's own here.
Without the agent these files stop on a Tcl error.

No board file of the project's own: the stock boards (lib/gdbserver-support.exp's gdbserver_start) start whatever
`GDBSERVER` names as `GDBSERVER --once localhost:PORT PROG ARGS` (`GDBSERVER --once --multi localhost:PORT` on the
extended board, which then names the program with `set remote exec-file`), wait for its `Listening on` line and
connect: gdbserver's own command line and output, so a server that speaks them needs no other board.

Where the harness differs for the stub: gdbserver runs the program on this host, so the program finds any file the
testsuite built for it, and the shared objects a program only dlopen()s (change-loc.exp, pending.exp and others
dlopen a `.sl` built beside the program, found through its RUNPATH of $ORIGIN) load under gdbserver. The stub's
machine holds only the files its user names (the program, what its dynamic linker opens at start, and `--with
FILE`). The harness is the user here: its wrapper names the shared objects in the directory of each program run
(STUB_OPTIONS: `--with '$ORIGIN/*.so'` and the like, for the program on the command line and for each program the
extended board runs with vRun), one rule for every test file, none recognised by name. Nothing else of the host is
reachable from inside.

Runs are serialised by a lock on the cache (one `make check` at a time, at `nice -n 10` by default). The exit
status is non-zero only when nothing could run: a failing test is a result, not an error. Wall times follow the
machine's load, and one file more than the others: tspeed.exp sizes its loop by the clock and then traces it
with a trap per iteration, so on a busy machine it runs into its 180 s timeouts (FAIL and UNRESOLVED, and many
minutes) where an idle one passes it in seconds.

Why this module is long: it is one harness from end to end (the Debian packages, the extracted tree and its build
directories, the wrapper and the warm server, `make check`, gdb.sum's parsing, the side-by-side report), and its
parts are only ever used together; the gate (gdb_testsuite_gate) reuses them.

Threads: everything runs on the caller's thread; `make check` is a child process.
"""

from __future__ import annotations

import argparse
import collections
import compileall
import contextlib
import fcntl
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..client.paths import ROOT, SCRIPTS

GDB = "/usr/bin/gdb"
GDBSERVER = "/usr/bin/gdbserver"
DATA_DIRECTORY = "/usr/share/gdb"
SOURCE_TARBALL = "/usr/src/gdb.tar.xz"
INPROCTRACE = "/usr/lib/libinproctrace.so"
#: what the runs need -> Debian's package that brings it (a path, or a command looked up on PATH)
NEEDS = {
    GDB: "gdb",
    GDBSERVER: "gdbserver",
    INPROCTRACE: "gdbserver",
    SOURCE_TARBALL: "gdb-source",
    "runtest": "dejagnu",
    "make": "make",
    "gcc": "gcc",
    "xz": "xz-utils",
    "/usr/include/x86_64-linux-gnu/sys/sdt.h": "systemtap-sdt-dev",  # stap-trace.exp's SystemTap probes
}
#: the members of the GDB tarball the testsuite's configure and `make check` read
MEMBERS = ("gdb/gdb/testsuite", "gdb/include", "gdb/config.guess", "gdb/config.sub", "gdb/install-sh",
           "gdb/missing", "gdb/gdb/silent-rules.mk", "gdb/gdb/disable-implicit-rules.mk")
TESTSUITE = Path("gdb/gdb/testsuite")  # inside CACHE/src

BOARDS = ("native-gdbserver", "native-extended-gdbserver")
SERVERS = ("gdbserver", "kgtp-sim")
#: what the stub's wrapper adds to gdbserver's command line: the shared objects beside the program run, by the names
#: the testsuite gives them (gdb_compile_shlib's outputs: NAME.so, NAME.sl), packed into the machine with it, at start
#: or at each vRun (`kgtp-sim gdbserver --with`: `$ORIGIN/` is the program's directory; the board note in the module's
#: docstring says why)
STUB_OPTIONS = ("--with", "$ORIGIN/*.so", "--with", "$ORIGIN/*.so.*", "--with", "$ORIGIN/*.sl")
#: the outcomes counted, in the table's order (DejaGnu's, and the ERROR lines of a file that broke)
OUTCOMES = ("PASS", "FAIL", "XFAIL", "KFAIL", "UNRESOLVED", "UNSUPPORTED", "UNTESTED", "ERROR")
#: outcomes counted too but shown only when a run has some (unexpected passes)
RARE_OUTCOMES = ("XPASS", "KPASS")
#: the table's column headings
HEADINGS = {"UNRESOLVED": "UNRES", "UNSUPPORTED": "UNSUP", "UNTESTED": "UNTST"}

#: Run control as a gdbserver user meets it, one or two files for each thing a remote stub must get right: the
#: breakpoint packets (Z0/Z1, conditions evaluated by the target), resuming and stepping (vCont, range stepping,
#: stepping over a breakpoint), returning from frames, watchpoints (Z2-Z4), signals reported and passed on,
#: inferior calls (registers saved and restored, a call interrupted) and threads (thread lists, per-thread
#: resumption, scheduler locking, events in several threads at once). Not here: attach, fork/exec and core files,
#: which are the native target's rather than a stub's, and the files that take minutes each.
RUN_CONTROL = (
    # breakpoints
    "gdb.base/break.exp",              # break/tbreak/info break/delete, run to them, breakpoints at function ends
    "gdb.base/condbreak.exp",          # conditional breakpoints, evaluated by the target when it can
    "gdb.base/hbreak2.exp",            # hardware breakpoints (Z1)
    # stepping and leaving frames
    "gdb.base/step-test.exp",          # step, next, stepi, nexti into and over calls
    "gdb.base/until.exp",              # until
    "gdb.base/advance.exp",            # advance (temporary breakpoints and a frame check)
    "gdb.base/finish.exp",             # finish out of functions of every return type (return values read back)
    "gdb.base/return.exp",             # return (frames popped by writing registers)
    "gdb.base/jump.exp",               # jump (the pc written, then resumed)
    # watchpoints
    "gdb.base/watchpoint.exp",         # software and hardware watchpoints, read/access watchpoints, scope
    "gdb.base/watch-cond.exp",         # conditional watchpoints
    "gdb.base/recurse.exp",            # watchpoints on locals of recursive frames going out of scope
    # signals
    "gdb.base/signals.exp",            # signals reported, passed, handled; stepping while they arrive
    "gdb.base/siginfo.exp",            # backtrace through an SA_SIGINFO handler, stepping out of it
    "gdb.base/sigbpt.exp",             # stepi through breakpoints around a faulting instruction and its handler
    "gdb.base/sigstep.exp",            # stepping into, over and out of signal handlers
    "gdb.base/interrupt.exp",          # Ctrl-C: the running program stopped from GDB, then resumed
    # inferior calls
    "gdb.base/callfuncs.exp",          # calls of every argument and return type, registers restored after
    "gdb.base/call-signal-resume.exp",  # a call interrupted by a signal, then resumed
    # threads
    "gdb.threads/pthreads.exp",        # thread list, breakpoints in threads, thread apply
    "gdb.threads/print-threads.exp",   # several threads hitting one breakpoint, killed at a breakpoint
    "gdb.threads/thread-specific-bp.exp",  # breakpoints for one thread, all-stop and non-stop
    "gdb.threads/schedlock.exp",       # scheduler locking: one thread resumed, the others held
    "gdb.threads/watchthreads.exp",    # hardware watchpoints hit by several threads
    "gdb.threads/sigthread.exp",       # Ctrl-C while threads run and signal each other
    "gdb.threads/signal-delivered-right-thread.exp",  # a signal passed to the thread that got it
    "gdb.threads/hand-call-in-threads.exp",  # inferior calls in several threads
    "gdb.threads/interrupted-hand-call.exp",  # a call in one thread stopped by a signal in another
    "gdb.threads/step-over-lands-on-breakpoint.exp",  # stepping over a breakpoint onto another
    "gdb.threads/multiple-step-overs.exp",  # several threads each needing a step over a breakpoint
    "gdb.threads/continue-pending-status.exp",  # continuing in a thread while another has an event pending
)
SETS = {"@trace": ("gdb.trace/*.exp",), "@run-control": RUN_CONTROL}


class Unavailable(RuntimeError):
    """What the runs need is missing and could not be installed."""


# --- gdb.sum --------------------------------------------------------------------------------------------------

#: what lib/gdb.exp's gdb_test_multiple appends to a failing test's name, `(REASON)`: the test is the one that
#: passes under the bare name elsewhere, so the reason is kept apart from the name
FAIL_REASONS = ("timeout", "the program exited", "the program is no longer running", "got interactive prompt",
                "got breakpoint menu", "GDB internal error", "shared library list corrupted",
                "probes interface failure")
_REASON = re.compile(r"^(.*) \((" + "|".join(re.escape(r) for r in FAIL_REASONS) + r")\)$")


@dataclass(frozen=True)
class Result:
    """One outcome line of a gdb.sum: the file it came from, its name, which of the file's tests of that name it
    is (1 for the first), its outcome, and why it failed when gdb_test_multiple said so (`reason`, taken off the
    name: `continue (the program exited)` is the test `continue`)."""

    file: str
    name: str
    occurrence: int
    outcome: str
    reason: str = ""

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.file, self.name, self.occurrence)

    @property
    def label(self) -> str:
        return self.name if self.occurrence == 1 else f"{self.name} (#{self.occurrence})"

    @property
    def described(self) -> str:
        """The outcome with its reason: `FAIL (timeout)`."""
        return f"{self.outcome} ({self.reason})" if self.reason else self.outcome


_RUNNING = re.compile(r"^Running (\S+\.exp) \.\.\.$")
_SUMMARY = re.compile(r"^\s*=== \S+ Summary ===$")
_OUTCOME = re.compile(r"^(" + "|".join(OUTCOMES + RARE_OUTCOMES) + r"): (.*)$")
#: outcomes whose name never carries a failure reason
_PASSING = ("PASS", "XPASS", "KPASS")


def exp_name(path: str) -> str:
    """`gdb.trace/tfind.exp` for a `Running .../testsuite/gdb.trace/tfind.exp ...` line's path."""
    _, sep, tail = path.rpartition("/testsuite/")
    return tail if sep else "/".join(path.split("/")[-2:])


def parse_sum(text: str) -> list[Result]:
    """The outcomes of a DejaGnu summary file, in order. A test's name is what follows `FILE: ` on its line (an
    ERROR line, which names no file, keeps its whole text); each belongs to the file of the `Running` line before
    it. Tests of one file that share a name (DejaGnu's DUPLICATE) are told apart by their occurrence. WARNING,
    DUPLICATE and PATH lines are notes, not outcomes, and so are the lines after the closing `=== gdb Summary ===`
    (where DejaGnu repeats a Tcl error of the last file as ERROR lines). A test that did not pass loses the reason
    gdb_test_multiple appended to its name (FAIL_REASONS) to `reason`, so that it pairs with its passing self."""
    results: list[Result] = []
    seen: collections.Counter[tuple[str, str]] = collections.Counter()
    current: str | None = ""
    for line in text.splitlines():
        running = _RUNNING.match(line)
        if running:
            current = exp_name(running.group(1))
            continue
        if _SUMMARY.match(line):
            current = None  # the summary and what follows it
            continue
        outcome = _OUTCOME.match(line)
        if not outcome or current is None:
            continue
        kind, name = outcome.groups()
        prefix = f"{current}: "
        if current and name.startswith(prefix):
            name = name[len(prefix):]
        reason = ""
        failed = _REASON.match(name) if kind not in _PASSING else None
        if failed:
            name, reason = failed.groups()
        seen[(current, name)] += 1
        results.append(Result(current, name, seen[(current, name)], kind, reason))
    return results


def files_of(text: str) -> list[str]:
    """The files a gdb.sum ran, in order (those that counted nothing too)."""
    return [exp_name(m.group(1)) for m in map(_RUNNING.match, text.splitlines()) if m]


def count(results: Iterable[Result]) -> dict[str, collections.Counter[str]]:
    """Outcome counts per file."""
    out: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for result in results:
        out[result.file][result.outcome] += 1
    return dict(out)


@dataclass(frozen=True)
class Difference:
    """A test that passes with one server and not with the other (`other_outcome`, with the failure's reason
    when there is one: `FAIL (timeout)`; None: not run there)."""

    file: str
    label: str
    passes_with: str
    other: str
    other_outcome: str | None


def differences(runs: dict[str, list[Result]]) -> list[Difference]:
    """The tests that pass with one server and have another outcome, or none, with the other, in file order and
    then in the order the passing server ran them. Only two servers are compared; fewer give nothing."""
    if len(runs) != 2:
        return []
    (a, results_a), (b, results_b) = runs.items()
    outcomes = {a: {r.key: r for r in results_a}, b: {r.key: r for r in results_b}}
    found = []
    for this, other in ((a, b), (b, a)):
        for key, result in outcomes[this].items():
            theirs = outcomes[other].get(key)
            if result.outcome == "PASS" and (theirs is None or theirs.outcome != "PASS"):
                found.append(Difference(result.file, result.label, this, other, theirs and theirs.described))
    order = {f: i for i, f in enumerate(dict.fromkeys(r.file for r in results_a + results_b))}
    return sorted(found, key=lambda d: order[d.file])  # stable: each server's own order within a file


# --- the report -----------------------------------------------------------------------------------------------

@dataclass
class Run:
    """One `make check` of one board against one server."""

    board: str
    server: str
    files: list[str]  # as the gdb.sum ran them
    results: list[Result]
    wall_s: float


def columns(runs: Sequence[Run]) -> list[str]:
    rare = [o for o in RARE_OUTCOMES if any(r.outcome == o for run in runs for r in run.results)]
    return list(OUTCOMES) + rare


def table_rows(runs: Sequence[Run]) -> tuple[list[str], list[list[str]]]:
    """The side-by-side table: a row per file (sorted) and a total row; a file a server did not run shows
    `-` in its columns."""
    kinds = columns(runs)
    header = ["file"] + [f"{run.server} {HEADINGS.get(k, k)}" for run in runs for k in kinds]
    files = sorted(set(f for run in runs for f in run.files + [r.file for r in run.results]))  # runtest's order varies
    counts = [count(run.results) for run in runs]
    ran = [set(run.files) | set(c) for run, c in zip(runs, counts)]
    rows = []
    for file in files:
        row = [file or "(before any file)"]
        for c, files_ran in zip(counts, ran):
            row += [str(c.get(file, {}).get(k, 0)) if file in files_ran else "-" for k in kinds]
        rows.append(row)
    total = ["total"]
    for c in counts:
        total += [str(sum(per.get(k, 0) for per in c.values())) for k in kinds]
    rows.append(total)
    return header, rows


def format_table(runs: Sequence[Run]) -> str:
    """The table as text: the servers' names over their column groups, the outcomes abbreviated."""
    header, rows = table_rows(runs)
    kinds = [HEADINGS.get(k, k) for k in columns(runs)]
    width0 = max(len(r[0]) for r in rows + [header])
    widths = [max(len(k), *(len(r[1 + i]) for r in rows)) for i, k in enumerate(kinds * len(runs))]
    group = len(kinds)
    lines = []
    over = " " * width0
    for i, run in enumerate(runs):
        span = sum(widths[i * group:(i + 1) * group]) + group - 1
        over += " | " + run.server.ljust(span)
    lines.append(over.rstrip())
    for row in [["file"] + kinds * len(runs)] + rows:
        cells = [row[0].ljust(width0)]
        for i in range(len(runs)):
            part = row[1 + i * group:1 + (i + 1) * group]
            cells.append(" ".join(c.rjust(w) for c, w in zip(part, widths[i * group:(i + 1) * group])))
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def markdown_table(runs: Sequence[Run]) -> str:
    header, rows = table_rows(runs)
    out = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    out += ["| " + " | ".join([f"`{r[0]}`" if r is not rows[-1] else "**total**", *r[1:]]) + " |" for r in rows]
    return "\n".join(out)


def format_differences(diffs: Sequence[Difference]) -> str:
    if not diffs:
        return "no test passes with one server and not with the other"
    lines = []
    for (this, other), group in _grouped(diffs):
        lines.append(f"pass with {this}, not with {other} ({len(group)}):")
        lines += [f"  {d.file}: {d.label}  [{other}: {d.other_outcome or 'not run'}]" for d in group]
    return "\n".join(lines)


def _grouped(diffs: Sequence[Difference]) -> list[tuple[tuple[str, str], list[Difference]]]:
    groups: dict[tuple[str, str], list[Difference]] = {}
    for d in diffs:
        groups.setdefault((d.passes_with, d.other), []).append(d)
    return list(groups.items())


def wall_times(runs: Sequence[Run]) -> str:
    return ", ".join(f"{run.server} {run.wall_s:.1f} s" for run in runs)


def report(board: str, runs: Sequence[Run], skipped: dict[str, str]) -> str:
    """What is printed for one board (and written to its summary.txt)."""
    files = list(dict.fromkeys(f for run in runs for f in run.files))
    lines = [f"== {board}: {len(files)} file{'' if len(files) == 1 else 's'}; wall time: {wall_times(runs)}"]
    lines += [f"({server} not run: {why})" for server, why in skipped.items()]
    lines.append(format_table(runs))
    if len(runs) == 2:
        lines += ["", format_differences(differences({r.server: r.results for r in runs}))]
    return "\n".join(lines)


# --- set-up ---------------------------------------------------------------------------------------------------

def missing() -> dict[str, str]:
    """What the runs need and this machine lacks -> the Debian package bringing it."""
    return {need: package for need, package in NEEDS.items()
            if not (os.path.exists(need) if need.startswith("/") else shutil.which(need))}


def ensure_packages(install: bool = True) -> None:
    """Install the missing Debian packages with scripts/lib/setup.sh's ensure_debian (one apt run)."""
    lacking = missing()
    if lacking and install:
        first = next(iter(lacking))
        command = f'. "{SCRIPTS / "lib" / "setup.sh"}" && ensure_debian {shlex.quote(first)} ' + " ".join(
            sorted(set(lacking.values())))
        proc = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise Unavailable(f"installing {' '.join(sorted(set(lacking.values())))} failed: "
                              f"{(proc.stderr or proc.stdout).strip()[-800:]}")
        lacking = missing()
    if lacking:
        raise Unavailable("missing: " + ", ".join(f"{need} (Debian's {package})" for need, package in lacking.items()))


def source_version() -> str:
    """gdb-source's Debian version (`13.1-3`): the cache's key."""
    return subprocess.run(["dpkg-query", "-W", "-f=${Version}", "gdb-source"], capture_output=True, text=True,
                          check=True).stdout.strip()


def default_cache() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kgtp-sim" / "gdb-testsuite" / source_version()


class Cache:
    """The extracted testsuite and its build directories, for one gdb-source version."""

    def __init__(self, root: Path):
        self.root = root
        self.src = root / "src"
        self.testsuite = self.src / TESTSUITE

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the cache for one harness run: its build directories and wrapper are rewritten."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"gdb-testsuite: waiting for another run using {self.root}", file=sys.stderr)
                fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def extract(self, tarball: str = SOURCE_TARBALL) -> None:
        """Extract MEMBERS once (into a temporary directory renamed into place, so a broken extraction is redone)."""
        if (self.src / ".complete").exists():
            return
        partial = self.root / "src.partial"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(self.src, ignore_errors=True)
        partial.mkdir(parents=True)
        subprocess.run(["tar", "-xJf", tarball, "-C", str(partial), *MEMBERS], check=True)
        (partial / ".complete").write_text(tarball + "\n")
        partial.rename(self.src)

    def build_dir(self, board: str, server: str) -> Path:
        """BOARD-SERVER's configured build directory, with the in-process agent where the testsuite looks."""
        top = self.root / "build" / f"{board}-{server}"
        build = top / "gdb" / "testsuite"
        agent = top / "gdbserver" / "libinproctrace.so"
        agent.parent.mkdir(parents=True, exist_ok=True)
        if not agent.is_symlink():
            agent.symlink_to(INPROCTRACE)
        if not (build / "Makefile").exists():
            build.mkdir(parents=True, exist_ok=True)
            with open(build / "configure.out", "w") as out:
                subprocess.run([str(self.testsuite / "configure")], cwd=build, stdout=out,
                               stderr=subprocess.STDOUT, check=True)
        return build

    def expand(self, patterns: Sequence[str]) -> list[str]:
        """FILES as the testsuite's relative names, sets and patterns expanded, in the order given, each once."""
        out: list[str] = []
        for pattern in patterns:
            if pattern.startswith("@"):
                if pattern not in SETS:
                    raise ValueError(f"unknown set {pattern} (known: {', '.join(SETS)})")
                out += self.expand(SETS[pattern])
                continue
            found = sorted(str(p.relative_to(self.testsuite)) for p in self.testsuite.glob(pattern))
            if not found:
                raise ValueError(f"no testsuite file matches {pattern}")
            out += found
        return list(dict.fromkeys(out))

    def stub_wrapper(self, python: str | None = None) -> Path:
        """The executable GDBSERVER points at for the stub: this checkout's `python -m kgtp_sim gdbserver`, naming
        the shared objects beside each program it runs (STUB_OPTIONS)."""
        if python is None:
            venv = ROOT / ".venv" / "bin" / "python"
            python = str(venv) if venv.exists() else sys.executable
        wrapper = self.root / "bin" / "kgtp-sim-gdbserver"
        wrapper.parent.mkdir(parents=True, exist_ok=True)
        options = " ".join(shlex.quote(option) for option in STUB_OPTIONS)
        wrapper.write_text("#!/bin/sh\n"
                           "# The stub's gdbserver role, for GDB's testsuite (kgtp_sim/tools/gdb_testsuite.py).\n"
                           "# gdbserver opens the host's files, so a program finds every shared object the testsuite\n"
                           "# built beside it, those it only dlopen()s too; the stub's machine holds only the files\n"
                           "# its user names. This harness is that user: it names the shared objects in the directory\n"
                           "# of each program run ($ORIGIN, where the testsuite's RUNPATH points), for every test\n"
                           "# alike (STUB_OPTIONS).\n"
                           f"PYTHONPATH={shlex.quote(str(ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}\n"
                           "export PYTHONPATH\n"
                           "# -S: a warm start's launcher needs no site-packages (reading them, the editable install's\n"
                           "# import hook among them, made a 45 ms start 50); a cold one loads them (__main__.py)\n"
                           f"exec {shlex.quote(python)} -S -m kgtp_sim gdbserver {options} \"$@\"\n")
        wrapper.chmod(0o755)
        # the testsuite starts hundreds of servers: their modules' bytecode compiled once here, read by each start
        # even where Python is told not to write it (PYTHONDONTWRITEBYTECODE: 0.2 s more per start, measured)
        compileall.compile_dir(str(ROOT / "kgtp_sim"), quiet=1)
        return wrapper


@contextlib.contextmanager
def warm_server(cache: Cache, nice: int = 10) -> Iterator[dict[str, str]]:
    """`kgtp-sim warm` for one run (at make's niceness, so its forks run as cold servers would), its socket in the
    cache; yields the environment that points the wrapper's `kgtp-sim gdbserver` at it. On leaving: the warm
    server ends, and its count of launches is checked (none: every server started cold, the variable lost)."""
    directory = cache.root / "warm"
    directory.mkdir(mode=0o700, exist_ok=True)
    directory.chmod(0o700)
    path = directory / "warm.sock"
    venv = ROOT / ".venv" / "bin" / "python"
    command = [str(venv) if venv.exists() else sys.executable, "-m", "kgtp_sim", "warm", "--socket", str(path)]
    if nice:
        command = ["nice", "-n", str(nice)] + command
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()
        if not first.startswith("Warm on "):
            raise Unavailable(f"`kgtp-sim warm` did not start: {first.strip() or proc.wait()}")
        yield {"KGTP_SIM_WARM": str(path)}
    finally:
        proc.terminate()
        rest = proc.communicate(timeout=60)[1]
    launches = re.search(r"(\d+) launches", rest)
    if launches is None or int(launches.group(1)) == 0:
        raise RuntimeError(f"the warm server served no launch: {rest.strip()[-400:]}")


def server_answers(program: Path | str) -> str | None:
    """None when `PROGRAM --help` succeeds, else why not (its last line of output)."""
    try:
        proc = subprocess.run([str(program), "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if proc.returncode == 0:
        return None
    text = (proc.stderr or proc.stdout).strip().splitlines()
    return text[-1] if text else f"exit status {proc.returncode}"


def stub_server(cache: Cache) -> str:
    """What GDBSERVER names for the stub: its wrapper, once `WRAPPER --help` answers (Unavailable says why not)."""
    wrapper = cache.stub_wrapper()
    why = server_answers(wrapper)
    if why is not None:
        raise Unavailable("the stub has no gdbserver role yet" if "invalid choice: 'gdbserver'" in why
                          else f"`python -m kgtp_sim gdbserver --help` fails: {why}")
    return str(wrapper)


# --- the runs -------------------------------------------------------------------------------------------------

def runtest_flags(board: str, gdbserver: str, files: Sequence[str]) -> str:
    """RUNTESTFLAGS: the same GDB, data directory and board for every server; only GDBSERVER differs."""
    return " ".join(shlex.quote(a) for a in (f"GDB={GDB}", f"GDBSERVER={gdbserver}",
                                             f"GDB_DATA_DIRECTORY={DATA_DIRECTORY}", f"--target_board={board}",
                                             *files))


def run_check(build: Path, board: str, server: str, gdbserver: str, files: Sequence[str], out: Path,
              nice: int = 10, env: dict[str, str] | None = None) -> Run:
    """One `make check` in BUILD (ENV added to its environment); gdb.sum, gdb.log and make's output are copied to
    OUT."""
    for name in ("gdb.sum", "gdb.log"):
        (build / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    command = ["make", "check", f"RUNTESTFLAGS={runtest_flags(board, gdbserver, files)}"]
    if nice:
        command = ["nice", "-n", str(nice)] + command
    started = time.monotonic()
    with open(out / "make.out", "w") as make_out:
        subprocess.run(command, cwd=build, stdout=make_out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                       env={**os.environ, **(env or {})})
    wall = time.monotonic() - started
    summary = build / "gdb.sum"
    if not summary.exists():
        raise RuntimeError(f"make check wrote no gdb.sum (see {out / 'make.out'})")
    for name in ("gdb.sum", "gdb.log"):
        shutil.copyfile(build / name, out / name)
    text = summary.read_text(errors="replace")
    return Run(board, server, files_of(text), parse_sum(text), wall)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gdb-testsuite", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", choices=SERVERS + ("both",), default="both",
                        help="which server GDBSERVER names (default: both, side by side)")
    parser.add_argument("--board", choices=BOARDS + ("both",), default="native-gdbserver",
                        help="the testsuite's board (default: native-gdbserver)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "gdb-testsuite",
                        help="where each run's gdb.sum and gdb.log go, as BOARD/SERVER/ (default: out/gdb-testsuite, "
                             "ignored by git)")
    parser.add_argument("--cache", type=Path, default=None,
                        help="the extracted testsuite and its build directories (default: "
                             "${XDG_CACHE_HOME:-~/.cache}/kgtp-sim/gdb-testsuite/GDB-SOURCE-VERSION)")
    parser.add_argument("--no-install", action="store_true", help="fail rather than install missing packages")
    parser.add_argument("--install-only", action="store_true",
                        help="install the missing Debian packages the runs need, then exit (scripts/test)")
    parser.add_argument("--nice", type=int, default=10, help="niceness of make check (default: 10; 0: none)")
    parser.add_argument("--cold", action="store_true",
                        help="start every stub cold (by default they are forks of a `kgtp-sim warm` server, each "
                             "some 0.25 s sooner)")
    parser.add_argument("files", nargs="*", metavar="FILES", default=["@trace"],
                        help="testsuite files or patterns (gdb.trace/tfind.exp, 'gdb.base/watch*.exp'), or @trace "
                             "(default) or @run-control")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        ensure_packages(install=not args.no_install)
    except Unavailable as exc:
        print(f"gdb-testsuite: {exc}", file=sys.stderr)
        return 2
    if args.install_only:
        return 0
    cache = Cache(args.cache or default_cache())
    boards = BOARDS if args.board == "both" else (args.board,)
    servers = SERVERS if args.server == "both" else (args.server,)
    with cache.locked():
        cache.extract()
        try:
            files = cache.expand(args.files)
        except ValueError as exc:
            print(f"gdb-testsuite: {exc}", file=sys.stderr)
            return 2
        programs = {"gdbserver": GDBSERVER}
        unavailable: dict[str, str] = {}
        if "kgtp-sim" in servers:
            try:
                programs["kgtp-sim"] = stub_server(cache)
            except Unavailable as exc:
                unavailable["kgtp-sim"] = str(exc)
                print(f"gdb-testsuite: kgtp-sim skipped: {exc}", file=sys.stderr)
        ran = 0
        for board in boards:
            runs, skipped = [], dict(unavailable)
            for server in (s for s in servers if s in programs):
                print(f"gdb-testsuite: {len(files)} files on {board} against {server} ({programs[server]})...",
                      file=sys.stderr, flush=True)
                try:
                    started = time.monotonic()
                    with (warm_server(cache, args.nice) if server == "kgtp-sim" and not args.cold
                          else contextlib.nullcontext({})) as env:
                        run = run_check(cache.build_dir(board, server), board, server, programs[server], files,
                                        args.out / board / server, args.nice, env)
                    run.wall_s = time.monotonic() - started  # the warm server's start and end included
                except (RuntimeError, Unavailable, subprocess.CalledProcessError) as exc:
                    print(f"gdb-testsuite: {server} on {board}: {exc}", file=sys.stderr)
                    skipped[server] = str(exc)
                    continue
                print(f"gdb-testsuite: {server} done in {run.wall_s:.1f} s", file=sys.stderr, flush=True)
                runs.append(run)
            if not runs:
                continue
            ran += len(runs)
            text = report(board, runs, skipped)
            print(text + "\n", flush=True)
            (args.out / board).mkdir(parents=True, exist_ok=True)
            (args.out / board / "summary.txt").write_text(text + "\n")
            (args.out / board / "summary.md").write_text(markdown_table(runs) + "\n")
    if not ran:
        print("gdb-testsuite: nothing could run", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
