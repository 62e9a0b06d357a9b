"""Static tracepoints in a program under `kgtp-sim gdbserver`, with real GDB 13.1 and 18.1: the program's SDT probes
(`<sys/sdt.h>`, tests/programs/probes.c) are its markers, listed by `info static-tracepoint-markers` where the
process has them (a PIE's moved with it) beside the kernel's, and `strace` at one collects `$_sdata`, its
arguments' values at each hit (registers at -O2, frame slots at -O0, constants), rendered `arg1=… arg2=…`.

Debian's gdbserver lists no marker and refuses `strace` (its in-process agent's static tracepoints were LTTng UST
markers, a library Debian does not build it with): nothing to compare with, so each hit's values are checked
against what the program computes.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from kgtp_sim.client import GDB_CLIENTS

from .test_gdbserver_tracing import session

SOURCE = Path(__file__).resolve().parents[1] / "programs" / "probes.c"
SDT_HEADER = Path("/usr/include/x86_64-linux-gnu/sys/sdt.h")
pytestmark = pytest.mark.skipif(not GDB_CLIENTS, reason="no GDB")
LINE = {name: number for number, text in enumerate(SOURCE.read_text().splitlines(), 1)
        for name in re.findall(r"line:(\w+)", text)}
#: the listing's row of a program's marker: its id, its address, where GDB places it
ROW = re.compile(r"^\d+\s+(kgtp:\w+)\s+[yn]\s+(0x[0-9a-f]+) in (\w+) at \S*probes\.c:(\d+)\s*$", re.M)


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict[str, Path]:
    if not SDT_HEADER.exists():
        pytest.skip("no <sys/sdt.h> (Debian's systemtap-sdt-dev: scripts/test installs it)")
    out = tmp_path_factory.mktemp("probes")
    built = {}
    for name, flags in (("O2-static", ["-O2", "-static"]), ("O0-pie", ["-O0"])):
        built[name] = out / f"probes-{name}"
        subprocess.run(["gcc", "-g", *flags, str(SOURCE), "-o", str(built[name])], check=True, capture_output=True)
    return built


def _markers(program: Path) -> dict[str, int]:
    """Each probe's site as linked, from binutils' reading of the notes (the oracle, apart from the stub's)."""
    notes = subprocess.run(["readelf", "-n", str(program)], check=True, capture_output=True, text=True).stdout
    return {f"kgtp:{name}": int(location, 16) for name, location in
            re.findall(r"Name: (\w+)\s+Location: (0x[0-9a-f]+)", notes)}


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda g: f"gdb{g.version}")
@pytest.mark.parametrize("build, engine, cpus", [("O2-static", "opt", 2), ("O0-pie", "interp", 1),
                                                 ("O0-pie", "naive", 2), ("O2-static", "interp", 2)])
def test_strace_at_a_programs_sdt_probe_collects_its_arguments(probes, gdb, build, engine, cpus):
    program = probes[build]
    linked = _markers(program)
    bias = 0x555555554000 if build.endswith("pie") else 0  # where the kernel loads a PIE (GDB's listing says so)
    step, round_ = linked["kgtp:step"] + bias, linked["kgtp:round"] + bias
    text, _, _ = session(gdb, program, [
        "break main", "continue", "info static-tracepoint-markers",
        f"strace *{step:#x}", "actions", "collect $_sdata", "end",
        f"strace *{round_:#x}", "actions", "collect $_sdata", "end",
        f"break {LINE['end']}", "tstart", "continue", "tstop", "tstatus",
        "tfind start", "while $trace_frame != -1", 'printf "frame %d tp %d\\n", $trace_frame, $tracepoint',
        "print $_sdata", "tfind", "end", "kill"], "--engine", engine, "--cpus", str(cpus))
    rows = {name: (int(address, 16), function, int(line)) for name, address, function, line in ROW.findall(text)}
    assert rows == {"kgtp:start": (linked["kgtp:start"] + bias, "main", LINE["start"]),
                    "kgtp:step": (step, "step", LINE["step"]), "kgtp:round": (round_, "main", LINE["round"])}, text
    assert re.search(r"^\d+\s+sched::sched_switch\s", text, re.M), text  # the kernel's markers too
    assert "Collected 8 trace frames." in text, text
    frames = re.findall(r"^frame (\d+) tp (\d+)\n\$\d+ = \"(.*)\"$", text, re.M)
    # step(i, -i) adds i to the total, then the round's probe: i and the constant 7
    expected = []
    total = 0
    for i in range(1, 5):
        total += i
        expected += [("2", f"arg1={i} arg2={-i} arg3={total}"), ("3", f"arg1={i} arg2=7")]
    assert [(tp, sdata) for _, tp, sdata in frames] == expected, text
