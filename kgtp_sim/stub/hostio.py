"""The gdbserver role's host I/O: GDB's `vFile:` packets (rsp/packets/hostio.py) served from the machine's own files,
as gdbserver's hostio.cc serves the target's, so that GDB's default sysroot `target:` reads the program and its
libraries from the target and `remote get` fetches one.

The only files are the machine's (machine/ramfs.py: the regular files of the archives it loaded: the program the
user named, its interpreter and libraries, each under its path inside the machine) and its processes' /proc files
(machine/procfs.py: `maps`, `cmdline`, `environ`, `comm`, the links `exe` and `cwd`, which GDB's `info proc` and
`gcore` read, as gdbserver's are the host kernel's), and paths are resolved as the machine's kernel resolves them (`..` by name: `/lib/../../etc/passwd` is `/etc/passwd`, which the machine has not).
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

from ..machine import MachineError, MemoryFault
from ..machine.procfs import DIRECTORY, LINK, ProcEntry, ProcFiles
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
_ESCAPED_BYTES = tuple(bytes([byte]) for byte in sorted(_ESCAPED))


def _fitting(header: bytes, data: bytes) -> bytes:
    """The longest start of `data` that, escaped after `header`, fits in one packet (gdbserver:
    hostio_reply_with_data and handle_pread's shortening). Counted with bytes.count, at C speed: the escaped
    bytes are few, so a first cut leaves a few bytes at most to take back one by one."""
    budget = PACKET_SIZE - len(header)

    def escapes(part: bytes) -> int:
        return sum(part.count(byte) for byte in _ESCAPED_BYTES)

    count = min(len(data), budget)
    extra = escapes(data[:count])
    if count + extra <= budget:
        return data[:count]
    count = budget - extra  # fits: its escapes are at most `extra`
    extra = escapes(data[:count])
    while count < len(data) and count + 1 + extra + (data[count] in _ESCAPED) <= budget:
        extra += data[count] in _ESCAPED
        count += 1
    return data[:count]


def _file_stat(file: RamfsFile) -> bytes:
    """The protocol's `struct stat` of a machine's file as its kernel fills one (fs.c: fill_stat)."""
    return h.encode_stat(dev=1, ino=file.data, mode=file.mode, nlink=1, size=file.size, blksize=4096,
                         blocks=(file.size + 511) // 512)


def _directory_stat(path: bytes) -> bytes:
    """A directory's, as the machine's kernel fills one (fs.c: fill_dir_stat): its inode from its path."""
    inode = 5381
    for byte in path:
        inode = (inode * 33 + byte) & (1 << 64) - 1
    return h.encode_stat(dev=1, ino=inode | 1 << 63, mode=0o040755, nlink=2, size=4096, blksize=4096, blocks=8)


@dataclass(frozen=True)
class _Generated:
    """A /proc file opened by GDB: its bytes as they were at the open (Linux renders them at each read; GDB reads
    one from its start to its end at once)."""

    path: bytes
    data: bytes


#: what stat tells of a /proc file (Linux's proc_pid_... inodes: regular, read-only, no size) and of a link
_PROC_FILE_STAT = h.encode_stat(dev=0, ino=0, mode=0o100444, nlink=1, size=0, blksize=1024, blocks=0)


@dataclass
class HostIOHandlers:
    """`vFile:setfs`, `open`, `pread`, `pwrite`, `close`, `fstat`, `stat`, `lstat`, `unlink`, `readlink` over the
    machine's files and its processes' /proc files (`procfs`: machine/procfs.py; None: no /proc)."""

    files: Ramfs
    procfs: ProcFiles | None = None
    _open: dict[int, RamfsFile | _Generated] = field(default_factory=dict)  #: GDB's descriptors

    def forget_session(self) -> None:
        """A new connection: the last one's descriptors are closed."""
        self._open.clear()

    def _resolve(self, raw: bytes, follow: bool = True) -> tuple[bytes, RamfsFile | ProcEntry | None] | bytes:
        """(the normalized path, what is there: a machine's file, a /proc entry, or None for a directory of the
        machine's files), links followed unless not `follow`; or the error reply (ENAMETOOLONG, ENOENT)."""
        try:
            path = normalize(raw)
        except PathTooLong:
            return h.error(h.FILEIO_ENAMETOOLONG)
        for _ in range(8):  # (links lead to a file or a directory: never further than one step)
            entry = self.procfs.lookup(path) if self.procfs is not None else None
            if entry is not None and entry.kind == LINK and follow:
                path = normalize(entry.data)
                continue
            if entry is not None:
                return path, entry
            file = self.files.lookup(path)
            if file is not None:
                return path, file
            if self.files.is_directory(path):
                return path, None
            break
        log.info("host I/O: the machine has no file %r", path)
        return h.error(h.FILEIO_ENOENT)

    @handles(h.SetFs)
    def setfs(self, packet: h.SetFs) -> Reply:
        return h.reply(0)

    @handles(h.Open)
    def open_file(self, packet: h.Open) -> Reply:
        if packet.flags & h.O_WRITING:
            log.info("host I/O: %r opened to write (flags %#x): refused", packet.path, packet.flags)
            return h.error(h.FILEIO_EACCES)
        found = self._resolve(packet.path)
        if isinstance(found, bytes):
            return found
        path, entry = found
        if entry is None or isinstance(entry, ProcEntry) and entry.kind == DIRECTORY:
            return h.error(h.FILEIO_ENOENT)  # no directory can be opened (fs.c: sys_openat)
        if len(self._open) >= MAX_FDS:
            return h.error(h.FILEIO_EMFILE)
        fd = next(n for n in range(FIRST_FD, FIRST_FD + MAX_FDS + 1) if n not in self._open)
        self._open[fd] = _Generated(path, entry.data) if isinstance(entry, ProcEntry) else entry
        return h.reply(fd)

    @handles(h.Pread)
    def pread(self, packet: h.Pread) -> Reply:
        file = self._open.get(packet.fd)
        if file is None:
            return h.error(h.FILEIO_EINVAL)
        header = b"F%x;" % PACKET_SIZE  # the longest header: what gdbserver leaves room for
        count = min(packet.count, PACKET_SIZE - len(header))
        try:
            if isinstance(file, _Generated):
                data = file.data[packet.offset:packet.offset + count]
            else:
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
        its inode, the archive's mode, one link, blocks of 512 bytes, 4096-byte I/O, no owner and no times; a
        /proc file's as Linux's (regular, read-only, no size)."""
        file = self._open.get(packet.fd)
        if file is None:
            return h.error(h.FILEIO_EINVAL)
        stat = _PROC_FILE_STAT if isinstance(file, _Generated) else _file_stat(file)
        return Binary(b"F%x;" % len(stat) + stat)

    @handles(h.Lstat)
    def lstat(self, packet: h.Lstat) -> Reply:
        return self._stat(packet.path, follow=False)

    @handles(h.Stat)
    def stat(self, packet: h.Stat) -> Reply:
        return self._stat(packet.path, follow=True)

    def _stat(self, raw: bytes, follow: bool) -> Reply:
        """What the machine's kernel's stat tells a process of the path (fs.c: path_stat): its file's, as `fstat`
        answers, or its directory's (fill_dir_stat); ENOENT for neither. /proc's entries as Linux's: its
        directories, its files, its links (`lstat`: the link itself; `stat`: what it leads to)."""
        found = self._resolve(raw, follow)
        if isinstance(found, bytes):
            return found
        path, entry = found
        if isinstance(entry, RamfsFile):
            stat = _file_stat(entry)
        elif entry is None or entry.kind == DIRECTORY:
            stat = _directory_stat(path)
        elif entry.kind == LINK:
            stat = h.encode_stat(dev=0, ino=0, mode=0o120777, nlink=1, size=len(entry.data), blksize=1024,
                                 blocks=0)
        else:
            stat = _PROC_FILE_STAT
        return Binary(b"F%x;" % len(stat) + stat)

    @handles(h.Unlink)
    def unlink(self, packet: h.Unlink) -> Reply:
        log.info("host I/O: unlink %r: refused", packet.path)
        return h.error(h.FILEIO_EPERM)

    @handles(h.Readlink)
    def readlink(self, packet: h.Readlink) -> Reply:
        """A /proc link's target (`exe`, `cwd`); the machine's files and directories are no links: EINVAL for one,
        as readlink(2) answers."""
        found = self._resolve(packet.path, follow=False)
        if isinstance(found, bytes):
            return found
        _path, entry = found
        if isinstance(entry, ProcEntry) and entry.kind == LINK:
            return Binary(b"F%x;" % len(entry.data) + entry.data)
        return h.error(h.FILEIO_EINVAL)
