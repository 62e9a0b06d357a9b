"""Host I/O packets: GDB's `vFile:` family (GDB's docs, "Host I/O Packets"; remote.c: remote_hostio_*), with which
GDB reads the target's files: the program and its libraries when its sysroot is `target:` (its default), `remote get`.

Requests carry hex numbers and hex-encoded paths; every reply is `F<result>` in hex, `F-1,<errno>` on failure with
errno one of the File-I/O protocol's (`FILEIO_*` below, gdbsupport/fileio.h's values), and data (pread, fstat,
readlink) follows the result after `;`, binary. A request that does not parse is answered `F-1,<EINVAL>`, as
gdbserver's hostio.cc answers it (hostio_packet_error), not `E01`. Open flags and modes are the protocol's
(`O_*`, `S_*`); a flag or mode bit it does not define makes the request malformed, as in gdbserver
(fileio_to_host_openflags, fileio_to_host_mode). `encode_stat` writes the protocol's `struct stat` (big-endian).

Pure: parsed on the server thread (`RspServer`) for kgtp_sim/stub/hostio.py's handlers.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar, Self

from .base import Packet, PacketError, parse_hex, parse_hex_bytes, split_exact

#: File-I/O errno values (gdbsupport/fileio.h: enum fileio_error)
FILEIO_EPERM, FILEIO_ENOENT, FILEIO_EIO, FILEIO_EACCES = 1, 2, 5, 13
FILEIO_EINVAL, FILEIO_EMFILE, FILEIO_ENAMETOOLONG = 22, 24, 91

#: open flags (FILEIO_O_*); RDONLY is 0
O_WRONLY, O_RDWR, O_APPEND, O_CREAT, O_TRUNC, O_EXCL = 0x1, 0x2, 0x8, 0x200, 0x400, 0x800
O_SUPPORTED = O_WRONLY | O_RDWR | O_APPEND | O_CREAT | O_TRUNC | O_EXCL
#: what asks to change (or make) a file: every flag but RDONLY's 0
O_WRITING = O_SUPPORTED
#: mode bits (FILEIO_S_*): the file types the protocol names and the permission bits
S_IFREG, S_IFDIR, S_IFCHR = 0o100000, 0o40000, 0o20000
S_PERMISSIONS = 0o777
S_SUPPORTED = S_IFREG | S_IFDIR | S_PERMISSIONS  #: what an open's mode may hold (FILEIO_S_SUPPORTED)

#: gdbserver's bound on a number in these packets (hostio.cc: require_int): at most 31 bits
_INT_BITS = 31


def _int(text: bytes, what: str) -> int:
    return parse_hex(text, what, bits=_INT_BITS)


def _path(text: bytes) -> bytes:
    path = parse_hex_bytes(text, "path")
    if b"\0" in path:
        raise PacketError("a path with a NUL byte")
    return path


def reply(result: int) -> bytes:
    """`F<result>`."""
    return b"F%x" % result


def error(errno: int) -> bytes:
    """`F-1,<errno>`."""
    return b"F-1,%x" % errno


@dataclass(frozen=True)
class HostIO(Packet):
    """A `vFile:` request: malformed, it is answered `F-1,<EINVAL>`."""

    MALFORMED: ClassVar[bytes | None] = error(FILEIO_EINVAL)


@dataclass(frozen=True)
class SetFs(HostIO):
    """`vFile:setfs:<pid>`: the file system later paths name, that of process `pid` (0: the server's own)."""

    PREFIX = b"vFile:setfs:"
    pid: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(_int(body, "pid"))


@dataclass(frozen=True)
class Open(HostIO):
    """`vFile:open:<path>,<flags>,<mode>`: a new descriptor of the file, the protocol's flags and creation mode."""

    PREFIX = b"vFile:open:"
    path: bytes = b""
    flags: int = 0
    mode: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        path, flags, mode = split_exact(body, b",", 3, "vFile:open")
        flags_value, mode_value = _int(flags, "flags"), _int(mode, "mode")
        if flags_value & ~O_SUPPORTED:
            raise PacketError(f"vFile:open: flags {flags_value:#x} the protocol does not define")
        if mode_value & ~S_SUPPORTED:
            raise PacketError(f"vFile:open: mode {mode_value:#o} the protocol does not define")
        return cls(_path(path), flags_value, mode_value)


@dataclass(frozen=True)
class Pread(HostIO):
    """`vFile:pread:<fd>,<count>,<offset>`: up to `count` bytes from `offset`."""

    PREFIX = b"vFile:pread:"
    fd: int = 0
    count: int = 0
    offset: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        fd, count, offset = split_exact(body, b",", 3, "vFile:pread")
        return cls(_int(fd, "fd"), _int(count, "count"), parse_hex(offset, "offset"))


@dataclass(frozen=True)
class Pwrite(HostIO):
    """`vFile:pwrite:<fd>,<offset>,<data>`: the data (binary, unescaped by the codec) written at `offset`."""

    PREFIX = b"vFile:pwrite:"
    fd: int = 0
    offset: int = 0
    data: bytes = b""

    @classmethod
    def parse(cls, body: bytes) -> Self:
        fd, offset, data = split_exact(body, b",", 3, "vFile:pwrite")
        return cls(_int(fd, "fd"), parse_hex(offset, "offset"), data)


@dataclass(frozen=True)
class Close(HostIO):
    """`vFile:close:<fd>`."""

    PREFIX = b"vFile:close:"
    fd: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(_int(body, "fd"))


@dataclass(frozen=True)
class Fstat(HostIO):
    """`vFile:fstat:<fd>`: the file's `struct stat` (`encode_stat`) after the result."""

    PREFIX = b"vFile:fstat:"
    fd: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(_int(body, "fd"))


@dataclass(frozen=True)
class _PathRequest(HostIO):
    """A request naming one path and nothing else: `vFile:<operation>:<path>`."""

    path: bytes = b""

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(_path(body))


@dataclass(frozen=True)
class Unlink(_PathRequest):
    """`vFile:unlink:<path>`."""

    PREFIX = b"vFile:unlink:"


@dataclass(frozen=True)
class Stat(_PathRequest):
    """`vFile:stat:<path>` (GDB 16 and later): the `struct stat` of the file at the path, links followed, after the
    result, as `vFile:fstat` answers."""

    PREFIX = b"vFile:stat:"


@dataclass(frozen=True)
class Lstat(Stat):
    """`vFile:lstat:<path>`: as `vFile:stat`, a link's own (GDB asks it whether a separate debug file's build-id
    link exists on the target)."""

    PREFIX = b"vFile:lstat:"


@dataclass(frozen=True)
class Readlink(_PathRequest):
    """`vFile:readlink:<path>`: the link's target after the result."""

    PREFIX = b"vFile:readlink:"


#: the protocol's struct stat: dev, ino, mode, nlink, uid, gid, rdev (4 bytes each), size, blksize, blocks (8 each),
#: atime, mtime, ctime (4 each), big-endian
_STAT = struct.Struct(">7I3Q3I")
STAT_SIZE = _STAT.size


def encode_stat(*, dev: int, ino: int, mode: int, nlink: int, size: int, blksize: int, blocks: int, uid: int = 0,
                gid: int = 0, rdev: int = 0, atime: int = 0, mtime: int = 0, ctime: int = 0) -> bytes:
    """The protocol's `struct stat` (gdbsupport/fileio.cc: host_to_fileio_stat): 32-bit fields truncated as there,
    the mode's file type kept only when the protocol names it, its permission bits as they are."""
    kind = mode & 0o170000
    mode = (kind if kind in (S_IFREG, S_IFDIR, S_IFCHR) else 0) | mode & S_PERMISSIONS
    words = (dev, ino, mode, nlink, uid, gid, rdev)
    return _STAT.pack(*(w & 0xFFFF_FFFF for w in words), size, blksize, blocks,
                      *(t & 0xFFFF_FFFF for t in (atime, mtime, ctime)))
