"""ELF64 files as the machine loads them, read with struct: the file header, the program headers, the section
headers and their names, the symbol table, a dynamic segment's tags and the interpreter's path.

The kernel image (image.py) and the programs packed into the initramfs (initramfs.py, what a dynamic linker reads
of them) need only these tables. pyelftools parses each entry through its construct layer and its import loads its
DWARF readers too: both were a good part of what `kgtp-sim run` spent before the machine booted. The kernel's DWARF
stays pyelftools' (dwarf.py). Little-endian 64-bit files only (x86_64's): the header of any other ELF file is read
(`bits`, `machine`), its tables are not.

Pure (no machine, no threads): whoever loads a file reads it.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import BinaryIO

ET_EXEC, ET_DYN = 2, 3
EM_X86_64 = 62
PT_LOAD, PT_DYNAMIC, PT_INTERP = 1, 2, 3
PF_X, PF_W, PF_R = 1, 2, 4
SHF_ALLOC, SHF_EXECINSTR = 2, 4
STB_LOCAL = 0
#: st_info's low 4 bits, as the ELF specification names them (less the STT_ prefix)
SYMBOL_TYPES = {0: "NOTYPE", 1: "OBJECT", 2: "FUNC", 3: "SECTION", 4: "FILE", 5: "COMMON", 6: "TLS", 7: "NUM",
                8: "RELC", 9: "SRELC", 10: "LOOS", 12: "HIOS", 13: "LOPROC", 15: "HIPROC"}
DT_NULL, DT_NEEDED, DT_STRTAB, DT_SONAME, DT_RPATH, DT_RUNPATH = 0, 1, 5, 14, 15, 29

_IDENT = 16
_HEADER = struct.Struct("<HHIQQQIHHHHHH")  #: e_type ... e_shstrndx, after e_ident
_SEGMENT = struct.Struct("<IIQQQQQQ")  #: p_type, p_flags, p_offset, p_vaddr, p_paddr, p_filesz, p_memsz, p_align
_SECTION = struct.Struct("<IIQQQQIIQQ")  #: sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, ...
_SYMBOL = struct.Struct("<IBBHQQ")  #: st_name, st_info, st_other, st_shndx, st_value, st_size
_DYNAMIC = struct.Struct("<qQ")  #: d_tag, d_val
_SHN_XINDEX = 0xFFFF


def header_name(table: str, value: int) -> str:
    """pyelftools' name of a header value (`table` "ENUM_E_MACHINE": EM_AARCH64; "ENUM_E_TYPE": ET_REL), for an
    error message: pyelftools is imported there only."""
    from elftools.elf import enums

    return next((name for name, number in getattr(enums, table).items() if number == value), str(value))


class ElfError(ValueError):
    """Not an ELF file, or tables that are not where its header says."""


@dataclass(frozen=True)
class Segment:
    """A program header."""

    type: int
    flags: int
    offset: int
    vaddr: int
    filesz: int
    memsz: int


@dataclass(frozen=True)
class Section:
    """A section header, its name read from the section-name table."""

    name: str
    type: int
    flags: int
    addr: int
    offset: int
    size: int
    link: int
    entsize: int


@dataclass(frozen=True)
class ElfSymbol:
    name: str
    value: int
    size: int
    type: int  #: STT_*, st_info's low 4 bits (SYMBOL_TYPES names them)
    bind: int  #: STB_*, its high 4 bits


class ElfFile:
    """An ELF file open for reading (`stream`: seek and read; it stays the caller's to close). Raises ElfError if
    the stream does not start with an ELF header."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        stream.seek(0)
        ident = stream.read(_IDENT)
        if len(ident) < _IDENT or ident[:4] != b"\x7fELF" or ident[4] not in (1, 2) or ident[5] not in (1, 2):
            raise ElfError("no ELF header")
        self.bits = 32 * ident[4]  #: 32 or 64 (EI_CLASS)
        self.little_endian = ident[5] == 1
        order = "<" if self.little_endian else ">"
        self.type, self.machine = struct.unpack(order + "HH", self._read(_IDENT, 4))
        self.readable = self.bits == 64 and self.little_endian  #: whether the tables below can be read
        if self.readable:
            (_, _, _, self.entry, self._phoff, self._shoff, _, _, self._phentsize, self._phnum, self._shentsize,
             self._shnum, self._shstrndx) = _HEADER.unpack(self._read(_IDENT, _HEADER.size))

    def _read(self, offset: int, size: int) -> bytes:
        self._stream.seek(offset)
        data = self._stream.read(size)
        if len(data) != size:
            raise ElfError(f"{size} bytes at file offset {offset:#x} run past the end of the file")
        return data

    def read(self, offset: int, size: int) -> bytes:
        """`size` bytes of the file from `offset` (ElfError if the file is shorter)."""
        return self._read(offset, size)

    def _tables(self) -> None:
        if not self.readable:
            raise ElfError(f"a {self.bits}-bit {'little' if self.little_endian else 'big'}-endian file's tables")

    # ---- program headers ---------------------------------------------------------------------------------

    @functools.cached_property
    def segments(self) -> tuple[Segment, ...]:
        self._tables()
        if not self._phnum:
            return ()
        if self._phentsize < _SEGMENT.size:
            raise ElfError(f"program headers of {self._phentsize} bytes")
        table = self._read(self._phoff, self._phentsize * self._phnum)
        out = []
        for index in range(self._phnum):
            kind, flags, offset, vaddr, _paddr, filesz, memsz, _align = _SEGMENT.unpack_from(
                table, index * self._phentsize)
            out.append(Segment(kind, flags, offset, vaddr, filesz, memsz))
        return tuple(out)

    def file_offset(self, address: int) -> int | None:
        """Where the byte at virtual address `address` is in the file (a PT_LOAD's file part), None if nowhere."""
        return next((address - s.vaddr + s.offset for s in self.segments
                     if s.type == PT_LOAD and s.vaddr <= address < s.vaddr + s.filesz), None)

    def string(self, offset: int) -> str:
        """The NUL-terminated UTF-8 string at file offset `offset` (undecodable bytes replaced)."""
        self._stream.seek(offset)
        data = b""
        while b"\0" not in data:
            chunk = self._stream.read(256)
            if not chunk:
                raise ElfError(f"no string end after file offset {offset:#x}")
            data += chunk
        return data[: data.index(b"\0")].decode("utf-8", "replace")

    def interpreter(self) -> str | None:
        """PT_INTERP's path, None if the file has none."""
        interp = next((s for s in self.segments if s.type == PT_INTERP), None)
        return None if interp is None else self.string(interp.offset)

    def dynamic_tags(self) -> list[tuple[int, int]]:
        """The dynamic segment's (d_tag, d_val) up to DT_NULL; [] if there is none."""
        dynamic = next((s for s in self.segments if s.type == PT_DYNAMIC), None)
        if dynamic is None:
            return []
        tags = []
        for tag, value in _DYNAMIC.iter_unpack(self._read(dynamic.offset, dynamic.filesz - dynamic.filesz % 16)):
            if tag == DT_NULL:
                break
            tags.append((tag, value))
        return tags

    def dynamic_string(self, tags: list[tuple[int, int]], offset: int) -> str:
        """The string at `offset` in the dynamic string table (DT_STRTAB's address, as the dynamic linker finds it)."""
        table = next((value for tag, value in tags if tag == DT_STRTAB), None)
        at = None if table is None else self.file_offset(table)
        if at is None:
            raise ElfError("dynamic tags with no string table in the file")
        return self.string(at + offset)

    # ---- section headers ---------------------------------------------------------------------------------

    @functools.cached_property
    def sections(self) -> tuple[Section, ...]:
        self._tables()
        if not self._shoff:
            return ()
        if self._shentsize < _SECTION.size:
            raise ElfError(f"section headers of {self._shentsize} bytes")
        first = _SECTION.unpack(self._read(self._shoff, _SECTION.size))
        count = self._shnum or first[5]  # 0: the count is the first header's sh_size (more than 0xff00 sections)
        names_index = first[6] if self._shstrndx == _SHN_XINDEX else self._shstrndx
        table = self._read(self._shoff, self._shentsize * count)
        raw = [_SECTION.unpack_from(table, index * self._shentsize) for index in range(count)]
        names = b""
        if 0 < names_index < count:
            names = self._read(raw[names_index][4], raw[names_index][5])
        out = []
        for name, kind, flags, addr, offset, size, link, _info, _align, entsize in raw:
            end = names.find(b"\0", name)
            out.append(Section(names[name:end if end >= 0 else len(names)].decode("utf-8", "replace"), kind, flags,
                               addr, offset, size, link, entsize))
        return tuple(out)

    def section(self, name: str) -> Section | None:
        return next((s for s in self.sections if s.name == name), None)

    def section_data(self, section: Section) -> bytes:
        return self._read(section.offset, section.size)

    def symbols(self) -> list[ElfSymbol]:
        """The entries of .symtab in order (the null symbol first), [] if the file has none."""
        symtab = self.section(".symtab")
        if symtab is None:
            return []
        if not 0 <= symtab.link < len(self.sections):
            raise ElfError(f".symtab's string table is section {symtab.link}")
        names = self.section_data(self.sections[symtab.link])
        data = self.section_data(symtab)
        size = symtab.entsize or _SYMBOL.size
        if size < _SYMBOL.size:
            raise ElfError(f"symbols of {size} bytes")
        out = []
        for offset in range(0, len(data) - size + 1, size):
            name, info, _other, _section, value, length = _SYMBOL.unpack_from(data, offset)
            end = names.find(b"\0", name)
            out.append(ElfSymbol(names[name:end if end >= 0 else len(names)].decode("utf-8", "replace"), value,
                                 length, info & 0xF, info >> 4))
        return out
