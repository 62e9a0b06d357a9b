"""KGTP's user-space variables with a process on the kernel, in every engine: `$current_task_user` is 1 exactly when
the task a hit interrupted is a process's (user_mode(task_pt_regs(current))), `$inferior_pid` names the process
GDB debugs (the gdbserver role sets it)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kgtp_sim.agent.opcodes import assemble
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.programs import Program, load_programs
from kgtp_sim.tracing import Tracer
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing.core.builtins import BUILTIN_VARIABLES
from kgtp_sim.tracing.core.frames import TsvBlock
from kgtp_sim.tracing.tracer import ENGINES

from ..conftest import VMLINUX
from ..programs import compile_program

N = {b.name: b.number for b in BUILTIN_VARIABLES}


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    return compile_program("syscalls", "glibc-static", tmp_path_factory.mktemp("user-builtins"))


@pytest.mark.parametrize("engine", ENGINES)
def test_user_mode_tasks_and_the_inferior_are_told_apart(program, engine):
    machine = Machine(KernelImage.load(VMLINUX), cpus=1)
    inside = load_programs(machine, [Program(program, (str(program),))])
    machine.start()
    try:
        pid = machine.processes.spawn(inside[program], [str(program)])
        tracer = Tracer(machine, engine)
        tracer.inferior_pid = pid
        site = machine.image.address_of("do_syscall")
        collect = assemble("; ".join(f"tracev {N[n]:#x}" for n in ("current_task_user", "current_task_pid",
                                                                   "inferior_pid")) + "; end")
        tracer.definitions.define(t.DefineTracepoint(number=1, address=site, more=True))
        tracer.definitions.add_actions(t.TracepointActions(number=1, address=site,
                                                           actions=(t.EvalExpression(collect),)))
        tracer.start()
        deadline = time.monotonic() + 60
        frames = []
        while time.monotonic() < deadline:
            frames = tracer.frames()
            pids = {values[N["current_task_pid"]] for values in _values(frames)}
            if pid in pids and len(pids) > 1:
                break
            time.sleep(0.05)
        tracer.stop(t.StopReason.STOP_COMMAND)
    finally:
        machine.shutdown()
    seen = {(v[N["current_task_pid"]], v[N["current_task_user"]], v[N["inferior_pid"]]) for v in _values(frames)}
    assert (pid, 1, pid) in seen, seen  # the process's system calls
    kernel = {(p, user) for p, user, _ in seen if p != pid}
    assert kernel and all(user == 0 for _, user in kernel), seen  # syscall_test's: a kernel thread's
    assert all(inferior == pid for _, _, inferior in seen)


def _values(frames) -> list[dict[int, int]]:
    return [{b.number: b.value for b in frame.blocks if isinstance(b, TsvBlock)} for frame in frames]
