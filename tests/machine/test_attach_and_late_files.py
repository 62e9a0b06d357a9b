"""The kernel's machine requests while it runs (fixtures/kernel: process.c serve_request): files added to the
initramfs (initramfs.c: ramfs_reserve, ramfs_add; machine/process.py: Processes.add_files), PTRACE_ATTACH of every
thread of a running process (ptrace.c: ptrace_attach; machine/tracee.py: Ptrace.attach), and the machine's process
listing (Processes.listing)."""

from __future__ import annotations

import time

import pytest

from kgtp_sim.client import VMLINUX
from kgtp_sim.machine import KernelImage, Machine, MachineError
from kgtp_sim.machine.initramfs import Archive
from kgtp_sim.programs import install_program

from ..programs import compile_program


@pytest.fixture(scope="module")
def machine():
    machine = Machine(KernelImage.load(VMLINUX), cpus=2)
    machine.start()
    yield machine
    machine.shutdown()


def test_a_program_added_while_the_kernel_runs_runs_and_its_libraries_go_in_once(machine, tmp_path):
    hello = compile_program("hello", "glibc-dynamic", tmp_path)
    inside = install_program(machine, hello)
    assert "/lib/x86_64-linux-gnu/libc.so.6" in machine.processes.files
    before = len(machine.processes.output[1])
    pid = machine.processes.spawn(inside, [inside], [])
    assert machine.processes.wait(pid, 30).code == 3  # hello.c's status
    assert b"hello" in bytes(machine.processes.output[1][before:])
    archive = Archive()
    archive.add_program(hello)
    assert machine.processes.add_files(archive) == []  # the same bytes: nothing added again


def test_a_file_added_again_with_other_bytes_shadows_the_older(machine, tmp_path):
    args = compile_program("args", "glibc-static", tmp_path)
    hello = compile_program("hello", "glibc-static", tmp_path)
    archive = Archive()
    archive.add_host_file(args, "/late/prog")
    assert machine.processes.add_files(archive) == ["/late/prog"]
    archive = Archive()
    archive.add_host_file(hello, "/late/prog")
    assert machine.processes.add_files(archive) == ["/late/prog"]
    before = len(machine.processes.output[1])
    pid = machine.processes.spawn("/late/prog", ["/late/prog", "one"], [])
    assert machine.processes.wait(pid, 30).code == 3  # hello's, not args
    assert b"hello" in bytes(machine.processes.output[1][before:])


def test_attach_stops_every_thread_and_refuses_what_it_cannot_take(machine, tmp_path):
    workers = compile_program("workers", "glibc-static", tmp_path)
    inside = install_program(machine, workers)
    pid = machine.processes.spawn(inside, [inside, "forever"], [])
    deadline = time.monotonic() + 30
    while len(machine.ptrace.threads_of(pid)) < 4:  # main and its three workers, once made
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.01)
    listed = {entry.pid: entry for entry in machine.processes.listing()}
    assert listed[pid].command == f"{inside} forever"
    assert listed[0].command == "[swapper/0]"
    threads = machine.ptrace.attach(pid)
    assert next(iter(threads)) == pid and len(threads) == 4  # the leader first, and its three workers
    assert set(threads) == set(machine.ptrace.threads_of(pid))
    for tid in threads:
        assert machine.ptrace.stop_of(tid) is not None
    with pytest.raises(MachineError, match="Operation not permitted"):  # traced already
        machine.ptrace.attach(pid)
    with pytest.raises(MachineError, match="Operation not permitted"):  # a kernel thread
        machine.ptrace.attach(2)
    with pytest.raises(MachineError, match="No such process"):
        machine.ptrace.attach(31999)
    if len(threads) > 1:
        with pytest.raises(MachineError, match="No such process"):  # a thread's id is no process's
            machine.ptrace.attach(list(threads)[1])
    threads[pid].kill()
    assert machine.processes.wait(pid, 30) is not None
