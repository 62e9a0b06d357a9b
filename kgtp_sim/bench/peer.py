"""The thesis workload under Debian's gdbserver 13 and its in-process agent, measured next to the simulator.

The same `kgtp_bench_loop(N)` / `kgtp_test_function` logic as the kernel's module.c, built as a user program
(fixtures/peer/thesis_workload.c, `gcc -O2 -no-pie -g` into a temporary directory: with PIE the agent's jump pad
is out of reach of the 5-byte jump), runs under `gdbserver --wrapper env LD_PRELOAD=/usr/lib/libinproctrace.so`
and real GDB (/usr/bin/gdb) sets, at kgtp_test_function, the benchmark's three dynamic cases:

- `false-cond`: `if 2*counter1+3*counter2<0` (never true: no frame);
- `expr`:       `collect (2*counter1+3*counter2)`;
- `cond+expr`:  `if 2*counter1+3*counter2>0` and the same collect;

as a `trace` (gdbserver-trap: a breakpoint, gdbserver evaluates and collects at each stop) and as an `ftrace`
(gdbserver-fast: the agent's jump pad, the condition compiled to native code), with the circular buffer on and a
64 MiB buffer as in runner.BUFFER_SIZE, so collection never stops. GDB compiles these expressions on the program
into the very bytecode of fixtures/bench/thesis_bytecode.json (counter1 and counter2 are in %rdi and %rsi).

Timing: the program times each batch of N calls itself (clock_gettime around kgtp_bench_loop) and stops at a
breakpoint on bench_sync() between batches, where GDB reads the time, starts (`tstart`) and stops (`tstop`) the
trace run and reads qTStatus (frames created). Each batch is one trace run, as a repetition is in runner.Bench.
Rows carry the median/min/max over the repetitions of host ns per call minus the untraced program's median,
which is measured in the same process under gdbserver with nothing armed (row `gdbserver-none`, absolute).

Hits: gdbserver counts a hit only when it collects (qTP reports 0 hits for a false condition), so after the
timed repetitions each row runs one more, untimed batch of at most HIT_CALLS calls that counts the probe's hits,
same probe kind, same actions: for `ftrace` GDB counts its breakpoint on the agent's gdb_collect, which the jump
pad enters on every hit (the condition is evaluated there); for `trace`, where gdbserver evaluates the condition
itself, the condition first increments a trace state variable, `($kgtp_peer_hits = $kgtp_peer_hits + 1) &&
<condition>` (the increment alone for `expr`). Hits must equal that batch's calls, and its frames created must be
0 for the false condition and one per call otherwise, as in the timed batches.

This module is also the driver GDB runs (`gdb -batch -nx -x peer.py`, the plan in $KGTP_PEER_PLAN), so its
top level imports only the standard library.

Threads: none of its own. On the host side it runs on the benchmark's thread (`kgtp-sim bench`, or
`python -m kgtp_sim.bench.peer`), with gcc, gdbserver and GDB as child processes, each waited for; inside GDB,
`driver` runs on the thread of GDB's Python.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: the checkout, spelled here rather than taken from kgtp_sim.client.paths: GDB's Python runs this file as a plain
#: script (without the package or its virtual environment), so its top level imports only the standard library
ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "fixtures" / "peer" / "thesis_workload.c"
PEER_SH = ROOT / "scripts" / "lib" / "peer.sh"
GDB = "/usr/bin/gdb"
GDBSERVER = "/usr/bin/gdbserver"
INPROCTRACE = "/usr/lib/libinproctrace.so"
BUFFER_SIZE = 64 << 20  # as runner.BUFFER_SIZE
FUNCTION = "kgtp_test_function"
EXPRESSION = "2*counter1+3*counter2"
COUNTER = "$kgtp_peer_hits"
#: calls of the untimed batch that counts hits (at most): GDB sees each fast-tracepoint hit there, about 1 ms each
HIT_CALLS = 1000

PROBES = ("gdbserver-none", "gdbserver-trap", "gdbserver-fast")
CASES = ("false-cond", "expr", "cond+expr")
ENGINE = "gdbserver"
#: the benchmark's row fields these rows fill (any other field of runner.FIELDS is None), then what only these
#: rows carry: calls per timed batch, and hits and frames counted in the untimed counting batch of hit_calls calls
FIELDS = ("probe", "case", "engine", "insns_per_hit", "ns_per_hit_median", "ns_per_hit_min", "ns_per_hit_max",
          "frames")
EXTRA = ("calls", "hits", "hit_calls", "hit_frames")


class PeerUnavailable(RuntimeError):
    """gdbserver, its in-process agent, gdb or gcc is missing and could not be installed."""


def condition(case: str) -> str | None:
    return {"false-cond": f"{EXPRESSION}<0", "expr": None, "cond+expr": f"{EXPRESSION}>0"}[case]


def actions(case: str) -> list[str]:
    return [] if case == "false-cond" else [f"collect ({EXPRESSION})"]


def expected_frames(case: str, calls: int) -> int:
    return 0 if case == "false-cond" else calls


# --- set-up ----------------------------------------------------------------------------------------------------

def missing() -> list[str]:
    """What the measurement needs and this machine lacks."""
    out = [p for p in (GDBSERVER, INPROCTRACE, GDB) if not os.path.exists(p)]
    if not shutil.which("gcc"):
        out.append("gcc")
    return out


def ensure_gdbserver(install: bool = True) -> None:
    """Install Debian's gdbserver (which ships libinproctrace.so) through scripts/lib/peer.sh when missing."""
    if install and (not os.path.exists(GDBSERVER) or not os.path.exists(INPROCTRACE)):
        proc = subprocess.run(["bash", "-c", f'. "{PEER_SH}" && ensure_gdbserver'], capture_output=True, text=True)
        if proc.returncode != 0:
            raise PeerUnavailable(f"installing gdbserver failed: {(proc.stderr or proc.stdout).strip()[-500:]}")
    lacking = missing()
    if lacking:
        raise PeerUnavailable("missing: " + ", ".join(lacking))


def version(program: str = GDBSERVER) -> str:
    out = subprocess.run([program, "--version"], capture_output=True, text=True).stdout
    return out.splitlines()[0].strip() if out else "?"


def build(workdir: Path) -> Path:
    """Compile the workload: -O2 like the kernel, -no-pie for the jump pad, -g for GDB's expressions."""
    binary = workdir / "thesis_workload"
    subprocess.run(["gcc", "-O2", "-no-pie", "-g", "-o", str(binary), str(SOURCE)], check=True,
                   capture_output=True, text=True)
    return binary


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env() -> dict:
    # the project venv's PATH has a different gdb/gdbserver and Python variables GDB's own Python must not see
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}
    env["PATH"] = "/usr/bin:/bin:/usr/sbin:/sbin"
    return env


class _Server:
    """gdbserver on a free loopback port with the agent preloaded into the program; killed (its group) on exit."""

    def __init__(self, binary: Path, workdir: Path, timeout: float = 20.0) -> None:
        self.log = workdir / "gdbserver.log"
        for _ in range(5):
            self.port = _free_port()
            with open(self.log, "wb") as log:
                self.proc = subprocess.Popen(
                    [GDBSERVER, "--wrapper", "env", f"LD_PRELOAD={INPROCTRACE}", "--",
                     f"127.0.0.1:{self.port}", str(binary)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
                    env=_clean_env(), start_new_session=True)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                text = self.log.read_text(errors="replace")
                if "Listening on port" in text:
                    return
                if self.proc.poll() is not None:
                    break
                time.sleep(0.02)
            self.close()
            if "Can't bind" not in self.log.read_text(errors="replace"):
                break
        raise RuntimeError(f"gdbserver did not start: {self.log.read_text(errors='replace')[-800:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def __enter__(self) -> "_Server":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- the measurement (host side) ------------------------------------------------------------------------------

def plan_cases(probes=("gdbserver-trap", "gdbserver-fast"), cases=CASES) -> list[dict]:
    return [{"probe": p, "case": c} for p in probes for c in cases]


def measure(calls: int = 10_000, repetitions: int = 5, cases: list[dict] | None = None,
            verify: bool = True, hit_calls: int | None = None, timeout: float = 900.0, keep: Path | None = None) -> dict:
    """Run the workload under gdbserver and GDB; the raw result of the driver (see `driver`)."""
    if repetitions < 1 or calls < 1:
        raise ValueError("calls and repetitions must be positive")
    ensure_gdbserver(install=False)
    workdir = Path(tempfile.mkdtemp(prefix="kgtp-peer-")) if keep is None else keep
    try:
        binary = build(workdir)
        with _Server(binary, workdir) as server:
            plan = {"port": server.port, "calls": calls, "repetitions": repetitions, "verify": verify,
                    "hit_calls": hit_calls or min(calls, HIT_CALLS),
                    "buffer_size": BUFFER_SIZE, "cases": cases if cases is not None else plan_cases(),
                    "workdir": str(workdir), "out": str(workdir / "result.json")}
            (workdir / "plan.json").write_text(json.dumps(plan))
            env = _clean_env()
            env["KGTP_PEER_PLAN"] = str(workdir / "plan.json")
            gdb = subprocess.run([GDB, "-batch", "-nx", "-x", str(Path(__file__).resolve()), str(binary)],
                                 cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
            out = Path(plan["out"])
            result = json.loads(out.read_text()) if out.exists() else None
            if not result or result.get("error"):
                raise RuntimeError("the GDB driver failed: " + (result or {}).get(
                    "error", f"no result (gdb exit {gdb.returncode})\n{gdb.stdout[-1500:]}\n{gdb.stderr[-1500:]}"))
            result["gdb"] = version(GDB)
            result["gdbserver"] = version(GDBSERVER)
            return result
    finally:
        if keep is None:
            shutil.rmtree(workdir, ignore_errors=True)


def rows_from(result: dict) -> list[dict]:
    """Rows in the benchmark's JSON schema (runner.FIELDS, in its order) followed by EXTRA."""
    calls = result["calls"]
    base = result["untraced_ns"]
    base_median = statistics.median(base)
    rows = [_row("gdbserver-none", "none", "none", base, calls, 0, (None, None, None))]
    for entry in result["rows"]:
        frames = entry["frames"]
        if len(set(frames)) != 1:
            raise RuntimeError(f"{entry['probe']} {entry['case']}: frames differ between repetitions: {frames}")
        ns = [x - base_median for x in entry["ns"]]
        rows.append(_row(entry["probe"], entry["case"], ENGINE, ns, calls, frames[0],
                         (entry["hits"], entry["hit_calls"], entry.get("hit_frames"))))
    return rows


def _fields() -> tuple[str, ...]:
    """runner.FIELDS (the JSON schema of the benchmark's rows) on the host side; ours inside GDB."""
    try:
        from .runner import FIELDS as runner_fields
    except ImportError:
        return FIELDS
    return tuple(runner_fields)


def _row(probe: str, case: str, engine: str, ns: list[float], calls: int, frames: int, counted: tuple) -> dict:
    row = dict.fromkeys(_fields())
    row.update({
        "probe": probe, "case": case, "engine": engine,
        "insns_per_hit": None,  # native code: no instruction counter
        "ns_per_hit_median": round(statistics.median(ns), 1),
        "ns_per_hit_min": round(min(ns), 1),
        "ns_per_hit_max": round(max(ns), 1),
        "frames": frames,
        "calls": calls,
        **dict(zip(("hits", "hit_calls", "hit_frames"), counted)),
    })
    return row


def check(row: dict) -> str | None:
    """What is wrong with a traced row's frames and counted hits, or None."""
    if row["probe"] == "gdbserver-none":
        return None
    if row["frames"] != expected_frames(row["case"], row["calls"]):
        return f"{row['frames']} frames in a batch of {row['calls']} calls"
    if row["hit_calls"] is not None:
        if row["hits"] != row["hit_calls"]:
            return f"{row['hits']} hits counted in {row['hit_calls']} calls"
        if row["hit_frames"] != expected_frames(row["case"], row["hit_calls"]):
            return f"{row['hit_frames']} frames in the counting batch of {row['hit_calls']} calls"
    return None


def peer_rows(calls: int = 10_000, repetitions: int = 5, install: bool = True, progress=None) -> list[dict]:
    """The gdbserver rows of the benchmark: installs gdbserver if missing, measures, checks, returns rows."""
    ensure_gdbserver(install=install)
    rows = rows_from(measure(calls=calls, repetitions=repetitions))
    for row in rows:
        problem = check(row)
        if problem:
            raise RuntimeError(f"gdbserver row {row['probe']} {row['case']}: {problem}")
        if progress:
            progress(row)
    return rows


# --- the driver (runs inside GDB) -----------------------------------------------------------------------------

def _status(gdb) -> dict:
    """qTStatus, raw: GDB's tstatus wording changes, the packet's fields (hex numbers) do not."""
    text = gdb.execute("maint packet qTStatus", to_string=True)
    match = re.search(r'received: "(.*)"', text)
    if not match:
        raise RuntimeError(f"no qTStatus reply: {text!r}")
    reply = match.group(1)
    fields = {"running": reply.startswith("T1")}
    for part in reply.split(";")[1:]:
        key, _, value = part.partition(":")
        fields[key] = value
    return fields


def _frames(fields: dict) -> int:
    # frames created in this run (tframes is what the circular buffer still holds)
    return int(fields.get("tcreated") or fields["tframes"], 16)


def _hit_counter(gdb, location: str):
    """A GDB breakpoint that counts its hits and never stops the program."""

    class HitCounter(gdb.Breakpoint):
        def __init__(self) -> None:
            super().__init__(location, internal=True)
            self.hits = 0

        def stop(self) -> bool:
            self.hits += 1
            return False

    return HitCounter()


def driver(gdb, plan: dict) -> dict:
    ex = gdb.execute
    workdir = Path(plan["workdir"])
    for command in ("set pagination off", "set confirm off", "set sysroot /", "set width 0",
                    f"target remote 127.0.0.1:{plan['port']}", "break bench_sync", "continue",
                    f"set trace-buffer-size {plan['buffer_size']}", "set circular-trace-buffer on"):
        ex(command, to_string=True)
    calls = plan["calls"]

    def batch(n: int) -> float:
        """One timed batch of n calls; returns host ns per call. Stops at bench_sync() again."""
        before = int(gdb.parse_and_eval("bench_batches"))
        ex(f"set var bench_calls = {n}", to_string=True)
        ex("continue", to_string=True)
        if int(gdb.parse_and_eval("bench_batches")) != before + 1:
            raise RuntimeError("the program did not stop at bench_sync after one batch")
        result = int(gdb.parse_and_eval("bench_result"))
        if result != n:
            raise RuntimeError(f"kgtp_bench_loop({n}) returned {result}")
        return int(gdb.parse_and_eval("bench_ns")) / n

    def define(probe: str, cond: str | None, acts: list[str]) -> None:
        ex("delete", to_string=True)
        command = "ftrace" if probe == "gdbserver-fast" else "trace"
        lines = [f"{command} {FUNCTION}" + (f" if {cond}" if cond else "")]
        if acts:
            lines += ["actions", *acts, "end"]
        script = workdir / "tracepoint.gdb"
        script.write_text("\n".join(lines) + "\n")
        ex(f"source {script}", to_string=True)
        ex("break bench_sync", to_string=True)

    def traced(n: int) -> tuple[float, int]:
        ex("tstart", to_string=True)
        ns = batch(n)
        fields = _status(gdb)
        if not fields["running"]:
            raise RuntimeError(f"the trace run stopped early: {fields}")
        frames = _frames(fields)
        ex("tstop", to_string=True)
        return ns, frames

    def count_hits(probe: str, name: str, n: int) -> tuple[int, int]:
        """An untimed batch of n calls that counts the probe's hits: (hits, frames created)."""
        if probe == "gdbserver-fast":
            # the jump pad enters the agent's gdb_collect on every hit; the condition is evaluated there
            define(probe, condition(name), actions(name))
            counter = _hit_counter(gdb, "gdb_collect")
            try:
                ex("tstart", to_string=True)
                batch(n)
                fields = _status(gdb)
                ex("tstop", to_string=True)
            finally:
                counter.delete()
            hits = counter.hits
        else:
            # gdbserver evaluates the condition itself: a trace state variable incremented first counts it
            ex(f"tvariable {COUNTER} = 0", to_string=True)
            cond = condition(name)
            define(probe, f"({COUNTER} = {COUNTER} + 1)" + (f" && {cond}" if cond else ""), actions(name))
            ex("tstart", to_string=True)
            batch(n)
            hits = int(gdb.parse_and_eval(COUNTER))
            fields = _status(gdb)
            ex("tstop", to_string=True)
            ex("delete", to_string=True)
            ex(f"delete tvariable {COUNTER}", to_string=True)
            ex("break bench_sync", to_string=True)
        if not fields["running"]:
            raise RuntimeError(f"the counting run stopped early: {fields}")
        return hits, _frames(fields)

    batch(min(calls, 1000))  # warm-up: page faults, caches
    untraced = [batch(calls) for _ in range(plan["repetitions"])]
    rows = []
    for case in plan["cases"]:
        probe, name = case["probe"], case["case"]
        define(probe, condition(name), actions(name))
        ns, frames = [], []
        for _ in range(plan["repetitions"]):
            t, f = traced(calls)
            ns.append(t)
            frames.append(f)
        entry = {"probe": probe, "case": name, "ns": ns, "frames": frames, "hits": None, "hit_calls": None}
        if plan.get("verify", True):
            entry["hits"], entry["hit_frames"] = count_hits(probe, name, plan["hit_calls"])
            entry["hit_calls"] = plan["hit_calls"]
        rows.append(entry)
    ex("delete", to_string=True)
    ex("set var bench_calls = 0", to_string=True)
    ex("continue", to_string=True)
    return {"calls": calls, "repetitions": plan["repetitions"], "untraced_ns": untraced, "rows": rows}


def _gdb_main() -> None:
    import traceback

    import gdb  # only inside GDB

    plan = json.loads(Path(os.environ["KGTP_PEER_PLAN"]).read_text())
    try:
        result = driver(gdb, plan)
    except BaseException as exc:  # report any failure to the host side, which raises it
        result = {"error": f"{exc}\n{traceback.format_exc()}"}
    Path(plan["out"]).write_text(json.dumps(result))


# --- command line ---------------------------------------------------------------------------------------------

def markdown(rows: list[dict]) -> str:
    lines = ["| probe | case | engine | ns/hit median | ns/hit min..max | frames | hits | calls |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['probe']} | {r['case']} | {r['engine']} | {r['ns_per_hit_median']:,.1f} "
                     f"| {r['ns_per_hit_min']:,.1f}..{r['ns_per_hit_max']:,.1f} | {r['frames']:,} "
                     f"| {'-' if r['hits'] is None else format(r['hits'], ',')} | {r['calls']:,} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kgtp_sim.bench.peer", description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")
    args = parser.parse_args(argv)
    started = time.monotonic()
    rows = peer_rows(calls=args.calls, repetitions=args.repetitions)
    print(f"{version(GDBSERVER)}, {version(GDB)}; {args.calls} calls, {args.repetitions} repetitions")
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if "gdb" in sys.modules:  # sourced by GDB (-x): the driver
        _gdb_main()
    else:
        sys.exit(main())
