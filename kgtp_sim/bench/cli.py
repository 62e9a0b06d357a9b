"""`kgtp-sim bench`: the thesis benchmark (issue 6). Wire with `add_parser(subparsers)` and `run(args)`.

Runs on the main thread of `kgtp-sim bench` (scripts/bench); the workloads it calls say what else runs (runner.py,
peer.py, scaling.py, smp.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

FULL = (10_000, 5)
QUICK = (1_000, 5)


#: The end of `kgtp-sim bench --help` (80 columns, printed as written).
EXAMPLES = """\
examples:
  kgtp-sim bench --quick            # about 30 s: each probe kind, case, engine
  kgtp-sim bench --json rows.json --chart chart.png --no-peer
  kgtp-sim bench --record --quick   # recording and reading traces at pace
  kgtp-sim bench --program-tracepoints  # a program's tracepoints, gdbserver's
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    bench = subparsers.add_parser("bench", help="the thesis benchmark: cost per hit of tracepoints",
                                  description="The thesis benchmark (scripts/bench): kgtp_bench_loop under every\n"
                                  "probe kind, case and engine, then under gdbserver.",
                                  epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(bench)
    return bench


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help=f"{QUICK[0]} calls, fewer rows of the scaling workload")
    parser.add_argument("--calls", type=int, default=None, help=f"calls of kgtp_test_function (default {FULL[0]})")
    parser.add_argument("--repetitions", type=int, default=None, help=f"timed runs per row (default {FULL[1]}, >= 5)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the rows as JSON")
    parser.add_argument("--chart", type=Path, default=None, metavar="FILE.png", help="write a bar chart (PNG)")
    parser.add_argument("--scaling", action="store_true",
                        help="also: cost per hit with 1..1000 tracepoints and 64 KiB..64 MiB buffers")
    parser.add_argument("--scaling-json", type=Path, default=None, metavar="FILE", help="scaling rows as JSON")
    parser.add_argument("--smp", action="store_true",
                        help="also: frames a second with 1, 2 and 4 CPUs, the kernel serving at full pace")
    parser.add_argument("--smp-json", type=Path, default=None, metavar="FILE", help="SMP rows as JSON")
    parser.add_argument("--no-peer", action="store_true",
                        help="leave out the gdbserver rows (the same workload as a user program under gdbserver)")
    parser.add_argument("--record", action="store_true",
                        help="instead: recording and reading traces at the kernel's pace (kgtp-sim record, export, "
                             "follow, babeltrace2; several minutes, --quick about one)")
    parser.add_argument("--record-json", type=Path, default=None, metavar="FILE", help="recording rows as JSON")
    parser.add_argument("--program-tracepoints", action="store_true",
                        help="instead: tracepoints in a program, the thesis workload as a user program under "
                             "`kgtp-sim gdbserver` (opt engine) and under gdbserver (--no-peer: ours only)")
    parser.add_argument("--program-tracepoints-json", type=Path, default=None, metavar="FILE",
                        help="program-tracepoint rows as JSON")
    parser.add_argument("--no-probe-effect", action="store_true",
                        help="leave out the probe effect of tracing every function (entry, entry and return)")
    parser.add_argument("--probe-effect-json", type=Path, default=None, metavar="FILE",
                        help="probe-effect rows as JSON")
    parser.add_argument("--no-stops", action="store_true",
                        help="leave out the breakpoint round trip under the gdbserver role and gdbserver")
    parser.add_argument("--no-programs", action="store_true",
                        help="leave out programs on the kernel: hello world, user vs kernel speed, getpid, context "
                             "switches, RSS over many switches")
    parser.add_argument("--programs-json", type=Path, default=None, metavar="FILE", help="program rows as JSON")
    parser.add_argument("--switches", type=int, default=None,
                        help="context switches of the RSS soak (default 100000, --quick 20000)")


def run(args: argparse.Namespace) -> int:
    if args.chart:
        from ..optional import pyplot

        pyplot("bench --chart")  # said before the run, not after it
    from .report import chart, markdown, write_json
    from .runner import Bench, expected_frames

    if args.record or args.record_json:
        return _recording(args)
    if args.program_tracepoints or args.program_tracepoints_json:
        return _program_tracepoints(args)
    calls, reps = QUICK if args.quick else FULL
    calls = args.calls or calls
    reps = args.repetitions or reps
    started = time.monotonic()
    bench = Bench(calls=calls, repetitions=reps)
    rows = bench.rows(progress=lambda r: print(
        f"  {r['probe']:>15} {r['case']:>9} {r['engine']:>6}: {r['insns_per_hit']} insns/hit", file=sys.stderr))
    if not args.no_peer:
        from .peer import PeerUnavailable, peer_rows

        try:
            rows += peer_rows(calls=calls, repetitions=reps, install=False, progress=lambda r: print(
                f"  {r['probe']:>15} {r['case']:>9}: {r['ns_per_hit_median']:,.0f} ns/hit", file=sys.stderr))
        except PeerUnavailable as error:
            print(f"kgtp-sim bench: gdbserver rows skipped: {error}", file=sys.stderr)
    bad = [r for r in rows if r["frames"] != expected_frames(r, calls)]
    print(markdown(rows, calls, reps, bench.speed_figures))
    if args.json:
        write_json(rows, args.json)
    if args.chart:
        chart(rows, args.chart)
    if not args.no_probe_effect:
        from .probe_effect import markdown as effect_markdown, probe_effect_rows

        effect = probe_effect_rows(calls=calls, repetitions=reps, progress=lambda r: print(
            f"  {r['probes']:>15} {r['engine']:>6}: {r['insns_per_call']} insns/call", file=sys.stderr))
        print(f"Probe effect of function-boundary tracing: kgtp_bench_loop({calls}), every function probed "
              "(`kgtp-fbt *` with `if 0`)\n")
        print(effect_markdown(effect))
        if args.probe_effect_json:
            import json

            args.probe_effect_json.write_text(json.dumps(effect, indent=2) + "\n")
    if not args.no_stops and not args.no_peer:
        from .stops import markdown as stops_markdown, rows as stop_rows

        stops = 200 if args.quick else 1000
        try:
            table = stop_rows(stops, progress=lambda m: print(f"  {m}", file=sys.stderr))
        except (RuntimeError, OSError) as error:
            print(f"kgtp-sim bench: breakpoint round trips skipped: {error}", file=sys.stderr)
        else:
            print(f"Breakpoint round trip: `continue` over a breakpoint hit {stops} times (GDB 13.1, the same static "
                  "program natively under gdbserver and as a process under `kgtp-sim gdbserver`)\n")
            print(stops_markdown(table))
    if not args.no_programs:
        from .programs import Sizes, markdown as programs_markdown, rows as program_rows

        sizes = Sizes(runs=3 if args.quick else Sizes.runs,
                      switches=args.switches or (20_000 if args.quick else Sizes.switches))
        programs = program_rows(sizes, progress=lambda m: print(f"  {m}", file=sys.stderr))
        print("Programs on the kernel: a dynamic glibc hello world, the same loop in ring 3 and in ring 0, "
              f"getpid, context switches, RSS over {sizes.switches:,} switches (kgtp_sim/bench/programs.py)\n")
        print(programs_markdown(programs))
        if args.programs_json:
            import json

            args.programs_json.write_text(json.dumps(programs, indent=2) + "\n")
    if args.scaling or args.scaling_json:
        from .scaling import markdown as scaling_markdown, scaling_rows

        srows = scaling_rows(quick=args.quick, calls=min(calls, 2000), repetitions=reps)
        print(scaling_markdown(srows))
        if args.scaling_json:
            import json

            args.scaling_json.write_text(json.dumps(srows, indent=2) + "\n")
    if args.smp or args.smp_json:
        from .smp import markdown as smp_markdown, smp_rows

        smp = smp_rows(seconds=1.0 if args.quick else 2.0)
        print(smp_markdown(smp))
        if args.smp_json:
            import json

            args.smp_json.write_text(json.dumps(smp, indent=2) + "\n")
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    for r in bad:
        print(f"kgtp-sim bench: {r['probe']} {r['case']} {r['engine']}: {r['frames']} frames, expected "
              f"{expected_frames(r, calls)}", file=sys.stderr)
    return 1 if bad else 0


def _recording(args: argparse.Namespace) -> int:
    import json

    from .recording import markdown as recording_markdown, recording_rows

    started = time.monotonic()
    rows = recording_rows(quick=args.quick, progress=lambda r: print(f"  {r}", file=sys.stderr, flush=True))
    print(recording_markdown(rows))
    if args.record_json:
        args.record_json.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    uncounted = [r for r in rows if r["row"] == "recording" and not r["every_frame_counted"]]
    for r in uncounted:
        print(f"kgtp-sim bench: {r['tracepoint']} recording: {r['recorded']} recorded + {r['lost']} lost != "
              f"{r['created']} created", file=sys.stderr)
    return 1 if uncounted else 0


def _program_tracepoints(args: argparse.Namespace) -> int:
    """The stub's rows (kgtp_sim/tools/program_hits.py, in a process of its own: it serves the program as the
    gdbserver role, a layer above the benchmark) and gdbserver's (peer.py), one table."""
    import json
    import os
    import subprocess
    import tempfile

    from .report import program_markdown

    started = time.monotonic()
    calls, reps = QUICK if args.quick else FULL
    windows = 10 if args.quick else 20
    with tempfile.TemporaryDirectory(prefix="kgtp-bench-") as tmp:
        out = Path(tmp) / "rows.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                              os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        proc = subprocess.run([sys.executable, "-m", "kgtp_sim.tools.program_hits", "--windows", str(windows),
                               "--json", str(out)], env=env, stdout=subprocess.DEVNULL)
        if proc.returncode or not out.exists():
            print("kgtp-sim bench: the program-tracepoint rows failed", file=sys.stderr)
            return 1
        rows = json.loads(out.read_text())
    if not args.no_peer:
        from .peer import PeerUnavailable, peer_rows

        try:
            rows += peer_rows(calls=args.calls or calls, repetitions=args.repetitions or reps, install=False)
        except PeerUnavailable as error:
            print(f"kgtp-sim bench: gdbserver rows skipped: {error}", file=sys.stderr)
    print(program_markdown(rows))
    if args.program_tracepoints_json:
        args.program_tracepoints_json.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    bad = [r for r in rows if r["probe"] not in ("stub-none", "gdbserver-none")
           and (r["frames"] != (0 if r["case"] == "false-cond" else r["calls"]) or r.get("python_hits"))]
    for r in bad:
        print(f"kgtp-sim bench: {r['probe']} {r['case']}: {r['frames']} frames in {r['calls']} calls, "
              f"{r.get('python_hits')} Python hits", file=sys.stderr)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kgtp-sim bench", description=__doc__, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
