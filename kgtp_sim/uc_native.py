"""Native helpers around libunicorn: what the Python binding does slowly or not at all.

A leaf module (it imports nothing from kgtp_sim), shared by the machine's CPU, the tracer's register reader and
the agent sandbox (which may not import the machine layer, hence a module of its own):

- `Registers`: one register per ctypes call straight into `uc_reg_read`/`uc_reg_write` (about 3x cheaper than
  the binding's `reg_read`), and `RegisterBatch`: many registers in one `uc_reg_read_batch` call;
- `add_native_hook`: a hook whose callback is machine code in an executable host page, so no Python runs per
  call (the instruction counter `inc qword [rcx]; ret`, the block stopper); `delete_hook` removes one;
- `InstructionCounter`: that counter, installed and removed on request;
- `context_field_offset`: the offset of a QEMU CPU field that the API does not reach, found by experiment in a
  context blob (`uc_context_save`), and `read_context_int`/`write_context_int` to use it; with them
  `clear_exception_in_flight`, which a hook that takes an exception from QEMU must call; `tsc_offset_field` and
  `write_context_u64`, for the TSC a stopped machine does not advance (machine/clock.py).

No thread of its own: each object works on the unicorn instance it is given, on the thread that owns that instance:
the machine's CPU thread (machine/cpu.py, dispatch.py, stopper.py, watchpoints.py; the tracer's register batch at a
hit), or the caller's for an agent `Sandbox`. The executable code pages and the context offset are found once and
cached for the process.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from typing import Callable

from unicorn import UC_ARCH_X86, UC_HOOK_CODE, UC_HOOK_INTR, UC_HOOK_MEM_WRITE, UC_MODE_64, Uc
from unicorn import x86_const as X
from unicorn.unicorn_py3.arch.types import uc_hook_h
from unicorn.unicorn_py3.unicorn import HOOK_CODE_CFUNC, uclib

PAGE = 0x1000
MASK64 = (1 << 64) - 1

#: the C library, for the calls the binding lacks or makes slow
lib = uclib


def handle(uc: Uc) -> ctypes.c_void_p:
    """The `uc_engine *` behind a binding object."""
    return uc._uch


class NativeError(Exception):
    """A libunicorn call refused what it was asked (the message names the call and its status)."""


class Registers:
    """Register access straight through libunicorn. Only for registers that fit 64 bits; the buffer is cleared
    before each read because unicorn writes just the register's width (2 bytes for a selector)."""

    def __init__(self, uc: Uc) -> None:
        self._handle = handle(uc)
        self._value = ctypes.c_uint64(0)
        self._ref = ctypes.byref(self._value)
        self._read = lib.uc_reg_read
        self._write = lib.uc_reg_write

    def read(self, reg: int) -> int:
        self._value.value = 0
        if self._read(self._handle, reg, self._ref):
            raise NativeError(f"uc_reg_read refused register {reg}")
        return self._value.value

    def write(self, reg: int, value: int) -> None:
        self._value.value = value & MASK64
        if self._write(self._handle, reg, self._ref):
            raise NativeError(f"uc_reg_write refused register {reg}")


class RegisterBatch:
    """Read a fixed list of registers in one `uc_reg_read_batch` call (arrays prepared once)."""

    def __init__(self, register_ids: tuple[int, ...]) -> None:
        count = len(register_ids)
        self._count = count
        self._ids = (ctypes.c_int * count)(*register_ids)
        self._values = (ctypes.c_uint64 * count)()
        base = ctypes.addressof(self._values)
        self._pointers = (ctypes.c_void_p * count)(*(base + 8 * i for i in range(count)))

    def read(self, uc: Uc) -> list[int]:
        ctypes.memset(self._values, 0, 8 * self._count)  # unicorn writes only a register's own width
        status = lib.uc_reg_read_batch(handle(uc), self._ids, self._pointers, self._count)
        if status:
            raise NativeError(f"uc_reg_read_batch failed: {status}")
        return list(self._values)


@functools.cache
def _code_page(code: bytes) -> tuple[mmap.mmap, int] | None:
    """`code` in an executable host page of its own (one per distinct code, kept for the process's life)."""
    try:
        page = mmap.mmap(-1, PAGE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except (OSError, ValueError):
        return None
    page.write(code)
    return page, ctypes.addressof(ctypes.c_char.from_buffer(page))


def native_function(code: bytes) -> int | None:
    """Address of `code` placed in executable host memory; None where W+X mappings are refused."""
    placed = _code_page(code)
    return None if placed is None else placed[1]


def add_native_hook(uc: Uc, kind: int, code: bytes, user_data: ctypes.c_void_p | int, begin: int = 1,
                    end: int = 0) -> uc_hook_h | None:
    """Add a hook whose callback is machine code (no Python per call): `code` is called with the callback's C
    arguments, user_data in the register of its last argument (rcx for a code or block hook). The default range
    (begin > end) covers every address. None where W+X mappings are refused or unicorn refuses the hook."""
    address = native_function(code)
    if address is None:
        return None
    hook = uc_hook_h()
    status = lib.uc_hook_add(
        handle(uc), ctypes.byref(hook), kind, ctypes.cast(address, HOOK_CODE_CFUNC),
        ctypes.cast(user_data, ctypes.c_void_p), ctypes.c_uint64(begin), ctypes.c_uint64(end),
    )
    return hook if status == 0 else None


def delete_hook(uc: Uc, hook: uc_hook_h) -> None:
    status = lib.uc_hook_del(handle(uc), hook)
    if status:
        raise NativeError(f"uc_hook_del failed: {status}")


def emu_stop_address() -> int:
    """Address of `uc_emu_stop`, for native callbacks that end emulation from the CPU thread."""
    return ctypes.cast(lib.uc_emu_stop, ctypes.c_void_p).value


def reg_read_address() -> int:
    """Address of `uc_reg_read`, for native callbacks that read a register (the block stopper's IF check)."""
    return ctypes.cast(lib.uc_reg_read, ctypes.c_void_p).value


class InstructionCounter:
    """Counts executed instructions with a native UC_HOOK_CODE callback, `inc qword [rcx]; ret`, whose user
    data (rcx) is a c_uint64: no Python runs per instruction (about 12 ns each).

    The hook exists only between `enable()` and `disable()`. Instrumentation is compiled into translated blocks,
    so both flush the translation cache: blocks translated without the hook would not count, blocks translated
    with it would keep paying for it. `available` is False where W+X host pages are refused.
    """

    CODE = bytes.fromhex("48ff01c3")

    def __init__(self, uc: Uc) -> None:
        self._uc = uc
        self.value_cell = ctypes.c_uint64(0)
        self._hook: uc_hook_h | None = None
        self.available = native_function(self.CODE) is not None

    @property
    def value(self) -> int:
        return self.value_cell.value

    @property
    def enabled(self) -> bool:
        return self._hook is not None

    def enable(self) -> bool:
        """Start counting (from the current value). False if native hooks are unavailable."""
        if self._hook is None and self.available:
            self._hook = add_native_hook(self._uc, UC_HOOK_CODE, self.CODE, ctypes.addressof(self.value_cell))
            if self._hook is None:
                self.available = False
                return False
            self._uc.ctl_flush_tb()
        return self._hook is not None

    def disable(self) -> None:
        """Stop counting; the value is kept."""
        if self._hook is not None:
            delete_hook(self._uc, self._hook)
            self._hook = None
            self._uc.ctl_flush_tb()


def context_field_offset(run: Callable[[Uc], None], make: Callable[[], Uc], before: int, after: int) -> int | None:
    """Offset of a 32-bit field of the saved CPU context that goes from `before` to `after` when `run(uc)` runs
    on a fresh CPU from `make()`; None unless exactly one field does."""
    uc = make()
    old = bytes(uc.context_save())
    run(uc)
    new = bytes(uc.context_save())
    b, a = (v.to_bytes(4, "little", signed=v < 0) for v in (before, after))
    found = [i for i in range(0, len(old) - 3, 4) if old[i: i + 4] == b and new[i: i + 4] == a]
    return found[0] if len(found) == 1 else None


def read_context_int(uc: Uc, offset: int) -> int:
    """The signed 32-bit field at `offset` of the CPU's current context."""
    context = uc.context_save()
    address = ctypes.cast(context.context, ctypes.c_void_p).value
    return ctypes.c_int32.from_address(address + offset).value


def write_context_int(uc: Uc, offset: int, value: int) -> None:
    """Set the signed 32-bit field at `offset` of the CPU's context."""
    context = uc.context_save()
    address = ctypes.cast(context.context, ctypes.c_void_p).value
    ctypes.c_int32.from_address(address + offset).value = value
    uc.context_restore(context)


@functools.cache
def old_exception_offset() -> int | None:
    """Offset of QEMU's CPUX86State.old_exception in a unicorn context blob, found by experiment.

    QEMU remembers the exception "in flight" and resets it only when it delivers the exception itself. Unicorn
    hands exceptions to our hook instead, so the memory stays set: after one #DE, the next #DE is promoted to a
    double fault (vector 8), and after one #PF, the next #PF likewise. We cannot reach the field through the
    API, so we find it once: run a #DE on a scratch CPU and look for the only int that went from -1 to 0.
    """
    def make() -> Uc:
        uc = Uc(UC_ARCH_X86, UC_MODE_64)
        uc.mem_map(0x1000, PAGE)
        uc.mem_write(0x1000, bytes.fromhex("31c9" "31d2" "48f7f1" "f4"))  # xor ecx,ecx; xor edx,edx; div rcx; hlt
        uc.hook_add(UC_HOOK_INTR, lambda uc, i, _: uc.reg_write(X.UC_X86_REG_RIP, uc.reg_read(X.UC_X86_REG_RIP) + 3))
        return uc

    return context_field_offset(lambda uc: uc.emu_start(0x1000, 0x1007), make, -1, 0)


def clear_exception_in_flight(uc: Uc) -> None:
    """Make QEMU forget the exception it raised and a hook took (see old_exception_offset); without it the next
    #PF or contributory exception would be promoted to a double fault."""
    offset = old_exception_offset()
    if offset is not None:
        write_context_int(uc, offset, -1)


@functools.cache
def tsc_offset_field() -> int | None:
    """Offset of QEMU's CPUX86State.tsc_offset in a unicorn context blob: `rdtsc` reads the host's TSC plus it (SVM
    sets it for a guest; nothing else does, so it is 0). The API does not reach it. In the structure it follows
    `old_exception` and `vm_vmcb`: of the few 8-byte fields after old_exception (found above), the one that, set on
    a scratch CPU, moves that CPU's `rdtsc` by what was written. None when no field does."""
    old = old_exception_offset()
    if old is None:
        return None
    uc = Uc(UC_ARCH_X86, UC_MODE_64)
    uc.mem_map(0x1000, PAGE)
    uc.mem_write(0x1000, b"\x0f\x31\xf4")  # rdtsc; hlt

    def rdtsc() -> int:
        uc.emu_start(0x1000, MASK64)
        return uc.reg_read(X.UC_X86_REG_RDX) << 32 | (uc.reg_read(X.UC_X86_REG_RAX) & 0xFFFFFFFF)

    shift = 1 << 50  # far more than the host's TSC moves during the experiment (some 10^15 ticks: days)
    first = (old + 4 + 7) & ~7
    for offset in range(first, first + 32, 8):
        context = uc.context_save()
        if offset + 8 > context.size:
            break
        before = rdtsc()
        write_context_u64(context, offset, shift)
        uc.context_restore(context)
        moved = rdtsc() - before
        write_context_u64(context, offset, 0)
        uc.context_restore(context)
        if shift <= moved < shift + (1 << 40):
            return offset
    return None


def write_saved_context_int(context: object, offset: int, value: int) -> None:
    """Set the signed 32-bit field at `offset` of a saved context (`uc.context_save()`)."""
    address = ctypes.cast(context.context, ctypes.c_void_p).value  # type: ignore[attr-defined]
    ctypes.c_int32.from_address(address + offset).value = value


def write_context_u64(context: object, offset: int, value: int) -> None:
    """Set the unsigned 64-bit field at `offset` of a saved context (`uc.context_save()`; a CPU takes it with
    `uc.context_restore`)."""
    address = ctypes.cast(context.context, ctypes.c_void_p).value  # type: ignore[attr-defined]
    ctypes.c_uint64.from_address(address + offset).value = value & MASK64


# ---- the engine's "PC written by a hook" flag ------------------------------------------------------------------
#
# Unicorn keeps RIP exact inside a memory or port hook by restoring it from the translated code's host address
# (cpu_restore_state) unless its `skip_sync_pc_on_exit` flag is set: uc_reg_write sets it when it writes the PC,
# so that the exit the write asks for does not restore the PC over the written one, and the next exit check in
# translated code clears it. A PC written from an interrupt or instruction hook (an int3 sent to its detour, an
# interrupt delivered, `syscall` entering the kernel) is taken without such a check: the flag stays set until the
# next emu_start, and every memory hook until then reads the RIP of the start of its translated block, not of
# the instruction that accessed memory (measured on unicorn 2.1.4). Hooks that write the PC there clear the flag
# after the write (`pc_sync_flag_address`).


def readable_ranges() -> list[tuple[int, int]]:
    """The host's readable mappings of this process, [begin, end) each (/proc/self/maps)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            if perms.startswith("r"):
                lo, hi = (int(v, 16) for v in span.split("-"))
                ranges.append((lo, hi))
    return ranges


_ENGINE_SCAN = 0x10000  #: bytes of the engine's own structure searched for the flag
#: int $0x80; mov %rax,(%rbx); movq $7,8(%rbx); hlt: the two stores after an interrupt whose hook wrote the PC
_PC_PROBE = bytes.fromhex("cd80" "488903" "48c7430807000000" "f4")
_PC_PROBE_STORES = (0x1002, 0x1005)


def _pc_probe(clear_at: int | None) -> tuple[Uc, list[int]]:
    """A scratch CPU that runs _PC_PROBE with an interrupt hook writing the PC (and clearing the byte at
    `clear_at` of the engine's structure after it); returns it and the RIPs its store hook saw."""
    uc = Uc(UC_ARCH_X86, UC_MODE_64)
    uc.mem_map(0x1000, PAGE)
    uc.mem_map(0x3000, PAGE)
    uc.mem_write(0x1000, _PC_PROBE)
    uc.reg_write(X.UC_X86_REG_RBX, 0x3000)
    seen: list[int] = []
    state = {"write": True}

    def on_interrupt(uc: Uc, _intno: int, _data: object) -> None:
        if state["write"]:
            uc.reg_write(X.UC_X86_REG_RIP, uc.reg_read(X.UC_X86_REG_RIP))
            if clear_at is not None:
                ctypes.c_uint8.from_address(ctypes.cast(handle(uc), ctypes.c_void_p).value + clear_at).value = 0

    uc.hook_add(UC_HOOK_INTR, on_interrupt)
    uc.hook_add(UC_HOOK_MEM_WRITE, lambda uc, *_: seen.append(uc.reg_read(X.UC_X86_REG_RIP)), None, 0x3000, 0x3FFF)
    uc._pc_probe_state = state  # type: ignore[attr-defined]
    return uc, seen


@functools.cache
def pc_sync_flag_offset() -> int | None:
    """Offset of unicorn's `skip_sync_pc_on_exit` in the engine's structure, found by experiment: the one byte that
    an interrupt hook's PC write leaves at 1 after a run and a run without that write leaves at 0, twice; kept only
    if clearing it after the write makes the stores that follow see their own RIP. None when not found (the
    machine then cannot make data breakpoints exact after such a hook)."""
    uc, _seen = _pc_probe(None)
    base = ctypes.cast(handle(uc), ctypes.c_void_p).value
    end = next((hi for lo, hi in readable_ranges() if lo <= base < hi), base)
    size = min(_ENGINE_SCAN, end - base)
    if size <= 0:
        return None
    state = uc._pc_probe_state  # type: ignore[attr-defined]

    def after_run(write: bool) -> bytes:
        state["write"] = write
        uc.emu_start(0x1000, 0x1000 + len(_PC_PROBE) - 1)
        return ctypes.string_at(base, size)

    found: set[int] | None = None
    for _ in range(2):
        clean, dirty = after_run(False), after_run(True)
        # the 1 bytes found by bytes.find, at C speed: a byte-by-byte loop over the structure took ~10 ms a run
        flipped, at = set(), dirty.find(1)
        while at >= 0:
            if clean[at] == 0:
                flipped.add(at)
            at = dirty.find(1, at + 1)
        found = flipped if found is None else found & flipped
    if found is None or len(found) != 1:
        return None
    offset = found.pop()
    _checked, seen = _pc_probe(offset)
    _checked.emu_start(0x1000, 0x1000 + len(_PC_PROBE) - 1)
    return offset if tuple(seen) == _PC_PROBE_STORES else None


def pc_sync_flag_address(uc: Uc) -> int | None:
    """Host address of `uc`'s `skip_sync_pc_on_exit` byte (see above), None where it was not found. A hook that
    wrote the PC from an interrupt or instruction hook stores 0 there after the write."""
    offset = pc_sync_flag_offset()
    return None if offset is None else ctypes.cast(handle(uc), ctypes.c_void_p).value + offset


def clear_pc_sync_flag(address: int | None) -> None:
    """Store 0 in the flag at `address` (pc_sync_flag_address); nothing when it is None."""
    if address is not None:
        ctypes.c_uint8.from_address(address).value = 0
