"""A process on the kernel seen from GDB in KGTP mode: a tracepoint in the kernel's system-call path sees its
calls, with its pid, its comm and its registers at the top of its kernel stack, as on Linux."""

from __future__ import annotations

import re

import pytest

from kgtp_sim.client import run_gdb
from kgtp_sim.client.gdb import command_file, gdb_batch
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


@pytest.mark.parametrize("cpus", [1, 2])
@pytest.mark.parametrize("engine", ["interp", "naive", "opt"])
def test_collect_current_and_bt_show_the_program_stack_down_to_main(gdb, tmp_path, engine, cpus):
    """KGTP's howto ("Use KGTP with user space program"): `collect $current` and `collect $bt` at a system call of
    the process; after tfind, GDB with the program's symbols shows the program's registers and walks its stack from
    the system call's wrapper down to main."""
    program = compile_program("syscalls", "glibc-static", tmp_path)
    server = start_stub("--run", f"{program} forever", "--engine", engine, cpus=cpus)
    try:
        wait_until(lambda: any("round" in line for line in server.output), "the program's first output")
        started = next(line for line in server.output if "started" in line)
        pid = int(re.search(r"as pid (\d+)", started).group(1))
        out = run_gdb(
            gdb, server, f"add-symbol-file {program}",
            f"trace do_syscall if $current_task_user && $current_task_pid == {pid} && "
            "((struct pt_regs *)$task_pt_regs)->orig_ax == 110",
            "actions", "collect $current", "collect $bt", "end",
            "tstart", *wait_for_hits(1, 2), "tstop", "tfind 0",
            "bt", "print $pc", "print $cs", "print $ss", "info symbol *(long *)$sp", "tfind 1", "bt",
        )
    finally:
        server.stop()
    walks = [re.findall(r"^#\d+\s+(?:0x[0-9a-f]+ in )?(\w+) \(", walk, re.M)
             for walk in out.split("Found trace frame")[1:]]
    assert len(walks) == 2, out + "".join(server.output[-20:])
    for walk in walks:
        # the program's frames from the system call's wrapper through main (GDB goes on below main to _start: its
        # main program is the kernel, whose symbols have no main)
        assert walk[:2] == ["getppid", "main"] and walk[-1] == "_start", out
    values = _values(out)
    assert re.fullmatch(r"\(void \(\*\)\(\)\) 0x[0-9a-f]+ <getppid\+\d+>", values[0]), out
    assert values[1:3] == ["51", "43"], out  # USER_CS, USER_DS: the process's registers
    assert re.search(r"^main \+ \d+ in section \.text", out, re.M), out  # its stack, collected by $bt


def test_a_second_inferior_reads_the_running_program_and_walks_its_traced_stack(gdb, tmp_path):
    """KGTP's howto, both parts ("the memory of the user space program", then "collect stack (for backtrace) of user
    space program in tracepoint") as written: `target extended-remote`, `info os processes`, `add-inferior`,
    `inferior 2`, `file PROG`, `attach PID` (nothing stops), the program's global read twice while it runs on;
    tracepoints of inferior 1 (the kernel) collect `$current` and `$bt`; in inferior 2 `tfind` and `bt` walk the
    program's stack with its own symbols; `detach` of inferior 2 leaves the kernel's session; a pid no process has
    is refused."""
    program = compile_program("syscalls", "glibc-static", tmp_path)
    server = start_stub("--run", str(program), cpus=2)
    try:
        wait_until(lambda: any("round" in line for line in server.output), "the program's first output")
        pid = int(re.search(r"as pid (\d+)", next(line for line in server.output if "started" in line)).group(1))
        commands = [
            "set pagination off", "set confirm off", f"target extended-remote {server.address}",
            "info os processes",
            f"trace do_syscall if $current_task_user && $current_task_pid == {pid} && "
            "((struct pt_regs *)$task_pt_regs)->orig_ax == 110",
            "actions", "collect $current", "collect $bt", "end",
            "tstart", *wait_for_hits(1, 2), "tstop",
            "add-inferior", "inferior 2", f"file {program}", f"attach {pid}",
            "set $first = *(unsigned long *)&rounds", "print $first > 0",
            "while *(unsigned long *)&rounds == $first", "end",  # the program runs on: its memory changes under GDB's eyes
            "print *(unsigned long *)&rounds > $first",
            "tfind 0", "bt", "tfind none",
            "detach", "inferior 1", "print jiffies > 0",
            "inferior 2", "attach 99999",
        ]
        with command_file(commands) as script:
            result = gdb_batch(gdb, "-x", str(script), timeout=120)
        out = result.stdout + result.stderr
    finally:
        server.stop()
    assert re.search(rf"^{pid}\s+root\s+{re.escape(str(program))}\s", out, re.M), out  # info os processes
    assert _values(out)[:2] == ["1", "1"], out + "".join(server.output[-30:])
    walk = re.findall(r"^#\d+\s+(?:0x[0-9a-f]+ in )?(\w+) \(", out.split("Found trace frame")[1], re.M)
    assert walk[:2] == ["getppid", "main"], out
    assert _values(out)[2] == "1", out  # the kernel's session went on after inferior 2's detach
    assert "[Inferior 2 (Remote target) detached]" in out
    assert "Attaching to Remote target failed" in out or "failed" in out.rsplit("attach 99999", 1)[-1], out


def test_fork_and_the_end_of_a_child_are_the_kernels_own_code_tracepoints_see(gdb, tmp_path):
    """A program forking child after child (tests/programs/forks.c "many"): a tracepoint at do_fork sees the parent
    in the fork system call, one at exit_notify each child's end with its wait status and its parent, one at
    do_wait the parent reaping them (fixtures/kernel/fork.c, exit.c)."""
    program = compile_program("forks", "musl-static", tmp_path)
    server = start_stub("--run", f"{program} many 1000000", cpus=2)
    try:
        started = wait_until(lambda: next((line for line in server.output if "started" in line), None),
                             "the program's start")
        pid = int(re.search(r"as pid (\d+)", started).group(1))
        out = run_gdb(
            gdb, server,
            "trace do_fork", "actions", "collect $current_task_pid, ((struct task_struct *)$current_task)->comm",
            "end",
            f"trace exit_notify if leader->parent->pid == {pid}", "actions", "collect leader->pid, status", "end",
            "trace do_wait", "actions", "collect $current_task_pid, which", "end",
            "tstart", *wait_for_hits(2, 3), "tstop",
            "tfind tracepoint 1", "print $current_task_pid", "print ((struct task_struct *)$current_task)->comm",
            "tfind tracepoint 2", "print leader->pid", "print status", "tfind tracepoint 3",
            "print $current_task_pid", "print which",
        )
    finally:
        server.stop()
    values = _values(out)
    assert len(values) == 6, out + "".join(server.output[-20:])
    assert values[0] == str(pid) and values[1] == f'"{program.name[:15]}"', out  # the parent, in fork
    assert int(values[2]) != pid and int(values[3]) % 256 == 0, out  # a child's end: its pid, an exit code
    assert values[4:] == [str(pid), "1"], out  # the parent in wait4 for its child (P_PID)
