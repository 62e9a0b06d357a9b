"""KGTP's `collect $current` with a process on the kernel, in every engine (`kgtp_sim/tracing/kgtp/printk.py`): at a
hit in the system-call path the frame's registers are the process's user registers (`task_pt_regs(current)`), and
`$bt` then records the process's own stack from its %rsp, read through its page tables, so the return address GDB
unwinds through is the program's; a kernel thread's hit takes the frame at the top of its kernel stack as gtp.c
does, its memory the kernel's."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from kgtp_sim.agent.opcodes import assemble
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.programs import Program, load_programs
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import Tracer
from kgtp_sim.tracing.core.builtins import BT_DEFAULT, BUILTIN_VARIABLES
from kgtp_sim.tracing.core.frames import MemoryBlock, TsvBlock
from kgtp_sim.tracing.tracer import ENGINES

from ..conftest import VMLINUX
from ..programs import compile_program

N = {b.name: b.number for b in BUILTIN_VARIABLES}
USER_CS, USER_SS = 0x33, 0x2B
TASK_SIZE = 0x800000000000
ORIG_AX = 16 * 8  #: struct pt_regs' orig_ax (fixtures/kernel/include/kernel.h)


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    return compile_program("syscalls", "glibc-static", tmp_path_factory.mktemp("current-user"))


def _functions(path: Path) -> dict[str, tuple[int, int]]:
    with path.open("rb") as f:
        symbols = ELFFile(f).get_section_by_name(".symtab")
        return {s.name: (s["st_value"], s["st_value"] + s["st_size"]) for s in symbols.iter_symbols()
                if s["st_info"]["type"] == "STT_FUNC" and s["st_size"]}


def _run(program: Path, engine: str, condition: str, actions: str, want) -> tuple[int, list]:
    """Trace do_syscall while the program runs until `want(pid, frames)`; the pid and the frames."""
    machine = Machine(KernelImage.load(VMLINUX), cpus=1)
    inside = load_programs(machine, [Program(program, (str(program),))])
    machine.start()
    try:
        pid = machine.processes.spawn(inside[program], [str(program)])
        tracer = Tracer(machine, engine)
        site = machine.image.address_of("do_syscall")
        tracer.definitions.define(t.DefineTracepoint(number=1, address=site, more=True,
                                                     condition=assemble(condition.format(pid=pid))))
        tracer.definitions.add_actions(t.TracepointActions(number=1, address=site,
                                                           actions=(t.EvalExpression(assemble(actions)),)))
        tracer.start()
        deadline = time.monotonic() + 60
        frames: list = []
        while time.monotonic() < deadline and not want(pid, frames):
            time.sleep(0.05)
            frames = tracer.frames()
        tracer.stop(t.StopReason.STOP_COMMAND)
        return pid, frames
    finally:
        machine.shutdown()


def _tsv(frame) -> dict[int, int]:
    return {b.number: b.value for b in frame.blocks if isinstance(b, TsvBlock)}


@pytest.mark.parametrize("engine", ENGINES)
def test_collect_current_records_the_process_user_registers_and_its_stack(program, engine):
    # trace do_syscall if $current_task_pid == PID && regs->orig_ax == 110 (getppid)
    # collect $current, $task_pt_regs, $bt
    pid, frames = _run(program, engine, f"getv {N['current_task_pid']:#x}; const16 {{pid:#x}}; equal; "
                       f"getv {N['task_pt_regs']:#x}; const8 {ORIG_AX:#x}; add; ref64; const8 0x6e; equal; "
                       "bit_and; end",
                       f"tracev {N['current']:#x}; tracev {N['task_pt_regs']:#x}; tracev {N['bt']:#x}; end",
                       lambda pid, frames: len(frames) >= 3)
    assert len(frames) >= 3
    functions = _functions(program)
    getppid, main = functions["getppid"], functions["main"]
    for frame in frames:
        regs = frame.registers
        assert regs is not None and len(regs) >= 20  # every register, though GDB sent no R action
        assert (regs["cs"], regs["ss"]) == (USER_CS, USER_SS)
        assert getppid[0] < regs["rip"] <= getppid[1]  # right after getppid's `syscall`
        assert 0 < regs["rsp"] < TASK_SIZE
        values = _tsv(frame)
        assert values[N["current"]] == values[N["task_pt_regs"]]  # the frame the registers came from
        stack = [b for b in frame.blocks if isinstance(b, MemoryBlock) and b.address == regs["rsp"]]
        assert len(stack) == 1 and len(stack[0].data) == BT_DEFAULT  # $bt: the process's stack, its own pages
        returns_to, = struct.unpack_from("<Q", stack[0].data)
        assert main[0] < returns_to < main[1]  # getppid has no frame: its caller's return address on top


@pytest.mark.parametrize("engine", ENGINES)
def test_a_kernel_threads_hit_takes_the_top_of_its_kernel_stack(program, engine):
    # collect $current, $current_task_user, $task_pt_regs at every hit, the kernel's threads' too
    _, frames = _run(program, engine, "const8 0x1; end",
                     f"tracev {N['current']:#x}; tracev {N['current_task_user']:#x}; "
                     f"tracev {N['task_pt_regs']:#x}; end",
                     lambda pid, frames: {_tsv(f)[N["current_task_user"]] for f in frames} == {0, 1})
    users = {_tsv(f)[N["current_task_user"]] for f in frames}
    assert users == {0, 1}
    for frame in frames:
        values, regs = _tsv(frame), frame.registers
        assert values[N["current"]] == values[N["task_pt_regs"]]
        assert (regs["cs"] & 3 == 3) == bool(values[N["current_task_user"]])
