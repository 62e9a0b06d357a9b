"""The /proc files of the machine's processes as a debugger on the host reads them (the gdbserver role's host I/O,
stub/hostio.py: GDB's `info proc`, `info proc mappings`, `gcore`), rendered from the kernel's own tables the way
Linux's procfs renders them, as gdbserver reads the host kernel's /proc for the process it debugs:

- `/proc/PID/maps`: the process's memory areas (mm->vmas), `start-end perms offset dev inode` and the file mapped
  (its path in the machine), `[heap]` for the area of the program's break and `[stack]` for the one holding the
  stack's top; a file's device is the machine's file system's (1, as stat tells: fs.c) and its inode the file's;
- `/proc/PID/cmdline` and `environ`: the strings the process was started or last exec'd with (process.c's
  `exec_args`), each ended by a NUL; `comm`: its name and a newline;
- the links `/proc/PID/exe` (the program's path) and `/proc/PID/cwd` ("/", every process's working directory).

`/proc` and `/proc/PID` are directories. PID is a live process's (its group leader's tgid) or one of its threads';
`self` has no meaning from the host and is no entry. The machine's programs themselves see only /proc/self/exe
(fixtures/kernel/fs.c).

The areas are read between instructions on the CPU thread, never while a CPU holds the process's mm->lock (one
that is changing them: the read waits for it to let go), so a rendering is one state of the areas.

Threads: any thread; the kernel's memory is read through `Machine.run_on_cpu`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from .errors import MachineError
from .layouts import kernel_layout
from .ramfs import PATH_MAX, FileLayout, kernel_name
from .tasks import live_tasks

VM_READ, VM_WRITE, VM_EXEC = 0x1, 0x2, 0x4
#: a file's device in maps: the machine's file system's, as the kernel's stat tells it (fs.c: fill_stat)
FILE_DEVICE = (0, 1)
#: Linux pads a maps line to this column before the path (fs/proc/task_mmu.c: show_vma_header_prefix's width)
PATH_COLUMN = 73
#: reads of the areas put off while a CPU changes them, before giving up
LOCKED_RETRIES = 1000

DIRECTORY, FILE, LINK = "directory", "file", "link"


@dataclass(frozen=True)
class ProcEntry:
    """What a /proc path names: its kind, and for a file or a link its bytes (a link's: its target)."""

    kind: str
    data: bytes = b""


@dataclass(frozen=True)
class _Layout:
    nr_vmas: int
    vmas: int
    capacity: int
    vma_size: int
    vm_start: int
    vm_end: int
    vm_flags: int
    vm_file: int
    file_start: int
    start_brk: int
    brk: int
    start_stack: int
    lock_holder: int
    args: int  #: exec_args, one per process slot: the last of tasks[]'s (process.c: slot_of)
    args_count: int
    args_size: int
    argc: int
    envc: int
    strings_size: int
    strings: int
    strings_capacity: int

    @classmethod
    def read(cls, path: Any) -> _Layout:
        return kernel_layout(path, cls, cls._from_dwarf)

    @classmethod
    def _from_dwarf(cls, dwarf: Any) -> _Layout:
        mms, args = dwarf.global_variable("mms"), dwarf.global_variable("exec_args")
        if mms is None or args is None or None in (mms[1].target, args[1].target):
            raise MachineError("the kernel's DWARF lacks `mms` or `exec_args`: no /proc")
        mm, spawn = mms[1].target, args[1].target
        assert mm is not None and spawn is not None
        vmas, array = mm.member("vmas")
        area = array.target
        assert area is not None
        lock, spinlock = mm.member("lock")
        strings, chars = spawn.member("strings")
        return cls(mm.member("nr_vmas")[0], vmas, array.count or 0, area.size, area.member("vm_start")[0],
                   area.member("vm_end")[0], area.member("vm_flags")[0], area.member("file")[0],
                   area.member("file_start")[0], mm.member("start_brk")[0], mm.member("brk")[0],
                   mm.member("start_stack")[0], lock + spinlock.member("holder")[0], args[0], args[1].count or 0,
                   spawn.size, spawn.member("argc")[0], spawn.member("envc")[0], spawn.member("size")[0], strings,
                   chars.count or 0)


class ProcFiles:
    """The machine's /proc, as a debugger on the host reads it."""

    def __init__(self, machine: Any) -> None:
        self._machine = machine
        self._layout: _Layout | None = None
        self._files: FileLayout | None = None  #: a mapped file's `struct ramfs_file` (ramfs.py's)

    def lookup(self, path: bytes) -> ProcEntry | None:
        """What the normalized `path` names under /proc, or None: no such entry (a path outside /proc too)."""
        parts = path.strip(b"/").split(b"/")
        if parts[0] != b"proc":
            return None
        if len(parts) == 1:
            return ProcEntry(DIRECTORY)
        if not parts[1].isdigit() or len(parts) > 3 or len(parts[1]) > 10:
            return None
        layout = self._layout
        if layout is None:
            layout = self._layout = _Layout.read(self._machine.image.path)
            self._files = FileLayout.read(self._machine.image.path)
        name = parts[2] if len(parts) == 3 else None
        if name not in (None, b"maps", b"cmdline", b"environ", b"comm", b"exe", b"cwd"):
            return None
        for _ in range(LOCKED_RETRIES):
            found = self._machine.run_on_cpu(lambda uc: self._render(uc, layout, int(parts[1]), name))
            if found is not _LOCKED:
                return found
        raise MachineError(f"the areas of process {int(parts[1])} stayed locked: /proc not read")

    def _render(self, uc: Any, layout: _Layout, pid: int, name: bytes | None) -> ProcEntry | None | object:
        tasks = live_tasks(uc, self._machine.image, self._machine.ptrace.layout)
        task = next((t for t in tasks if t.pid == pid), None)
        if task is None:
            return None
        leader = next((t for t in tasks if t.pid == task.tgid), task)
        if name is None:
            return ProcEntry(DIRECTORY)
        if name == b"cwd":
            return ProcEntry(LINK, b"/")
        if name == b"comm":
            comm = bytes(uc.mem_read(leader.address + self._machine.ptrace.layout.comm, 16)).split(b"\0")[0]
            return ProcEntry(FILE, comm + b"\n")
        if name in (b"cmdline", b"environ", b"exe"):
            path, argv, envp = self._strings(uc, layout, leader)
            if name == b"exe":
                return ProcEntry(LINK, path)
            return ProcEntry(FILE, b"".join(s + b"\0" for s in (argv if name == b"cmdline" else envp)))
        if struct.unpack("<i", uc.mem_read(task.mm + layout.lock_holder, 4))[0] != -1:
            return _LOCKED
        return ProcEntry(FILE, self._maps(uc, layout, task.mm))

    def _strings(self, uc: Any, layout: _Layout, leader: Any) -> tuple[bytes, list[bytes], list[bytes]]:
        """The leader's slot's exec_args: the program's path, its arguments, its environment."""
        tasks, size = self._machine.image.symbols["tasks"], self._machine.ptrace.layout.size
        slot = (leader.address - tasks.address) // size - (tasks.size // size - layout.args_count)
        raw = bytes(uc.mem_read(layout.args + slot * layout.args_size, layout.args_size))
        argc, envc, size = (struct.unpack_from("<I", raw, at)[0] for at in (layout.argc, layout.envc,
                                                                            layout.strings_size))
        strings = raw[layout.strings:layout.strings + min(size, layout.strings_capacity)].split(b"\0")
        return strings[0], strings[1:1 + argc], strings[1 + argc:1 + argc + envc]

    def _maps(self, uc: Any, layout: _Layout, mm: int) -> bytes:
        count = struct.unpack("<i", uc.mem_read(mm + layout.nr_vmas, 4))[0]
        raw = bytes(uc.mem_read(mm + layout.vmas, max(0, min(count, layout.capacity)) * layout.vma_size))
        start_brk, brk, start_stack = (struct.unpack("<Q", uc.mem_read(mm + at, 8))[0]
                                       for at in (layout.start_brk, layout.brk, layout.start_stack))
        lines = []
        for at in range(0, len(raw), layout.vma_size):
            start, end, flags, file, offset = (struct.unpack_from("<Q", raw, at + field)[0] for field in (
                layout.vm_start, layout.vm_end, layout.vm_flags, layout.vm_file, layout.file_start))
            perms = "".join(c if flags & bit else "-" for c, bit in (("r", VM_READ), ("w", VM_WRITE),
                                                                      ("x", VM_EXEC))) + "p"
            device, inode, path = (0, 0), 0, b""
            if file:
                files = self._files
                assert files is not None
                device = FILE_DEVICE
                inode = struct.unpack("<Q", uc.mem_read(file + files.data, 8))[0]
                at = struct.unpack("<Q", uc.mem_read(file + files.name, 8))[0]
                name = kernel_name(self._machine.kernel_space, at, PATH_MAX)
                path = b"/" + (name or b"").lstrip(b"/")
            elif start < brk and end > start_brk:  # (task_mmu.c: vma_is_initial_heap, then the stack)
                path = b"[heap]"
            elif start <= start_stack <= end:
                path = b"[stack]"
            head = f"{start:08x}-{end:08x} {perms} {offset if file else 0:08x} {device[0]:02x}:{device[1]:02x} {inode} "
            lines.append((head.ljust(PATH_COLUMN) if path else head).encode() + path + b"\n")
        return b"".join(lines)


_LOCKED = object()  #: a CPU holds the areas' lock: read them again once it let go
