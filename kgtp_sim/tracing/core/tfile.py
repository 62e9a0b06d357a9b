"""Trace files in GDB's tfile format, written by the target for `tsave -r` (QTSave).

The same file GDB writes for `tsave`: a text header of definitions (register block size, status, trace variables,
tracepoints with their hit counts, the target description), an empty line, the raw frames, and a 4-byte zero.
`target tfile FILE` reads it back. Where the file may go is confined to the directory chosen at start-up.

Pure: writes bytes from the definitions and frames it is given; called on the server thread (QTSave).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


class SavePathError(ValueError):
    """The requested path is refused (no save directory configured, or it escapes it)."""


def resolve_save_path(save_dir: Path | None, requested: str) -> Path:
    if save_dir is None:
        raise SavePathError("target-side saving is disabled (start the stub with --save-dir DIR)")
    if not requested or any(ord(c) < 0x20 or ord(c) == 0x7F for c in requested):
        raise SavePathError("empty file name, or control characters in it")
    root = save_dir.resolve()
    candidate = Path(requested)
    target = (candidate if candidate.is_absolute() else root / candidate).resolve()
    if target == root or root not in target.parents:
        raise SavePathError(f"{requested!r} is outside the save directory {root}")
    return target


def write_tfile(
    path: Path,
    *,
    regblock_size: int,
    status_reply: bytes,
    variables: list[bytes],
    tracepoints: list[bytes],
    usage: list[tuple[int, int, int, int]],
    tdesc: str,
    frames: bytes,
) -> None:
    """`status_reply` is a qTStatus reply (`T0;...`); `variables`/`tracepoints` are qTfV/qTfP upload pieces;
    `usage` holds (number, address, hits, bytes) per location."""
    lines = [b"\x7fTRACE0\n", b"R %x\n" % regblock_size, b"status " + status_reply[1:] + b"\n"]
    lines += [b"tsv " + v + b"\n" for v in variables]
    lines += [b"tp " + piece + b"\n" for piece in tracepoints]
    lines += [b"tp V%x:%x:%x:%x\n" % entry for entry in usage]
    lines += [b"tdesc " + line.encode() + b"\n" for line in tdesc.splitlines() if line]
    data = b"".join(lines) + b"\n" + frames + b"\0\0\0\0"
    # A fresh, exclusively created temporary (never a name someone could have planted a link at), renamed over
    # the target: the rename replaces a link at the final name instead of writing through it.
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
