"""The kernel's processes as the host reads them from kernel memory: the live tasks of its `tasks[]`, each
process's address space (`mm->pgd`) and memory areas (`mm->vmas`), for a debugger that must tell processes apart
without stopping any (KGTP mode's breakpoints at user addresses, stub/kernel.py; the gdbserver role's threads,
tracee.py).

The offsets of a task's fields are the kernel's `ptrace_abi` table's (tracee.TaskLayout, handed in); those of
`struct mm_struct`'s areas and `struct vm_area_struct` (fixtures/kernel/include/process.h) come from the kernel's
DWARF, read once, on first use.

Threads: `live_tasks` runs on the CPU thread (it is given the unicorn instance); `ProcessTable`' methods on any
thread, reading through `Machine.run_on_cpu`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from .errors import MachineError
from .layouts import kernel_layout

EXIT_ZOMBIE, TASK_DEAD = 0x20, 0x80
VM_EXEC = 0x4  #: a memory area's vm_flags: its pages may be run


@dataclass(frozen=True)
class Task:
    """A live task of a process, as tasks[] holds it."""

    address: int
    pid: int
    tgid: int
    mm: int


def live_tasks(uc: Any, image: Any, layout: Any) -> list[Task]:
    """The tasks of processes in the kernel's tasks[] that live (an address space, not ended), read with `uc` on
    the CPU thread; `layout` is the kernel's ptrace_abi (tracee.TaskLayout)."""
    symbol = image.symbols["tasks"]
    count = symbol.size // layout.size
    raw = bytes(uc.mem_read(symbol.address, count * layout.size))
    found = []
    for index in range(count):
        base = index * layout.size
        pid, = struct.unpack_from("<i", raw, base + layout.pid)
        group, = struct.unpack_from("<i", raw, base + layout.tgid)
        state, = struct.unpack_from("<q", raw, base + layout.state)
        mm, = struct.unpack_from("<Q", raw, base + layout.mm)
        if mm and state not in (TASK_DEAD, EXIT_ZOMBIE):
            found.append(Task(symbol.address + base, pid, group, mm))
    return found


@dataclass(frozen=True)
class AreaLayout:
    """Where `struct mm_struct` keeps its memory areas and what a `struct vm_area_struct` holds."""

    nr_vmas: int
    vmas: int
    capacity: int
    size: int
    start: int
    end: int
    flags: int

    @classmethod
    def read(cls, path: Any) -> AreaLayout:
        return kernel_layout(path, cls, cls._from_dwarf)

    @classmethod
    def _from_dwarf(cls, dwarf: Any) -> AreaLayout:
        found = dwarf.global_variable("mms")  # process.c's mm_structs (task.h only declares the struct)
        if found is None or found[1].target is None:
            raise MachineError("the kernel's DWARF has no `mms`: its processes' memory areas cannot be read")
        mm = found[1].target
        nr_vmas, _ = mm.member("nr_vmas")
        vmas, array = mm.member("vmas")
        area = array.target
        return cls(nr_vmas, vmas, array.count or 0, area.size, area.member("vm_start")[0],
                   area.member("vm_end")[0], area.member("vm_flags")[0])


class ProcessTable:
    """The machine's live processes, by pid (their tgid): address spaces and memory areas."""

    def __init__(self, machine: Any) -> None:
        self._machine = machine
        self._areas: AreaLayout | None = None

    def _tasks(self, uc: Any) -> list[Task]:
        return live_tasks(uc, self._machine.image, self._machine.ptrace.layout)

    def spaces(self) -> dict[int, Any]:
        """Every live process's address space (uc_paging.AddressSpace of its page tables), by pid."""
        pgd = self._machine.ptrace.layout.mm_pgd

        def spaces(uc: Any) -> dict[int, Any]:
            found: dict[int, Any] = {}
            for task in self._tasks(uc):
                root = struct.unpack("<Q", uc.mem_read(task.mm + pgd, 8))[0]
                found.setdefault(task.tgid, self._machine.kernel_space.space_at(root))
            return found

        return self._machine.run_on_cpu(spaces)

    def mapping(self, address: int, code: bool) -> list[int]:
        """The live processes (pids, sorted) one of whose memory areas covers `address` (an executable one for
        `code`), as the kernel keeps them: a page not faulted in yet counts (code the program has not run so far)."""
        areas = self._areas
        if areas is None:
            areas = self._areas = AreaLayout.read(self._machine.image.path)

        def scan(uc: Any) -> list[int]:
            found = set()
            for task in self._tasks(uc):
                count = struct.unpack("<i", uc.mem_read(task.mm + areas.nr_vmas, 4))[0]
                raw = bytes(uc.mem_read(task.mm + areas.vmas, max(0, min(count, areas.capacity)) * areas.size))
                for at in range(0, len(raw), areas.size):
                    start, end, flags = (struct.unpack_from("<Q", raw, at + offset)[0]
                                         for offset in (areas.start, areas.end, areas.flags))
                    if start <= address < end and (flags & VM_EXEC or not code):
                        found.add(task.tgid)
            return sorted(found)

        return self._machine.run_on_cpu(scan)
