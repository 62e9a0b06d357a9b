"""Machines built ahead of their use (Machine.prepare / Machine.prepared): the warm server (warm.py) builds one
before it forks, and each fork's gdbserver takes its copy instead of building its own.

A prepared machine is handed out once per process, only for the same kernel file (as it is now), hz, pace and CPU
count, with its clock counting from when it is taken. Across fork(): each child gets the machine as the parent
built it, starts it, boots it and runs programs on it (a program installed while it runs, as a vRun does), and the
next child gets it untouched by the first. The forks run in a Python of their own (forking the test runner, with
its threads, would copy their locks half-held)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

from kgtp_sim.client import ROOT, VMLINUX
from kgtp_sim.machine import Machine

from ..programs import compile_program


def test_a_prepared_machine_goes_once_to_the_same_arguments_its_clock_from_then(tmp_path):
    kernel = tmp_path / "vmlinux"
    shutil.copy(VMLINUX, kernel)
    Machine.prepare(kernel, hz=100, cpus=2)
    try:
        assert Machine.prepared(kernel, hz=250, cpus=2) is None
        assert Machine.prepared(kernel, hz=100, cpus=1) is None
        assert Machine.prepared(VMLINUX, hz=100, cpus=2) is None  # another file
        built = time.monotonic_ns()
        time.sleep(0.05)  # so that a clock counting from the build would show it
        taken = time.monotonic_ns()
        machine = Machine.prepared(kernel, hz=100, cpus=2)
        assert machine is not None and machine.cpu_count == 2 and machine.hz == 100 and not machine.started
        assert machine.clock.ns() < time.monotonic_ns() - built - (taken - built) // 2
        assert Machine.prepared(kernel, hz=100, cpus=2) is None  # once
        Machine.prepare(kernel, hz=100, cpus=2)
        os.utime(kernel, ns=(time.time_ns(), time.time_ns() + 10**9))  # the file changed since
        assert Machine.prepared(kernel, hz=100, cpus=2) is None
    finally:
        Machine._prepared.clear()


FORKS = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from kgtp_sim.client import VMLINUX
    from kgtp_sim.machine import Machine
    from kgtp_sim.programs import install_program

    program = Path(sys.argv[1])
    Machine.prepare(VMLINUX, cpus=2)
    parent = Machine._prepared[next(iter(Machine._prepared))]
    for child in range(2):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                machine = Machine.prepared(VMLINUX, cpus=2)
                assert machine is parent, "not the machine built before the fork"
                output = []
                machine.processes.sink = lambda fd, data: output.append(data)
                machine.start()
                inside = install_program(machine, program)
                ended = machine.processes.wait(machine.processes.spawn(inside, [str(program), "a", "b"]), 60)
                assert ended is not None and ended.shell_status == 0, ended
                assert b'argv[2] = "b"' in b"".join(output), output
                assert "2 CPUs" in machine.console_text(), machine.console_text()
                machine.shutdown()
                code = 0
            finally:
                sys.stdout.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, f"fork {child}: {status}"
    assert not parent.started and parent.console_text() == ""  # the parent's copy never ran
    print("forks ok")
""")


def test_each_fork_takes_the_machine_as_built_and_runs_a_program_on_it(tmp_path):
    program = compile_program("args", "glibc-dynamic", tmp_path)
    result = subprocess.run([sys.executable, "-c", FORKS, str(program)], capture_output=True, text=True, timeout=300,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0 and "forks ok" in result.stdout, result.stdout + result.stderr
