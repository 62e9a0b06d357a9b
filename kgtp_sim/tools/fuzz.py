"""Fuzzing the stub's protocol layer: generators of hostile RSP input, a harness that checks every answer, and a
time-bounded campaign (`scripts/fuzz [--seconds N] [--seed S]`).

The harness drives a real `kgtp_sim.app.Stub` in-process (its dispatcher, handlers, tracer and kernel, with the
machine running) through a `Session`, exactly the object the TCP server feeds. After every fuzzed packet it
checks that:

- the packet got an answer: `E..`, empty, or a reply (a `c` is answered by the stop the kernel made meanwhile, at
  a breakpoint, or once Ctrl-C follows, as GDB does it);
- no handler failed (the dispatcher's last-resort guard answers `E0f` and logs a traceback: that is a crash);
- the session still serves: `QTFrame:ffffffff` answers `OK` and `m<jiffies>,8` answers 8 bytes of hex;
- the kernel is alive (checked at the end: jiffies advanced, the machine neither crashed nor halted; a machine the
  packets stopped, breakpoints and `monitor stop` being fuzzed too, runs again once the session leaves, as after
  a GDB).

Inputs come from four generators, all driven by a `random.Random` so a campaign is reproducible from its seed
and the test suite can drive them from hypothesis: structured packets for every packet class the dispatcher
reaches (QTDP and QTFrame with their own grammars), mutations of the requests real GDB sent in
fixtures/transcripts, random bodies after a valid prefix, and damaged framing (bad checksums, escapes,
run-length counts, truncation, oversized packets).

The pieces: fuzz_inputs.py (the generators), fuzz_harness.py (the stub under test and the checks), this module
(the campaign: a time-bounded run with a failure per kind and a replayable reproducer, `--replay`, the figures and
the command line). Runs on the main thread of `scripts/fuzz`; every name of the other two is offered here too.
"""

from __future__ import annotations

import argparse
import logging
import random
import re
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .fuzz_harness import FUZZ_CPUS, Figures, FuzzFailure, Harness, build_stub, is_error_reply
from .fuzz_inputs import (
    HOSTILE_BYTECODE,
    INTERESTING,
    MONITOR_ARGS,
    MONITOR_WORDS,
    Generator,
    Vocabulary,
    action,
    agent_expression,
    bytecode,
    damaged_frame,
    generic,
    hex_number,
    hex_text,
    monitor,
    mutate,
    number,
    oversized,
    qtdp,
    qtdp_actions,
    qtframe,
    random_bytes,
    reachable_packet_classes,
    seed_packets,
    structured,
)

__all__ = [
    # the inputs
    "HOSTILE_BYTECODE", "INTERESTING", "MONITOR_ARGS", "MONITOR_WORDS", "Generator", "Vocabulary", "action",
    "agent_expression", "bytecode", "damaged_frame", "generic", "hex_number", "hex_text", "monitor", "mutate",
    "number", "oversized", "qtdp", "qtdp_actions", "qtframe", "random_bytes", "reachable_packet_classes",
    "seed_packets", "structured",
    # the harness
    "FUZZ_CPUS", "Figures", "FuzzFailure", "Harness", "build_stub", "is_error_reply",
    # the campaign
    "Failure", "campaign", "format_figures", "main", "replay", "signature",
]


# ---- the campaign ----------------------------------------------------------------------------------------------


def signature(failure: str) -> str:
    """A failure's kind, with the numbers that vary between occurrences taken out."""
    return re.sub(r"0x[0-9a-f]+|\d+", "N", failure.split(" answering ")[0])[:160]


@dataclass
class Failure:
    message: str
    history: list[tuple[str, bytes]]  # the inputs that led to it, oldest first (state carries over)
    count: int = 1


def campaign(seconds: float, seed: int, report: Callable[[str], None] = print,
             dump: Path | None = None) -> tuple[Figures, float, list[Failure]]:
    stub = build_stub()
    harness = Harness(stub)
    generator = Generator(reachable_packet_classes(stub.dispatcher), seed_packets(),
                          Vocabulary.from_image(stub.machine.image))
    rng = random.Random(seed)
    failures: dict[str, Failure] = {}
    history: list[tuple[str, bytes]] = []
    since_rebuild: list[tuple[str, bytes]] = []  # everything the current stub saw: a replayable reproducer
    started = time.monotonic()
    next_report = started + 10

    def failed(message: str) -> None:
        harness.figures.crashes += 1
        key = signature(message)
        if key in failures:
            failures[key].count += 1
        else:
            failures[key] = Failure(message, list(history))
            report(f"FAILURE: {message}")
            if dump is not None:
                dump.mkdir(parents=True, exist_ok=True)
                path = dump / f"failure-{len(failures)}.txt"
                path.write_text(f"# {message}\n" + "".join(f"{src} {data.hex()}\n" for src, data in since_rebuild))
                report(f"  reproducer: {path} ({len(since_rebuild)} inputs; replay with --replay)")

    try:
        while time.monotonic() - started < seconds:
            source, payload = generator.packet(rng)
            try:
                if rng.random() < 0.85:
                    history.append((source, payload))
                    since_rebuild.append((source, payload))
                    harness.packet(payload, source)
                else:
                    wire = damaged_frame(rng, payload) if rng.random() < 0.9 else oversized(rng, 1 << 16)
                    history.append(("wire", wire))
                    since_rebuild.append(("wire", wire))
                    harness.raw(wire)
            except FuzzFailure as failure:
                failed(str(failure))
                harness.recover(build_stub())
                since_rebuild.clear()
            del history[:-40]
            if time.monotonic() >= next_report:
                next_report += 10
                f = harness.figures
                report(f"  {time.monotonic() - started:6.0f}s  packets {f.packets}  errors {f.answered_error}  "
                       f"crashes {f.crashes} ({len(failures)} kinds)")
        try:
            final_jiffies = harness.kernel_alive()
        except FuzzFailure as failure:
            failed(str(failure))
            final_jiffies = -1
        harness.figures.by_source["jiffies advanced"] = final_jiffies - harness.first_jiffies
    finally:
        harness.close()
        harness.machine.shutdown()
    return harness.figures, time.monotonic() - started, list(failures.values())


def replay(path: Path, report: Callable[[str], None] = print) -> str | None:
    """Feed a dumped input history to a fresh stub; returns the first failure (None if it did not recur)."""
    inputs = []
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            source, data = line.split(" ", 1)
            inputs.append((source, bytes.fromhex(data)))
    stub = build_stub()
    harness = Harness(stub)
    try:
        for index, (source, data) in enumerate(inputs):
            try:
                harness.raw(data) if source == "wire" else harness.packet(data, source)
            except FuzzFailure as failure:
                report(f"input {index} of {len(inputs)} ({source} {data[:120]!r}): {failure}")
                return str(failure)
        return None
    finally:
        harness.close()
        harness.machine.shutdown()


def format_figures(figures: Figures, elapsed: float, seed: int) -> str:
    f = figures
    lines = [
        f"fuzz campaign: seed {seed}, {elapsed:.1f} s",
        f"  packets sent        {f.packets}  ({f.packets / max(elapsed, 1e-9):.0f}/s)",
        f"  answered OK/data    {f.answered_ok}",
        f"  answered E..        {f.answered_error}  ({', '.join(f'{k} {v}' for k, v in f.errors_by_code.most_common())})",
        f"  answered empty      {f.answered_empty}",
        f"  damaged frames      {f.frames_damaged}",
        f"  health checks       {f.health_checks}",
        f"  reconnects          {f.reconnects}",
        f"  by source           {', '.join(f'{k} {v}' for k, v in f.by_source.items() if k != 'jiffies advanced')}",
        f"  jiffies advanced    {f.by_source.get('jiffies advanced', 0)}",
        f"  crashes             {f.crashes}",
    ]
    return "\n".join(lines)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180, help="how long to run (default: 180)")
    parser.add_argument("--seed", type=int, default=None, help="campaign seed (default: random, printed)")
    parser.add_argument("--history", type=int, default=12, help="inputs shown before each failure (default: 12)")
    parser.add_argument("--dump", type=Path, default=None, help="write a replayable reproducer per failure kind here")
    parser.add_argument("--replay", type=Path, default=None, help="replay a reproducer written by --dump and exit")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.replay is not None:
        logging.getLogger().addHandler(logging.NullHandler())
        failure = replay(args.replay)
        print("replay: " + ("did not fail" if failure is None else "failed"))
        return 1 if failure else 0
    seed = args.seed if args.seed is not None else random.SystemRandom().getrandbits(32)
    logging.getLogger().addHandler(logging.NullHandler())  # failures are caught and reported by the harness
    print(f"fuzz: {args.seconds:.0f} s against an in-process stub with a running kernel (seed {seed})", flush=True)
    figures, elapsed, failures = campaign(args.seconds, seed, dump=args.dump)
    print(format_figures(figures, elapsed, seed))
    for failure in failures:
        print(f"\n{failure.count} x {failure.message}\n  the last inputs before it (oldest first):")
        for source, payload in failure.history[-args.history:]:
            print(f"    {source:12} {payload[:160]!r}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
