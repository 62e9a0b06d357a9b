"""The kernel ELF as the machine and the stub need it: loadable segments, symbols, text, the marker table.

Everything is read from the file (program headers, the symbol table, section `kgtp_markers`); nothing about the
bundled kernel is hard-coded, so any x86_64 ELF linked the same way loads. The file is read once into memory:
`read_code` serves the original bytes even after the stub patched the live kernel.

Thread: loaded on the thread that builds the machine (the main thread of `kgtp-sim serve`; a tool's, the benchmark's
or a test's); nothing changes it afterwards, so any thread reads it: the server thread (symbols, the marker list)
and whichever thread the tracer plans and patches a location on.
"""

from __future__ import annotations

import bisect
import io
import struct
from dataclasses import dataclass
from pathlib import Path

from . import elf as E
from .errors import KernelImageError
from .markers import Marker, parse_markers

MARKER_SECTION = "kgtp_markers"


@dataclass(frozen=True)
class Symbol:
    name: str
    address: int
    size: int
    type: str  #: "FUNC", "OBJECT", "NOTYPE", ...

    @property
    def end(self) -> int:
        return self.address + self.size

    def __contains__(self, address: int) -> bool:
        return self.address <= address < self.address + max(self.size, 1)


@dataclass(frozen=True)
class Segment:
    """One PT_LOAD: `data` is the file part; memory up to `memsz` beyond it is zero (bss)."""

    vaddr: int
    memsz: int
    data: bytes
    readable: bool
    writable: bool
    executable: bool

    @property
    def end(self) -> int:
        return self.vaddr + self.memsz


class KernelImage:
    """A loaded kernel ELF. Build with `KernelImage.load(path)`."""

    def __init__(
        self,
        path: Path,
        entry: int,
        segments: tuple[Segment, ...],
        symbols: dict[str, Symbol],
        text_range: tuple[int, int],
        sections: dict[str, tuple[int, int]],
    ) -> None:
        self.path = path
        self.entry = entry
        self.segments = segments
        self.symbols = symbols
        self.text_range = text_range
        #: name -> (address, size) of every allocated section
        self.sections = sections
        self._sized = sorted((s for s in symbols.values() if s.size and s.type in ("FUNC", "OBJECT")),
                             key=lambda s: s.address)
        self._starts = [s.address for s in self._sized]
        self._functions = [s for s in self._sized if s.type == "FUNC"]
        self._function_starts = [s.address for s in self._functions]
        self.markers: tuple[Marker, ...] = ()
        #: (faulting instruction, fixup) pairs of the kernel's __ex_table: instructions that may fault by design
        self.exception_table: tuple[tuple[int, int], ...] = ()

    # ---- loading ---------------------------------------------------------------------------------------------

    #: images read ahead by `preload`, by (path, size, mtime): each is handed to the first `load` of that file
    _preloaded: dict[tuple[str, int, int], KernelImage] = {}

    @classmethod
    def preload(cls, path: str | Path) -> None:
        """Read `path` now for a later `load` in this process or in its forks (warm.py: each fork's server is
        handed the image its parent read, the parent's copy untouched by what the fork's machine does to it)."""
        key = cls.file_key(Path(path))
        if key is not None:
            cls._preloaded[key] = cls.load(path)

    @staticmethod
    def file_key(path: Path) -> tuple[str, int, int] | None:
        """The file as it is now (resolved path, size, modification time); None where it cannot be read."""
        try:
            info = path.stat()
        except OSError:
            return None
        return str(path.resolve()), info.st_size, info.st_mtime_ns

    @classmethod
    def load(cls, path: str | Path) -> KernelImage:
        path = Path(path)
        if cls._preloaded:
            key = cls.file_key(path)
            if key is not None and key in cls._preloaded:
                return cls._preloaded.pop(key)
        try:
            raw = path.read_bytes()
        except OSError as error:
            raise KernelImageError(f"cannot read kernel image {path}: {error.strerror or error}") from None
        try:
            elf = E.ElfFile(io.BytesIO(raw))
        except E.ElfError as error:
            raise KernelImageError(f"{path}: not a usable ELF file ({error})") from None
        try:
            return cls._from_elf(path, elf)
        except (KeyError, ValueError, IndexError, struct.error) as error:  # malformed tables inside an ELF
            raise KernelImageError(f"{path}: malformed ELF ({error})") from None

    @classmethod
    def _from_elf(cls, path: Path, elf: E.ElfFile) -> KernelImage:
        if elf.bits != 64 or elf.machine != E.EM_X86_64:
            machine = E.header_name("ENUM_E_MACHINE", elf.machine)
            raise KernelImageError(f"{path}: not an x86_64 ELF ({machine}, {elf.bits}-bit)")
        if elf.type != E.ET_EXEC:
            kind = E.header_name("ENUM_E_TYPE", elf.type)
            raise KernelImageError(f"{path}: not a linked executable (ELF type {kind})")
        segments = [Segment(vaddr=seg.vaddr, memsz=seg.memsz, data=elf.read(seg.offset, seg.filesz),
                            readable=bool(seg.flags & E.PF_R), writable=bool(seg.flags & E.PF_W),
                            executable=bool(seg.flags & E.PF_X))
                    for seg in elf.segments if seg.type == E.PT_LOAD and seg.memsz]
        if not segments:
            raise KernelImageError(f"{path}: no loadable segments")

        symbols: dict[str, Symbol] = {}
        for sym in elf.symbols():
            kind = E.SYMBOL_TYPES.get(sym.type, str(sym.type))
            if not sym.name or kind in ("FILE", "SECTION"):
                continue
            # a global wins over a local of the same name (static helpers may repeat across files)
            if sym.name in symbols and sym.bind == E.STB_LOCAL:
                continue
            symbols[sym.name] = Symbol(sym.name, sym.value, sym.size, kind)
        sections = {}
        text_lo, text_hi = None, None
        for sec in elf.sections:
            if not sec.flags & E.SHF_ALLOC:
                continue
            sections[sec.name] = (sec.addr, sec.size)
            if sec.flags & E.SHF_EXECINSTR and sec.size:
                lo, hi = sec.addr, sec.addr + sec.size
                text_lo = lo if text_lo is None else min(text_lo, lo)
                text_hi = hi if text_hi is None else max(text_hi, hi)
        if text_lo is None:
            executable = [s for s in segments if s.executable]
            if not executable:
                raise KernelImageError(f"{path}: no executable code")
            text_lo, text_hi = min(s.vaddr for s in executable), max(s.end for s in executable)

        image = cls(path, elf.entry, tuple(segments), symbols, (text_lo, text_hi), sections)
        if "__ex_table" in sections:
            address, size = sections["__ex_table"]
            raw_table = image.read(address, size - size % 16)
            image.exception_table = tuple(struct.iter_unpack("<QQ", raw_table))
        if MARKER_SECTION in sections:
            address, size = sections[MARKER_SECTION]
            image.markers = parse_markers(image.read(address, size), image.read, image.read_string, address)
        return image

    # ---- queries ---------------------------------------------------------------------------------------------

    def address_of(self, name: str) -> int:
        try:
            return self.symbols[name].address
        except KeyError:
            raise KeyError(f"no symbol {name!r} in {self.path}") from None

    def symbol_at(self, address: int) -> Symbol | None:
        """The function or object whose [start, start+size) holds `address`."""
        i = bisect.bisect_right(self._starts, address) - 1
        while i >= 0:
            sym = self._sized[i]
            if address in sym:
                return sym
            if sym.address + sym.size <= address and i and self._sized[i - 1].end <= sym.address:
                break
            i -= 1
        return None

    def function_at(self, address: int) -> Symbol | None:
        i = bisect.bisect_right(self._function_starts, address) - 1
        if i >= 0 and address in self._functions[i]:
            return self._functions[i]
        return None

    def function_bounds(self, address: int) -> tuple[str, int, int] | None:
        """(name, start, end) of the function holding `address` (tracing's CodeSource protocol)."""
        sym = self.function_at(address)
        return (sym.name, sym.address, sym.end) if sym else None

    def read(self, address: int, length: int) -> bytes:
        """Initial contents of the image (bss reads as zeroes). Raises KernelImageError outside the segments."""
        for seg in self.segments:
            if seg.vaddr <= address and address + length <= seg.end:
                start = address - seg.vaddr
                chunk = seg.data[start : start + length]
                return chunk + bytes(length - len(chunk))
        raise KernelImageError(f"{self.path}: {length} bytes at {address:#x} are outside the loaded image")

    def read_code(self, address: int, length: int) -> bytes:
        """Original bytes (not the live, possibly patched, memory)."""
        return self.read(address, length)

    def read_string(self, address: int, limit: int = 4096) -> str:
        for seg in self.segments:
            if seg.vaddr <= address < seg.vaddr + len(seg.data):
                start = address - seg.vaddr
                end = seg.data.find(b"\0", start, start + limit)
                if end < 0:
                    break
                return seg.data[start:end].decode("utf-8", "replace")
        raise KernelImageError(f"{self.path}: no string at {address:#x}")
