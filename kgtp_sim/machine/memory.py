"""The machine's memory from the host's side: physical frames, the address spaces, the kernel's demand frames,
the stub's pages, and keeping translated code true to memory.

Owns, for the one unicorn instance (kgtp_sim/uc_paging.py holds the page-table mechanics):

- physical memory (`uc.mem_map`; every frame RWX to unicorn, the rights live in the entries) and the kernel's
  tables as a bootloader builds them: the image's pages with their segments' rights, the boot page and its GDT,
  empty tables under the demand region (docs/DESIGN.md, "Address space of the simulated machine");
- the address spaces: the kernel's (`kernel`, the default everywhere) and the ones `new_space` makes, each
  sharing the kernel half, with its own user half;
- the frames of the kernel's demand region (handed out and taken back through port 0x80, devices.py);
- the pages of module and vmalloc space the stub allocates (`Machine.alloc_code`/`alloc_data`);
- dropping translated code after the host changed code (`remove_cache`).

Runs on the CPU thread (inside a posted request or a hook), or on the caller's before `Machine.start`.
"""

from __future__ import annotations

import struct

from unicorn import UC_PROT_ALL
from unicorn import x86_const as X
from unicorn.unicorn_const import UC_CTL_IO_WRITE, UC_CTL_TLB_FLUSH

from .. import uc_paging as paging
from ..uc_paging import AddressSpace, PagedUc, PageTables
from .errors import MachineError
from .image import KernelImage
from .layout import (
    BOOT_BASE,
    BOOT_SIZE,
    DEMAND_BASE,
    DEMAND_SIZE,
    MODULE_BASE,
    MODULE_SIZE,
    PAGE_SIZE,
    PHYS_BOOT,
    PHYS_DEMAND,
    PHYS_DEMAND_SIZE,
    PHYS_KERNEL,
    PHYS_KERNEL_SIZE,
    PHYS_MODULE,
    PHYS_TABLES,
    PHYS_TABLES_SIZE,
    PHYS_VMALLOC,
    VMALLOC_BASE,
    VMALLOC_SIZE,
    page_ceil,
    page_floor,
)

#: the bootloader's GDT: null, 64-bit code (0x08), data (0x10); the kernel installs its own equivalent
BOOT_GDT = struct.pack("<3Q", 0, 0x00AF9B000000FFFF, 0x00CF93000000FFFF)


def _gaps(regions) -> list[tuple[int, int]]:
    """The physical addresses no region backs, as inclusive (begin, end) ranges, from unicorn's inclusive
    (begin, end, perms) regions."""
    gaps, cursor = [], 0
    for begin, end, _ in sorted(regions):
        if begin > cursor:
            gaps.append((cursor, begin - 1))
        cursor = end + 1
    if cursor <= 2**64 - 1:
        gaps.append((cursor, 2**64 - 1))
    return gaps


class Memory:
    """Physical memory and page tables of a CPU running `image`, built before its first instruction."""

    def __init__(self, uc: PagedUc, image: KernelImage) -> None:
        self.uc = uc
        uc.mem_map(PHYS_BOOT, PAGE_SIZE, UC_PROT_ALL)
        uc.mem_map(PHYS_TABLES, PHYS_TABLES_SIZE, UC_PROT_ALL)
        uc.mem_map(PHYS_DEMAND, PHYS_DEMAND_SIZE, UC_PROT_ALL)
        uc.mem_map(PHYS_MODULE, MODULE_SIZE, UC_PROT_ALL)
        uc.mem_map(PHYS_VMALLOC, VMALLOC_SIZE, UC_PROT_ALL)
        #: the kernel's address space: its page tables, the default space of every access
        self.kernel = PageTables(uc, PHYS_TABLES, PHYS_TABLES_SIZE)
        self._map_image(image)
        self.kernel.map(BOOT_BASE, PHYS_BOOT, BOOT_SIZE, paging.RODATA)
        uc.phys_write(PHYS_BOOT, BOOT_GDT)
        self.kernel.prepare(DEMAND_BASE, DEMAND_SIZE)  # entries absent: the kernel's #PF handler fills them
        #: module and vmalloc pages mapped so far, with their rights (`map_stub_pages`)
        self._stub_pages: dict[int, int] = {}
        #: frames of the demand pool not handed to the kernel (it asks through port 0x80)
        self._free_frames = list(range(PHYS_DEMAND + PHYS_DEMAND_SIZE - PAGE_SIZE, PHYS_DEMAND - 1, -PAGE_SIZE))
        self.frames_in_use = 0

    def _map_image(self, image: KernelImage) -> None:
        """Load each PT_LOAD at PHYS_KERNEL + (vaddr - lowest vaddr) and map its pages with its permissions:
        text read-only and executable, rodata read-only, data no-execute (a kernel write to text is a #PF)."""
        low = page_floor(min(seg.vaddr for seg in image.segments))
        high = page_ceil(max(seg.end for seg in image.segments))
        if high - low > PHYS_KERNEL_SIZE:
            raise MachineError(f"kernel image of {high - low:#x} bytes does not fit {PHYS_KERNEL_SIZE:#x}")
        self.uc.mem_map(PHYS_KERNEL, high - low, UC_PROT_ALL)
        rights: dict[int, tuple[bool, bool]] = {}  # page -> (writable, executable): a shared page gets both's
        for seg in image.segments:
            for page in range(page_floor(seg.vaddr), page_ceil(seg.end), PAGE_SIZE):
                w, x = rights.get(page, (False, False))
                rights[page] = (w or seg.writable, x or seg.executable)
        runs: list[list] = []  # [start, end, rights]: consecutive pages of the same rights, one map() each
        for page, page_rights in sorted(rights.items()):
            if runs and runs[-1][1] == page and runs[-1][2] == page_rights:
                runs[-1][1] += PAGE_SIZE
            else:
                runs.append([page, page + PAGE_SIZE, page_rights])
        for start, end, (w, x) in runs:
            self.kernel.map(start, PHYS_KERNEL + start - low, end - start, paging.leaf_flags(True, w, x))
        for seg in image.segments:
            self.uc.phys_write(PHYS_KERNEL + seg.vaddr - low, seg.data)

    # ---- address spaces ------------------------------------------------------------------------------------

    def new_space(self) -> AddressSpace:
        """A space for a process: the kernel half shared with the kernel's space, the user half empty."""
        return self.kernel.new_space()

    def loaded_space(self) -> AddressSpace:
        """The space whose root the loaded CPU's CR3 holds (a read-only view if the machine did not make it)."""
        return self.kernel.space_at(self.uc.reg_read(X.UC_X86_REG_CR3))

    def executable(self, address: int, space: AddressSpace | None = None) -> bool:
        """Is the page holding `address` present and executable in `space` (None: the kernel's)?"""
        return (space or self.kernel).executable(address)

    # ---- the stub's pages ----------------------------------------------------------------------------------

    def map_stub_pages(self, address: int, length: int, data: bool = False) -> None:
        """Map the pages of module or vmalloc space under [address, address + length) as their space wants them
        (module space read-write-execute, vmalloc space no-execute), each to its own frame; `data` maps module
        pages no-execute (data that code in module space keeps beside itself: see `Machine.alloc_code`).
        A page mapped before with other rights is mapped again."""
        if MODULE_BASE <= address < MODULE_BASE + MODULE_SIZE:
            base, physical, flags = MODULE_BASE, PHYS_MODULE, paging.DATA if data else paging.CODE
        elif VMALLOC_BASE <= address < VMALLOC_BASE + VMALLOC_SIZE:
            base, physical, flags = VMALLOC_BASE, PHYS_VMALLOC, paging.DATA
        else:
            raise ValueError(f"{address:#x} is neither in module space nor in vmalloc space")
        first = page_floor(address)
        last = page_ceil(address + length)
        remapped = False
        run_start = None
        for page in list(range(first, last, PAGE_SIZE)) + [None]:
            if page is not None and self._stub_pages.get(page) != flags:
                remapped |= page in self._stub_pages
                run_start = page if run_start is None else run_start
                continue
            if run_start is not None:
                end = page if page is not None else last
                self.kernel.map(run_start, physical + run_start - base, end - run_start, flags)
                self._stub_pages.update(dict.fromkeys(range(run_start, end, PAGE_SIZE), flags))
                run_start = None
        if remapped:  # the TLB may still hold the old rights
            self.uc.ctl(UC_CTL_TLB_FLUSH, UC_CTL_IO_WRITE)

    def zero_stub_data(self, address: int, length: int) -> None:
        """Zero [address, address + length) of vmalloc space (mapped by `map_stub_pages`) in one write to the
        frames behind it: vmalloc space maps onto its frames in order, and its pages are no-execute, so no
        translated code can be stale there (a trace buffer of megabytes zeroed page by page through the tables
        took some 15 ms of each tstart)."""
        if not VMALLOC_BASE <= address <= address + length <= VMALLOC_BASE + VMALLOC_SIZE:
            raise ValueError(f"{address:#x}+{length:#x} is not in vmalloc space")
        self.uc.phys_write(PHYS_VMALLOC + address - VMALLOC_BASE, bytes(length))

    # ---- the demand region: frames for the kernel's #PF handler -----------------------------------------------

    def alloc_frame(self) -> int:
        """A zeroed page frame for the kernel to map in its demand region (0 if none is left)."""
        if not self._free_frames:
            return 0
        frame = self._free_frames.pop()
        self.uc.phys_write(frame, bytes(PAGE_SIZE))
        self.frames_in_use += 1
        return frame

    def free_frame(self, frame: int) -> bool:
        """The kernel gives a frame back (after clearing its entry and invalidating its TLB entry)."""
        if not PHYS_DEMAND <= frame < PHYS_DEMAND + PHYS_DEMAND_SIZE or frame & (PAGE_SIZE - 1) or (
                frame in self._free_frames):
            return False
        self._free_frames.append(frame)
        self.frames_in_use -= 1
        return True

    @property
    def demand_pages(self) -> set[int]:
        """Pages of the demand region the kernel has made present (read from its page table)."""
        table = self.kernel.entry_address(DEMAND_BASE)
        count = DEMAND_SIZE // PAGE_SIZE
        entries = struct.unpack(f"<{count}Q", self.uc.phys_read(table, 8 * count))
        return {DEMAND_BASE + i * PAGE_SIZE for i, entry in enumerate(entries) if entry & paging.PTE_PRESENT}

    # ---- translated code -----------------------------------------------------------------------------------

    def remove_cache(self, address: int, length: int, space: AddressSpace | None = None,
                     in_emulation: bool = False) -> bool:
        """Drop translated code over [address, address + length) of `space` (None: the kernel's) after the host
        changed it. Only for executable pages: unicorn finds the code through an instruction fetch, which on any
        other page fails and leaves a #PF in flight. That fetch goes through the loaded CPU's CR3: the kernel
        half is the same in every space; a process's half is looked up with its space loaded for the moment
        (between runs). Inside emulation, the user half of a space not loaded would be translated through
        another space's tables, so there every translated block is dropped instead (the emulator keys its
        blocks by physical page, so a process would otherwise run its old code when loaded again): between
        runs only, as dropping them all under a running block is not safe. False: inside emulation, where this
        code cannot be dropped (a process's half of a space not loaded, or any code while the CPU runs in user
        mode): the caller drops it once the run ended (Cpu.remove_cache)."""
        space = space or self.kernel
        if length <= 0 or not (space.executable(address) and space.executable(address + length - 1)):
            return True
        if not paging.kernel_half(address) and not in_emulation:
            # a process's code: the fetch of a user page succeeds at any privilege, through the space's own tables:
            # the space is loaded for the lookup (and the loaded one put back), so only the blocks of that code go
            cr3 = self.uc.reg_read(X.UC_X86_REG_CR3)
            if cr3 & paging.PTE_ADDRESS == space.root:
                self.uc.ctl_remove_cache(address, address + length)
                return True
            self.uc.reg_write(X.UC_X86_REG_CR3, space.root)
            try:
                self.uc.ctl_remove_cache(address, address + length)
            finally:
                self.uc.reg_write(X.UC_X86_REG_CR3, cr3)
            return True
        # the fetch also runs at the loaded CPU's privilege: from ring 3 a kernel page is a supervisor page it may
        # not fetch from (no block found, a #PF left in flight), so a CPU in user mode drops every block instead
        user_mode = bool(self.uc.reg_read(X.UC_X86_REG_CS) & 3)
        if not user_mode and (paging.kernel_half(address) or self.loaded_space() is space):
            self.uc.ctl_remove_cache(address, address + length)
            return True
        if in_emulation:
            return False
        self.uc.ctl_flush_tb()
        return True
