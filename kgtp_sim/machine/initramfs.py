"""The initramfs archive: programs packed as Linux's initramfs is, a cpio archive in the "newc" format.

Pure (no machine, no threads). `Archive` collects files under their paths inside the machine (the host's absolute
paths: a program finds its files where the host has them) and `pack()` returns the archive's bytes, which
`process.Processes` places in the machine's RAM before boot for the kernel's initramfs.c to list.

newc, as Linux's usr/gen_init_cpio writes it: per entry a 110-byte header, "070701" then thirteen 8-digit hex
fields (ino, mode, uid, gid, nlink, mtime, filesize, devmajor, devminor, rdevmajor, rdevminor, namesize,
check), the NUL-terminated name padded with the header to a multiple of 4 bytes, the data padded likewise;
directories before the files in them; a last entry named TRAILER!!!.
"""

from __future__ import annotations

import posixpath
import stat
from dataclasses import dataclass, field
from pathlib import Path

NEWC_MAGIC = b"070701"
TRAILER = "TRAILER!!!"


def _pad4(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 4)


def _entry(name: str, mode: int, data: bytes, ino: int) -> bytes:
    encoded = name.encode() + b"\0"
    fields = (ino, mode, 0, 0, 2 if stat.S_ISDIR(mode) else 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0)
    header = NEWC_MAGIC + b"".join(b"%08x" % value for value in fields)
    return _pad4(header + encoded) + _pad4(data)


@dataclass
class Archive:
    """Files for the machine, by their absolute path inside it."""

    files: dict[str, tuple[int, bytes]] = field(default_factory=dict)  # path -> (mode, data)

    def add_file(self, path: str, data: bytes, mode: int = 0o755) -> None:
        path = "/" + posixpath.normpath(path).lstrip("/")
        if path == "/":
            raise ValueError("a file needs a name")
        self.files[path] = (stat.S_IFREG | (mode & 0o7777), bytes(data))

    def add_host_file(self, host_path: str | Path) -> str:
        """The host file under its absolute path; returns that path (the one the machine knows it by)."""
        resolved = Path(host_path).resolve()
        info = resolved.stat()
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{host_path}: not a regular file")
        self.add_file(str(resolved), resolved.read_bytes(), info.st_mode)
        return str(resolved)

    def pack(self) -> bytes:
        directories: set[str] = set()
        for path in self.files:
            parent = posixpath.dirname(path)
            while parent != "/":
                directories.add(parent)
                parent = posixpath.dirname(parent)
        out = bytearray()
        ino = 1
        for directory in sorted(directories):
            out += _entry(directory.lstrip("/"), stat.S_IFDIR | 0o755, b"", ino)
            ino += 1
        for path in sorted(self.files):
            mode, data = self.files[path]
            out += _entry(path.lstrip("/"), mode, data, ino)
            ino += 1
        out += _entry(TRAILER, 0, b"", 0)
        return bytes(out)


def unpack(archive: bytes) -> dict[str, tuple[int, bytes]]:
    """The entries of a newc archive (name -> (mode, data)), up to its trailer: for tests and diagnostics."""
    entries, offset = {}, 0
    while offset + 110 <= len(archive) and archive[offset: offset + 6] == NEWC_MAGIC:
        fields = [int(archive[offset + 6 + 8 * i: offset + 14 + 8 * i], 16) for i in range(13)]
        mode, size, namesize = fields[1], fields[6], fields[11]
        name = archive[offset + 110: offset + 110 + namesize - 1].decode()
        data_at = (offset + 110 + namesize + 3) & ~3
        if name == TRAILER:
            break
        entries[name] = (mode, archive[data_at: data_at + size])
        offset = (data_at + size + 3) & ~3
    return entries
