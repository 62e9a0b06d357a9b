"""Dynamic tracepoints end to end with real GDB, adapted from GDB's gdb.trace scenarios, with the kernel's
workload (kgtp_test_function called from a kernel thread) in place of `continue`.

Values are checked against each other and against what the kernel really had (registers collected in the same
frame, the kernel's own counters), never against numbers written into the test.
"""

from __future__ import annotations

import re

import pytest

from ..conftest import run_gdb, wait_for_hits, wait_for_trace_stop

pytestmark = pytest.mark.gdb

COND = "(2*counter1+3*counter2>0)"
EXPR = "(2*counter1+3*counter2)"


def _frames_collected(out: str) -> int:
    match = re.search(r"Collected (\d+) trace frames?", out)
    assert match, out
    return int(match.group(1))


def test_condition_and_collections_match_the_kernel(gdb, one_cpu_stub):
    out = run_gdb(
        gdb, one_cpu_stub, "monitor pace 20",  # native collection is fast: keep 0.3 s of frames under 1 MiB
        f"trace kgtp_test_function if {COND}", "actions", f"collect {EXPR}", "collect $regs", "collect kgtp_counter",
        "end", "tstart", *wait_for_hits(1, 11), "tstop", "tstatus",
        "tfind start", "tdump", "print $rdi", "print $rsi", "print kgtp_counter",
        "tfind", "print $rdi", "print kgtp_counter",
    )
    assert _frames_collected(out) > 10, out
    assert "Trace stopped by a tstop command" in out
    expr = [int(v) for v in re.findall(rf"^{re.escape(EXPR)} = (-?\d+)$", out, re.M)]
    values = [int(v) for v in re.findall(r"^\$\d+ = (-?\d+)$", out, re.M)]
    rdi, rsi, counter, rdi2, counter2 = values
    assert expr[0] == 2 * rdi + 3 * rsi, out  # the expression was evaluated on the registers of that hit
    assert rdi2 == rdi + 1 and counter2 == counter + 1  # consecutive calls, consecutive frames
    assert re.search(r"^rip\s+0x[0-9a-f]+\s+0x[0-9a-f]+ <kgtp_test_function>", out, re.M), out


def test_false_condition_collects_nothing(gdb, fresh_stub):
    out = run_gdb(gdb, fresh_stub, "trace kgtp_test_function if (2*counter1+3*counter2<0)", "actions",
                  f"collect {EXPR}", "end", "tstart", "shell sleep 0.2", "tstop", "tstatus", "info tracepoints",
                  "monitor probes")
    assert _frames_collected(out) == 0, out
    assert "already hit" not in out, out  # hits count true conditions, as gdbserver counts them
    fired = re.search(r"^\s*1\s+0x[0-9a-f]+\s+\w+\s+\w+\s+fired (\d+)", out, re.M)
    assert fired and int(fired.group(1)) > 10, out  # the probe did fire; the condition said no


def test_passcount_stops_the_run(gdb, fresh_stub):
    out = run_gdb(gdb, fresh_stub, "trace kgtp_test_function", "passcount 5", "actions", "collect counter1", "end",
                  "tstart", *wait_for_trace_stop(), "tstatus")
    assert "Trace stopped by tracepoint 1." in out, out
    assert _frames_collected(out) == 5, out


def test_full_buffer_stops_with_tfull(gdb, fresh_stub):
    out = run_gdb(gdb, fresh_stub, "set trace-buffer-size 8192", "trace kgtp_test_function", "actions", "collect $regs",
                  "end", "tstart", *wait_for_trace_stop(), "tstatus")
    assert "Trace stopped because the buffer was full" in out, out
    frames = _frames_collected(out)
    # each CPU has an 8192-byte ring and the run stops when one fills: every CPU's frames together fit the whole
    # buffer (CPUs times 8192, as tstatus sums it), a $regs frame taking over 300 bytes
    total = int(re.search(r"Trace buffer has \d+ bytes of (\d+) bytes free", out).group(1))
    assert total % 8192 == 0 and 0 < frames < total // 300, out


def test_circular_buffer_keeps_the_newest_frames(gdb, one_cpu_stub):
    fresh_stub = one_cpu_stub  # one ring, one workload thread: the frames kept are consecutive calls
    out = run_gdb(gdb, fresh_stub, "set trace-buffer-size 8192", "set circular-trace-buffer on",
                  "trace kgtp_test_function", "actions", "collect $regs", "end", "tstart", *wait_for_hits(1, 100),
                  "tstop", "tstatus")
    match = re.search(r"Buffer contains (\d+) trace frames \(of (\d+) created total\)", out)
    assert match, out
    kept, created = int(match.group(1)), int(match.group(2))
    assert 0 < kept < created and kept < 8192 // 200, out
    # a second GDB finds the stopped run's frames on the target
    out = run_gdb(gdb, fresh_stub, "tfind 0", "print $rdi", f"tfind {kept - 1}", "print $rdi", "tfind none")
    first, last = (int(v) for v in re.findall(r"^\$\d+ = (\d+)$", out, re.M))
    assert last - first == kept - 1, out  # a contiguous run of consecutive calls survived


def test_tfind_forms(gdb, fresh_stub):
    out = run_gdb(
        gdb, fresh_stub, "monitor pace 5",  # load_module runs every 50 ticks: keep the buffer from filling first
        "trace kgtp_test_function", "actions", "collect $regs", "end",
        "trace load_module", "actions", "collect $regs", "end",
        "tstart", *wait_for_hits(2), *wait_for_hits(1, more=True), "tstop",  # a tp 1 frame after a tp 2 one
        # searches other than by number start after the selected frame
        "tfind tracepoint 2", "print $pc", "tfind pc kgtp_test_function", "print $pc",
        "tfind none", "tfind outside kgtp_test_function, kgtp_test_function + 4", "print $pc",
        "tfind none", "tfind range kgtp_test_function, kgtp_test_function + 4", "print $pc",
        "tfind none", "tfind 0", "tfind end",
    )
    assert re.search(r"Found trace frame \d+, tracepoint 2", out), out
    pcs = re.findall(r"^\$\d+ = \(void \(\*\)\([^)]*\)\) 0x[0-9a-f]+ <(\w+)>", out, re.M)
    assert pcs == ["load_module", "kgtp_test_function", "load_module", "kgtp_test_function"], out
    assert "No longer looking at any trace frame" in out and "Found trace frame 0," in out


def test_tsave_then_target_tfile_shows_the_same_frames(gdb, fresh_stub, tmp_path):
    saved = tmp_path / "trace.tf"
    live = run_gdb(gdb, fresh_stub, f"trace kgtp_test_function if {COND}", "actions", f"collect {EXPR}",
                   "collect $regs", "end", "tstart", *wait_for_hits(1, 4), "tstop", "tfind 3", "tdump",
                   f"tsave {saved}")
    assert saved.exists(), live
    offline = run_gdb(gdb, fresh_stub, f"target tfile {saved}", "tfind 3", "tdump", attach=False)
    def dump(text):
        return re.findall(r"^(\(2\*counter1.*|r[a-z0-9]+ +0x\S+.*)$", text, re.M)
    assert dump(live) and dump(live) == dump(offline), offline


@pytest.mark.parametrize("engine", ["interp", "naive", "opt"])
def test_compact_frames_read_back_the_same_live_from_tfile_and_ctf(gdb, engine, tmp_path):
    """`collect (2*counter1+3*counter2)` records rdi, rsi (and rip) only: live, GDB sees the other registers
    unavailable; `tsave` + `target tfile` and `tsave -ctf` + `target ctf` read the same expression values."""
    from ..conftest import start_stub

    server = start_stub("--engine", engine)
    saved, ctf = tmp_path / "trace.tf", tmp_path / "ctf"
    frames = ("tfind 0", "tdump", "tfind 3", "tdump")
    try:
        live = run_gdb(gdb, server, f"trace kgtp_test_function if {COND}", "actions", f"collect {EXPR}", "end",
                       "tstart", *wait_for_hits(1, 4), "tstop", *frames, "info registers rax rdi rip",
                       f"tsave {saved}", f"tsave -ctf {ctf}")
    finally:
        server.stop()
    values = re.findall(rf"^{re.escape(EXPR)} = (-?\d+)$", live, re.M)
    assert len(values) == 2 and values[0] != values[1], live
    assert re.search(r"^rax\s+<unavailable>", live, re.M), live
    assert re.search(r"^rdi\s+0x[0-9a-f]+\s+\d+", live, re.M), live
    assert re.search(r"^rip\s+0x[0-9a-f]+\s+0x[0-9a-f]+ <kgtp_test_function", live, re.M), live
    offline = run_gdb(gdb, None, f"target tfile {saved}", *frames, attach=False)
    assert re.findall(rf"^{re.escape(EXPR)} = (-?\d+)$", offline, re.M) == values, offline
    if "unknown option `-ctf'" not in live:  # a GDB built without CTF support cannot write or read it
        offline = run_gdb(gdb, None, f"target ctf {ctf}", *frames, attach=False)
        assert re.findall(rf"^{re.escape(EXPR)} = (-?\d+)$", offline, re.M) == values, offline


def test_bad_tracepoint_location_fails_tstart_with_a_message(gdb, fresh_stub):
    out = run_gdb(gdb, fresh_stub, "trace *(kgtp_test_function+1)", "tstart", "tstatus")
    assert "middle of an instruction" in out, out


def test_trace_state_variables_and_teval(gdb, fresh_stub):
    out = run_gdb(gdb, fresh_stub, "tvariable $hits = 10", "trace kgtp_test_function", "passcount 7", "actions",
                  "teval $hits = $hits + 1", "collect $hits", "end", "tstart", *wait_for_trace_stop(),
                  "tstatus", "tfind 6", "tdump", "tfind none", "info tvariables")
    assert "$hits = 17" in out, out


def test_division_by_zero_in_condition_stops_with_an_error(gdb, fresh_stub):
    out = run_gdb(gdb, fresh_stub, "trace kgtp_test_function if (counter1 / (counter2 - counter2)) > 0", "tstart",
                  *wait_for_trace_stop(), "tstatus")
    assert re.search(r"Trace stopped by an error \(.*division by zero", out), out


def test_ignore_error_keeps_tracing(gdb, fresh_stub):
    # KGTP's $ignore_error: tstart leaves out a tracepoint it cannot install and records why in $last_errno
    out = run_gdb(gdb, fresh_stub, "tvariable $ignore_error = 1", "trace *(kgtp_test_function+1)",
                  "trace kgtp_test_function", "tstart", *wait_for_hits(2, 3), "tstatus", "print $last_errno",
                  "tstop", "tvariable $ignore_error = 0")
    assert "Trace is running on the target" in out, out
    assert re.search(r"^\$\d+ = -22$", out, re.M), out  # -EINVAL


def test_disconnect_stops_tracing_unless_asked_otherwise(gdb, fresh_stub):
    run_gdb(gdb, fresh_stub, "trace kgtp_test_function", "tstart", "shell sleep 0.1")  # leaves without tstop
    out = run_gdb(gdb, fresh_stub, "tstatus")
    assert "Trace stopped because of disconnection" in out, out
    run_gdb(gdb, fresh_stub, "set disconnected-tracing on", "trace kgtp_test_function", "tstart")
    out = run_gdb(gdb, fresh_stub, "tstatus", "info tracepoints", "tstop")
    assert "Trace is running on the target" in out, out
    assert "kgtp_test_function" in out  # the reconnecting GDB learned the tracepoint from the target


def test_enable_disable_and_install_during_a_run(gdb, fresh_stub):
    out = run_gdb(
        gdb, fresh_stub, "monitor pace 5", "trace kgtp_test_function", "actions", "collect counter1", "end",
        "tstart", *wait_for_hits(1), "disable 1", "tstatus", "shell sleep 0.2", "tstatus",
        "trace load_module", "actions", "collect $regs", "end", *wait_for_hits(2),
        "enable 1", *wait_for_hits(1, more=True), "tstop", "tstatus", "info tracepoints",
    )
    counts = [int(n) for n in re.findall(r"Collected (\d+) trace frames", out)]
    assert len(counts) == 3 and 0 < counts[0] <= counts[1] <= counts[0] + 2, out  # nothing while disabled
    hits = [int(n) for n in re.findall(r"tracepoint already hit (\d+) times?", out)]
    assert len(hits) == 2 and hits[0] > counts[1] and hits[1] > 0, out  # re-enabled, and the new one fired


@pytest.mark.parametrize("engine", ["interp", "naive", "opt"])
def test_each_engine_through_gdb(gdb, engine):
    from ..conftest import start_stub

    server = start_stub("--engine", engine)
    try:
        out = run_gdb(gdb, server, f"trace kgtp_test_function if {COND}", "actions", f"collect {EXPR}",
                      "collect $regs", "end", "tstart", *wait_for_hits(1, 4), "tstop", "tstatus",
                      "tfind 2", "tdump", "monitor probes", "monitor engine")
    finally:
        server.stop()
    assert _frames_collected(out) > 3, out
    expr = int(re.search(rf"^{re.escape(EXPR)} = (-?\d+)$", out, re.M).group(1))
    rdi = int(re.search(r"^rdi\s+0x[0-9a-f]+\s+(\d+)$", out, re.M).group(1))
    rsi = int(re.search(r"^rsi\s+0x[0-9a-f]+\s+(\d+)$", out, re.M).group(1))
    assert expr == 2 * rdi + 3 * rsi, out
    assert f"engine {engine}" in out
    kind = re.search(r"0x[0-9a-f]+\s+(jump|int3)\s+removed", out)
    assert kind and kind.group(1) == ("int3" if engine == "interp" else "jump"), out


def test_ftrace_uses_a_jump_and_gdb_refuses_short_instructions(gdb, fresh_stub):
    # qTMinFTPILen says 5: GDB itself refuses a fast tracepoint on the 1-byte `ret`
    out = run_gdb(gdb, fresh_stub, "ftrace *(kgtp_test_function + 12)")
    assert "need at least 5 bytes for the jump" in out, out
    out = run_gdb(gdb, fresh_stub, "ftrace kgtp_test_function", "actions", "collect $regs", "end",
                  "tstart", *wait_for_hits(1), "tstop", "tstatus", "monitor probes")
    assert re.search(r"0x[0-9a-f]+\s+jump\s+removed\s+fired \d+", out), out
    assert _frames_collected(out) > 0, out


def test_while_stepping_collects_at_each_next_instruction(gdb, fresh_stub):
    out = run_gdb(gdb, fresh_stub, "monitor pace 5", "trace kgtp_test_function", "passcount 2", "actions",
                  "collect counter1", "while-stepping 2", "collect $regs", "end", "end",
                  "tstart", *wait_for_trace_stop(), "tstatus", "tfind 0", "print $pc", "tfind 1", "print $pc",
                  "tdump", "tfind 2", "print $pc", "tfind 3", "print $pc")
    # hit, 2 steps, hit, 2 steps: the pass count ends the run once that hit's steps are recorded (as KGTP)
    assert "Collected 6 trace frames" in out and "Trace stopped by tracepoint 1" in out, out
    pcs = re.findall(r"^\$\d+ = \(void \(\*\)\([^)]*\)\) (0x[0-9a-f]+) <(\w+)(?:\+(\d+))?>", out, re.M)
    assert [(name, int(offset or 0)) for _, name, offset in pcs][:3] == [
        ("kgtp_test_function", 0), ("kgtp_test_function", 7), ("kgtp_test_function", 12)], out
    assert pcs[3][1] == "kgtp_test_function" and not pcs[3][2], out  # the second hit
    assert re.search(r"^rip\s+0x[0-9a-f]+\s+0x[0-9a-f]+ <kgtp_test_function\+7>", out, re.M), out  # tdump


def test_tsave_r_writes_on_the_target_inside_the_save_dir_only(gdb, tmp_path):
    from ..conftest import start_stub

    save_dir = tmp_path / "saves"
    save_dir.mkdir()
    server = start_stub("--save-dir", str(save_dir))
    try:
        out = run_gdb(gdb, server, "monitor pace 5", f"trace kgtp_test_function if {COND}", "actions",
                      f"collect {EXPR}", "collect $regs", "end", "tstart", *wait_for_hits(1, 3), "tstop", "tfind 2",
                      "tdump", "tsave -r run.tf", f"tsave -r {save_dir}/abs.tf", "tsave -r ../escape.tf")
        assert "escape.tf' is outside the save directory" in out, out  # the escaping path is refused
        assert not (tmp_path / "escape.tf").exists()
        offline = run_gdb(gdb, None, f"target tfile {save_dir / 'run.tf'}", "tstatus", "tfind 2", "tdump",
                          attach=False)
    finally:
        server.stop()
    assert (save_dir / "abs.tf").exists()
    dump = lambda text: re.findall(r"^(\(2\*counter1.*|r[a-z0-9]+ +0x\S+.*)$", text, re.M)  # noqa: E731
    assert dump(out) and dump(out) == dump(offline), offline
    assert "Trace stopped by a tstop command" in offline


def test_tsave_r_refused_without_save_dir(gdb, fresh_stub):
    out = run_gdb(gdb, fresh_stub, "trace kgtp_test_function", "tstart", "tstop", "tsave -r /tmp/x.tf")
    assert "--save-dir" in out, out


def _kernel_module_catalog() -> set[str]:
    from kgtp_sim.client import KERNEL_SOURCES

    source = (KERNEL_SOURCES / "module.c").read_text()
    return set(re.findall(r'\{ "(\w+)", (?:0x)?[0-9a-f]+ \}', source))


def test_args_locals_strings_struct_members_and_bt(gdb, fresh_stub, tmp_path):
    catalog = _kernel_module_catalog()
    assert len(catalog) > 3
    out = run_gdb(
        gdb, fresh_stub, "trace load_module", "actions", "collect $args", "collect/s name",
        # `current` is per CPU (%gs:0, a macro to GDB): the hitting CPU's element, through KGTP's $cpu_id
        "collect cpu_data[$cpu_id].current_task->comm", "collect cpu_data[$cpu_id].current_task->pid",
        "collect $bt", "collect $regs", "end",
        "tstart", *wait_for_hits(1), "tstop", "tfind 0", "tdump", "print name",
        "print cpu_data[$cpu_id].current_task->comm", "print cpu_data[$cpu_id].current_task->pid", "bt 2",
    )
    name = re.search(r'^\$1 = 0x[0-9a-f]+ "(\w+)"$', out, re.M)
    assert name and name.group(1) in catalog, out  # the string the kernel passed, collected with collect/s
    assert re.search(r"^taints = \d+$", out, re.M), out  # $args
    comm = re.search(r'^\$2 = "(\w+)', out, re.M)
    assert comm and comm.group(1) == "kmodload", out  # the task that loads modules
    assert re.search(r"^#1\s+0x[0-9a-f]+ in kmodload_thread", out, re.M), out  # $bt let GDB unwind


def test_tsave_ctf(gdb, fresh_stub, tmp_path):
    out = run_gdb(gdb, fresh_stub, "trace load_module", "actions", "collect $regs", "collect/s name", "end",
                  "tstart", *wait_for_hits(1), "tstop", f"tsave -ctf {tmp_path / 'ctf'}")
    if "unknown option `-ctf'" in out:
        pytest.skip(f"GDB {gdb.version} was built without CTF (libbabeltrace) support")
    metadata = (tmp_path / "ctf" / "metadata").read_text()
    assert "register" in metadata and (tmp_path / "ctf" / "datastream").stat().st_size > 0, out


def test_frames_carry_timestamps_and_cpu_shown_by_monitor(gdb, fresh_stub):
    out = run_gdb(gdb, fresh_stub, "trace kgtp_test_function", "actions", "collect counter1", "end", "tstart",
                  *wait_for_hits(1, 5), "tstop", "monitor frames 0 5")
    rows = re.findall(r"^frame\s+(\d+)\s+tp\s+1\s+\+\s*([\d.]+) us\s+cpu (\d+)\s+seq (\d+)", out, re.M)
    assert len(rows) == 5, out
    times = [float(r[1]) for r in rows]
    assert times == sorted(times) and times[0] == 0.0 and times[-1] > 0, out  # monotonic, per frame
    # each CPU counts its own frames from 0 (two CPUs run kgtp_bench threads), merged in timestamp order
    by_cpu: dict[str, list[int]] = {}
    for row in rows:
        by_cpu.setdefault(row[2], []).append(int(row[3]))
    assert set(by_cpu) <= {"0", "1"} and all(seqs == list(range(len(seqs))) for seqs in by_cpu.values()), out


def test_frame_serves_read_only_memory_live_and_faults_become_unavailable(gdb, fresh_stub):
    out = run_gdb(gdb, fresh_stub, "trace kgtp_test_function", "actions", "collect *(long *)0x10",
                  "collect kgtp_counter", "end", "tstart", *wait_for_hits(1), "tstop", "tstatus",
                  "tfind 0", "x/2i $pc", "print *(long *)0x10", "print kgtp_counter", "print jiffies")
    assert "Trace stopped by a tstop command" in out, out  # a faulting collection does not stop the run
    assert re.search(r"^=> 0x[0-9a-f]+ <kgtp_test_function>:\s+add", out, re.M), out  # .text via QTro
    assert re.search(r"^\$1 = <unavailable>|Cannot access memory at address 0x10", out, re.M), out
    assert re.search(r"^\$2 = \d+$", out, re.M), out
    assert re.search(r"^\$3 = <unavailable>$", out, re.M), out  # not collected, not read-only


def test_condition_reading_bad_memory_records_terror(gdb, fresh_stub):
    out = run_gdb(gdb, fresh_stub, "trace kgtp_test_function if *(int *)0x10 > 0", "tstart",
                  *wait_for_trace_stop(), "tstatus")
    assert re.search(r"Trace stopped by an error \(tracepoint 1: memory fault", out), out


def test_locals(gdb, fresh_stub):
    out = run_gdb(gdb, fresh_stub, "trace module.c:57", "actions", "collect $locals", "end", "tstart",
                  *wait_for_hits(1), "tstop", "tfind 0", "tdump")
    assert re.search(r"^mod = 0x[0-9a-f]+ <modules(\+\d+)?>$", out, re.M), out


def test_tfind_line(gdb, fresh_stub):
    out = run_gdb(gdb, fresh_stub, "monitor pace 5", "trace kgtp_test_function", "trace load_module",
                  "tstart", *wait_for_hits(2), *wait_for_hits(1, more=True), "tstop", "tfind line module.c:53", "print $pc", "tfind none",
                  "tfind line kgtp_test_function", "print $pc")
    pcs = re.findall(r"^\$\d+ = \(void \(\*\)\([^)]*\)\) 0x[0-9a-f]+ <(\w+)>", out, re.M)
    assert pcs == ["load_module", "kgtp_test_function"], out


@pytest.mark.parametrize("engine", ["naive", "opt"])
@pytest.mark.parametrize("newcomer", ["compiled", "python"])
def test_a_tracepoint_set_during_a_run_at_a_compiled_probes_address_collects_beside_it(gdb, engine, newcomer):
    """`trace kgtp_test_function` twice, the second while the run goes on (trace-break.exp's fifth case, in the
    kernel; GDB downloads it as it is created, before any `actions`): the first's lone compiled probe becomes a
    chain's head, or, when the second needs Python (a condition on a variable only Python computes), both share
    the int3; the first's count goes on from tstart and both collect from then on."""
    from ..conftest import start_stub

    server = start_stub("--engine", engine, "--cpus", "1")
    condition = " if $hardirq_count == 0" if newcomer == "python" else ""
    try:
        out = run_gdb(gdb, server, "trace kgtp_test_function", "actions", "collect counter1", "end", "tstart",
                      *wait_for_hits(1, 3), f"trace kgtp_test_function{condition}", *wait_for_hits(2, 3), "tstop",
                      "tstatus", "info tracepoints", "monitor probes", "tfind tracepoint 2", "tfind tracepoint 1",
                      "print counter1")
    finally:
        server.stop()
    assert "Target returns error" not in out and "error" not in out.lower(), out
    hits = [int(n) for n in re.findall(r"tracepoint already hit (\d+) times?", out)]
    assert len(hits) == 2 and hits[0] > hits[1] >= 3, out  # the first counted from tstart on
    assert _frames_collected(out) == sum(hits), out
    kinds = re.findall(r"^\s*([12])\s+0x[0-9a-f]+\s+(jump|int3)\s+removed", out, re.M)
    assert sorted(kinds) == ([("1", "int3"), ("2", "int3")] if newcomer == "python" else
                             [("1", "jump"), ("2", "jump")]), out
    assert re.search(r"^Found trace frame \d+, tracepoint 2$", out, re.M), out
    assert re.search(r"^Found trace frame \d+, tracepoint 1$", out, re.M), out
    assert re.search(r"^\$1 = \d+$", out, re.M), out
