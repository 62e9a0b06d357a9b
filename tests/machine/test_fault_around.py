"""Fault-around (fixtures/kernel/mm.c, fault_around, Linux's do_fault_around): a read or instruction fetch that
faults in a page of a file area brings in the pages of its aligned 16-page window that the area's file covers, with
the file's bytes, so a library's code costs a fault per 64 KiB instead of one per page; a write to a private file
mapping, and any access to an anonymous one, still brings in that one page.

tests/programs/faultaround.c maps its own file read-only and privately writable, and 64 anonymous pages, touches
page 21 of each (a read, a write, a read), prints where they are and waits; the host then reads the process's page
tables (uc_paging through the process table) and compares the pages with the file on the host."""

from __future__ import annotations

import re

import pytest

from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.tasks import ProcessTable
from kgtp_sim.programs import Program, load_programs

from ..conftest import VMLINUX, wait_until
from ..programs import compile_program

PAGE = 4096
WINDOW = 16 * PAGE
TOUCHED = 21


@pytest.fixture(scope="module", params=[1, 2], ids=["1 CPU", "2 CPUs"])
def run(tmp_path_factory, request):
    path = compile_program("faultaround", "glibc-static", tmp_path_factory.mktemp("fault-around"))
    machine = Machine(KernelImage.load(VMLINUX), cpus=request.param)
    inside = load_programs(machine, [Program(path, (str(path),))])
    output: list[bytes] = []
    machine.processes.sink = lambda fd, data: output.append(data)
    machine.start()
    try:
        pid = machine.processes.spawn(inside[path], [str(path)])
        line = wait_until(lambda: re.search(rb"read (0x\w+) write (0x\w+) anon (0x\w+) size (\d+)", b"".join(output)),
                          "the program's mappings")
        read_map, write_map, anon = (int(line.group(i), 16) for i in (1, 2, 3))
        size = int(line.group(4))
        space = ProcessTable(machine).spaces()[pid]
        yield machine, space, path.read_bytes(), size, read_map, write_map, anon
    finally:
        machine.shutdown()


def _present(space, start: int, pages: int) -> set[int]:
    """The page numbers (from `start`) of the `pages` pages from `start` that the tables map."""
    return {i for i in range(pages) if space.translate(start + i * PAGE) is not None}


def test_a_read_of_a_file_mapping_brings_in_its_window_with_the_files_bytes(run):
    machine, space, data, size, read_map, _write_map, _anon = run
    assert size == len(data) and size >= 64 * PAGE
    touched = read_map + TOUCHED * PAGE
    first = max(read_map, touched & ~(WINDOW - 1))
    last = min(read_map + size, (touched & ~(WINDOW - 1)) + WINDOW)
    window = set(range((first - read_map) // PAGE, (last - read_map) // PAGE))
    assert TOUCHED in window and len(window) >= 2
    assert _present(space, read_map, size // PAGE) == window
    for page in window:
        assert machine.read_memory(read_map + page * PAGE, PAGE, space) == data[page * PAGE:(page + 1) * PAGE], page


def test_a_write_to_a_private_file_mapping_brings_in_one_page(run):
    machine, space, data, size, _read_map, write_map, _anon = run
    assert _present(space, write_map, size // PAGE) == {TOUCHED}
    page = machine.read_memory(write_map + TOUCHED * PAGE, PAGE, space)
    assert page[5:6] == b"X" and page[:5] + page[6:] == data[TOUCHED * PAGE:TOUCHED * PAGE + 5] + \
        data[TOUCHED * PAGE + 6:(TOUCHED + 1) * PAGE]


def test_an_anonymous_mapping_brings_in_one_page(run):
    _machine, space, _data, _size, _read_map, _write_map, anon = run
    assert _present(space, anon, 64) == {TOUCHED}
