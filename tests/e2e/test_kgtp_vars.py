"""KGTP's special trace state variables with real GDB: uploaded at connect by KGTP's names and numbers, read in
conditions and collections, checked against what the kernel really had (its task table and stacks, read with
GDB's own DWARF view of the kernel), and against each other."""

from __future__ import annotations

import re

import pytest

from kgtp_sim.tracing.core.builtins import BUILTIN_VARIABLES, GTP_VERSION

from ..conftest import run_gdb, start_stub, wait_for_hits, wait_for_trace_stop

pytestmark = pytest.mark.gdb


def _values(out: str) -> list[str]:
    return re.findall(r"^\$\d+ = (.*)$", out, re.M)


def test_gdb_creates_every_special_variable_at_connect(gdb, fresh_stub):
    out = run_gdb(gdb, None, "set verbose on", f"target remote {fresh_stub.address}", "info tvariables",
                  attach=False)
    created = dict((int(n), name) for name, n in re.findall(
        r"Created trace state variable \$(\w+) for target's variable (\d+)\.", out))
    assert created == {b.number: b.name for b in BUILTIN_VARIABLES}, out
    assert re.search(rf"^\$gtp_version\s+{GTP_VERSION}\s+{GTP_VERSION}\s*$", out, re.M), out
    assert re.search(r"^\$bt\s+512\s+512\s*$", out, re.M), out  # KGTP's default
    assert re.search(r"^\$cpu_number\s+2\s+2\s*$", out, re.M), out  # serve's default: two CPUs
    assert re.search(r"^\$printk_level\s+8\s", out, re.M), out
    assert re.search(r"^\$current_task\s+0\s+<undefined>", out, re.M), out  # only a tracepoint can read it


def test_task_variables_match_the_kernel(gdb, fresh_stub):
    out = run_gdb(
        gdb, fresh_stub, "trace kgtp_test_function if $cpu_id == 0 && $current_task_pid == 1", "actions",
        "collect $current_task, $current_task_pid, $current_thread_info, $task_pt_regs, $current_task_user",
        "collect *(struct task_struct *)$current_task",
        "collect $clock, $rdtsc, $cpu_number, $gtp_version, $hardirq_count, $softirq_count, $xtime_sec", "end",
        "tstart", *wait_for_hits(1, 3), "tstop", "tfind 0",
        "print ((struct task_struct *)$current_task)->pid == $current_task_pid",
        "print ((struct task_struct *)$current_task)->comm",
        "print $current_thread_info == (unsigned long)thread_stacks[1]",
        "print $task_pt_regs == (unsigned long)thread_stacks[2] - sizeof(struct pt_regs)",
        "print $current_task_user", "print $cpu_number", "print $gtp_version", "print $hardirq_count",
        "print $softirq_count", "print $xtime_sec > 1700000000", "print $clock > 0",
        "set $c0 = $clock", "tfind 1", "print $clock > $c0",
    )
    values = _values(out)
    assert values[:2] == ["1", '"kgtp_bench\\000\\000\\000\\000\\000"'], out
    assert values[2:] == ["1", "1", "0", "2", str(GTP_VERSION), "0", "0", "1", "1", "1"], out  # two CPUs


def test_hardirq_count_inside_the_timer_interrupt(gdb, fresh_stub):
    out = run_gdb(gdb, fresh_stub, "trace timer_interrupt", "actions", "collect $hardirq_count, $irq_count", "end",
                  "trace kgtp_test_function", "actions", "collect $hardirq_count", "end",
                  "tstart", *wait_for_hits(1, 2), *wait_for_hits(2, 2), "tstop",
                  "tfind tracepoint 1", "print $hardirq_count", "print $irq_count",
                  "tfind none", "tfind tracepoint 2", "print $hardirq_count")
    assert _values(out) == ["65536", "65536", "0"], out  # one hard interrupt being handled, as hardirq_count()


def test_cooked_clock_leaves_out_the_time_tracing_took(gdb, fresh_stub):
    out = run_gdb(gdb, fresh_stub, "trace kgtp_test_function", "actions", "collect $clock, $cooked_clock", "end",
                  "tstart", *wait_for_hits(1, 5), "tstop", "tfind 0", "print $clock - $cooked_clock",
                  "tfind 4", "print $clock - $cooked_clock")
    first, later = (int(v) for v in _values(out))
    assert 0 <= first < later, out  # four handlers' time taken off by the fifth hit


def test_step_count_and_step_id_in_while_stepping_frames(gdb, fresh_stub):
    out = run_gdb(gdb, fresh_stub, "trace load_module", "passcount 1", "actions", "collect $step_count, $step_id",
                  "while-stepping 3", "collect $step_count, $step_id", "end", "end",
                  "tstart", *wait_for_trace_stop(), "tstatus",
                  *[c for n in range(4) for c in (f"tfind {n}", "print $step_count", "print $step_id")])
    assert "Collected 4 trace frames" in out, out  # the pass-count hit's steps are recorded before the stop
    assert _values(out) == ["0", "1", "1", "1", "2", "1", "3", "1"], out


def test_bt_records_the_registers_and_512_bytes_of_stack(gdb, fresh_stub):
    out = run_gdb(gdb, fresh_stub, "trace load_module", "actions", "collect $bt", "end",
                  "tstart", *wait_for_hits(1), "tstop", "tfind 0", "bt 3", "x/1gx $sp+504", "x/1gx $sp+512")
    assert re.search(r"^#1\s+0x[0-9a-f]+ in kmodload_thread", out, re.M), out  # registers + stack: GDB unwinds
    assert re.search(r"^0x[0-9a-f]+ <[^>]+>:\s+0x[0-9a-f]+$", out, re.M), out  # the last recorded word
    assert re.search(r"^0x[0-9a-f]+ <[^>]+>:\s+<unavailable>$", out, re.M), out  # and nothing past $bt bytes


def test_dump_stack_prints_the_hits_backtrace():
    server = start_stub("-v")
    try:
        from kgtp_sim.client import GDB_CLIENTS

        out = run_gdb(GDB_CLIENTS[0], server, "trace load_module", "actions", "collect $dump_stack", "end",
                      "tstart", *wait_for_hits(1), "tstop")
    finally:
        server.stop()
    log = "".join(server.output)
    # on the kernel's console, as KGTP's printk and Linux's dump_stack() print it
    assert re.search(r"console: CPU0 gtp 1 ffffffff[0-9a-f]{8}:CPU: 0 PID: \d+ Comm: kmodload Not tainted", log), \
        log + out
    assert re.search(r"console:  \[<ffffffff[0-9a-f]+>\] load_module\+0x0/0x", log) and "kmodload_thread+" in log, log


@pytest.mark.parametrize("action, text", [
    ("teval $clock = 1", "variable clock cannot be set by a tracepoint"),  # GDB cannot receive '$' in a reply
    ("collect $last_errno", "variable last_errno cannot be read by a tracepoint"),
])
def test_what_kgtp_refuses_fails_tstart_with_its_reason(gdb, fresh_stub, action, text):
    out = run_gdb(gdb, fresh_stub, "trace kgtp_test_function", "actions", action, "end", "tstart", "tstatus")
    assert text in out and "Trace is running" not in out, out
