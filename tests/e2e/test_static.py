"""Static tracepoints on the kernel's TRACE_EVENT markers, end to end with real GDB 13.1 and 18.1.

GDB 13 to 18 have undefined behaviour when creating static tracepoints if the stub names the marker at `strace`
time (docs: README, "GDB client notes"); the stub avoids it. A test that sees GDB die tells that apart from a
stub failure by looking for GDB's own fatal-signal report.
"""

from __future__ import annotations

import re

import pytest

from kgtp_sim.machine import KernelImage

from ..conftest import VMLINUX, run_gdb, wait_for_hits

pytestmark = pytest.mark.gdb

IMAGE = KernelImage.load(VMLINUX)
MARKERS = {m.id: m for m in IMAGE.markers}
SITE = {marker_id: marker.site for marker_id, marker in MARKERS.items()}
NOP = bytes.fromhex("0f1f440000")


def run(gdb, stub, *commands: str) -> str:
    out = run_gdb(gdb, stub, *commands)
    if "Fatal signal" in out or "internal-error" in out:  # GDB itself crashed: not the stub's failure
        pytest.fail(f"GDB {gdb.version} crashed (client bug, see README):\n{out}")
    return out


def test_info_static_tracepoint_markers_lists_every_marker_of_the_image(gdb, stub):
    out = run(gdb, stub, "info static-tracepoint-markers")
    listed = re.findall(r"^\d+\s+(\S+::\S+)\s+n\s+(0x[0-9a-f]+) in (\w+)", out, re.M)
    formats = re.findall(r'^\s+Data: "(.*)"$', out, re.M)
    assert {(i, int(a, 16)) for i, a, _ in listed} == {(m.id, m.site) for m in IMAGE.markers}, out
    assert sorted(formats) == sorted(m.format for m in IMAGE.markers)
    assert dict((i, f) for i, _, f in listed)["module::kgtp_module_event"] == "kgtp_test_function"


def test_strace_with_condition_on_a_global_collects_sdata_and_registers(gdb, fresh_stub):
    site = SITE["module::kgtp_module_event"]
    out = run(gdb, fresh_stub, "monitor pace 20", f"strace *{site:#x} if (jiffies & 1) == 0", "actions",
              "collect $_sdata", "collect $regs", "collect jiffies", "collect (2*counter1+3*counter2)", "end",
              "tstart", *wait_for_hits(1, 2), "tstop", "tstatus", "tfind 1", "print $_sdata", "print jiffies",
              "print $rdi", "print $rsi", "tdump")
    assert re.search(r"Collected [1-9]\d* trace frames", out), out
    sdata = re.search(r'^\$1 = "counter1=(-?\d+) counter2=(-?\d+)"', out, re.M)
    assert sdata, out
    jiffies, rdi, rsi = (int(v) for v in re.findall(r"^\$[234] = (\d+)$", out, re.M))
    assert jiffies % 2 == 0, out  # the condition used a variable that is not a marker argument
    assert (int(sdata.group(1)), int(sdata.group(2))) == (rdi, rsi), out  # the TRACE_EVENT data is the site's
    assert re.search(rf"^\(2\*counter1\+3\*counter2\) = {2 * rdi + 3 * rsi}$", out, re.M), out


def test_strace_file_line_false_condition_collects_nothing(gdb, fresh_stub):
    out = run(gdb, fresh_stub, "strace module.c:14 if counter1 < 0", "actions", "collect $_sdata", "end",
              "tstart", "shell sleep 0.2", "tstop", "tstatus", "monitor probes")
    assert "Collected 0 trace frames" in out, out
    fired = re.search(r"fired (\d+)\s+hits 0", out)
    assert fired and int(fired.group(1)) > 10, out  # the marker fired; the condition said no


def test_every_marker_fires_and_renders_like_ftrace(gdb, fresh_stub):
    order = list(MARKERS)
    commands = []
    for marker_id in order:
        commands += [f"strace *{SITE[marker_id]:#x}", "actions", "collect $_sdata", "end"]
    commands.append("tstart")
    for number in range(1, len(order) + 1):
        commands += wait_for_hits(number)
    commands += ["tstop", "tstatus"]
    for number in range(1, len(order) + 1):
        commands += ["tfind none", f"tfind tracepoint {number}", "print $_sdata"]
    out = run(gdb, fresh_stub, *commands)
    printed = re.findall(r'^\$\d+ = "(.*)"$', out, re.M)
    assert len(printed) == len(order), out
    for marker_id, text in zip(order, printed):
        pattern = re.escape(MARKERS[marker_id].format)
        pattern = re.sub(r"%(l|ll)?[du]", r"-?\\d+", pattern).replace("%s", r"[\w/.-]*")
        pattern = re.sub(r"%l?x", "[0-9a-f]+", pattern)
        assert re.fullmatch(pattern, text), (marker_id, text)
    by_id = dict(zip(order, printed))
    assert re.match(r"prev_comm=[\w/]+ prev_pid=\d+ .* ==> next_comm=[\w/]+ next_pid=\d+", by_id["sched::sched_switch"])
    assert re.match(r"[a-z0-9_]+ taints=\d+", by_id["module::module_load"])  # the string field
    assert re.match(r"ip=\d+ addr=\d+ write_access=[01]", by_id["fault::page_fault_entry"])  # a real #PF


def test_disabling_a_marker_during_a_run_stops_its_frames_and_restores_the_nop(gdb, fresh_stub):
    site = SITE["module::kgtp_module_event"]
    out = run(gdb, fresh_stub, "monitor pace 5", f"strace *{site:#x}", "actions", "collect $_sdata", "end",
              "tstart", *wait_for_hits(1), "disable 1", "tstatus", "x/5xb " + hex(site), "shell sleep 0.3",
              "tstatus", "tstop")
    counts = [int(n) for n in re.findall(r"Collected (\d+) trace frames", out)]
    assert len(counts) == 2 and 0 < counts[0] and counts[1] <= counts[0] + 1, out
    shown = re.search(r":\s+(0x0f\s+0x1f\s+0x44\s+0x00\s+0x00)$", out, re.M)
    assert shown, out  # a disabled marker is the plain 5-byte NOP again


def test_after_tsave_and_target_tfile_frames_read_back_and_monitor_renders_sdata(gdb, fresh_stub, tmp_path):
    """GDB's trace-file reader has no `S` block: saved frames keep registers and memory, and the stub renders
    `$_sdata` for any frame through `monitor sdata` (live `print $_sdata` is tested above)."""
    site = SITE["module::module_load"]
    saved = tmp_path / "static.tf"
    live = run(gdb, fresh_stub, f"strace *{site:#x}", "actions", "collect $_sdata", "collect $regs", "end",
               "tstart", *wait_for_hits(1), "tstop", "tfind 0", "print $_sdata", "print $rbx", f"tsave {saved}",
               "monitor sdata 0 1")
    text = re.search(r'^\$1 = "(.*)"$', live, re.M)
    assert text and re.search(rf"^frame\s+0\s+tp\s+1\s+{re.escape(text.group(1))}$", live, re.M), live
    offline = run_gdb(gdb, None, f"target tfile {saved}", "tfind 0", "print $rbx", attach=False)
    rbx = re.search(r"^\$2 = (-?\d+)$", live, re.M).group(1)
    assert re.search(rf"^\$1 = {rbx}$", offline, re.M), offline
