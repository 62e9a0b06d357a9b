"""Memory limits of processes on the kernel: a program that takes memory without end is killed by the kernel's OOM
killer once the machine's RAM for processes runs out (SIGKILL: status 137); RLIMIT_AS and RLIMIT_DATA set with setrlimit make mmap and brk fail with
ENOMEM, as natively."""

from __future__ import annotations

import os
import subprocess

import pytest

from kgtp_sim.client.paths import ROOT
from kgtp_sim.client.stub import kgtp_command

from ..programs import MODES, compile_program


def test_a_program_without_end_of_memory_is_killed_by_the_oom_killer(tmp_path):
    program = compile_program("hog", "glibc-static", tmp_path)
    done = subprocess.run(kgtp_command("run", "--cpus", "1", str(program)), capture_output=True, timeout=300,
                          cwd=ROOT)
    assert done.stdout == b"taking memory\n", done
    assert done.returncode == 128 + 9, done
    assert done.stderr.decode().strip() == f"kgtp-sim: {program}: killed by SIGKILL", done


@pytest.mark.parametrize("mode", sorted(MODES))
def test_rlimit_as_and_data_make_mmap_and_brk_fail_as_natively(tmp_path, mode):
    program = compile_program("hog", mode, tmp_path)
    native = subprocess.run([str(program), "limit"], capture_output=True, timeout=60)
    simulated = subprocess.run(kgtp_command("run", str(program), "limit"), capture_output=True, timeout=120,
                               cwd=ROOT, env={**os.environ, "LC_ALL": "C"})
    assert simulated.stdout == native.stdout, (simulated, native)
    assert native.stdout.count(b"stopped: ") == 2 and b"within the limit no" not in native.stdout, native
    assert simulated.returncode == native.returncode == 0, simulated
