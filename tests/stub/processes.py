"""What the process-target tests share (test_process_all_stop, test_process_non_stop, test_process_events,
test_breakpoint_conditions): a started machine whose processes' standard output is kept in `machine.written`, a
program's symbols, and the wait for the next stop as the server does it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

from elftools.elf.elffile import ELFFile

from kgtp_sim.client import VMLINUX
from kgtp_sim.machine import KernelImage, Machine


def started_machine(cpus: int) -> Iterator[Machine]:
    """A module fixture's body: the machine started, its processes' fd 1 collected, shut down at the end."""
    machine = Machine(KernelImage.load(VMLINUX), cpus=cpus)
    machine.written = bytearray()
    machine.processes.sink = lambda fd, data: machine.written.extend(data) if fd == 1 else None
    machine.start()
    yield machine
    machine.shutdown()


def symbol(program, name: str) -> int:
    """The address of `name` in a (not relocated) program's symbol table."""
    with open(program, "rb") as f:
        return ELFFile(f).get_section_by_name(".symtab").get_symbol_by_name(name)[0]["st_value"]


T = TypeVar("T")
WAIT_S = 60


def next_stop(machine: Machine, poll: Callable[[], T | None]) -> T:
    """`poll()`'s first answer that is not None, asked again each time the machine hears of a stop (as the server
    polls when the kernel tells it of one), never after a time window."""
    ptrace = machine.ptrace
    while True:
        serial = ptrace.serial
        stop = poll()
        if stop is not None:
            return stop
        ptrace.wait_serial(serial, WAIT_S)
