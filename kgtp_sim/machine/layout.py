"""The simulated address space (docs/DESIGN.md) and the allocators for the regions the stub owns.

The stub generates code (probe detours, compiled agent expressions) and data (trace buffer, agent contexts)
inside the machine, like a kernel module would: code goes to "module space", data to "vmalloc space". A page of
either is mapped in the page tables the first time an allocation covers it, and stays mapped.

Thread: the constants are read anywhere; the allocators take a lock, so any thread may allocate: the tracer
allocates where it starts a run or installs a location (on the CPU thread, at tstart or when GDB arms a location
during a run), `Machine.call` and the tests on the caller's thread.
"""

from __future__ import annotations

import threading

PAGE_SIZE = 0x1000

MODULE_BASE = 0xFFFF_FFFF_A000_0000  #: executable memory for stub-generated code (Machine.alloc_code)
MODULE_SIZE = 64 << 20
VMALLOC_BASE = 0xFFFF_C900_0000_0000  #: stub data (Machine.alloc_data)
VMALLOC_SIZE = 0x10000000  # 256 MiB: a 64 MiB trace buffer plus contexts and counters
DEMAND_BASE = 0xFFFF_8880_0000_0000  #: unmapped until the kernel touches it (#PF -> do_page_fault -> port 0x80)
DEMAND_SIZE = 1 << 20
BOOT_BASE = 0xFFFF_FE00_0000_0000  #: the "bootloader" page: a GDT valid before the kernel loads its own
BOOT_SIZE = PAGE_SIZE

# Physical memory (what `uc.mem_map` maps; the CPU reaches it only through the page tables, docs/DESIGN.md).
PHYS_BOOT = 0x0000_1000  #: the bootloader's GDT page
PHYS_TABLES = 0x0010_0000  #: the page-table pool: the PML4 and every table under it
PHYS_TABLES_SIZE = 2 << 20
PHYS_KERNEL = 0x0100_0000  #: the kernel image (16 MiB, as Linux's default load address)
PHYS_KERNEL_SIZE = 16 << 20
PHYS_DEMAND = 0x0200_0000  #: page frames handed to the kernel's #PF handler (port 0x80), one per demand page
PHYS_DEMAND_SIZE = DEMAND_SIZE
PHYS_MODULE = 0x0400_0000  #: module space's frames, at the same offsets as its virtual pages
PHYS_VMALLOC = 0x1000_0000  #: vmalloc space's frames, likewise
PHYS_RAM = 0x0800_0000  #: RAM for processes and the initramfs (process.py; the kernel's RAM_PHYS)
RAM_SIZE = 64 << 20
PAGE_OFFSET = 0xFFFF_8880_0000_0000  #: the kernel sees RAM at PAGE_OFFSET + physical (Linux's direct map)


def page_floor(address: int) -> int:
    return address & ~(PAGE_SIZE - 1)


def page_ceil(address: int) -> int:
    return (address + PAGE_SIZE - 1) & ~(PAGE_SIZE - 1)


class RegionAllocator:
    """First-fit allocator over [base, base+size) with coalescing frees. Thread-safe.

    Blocks are aligned to `align`; the free list stays short because the stub allocates a few long-lived blocks
    (detours, buffers) rather than many small ones.
    """

    def __init__(self, base: int, size: int, align: int = 16) -> None:
        self.base = base
        self.size = size
        self.align = align
        self._free: list[tuple[int, int]] = [(base, size)]  # sorted (start, length)
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()

    def alloc(self, length: int) -> int:
        if length <= 0:
            raise ValueError(f"allocation size must be positive, not {length}")
        length = (length + self.align - 1) // self.align * self.align
        with self._lock:
            for i, (start, free) in enumerate(self._free):
                if free >= length:
                    if free == length:
                        del self._free[i]
                    else:
                        self._free[i] = (start + length, free - length)
                    self._used[start] = length
                    return start
        raise MemoryError(f"region {self.base:#x}+{self.size:#x} exhausted ({length} bytes wanted)")

    def free(self, address: int) -> None:
        with self._lock:
            try:
                length = self._used.pop(address)
            except KeyError:
                raise ValueError(f"{address:#x} was not allocated here") from None
            self._free.append((address, length))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for start, free in self._free:
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + free)
                else:
                    merged.append((start, free))
            self._free = merged

    def size_of(self, address: int) -> int:
        with self._lock:
            return self._used[address]

    @property
    def allocated(self) -> int:
        with self._lock:
            return sum(self._used.values())

    def __contains__(self, address: int) -> bool:
        return self.base <= address < self.base + self.size
