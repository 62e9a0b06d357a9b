"""Tracing a several-CPU machine with real GDB: `$cpu_id` collected at kgtp_test_function, tstatus over per-CPU
rings, tfind through the merged frames, each frame's CPU in `monitor frames` agreeing with its `$cpu_id`.

The stub is started with two CPUs when `serve` has `--cpus`. Which CPUs the kernel runs the workload on depends
on the kernel: with one CPU online every frame is CPU 0's; once CPU 1 runs `kgtp_bench` too (`monitor stats`
shows cpus_online 2) frames of both CPUs must appear.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from kgtp_sim.client.stub import kgtp_command

from ..conftest import run_gdb, start_stub, wait_for_hits

pytestmark = pytest.mark.gdb


def _serve_has_cpus() -> bool:
    result = subprocess.run(kgtp_command("serve", "--help"), capture_output=True, text=True, timeout=60)
    return "--cpus" in result.stdout


@pytest.fixture(scope="module")
def smp_stub():
    server = start_stub(*(("--cpus", "2") if _serve_has_cpus() else ()))
    yield server
    server.stop()


def test_frames_of_every_online_cpu_with_their_cpu_id(gdb, smp_stub):
    out = run_gdb(
        gdb, smp_stub, "monitor stats", "print $cpu_number",
        "trace kgtp_test_function", "actions", "collect $cpu_id, counter1", "end",
        # 100 calls a tick on each CPU, in turns of 2 ms: 400 hits span several turns of both CPUs
        "tstart", *wait_for_hits("$tpnum", 400), "tstop", "tstatus",
        "python",
        "ids = []",
        "gdb.execute('tfind start', to_string=True)",
        "while int(gdb.parse_and_eval('$trace_frame')) >= 0:",
        "    ids.append(int(gdb.parse_and_eval('$cpu_id')))",
        "    gdb.execute('tfind', to_string=True)",
        "print('CPU_IDS', ' '.join(map(str, ids)))",
        "end",
        "monitor frames 0 10000",
        "tfind none", "delete", "tstatus",
    )
    cpus = int(re.search(r"^\$1 = (\d+)$", out, re.M).group(1))
    online = int(re.search(r"^cpus_online\s+(\d+)", out, re.M).group(1))
    assert cpus == int(re.search(r"^cpus\s+(\d+)", out, re.M).group(1)), out  # $cpu_number: the CPU count
    collected = int(re.search(r"Collected (\d+) trace frames", out).group(1))
    ids = [int(n) for n in re.search(r"^CPU_IDS ?(.*)$", out, re.M).group(1).split()]
    listed = [int(cpu) for cpu in re.findall(r"^frame\s+\d+\s+tp\s+\d+\s+\+\s*[-\d.]+ us\s+cpu (\d+)", out, re.M)]
    assert len(ids) == collected >= 40, out
    assert ids == listed, out  # tfind's order is the merged order `monitor frames` lists, CPU by CPU
    assert set(ids) <= set(range(online)), out
    if online >= 2:  # the kernel runs kgtp_bench on every CPU: both CPUs traced
        assert set(ids) >= {0, 1}, out
    else:
        assert set(ids) == {0}, out


def test_a_per_cpu_variable_counts_each_cpus_hits(gdb, smp_stub):
    """KGTP's `$p_` variable: `teval $p_hits = $p_hits + 1` counts on the hitting CPU's copy (natively, in the
    default optimizing engine), so each CPU's frames carry 1, 2, 3, ... of their own."""
    out = run_gdb(
        gdb, smp_stub, "delete",  # the tracepoints GDB uploaded from the module's earlier session
        "tvariable $p_hits", "trace kgtp_test_function", "actions",
        "teval $p_hits = $p_hits + 1", "collect $cpu_id, $p_hits", "end",
        "tstart", *wait_for_hits("$tpnum", 400), "tstop",
        "python",
        "pairs = []",
        "gdb.execute('tfind start', to_string=True)",
        "while int(gdb.parse_and_eval('$trace_frame')) >= 0:",
        "    pairs.append('%d:%d' % (int(gdb.parse_and_eval('$cpu_id')), int(gdb.parse_and_eval('$p_hits'))))",
        "    gdb.execute('tfind', to_string=True)",
        "print('PAIRS', ' '.join(pairs))",
        "end",
        "monitor probes", "tfind none", "delete", "tstatus",
    )
    pairs = [tuple(map(int, pair.split(":"))) for pair in re.search(r"^PAIRS ?(.*)$", out, re.M).group(1).split()]
    assert len(pairs) >= 400, out
    by_cpu: dict[int, list[int]] = {}
    for cpu, hits in pairs:
        by_cpu.setdefault(cpu, []).append(hits)
    for cpu, counts in by_cpu.items():
        assert counts == list(range(1, len(counts) + 1)), (cpu, counts[:20], out)
    assert re.search(r"^\s*\d+\s+0x[0-9a-f]+\s+jump\s", out, re.M), out  # compiled: a jump to its detour
