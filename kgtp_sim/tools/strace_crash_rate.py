"""Measure how often real GDB crashes while creating static tracepoints against the stub.

GDB 13 to 18 write a member of a derived class before it is constructed when the stub's qTSTMat reply names a
marker at `strace` time (undefined behaviour: a segfault or an abort in free, depending on the heap). The stub
therefore names markers only while GDB downloads them. This runs N fresh GDB sessions, each creating four static
tracepoints and starting and stopping a run, against a stub serving qTSTMat our way and (with
`--name-markers-at-strace`) the naive way, and counts the sessions in which GDB died.

    python -m kgtp_sim.tools.strace_crash_rate [--sessions 50] [--gdb PATH ...]

Runs on the main thread of this command; the stub and each GDB are child processes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from ..client import GDB_CLIENTS, VMLINUX, command_file, gdb_batch, gdb_version, session_lines, start_stub
from ..machine import KernelImage

SITES = ("module::kgtp_module_event", "module::module_load", "sched::sched_switch", "syscalls::sys_enter")


def session_commands() -> list[str]:
    """One session: a static tracepoint on each of SITES collecting `$_sdata`, a short run, and detach."""
    markers = {m.id: m for m in KernelImage.load(VMLINUX).markers}
    commands = []
    for marker_id in SITES:
        commands += [f"strace *{markers[marker_id].site:#x}", "actions", "collect $_sdata", "end"]
    return [*commands, "tstart", "shell sleep 0.1", "tstop", "tstatus", "detach"]


def crashed(result: subprocess.CompletedProcess) -> bool:
    text = result.stdout + result.stderr
    return result.returncode < 0 or "Fatal signal" in text or "internal-error" in text or "free():" in text


def measure(gdb: str, sessions: int, naive: bool, timeout: float = 30) -> tuple[int, int]:
    stub = start_stub(*(["--name-markers-at-strace"] if naive else []))
    failures = crashes = 0
    try:
        with command_file(session_lines(stub.address, session_commands())) as script:
            for _ in range(sessions):
                try:
                    result = gdb_batch(gdb, "-x", str(script), timeout=timeout)
                except subprocess.TimeoutExpired:
                    crashes += 1  # GDB hung (seen with 18.1 after the corrupted construction): as bad as a crash
                    continue
                if crashed(result):
                    crashes += 1
                elif "Trace stopped by a tstop command" not in result.stdout:
                    failures += 1
    finally:
        stub.stop()
    return crashes, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--gdb", action="append", help="GDB binaries (default: /usr/bin/gdb and the venv's)")
    parser.add_argument("--naive-sessions", type=int, default=None, help="sessions for the naive way (default: same)")
    parser.add_argument("--only", choices=("ours", "naive"), default=None)
    args = parser.parse_args(argv)
    gdbs = args.gdb or [client.path for client in GDB_CLIENTS]
    print("| GDB | qTSTMat served | sessions | GDB crashed or hung | other failures |\n|---|---|---|---|---|")
    for gdb in gdbs:
        version = gdb_version(gdb)
        for naive in (False, True):
            if args.only and (args.only == "naive") != naive:
                continue
            sessions = args.naive_sessions if naive and args.naive_sessions else args.sessions
            crashes, failures = measure(gdb, sessions, naive)
            way = "named at strace (naive)" if naive else "named only during download (ours)"
            print(f"| {version} | {way} | {sessions} | {crashes} | {failures} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
