"""`monitor run` and `monitor ps` in KGTP mode: a program packed at boot (`serve --with`) started from GDB, listed
with the kernel's tasks (pid, comm, state, CPU, user and system time as the kernel's tick accounts them), and its
system calls seen by a tracepoint conditioned on its pid."""

from __future__ import annotations

import re

import pytest

from kgtp_sim.client import run_gdb
from kgtp_sim.client.stub import start_stub

from ..conftest import wait_for_hits
from ..programs import compile_program


@pytest.fixture
def packed_stub(tmp_path):
    program = compile_program("syscalls", "musl-static", tmp_path)
    server = start_stub("--with", str(program), cpus=2)
    yield server, program
    server.stop()


def _ps_rows(text: str) -> dict[int, list[str]]:
    """pid -> the rest of its row, from the last `monitor ps` table in the text."""
    table = text[text.rindex("  PID  COMM"):]
    rows = {}
    for line in table.splitlines()[1:]:
        words = line.split()
        if len(words) != 7 or not words[0].isdigit():
            break
        rows[int(words[0])] = words[1:]
    return rows


def test_monitor_run_starts_a_packed_program_that_ps_lists_and_a_tracepoint_sees(gdb, packed_stub):
    server, program = packed_stub
    comm = program.name[:15]
    out = run_gdb(gdb, server, "monitor ps", f"monitor run {program} forever")
    before = _ps_rows(out[:out.index("started")])
    assert before[1][:3] == ["kgtp_bench", "S", "0"] or before[1][0] == "kgtp_bench", out
    assert not any(row[0] == comm for row in before.values()), out
    pid = int(re.search(rf"started {re.escape(str(program))} forever as pid (\d+)", out).group(1))
    assert pid >= 100, out

    out = run_gdb(
        gdb, server, f"trace do_syscall if $current_task_pid == {pid}", "actions",
        "collect $current_task_pid, regs->orig_ax", "end",
        "tstart", *wait_for_hits(1, 20), "tstop", "tfind 0", "print $current_task_pid", "print regs->orig_ax",
        "tfind end", "monitor ps",
    )
    values = re.findall(r"^\$\d+ = (.*)$", out, re.M)
    assert values[:2] == [str(pid), "110"], out  # its getppid calls
    row = _ps_rows(out)[pid]
    name, state, cpu, user, system, tgid = row
    assert (name, tgid) == (comm, str(pid)), out
    assert state in ("R", "S") and cpu in ("0", "1"), out
    # a loop of getppid calls: its ticks land in user mode and in the kernel both, given time
    assert float(user) + float(system) > 0, out
    assert any(line.startswith(f"kgtp-sim: started {program} forever as pid {pid}") for line in server.output)


def test_monitor_run_refuses_a_program_not_packed(gdb, packed_stub):
    server, program = packed_stub
    out = run_gdb(gdb, server, "monitor run /bin/true", "monitor run")
    assert f"/bin/true is not a program of this machine (packed at boot: {program}" in out, out
    assert "monitor run: which program?" in out and "usage: monitor run PROG [ARG...]" in out, out
