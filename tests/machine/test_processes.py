"""The machine's side of processes (kgtp_sim/machine/process.py) against the kernel it talks to."""

from __future__ import annotations

import pytest

from kgtp_sim.client import VMLINUX
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine import process
from kgtp_sim.machine.process import SpawnError
from kgtp_sim.machine.dwarf import KernelDwarf


def test_spawn_request_layout_is_the_kernels():
    dwarf = KernelDwarf(VMLINUX)
    try:
        _address, request = dwarf.global_variable("spawn_request")
        offsets = {name: request.member(name)[0] for name in ("seq", "done", "result", "cpu", "flags", "args")}
        args = request.member("args")[1]
        assert offsets == {"seq": process.SPAWN_SEQ, "done": process.SPAWN_DONE, "result": process.SPAWN_RESULT,
                           "cpu": process.SPAWN_CPU, "flags": process.SPAWN_FLAGS, "args": process.SPAWN_ARGC}
        assert offsets["args"] + args.member("strings")[0] == process.SPAWN_STRINGS
        assert args.member("strings")[1].size == process.SPAWN_ARGS_SIZE
    finally:
        dwarf.close()


def test_requests_the_kernel_cannot_take_are_refused_on_the_host():
    machine = Machine(KernelImage.load(VMLINUX))
    with pytest.raises(SpawnError, match="NUL"):
        machine.processes.spawn("/bin/x", ["x", "a\0b"])
    with pytest.raises(SpawnError, match="4096"):
        machine.processes.spawn("/bin/x", ["x", "y" * 5000])


def test_the_initramfs_is_loaded_before_boot_only():
    machine = Machine(KernelImage.load(VMLINUX))
    machine.processes.load_archive(b"070701" + b"0" * 200)
    assert machine.read_symbol("initrd_size") == 206
    start = machine.read_symbol("initrd_start")
    assert start % 4096 == 0 and start + 206 <= process.PHYS_RAM + process.RAM_SIZE
    machine.start()
    try:
        with pytest.raises(Exception, match="before the machine starts"):
            machine.processes.load_archive(b"")
    finally:
        machine.shutdown()


def test_two_processes_on_two_cpus_run_in_their_own_address_spaces(tmp_path):
    """One unicorn CPU stands for both CPUs: switching between them must not carry one process's TLB entries
    into the other's address space (both programs load at the same addresses, so a stale entry reaches the
    other's pages: a segfault within a few rounds). Both run on, each writing its rounds."""
    import time

    from kgtp_sim.machine.initramfs import Archive

    from ..programs import compile_program

    program = compile_program("syscalls", "glibc-static", tmp_path)
    archive = Archive()
    inside = archive.add_program(program)
    machine = Machine(KernelImage.load(VMLINUX), cpus=2)
    machine.processes.load_archive(archive.pack())
    rounds = []
    machine.processes.sink = lambda fd, data: rounds.append(data.count(b"round\n"))
    machine.start()
    try:
        pids = [machine.processes.spawn(inside, ["syscalls"]) for _ in range(2)]
        deadline = time.monotonic() + 120
        while sum(rounds) < 40 and not machine.processes.exited():
            assert time.monotonic() < deadline, "the programs made no progress"
            time.sleep(0.05)
        ended = machine.processes.exited()
    finally:
        machine.shutdown()
    assert not ended, (pids, ended, machine.console_text()[-2000:])


def test_each_request_rings_cpu_0_which_takes_the_vector(tmp_path):
    """The host writes a request, bumps its seq and rings CPU 0 (HOST_REQUEST_VECTOR): the kernel has a gate for
    the vector and serves the request from it, not only at CPU 0's next tick; every ring is taken, the requests'
    answers are the kernel's (files listed, a program started and ended)."""
    from kgtp_sim.programs import install_program

    from ..conftest import wait_until
    from ..programs import compile_program

    program = compile_program("hello", "glibc-static", tmp_path)
    machine = Machine(KernelImage.load(VMLINUX), hz=10)  # ticks 100 ms apart: a request served at once is rung
    assert process.HOST_REQUEST_ENTRY in machine.image.symbols
    machine.start()
    try:
        rung = lambda: machine.cpu.delivered[process.HOST_REQUEST_VECTOR]  # noqa: E731
        inside = install_program(machine, program)  # two requests: room for the files, then their listing
        wait_until(lambda: rung() == 2, "two rings taken")
        pid = machine.processes.spawn(inside, [inside])
        wait_until(lambda: rung() == 3, "the spawn's ring taken")
        ended = machine.processes.wait(pid, 60)
        assert ended is not None and ended.code == 3, machine.console_text()[-2000:]
    finally:
        machine.shutdown()
