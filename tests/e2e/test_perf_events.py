"""KGTP's perf-event howto example with real GDB, on the machine's performance counters, and `monitor perf`.

The howto (its section "How to use performance counters") defines the per-CPU variables with its `dpe` GDB
command, switches the CPU's events on at a function's entry (`teval $p_pe_en=1`) and off at its return
(`teval $kret=0`, `teval $p_pe_en=0`), collects the counts and sets them to 0 for the next call. Here the
function is the page-fault path's `frame_request` (called with interrupts off: no interrupt lands inside it), the
events instructions (PERF_COUNT_HW_INSTRUCTIONS, config 1) and branches (4): each call's counts must be the
instructions and branches of its code from the entry tracepoint's address to its `ret`, exactly, on every CPU, in
every engine, with GDB 13.1 and 18.1.
"""

from __future__ import annotations

import re

import pytest
from capstone import CS_ARCH_X86, CS_MODE_64, Cs
from capstone import x86_const as X

from kgtp_sim.machine import KernelImage

from ..conftest import VMLINUX, run_gdb, start_stub

pytestmark = pytest.mark.gdb

IMAGE = KernelImage.load(VMLINUX)

#: the howto's `dpe` and `spe` GDB commands, as it prints them
HOWTO_COMMANDS = (
    "define dpe",
    "  if ($argc < 2)",
    '    printf "Usage: dpe pe_type pe_config [enable]\\n"',
    "  end",
    "  if ($argc >= 2)",
    '    eval "tvariable $p_pe_val_%d%d_c",$arg0, $arg1',
    '    eval "tvariable $p_pe_en_%d%d_c",$arg0, $arg1',
    "    set $tmp=0",
    "    while $tmp<$cpu_number",
    '      eval "tvariable $p_pe_type_%d%d_c%d=%d",$arg0, $arg1, $tmp, $arg0',
    '      eval "tvariable $p_pe_config_%d%d_c%d=%d",$arg0, $arg1, $tmp, $arg1',
    '      eval "tvariable $p_pe_val_%d%d_c%d=0",$arg0, $arg1, $tmp',
    "      if ($argc >= 3)",
    '        eval "tvariable $p_pe_en_%d%d_c%d=%d",$arg0, $arg1, $tmp, $arg2',
    "      end",
    "      set $tmp=$tmp+1",
    "    end",
    "  end",
    "end",
    "define spe",
    "  if ($argc != 2 && $argc != 3)",
    '    printf "Usage: spe pe_type pe_config [cpu_id]\\n"',
    "  end",
    "  if ($argc == 2)",
    "    set $tmp=0",
    "    while $tmp<$cpu_number",
    '      eval "printf \\"$p_pe_val_%%d%%d_c%%d=%%ld\\\\n\\",$arg0, $arg1, $tmp, $p_pe_val_%d%d_c%d", $arg0, $arg1, '
    "$tmp",
    "      set $tmp=$tmp+1",
    "    end",
    "  end",
    "  if ($argc == 3)",
    '    eval "printf \\"$p_pe_val_%%d%%d_c%%d=%%ld\\\\n\\",$arg0, $arg1, $tmp, $p_pe_val_%d%d_c%d", $arg0, $arg1, '
    "$arg2",
    "  end",
    "end",
)


@pytest.fixture(scope="module", params=[(1, "interp"), (1, "naive"), (1, "opt"), (2, "interp"), (2, "naive"),
                                        (2, "opt")], ids=lambda p: f"{p[0]}cpu-{p[1]}")
def machine(request):
    cpus, engine = request.param
    server = start_stub("--engine", engine, cpus=cpus)
    yield server, cpus
    server.stop()


def _path_from(address: int) -> tuple[int, int]:
    """(instructions, branches) from `address` to the first `ret`: a function without branches before it."""
    cs = Cs(CS_ARCH_X86, CS_MODE_64)
    cs.detail = True
    instructions = branches = 0
    for insn in cs.disasm(IMAGE.read_code(address, 64), address):
        instructions += 1
        if insn.group(X.X86_GRP_JUMP) or insn.group(X.X86_GRP_CALL):
            raise AssertionError(f"{insn.mnemonic} at {insn.address:#x}: the path is not straight")
        if insn.id == X.X86_INS_RET:
            return instructions, branches + 1
    raise AssertionError("no ret")


def _wait_for_calls_on(cpus: int, calls: int) -> tuple[str, ...]:
    """GDB Python: run until `monitor frames` lists `calls` frames of the last tracepoint created from each CPU
    (GDB numbers on from the tracepoints an earlier session left on the target)."""
    return (
        "python",
        "import re, time",
        "deadline = time.monotonic() + 120",
        "number = int(gdb.parse_and_eval('$tpnum'))",
        "while True:",
        "    listed = gdb.execute('monitor frames 0 10000', to_string=True)",
        r"    cpus = re.findall(r'tp\s+%d\s.*\scpu (\d+)' % number, listed)",
        f"    if all(cpus.count(str(cpu)) >= {calls} for cpu in range({cpus})):",
        "        break",
        "    if time.monotonic() > deadline:",
        "        raise gdb.GdbError('not enough calls: ' + str(cpus))",
        "    time.sleep(0.05)",
        "end",
    )


def test_the_howto_example_counts_each_call_exactly(gdb, machine):
    stub, cpus = machine
    out = run_gdb(
        gdb, stub, "delete", *HOWTO_COMMANDS,
        "dpe 0 1", "dpe 0 4",  # PERF_COUNT_HW_INSTRUCTIONS, PERF_COUNT_HW_BRANCH_INSTRUCTIONS
        "trace frame_request", "actions", "teval $p_pe_en=1", "end",
        "trace *frame_request", "actions", "teval $kret=0", "teval $p_pe_en=0",
        "collect $p_pe_val_01_c", "collect $p_pe_val_04_c", "teval $p_pe_val_01_c=0", "teval $p_pe_val_04_c=0",
        "end",
        "tstart", *_wait_for_calls_on(cpus, 3), "tstop",
        "tfind tracepoint $tpnum", "tdump", "print $cpu_id", "tfind none", "spe 0 1", "spe 0 4",
        "python",
        "gdb.execute('tfind none')",
        "while 'Found trace frame' in gdb.execute('tfind tracepoint $tpnum', to_string=True):",
        "    v = lambda e: int(gdb.parse_and_eval(e))",
        "    print('CALL %d %d %d' % (v('$cpu_id'), v('$p_pe_val_01_c'), v('$p_pe_val_04_c')))",
        "end",
        timeout=240,
    )
    entry = int(re.search(r"^Tracepoint \d+ at (0x[0-9a-f]+): file fixtures/kernel/traps\.c", out, re.M).group(1), 16)
    instructions, branches = _path_from(entry)
    calls = [tuple(map(int, row)) for row in re.findall(r"^CALL (\d+) (\d+) (\d+)$", out, re.M)]
    assert len(calls) >= 3 * cpus, out
    assert {cpu for cpu, _, _ in calls} == set(range(cpus)), out
    assert {(i, b) for _, i, b in calls} == {(instructions, branches)}, out  # every call, exactly
    assert re.search(rf"^\$p_pe_val_01_c = {instructions}$", out, re.M), out  # tdump of the first return frame
    assert re.search(r"^\$\d+ = [01]$", out, re.M), out  # $cpu_id of that frame, as KGTP answers it
    for cpu in range(cpus):  # spe, live: each CPU's counter since its last call's reset
        assert re.search(rf"^\$p_pe_val_01_c{cpu}=\d+$", out, re.M), out
        assert re.search(rf"^\$p_pe_val_04_c{cpu}=\d+$", out, re.M), out


def _wait_for_perf(cpus: int) -> tuple[str, ...]:
    """GDB Python: run until `monitor perf` shows instructions and context switches on every CPU."""
    return (
        "python",
        "import re, time",
        "deadline = time.monotonic() + 60",
        "while True:",
        "    shown = gdb.execute('monitor perf', to_string=True)",
        r"    rows = [re.search(r'^CPU%d\s+([\d,]+)\s+context-switches' % c, shown, re.M) for c in range(" f"{cpus})]",
        "    if all(r and int(r.group(1).replace(',', '')) > 0 for r in rows):",
        "        break",
        "    if time.monotonic() > deadline:",
        "        raise gdb.GdbError('no counts: ' + shown)",
        "    time.sleep(0.05)",
        "end",
    )


def test_monitor_perf_prints_each_cpus_counters_like_perf_stat(gdb, machine):
    stub, cpus = machine
    out = run_gdb(gdb, stub, "monitor perf", "monitor perf on", *_wait_for_perf(cpus), "monitor perf",
                  "monitor perf off", "monitor perf")
    assert "perf: not counting (monitor perf on starts)" in out, out
    assert f"perf: counting on {cpus} CPUs" in out, out
    stats = out.split(f"perf: counting on {cpus} CPUs")[1]
    assert "Performance counter stats for the machine" in stats and "seconds time elapsed" in stats, out

    def count(cpu: int, event: str) -> float:
        found = re.search(rf"^CPU{cpu}\s+([\d,.]+)(?: msec)?\s+{re.escape(event)}(\s|$)", stats, re.M)
        assert found, (cpu, event, out)
        return float(found.group(1).replace(",", ""))

    for cpu in range(cpus):
        assert count(cpu, "instructions") > count(cpu, "branches") > 0, out
        assert count(cpu, "cycles") > 0 and count(cpu, "context-switches") > 0, out
        assert count(cpu, "cpu-migrations") == 0 and count(cpu, "instructions:u") == 0, out  # bound kernel threads
        assert count(cpu, "cpu-clock") >= count(cpu, "task-clock") > 0, out
    assert "perf: stopped" in out and out.rstrip().endswith("perf: not counting (monitor perf on starts)"), out
