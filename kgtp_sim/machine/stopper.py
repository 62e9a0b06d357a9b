"""Ending emulation at a block boundary on behalf of other threads (`BlockStopper`).

Owns one native UC_HOOK_BLOCK callback and the cell it reads. `request` runs on any thread (the server's
requests, the ticker); `stop_outside`, `stop_when_interruptible`, `clear` and `take` run on the CPU thread between
runs; the check itself runs on the CPU thread inside emulation, at the start of every block.
"""

from __future__ import annotations

import ctypes

from unicorn import UC_HOOK_BLOCK, Uc

from unicorn import x86_const as X

from ..uc_native import add_native_hook, emu_stop_address, reg_read_address

EFLAGS_IF = 0x200


class _StopCell(ctypes.Structure):
    _fields_ = [("requested", ctypes.c_uint64), ("emu_stop", ctypes.c_void_p), ("lo", ctypes.c_uint64),
                ("hi", ctypes.c_uint64), ("reg_read", ctypes.c_void_p)]


class BlockStopper:
    """Ends emulation at the next block boundary on behalf of other threads.

    `uc.emu_stop()` called from another thread is not safe: it can end a translation block in the middle
    while QEMU resumes from the block's first instruction, so the instructions already run execute twice (an
    `inc` counted twice, a `push` doubled; measured with two counters in one block). A stop requested from
    inside a hook on the CPU thread is exact. So other threads only raise a flag; a native UC_HOOK_BLOCK
    callback (`cmp [rcx], 0; jne; ret; jmp *uc_emu_stop`) sees it at the next block's start, before any of
    its instructions ran, and calls uc_emu_stop from the CPU thread. Without W+X pages, a Python block hook
    does the same, slower.

    A second kind of request, `stop_outside(lo, hi)`, ends emulation at the first block that starts outside
    [lo, hi): the CPU thread asks it when a timer tick waits while the stub's own code (a detour, interrupts
    off) runs, so the tick is taken as soon as the kernel's code resumes instead of whenever a periodic stop
    happens to land outside a detour (at full tracing pace, almost never).

    A third, `stop_when_interruptible()`, ends emulation at the first block that starts with IF set: the CPU
    thread asks it when an interrupt waits for a CPU that runs with interrupts off, so the interrupt is taken as
    soon as the kernel enables them again (`sti`, `popf`, `iretq`, `sysretq`), as a CPU takes a pending interrupt
    then (a hypervisor's "interrupt window" exit). Retried only at periodic stops, a tick could wait for seconds
    behind a thread whose time goes mostly to port reads with interrupts off (sched_clock under its lock, in a
    loop of `usleep(1)`), and so could the thread the tick would have switched to.
    """

    # cmp qword [rcx], 0; jne +1; ret
    # cmp qword [rcx], 1; je stop                      (1: stop at any block)
    # cmp qword [rcx], 3; je ifcheck                   (3: stop where IF is set)
    # cmp rsi, [rcx+16]; jb stop; cmp rsi, [rcx+24]; jae stop; ret    (2: only outside [lo, hi))
    # ifcheck: push rdi; push rcx; sub rsp, 24; mov qword [rsp], 0    (the call's stack 16-byte aligned)
    #          mov esi, UC_X86_REG_EFLAGS; mov rdx, rsp; call [rcx+32]    (uc_reg_read(uc, EFLAGS, &value))
    #          mov rax, [rsp]; add rsp, 24; pop rcx; pop rdi; test eax, 0x200; jnz stop; ret
    # stop: jmp qword [rcx+8]                          (uc_emu_stop(uc): rdi is still the hook's uc)
    CODE = bytes.fromhex(
        "48833900" "7501" "c3"
        "48833901" "743e"
        "48833903" "740d"
        "483b7110" "7232" "483b7118" "732c" "c3"
        "57" "51" "4883ec18" "48c7042400000000"
        "be" + X.UC_X86_REG_EFLAGS.to_bytes(4, "little").hex() + "4889e2" "ff5120"
        "488b0424" "4883c418" "59" "5f" "a900020000" "7501" "c3"
        "ff6108"
    )
    ANY_BLOCK, OUTSIDE_RANGE, WHEN_INTERRUPTIBLE = 1, 2, 3

    def __init__(self, uc: Uc) -> None:
        self._cell = _StopCell(0, emu_stop_address(), 0, 0, reg_read_address())
        self._hook = add_native_hook(uc, UC_HOOK_BLOCK, self.CODE, ctypes.addressof(self._cell))
        if self._hook is None:
            uc.hook_add(UC_HOOK_BLOCK, self._python_check)

    def request(self) -> None:
        """From any thread: end emulation at the next block boundary (kept until `clear`)."""
        self._cell.requested = self.ANY_BLOCK

    def stop_outside(self, lo: int, hi: int) -> None:
        """On the CPU thread, before emulation starts: end it at the first block starting outside [lo, hi).
        A later `request` from any thread widens this to any block."""
        self._cell.lo, self._cell.hi = lo, hi
        self._cell.requested = self.OUTSIDE_RANGE

    def stop_when_interruptible(self) -> None:
        """On the CPU thread, before emulation starts: end it at the first block that starts with EFLAGS.IF set
        (at once if it is set). A later `request` from any thread widens this to any block."""
        self._cell.requested = self.WHEN_INTERRUPTIBLE

    def clear(self) -> None:
        """On the CPU thread, before emulation starts: forget requests already served."""
        self._cell.requested = 0

    def take(self) -> int:
        """On the CPU thread: the pending request (0 if none), cleared; `request()` puts a stop back."""
        requested, self._cell.requested = self._cell.requested, 0
        return requested

    def _python_check(self, uc: Uc, address: int, _size: int, _data: object) -> None:
        cell = self._cell
        if cell.requested == self.ANY_BLOCK or (
                cell.requested == self.OUTSIDE_RANGE and not cell.lo <= address < cell.hi) or (
                cell.requested == self.WHEN_INTERRUPTIBLE and uc.reg_read(X.UC_X86_REG_EFLAGS) & EFLAGS_IF):
            uc.emu_stop()
