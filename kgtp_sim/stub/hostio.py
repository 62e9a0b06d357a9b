"""The gdbserver role's host I/O: GDB's `vFile:` packets (rsp/packets/hostio.py) served from the machine's own files,
as gdbserver's hostio.cc serves the target's, so that GDB's default sysroot `target:` reads the program and its
libraries from the target and `remote get` fetches one.

The only files are the machine's (machine/ramfs.py: the regular files of the archives it loaded: the program the
user named, its interpreter and libraries, each under its path inside the machine), and paths are resolved as the
machine's kernel resolves them (`..` by name: `/lib/../../etc/passwd` is `/etc/passwd`, which the machine has not).
Nothing here opens a host file: a path the machine has no file at is ENOENT, whatever the host has there. The files
are read-only to GDB: opening one to write or create is EACCES, as is `vFile:pwrite`; `vFile:unlink` is EPERM. The
machine has one file system, every process's: `vFile:setfs` of any pid answers 0 and changes nothing. A descriptor
GDB did not open here (or closed) is EINVAL, as gdbserver answers one it does not know (require_valid_fd); a new
connection starts with none open. `fstat`, `stat` and `lstat` (GDB 16's, which asks whether a separate debug file's
build-id link exists on the target) tell what the machine's kernel tells a process (fs.c: fill_stat, path_stat).

Not announced in qSupported (gdbserver announces no host I/O either: GDB finds it by trying `vFile:open`); only the
gdbserver role has these handlers, KGTP mode answers every `vFile:` packet with the empty reply.

Runs on the server thread, as every handler.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import accumulate

from ..machine import MachineError, MemoryFault
from ..machine.ramfs import PathTooLong, Ramfs, RamfsFile, normalize
from ..rsp.dispatch import PACKET_SIZE, Binary, Reply, handles
from ..rsp.packets import hostio as h

log = logging.getLogger(__name__)

#: descriptors are numbered from here, as a process's first open file is (0-2 are its standard streams)
FIRST_FD = 3
#: descriptors one connection may hold open at once (more: EMFILE)
MAX_FDS = 64
#: the bytes that take two on the wire (codec.escape)
_ESCAPED = frozenset(b"$#}*")


def _fitting(header: bytes, data: bytes) -> bytes:
    """The longest start of `data` that, escaped after `header`, fits in one packet (gdbserver:
    hostio_reply_with_data and handle_pread's shortening)."""
    budget = PACKET_SIZE - len(header)
    if len(data) <= budget // 2:
        return data
    sizes = list(accumulate(2 if byte in _ESCAPED else 1 for byte in data))
    count = next((i for i, size in enumerate(sizes) if size > budget), len(data))
    return data[:count]


def _file_stat(file: RamfsFile) -> bytes:
    """The protocol's `struct stat` of a machine's file as its kernel fills one (fs.c: fill_stat)."""
    return h.encode_stat(dev=1, ino=file.data, mode=file.mode, nlink=1, size=file.size, blksize=4096,
                         blocks=(file.size + 511) // 512)


@dataclass
class HostIOHandlers:
    """`vFile:setfs`, `open`, `pread`, `pwrite`, `close`, `fstat`, `stat`, `lstat`, `unlink`, `readlink` over the
    machine's files."""

    files: Ramfs
    _open: dict[int, RamfsFile] = field(default_factory=dict)  #: GDB's descriptors

    def forget_session(self) -> None:
        """A new connection: the last one's descriptors are closed."""
        self._open.clear()

    def _lookup(self, raw: bytes) -> RamfsFile | bytes:
        """The machine's file at `raw`, or the error reply (ENAMETOOLONG, ENOENT)."""
        try:
            path = normalize(raw)
        except PathTooLong:
            return h.error(h.FILEIO_ENAMETOOLONG)
        found = self.files.lookup(path)
        if found is None:
            log.info("host I/O: the machine has no file %r", path)
            return h.error(h.FILEIO_ENOENT)
        return found

    @handles(h.SetFs)
    def setfs(self, packet: h.SetFs) -> Reply:
        return h.reply(0)

    @handles(h.Open)
    def open_file(self, packet: h.Open) -> Reply:
        if packet.flags & h.O_WRITING:
            log.info("host I/O: %r opened to write (flags %#x): refused", packet.path, packet.flags)
            return h.error(h.FILEIO_EACCES)
        found = self._lookup(packet.path)
        if isinstance(found, bytes):
            return found
        if len(self._open) >= MAX_FDS:
            return h.error(h.FILEIO_EMFILE)
        fd = next(n for n in range(FIRST_FD, FIRST_FD + MAX_FDS + 1) if n not in self._open)
        self._open[fd] = found
        return h.reply(fd)

    @handles(h.Pread)
    def pread(self, packet: h.Pread) -> Reply:
        file = self._open.get(packet.fd)
        if file is None:
            return h.error(h.FILEIO_EINVAL)
        header = b"F%x;" % PACKET_SIZE  # the longest header: what gdbserver leaves room for
        count = min(packet.count, PACKET_SIZE - len(header))
        try:
            data = self.files.read(file, packet.offset, count)
        except (MachineError, MemoryFault) as error:
            log.info("host I/O: reading %r: %s", file.path, error)
            return h.error(h.FILEIO_EIO)
        data = _fitting(header, data)
        return Binary(b"F%x;" % len(data) + data)

    @handles(h.Pwrite)
    def pwrite(self, packet: h.Pwrite) -> Reply:
        if packet.fd not in self._open:
            return h.error(h.FILEIO_EINVAL)
        return h.error(h.FILEIO_EACCES)

    @handles(h.Close)
    def close_file(self, packet: h.Close) -> Reply:
        if self._open.pop(packet.fd, None) is None:
            return h.error(h.FILEIO_EINVAL)
        return h.reply(0)

    @handles(h.Fstat)
    def fstat(self, packet: h.Fstat) -> Reply:
        """What the machine's kernel tells a process of the file (fs.c: fill_stat): device 1, its bytes' address as
        its inode, the archive's mode, one link, blocks of 512 bytes, 4096-byte I/O, no owner and no times."""
        file = self._open.get(packet.fd)
        if file is None:
            return h.error(h.FILEIO_EINVAL)
        stat = _file_stat(file)
        return Binary(b"F%x;" % len(stat) + stat)

    @handles(h.Lstat)
    def lstat(self, packet: h.Lstat) -> Reply:
        return self.stat(packet)

    @handles(h.Stat)
    def stat(self, packet: h.Stat) -> Reply:
        """What the machine's kernel's stat tells a process of the path (fs.c: path_stat): its file's, as `fstat`
        answers, or its directory's (fill_dir_stat); ENOENT for neither. The machine has no links: `lstat` is
        `stat`."""
        try:
            path = normalize(packet.path)
        except PathTooLong:
            return h.error(h.FILEIO_ENAMETOOLONG)
        file = self.files.lookup(path)
        if file is not None:
            stat = _file_stat(file)
        elif self.files.is_directory(path):
            inode = 5381
            for byte in path:
                inode = (inode * 33 + byte) & (1 << 64) - 1
            stat = h.encode_stat(dev=1, ino=inode | 1 << 63, mode=0o040755, nlink=2, size=4096, blksize=4096,
                                 blocks=8)
        else:
            log.info("host I/O: the machine has no file %r", path)
            return h.error(h.FILEIO_ENOENT)
        return Binary(b"F%x;" % len(stat) + stat)

    @handles(h.Unlink)
    def unlink(self, packet: h.Unlink) -> Reply:
        log.info("host I/O: unlink %r: refused", packet.path)
        return h.error(h.FILEIO_EPERM)

    @handles(h.Readlink)
    def readlink(self, packet: h.Readlink) -> Reply:
        """The machine's files are regular files, none a link: EINVAL for one of them, as readlink(2) answers."""
        found = self._lookup(packet.path)
        return found if isinstance(found, bytes) else h.error(h.FILEIO_EINVAL)
