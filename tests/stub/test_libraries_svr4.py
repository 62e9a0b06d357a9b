"""The `<library-list-svr4>` document (stub/program.py: libraries_svr4, find_r_debug) over a process memory made
here: a PIE's program headers where its auxiliary vector says, its dynamic section with DT_DEBUG, r_debug and the
link_map chains of two namespaces, laid out as glibc's ld.so lays them (link.h). What gdbserver's linux-low.cc
answers for each: the list from r_debug, the augmented `start`/`prev`/`lmid` form, an empty list before the dynamic
linker set DT_DEBUG, None (E01) for a program without r_debug, and where a list that is cut or corrupted ends."""

from __future__ import annotations

import struct

import pytest

from kgtp_sim.stub.program import (AT_PHDR, AT_PHNUM, DT_DEBUG, DT_NULL, PT_DYNAMIC, PT_PHDR, find_r_debug,
                                   libraries_svr4)

PT_LOAD, PT_INTERP, DT_NEEDED, AT_ENTRY = 1, 3, 1, 9
BIAS = 0x5555_5555_4000  #: where the kernel loads a PIE
PHDR_VADDR, DYNAMIC_VADDR = 0x40, 0x3DE0
R_DEBUG = 0x7FFF_F7FF_E118  #: ld.so's _r_debug_extended
SECOND_R_DEBUG = 0x7FFF_F7FF_0100  #: a dlmopen namespace's
#: link_map addresses: the program, the libraries of the first namespace, one in the second
MAIN, LIBC, LDSO, OTHER = 0x7FFF_F7FF_E2E0, 0x7FFF_F7FC_0200, 0x7FFF_F7FF_DAD0, 0x7FFF_F7FF_0200
NAMES = {MAIN: b"", LIBC: b"/lib/x86_64-linux-gnu/libc.so.6", LDSO: b"/lib64/ld-linux-x86-64.so.2",
         OTHER: b"/opt/a\"b'<c>&d.so"}
NAME_AT = {lm: lm + 0x100 for lm in NAMES}


class Memory:
    """A process's memory: bytes at addresses; a read gives what is there from the address on (the readable
    prefix, as ProcessTarget.live_memory), nothing where nothing is."""

    def __init__(self) -> None:
        self.regions: dict[int, bytearray] = {}

    def put(self, address: int, data: bytes) -> None:
        self.regions[address] = bytearray(data)

    def read(self, address: int, length: int) -> bytes:
        for start, data in self.regions.items():
            if start <= address < start + len(data):
                return bytes(data[address - start: address - start + length])
        return b""


def _auxv(phdr: int, phnum: int) -> bytes:
    return struct.pack("<6Q", AT_PHDR, phdr, AT_PHNUM, phnum, 0, 0)


def _phdr(kind: int, vaddr: int) -> bytes:
    return struct.pack("<IIQQQQQQ", kind, 4, vaddr, vaddr, vaddr, 0x100, 0x100, 8)


def _link_map(l_addr: int, name: int, l_ld: int, l_next: int, l_prev: int) -> bytes:
    return struct.pack("<5Q", l_addr, name, l_ld, l_next, l_prev)


def program(debug: int = R_DEBUG, *, bias: int = BIAS, headers: tuple[int, ...] = (PT_PHDR, PT_INTERP, PT_LOAD,
                                                                                    PT_DYNAMIC),
            tags: tuple[int, ...] = (DT_NEEDED, DT_DEBUG, DT_NULL), version: int = 2) -> tuple[bytes, Memory]:
    """The auxiliary vector and memory of a dynamically linked program stopped after its dynamic linker ran:
    DT_DEBUG holds `debug`; r_debug (`version`) lists the program, libc and ld.so, and (version 2) a second
    namespace holding OTHER."""
    memory = Memory()
    vaddrs = {PT_PHDR: PHDR_VADDR, PT_DYNAMIC: DYNAMIC_VADDR}
    memory.put(bias + PHDR_VADDR, b"".join(_phdr(kind, vaddrs.get(kind, 0)) for kind in headers))
    memory.put(bias + DYNAMIC_VADDR, b"".join(struct.pack("<qQ", tag, debug if tag == DT_DEBUG else 7)
                                              for tag in tags))
    memory.put(R_DEBUG, struct.pack("<iiQQiiQQ", version, 0, MAIN, 0x7FFF_F7FD_4B70, 0, 0, 0x7FFF_F7FC_A000,
                                    SECOND_R_DEBUG))
    memory.put(SECOND_R_DEBUG, struct.pack("<iiQQiiQQ", 2, 0, OTHER, 0, 0, 0, 0, 0))
    memory.put(MAIN, _link_map(bias, NAME_AT[MAIN], bias + DYNAMIC_VADDR, LIBC, 0))
    memory.put(LIBC, _link_map(0x7FFF_F7DD_5000, NAME_AT[LIBC], 0x7FFF_F7FA_7B60, LDSO, MAIN))
    memory.put(LDSO, _link_map(0x7FFF_F7FC_A000, NAME_AT[LDSO], 0x7FFF_F7FF_CE40, 0, LIBC))
    memory.put(OTHER, _link_map(0x7FFF_F000_0000, NAME_AT[OTHER], 0x7FFF_F000_3000, 0, 0))
    for lm, name in NAMES.items():
        memory.put(NAME_AT[lm], name + b"\0")
    return _auxv(bias + PHDR_VADDR, len(headers)), memory


def _library(name: bytes, lm: int, l_addr: int, l_ld: int, lmid: int) -> bytes:
    return b'<library name="%s" lm="0x%x" l_addr="0x%x" l_ld="0x%x" lmid="0x%x"/>' % (name, lm, l_addr, l_ld, lmid)


LIBC_ENTRY = _library(NAMES[LIBC], LIBC, 0x7FFF_F7DD_5000, 0x7FFF_F7FA_7B60, R_DEBUG)
LDSO_ENTRY = _library(NAMES[LDSO], LDSO, 0x7FFF_F7FC_A000, 0x7FFF_F7FF_CE40, R_DEBUG)
OTHER_ENTRY = _library(b"/opt/a&quot;b&apos;&lt;c&gt;&amp;d.so", OTHER, 0x7FFF_F000_0000, 0x7FFF_F000_3000,
                       SECOND_R_DEBUG)


def test_every_namespace_from_r_debug_the_program_as_main_lm_names_escaped():
    vector, memory = program()
    assert find_r_debug(vector, memory.read) == R_DEBUG
    assert libraries_svr4(vector, memory.read) == (
        b'<library-list-svr4 version="1.0" main-lm="0x%x">' % MAIN + LIBC_ENTRY + LDSO_ENTRY + OTHER_ENTRY
        + b"</library-list-svr4>")


def test_r_debug_version_1_has_no_next_namespace():
    vector, memory = program(version=1)
    assert libraries_svr4(vector, memory.read) == (
        b'<library-list-svr4 version="1.0" main-lm="0x%x">' % MAIN + LIBC_ENTRY + LDSO_ENTRY + b"</library-list-svr4>")


def test_before_the_dynamic_linker_set_dt_debug_the_list_is_empty_and_valid():
    vector, memory = program(debug=0)
    assert find_r_debug(vector, memory.read) == 0
    assert libraries_svr4(vector, memory.read) == b'<library-list-svr4 version="1.0"></library-list-svr4>'


def test_a_program_loaded_where_it_was_linked_has_no_bias():
    vector, memory = program(bias=0)
    assert find_r_debug(vector, memory.read) == R_DEBUG


@pytest.mark.parametrize("headers, tags", [
    ((PT_LOAD, PT_DYNAMIC), (DT_DEBUG, DT_NULL)),  # no PT_PHDR: no load bias to find (a static program's)
    ((PT_PHDR, PT_LOAD), (DT_DEBUG, DT_NULL)),  # no PT_DYNAMIC
    ((PT_PHDR, PT_LOAD, PT_DYNAMIC), (DT_NEEDED, DT_NULL, DT_DEBUG)),  # DT_DEBUG after the end
], ids=["no-pt-phdr", "no-pt-dynamic", "no-dt-debug"])
def test_a_program_without_r_debug_has_no_list(headers, tags):
    """gdbserver answers E01 (get_r_debug's -1), and GDB then looks in the memory itself."""
    vector, memory = program(headers=headers, tags=tags)
    assert find_r_debug(vector, memory.read) is None
    assert libraries_svr4(vector, memory.read) is None


def test_an_auxiliary_vector_without_program_headers_has_no_list():
    _vector, memory = program()
    assert libraries_svr4(struct.pack("<4Q", AT_ENTRY, BIAS + 0x1000, 0, 0), memory.read) is None
    assert libraries_svr4(_auxv(BIAS + PHDR_VADDR, 100), memory.read) is None  # gdbserver's sanity bound
    assert libraries_svr4(_auxv(BIAS + 0x9000, 4), memory.read) is None  # headers that cannot be read


def test_start_prev_and_lmid_walk_one_namespace_from_start():
    """GDB's augmented request after a library loaded: from `start` on, `prev` the one before it, each object
    with the `lmid` given (0 when none is)."""
    vector, memory = program()
    assert libraries_svr4(vector, memory.read, lmid=R_DEBUG, start=LDSO, prev=LIBC) == (
        b'<library-list-svr4 version="1.0">' + LDSO_ENTRY + b"</library-list-svr4>")
    assert libraries_svr4(vector, memory.read, start=LIBC, prev=MAIN) == (
        b'<library-list-svr4 version="1.0">' + LIBC_ENTRY.replace(b'lmid="0x%x"' % R_DEBUG, b'lmid="0x0"')
        + LDSO_ENTRY.replace(b'lmid="0x%x"' % R_DEBUG, b'lmid="0x0"') + b"</library-list-svr4>")
    # a start whose l_prev is not `prev`: nothing (gdbserver: "Corrupted shared library list")
    assert libraries_svr4(vector, memory.read, start=LDSO, prev=MAIN) == (
        b'<library-list-svr4 version="1.0"></library-list-svr4>')


def test_a_corrupted_list_ends_where_l_prev_disagrees():
    vector, memory = program(version=1)
    memory.put(LDSO, _link_map(0x7FFF_F7FC_A000, NAME_AT[LDSO], 0x7FFF_F7FF_CE40, 0, MAIN))  # not LIBC
    assert libraries_svr4(vector, memory.read) == (
        b'<library-list-svr4 version="1.0" main-lm="0x%x">' % MAIN + LIBC_ENTRY + b"</library-list-svr4>")


def test_a_cycle_whose_links_agree_ends_once_round():
    """start=LIBC, prev=LDSO over LIBC <-> LDSO pointing at each other both ways: every l_prev agrees, and the walk
    still ends, after each object once."""
    vector, memory = program()
    memory.put(LIBC, _link_map(0x7FFF_F7DD_5000, NAME_AT[LIBC], 0x7FFF_F7FA_7B60, LDSO, LDSO))
    memory.put(LDSO, _link_map(0x7FFF_F7FC_A000, NAME_AT[LDSO], 0x7FFF_F7FF_CE40, LIBC, LIBC))
    document = libraries_svr4(vector, memory.read, lmid=R_DEBUG, start=LIBC, prev=LDSO)
    assert document == b'<library-list-svr4 version="1.0">' + LIBC_ENTRY + LDSO_ENTRY + b"</library-list-svr4>"


def test_what_cannot_be_read_ends_the_list_and_an_unreadable_name_is_not_listed():
    vector, memory = program(version=1)
    memory.put(LIBC, _link_map(0x7FFF_F7DD_5000, 0xDEAD_0000, 0x7FFF_F7FA_7B60, 0x1000, MAIN))  # name, next: nowhere
    assert libraries_svr4(vector, memory.read) == (
        b'<library-list-svr4 version="1.0" main-lm="0x%x"></library-list-svr4>' % MAIN)


def test_an_r_debug_that_cannot_be_read_still_gives_a_valid_document():
    """gdbserver leaves its opening tag unclosed there; the document here stays well-formed."""
    vector, memory = program(debug=0x1000)
    assert libraries_svr4(vector, memory.read) == b'<library-list-svr4 version="1.0"></library-list-svr4>'
    vector, memory = program()
    memory.put(R_DEBUG, struct.pack("<i", 0))  # a version GDB does not know
    assert libraries_svr4(vector, memory.read) == b'<library-list-svr4 version="1.0"></library-list-svr4>'


def test_a_long_name_is_read_across_pages_up_to_path_max():
    vector, memory = program(version=1)
    name = b"/" + b"d" * 5000
    memory.put(NAME_AT[LIBC], name + b"\0")
    document = libraries_svr4(vector, memory.read)
    assert b'name="%s"' % name[:4095] in document
    memory.put(NAME_AT[LIBC], name[:3000] + b"\0")
    assert b'name="%s"' % name[:3000] in libraries_svr4(vector, memory.read)
