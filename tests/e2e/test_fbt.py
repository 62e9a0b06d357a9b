"""Function-boundary tracing with real GDB (scripts/gdb/kgtp_fbt.py): `kgtp-fbt *` puts an entry and a return tracepoint
on every kernel function that can take them, in one GDB session, says which ones it left out and why, traces a
run of the whole kernel without the kernel misbehaving, and removes its tracepoints again; on 1 and 2 CPUs, in
every engine, with GDB 13.1 and 18.1."""

from __future__ import annotations

import re

import pytest

from kgtp_sim.machine import KernelImage
from kgtp_sim.tracing.patching.probes import decode

from ..conftest import GDB_CLIENTS, ROOT, VMLINUX, run_gdb, start_stub, wait_for_hits

pytestmark = pytest.mark.gdb

IMAGE = KernelImage.load(VMLINUX)
DO_INTERRUPT = IMAGE.function_at(IMAGE.address_of("do_interrupt"))
#: where do_syscall returns to: the instruction after do_interrupt's call
AFTER_SYSCALL = next(i.end for i in decode(IMAGE.read_code(DO_INTERRUPT.address, DO_INTERRUPT.size),
                                           DO_INTERRUPT.address)
                     if i.mnemonic == "call" and i.branch_target == IMAGE.address_of("do_syscall"))
#: functions every CPU runs within moments (the workload, the tick, system calls, page faults): both their
#: probes must fire
BUSY = ("kgtp_test_function", "timer_interrupt", "do_interrupt", "schedule", "switch_stacks", "do_syscall",
        "do_page_fault", "frame_request", "spin_lock_irqsave", "spin_unlock_irqrestore")


#: every engine on one and two CPUs with GDB 13; GDB 18 on the two ends of that range (its packets are GDB 13's:
#: what differs between the GDBs is the client, which two machines exercise)
COMBINATIONS = [(client, cpus, engine) for client in GDB_CLIENTS
                for cpus, engine in ((1, "interp"), (1, "naive"), (1, "opt"), (2, "interp"), (2, "naive"), (2, "opt"))
                if client.version == "13" or (cpus, engine) in ((1, "interp"), (2, "opt"))]


@pytest.fixture(params=COMBINATIONS, ids=lambda p: f"gdb{p[0].version}-{p[1]}cpu-{p[2]}")
def machine(request):
    _client, cpus, engine = request.param
    server = start_stub("--engine", engine, cpus=cpus)
    yield server, cpus, request.param[0]
    server.stop()


@pytest.fixture
def gdb(machine):
    """The GDB of the machine's combination (overrides the suite's fixture over every GDB)."""
    return machine[2]


#: GDB Python: run until both probes of every BUSY function fired (`monitor probes` counts them)
WAIT_FOR_BUSY = (
    "python",
    "import re, time",
    "deadline = time.monotonic() + 180",
    "while True:",
    "    rows = gdb.execute('monitor probes', to_string=True).splitlines()",
    f"    fired = {{name: [int(re.search(r'fired (\\d+)', r).group(1)) for r in rows if r.endswith('(' + name + ')')"
    f" or '(' + name + ', return probe' in r] for name in {BUSY!r}}}",
    "    if all(len(f) == 2 and min(f) > 0 for f in fired.values()):",
    "        break",
    "    if time.monotonic() > deadline:",
    "        raise gdb.GdbError('not every busy function was traced: ' + repr(fired))",
    "    time.sleep(0.1)",
    "end",
)

#: GDB Python: the kernel runs on after the run: jiffies moves
JIFFIES_MOVE = (
    "python",
    "import time",
    "start, deadline = int(gdb.parse_and_eval('jiffies')), time.monotonic() + 30",
    "while int(gdb.parse_and_eval('jiffies')) == start:",
    "    if time.monotonic() > deadline:",
    "        raise gdb.GdbError('jiffies stopped')",
    "    time.sleep(0.05)",
    "print('JIFFIES MOVED')",
    "end",
)


def test_kgtp_fbt_traces_every_probeable_functions_entry_and_return(gdb, machine):
    stub, cpus, _ = machine
    out = run_gdb(
        # a tstart that installs some 450 probes takes seconds on a busy host: more than GDB's 2 s wait for a reply
        gdb, stub, "set remotetimeout 60", f"source {ROOT}/scripts/gdb/kgtp_fbt.py", "monitor fbt", "kgtp-fbt *",
        "info kgtp-fbt", "tstart", *WAIT_FOR_BUSY, "tstop",
        # a second run: calls still inside the first run's return probes return through trampolines it retired
        "tstart", *WAIT_FOR_BUSY, "tstop", "tstatus", "monitor probes", *JIFFIES_MOVE, "monitor stats",
        "monitor console",
        "delete kgtp-fbt", "info tracepoints", "info kgtp-fbt",
        timeout=300,
    )
    listed = re.findall(r"^0x[0-9a-f]+\s+entry (\S+)\s+return (\S+)\s+(\S+)", out, re.M)
    entries = sum(entry != "none" for entry, _, _ in listed)
    returns = sum(ret == "yes" for _, ret, _ in listed)
    assert len(listed) > 70 and entries > 70 and returns > 50, out
    assert (f"kgtp-fbt: {entries} entry and {returns} return tracepoints on {entries} functions "
            f"(tracepoints 1-{entries + returns}); {2 * (len(listed) - entries) + entries - returns} probes left out "
            "(info kgtp-fbt says why)") in out, out
    # the reasons: no probe at all where even an int3 cannot go, no return probe for the entry code and for a
    # function that never returns
    trap = IMAGE.address_of("trap_breakpoint")
    assert f"trap_breakpoint entry: {trap:#x}: int3 in trap_breakpoint is already a breakpoint" in out, out
    assert "trap_invalid_op entry: " in out and "is in the kernel's exception table" in out, out
    assert "common_entry return: entry code in assembly (boot.S)" in out, out
    assert "cpu_idle return: never returns" in out, out
    created = re.findall(r"^(\d+)\s+(entry|return)\s+(jump|int3)\s+(\S+)$", out, re.M)
    assert len(created) == entries + returns, out
    # the whole kernel ran traced: frames, the busy functions' both probes fired
    collected = int(re.search(r"Collected (\d+) trace frames", out).group(1))
    assert collected > 100, out
    fired = re.findall(r"^\s*\d+\s+0x[0-9a-f]+\s+\S+\s+removed\s+fired (\d+)", out, re.M)
    assert len(fired) == entries + returns and sum(map(int, fired)) >= collected, out
    # ... and the kernel did not misbehave
    assert "JIFFIES MOVED" in out and "Kernel panic" not in out, out
    assert re.search(r"^state\s+(running|idle)$", out, re.M), out
    assert re.search(rf"^cpus_online\s+{cpus}$", out, re.M), out
    assert f"kgtp-fbt: {entries + returns} tracepoints deleted" in out, out
    assert "No tracepoints." in out and "kgtp-fbt: nothing created" in out, out


def test_kgtp_fbt_entry_or_return_with_a_collection(gdb, machine):
    """One side only, a glob, and `collect` added to the actions: do_syscall's return frames carry its return
    value in %rax, read at the caller's instruction after the call; `delete kgtp-fbt PATTERN` removes some."""
    stub, _, _ = machine
    out = run_gdb(
        gdb, stub, f"source {ROOT}/scripts/gdb/kgtp_fbt.py", "kgtp-fbt do_sys*ll return collect $rax",  # do_syscall, not do_syscall_64
        "kgtp-fbt kgtp_test_* entry", "info kgtp-fbt",
        "tstart", *wait_for_hits(1, 2), "tstop",  # do_syscall's returns (a fresh stub: GDB numbers from 1)
        "python",
        "row = re.search(r'^(\\d+)\\s+return', gdb.execute('info kgtp-fbt do_syscall', to_string=True), re.M)",
        "gdb.execute('tfind tracepoint ' + row.group(1))",
        "print('SYSCALL RETURN %s' % gdb.execute('info symbol $pc', to_string=True).strip())",
        "gdb.execute('tfind none')",
        "end",
        "delete kgtp-fbt do_*", "info kgtp-fbt", "kgtp-fbt no_such_function",
    )
    assert "kgtp-fbt: 0 entry and 1 return tracepoints on 1 functions" in out, out
    assert "kgtp-fbt: 1 entry and 0 return tracepoints on 1 functions" in out, out
    assert re.search(r"^\d+\s+return\s+int3\s+do_syscall$", out, re.M), out
    assert re.search(r"^\d+\s+entry\s+jump\s+kgtp_test_function$", out, re.M), out
    assert f"SYSCALL RETURN do_interrupt + {AFTER_SYSCALL - DO_INTERRUPT.address} in section .text" in out, out
    assert "kgtp-fbt: 1 tracepoints deleted" in out, out
    assert out.split("kgtp-fbt: 1 tracepoints deleted")[1].count("kgtp_test_function") == 1, out
    assert "no kernel function matches 'no_such_function'" in out, out
