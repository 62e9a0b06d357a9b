"""A breakpoint's round trip: `continue` over a breakpoint hit N times, per stop, under kgtp-sim's gdbserver role
and under Debian's gdbserver 13, with the same GDB (/usr/bin/gdb) and the same program.

The program (fixtures/peer/stops.c, `gcc -O2 -g -static` into a temporary directory: the same binary for both
servers) calls hit(i) in a loop; GDB breaks on hit and runs `continue` in batches of BATCH stops, timing each batch
in its own Python (`time.perf_counter`); the rows give the median, min and max of the batches' host time per
stop, and the ratio of the medians. Each stop is GDB's whole round trip: the stop reply, the registers and memory
GDB reads at a stop, the breakpoint's removal and reinsertion, the step over it, and the resumption. Under
gdbserver the program runs natively (ptrace); under the stub it runs as a process of the simulated kernel, whose
ptrace stops and resumes it (fixtures/kernel/ptrace.c). The stub's instructions per stop are not counted: they
depend on what the kernel's other threads do meanwhile; its host time is the figure.

This module is also the driver GDB runs (`gdb -batch -nx -x stops.py`, the plan in $KGTP_STOPS_PLAN), so its top
level imports only the standard library.

Threads: none of its own; the host side runs on the benchmark's thread with gcc, the servers and GDB as child
processes, each waited for; inside GDB, `driver` runs on GDB's Python thread.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "fixtures" / "peer" / "stops.c"
GDB = "/usr/bin/gdb"
GDBSERVER = "/usr/bin/gdbserver"
BATCH = 50


def build(workdir: Path) -> Path:
    binary = workdir / "stops"
    subprocess.run(["gcc", "-O2", "-g", "-static", "-o", str(binary), str(SOURCE)], check=True, capture_output=True)
    return binary


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}
    env["PATH"] = "/usr/bin:/bin:/usr/sbin:/sbin"
    return env


def _server(command: list[str], log: Path, env: dict) -> subprocess.Popen:
    """Start a server and wait for its `Listening on port` line (its stderr, into `log`)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, cwd=log.parent)
    deadline = time.monotonic() + 60
    while "Listening on port" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            raise RuntimeError(f"{command[0]} did not start: {log.read_text(errors='replace')[-800:]}")
        time.sleep(0.02)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def measure(server: str, binary: Path, stops: int, workdir: Path) -> dict:
    """One server's batches: {'server', 'stops', 'batch', 'seconds': [per batch]}."""
    port = _free_port()
    if server == "gdbserver":
        command, env = [GDBSERVER, "--once", f"127.0.0.1:{port}", str(binary), str(stops)], _clean_env()
    else:
        command = [sys.executable, "-m", "kgtp_sim", "gdbserver", "--once", "--cpus", os.environ.get("KGTP_STOPS_CPUS", "2"), f"127.0.0.1:{port}", str(binary),
                   str(stops)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = _server(command, workdir / f"{server}.log", env)
    plan = workdir / f"{server}.plan.json"
    out = workdir / f"{server}.out.json"
    plan.write_text(json.dumps({"port": port, "stops": stops, "batch": BATCH, "out": str(out)}))
    try:
        subprocess.run([GDB, "-batch", "-nx", "-x", str(Path(__file__)), str(binary)], env={
            **_clean_env(), "KGTP_STOPS_PLAN": str(plan)}, capture_output=True, timeout=1800, check=False)
    finally:
        _stop(proc)
    if not out.exists():
        raise RuntimeError(f"GDB wrote no result for {server}")
    result = json.loads(out.read_text())
    if "error" in result:
        raise RuntimeError(f"{server}: {result['error']}")
    continues = len(result["seconds"]) * result["batch"]
    if result["total"] != continues * (continues - 1) // 2:  # each continue stopped at the next call, none missed
        raise RuntimeError(f"{server}: {continues} continues left total at {result['total']}")
    return {"server": server, **result}


def rows(stops: int = 1000, progress=None) -> list[dict]:
    """Both servers' rows (the stub's first), with the ratio of medians on the stub's row."""
    if not os.path.exists(GDBSERVER) or not os.path.exists(GDB) or not shutil.which("gcc"):
        raise RuntimeError(f"needs gcc, {GDB} and {GDBSERVER}")
    out = []
    with tempfile.TemporaryDirectory(prefix="kgtp-stops-") as tmp:
        workdir = Path(tmp)
        binary = build(workdir)
        for server in ("kgtp-sim", "gdbserver"):
            if progress:
                progress(f"breakpoint round trips under {server}: {stops} stops")
            result = measure(server, binary, stops, workdir)
            per_stop = [s / result["batch"] * 1e6 for s in result["seconds"]]
            out.append({"server": server, "stops": len(per_stop) * result["batch"],
                        "us_per_stop_median": statistics.median(per_stop), "us_per_stop_min": min(per_stop),
                        "us_per_stop_max": max(per_stop)})
    out[0]["ratio_to_gdbserver"] = out[0]["us_per_stop_median"] / out[1]["us_per_stop_median"]
    return out


def markdown(table: list[dict]) -> str:
    lines = ["| server | stops | µs/stop median | min..max | ratio |", "|---|---:|---:|---:|---:|"]
    for r in table:
        ratio = f"{r['ratio_to_gdbserver']:.2f}" if "ratio_to_gdbserver" in r else "1"
        lines.append(f"| {r['server']} | {r['stops']:,} | {r['us_per_stop_median']:,.0f} "
                     f"| {r['us_per_stop_min']:,.0f}..{r['us_per_stop_max']:,.0f} | {ratio} |")
    return "\n".join(lines)


# ---- inside GDB ---------------------------------------------------------------------------------------------


def driver(gdb, plan: dict) -> dict:
    ex = gdb.execute
    ex("set pagination off")
    ex("set confirm off")
    ex(f"target remote 127.0.0.1:{plan['port']}")
    ex("break hit")
    ex("continue", to_string=True)  # the first stop: not timed (connection, symbols)
    seconds = []
    for _ in range(plan["stops"] // plan["batch"] - 1):
        start = time.perf_counter()
        for _ in range(plan["batch"]):
            ex("continue", to_string=True)
        seconds.append(time.perf_counter() - start)
    total = int(gdb.parse_and_eval("total"))  # hit(i) ran for every i before the one it stopped at
    ex("kill")
    return {"batch": plan["batch"], "seconds": seconds, "total": total}


def _gdb_main() -> None:
    import traceback

    import gdb  # only inside GDB

    plan = json.loads(Path(os.environ["KGTP_STOPS_PLAN"]).read_text())
    try:
        result = driver(gdb, plan)
    except BaseException as exc:  # the host side raises it
        result = {"error": f"{exc}\n{traceback.format_exc()}"}
    Path(plan["out"]).write_text(json.dumps(result))


if __name__ == "__main__" and "KGTP_STOPS_PLAN" in os.environ:
    _gdb_main()
elif __name__ == "__main__":
    table = rows(int(sys.argv[1]) if len(sys.argv) > 1 else 1000, progress=lambda m: print(m, file=sys.stderr))
    print(markdown(table))
