"""The regression gate: a few files of GDB's own testsuite against the stub, compared test by test with the
outcomes committed in fixtures/gdb-testsuite/gate.txt.

    python -m kgtp_sim.tools.gdb_testsuite_gate [--update [--accept-regressions]] [--out DIR] [--no-install]

(`scripts/gdb-testsuite --gate [--update]` sets up the venv and runs this; `scripts/test` runs it through
tests/e2e/test_gdb_testsuite.py.) The files of GATE run once, on the native-gdbserver board, against the stub's
gdbserver role only, with gdb_testsuite's cache, wrapper and `make check` (run_check); their gdb.sum is read with
its parse_sum, so a name the testsuite repeats within a file is told apart by its occurrence (the second
`continue` is `continue (#2)`). Each test is then judged against the recorded outcome:

    regression   recorded PASS, now anything else or not run: the gate fails
    new pass     now PASS, recorded as anything else or not recorded: reported, to be recorded with --update
    changed      any other change of outcome (FAIL to UNRESOLVED, a new failing test, a failing test gone): shown

The run itself is broken, and the gate fails, when `make check` writes no gdb.sum, a file of GATE did not run, a
file stopped on a Tcl ERROR, or the recorded outcomes do not cover exactly the files of GATE (the list changed
without --update). Exit status: 0 no regression, 1 regressions, 2 a broken run or nothing could run.

`--update` records the run's outcomes (all of them, in GATE's order and then the run's) over the expected file,
with a header naming the GDB, gdb-source version and board they came from (a file new to GATE is shown as its
counts, a file left out of it is forgotten): that file is what the stub did when the gate was added and at each
update, written by this module only. An update that would record a regression is refused unless
`--accept-regressions` says it is meant (a test GDB renamed, a behaviour given up on purpose); a broken run is
never recorded.

Threads: everything runs on the caller's thread; `make check` is a child process.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..client.paths import FIXTURES, ROOT
from .gdb_testsuite import (
    GDB,
    Cache,
    Result,
    Unavailable,
    default_cache,
    ensure_packages,
    run_check,
    source_version,
    stub_server,
    warm_server,
)

#: The gate's files: each runs in seconds against the stub (eight, with schedlock, in 50 s on two cores with a fresh cache,
#: extraction and configure included; 90 to 105 s with the load average at 7 to 9), the stub passes most or all of
#: its tests, and their outcomes, names included, were the same over repeated runs on a busy machine. Left out:
#: gdb.threads/pthreads.exp (a test's name counts the calls a thread made before it stopped, which varies: `... 15
#: times (16 times)`), gdb.threads/print-threads.exp (the simulated kernel crashed once under it, at a context switch
#: to a task whose saved stack pointer was 0, fixed since), gdb.trace/collection.exp (391 passes, but 35 to 50 s
#: alone) and gdb.threads/schedlock.exp (208 passes in every run on a busy machine, 192 to 198 on a quieter one in
#: an earlier session, its `next` over a call with the other threads running timing out: not reproduced since, on
#: a machine that stayed busy, so not yet explained).
GATE = (
    "gdb.trace/tsv.exp",           # trace state variables: defined, collected, read live and from tsave's files
    "gdb.trace/actions.exp",       # tracepoint actions (collect, teval, while-stepping): set, listed, run, saved
    "gdb.trace/tstatus.exp",       # tstatus: trace notes, user, stop reason, hit counts, frames used (qTStatus)
    "gdb.base/break.exp",          # breakpoints (Z0): break/tbreak/info break/delete, run to them, at function ends
    "gdb.base/step-test.exp",      # step, next, stepi, nexti into and over calls (vCont)
    "gdb.base/finish.exp",         # finish out of functions of every return type, return values read back
    "gdb.base/watchpoint.exp",     # software and hardware watchpoints (Z2-Z4), read/access watchpoints, scope
)
#: The committed outcomes (written by `--update` only)
EXPECTED = FIXTURES / "gdb-testsuite" / "gate.txt"
BOARD = "native-gdbserver"
SERVER = "kgtp-sim"
#: scripts/test installs gdb_testsuite.NEEDS and exports REQUIRED=required: the gate's test then fails, rather
#: than skips, when they are missing
REQUIRED = "KGTP_SIM_GDB_TESTSUITE"

Key = tuple[str, str, int]  # Result.key: file, name, occurrence


# --- the expected file ----------------------------------------------------------------------------------------

_HEADER = """\
# The regression gate's expected outcomes: GDB's own testsuite, the files of GATE
# (kgtp_sim/tools/gdb_testsuite_gate.py), run against the stub's gdbserver role.
# A test recorded PASS that does not pass fails the gate (scripts/test); a new pass is recorded by running
#     scripts/gdb-testsuite --gate --update
# and committing this file with the change that brought it. Written by that command only: never edit it by hand.
# One line per test: OUTCOME<TAB>FILE<TAB>OCCURRENCE<TAB>NAME (OCCURRENCE: which of the file's tests of that name).
"""


@dataclass
class Expected:
    """The recorded outcomes: per test (file, name, occurrence) its outcome; the provenance lines of the header
    (`gdb: ...`, `board: ...`) and the files recorded."""

    outcomes: dict[Key, str] = field(default_factory=dict)
    provenance: dict[str, str] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)


def format_expected(results: Sequence[Result], files: Sequence[str], provenance: dict[str, str]) -> str:
    """The expected file for a run: the header, `# KEY: VALUE` provenance lines and `# file: F` for each of
    FILES, then a line per result, FILES' order first and the run's order within a file."""
    order = {f: i for i, f in enumerate(files)}
    lines = [_HEADER.rstrip("\n")]
    lines += [f"# {key}: {value}" for key, value in provenance.items()]
    lines += [f"# file: {f}" for f in files]
    ranked = sorted(enumerate(results), key=lambda ir: (order.get(ir[1].file, len(order)), ir[0]))
    lines += [f"{r.outcome}\t{r.file}\t{r.occurrence}\t{r.name}" for _, r in ranked]
    return "\n".join(lines) + "\n"


def parse_expected(text: str) -> Expected:
    """What format_expected wrote. A malformed line or a test recorded twice is a ValueError (the file is the
    gate's own output, so either means it was edited)."""
    expected = Expected()
    for number, line in enumerate(text.split("\n"), 1):
        if not line:
            continue
        if line.startswith("#"):
            key, sep, value = line[1:].strip().partition(": ")
            if sep and key == "file":
                expected.files.append(value)
            elif sep and " " not in key:
                expected.provenance[key] = value
            continue
        parts = line.split("\t", 3)
        if len(parts) != 4 or not parts[2].isdigit():
            raise ValueError(f"line {number}: not OUTCOME<TAB>FILE<TAB>OCCURRENCE<TAB>NAME: {line!r}")
        outcome, file, occurrence, name = parts
        key = (file, name, int(occurrence))
        if key in expected.outcomes:
            raise ValueError(f"line {number}: {file}: {name} (#{occurrence}) recorded twice")
        expected.outcomes[key] = outcome
    return expected


# --- the comparison -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Change:
    """A test whose outcome differs from the recorded one (None: not recorded, or not run now)."""

    file: str
    name: str
    occurrence: int
    expected: str | None
    now: str | None

    @property
    def label(self) -> str:
        return self.name if self.occurrence == 1 else f"{self.name} (#{self.occurrence})"

    def line(self) -> str:
        return f"  {self.file}: {self.label}  [{self.expected or 'not recorded'} -> {self.now or 'not run'}]"


@dataclass
class Verdict:
    """The gate's judgement of one run."""

    regressions: list[Change] = field(default_factory=list)
    new_passes: list[Change] = field(default_factory=list)
    changed: list[Change] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)  # why the run itself cannot be judged
    first_recorded: dict[str, dict[str, int]] = field(default_factory=dict)  # an update's new files: outcome counts
    counts: dict[str, int] = field(default_factory=dict)  # outcome -> tests this run

    @property
    def status(self) -> int:
        return 2 if self.broken else 1 if self.regressions else 0


def broken_run(files: Sequence[str], ran: Sequence[str], results: Sequence[Result]) -> list[str]:
    """Why a run of FILES cannot be judged: a file it did not run, an ERROR (a Tcl error stopped a file)."""
    why = [f"{f}: not run (no `Running` line in gdb.sum)" for f in files if f not in ran]
    why += [f"{r.file or '(before any file)'}: ERROR: {r.name}" for r in results if r.outcome == "ERROR"]
    return why


def compare(expected: Expected, files: Sequence[str], ran: Sequence[str], results: Sequence[Result],
            update: bool = False) -> Verdict:
    """Judge a run of FILES (the gdb.sum's `Running` files RAN, its RESULTS) against EXPECTED, test by test over
    FILES, in FILES' order. A file of FILES with nothing recorded, or one recorded and not in FILES, makes the run
    broken, unless UPDATE (a change of the list is what an update is for: a new file's tests are then counted in
    `first_recorded`, not listed one by one)."""
    verdict = Verdict(broken=broken_run(files, ran, results))
    unrecorded = [f for f in files if f not in expected.files]
    if not update:
        verdict.broken += [f"{f}: no outcomes recorded (the gate's list changed: record with --update)"
                           for f in unrecorded]
        verdict.broken += [f"{f}: recorded but not in the gate's list (record with --update)"
                           for f in expected.files if f not in files]
    now = {r.key: r.outcome for r in results}
    for r in results:
        verdict.counts[r.outcome] = verdict.counts.get(r.outcome, 0) + 1
        if update and r.file in unrecorded:
            verdict.first_recorded.setdefault(r.file, {}).setdefault(r.outcome, 0)
            verdict.first_recorded[r.file][r.outcome] += 1
    verdict.first_recorded = {f: verdict.first_recorded[f] for f in files if f in verdict.first_recorded}
    order = {f: i for i, f in enumerate(files)}
    keys = sorted(list(now) + [k for k in expected.outcomes if k not in now], key=lambda k: order.get(k[0], -1))
    for key in keys:  # stable: the run's order within a file, then the recorded tests it did not run
        before, after = expected.outcomes.get(key), now.get(key)
        if before == after or key[0] in unrecorded or key[0] not in order:
            continue
        change = Change(*key, before, after)
        if before == "PASS":
            verdict.regressions.append(change)
        elif after == "PASS":
            verdict.new_passes.append(change)
        else:
            verdict.changed.append(change)
    return verdict


def format_verdict(verdict: Verdict, wall_s: float | None = None) -> str:
    """Regressions, new passes and other changes by name, then the one-line total."""
    lines = []
    if verdict.broken:
        lines.append(f"the run is broken ({len(verdict.broken)}):")
        lines += [f"  {why}" for why in verdict.broken]
    for title, changes in (("REGRESSIONS: recorded PASS, now not", verdict.regressions),
                           ("new passes: record them with `scripts/gdb-testsuite --gate --update`", verdict.new_passes),
                           ("other changes (not failing the gate)", verdict.changed)):
        if changes:
            lines.append(f"{title} ({len(changes)}):")
            lines += [change.line() for change in changes]
    for file, counts in verdict.first_recorded.items():
        lines.append(f"{file}: first recorded: " + ", ".join(f"{n} {outcome}" for outcome, n in counts.items()))
    counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(verdict.counts.items(), key=lambda kv: -kv[1]))
    result = "BROKEN" if verdict.broken else "FAILED" if verdict.regressions else "ok"
    total = (f"gate {result}: {len(verdict.regressions)} regressions, {len(verdict.new_passes)} new passes, "
             f"{len(verdict.changed)} other changes; this run: {counts or 'no tests'}")
    if wall_s is not None:
        total += f"; {wall_s:.1f} s"
    lines.append(total)
    return "\n".join(lines)


def decide(verdict: Verdict, update: bool, accept_regressions: bool = False) -> tuple[int, str | None]:
    """The exit status, and why an update is refused (None: not refused, or no update): a check fails on
    regressions (1) or a broken run (2); an update records unless the run is broken (2) or it would record
    regressions without ACCEPT_REGRESSIONS (1)."""
    if not update:
        return verdict.status, None
    if verdict.broken:
        return 2, "a broken run is not recorded"
    if verdict.regressions and not accept_regressions:
        return 1, ("not recorded: the regressions above would be (fix them, or pass --accept-regressions if they "
                   "are meant)")
    return 0, None


# --- the run --------------------------------------------------------------------------------------------------

def provenance() -> dict[str, str]:
    """Which GDB, testsuite and board the outcomes came from."""
    gdb = subprocess.run([GDB, "--version"], capture_output=True, text=True).stdout.splitlines()
    return {"gdb": gdb[0] if gdb else GDB, "gdb-source": source_version(), "board": BOARD, "server": SERVER}


def read_expected(path: Path) -> Expected:
    return parse_expected(path.read_text()) if path.exists() else Expected()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gdb-testsuite --gate", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--update", action="store_true",
                        help=f"record this run's outcomes in {EXPECTED.relative_to(ROOT)} (refused on a broken run)")
    parser.add_argument("--accept-regressions", action="store_true",
                        help="with --update: record even when tests recorded PASS no longer pass")
    parser.add_argument("--expected", type=Path, default=EXPECTED, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "gdb-testsuite" / "gate",
                        help="where the run's gdb.sum and gdb.log go (default: out/gdb-testsuite/gate)")
    parser.add_argument("--cache", type=Path, default=None, help="the testsuite's cache (as gdb-testsuite's)")
    parser.add_argument("--no-install", action="store_true", help="fail rather than install missing packages")
    parser.add_argument("--nice", type=int, default=10, help="niceness of make check (default: 10; 0: none)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.accept_regressions and not args.update:
        print("gdb-testsuite --gate: --accept-regressions goes with --update", file=sys.stderr)
        return 2
    try:
        expected = read_expected(args.expected)
    except ValueError as exc:
        print(f"gdb-testsuite --gate: {args.expected}: {exc}", file=sys.stderr)
        return 2
    try:
        ensure_packages(install=not args.no_install)
        cache = Cache(args.cache or default_cache())
        with cache.locked():
            started = time.monotonic()  # not the wait for the lock
            cache.extract()
            missing = [f for f in GATE if not (cache.testsuite / f).exists()]
            if missing:
                raise Unavailable("not in the testsuite: " + ", ".join(missing))
            server = stub_server(cache)
            print(f"gdb-testsuite --gate: {len(GATE)} files on {BOARD} against {SERVER}...", file=sys.stderr,
                  flush=True)
            with warm_server(cache, args.nice) as env:  # the servers forked warm, as the testsuite tool's are
                run = run_check(cache.build_dir(BOARD, SERVER), BOARD, SERVER, server, GATE, args.out,
                                args.nice, env)
        wall = time.monotonic() - started
    except (Unavailable, RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"gdb-testsuite --gate: {exc}", file=sys.stderr)
        return 2
    verdict = compare(expected, GATE, run.files, run.results, update=args.update)
    print(format_verdict(verdict, wall), flush=True)
    recorded = expected.provenance.get("gdb-source")
    if recorded and recorded != source_version():
        print(f"note: recorded with gdb-source {recorded}, this run used {source_version()}", flush=True)
    status, refusal = decide(verdict, args.update, args.accept_regressions)
    if refusal:
        print(f"gdb-testsuite --gate: {refusal}", file=sys.stderr)
    if args.update and status == 0:
        args.expected.parent.mkdir(parents=True, exist_ok=True)
        args.expected.write_text(format_expected(run.results, GATE, provenance()))
        print(f"recorded {len(run.results)} outcomes in {args.expected}", flush=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
