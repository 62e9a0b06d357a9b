"""The machine's files as its kernel knows them: the regular files of the initramfs and of the archives added later
(fixtures/kernel/initramfs.c's `ramfs_files`, the newest entry of a path shadowing the older), read from kernel
memory, and paths resolved as the kernel's fs.c resolves them (`normalize`: absolute against "/", "." and ".." by
name, repeated slashes as one).

What a debugger may serve of the machine's file system (the gdbserver role's host I/O, stub/hostio.py): the files the
archives hold (a program the user named, its interpreter and libraries, initramfs.py) and nothing else; no host file
is opened here, the bytes are the archive's own in the machine's RAM, which the kernel never writes.

The layout of `struct ramfs_file` and the table's capacity come from the kernel's DWARF, read once, on first use.

Threads: any thread; the table and the bytes are read through `Machine.run_on_cpu`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from unicorn import UcError

from .errors import MachineError
from .layouts import kernel_layout

#: the kernel's longest path, NUL included (fs.c: get_path)
PATH_MAX = 4096
PAGE = 0x1000


class PathTooLong(ValueError):
    """A path the kernel would refuse with ENAMETOOLONG."""


def normalize(path: bytes) -> bytes:
    """`path` as the kernel's get_path makes it: absolute ("/" is the working directory of every process), "." and
    empty components dropped, ".." taking the component before it away (by name: the files have no directories
    that could be links), "/" for nothing left. Raises PathTooLong where the kernel answers ENAMETOOLONG."""
    if len(path) >= PATH_MAX:
        raise PathTooLong(f"a path of {len(path)} bytes")
    parts: list[bytes] = []
    for part in path.split(b"/"):
        if part in (b"", b"."):
            continue
        if part == b"..":
            if parts:
                parts.pop()
            continue
        parts.append(part)
    return b"/" + b"/".join(parts)


@dataclass(frozen=True)
class RamfsFile:
    """A regular file of the machine: its normalized path, where its bytes are (a kernel address, in the archive),
    its size and mode (the archive entry's)."""

    path: bytes
    data: int
    size: int
    mode: int


@dataclass(frozen=True)
class FileLayout:
    """Where the kernel keeps its files' table and what a `struct ramfs_file` holds (its DWARF's); machine/procfs.py
    reads a mapped file's name and data through it too."""

    table: int
    count: int
    capacity: int
    size: int
    name: int
    data: int
    length: int
    mode: int

    @classmethod
    def read(cls, path: Any) -> FileLayout:
        return kernel_layout(path, cls, cls._from_dwarf)

    @classmethod
    def _from_dwarf(cls, dwarf: Any) -> FileLayout:
        table, count = dwarf.global_variable("ramfs_files"), dwarf.global_variable("nr_ramfs_files")
        if table is None or count is None or table[1].target is None:
            raise MachineError("the kernel's DWARF has no `ramfs_files`: its files cannot be listed")
        entry = table[1].target
        return cls(table[0], count[0], table[1].count or 0, entry.size, entry.member("name")[0],
                   entry.member("data")[0], entry.member("size")[0], entry.member("mode")[0])


class Ramfs:
    """The running machine's files, looked up by path and read."""

    def __init__(self, machine: Any) -> None:
        self._machine = machine
        self._layout: FileLayout | None = None

    def lookup(self, path: bytes) -> RamfsFile | None:
        """The file at `path` (normalized: `normalize`), the newest entry of that path as the kernel's ramfs_lookup
        finds it; None when the machine has no regular file there ("/" and the archives' directories included)."""
        layout = self._layout
        if layout is None:
            layout = self._layout = FileLayout.read(self._machine.image.path)
        wanted = path.lstrip(b"/")
        if not wanted:
            return None

        def find(uc: Any) -> RamfsFile | None:
            space = self._machine.kernel_space
            count = min(struct.unpack("<I", bytes(space.read(layout.count, 4)))[0], layout.capacity)
            raw = bytes(space.read(layout.table, count * layout.size))
            for index in reversed(range(count)):  # the newest first: an entry added later shadows
                at = index * layout.size
                name = kernel_name(space, struct.unpack_from("<Q", raw, at + layout.name)[0], len(wanted))
                if name is not None and name.lstrip(b"/") == wanted:
                    (data,), (length,) = (struct.unpack_from("<Q", raw, at + offset)
                                          for offset in (layout.data, layout.length))
                    mode, = struct.unpack_from("<I", raw, at + layout.mode)
                    return RamfsFile(b"/" + wanted, data, length, mode)
            return None

        return self._machine.run_on_cpu(find)

    def is_directory(self, path: bytes) -> bool:
        """Whether `path` (normalized) is a directory as the kernel's ramfs_is_dir finds one: "/", or what a file's
        path goes through."""
        wanted = path.strip(b"/")
        return not wanted or any(name.lstrip(b"/").startswith(wanted + b"/") for name in self._names())

    def _names(self) -> list[bytes]:
        layout = self._layout
        if layout is None:
            layout = self._layout = FileLayout.read(self._machine.image.path)

        def names(uc: Any) -> list[bytes]:
            space = self._machine.kernel_space
            count = min(struct.unpack("<I", bytes(space.read(layout.count, 4)))[0], layout.capacity)
            raw = bytes(space.read(layout.table, count * layout.size))
            found = (kernel_name(space, struct.unpack_from("<Q", raw, index * layout.size + layout.name)[0], PATH_MAX)
                     for index in range(count))
            return [name for name in found if name is not None]

        return self._machine.run_on_cpu(names)

    def read(self, file: RamfsFile, offset: int, length: int) -> bytes:
        """Up to `length` bytes of `file` from `offset` (fewer at its end, none past it)."""
        length = max(0, min(length, file.size - offset))
        return self._machine.read_memory(file.data + offset, length) if length else b""


def kernel_name(space: Any, address: int, limit: int) -> bytes | None:
    """The NUL-terminated name at kernel `address`, read a page at most at a time; None when it is longer than
    `limit` bytes past any leading slashes (no match for a path of fewer) or cannot be read."""
    out = bytearray()
    while len(out.lstrip(b"/")) <= limit and len(out) < PATH_MAX:
        at = address + len(out)
        try:
            chunk = bytes(space.read(at, PAGE - (at & (PAGE - 1))))
        except UcError:
            return None
        end = chunk.find(b"\0")
        if end >= 0:
            return bytes(out + chunk[:end])
        out += chunk
    return None
