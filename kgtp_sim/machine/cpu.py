"""The unicorn CPU: its registers, its hooks, x86 interrupt/exception delivery through the kernel's IDT, and the
run loop (`Cpu.run`).

Owns the unicorn instance and everything that happens between unicorn and the kernel at one instruction
boundary. Runs on the CPU thread (`Machine`), or on the caller's before `Machine.start`; the hooks run on it
inside emulation. Its parts live beside it:

- memory.py: physical memory, the page tables and address spaces, the demand frames, the stub's pages, dropping
  translated code (`Cpu.memory`);
- dispatch.py: the tables the stub's code gets a look at first (the int3 jump table, the fault fixups);
- stopper.py: ending emulation at a block boundary for other threads (`Cpu.stopper`);
- counters.py: the performance counters, told of runs, exceptions, page faults and the stub's handlers through
  `Cpu.observer` while a counter is open (None otherwise: no cost).

Unicorn runs instructions but has no notion of an IDT: software interrupts, #DE, #UD and bad memory accesses
come back to us as hooks. This module turns each into what the hardware would do (push the 64-bit interrupt
frame, set CR2, clear IF for an interrupt gate, jump to the gate's handler), so the kernel handles its own
exceptions and returns with `iretq`. Two tables get a look first, for the tracer's sake:

- `breakpoints`: an int3 at one of these addresses is the stub's probe, not the kernel's business (and the
  native `jumps` table, dispatch.py, sends the compiled engines' int3s on without any Python);
- `fault_fixups`: a memory fault whose RIP is in one of these ranges (stub-generated code) is resolved by the
  tracer (like Linux's exception tables), never by the kernel's #PF handler.

Measured on unicorn 2.1.4: writing RIP inside an INTR or INSN_INVALID hook redirects execution; #DE reports RIP
at the faulting instruction, `int N` and int3 report RIP after it; an unmapped access stops emu_start with RIP
at the faulting instruction (so we stop, then deliver #PF from the run loop); `hlt` ends emu_start with RIP after
it.

Memory goes through the kernel's page tables (kgtp_sim/uc_paging.py): the machine builds them as a bootloader
would and hands the CPU CR3 with paging on, so a not-present page or a protection violation is a real #PF raised
by the MMU. Unicorn gives that to UC_HOOK_INTR with RIP at the faulting instruction and CR2 set; QEMU keeps the
error code in a field the API does not reach, read from the saved context (offset found by experiment, as for
the "exception in flight" below). The kernel's #PF handler fills the entry of a demand page itself and drops
pages by clearing their entries and running `invlpg`, so the machine never flushes the TLB.
"""

from __future__ import annotations

import ctypes
import enum
import struct
from collections import Counter
from typing import Callable, Protocol

from unicorn import (
    UC_ARCH_X86,
    UC_HOOK_INSN,
    UC_HOOK_INSN_INVALID,
    UC_HOOK_MEM_INVALID,
    UC_MEM_FETCH_PROT,
    UC_MEM_FETCH_UNMAPPED,
    UC_MEM_READ_PROT,
    UC_MEM_WRITE_PROT,
    UC_MEM_WRITE_UNMAPPED,
    UC_MODE_64,
    Uc,
    UcError,
)
from unicorn import x86_const as X

from .. import uc_paging as paging
from ..uc_native import (
    InstructionCounter,
    Registers,
    clear_pc_sync_flag,
    delete_hook,
    old_exception_offset,
    pc_sync_flag_address,
)
from ..uc_paging import AddressSpace, kernel_half, memory_operand_address, page_fault_error_offset
from .dispatch import FaultFixups, FaultHandler, InterruptDispatch  # noqa: F401 - FaultHandler: cpu.py's name too
from . import process
from .errors import MachineError
from .image import KernelImage
from .memory import BOOT_GDT, Memory, _gaps
from .layout import BOOT_BASE
from .stopper import BlockStopper
from .syscall_entry import SyscallEntry

TRANSLATION_CACHE = 32 << 20  #: bytes of host code the emulator keeps translated (see Cpu.__init__)
NO_EXIT = 0xFFFF_FFFF_FFFF_FFFF  #: `until` for emu_start when only a stop request should end it
ERROR_CODE_VECTORS = frozenset({8, 10, 11, 12, 13, 14, 17, 21, 29, 30})
EFLAGS_TF = 1 << 8
EFLAGS_IF = 1 << 9
EFLAGS_NT = 1 << 14
EFLAGS_RF = 1 << 16
KERNEL_CS = 0x08
KERNEL_DS = 0x10

#: register name (kgtp_sim/arch/amd64.py order) -> unicorn id
REGISTER_IDS: dict[str, int] = {
    name: getattr(X, f"UC_X86_REG_{name.upper()}")
    for name in (
        "rax rbx rcx rdx rsi rdi rbp rsp r8 r9 r10 r11 r12 r13 r14 r15 rip eflags cs ss ds es fs gs".split()
    )
}
ARGUMENT_REGISTERS = (X.UC_X86_REG_RDI, X.UC_X86_REG_RSI, X.UC_X86_REG_RDX, X.UC_X86_REG_RCX, X.UC_X86_REG_R8,
                      X.UC_X86_REG_R9)

BreakpointHandler = Callable[[Uc], None]

GENERAL_PROTECTION = 13
PAGE_FAULT = 14

#: exceptions QEMU calls "contributory": a second one before the first is delivered makes a #DF
CONTRIBUTORY_VECTORS = frozenset({0, 10, 11, 12, 13})


class Stop(enum.Enum):
    """Why `Cpu.run` returned."""

    HALT = "hlt executed"
    STOPPED = "stop requested (or instruction budget spent)"
    UNTIL = "reached the requested address"
    EXCEPTION = "a memory fault was delivered (IDT or fixup); resume"


class CpuObserver(Protocol):
    """What the machine's performance counters hear from the CPU (counters.Counters), on the CPU thread."""

    def run_begins(self) -> None: ...

    def run_ends(self) -> None: ...

    def fault_at(self, rip: int) -> None:
        """An exception stopped the instruction at `rip` before it retired."""

    def page_fault(self, from_user: bool) -> None: ...

    def handler_begins(self) -> None:
        """The stub's Python handler for a breakpoint or a single-step trap begins (`handler_ends`: it ends)."""

    def handler_ends(self) -> None: ...

    def cpu_loaded(self, index: int) -> None:
        """The scheduler put CPU `index`'s registers in the unicorn instance."""


class Cpu:
    """One x86_64 CPU running the kernel image. Not thread-safe: the Machine serialises access."""

    def __init__(self, image: KernelImage, port_out: Callable[[int, int, int, int], None],
                 port_in: Callable[[int, int], int]) -> None:
        self.image = image
        self._port_out = port_out
        self._port_in = port_in
        uc = paging.PagedUc(UC_ARCH_X86, UC_MODE_64)
        # The translation cache: when it is full the emulator drops every translated block and starts over (its
        # own policy, a few milliseconds of translating the hot code again). Its default of 1 GiB let a serving
        # machine's host memory grow with translations that are never used again (about 4 MiB a second under
        # compiled tracing at full pace, seen in the soak) before that happened.
        uc.ctl_set_tcg_buffer_size(TRANSLATION_CACHE)
        self.uc = uc
        self.memory = Memory(uc, image)
        #: the kernel's address space (its page tables): the default space of every access
        self.tables = self.memory.kernel
        process.prepare_memory(uc, self.tables)  # RAM for processes, before the hooks on what no memory backs

        self.breakpoints: dict[int, BreakpointHandler] = {}
        #: the single-step trap (#DB after an instruction run with EFLAGS.TF): the stub's while-stepping, never the
        #: kernel's (it sets no TF); handler(uc) runs with RIP at the next instruction
        self.debug_trap: BreakpointHandler | None = None
        #: asked first at every #DB: is it a single step inside the code behind a call gate, to be let go (gates.py)
        self.gate_step: Callable[[Uc], bool] | None = None
        #: called on the CPU thread when a run ends, outside emulation, before `run` returns (the hardware
        #: breakpoints finish an instruction the stop cut in two there: watchpoints.py)
        self.after_run: BreakpointHandler | None = None
        #: told of runs, exceptions, page faults and the stub's handlers while a performance counter is open
        #: (counters.Counters; None otherwise, so that counting costs nothing when no counter is)
        self.observer: CpuObserver | None = None
        self.fault_fixups = FaultFixups()
        #: (start, end, page-table root) of code the stub placed in a process where, as in module space, the CPU is
        #: neither interrupted nor switched out (a compiled hit's pad, from the hit to the end of the probed
        #: instruction: tracing/engines/userprobes.py)
        self.process_stub_code: list[tuple[int, int, int]] = []
        self.delivered: Counter[int] = Counter()  # vector -> times delivered through the IDT
        self.breakpoint_hits = 0
        self.fixup_hits = 0

        self._fault: tuple[int, int] | None = None  # (access, address) of an access to absent physical memory
        #: code changed inside emulation whose translated blocks go when the run ends (`remove_cache`)
        self._stale: list[tuple[int, int, AddressSpace | None]] = []
        self._counted = False  # the last run had an instruction budget (unicorn's count hook is in)
        self._in_emulation = False
        self._error: BaseException | None = None  # raised inside a hook; re-raised by run()
        #: int3 -> target without Python (`InterruptDispatch`); other interrupts reach `_on_interrupt`
        self.jumps = InterruptDispatch(uc, self._on_interrupt)
        self._pc_sync_flag = pc_sync_flag_address(uc)
        uc.hook_add(UC_HOOK_INSN_INVALID, self._on_invalid)
        # Only where no frame is: a memory hook whose range covers a frame makes the emulator take its slow path
        # for every store to that frame, forever (it never marks a hooked page's TLB entry dirty).
        for begin, end in _gaps(uc.mem_regions()):
            uc.hook_add(UC_HOOK_MEM_INVALID, self._on_bad_access, None, begin, end)
        uc.hook_add(UC_HOOK_INSN, self._on_out, None, 1, 0, X.UC_X86_INS_OUT)
        uc.hook_add(UC_HOOK_INSN, self._on_in, None, 1, 0, X.UC_X86_INS_IN)
        #: counts only while enabled (Machine.counting): the hook costs about 12 ns per instruction
        self.counter = InstructionCounter(uc)
        self.stopper = BlockStopper(uc)
        self.regs = Registers(uc)
        #: `syscall` made architectural, and the privilege change of interrupts from user mode
        self.syscall_entry = SyscallEntry(uc)
        # Runs end at hlt, a stop or an exit address. Unicorn invalidates the translation at each exit when a run
        # ends, and an `until` of "none" (all ones) is an address that is never mapped: invalidating there walks
        # the tables, fails, and leaves CR2 and a #PF "in flight" behind (the next real #PF became a #DF).
        uc.ctl_exits_enabled(True)
        uc.ctl_set_exits([])
        self._reset(image.entry)

    def _reset(self, entry: int) -> None:
        """The state a 64-bit bootloader hands over: long mode with paging on the kernel's tables, flat
        segments, interrupts off, RIP at entry (the boot page holds the GDT: memory.Memory)."""
        uc = self.uc
        self.tables.enable()
        uc.reg_write(X.UC_X86_REG_GDTR, (0, BOOT_BASE, len(BOOT_GDT) - 1, 0))
        uc.reg_write(X.UC_X86_REG_CS, KERNEL_CS)
        for seg in (X.UC_X86_REG_SS, X.UC_X86_REG_DS, X.UC_X86_REG_ES):
            uc.reg_write(seg, KERNEL_DS)
        uc.reg_write(X.UC_X86_REG_EFLAGS, 0x2)
        uc.reg_write(X.UC_X86_REG_RIP, entry)

    def remove_cache(self, address: int, length: int, space: AddressSpace | None = None) -> None:
        """Drop translated code over [address, address + length) of `space` (None: the kernel's) after the host
        changed it (memory.Memory.remove_cache). Inside emulation, code the loaded CPU cannot look up there (a
        process's, with another space loaded; the kernel's, from user mode: a hit in one space that ends the run
        takes the probes of the other out) is dropped once this run ends, and the run ends at the next block
        boundary: none of that code runs before (it is not the running block's, which is the hit's)."""
        if not self.memory.remove_cache(address, length, space, self._in_emulation):
            self._stale.append((address, length, space))
            self.stopper.request()

    # ---- registers ---------------------------------------------------------------------------------------

    def registers(self) -> dict[str, int]:
        return {name: self.regs.read(reg) for name, reg in REGISTER_IDS.items()}

    def interrupts_enabled(self) -> bool:
        return bool(self.regs.read(X.UC_X86_REG_EFLAGS) & EFLAGS_IF)

    @property
    def rip(self) -> int:
        return self.regs.read(X.UC_X86_REG_RIP)

    @property
    def in_emulation(self) -> bool:
        """Inside emu_start (a hook is running): the CPU cannot be stepped from here."""
        return self._in_emulation

    # ---- interrupt delivery ------------------------------------------------------------------------------

    def deliver(self, vector: int, error_code: int | None = None) -> None:
        """Enter the kernel's handler for `vector` the way an x86_64 CPU does (same privilege level, no IST)."""
        uc, regs = self.uc, self.regs
        _, base, limit, _ = uc.reg_read(X.UC_X86_REG_IDTR)
        rip = regs.read(X.UC_X86_REG_RIP)
        if vector * 16 + 15 > limit:
            raise MachineError(f"vector {vector} at rip {rip:#x}: outside the IDT (limit {limit:#x}); is it loaded?")
        try:
            low, selector, _ist, attr, middle, high, _ = struct.unpack("<HHBBHII", uc.mem_read(base + vector * 16, 16))
        except UcError:
            raise MachineError(f"vector {vector} at rip {rip:#x}: IDT at {base:#x} is not mapped") from None
        if not attr & 0x80:
            raise MachineError(f"vector {vector} at rip {rip:#x}: no handler (IDT gate not present)")
        rsp = regs.read(X.UC_X86_REG_RSP)
        rflags = regs.read(X.UC_X86_REG_EFLAGS)
        cs = regs.read(X.UC_X86_REG_CS)
        frame = struct.pack("<5Q", rip, cs, rflags, rsp, regs.read(X.UC_X86_REG_SS))
        if error_code is not None:
            frame = struct.pack("<Q", error_code) + frame
        from_user = bool(cs & 3)  # to ring 0 on the stack in the TSS's rsp0 (syscall_entry.py)
        stack = self.syscall_entry.ring0_stack() if from_user else rsp
        new_rsp = (stack & ~0xF) - len(frame)  # 64-bit mode aligns the frame to 16 bytes
        try:
            uc.mem_write(new_rsp, frame)
        except UcError:
            raise MachineError(f"vector {vector} at rip {rip:#x}: cannot push the frame at rsp {rsp:#x}") from None
        rflags &= ~(EFLAGS_TF | EFLAGS_NT | EFLAGS_RF)
        if attr & 0xF == 0xE:  # interrupt gate, as opposed to a trap gate
            rflags &= ~EFLAGS_IF
        if from_user:
            self.syscall_entry.enter_ring0(selector, 0)
        regs.write(X.UC_X86_REG_RSP, new_rsp)
        regs.write(X.UC_X86_REG_EFLAGS, rflags)
        regs.write(X.UC_X86_REG_RIP, low | middle << 16 | high << 32)
        self.delivered[vector] += 1
        if vector == PAGE_FAULT and self.observer is not None:
            self.observer.page_fault(from_user=cs & 3 == 3)

    # ---- hooks (run on the CPU thread, inside emu_start) ---------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self.uc.emu_stop()

    def _on_interrupt(self, uc: Uc, intno: int, _data: object) -> None:
        try:
            observer = self.observer
            if observer is not None:
                observer.fault_at(self.regs.read(X.UC_X86_REG_RIP))
            if intno == 1 and self.gate_step is not None and self.gate_step(uc):
                return
            if intno == 1 and self.debug_trap is not None:
                self._handle(self.debug_trap, uc)
                return
            if intno == 3:
                address = self.regs.read(X.UC_X86_REG_RIP) - 1
                handler = self.breakpoints.get(address)
                if handler is not None:
                    self.breakpoint_hits += 1
                    uc.reg_write(X.UC_X86_REG_RIP, address)
                    self._handle(handler, uc)
                    return
                target = self.jumps.target(address)
                if target is not None:  # the native dispatch is off (no W+X pages): same effect, in Python
                    self.breakpoint_hits += 1
                    uc.reg_write(X.UC_X86_REG_RIP, target)
                    return
            if intno in (PAGE_FAULT, GENERAL_PROTECTION):
                self._memory_fault(intno)
                return
            self.deliver(intno, 0 if intno in ERROR_CODE_VECTORS else None)
            if intno in CONTRIBUTORY_VECTORS:
                self._forget_exception_in_flight()
        except BaseException as error:  # noqa: BLE001 - surfaced by run()
            self._fail(error)

    def _handle(self, handler: BreakpointHandler, uc: Uc) -> None:
        """The stub's handler of a breakpoint or a single-step trap; the performance counters pause meanwhile."""
        observer = self.observer
        if observer is None:
            handler(uc)
            return
        observer.handler_begins()
        try:
            handler(uc)
        finally:
            observer.handler_ends()

    def _memory_fault(self, vector: int) -> None:
        """A #PF from the MMU (RIP at the faulting instruction, CR2 set) or a #GP (a non-canonical address):
        the fault-fixup table for stub code, else the kernel's handler through the IDT."""
        error_code = self._forget_exception_in_flight(read_error_code=vector == PAGE_FAULT)
        rip = self.regs.read(X.UC_X86_REG_RIP)
        handler = self.fault_fixups.find(rip)
        if handler is not None:
            self.fixup_hits += 1
            if vector == PAGE_FAULT:
                address = self.regs.read(X.UC_X86_REG_CR2)
            else:
                address = memory_operand_address(self.uc, rip)
            handler(self.uc, address)
            return
        self.deliver(vector, error_code if vector == PAGE_FAULT else 0)

    def delete_hook(self, hook: object, code_at: int | None = None) -> None:
        """Between runs: remove a hook (a Python hook's handle, or a native one's), then forget the fault its
        removal can leave in flight: unicorn drops the code of an address-ranged hook by an instruction fetch through
        the loaded CPU's CR3, and at a process's address with another space loaded (or an untouched page) that fetch
        faults and leaves a #PF in flight, which would swallow the CPU's next page fault or make it a double fault
        (seen: no #PF delivered any more after the counters' user-code hook went, once a program had run).

        `code_at`: the hook is a code hook at that address. The code translated there must go with it: unicorn
        compiles the only code hook into a block as a direct call of its callback, so a block the fetch above did
        not reach would go on calling the callback the binding frees (the host process dies of a segmentation
        fault). At a user address, where each space maps its own frame, every space's translated code is dropped;
        the kernel half is the same in every space, so the fetch reaches it."""
        if isinstance(hook, int):
            self.uc.hook_del(hook)
        else:
            delete_hook(self.uc, hook)
        self.forget_fault_in_flight()
        if code_at is not None and not kernel_half(code_at):
            self.uc.ctl_flush_tb()

    def forget_fault_in_flight(self) -> None:
        """Between runs: no exception is in flight on the loaded CPU (after a host operation whose instruction
        fetch may have faulted: see uc_native.old_exception_offset)."""
        self._forget_exception_in_flight()

    def _forget_exception_in_flight(self, read_error_code: bool = False) -> int:
        """We delivered the exception, so QEMU must stop treating it as in flight (see uc_native.old_exception_offset).
        With read_error_code, also returns the #PF error code QEMU computed (same context trip)."""
        offset = old_exception_offset()
        code_offset = page_fault_error_offset() if read_error_code else None
        if offset is None and code_offset is None:
            return 0
        context = self.uc.context_save()
        address = ctypes.cast(context.context, ctypes.c_void_p).value
        error_code = ctypes.c_uint32.from_address(address + code_offset).value if code_offset is not None else 0
        if offset is not None:
            ctypes.c_int32.from_address(address + offset).value = -1
            self.uc.context_restore(context)
        return error_code

    def _on_invalid(self, uc: Uc, _data: object) -> bool:
        try:
            if self.observer is not None:
                self.observer.fault_at(self.regs.read(X.UC_X86_REG_RIP))
            self.deliver(6)
            clear_pc_sync_flag(self._pc_sync_flag)  # RIP written from an instruction hook (uc_native)
            return True
        except BaseException as error:  # noqa: BLE001
            self._fail(error)
            return False

    def _on_bad_access(self, uc: Uc, access: int, address: int, size: int, value: int, _data: object) -> bool:
        """An access the page tables allowed but no physical memory backs (a bad entry): stops emulation."""
        self._fault = (access, address)
        return False

    def _on_out(self, uc: Uc, port: int, size: int, value: int, _data: object) -> None:
        try:
            self._port_out(port, size, value, self.regs.read(X.UC_X86_REG_RDI))
        except BaseException as error:  # noqa: BLE001
            self._fail(error)

    def _on_in(self, uc: Uc, port: int, size: int, _data: object) -> int:
        try:
            return self._port_in(port, size)
        except BaseException as error:  # noqa: BLE001
            self._fail(error)
            return 0

    # ---- running -----------------------------------------------------------------------------------------

    def run(self, until: int = NO_EXIT, count: int = 0, keep_stop_request: bool = False) -> Stop:
        """Run from RIP until hlt, a stop request, `until`, `count` instructions, or a bad physical access.

        A stop requested before the run began is forgotten: it was for whoever called run (a run nested in a
        posted request would otherwise end at once, forever). The machine's loop, which clears it under its
        lock so no request is lost, passes keep_stop_request.
        """
        uc = self.uc
        if not keep_stop_request:
            self.stopper.clear()
        self._fault = None
        self._error = None
        begin = self.regs.read(X.UC_X86_REG_RIP)
        failure: UcError | None = None
        if until != NO_EXIT:
            if not self.memory.loaded_space().executable(until - 1):
                # when the run ends, unicorn looks up the code at until - 1 by an instruction fetch: anywhere
                # else that fetch faults, and the fault is taken as a #PF by the next run
                raise MachineError(f"exit address {until:#x}: the byte before it is not executable code")
            uc.ctl_set_exits([until])
        if count and not self._counted:
            # unicorn counts through a code hook it adds now, in code translated from now on only: code translated
            # before would run uncounted (a step would run on until new code). It drops the code itself when the
            # hook goes (the next run without a budget).
            uc.ctl_flush_tb()
        self._counted = bool(count)
        observer = self.observer
        if observer is not None:
            observer.run_begins()
        self._in_emulation = True
        try:
            uc.emu_start(begin, until, 0, count)
        except UcError as error:
            failure = error
        finally:
            self._in_emulation = False
            stale, self._stale = self._stale, []
            for address, length, space in stale:
                self.memory.remove_cache(address, length, space)
            if until != NO_EXIT:
                uc.ctl_set_exits([])
            if self.observer is not None:  # (one may have come or gone during the run)
                self.observer.run_ends()
        if self.after_run is not None and failure is None and self._error is None and self._fault is None:
            try:
                self.after_run(uc)
            except BaseException as error:  # noqa: BLE001 - surfaced below, as a hook's
                self._error = error
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self._fault is not None:
            self._handle_fault(*self._fault)
            return Stop.EXCEPTION
        rip = self.regs.read(X.UC_X86_REG_RIP)
        if failure is not None:
            raise MachineError(f"emulation failed at rip {rip:#x}: {failure}")
        if rip == until:
            return Stop.UNTIL
        try:
            if uc.mem_read(rip - 1, 1) == b"\xf4":
                return Stop.HALT
        except UcError:
            pass
        return Stop.STOPPED

    def _handle_fault(self, access: int, address: int) -> None:
        """An access to unbacked physical memory stopped emulation with RIP at the faulting instruction: the
        fixup table, else a #PF (present: the entry exists) for the kernel."""
        self._fault = None
        rip = self.uc.reg_read(X.UC_X86_REG_RIP)
        if self.observer is not None:
            self.observer.fault_at(rip)
        handler = self.fault_fixups.find(rip)
        if handler is not None:
            self.fixup_hits += 1
            handler(self.uc, address)
            return
        present = access in (UC_MEM_READ_PROT, UC_MEM_WRITE_PROT, UC_MEM_FETCH_PROT)
        write = access in (UC_MEM_WRITE_UNMAPPED, UC_MEM_WRITE_PROT)
        fetch = access in (UC_MEM_FETCH_UNMAPPED, UC_MEM_FETCH_PROT)
        self.uc.reg_write(X.UC_X86_REG_CR2, address)
        self.deliver(PAGE_FAULT, int(present) | int(write) << 1 | int(fetch) << 4)

    def read_byte(self, address: int) -> int | None:
        try:
            return self.uc.mem_read(address, 1)[0]
        except UcError:
            return None
