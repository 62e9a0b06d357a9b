"""The combination suite's command: `scripts/combinations [--seconds N] [--seed S] [--only SPEC] [--cold]` runs the
combinations of a seed (or one, as a failure printed it), each checked by the oracle, and prints every failure with
the `--only` spec that reruns it alone.

Runs on the command's main thread (or a test's), which feeds the runners' sessions.
"""

from __future__ import annotations

import argparse
import logging
import random
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..fuzz_harness import FuzzFailure
from .oracle import check
from .process import ProcessRunner
from .runner import CombinationFailure, Driver, Runner
from .space import Combination, normalize, walk


class Runners:
    """The runner of each space: the kernel's (made at once, as before) and the process's (made at its first
    combination: it builds the program)."""

    def __init__(self, cold: bool = False) -> None:
        self.kernel = Runner(cold)
        self._process: ProcessRunner | None = None

    @property
    def process(self) -> ProcessRunner:
        if self._process is None:
            self._process = ProcessRunner()
        return self._process

    def of(self, c: Combination) -> Driver:
        return self.process if c.space == "process" else self.kernel

    def close(self) -> None:
        self.kernel.close()
        if self._process is not None:
            self._process.close()


@dataclass
class Outcome:
    combination: Combination
    problems: list[str]
    seconds: float


def run_one(runners: Runners, c: Combination) -> Outcome:
    """Run and check one combination; any failure (the oracle's, the harness', an exception) is its problems, and
    the machine that saw it is replaced."""
    started = time.monotonic()
    runner = runners.of(c)
    try:
        seen = runner.run(c)
        problems = check(c, seen, seen.sites or runner.sites)
        runner.healthy(c.cpus)
    except (CombinationFailure, FuzzFailure, AssertionError) as failure:
        problems = [f"{type(failure).__name__}: {failure}"]
    except Exception as failure:  # noqa: BLE001 - the harness' own error is a failure too; the walk goes on
        where = traceback.extract_tb(failure.__traceback__)[-1]
        problems = [f"{type(failure).__name__} in the harness ({where.filename.rsplit('/', 1)[-1]}:{where.lineno}): "
                    f"{failure}"]
    if problems:
        console = runner.console_tail(c.cpus)
        if any(word in console for word in ("panic", "Oops", "BUG", "general protection")):
            problems.append("the kernel's console ends:\n    " + console.replace("\n", "\n    "))
        runner.retire(c.cpus)
    return Outcome(c, problems, time.monotonic() - started)


def campaign(seconds: float, seed: int, *, limit: int | None = None, report: Callable[[str], None] = print,
             cold: bool = False) -> tuple[int, list[Outcome]]:
    """Combinations of `seed` until `seconds` passed (or `limit` ran); returns how many ran and the failures."""
    runners = Runners(cold)
    failures: list[Outcome] = []
    ran = 0
    started = time.monotonic()
    next_report = started + 30
    try:
        for c in walk(seed):
            if time.monotonic() - started >= seconds or (limit is not None and ran >= limit):
                break
            outcome = run_one(runners, c)
            ran += 1
            if outcome.problems:
                failures.append(outcome)
                report(f"FAILURE (seed {seed}, combination {ran}): --only '{c.spec()}'\n  "
                       + "\n  ".join(outcome.problems[:8]))
            if time.monotonic() >= next_report:
                next_report += 30
                report(f"  {time.monotonic() - started:6.0f}s  {ran} combinations, {len(failures)} failed")
    finally:
        runners.close()
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
        runners = Runners(cold=args.cold)
        try:
            outcome = run_one(runners, c)
        finally:
            runners.close()
        print(f"{c.spec()}: " + ("passed" if not outcome.problems else "FAILED\n  " + "\n  ".join(outcome.problems)))
        return 1 if outcome.problems else 0
    seed = args.seed if args.seed is not None else random.SystemRandom().getrandbits(32)
    print(f"combinations: {args.seconds:.0f} s, seed {seed}", flush=True)
    started = time.monotonic()
    ran, failures = campaign(args.seconds, seed, cold=args.cold)
    print(f"combinations: {ran} checked in {time.monotonic() - started:.0f} s, {len(failures)} failed (seed {seed})")
    return 1 if failures else 0
