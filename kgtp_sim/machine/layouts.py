"""Where the kernel keeps what the host reads in its memory (a table's address, a structure's size, a member's
offset), found in its DWARF once per kernel file and kept in a cache on disk, so a server that starts for one short
session does not parse the DWARF (0.2 s) to read the machine's files or its processes' areas.

`kernel_layout(path, cls, compute)` returns `cls(**fields)`: from the cache when it holds an entry for this kernel
file (its resolved path, size, modification time and inode) and for this layout class with these field names, else
from `compute(dwarf)` (a KernelDwarf lent by `KernelDwarf.reading`), then written to the cache. A layout that cannot
be computed raises whatever `compute` raises (nothing is cached then); a cache that cannot be read or written (a
read-only home, a damaged file) is only a slower start. The cache is one JSON file per kernel file under
`${XDG_CACHE_HOME:-~/.cache}/kgtp-sim/layouts/`, written whole to a temporary name and renamed (servers started side
by side may race: each writes a complete file, the last rename wins, a lost entry is computed again).

Any thread; the readers are the layout classes' `read` (ramfs.py, procfs.py, tasks.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def cache_directory() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kgtp-sim" / "layouts"


def _identity(path: Path) -> tuple[str, str] | None:
    """(cache file name, what the kernel file is now) for `path`, None when it cannot be stat()ed."""
    try:
        stat = path.stat()
    except OSError:
        return None
    resolved = str(path.resolve())
    name = hashlib.sha256(resolved.encode()).hexdigest()[:32] + ".json"
    return name, f"{resolved}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}"


def _load(file: Path, kernel: str) -> dict[str, Any]:
    try:
        with open(file) as stream:
            saved = json.load(stream)
    except (OSError, ValueError):
        return {}
    if not isinstance(saved, dict) or saved.get("kernel") != kernel or not isinstance(saved.get("layouts"), dict):
        return {}
    return saved["layouts"]


def _store(file: Path, kernel: str, layouts: dict[str, Any]) -> None:
    temporary = file.with_name(f"{file.name}.{os.getpid()}.tmp")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with open(temporary, "w") as stream:
            json.dump({"kernel": kernel, "layouts": layouts}, stream)
        os.replace(temporary, file)
    except OSError:
        try:
            temporary.unlink()
        except OSError:
            pass


def kernel_layout(path: Any, cls: type[T], compute: Callable[[Any], T]) -> T:
    """`cls`'s layout of the kernel at `path` (a dataclass of ints): cached, or computed from its DWARF."""
    kernel_path = Path(path)
    fields = [field.name for field in dataclasses.fields(cls)]  # type: ignore[arg-type]
    key = f"{cls.__module__}.{cls.__qualname__}({','.join(fields)})"
    identity = _identity(kernel_path)
    if identity is not None:
        name, kernel = identity
        entry = _load(cache_directory() / name, kernel).get(key)
        if isinstance(entry, dict) and sorted(entry) == sorted(fields) and \
                all(isinstance(value, int) for value in entry.values()):
            return cls(**entry)
    from .dwarf import KernelDwarf

    with KernelDwarf.reading(kernel_path) as dwarf:
        layout = compute(dwarf)
    if identity is not None:
        file = cache_directory() / name
        layouts = _load(file, kernel)
        layouts[key] = dataclasses.asdict(layout)  # type: ignore[call-overload]
        _store(file, kernel, layouts)
    return layout
