"""x86_64 4-level page tables in the emulated machine's physical memory, address spaces, and access through them
from the host.

A leaf module (it imports nothing from kgtp_sim): shared by the machine's CPU and the agent sandbox. No thread of
its own; its objects are used by whoever owns the unicorn instance (the machine's CPU thread).

Unicorn runs with its default TLB: the CPU translates every access through CR3's tables like a real x86_64 in
long mode (CR0.PG, CR4.PAE, EFER.LME), and `uc.mem_map` defines physical memory. An `AddressSpace` is one tree of
tables under a root (a CR3 value): the bootloader's and the module loader's side of paging. It builds its tables
from a pool of physical pages, maps pages with the permissions a kernel gives them (present, writable,
no-execute, user), walks them to translate a virtual address for the host, and reads and writes through them.
`PageTables` is the kernel's space, the first: PML4 slot 510 points back at the PML4 itself, so the kernel
reaches the entry of any address at `PTE_WINDOW + (address >> 9 & 0x7ffffffff8)` and fills or clears the entries
of its demand-paged region itself. Its `new_space` makes a space for a process: the kernel half shared (the
upper PML4 entries copied, slot 510 pointing at the new root), the user half empty.

`PagedUc` is the unicorn CPU whose `mem_read`/`mem_write` take virtual addresses and go through those tables,
the way a debugger reads a kernel: an address whose page is not present is an error (`UcError`, as an unmapped
address always was), never a mapping made by the read, and the CPU's state is left as it was; a write to a
read-only page (kernel text) is done, as a debugger's (or text_poke's) would be. The kernel half goes through
the kernel's space, the rest through the space CR3 holds (what a hook sees is what the interrupted code sees).
`phys_read`/`phys_write` reach physical memory.

Why not `uc_vmem_read`/`uc_vmem_translate`: in unicorn 2.1.4 they probe the CPU's own TLB fill, and a probe that
fails still leaves a page fault pending in the CPU (CR2 set to the address, exception_index 14) that is taken
as a bogus #PF when emulation resumes from a hook. A walk of our own has no side effect, and can walk a space
the CPU has not loaded.
"""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Callable, Iterable

import functools

from unicorn import UC_ARCH_X86, UC_ERR_READ_UNMAPPED, UC_ERR_WRITE_UNMAPPED, UC_HOOK_INTR, UC_MODE_64, Uc, UcError
from unicorn.unicorn_py3.unicorn import ucsubclass
from unicorn import x86_const as X

if TYPE_CHECKING:
    from capstone import Cs

PAGE_SIZE = 0x1000
PTE_PRESENT = 1 << 0
PTE_RW = 1 << 1
PTE_USER = 1 << 2
PTE_ACCESSED = 1 << 5
PTE_DIRTY = 1 << 6
PTE_LARGE = 1 << 7
PTE_GLOBAL = 1 << 8
PTE_NX = 1 << 63
PTE_ADDRESS = 0x000F_FFFF_FFFF_F000
TABLE_FLAGS = PTE_PRESENT | PTE_RW  #: upper levels allow everything; the leaf decides

RECURSIVE_SLOT = 510
PTE_WINDOW = 0xFFFF_FF00_0000_0000  #: sign-extended slot 510: the page tables as seen through themselves

CR0_PE = 1 << 0
CR0_MP = 1 << 1
CR0_ET = 1 << 4
CR0_NE = 1 << 5
CR0_WP = 1 << 16
CR0_PG = 1 << 31
CR4_PAE = 1 << 5
CR4_PGE = 1 << 7
MSR_EFER = 0xC000_0080
EFER_LME = 1 << 8
EFER_LMA = 1 << 10
EFER_NXE = 1 << 11

#: what each kind of mapping gets in its leaf entry
TEXT = PTE_PRESENT | PTE_GLOBAL  #: read + execute
RODATA = PTE_PRESENT | PTE_GLOBAL | PTE_NX
DATA = PTE_PRESENT | PTE_RW | PTE_GLOBAL | PTE_NX
CODE = PTE_PRESENT | PTE_RW | PTE_GLOBAL  #: module space: written by the stub, executed by the kernel
DEMAND = PTE_PRESENT | PTE_RW | PTE_NX
#: a process's pages (the user half: never global, their entries go with their space)
USER_TEXT = PTE_PRESENT | PTE_USER
USER_DATA = PTE_PRESENT | PTE_RW | PTE_USER | PTE_NX


def indexes(address: int) -> tuple[int, int, int, int]:
    return (address >> 39 & 511, address >> 30 & 511, address >> 21 & 511, address >> 12 & 511)


def canonical(address: int) -> bool:
    top = address >> 47
    return top == 0 or top == 0x1FFFF


def leaf_flags(readable: bool, writable: bool, executable: bool) -> int:
    """Leaf flags of an ELF segment's pages (x86 has no unreadable present page)."""
    return PTE_PRESENT | PTE_GLOBAL | (PTE_RW if writable else 0) | (0 if executable else PTE_NX)


@ucsubclass
class PagedUc(Uc):
    """A unicorn x86_64 CPU whose host-side memory access goes through the page tables (see the module text):
    the kernel half through the kernel's space, which every space the machine makes shares, and the user half
    (and the page-table window, each space's own) through the space whose root CR3 holds, as the CPU would."""

    tables: PageTables
    #: told (address, size) after the host wrote into the lower half through a space (a process's memory, code
    #: included): the performance counters forget the user code they decoded
    on_user_write: Callable[[int, int], None] | None = None

    def phys_read(self, address: int, size: int) -> bytearray:
        return Uc.mem_read(self, address, size)

    def phys_write(self, address: int, data: bytes) -> None:
        Uc.mem_write(self, address, data)

    def mem_read(self, address: int, size: int) -> bytearray:
        physical = self._kernel_known(address, size)
        if physical is not None:
            return Uc.mem_read(self, physical, size)
        return self._space(address).read(address, size)

    def mem_write(self, address: int, data: bytes) -> None:
        physical = self._kernel_known(address, len(data))
        if physical is not None:
            Uc.mem_write(self, physical, data)
            return
        self._space(address).write(address, data)

    def _kernel_known(self, address: int, size: int) -> int | None:
        """The hit path's shortcut: the physical address of a kernel-half range within one page the machine
        mapped itself (the same in every space; the page-table window is never among them)."""
        offset = address & (PAGE_SIZE - 1)
        if not address >> 63 or offset + size > PAGE_SIZE:
            return None
        known = self.tables._known.get(address - offset)
        return None if known is None else known + offset

    def _space(self, address: int) -> AddressSpace:
        if kernel_half(address):
            return self.tables  # no register read: the hit path reads kernel memory this way
        return self.tables.space_at(self.reg_read(X.UC_X86_REG_CR3))


def _pages(address: int, size: int) -> Iterable[tuple[int, int]]:
    end = address + size
    while address < end:
        length = min(end, (address & ~(PAGE_SIZE - 1)) + PAGE_SIZE) - address
        yield address, length
        address += length


def kernel_half(address: int) -> bool:
    """Is `address` in the upper half, which every space shares (except the page-table window, each its own)?"""
    return bool(address >> 63) and address >> 39 & 511 != RECURSIVE_SLOT


class TablePool:
    """Physical pages for page tables, [base, base + size), handed out zeroed; shared by every space of a CPU."""

    def __init__(self, uc: PagedUc, base: int, size: int) -> None:
        self.uc = uc
        self._next = base
        self._end = base + size

    def alloc(self) -> int:
        table = self._next
        if table >= self._end:
            raise MemoryError("page-table pool exhausted")
        self._next += PAGE_SIZE
        self.uc.phys_write(table, bytes(PAGE_SIZE))
        return table


class AddressSpace:
    """One tree of 4-level page tables under a root table: what CR3 holds while the space is loaded.

    Host access through it follows the rules of the module text: `read`/`write` translate through this space's
    own tables (never the CPU's TLB, never CR3), an absent page is a UcError and maps nothing, a write to a
    read-only page goes through. A space made by `PageTables.new_space` shares the kernel half: its upper PML4
    entries point at the kernel's tables (the page-table window excepted, which points at its own root), so the
    kernel half reads the same in every space, and the user half starts empty. Leaf entries the machine writes
    itself (`map`) are remembered per space (the kernel half's in the kernel's space, for all); every other
    address is walked at each access.

    A space of no pool (`PageTables.space_at` of a root the machine did not make) can be read, not mapped.
    """

    def __init__(self, uc: PagedUc, root: int, pool: TablePool | None = None,
                 kernel: PageTables | None = None) -> None:
        self.uc = uc
        self.root = root  #: physical address of the PML4: the space's CR3 value
        self._pool = pool
        self._kernel = kernel  #: the space whose upper half this one shares (None: its own)
        self._known: dict[int, int] = {}  #: virtual page -> physical page, for the machine's own mappings
        self._kernel_known = kernel._known if kernel is not None else self._known
        self._tables: dict[tuple[int, ...], int] = {(): root}  #: index path -> physical table

    @property
    def pml4(self) -> int:
        return self.root

    def __repr__(self) -> str:
        return f"<{type(self).__name__} cr3={self.root:#x}>"

    # ---- building ------------------------------------------------------------------------------------------

    def _write_entry(self, physical: int, value: int) -> None:
        self.uc.phys_write(physical, struct.pack("<Q", value))

    def _owner(self, virtual: int) -> AddressSpace:
        """The space whose tables hold the entries of `virtual`: the kernel's for the shared half."""
        return self._kernel if self._kernel is not None and kernel_half(virtual) else self

    def table_for(self, address: int) -> int:
        """Physical address of the last-level table covering `address`, created (empty) if missing. The
        kernel half's tables are the kernel space's: make them there."""
        if self._owner(address) is not self:
            raise ValueError(f"{address:#x} is in the kernel half, which this space shares: map it in the kernel's")
        if self._pool is None:
            raise ValueError(f"{self!r} was not made by the machine: its tables cannot be changed")
        path = indexes(address)[:3]
        table = self._tables.get(path)
        if table is not None:
            return table
        parent = self.root
        for depth in range(1, 4):
            table = self._tables.get(path[:depth])
            if table is None:
                table = self._pool.alloc()
                self._write_entry(parent + 8 * path[depth - 1], table | TABLE_FLAGS)
                self._tables[path[:depth]] = table
                if depth == 1:
                    self._new_top_entry(path[0], table | TABLE_FLAGS)
            parent = table
        return table

    def _new_top_entry(self, index: int, entry: int) -> None:
        """A PML4 entry was just made (the kernel's space hands the kernel half's on to the spaces sharing it)."""

    def map(self, virtual: int, physical: int, size: int, flags: int) -> None:
        """Map [virtual, virtual + size) to [physical, ...) page by page with leaf `flags` (machine-owned)."""
        end = virtual + size
        while virtual < end:
            table = self.table_for(virtual)
            first = indexes(virtual)[3]
            count = min(512 - first, (end - virtual) // PAGE_SIZE)
            frames = range(physical, physical + count * PAGE_SIZE, PAGE_SIZE)
            entries = struct.pack(f"<{count}Q", *(frame | flags for frame in frames))
            self.uc.phys_write(table + 8 * first, entries)
            self._known.update(zip(range(virtual, virtual + count * PAGE_SIZE, PAGE_SIZE), frames))
            virtual += count * PAGE_SIZE
            physical += count * PAGE_SIZE

    def prepare(self, virtual: int, size: int) -> None:
        """Create the (empty) tables for a region whose entries someone else fills: the kernel's demand region."""
        for address in range(virtual, virtual + size, 512 * PAGE_SIZE):
            self.table_for(address)

    # ---- reading -------------------------------------------------------------------------------------------

    def entry_address(self, virtual: int) -> int | None:
        """Physical address of the leaf entry of `virtual`, if its tables exist."""
        owner = self._owner(virtual)
        table = owner._tables.get(indexes(virtual)[:3])
        return None if table is None else table + 8 * indexes(virtual)[3]

    def translate(self, virtual: int, size: int = 1) -> int | None:
        """Physical address of `virtual` (None if not present), or None if [virtual, virtual + size) crosses a
        page boundary (then translate page by page)."""
        offset = virtual & (PAGE_SIZE - 1)
        if offset + size > PAGE_SIZE:
            return None
        page = virtual - offset
        known = (self._kernel_known if kernel_half(virtual) else self._known).get(page)
        if known is not None:
            return known + offset
        entry = self.walk(page)
        return None if entry is None else (entry & PTE_ADDRESS) + offset

    def walk(self, virtual: int) -> int | None:
        """The leaf entry mapping `virtual` (4 KiB, 2 MiB or 1 GiB), read from this space's tables; None if
        absent."""
        if not canonical(virtual):
            return None
        phys_read = self.uc.phys_read
        table = self.root
        for level, index in enumerate(indexes(virtual)):
            entry = int.from_bytes(phys_read(table + 8 * index, 8), "little")
            if not entry & PTE_PRESENT:
                return None
            if level == 3:
                return entry
            if entry & PTE_LARGE and level in (1, 2):
                span = 1 << (30 if level == 1 else 21)
                return (entry & PTE_ADDRESS & ~(span - 1)) + (virtual & (span - 1) & ~(PAGE_SIZE - 1)) | (
                    entry & ~PTE_ADDRESS)
            table = entry & PTE_ADDRESS
        return None

    def executable(self, address: int) -> bool:
        """Is the page holding `address` present and executable in this space?"""
        entry = self.walk(address & ~(PAGE_SIZE - 1))
        return entry is not None and not entry & PTE_NX

    # ---- the host's access ---------------------------------------------------------------------------------

    def read(self, address: int, size: int) -> bytearray:
        """[address, address + size) as this space maps it; UcError(UC_ERR_READ_UNMAPPED) if a page is absent."""
        first = self.translate(address, size)
        if first is not None:
            return Uc.mem_read(self.uc, first, size)
        out = bytearray()
        for physical, length in self._runs(address, size, UC_ERR_READ_UNMAPPED):
            out += Uc.mem_read(self.uc, physical, length)
        return out

    def write(self, address: int, data: bytes) -> None:
        """Write through this space's tables (read-only pages too, as a debugger does); nothing is written if a
        page is absent (UcError(UC_ERR_WRITE_UNMAPPED))."""
        size = len(data)
        first = self.translate(address, size)
        if first is not None:
            Uc.mem_write(self.uc, first, data)
        else:
            data = bytes(data)
            offset = 0
            for physical, length in self._runs(address, size, UC_ERR_WRITE_UNMAPPED):  # all translated first
                Uc.mem_write(self.uc, physical, data[offset: offset + length])
                offset += length
        listener = getattr(self.uc, "on_user_write", None)
        if listener is not None and not kernel_half(address):
            listener(address, size)

    def _runs(self, address: int, size: int, error: int) -> list[tuple[int, int]]:
        """[address, address + size) as runs of contiguous physical memory; UcError(error) if a page is absent."""
        runs: list[tuple[int, int]] = []
        for virtual, length in _pages(address, size):
            physical = self.translate(virtual)
            if physical is None:
                raise UcError(error, address, size)
            if runs and runs[-1][0] + runs[-1][1] == physical:
                runs[-1] = (runs[-1][0], runs[-1][1] + length)
            else:
                runs.append((physical, length))
        return runs


class PageTables(AddressSpace):
    """The kernel's address space (Linux's swapper_pg_dir): the first space of a CPU, built in a pool of
    physical pages [pool, pool + pool_size) that every later space's tables come from too, and the registry of
    the spaces by root. PML4 slot 510 is the page-table window.

    `new_space` makes a space sharing the kernel half (Linux's pgd_alloc: the kernel's upper PML4 entries
    copied); a kernel-half PML4 entry made later is copied into every such space (Linux's sync_global_pgds).
    """

    def __init__(self, uc: PagedUc, pool: int, pool_size: int) -> None:
        tables = TablePool(uc, pool, pool_size)
        super().__init__(uc, tables.alloc(), tables)
        uc.tables = self
        self._write_entry(self.root + 8 * RECURSIVE_SLOT, self.root | TABLE_FLAGS | PTE_NX)
        self._spaces: dict[int, AddressSpace] = {self.root: self}  #: root -> space, this one included

    def new_space(self) -> AddressSpace:
        """A space of its own root whose kernel half is this one's and whose user half is empty."""
        assert self._pool is not None
        root = self._pool.alloc()
        upper = bytearray(self.uc.phys_read(self.root + 8 * 256, 8 * 256))
        upper[8 * (RECURSIVE_SLOT - 256): 8 * (RECURSIVE_SLOT - 255)] = struct.pack("<Q", root | TABLE_FLAGS | PTE_NX)
        self.uc.phys_write(root + 8 * 256, bytes(upper))
        space = AddressSpace(self.uc, root, self._pool, kernel=self)
        self._spaces[root] = space
        return space

    def space_at(self, cr3: int) -> AddressSpace:
        """The space whose root `cr3` names: one of the machine's, or a read-only view of a root it did not make."""
        root = cr3 & PTE_ADDRESS
        space = self._spaces.get(root)
        return space if space is not None else AddressSpace(self.uc, root)

    @property
    def spaces(self) -> list[AddressSpace]:
        """Every space of the machine, the kernel's first."""
        return list(self._spaces.values())

    def _new_top_entry(self, index: int, entry: int) -> None:
        if index < 256 or index == RECURSIVE_SLOT:
            return
        for space in self._spaces.values():
            if space is not self:
                self._write_entry(space.root + 8 * index, entry)

    def enable(self) -> None:
        """Hand the CPU these tables as a 64-bit bootloader does: CR3, PAE, long mode with NX, paging, WP."""
        uc = self.uc
        uc.reg_write(X.UC_X86_REG_CR3, self.root)
        uc.reg_write(X.UC_X86_REG_CR4, uc.reg_read(X.UC_X86_REG_CR4) | CR4_PAE | CR4_PGE)
        uc.msr_write(MSR_EFER, uc.msr_read(MSR_EFER) | EFER_LME | EFER_LMA | EFER_NXE)
        uc.reg_write(X.UC_X86_REG_CR0, uc.reg_read(X.UC_X86_REG_CR0) | CR0_PE | CR0_MP | CR0_ET | CR0_NE | CR0_WP
                     | CR0_PG)


@functools.cache
def page_fault_error_offset() -> int | None:
    """Offset of CPUX86State.error_code (the #PF error code QEMU computed) in a context blob, by experiment: a
    scratch CPU with paging writes to a not-present page (error 2), then fetches from one (error 0x10)."""
    code, absent = 0xFFFF_FFFF_8000_0000, 0xFFFF_FFFF_8020_0000
    offsets = None
    for entry, expected in ((code, 2), (code + 14, 0x10)):  # the store, then `jmp rax` with rax = absent
        uc = PagedUc(UC_ARCH_X86, UC_MODE_64)
        uc.mem_map(0, 0x10000)
        tables = PageTables(uc, 0x1000, 0x8000)
        tables.map(code, 0xF000, PAGE_SIZE, TEXT)
        tables.prepare(absent, PAGE_SIZE)
        tables.enable()
        uc.ctl_exits_enabled(True)
        uc.ctl_set_exits([])
        # mov rax, absent; mov byte [rax], 1; hlt; jmp rax
        uc.phys_write(0xF000, bytes.fromhex("48b8") + absent.to_bytes(8, "little") + bytes.fromhex("c60001f4ffe0"))
        uc.hook_add(UC_HOOK_INTR, lambda uc, intno, _: uc.emu_stop())
        uc.reg_write(X.UC_X86_REG_RAX, absent)
        before = bytes(uc.context_save())
        try:
            uc.emu_start(entry, 0)
        except UcError:
            return None
        after = bytes(uc.context_save())
        found = {i for i in range(0, len(after) - 3, 4)
                 if int.from_bytes(after[i: i + 4], "little") == expected and before[i: i + 4] != after[i: i + 4]}
        offsets = found if offsets is None else offsets & found
    return next(iter(offsets)) if offsets and len(offsets) == 1 else None


def memory_operand_address(uc: Uc, rip: int) -> int:
    """The address the instruction at `rip` accesses, from its memory operand (base + index * scale + disp);
    for a #GP, which unlike a #PF reports no address. 0 if it has none or cannot be read."""
    from capstone import CS_OP_MEM
    from capstone import x86_const as CX

    try:
        insn = next(_disassembler().disasm(bytes(uc.mem_read(rip, 16)), rip, 1))
    except (UcError, StopIteration):
        return 0
    for op in insn.operands:
        if op.type != CS_OP_MEM:
            continue
        mem = op.mem

        def reg(cs_reg: int) -> int:
            if cs_reg == CX.X86_REG_INVALID:
                return 0
            if cs_reg == CX.X86_REG_RIP:
                return insn.address + insn.size
            return uc.reg_read(getattr(X, f"UC_X86_REG_{_disassembler().reg_name(cs_reg).upper()}"))

        return (reg(mem.base) + reg(mem.index) * mem.scale + mem.disp) & ((1 << 64) - 1)
    return 0


@functools.cache
def _disassembler() -> Cs:
    from capstone import CS_ARCH_X86, CS_MODE_64, Cs  # on first use: a machine that never needs it never loads it

    cs = Cs(CS_ARCH_X86, CS_MODE_64)
    cs.detail = True
    return cs
