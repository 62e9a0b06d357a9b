"""KGTP's direct output, `$enable`/`$disable` and `$current` with real GDB: actions written as KGTP's howto writes
them, the printed lines read back with `monitor console` and from the stub's own output, the switching seen in
the trace frames GDB finds."""

from __future__ import annotations

import re

import pytest

from ..conftest import run_gdb, start_stub, wait_for_hits

pytestmark = pytest.mark.gdb

#: the module names kmodload_thread loads in turn (fixtures/kernel/module.c)
CATALOG = ("ext4", "e1000e", "snd_hda_intel", "kgtp", "nf_conntrack", "nvidia", "bluetooth")


def _address(out: str, number: int = 1) -> str:
    return f"{int(re.search(rf'Tracepoint {number} at (0x[0-9a-f]+)', out).group(1), 16):016x}"


def test_printk_level_makes_collect_print_on_the_console(gdb):
    """KGTP's howto example on load_module: every collect prints, nothing is recorded."""
    server = start_stub("-v")
    try:
        out = run_gdb(gdb, server, "tvariable $c", "trace load_module", "actions", "teval $printk_level=0",
                      "collect $c=$c+1, ((struct task_struct *)$current_task)->pid", "collect $printk_tmp=jiffies",
                      "teval $printk_format=4", "collect *name@8", "end",
                      "tstart", *wait_for_hits(1, 2), "tstop", "tstatus", "monitor console", "output tasks")
    finally:
        server.stop()
    at = _address(out)
    assert "Collected 0 trace frames" in out, out
    pid = re.search(r'pid = (\d+), comm = "kmodload', out).group(1)
    lines = re.findall(rf"^<0>CPU0 gtp 1 {at}:(.*)$", out, re.M)
    assert len(lines) >= 8, out
    for n, hit in enumerate(zip(*[iter(lines)] * 4), 1):
        count, task, jiffies, name = hit
        assert count == f"$c=$c+1={n}" and task == f"((struct task_struct *)$current_task)->pid={pid}", out
        assert re.fullmatch(r"\$printk_tmp=jiffies=\d+", jiffies) and int(jiffies.rsplit("=", 1)[1]) > 0, out
        assert name.startswith("*name@8=") and name[8:] in [m[:8] for m in CATALOG], out
    log = "".join(server.output)
    assert f"console: <0>CPU0 gtp 1 {at}:$c=$c+1=1\n" in log and f"console: <0>CPU0 gtp 1 {at}:$c=$c+1=2\n" in log


def test_printing_and_recording_collects_in_one_tracepoint(gdb, fresh_stub):
    """Collects at level 8 record; at level 6 they print; the registers GDB adds for the printed ones go with
    them only when nothing recorded needs them (here `taints` does: they are recorded)."""
    out = run_gdb(gdb, fresh_stub, "tvariable $c", "trace load_module", "actions", "collect taints",
                  "teval $printk_level=6", "teval $printk_format=3", "collect *(unsigned char *)name",
                  "collect $printk_tmp=(long)taints", "teval $printk_level=8", "collect $c=taints+1", "end",
                  "tstart", *wait_for_hits(1, 2), "tstop", "tstatus", "tfind 0", "print taints",
                  "print $c == taints + 1", "print $printk_tmp", "monitor console")
    at = _address(out)
    frames = int(re.search(r"Collected (\d+) trace frames", out).group(1))
    printed = re.findall(rf"^<6>CPU0 gtp 1 {at}:\*\(unsigned char \*\)name=0x([0-9a-f]+)$", out, re.M)
    assert frames >= 2 and len(printed) == frames, out  # one frame per hit, one line per hit
    assert {chr(int(c, 16)) for c in printed} <= {m[0] for m in CATALOG}, out
    taints = re.findall(rf"^<6>CPU0 gtp 1 {at}:\$printk_tmp=\(long\)taints=0x([0-9a-f]+)$", out, re.M)
    assert len(taints) == frames, out
    values = re.findall(r"^\$\d+ = (.*)$", out, re.M)
    assert values[0] == str(int(taints[0], 16)) and values[1] == "1", out  # recorded
    assert values[2] in ("void", "<unavailable>"), out  # printed, not recorded: GDB has no value for it


def test_enable_and_disable_from_actions_switch_a_compiled_tracepoint(gdb, fresh_stub):
    """Tracepoint 2 (the timer) disables tracepoint 1 at once; tracepoint 3 (a later module load) enables it
    again. Tracepoint 1 is compiled (a jump to its detour) and never hits in between: the first frame it
    records after tracepoint 2's is from after the re-enable ($n == 2), and $off, counting its hits at $n == 1,
    stays 0."""
    out = run_gdb(gdb, fresh_stub, "tvariable $n", "tvariable $off", "trace kgtp_test_function", "actions",
                  "collect $n", "teval $off = $off + ($n == 1)", "end",
                  "trace timer_interrupt if $n == 0", "actions", "teval $n = 1, $disable = 1", "collect $n", "end",
                  "trace load_module if $n == 1", "actions", "teval $n = 2, $enable = 1", "collect $n", "end",
                  "tstart", "monitor probes", *wait_for_hits(3, 1), *wait_for_hits(1, 5, more=True), "tstop",
                  "print $off", "tfind tracepoint 2", "print $n", "tfind tracepoint 1", "print $n",
                  "monitor probes")
    rows = re.findall(r"^\s+1\s+0x[0-9a-f]+\s+(\w+)\s+(\w+)", out, re.M)
    assert rows and all(kind == "jump" for kind, _ in rows), out  # compiled, before and after the switch
    values = re.findall(r"^\$\d+ = (.*)$", out, re.M)
    assert values[:3] == ["0", "1", "2"], out
    found = [(int(n), int(tp)) for n, tp in re.findall(r"Found trace frame (\d+), tracepoint (\d)", out)]
    assert [tp for _, tp in found] == [2, 1] and found[0][0] < found[1][0], out


def test_current_records_the_interrupted_contexts_registers(gdb, fresh_stub):
    """At the timer interrupt, `$current = (unsigned long)regs` makes the registers tracepoint 1 records those of
    the context the interrupt stopped; tracepoint 2 at the same hit records that struct pt_regs itself. (GDB
    cannot compile the assignment of a pointer variable to a trace state variable without the cast; KGTP's howto
    writes it so.)"""
    out = run_gdb(gdb, fresh_stub, "trace timer_interrupt", "actions", "teval $current = (unsigned long)regs",
                  "collect $regs",
                  "end", "trace timer_interrupt", "actions", "collect *regs", "end",
                  "tstart", *wait_for_hits(2, 3), "tstop",
                  "tfind tracepoint 1", "print/x $pc", "print/x $sp", "print/x $rbx", "print/x $eflags",
                  "tfind tracepoint 2", "print/x regs->ip", "print/x regs->sp", "print/x regs->bx",
                  "print/x regs->flags", "print $pc == timer_interrupt")
    values = re.findall(r"^\$\d+ = (.*)$", out, re.M)
    assert len(values) == 9 and values[:4] == values[4:8], out  # the context's pc, sp, rbx, eflags
    assert values[8] == "1", out  # tracepoint 2's own registers are the hit's
    assert int(values[3], 16) & 0x200, out  # interrupts were on where the timer stopped it


def test_a_reconnecting_gdb_is_told_what_disable_switched_off(gdb, fresh_stub):
    """As KGTP reports its tracepoints' state in the upload (qTfP), a GDB attaching later sees tracepoint 1
    disabled by tracepoint 2's action; the GDB that defined it still shows its own view."""
    first = run_gdb(gdb, fresh_stub, "trace kgtp_test_function", "trace timer_interrupt", "actions",
                    "teval $disable = 1", "end", "tstart", *wait_for_hits(2, 1), "info tracepoints")
    later = run_gdb(gdb, fresh_stub, "info tracepoints")
    assert re.search(r"^1\s+tracepoint\s+keep\s+y\s", first, re.M), first  # GDB's own view
    numbers = {int(target): gdb_number for gdb_number, target in
               re.findall(r"Created tracepoint (\d+) for target's tracepoint (\d+)", later)}
    assert re.search(rf"^{numbers[1]}\s+tracepoint\s+keep\s+n\s+0x[0-9a-f]+ in kgtp_test_function", later, re.M), later
    assert re.search(rf"^{numbers[2]}\s+tracepoint\s+keep\s+y\s+0x[0-9a-f]+ in timer_interrupt", later, re.M), later


@pytest.mark.parametrize("engine", ["interp", "naive", "opt"])
def test_an_expression_over_a_register_prints_its_value(gdb, engine):
    """The issue's example: `collect counter1+0` of kgtp_test_function's register argument traces nothing (GDB
    computes it from the `R` registers and pops it); at level 0 its value prints at each hit, and the registers go
    with it: nothing is recorded. Each line's value is the call's counter1, which kmodload's caller counts up by
    one a call on each CPU."""
    server = start_stub("--engine", engine)
    try:
        out = run_gdb(gdb, server, "trace kgtp_test_function", "actions", "teval $printk_level = 0",
                      "collect counter1+0", "end", "tstart", *wait_for_hits(1, 3), "tstop", "tstatus",
                      "monitor console")
    finally:
        server.stop()
    at = _address(out)
    assert "Collected 0 trace frames" in out, out
    lines = re.findall(rf"^<0>CPU(\d+) gtp 1 {at}:counter1\+0=(\d+)$", out, re.M)
    assert len(lines) >= 3, out
    for cpu in {cpu for cpu, _ in lines}:  # each CPU's caller counts its own calls: consecutive values
        values = [int(value) for c, value in lines if c == cpu]
        assert all(b == a + 1 for a, b in zip(values, values[1:])), out
