"""What the process-target tests share (test_process_all_stop, test_process_non_stop, test_process_events): a
started machine whose processes' standard output is kept in `machine.written`, and a program's symbols."""

from __future__ import annotations

from collections.abc import Iterator

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
