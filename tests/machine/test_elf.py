"""The machine's own ELF reader (kgtp_sim/machine/elf.py) against pyelftools: the same program headers, section
headers, symbols, interpreter and dynamic tags, for the kernel image and for a dynamic program and its libraries;
and what it refuses."""

from __future__ import annotations

import io
import struct

import pytest
from elftools.elf.elffile import ELFFile
from elftools.elf.enums import ENUM_D_TAG, ENUM_SH_TYPE_BASE, ENUM_P_TYPE_BASE

from kgtp_sim.machine import elf as E
from kgtp_sim.machine.initramfs import runtime_files

from ..conftest import VMLINUX
from ..programs import compile_program


def _number(value, names: dict) -> int:
    """pyelftools gives a known value by name, an unknown one as a number."""
    return names[value] if isinstance(value, str) else value


def _same_as_pyelftools(path) -> None:
    data = path.read_bytes()
    ours, theirs = E.ElfFile(io.BytesIO(data)), ELFFile(io.BytesIO(data))
    assert (ours.bits, ours.entry) == (theirs.elfclass, theirs["e_entry"])
    assert [(s.type, s.flags, s.offset, s.vaddr, s.filesz, s.memsz) for s in ours.segments] == [
        (_number(s["p_type"], ENUM_P_TYPE_BASE), s["p_flags"], s["p_offset"], s["p_vaddr"], s["p_filesz"],
         s["p_memsz"]) for s in theirs.iter_segments()]
    assert [(s.name, s.type, s.flags, s.addr, s.offset, s.size, s.link, s.entsize) for s in ours.sections] == [
        (s.name, _number(s["sh_type"], ENUM_SH_TYPE_BASE), s["sh_flags"], s["sh_addr"], s["sh_offset"],
         s["sh_size"], s["sh_link"], s["sh_entsize"]) for s in theirs.iter_sections()]
    symtab = theirs.get_section_by_name(".symtab")
    assert [(s.name, s.value, s.size, E.SYMBOL_TYPES[s.type], s.bind) for s in ours.symbols()] == (
        [] if symtab is None else
        [(s.name, s["st_value"], s["st_size"], s["st_info"]["type"].removeprefix("STT_"),
          {"STB_LOCAL": 0, "STB_GLOBAL": 1, "STB_WEAK": 2}[s["st_info"]["bind"]]) for s in symtab.iter_symbols()])
    interp = next((s.get_interp_name() for s in theirs.iter_segments() if s["p_type"] == "PT_INTERP"), None)
    assert ours.interpreter() == interp
    dynamic = next((s for s in theirs.iter_segments() if s["p_type"] == "PT_DYNAMIC"), None)
    tags = ours.dynamic_tags()
    expected = [] if dynamic is None else [t for t in dynamic.iter_tags() if t.entry.d_tag != "DT_NULL"]
    assert [(tag, value) for tag, value in tags] == [
        (_number(t.entry.d_tag, ENUM_D_TAG), t.entry.d_val) for t in expected]
    for tag, value in tags:
        name = {E.DT_NEEDED: "needed", E.DT_SONAME: "soname", E.DT_RPATH: "rpath", E.DT_RUNPATH: "runpath"}.get(tag)
        if name:
            assert ours.dynamic_string(tags, value) == getattr(next(t for t in expected if t.entry.d_val == value
                                                                    and t.entry.d_tag == f"DT_{name.upper()}"), name)


def test_the_kernel_image_reads_as_pyelftools_reads_it():
    _same_as_pyelftools(VMLINUX)


def test_a_dynamic_program_and_its_libraries_read_as_pyelftools_reads_them(tmp_path):
    program = compile_program("hello", "glibc-dynamic", tmp_path)
    files = [program, *runtime_files(program).values()]
    assert len(files) >= 3  # the interpreter and libc at least
    for path in files:
        _same_as_pyelftools(path)


def test_what_is_not_a_64_bit_little_endian_elf_file():
    with pytest.raises(E.ElfError):
        E.ElfFile(io.BytesIO(b"#!/bin/sh\n" * 10))
    with pytest.raises(E.ElfError):
        E.ElfFile(io.BytesIO(b"\x7fELF"))
    # a 32-bit header: what it is can be read, its tables cannot
    header = b"\x7fELF\x01\x01\x01" + bytes(9) + struct.pack("<HH", E.ET_EXEC, 3) + bytes(32)
    elf = E.ElfFile(io.BytesIO(header))
    assert (elf.bits, elf.machine, elf.type, elf.readable) == (32, 3, E.ET_EXEC, False)
    assert E.header_name("ENUM_E_MACHINE", elf.machine) == "EM_386"
    with pytest.raises(E.ElfError):
        elf.segments
    truncated = VMLINUX.read_bytes()[:200]  # the header, not the tables it points at
    with pytest.raises(E.ElfError):
        E.ElfFile(io.BytesIO(truncated)).sections
