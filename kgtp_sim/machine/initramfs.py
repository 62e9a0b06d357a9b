"""The initramfs archive: programs packed as Linux's initramfs is, a cpio archive in the "newc" format, with
what a dynamically linked program needs to run.

Pure (no machine, no threads). `Archive` collects files under their paths inside the machine (the host's absolute
paths: a program finds its files where the host has them) and `pack()` returns the archive's bytes, which
`process.Processes` places in the machine's RAM before boot for the kernel's initramfs.c to list.

`Archive.add_program` adds a program and, if it is dynamically linked, what its dynamic linker will open inside:
the interpreter (PT_INTERP) and the DT_NEEDED libraries, recursively, found as that linker searches
(`runtime_files`: glibc's ld.so, _dl_map_object, without an ld.so.cache; musl's ld.so, load_library, without
its path file), each stored under the path the linker will open, with the bytes of the host file it resolves to;
and for glibc, the library its libc opens itself (dlopen) to unwind a thread's stack, libgcc_s.so.1 (pthread_exit,
pthread_cancel, backtrace), when the host has it. Nothing else of the host goes in.

newc, as Linux's usr/gen_init_cpio writes it: per entry a 110-byte header, "070701" then thirteen 8-digit hex
fields (ino, mode, uid, gid, nlink, mtime, filesize, devmajor, devminor, rdevmajor, rdevminor, namesize,
check), the NUL-terminated name padded with the header to a multiple of 4 bytes, the data padded likewise;
directories before the files in them; a last entry named TRAILER!!!.
"""

from __future__ import annotations

import os
import posixpath
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

from .elf import (
    DT_NEEDED,
    DT_RPATH,
    DT_RUNPATH,
    DT_SONAME,
    EM_X86_64,
    ET_DYN,
    ET_EXEC,
    ElfError,
    ElfFile,
    header_name,
)

NEWC_MAGIC = b"070701"
TRAILER = "TRAILER!!!"


#: the directories glibc's ld.so searches after RPATH, LD_LIBRARY_PATH and RUNPATH when it has no ld.so.cache (its
#: "system search path": multiarch on Debian and Ubuntu, lib64 on Fedora and SUSE, then lib)
GLIBC_SYSTEM_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib",
                     "/usr/lib")
#: musl's ld.so without its /etc/ld-musl-x86_64.path (which is not packed): its built-in search path
MUSL_SYSTEM_DIRS = ("/lib", "/usr/local/lib", "/usr/lib")
#: what glibc's libc dlopens (by name, through the same search) to unwind a stack: pthread_exit, pthread_cancel
GLIBC_UNWINDER = "libgcc_s.so.1"
#: names musl's ld.so answers with itself (libc.so, libm.so, libpthread.so ...: all in its libc)
_MUSL_BUILTIN = re.compile(r"lib(c|pthread|rt|m|dl|util|xnet)(\.so.*)?\Z", re.S)


class MissingFile(ValueError):
    """A file a program needs to run (its interpreter, a library) is not on this host."""


@dataclass(frozen=True)
class _Dynamic:
    """What a dynamic linker reads of an x86_64 ELF file."""

    interp: str | None
    needed: tuple[str, ...]
    rpath: tuple[str, ...]
    runpath: tuple[str, ...]
    soname: str | None


def _read_dynamic(path: str | Path) -> _Dynamic | None:
    """The file's PT_INTERP and dynamic tags; None unless it is a 64-bit x86_64 ELF file (ld.so skips others). Read
    as the dynamic linker reads them: the program headers, the dynamic segment, the strings at DT_STRTAB's
    address."""
    try:
        with open(path, "rb") as f:
            elf = ElfFile(f)
            if elf.bits != 64 or not elf.little_endian or elf.machine != EM_X86_64:
                return None
            tags = elf.dynamic_tags()
            needed, rpath, runpath, soname = [], [], [], None
            for tag, value in tags:
                if tag == DT_NEEDED:
                    needed.append(elf.dynamic_string(tags, value))
                elif tag == DT_RPATH:
                    rpath += elf.dynamic_string(tags, value).split(":")
                elif tag == DT_RUNPATH:
                    runpath += elf.dynamic_string(tags, value).split(":")
                elif tag == DT_SONAME:
                    soname = elf.dynamic_string(tags, value)
            return _Dynamic(elf.interpreter(), tuple(needed), tuple(rpath), tuple(runpath), soname)
    except (OSError, ValueError, struct.error):
        return None


def check_program(path: str | Path) -> None:
    """Raise ValueError naming why the host file at `path` is no program the kernel runs (not a regular file, not
    a 64-bit x86_64 ELF executable or PIE), OSError when it cannot be read; what gdbserver's vRun of a bad file
    ends in, said before anything goes into the machine."""
    with open(path, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError("not a regular file")
        try:
            elf = ElfFile(f)
        except ElfError:
            raise ValueError("not an ELF file") from None
    if elf.bits != 64 or elf.machine != EM_X86_64:
        raise ValueError(f"not an x86_64 program ({elf.bits}-bit {header_name('ENUM_E_MACHINE', elf.machine)})")
    if elf.type not in (ET_EXEC, ET_DYN):
        raise ValueError(f"not an executable ({header_name('ENUM_E_TYPE', elf.type)})")


def _expand(directories: tuple[str, ...], origin: str) -> list[str]:
    """Search directories with $ORIGIN substituted; relative and other substituted ones left out."""
    out = []
    for directory in directories:
        directory = directory.replace("${ORIGIN}", origin).replace("$ORIGIN", origin)
        if directory.startswith("/") and "$" not in directory:
            out.append(directory)
    return out


def runtime_files(program: str | Path, library_path: str = "") -> dict[str, Path]:
    """What the dynamic linker of `program` opens when it runs inside: path inside -> the host file it resolves
    to; {} for a static program. `library_path` is the LD_LIBRARY_PATH the program will have. The interpreter
    goes under its PT_INTERP path; each DT_NEEDED library (the program's, then theirs) under the first path of the
    linker's search where the host has an x86_64 ELF file of that name. A name the linker has loaded already
    (the interpreter's DT_SONAME: glibc's libc needs ld-linux-x86-64.so.2; musl's libc.so, which is its ld.so) is
    no new file. A glibc program also gets GLIBC_UNWINDER, which its libc opens itself when a thread ends by
    pthread_exit, if the host has one (a program that needs none still runs without). Raises MissingFile naming what
    is not found."""
    main = _read_dynamic(program)
    if main is None or main.interp is None:
        return {}
    interp = posixpath.normpath(main.interp)
    if not os.path.isfile(interp):
        raise MissingFile(f"needs its interpreter {main.interp}, which is not on this host")
    interp_elf = _read_dynamic(interp)
    if interp_elf is None:
        raise MissingFile(f"its interpreter {main.interp} is not an x86_64 ELF file")
    musl = posixpath.basename(interp).startswith("ld-musl-")
    files = {interp: Path(interp).resolve()}
    loaded = {name for name in (interp_elf.soname, posixpath.basename(interp)) if name}
    environment = [d for d in library_path.replace(";", ":").split(":") if d.startswith("/")]
    program_inside = str(Path(program).resolve())
    queue = [(program_inside, main)]
    while queue:
        path, elf = queue.pop(0)
        origin = posixpath.dirname(path)
        for name in elf.needed:
            if name in loaded or (musl and _MUSL_BUILTIN.match(name)):
                continue
            if "/" in name:  # a path, not searched (relative: to the working directory, "/" inside)
                candidates = [posixpath.normpath(posixpath.join("/", name))]
            else:
                if musl:  # LD_LIBRARY_PATH, the needing object's RUNPATH (or RPATH), the built-in path
                    directories = [*environment, *_expand(elf.runpath or elf.rpath, origin), *MUSL_SYSTEM_DIRS]
                else:  # RPATH (the object's and the program's, unless the object has RUNPATH), LD_LIBRARY_PATH,
                    # RUNPATH, the system directories
                    rpath = [] if elf.runpath else [*_expand(elf.rpath, origin),
                                                    *_expand(() if main.runpath else main.rpath,
                                                             posixpath.dirname(program_inside))]
                    directories = [*rpath, *environment, *_expand(elf.runpath, origin), *GLIBC_SYSTEM_DIRS]
                candidates = [posixpath.normpath(posixpath.join(d, name)) for d in dict.fromkeys(directories)]
            found = next(((c, lib) for c in candidates if os.path.isfile(c) and (lib := _read_dynamic(c))), None)
            if found is None:
                where = ", ".join(posixpath.dirname(c) for c in candidates)
                raise MissingFile(f"needs the library {name} ({path} asks for it), which is not in {where}")
            inside, library = found
            files[inside] = Path(inside).resolve()
            loaded.update(n for n in (name, library.soname) if n)
            queue.append((inside, library))
    if not musl and "libc.so.6" in loaded and GLIBC_UNWINDER not in loaded:
        unwinder = next((c for d in GLIBC_SYSTEM_DIRS if os.path.isfile(c := posixpath.join(d, GLIBC_UNWINDER))
                         and _read_dynamic(c)), None)
        if unwinder is not None:  # its own DT_NEEDED is libc.so.6, loaded already
            files[unwinder] = Path(unwinder).resolve()
    return files


def _pad4(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 4)


def _entry(name: str, mode: int, data: bytes, ino: int) -> tuple[bytes, bytes, bytes]:
    """A newc entry as its parts (header and name padded, the data, the data's padding): the archive is joined
    once, its files' bytes copied once (a program's libraries are megabytes)."""
    encoded = name.encode() + b"\0"
    fields = (ino, mode, 0, 0, 2 if stat.S_ISDIR(mode) else 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0)
    header = NEWC_MAGIC + b"".join(b"%08x" % value for value in fields)
    return _pad4(header + encoded), data, b"\0" * (-len(data) % 4)


@dataclass
class Archive:
    """Files for the machine, by their absolute path inside it."""

    files: dict[str, tuple[int, bytes]] = field(default_factory=dict)  # path -> (mode, data)

    def add_file(self, path: str, data: bytes, mode: int = 0o755) -> None:
        path = "/" + posixpath.normpath(path).lstrip("/")
        if path == "/":
            raise ValueError("a file needs a name")
        self.files[path] = (stat.S_IFREG | (mode & 0o7777), bytes(data))

    def add_host_file(self, host_path: str | Path, inside: str | None = None) -> str:
        """The host file (symbolic links followed) under `inside`, by default its own absolute path; returns
        the path the machine knows it by."""
        resolved = Path(host_path).resolve()
        info = resolved.stat()
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{host_path}: not a regular file")
        inside = inside or str(resolved)
        self.add_file(inside, resolved.read_bytes(), info.st_mode)
        return inside

    def add_program(self, host_path: str | Path, library_path: str = "") -> str:
        """A program and what its dynamic linker will open (`runtime_files`); returns the program's path inside.
        Raises MissingFile before anything is added if a file it needs is not on this host."""
        needed = runtime_files(host_path, library_path)
        inside = self.add_host_file(host_path)
        for path, host_file in needed.items():
            self.add_host_file(host_file, path)
        return inside

    def pack(self) -> bytes:
        directories: set[str] = set()
        for path in self.files:
            parent = posixpath.dirname(path)
            while parent != "/":
                directories.add(parent)
                parent = posixpath.dirname(parent)
        out: list[bytes] = []
        ino = 1
        for directory in sorted(directories):
            out += _entry(directory.lstrip("/"), stat.S_IFDIR | 0o755, b"", ino)
            ino += 1
        for path in sorted(self.files):
            mode, data = self.files[path]
            out += _entry(path.lstrip("/"), mode, data, ino)
            ino += 1
        out += _entry(TRAILER, 0, b"", 0)
        return b"".join(out)


def unpack(archive: bytes | memoryview) -> dict[str, tuple[int, bytes]]:
    """The entries of a newc archive (name -> (mode, data)), up to its trailer: for tests and diagnostics; given
    a memoryview, each data is a view into it (no copy)."""
    entries, offset = {}, 0
    while offset + 110 <= len(archive) and bytes(archive[offset: offset + 6]) == NEWC_MAGIC:
        fields = [int(bytes(archive[offset + 6 + 8 * i: offset + 14 + 8 * i]), 16) for i in range(13)]
        mode, size, namesize = fields[1], fields[6], fields[11]
        name = bytes(archive[offset + 110: offset + 110 + namesize - 1]).decode()
        data_at = (offset + 110 + namesize + 3) & ~3
        if name == TRAILER:
            break
        entries[name] = (mode, archive[data_at: data_at + size])
        offset = (data_at + size + 3) & ~3
    return entries
