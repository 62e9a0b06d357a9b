"""KGTP's watch tracepoints with real GDB: the howto's static example (`trace *&jiffies_64`, here kgtp_counter,
which the kernel's workload thread increments in kgtp_test_function), its dynamic example (another tracepoint
points `trace *1` at an address while the kernel runs, a third stops it), and the four-register limit."""

from __future__ import annotations

import re

import pytest

from kgtp_sim.machine import KernelImage
from kgtp_sim.tracing.patching.probes import decode

from ..conftest import VMLINUX, run_gdb, wait_for_hits

pytestmark = pytest.mark.gdb

IMAGE = KernelImage.load(VMLINUX)

def _call_site() -> int:
    """The `call kgtp_test_function` in the workload's loop (kgtp_bench_thread)."""
    _, low, high = IMAGE.function_bounds(IMAGE.address_of("kgtp_bench_thread"))
    target = IMAGE.address_of("kgtp_test_function")
    return next(i.address for i in decode(IMAGE.read_code(low, high - low), low) if i.branch_target == target)


CALL = _call_site()
AFTER_CALL = CALL + 5


def _values(out: str) -> list[str]:
    return re.findall(r"^\$\d+ = (.*)$", out, re.M)


def test_static_watch_as_in_kgtps_howto(gdb, fresh_stub):
    out = run_gdb(
        gdb, fresh_stub, "trace *&kgtp_counter", "actions", "teval $watch_static=1", "teval $watch_type=1",
        "teval $watch_size=4", "collect $watch_val", "collect $watch_prev_val", "collect $watch_count",
        "collect $watch_addr", "collect kgtp_counter", "collect $bt", "end",
        "tstart", *wait_for_hits(1, 3), "tstop", "tstatus",
        "tfind 0", "print $watch_val == $watch_prev_val + 1", "print $watch_val == kgtp_counter",
        "print $watch_addr == (long) &kgtp_counter", "print $watch_count", "print $pc", "bt 2",
        "tfind 1", "print $watch_val - $watch_prev_val", "tfind none", "info tracepoints")
    assert re.search(r"Collected \d+ trace frames", out) and "Trace stopped by a tstop command" in out, out
    values = _values(out)
    assert values[:4] == ["1", "1", "1", "1"], out  # kgtp_counter as collected with $bt's stack and registers
    assert re.match(r"\(void \(\*\)\(\)\) 0x[0-9a-f]+ <kgtp_test_function\+7>", values[4]), out  # after the addl
    assert re.search(r"^#0 +kgtp_test_function \(", out, re.M), out
    assert re.search(r"^#1 +0x[0-9a-f]+ in kgtp_bench_thread \(", out, re.M), out
    assert values[5] == "1", out
    assert re.search(r"tracepoint already hit \d+ time", out), out


def test_dynamic_watch_as_in_kgtps_howto(gdb, fresh_stub):
    out = run_gdb(
        gdb, fresh_stub, "trace *1", "actions", "teval $watch_static=0", "teval $watch_type=1", "teval $watch_size=4",
        "collect $watch_addr", "collect $watch_val", "collect $watch_prev_val", "collect $watch_trace_num",
        "collect $regs", "end",
        f"trace *{CALL:#x}", "actions", "teval $watch_set_addr=1", "teval $watch_size=4",
        "teval $watch_start=&kgtp_counter", "collect $watch_start", "end",
        f"trace *{AFTER_CALL:#x}", "actions", "teval $watch_stop=&kgtp_counter", "collect $watch_stop", "end",
        "tstart", *wait_for_hits(1, 3), *wait_for_hits(3, 1), "tstop", "tstatus",
        "tfind tracepoint 1", "print $watch_val == $watch_prev_val + 1", "print $watch_addr == (long) &kgtp_counter",
        "print $watch_trace_num", "print $pc",
        "tfind none", "tfind tracepoint 2", "print $watch_start", "tfind none", "tfind tracepoint 3",
        "print $watch_stop")  # each found from the first frame: CPUs interleave their frames
    # Tracepoint 3 is waited for too: with two CPUs' watches on one counter, three watch hits may all come before
    # any CPU reached the end of its call (CI once stopped with 5 frames and none of tracepoint 3).
    values = _values(out)
    assert values[:3] == ["1", "1", "2"], out
    assert re.match(r"\(void \(\*\)\(\)\) 0x[0-9a-f]+ <kgtp_test_function\+7>", values[3]), out
    assert values[4:] == ["0", "0"], out
    assert re.search(r"Collected \d+ trace frames", out), out


def test_a_fifth_watch_is_refused_at_tstart(gdb, fresh_stub):
    commands = []
    for variable in ("kgtp_counter", "jiffies", "kgtp_test_pace", "nr_modules_loaded", "nr_context_switches"):
        commands += [f"trace *&{variable}", "actions", "teval $watch_static=1", "teval $watch_size=4", "end"]
    out = run_gdb(gdb, fresh_stub, *commands, "tstart", "tstatus")
    assert "tracepoint 5: no free hardware breakpoint" in out, out
    assert "x86 has 4 debug registers, all in use (tracepoints 1, 2, 3, 4)" in out, out
    assert "Trace is running" not in out, out
