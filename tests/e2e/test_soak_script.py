"""The soak tool (scripts/soak): a short run proves it works end to end, and its verdicts are checked on
made-up samples, frames and GDB/MI records, so a broken invariant is known to be reported.

The full ten-minute soak is not part of the suite; its figures are in docs/soak/.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from kgtp_sim.client import GDB_CLIENTS, ROOT, SCRIPTS, parse_cstring, parse_results
from kgtp_sim.tools import soak
from kgtp_sim.tools.soak import Check, FrameRecord, Limits, Sample

SIZE = 0x20000


def steady_samples(count: int = 12, step_s: float = 10.0) -> list[Sample]:
    """What a healthy run looks like: wrapped from the start, about 400 frames kept, everything growing."""
    return [Sample(elapsed_s=i * step_s, rss_kib=54_000, hwm_kib=55_000, running=True, stop_reason="tnotrun",
                   frames=400 + (i % 3), created=1000 + 100_000 * i, free=SIZE - 400 * 320 - 8 * (i % 3),
                   size=SIZE, jiffies=50 + 1000 * i, instructions=10**6 * i)
            for i in range(count)]


def verdicts(samples: list[Sample]) -> dict[str, bool]:
    return {check.name.split(" (")[0]: check.passed for check in soak.check_samples(samples, SIZE)}


def failed(samples: list[Sample]) -> set[str]:
    return {name for name, passed in verdicts(samples).items() if not passed}


def test_a_healthy_run_passes_every_sample_check():
    assert failed(steady_samples()) == set()


def test_decreasing_tcreated_is_detected():
    samples = steady_samples()
    samples[7] = dataclasses.replace(samples[7], created=samples[6].created - 1)
    assert "tcreated never decreases" in failed(samples)


def test_a_stalled_run_and_a_frozen_kernel_are_detected():
    samples = steady_samples()
    for i in range(8, 12):
        samples[i] = dataclasses.replace(samples[i], created=samples[7].created, jiffies=samples[7].jiffies)
    assert {"tracepoints keep firing", "kernel keeps running"} <= failed(samples)


def test_frames_beyond_created_and_impossible_accounting_are_detected():
    samples = steady_samples()
    samples[3] = dataclasses.replace(samples[3], frames=2**64 - 5)  # an underflowed frame counter
    samples[5] = dataclasses.replace(samples[5], free=samples[5].free + 1)  # not whole 8-byte entries
    samples[6] = dataclasses.replace(samples[6], free=SIZE + 8)
    samples[9] = dataclasses.replace(samples[9], size=SIZE // 2)
    assert {"tframes <= tcreated", "buffer accounting"} <= failed(samples)
    for index in (5, 6, 9):
        only = steady_samples()
        only[index] = samples[index]
        assert failed(only) == {"buffer accounting"}, index


def test_a_stopped_run_and_an_unreadable_status_are_detected():
    samples = steady_samples()
    samples[4] = dataclasses.replace(samples[4], running=False, stop_reason="tfull")
    samples[10] = Sample(elapsed_s=100.0, rss_kib=54_000, hwm_kib=55_000, status_error="qTStatus answered 'E0f'")
    assert {"run never stops", "qTStatus answers"} <= failed(samples)


def test_frame_count_swinging_after_the_wrap_is_detected():
    samples = steady_samples()
    samples[6] = dataclasses.replace(samples[6], frames=20, free=SIZE - 20 * 320)
    assert failed(samples) == {"tframes steady once wrapped"}


def test_rss_growth_fails_the_memory_checks_and_flat_rss_passes():
    flat = steady_samples(60)
    leaking = [dataclasses.replace(s, rss_kib=54_000 + int(s.elapsed_s * 30)) for s in flat]  # 1.76 MiB/min
    for samples, expected in ((flat, True), (leaking, False)):
        figures = soak.memory_figures(samples, duration_s=600, warmup_s=30)
        assert all(c.passed == expected for c in soak.check_memory(figures)), figures
    figures = soak.memory_figures(leaking, duration_s=600, warmup_s=30)
    assert figures.slope_mib_per_min == pytest.approx(30 * 60 / 1024, rel=1e-6)
    assert figures.rss_start_mib == pytest.approx((54_000 + 30 * 30) / 1024)


def kgtp_frame(number: int, counter1: int, counter: int, expression: int | None = None, cpu: int = 0) -> FrameRecord:
    counter2 = counter1 - 1
    value = 2 * counter1 + 3 * counter2 if expression is None else expression
    return FrameRecord(number, 1, 0, {"$rdi": str(counter1), "$rsi": str(counter2), "kgtp_counter": str(counter),
                                      "(2*counter1+3*counter2)": str(value)}, cpu)


def test_frame_values_are_consecutive_per_cpu():
    """Two CPUs' loops interleave: each CPU's counter1 steps by one, the shared kgtp_counter by the calls of both."""
    specs = soak.tracepoint_specs(0xFFFFFFFF8100091C)
    both = [kgtp_frame(n, 100 + n // 2 if n % 2 == 0 else 7 + n // 2, 500 + n, cpu=n % 2) for n in range(8)]
    assert soak.check_frame_values(both, specs, final_jiffies=None) == []
    lost = both[:4] + [kgtp_frame(4, 103, 504)] + both[5:]  # CPU 0 skipped a call
    assert "counter1 stepped 2" in soak.check_frame_values(lost, specs, None)[0]


def test_frame_values_catch_a_lost_or_repeated_call_and_a_wrong_expression():
    specs = soak.tracepoint_specs(0xFFFFFFFF8100091C)
    good = [kgtp_frame(n, 100 + n, 500 + n) for n in range(5)]
    assert soak.check_frame_values(good, specs, final_jiffies=None) == []
    doubled = good[:3] + [kgtp_frame(3, 103, 504)]  # kgtp_counter++ counted twice for one call
    assert "kgtp_counter 2" in soak.check_frame_values(doubled, specs, None)[0]
    wrong = good[:2] + [kgtp_frame(2, 102, 502, expression=7)]
    assert "collected expression 7" in soak.check_frame_values(wrong, specs, None)[0]
    schedule = [FrameRecord(0, 2, 0, {"jiffies": "90"}), FrameRecord(1, 2, 0, {"jiffies": "89"})]
    assert "went back" in soak.check_frame_values(schedule, specs, None)[0]
    syscall = [FrameRecord(0, 3, 0, {"regs->orig_ax": "39", "regs->vector": "14"})]
    assert soak.check_frame_values(syscall, specs, None)


def test_sequence_check_wants_consecutive_numbers_ending_at_tcreated():
    rows = [(n, 1, float(n), 1000 + n) for n in range(10)]
    assert soak.check_sequence(rows, frames=10, created=1010) == []
    assert soak.check_sequence(rows[:5] + rows[6:], frames=10, created=1010)  # a frame missing in the middle
    assert soak.check_sequence(rows, frames=10, created=1011)  # the newest frame is not the last created


def test_sequence_check_follows_each_cpu():
    # CPU 0 made 1000 frames before these, CPU 1 made 20: their sequences interleave in timestamp order
    rows = [(n, 1, float(n), 1000 + n // 2 if n % 2 == 0 else 20 + n // 2) for n in range(10)]
    cpu_of = {n: n % 2 for n in range(10)}
    assert soak.check_sequence(rows, frames=10, created=1005 + 25, cpu_of=cpu_of) == []
    assert soak.check_sequence(rows, frames=10, created=1005 + 25)  # read as one CPU's: not consecutive
    gap = rows[:4] + rows[6:]  # CPU 0 lost a frame in the middle (and so did CPU 1)
    assert soak.check_sequence(gap, frames=8, created=1030, cpu_of=cpu_of)
    back = rows[:3] + [(3, 1, 1.5, rows[3][3])] + rows[4:]
    assert "goes back" in " ".join(soak.check_sequence(back, frames=10, created=1030, cpu_of=cpu_of))


def test_gdb_mi_records_parse_including_tracepoint_scripts():
    line = (',BreakpointTable={nr_rows="1",body=[bkpt={number="1",type="tracepoint",addr="0xffffffff81001090",'
            'script={"collect $regs","collect (2*counter1+3*counter2)"},thread-groups=["i1"]}]}')
    table = parse_results(line)["BreakpointTable"]
    point = table["body"][0]["bkpt"]
    assert point["addr"] == "0xffffffff81001090" and point["script"][1] == "collect (2*counter1+3*counter2)"
    assert parse_cstring(r'"Found \"x\"\n\101"') == 'Found "x"\nA'


def test_the_script_runs_the_tool():
    script = SCRIPTS / "soak"
    assert os.access(script, os.X_OK)
    assert "-m kgtp_sim.tools.soak" in script.read_text()


@pytest.mark.gdb
@pytest.mark.slow
@pytest.mark.skipif(not GDB_CLIENTS, reason="needs gdb")
def test_a_short_soak_passes_every_invariant(tmp_path):
    """Fifteen seconds of the real thing with the interpreting engine, the one with the most Python per hit (the
    compiled engines' runs are in docs/soak/). On failure the report ends with the stub's log and, if the stub
    stopped answering, every thread's stack."""
    figures = tmp_path / "soak.json"
    command = [sys.executable, "-m", "kgtp_sim.tools.soak", "--seconds", "15", "--sample-seconds", "2",
               "--engine", "interp", "--rss-slope-limit", "60", "--gdb", GDB_CLIENTS[0].path, "--json", str(figures),
               "--cpus", "2"]  # a kgtp_bench/N on each CPU, per-CPU rings: values and sequences checked per CPU
    # above the tool's own limits (stub start, GDB/MI, GDB batch), so a hang is reported by the tool, with its log
    result = subprocess.run(command, capture_output=True, text=True, timeout=420, cwd=ROOT)
    assert figures.exists(), result.stdout + result.stderr
    data = json.loads(figures.read_text())
    failures = [c for c in data["checks"] if not c["passed"]]
    assert result.returncode == 0 and not failures, result.stdout + result.stderr
    assert len(data["samples"]) >= 7 and data["throughput"]["wraps"] > 10
    assert data["final"]["frames_walked"] == int(data["final"]["status_after_stop"]["frames"]) > 0
    assert "PASS  tfind walks exactly tframes frames" in result.stdout
    assert data["config"]["cpus"] == 2 and "FAIL" not in result.stdout


def test_check_names_are_unique():
    names = [c.name for c in soak.check_samples(steady_samples(), SIZE, Limits())]
    assert len(names) == len(set(names)) and all(isinstance(c, Check) for c in soak.check_samples([], SIZE))
