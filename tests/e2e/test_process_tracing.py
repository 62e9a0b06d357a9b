"""A process on the kernel seen from GDB in KGTP mode: a tracepoint in the kernel's system-call path sees its
calls, with its pid, its comm and its registers at the top of its kernel stack, as on Linux."""

from __future__ import annotations

import re

import pytest

from kgtp_sim.client import run_gdb
from kgtp_sim.client.stub import start_stub

from ..conftest import wait_for_hits, wait_until
from ..programs import compile_program


@pytest.fixture
def program_stub(tmp_path):
    program = compile_program("syscalls", "musl-static", tmp_path)
    server = start_stub("--run", f"{program} forever", cpus=2)
    yield server, program
    server.stop()


def _values(out: str) -> list[str]:
    return re.findall(r"^\$\d+ = (.*)$", out, re.M)


def test_do_syscall_sees_the_process_with_its_pid_and_comm(gdb, program_stub):
    server, program = program_stub
    wait_until(lambda: any("round" in line for line in server.output), "the program's first output")
    started = next(line for line in server.output if "started" in line)
    pid = int(re.search(r"as pid (\d+)", started).group(1))
    out = run_gdb(
        gdb, server, "trace do_syscall if regs->orig_ax == 110", "actions",
        "collect $current_task_pid, regs->orig_ax, ((struct task_struct *)$current_task)->comm",
        "collect $task_pt_regs, *regs", "end",
        "tstart", *wait_for_hits(1, 3), "tstop", "tfind 0",
        "print $current_task_pid", "print ((struct task_struct *)$current_task)->comm", "print regs->orig_ax",
        "print (unsigned long)regs == $task_pt_regs", "print regs->cs", "print regs->ss",
        "print regs->ip < 0x800000000000", "print regs->vector",
    )
    values = _values(out)
    assert len(values) == 8, out + "".join(server.output[-20:])
    assert values[0] == str(pid), out
    assert values[1] == f'"{program.name[:15]}"', out  # comm: the program's name, as Linux cuts it
    assert values[2:] == ["110", "1", "51", "43", "1", "256"], out  # getppid; USER_CS 0x33, USER_DS 0x2b
