"""The debugger's side of the kernel's ptrace (fixtures/kernel/ptrace.c): traced processes, their stops, their
registers and memory, and the requests that resume them, as Linux's ptrace gives them to gdbserver.

A process spawned traced (`Ptrace.spawn`) stops, instead of taking a signal, on the way back to user mode: the
SIGTRAP of its exec (its first instruction), a breakpoint's int3, the end of a single step, a fault (SIGSEGV...),
the debugger's interrupt (SIGINT). The kernel tells the machine once the task is off its CPU (PORT_PTRACE), and
from then until it is resumed everything of it is in kernel memory, where this module reads and writes it:

- its user registers: the struct pt_regs on its kernel stack (`task->stop_regs`), FS and GS bases in
  `task->thread`, x87/SSE in `task->fpu` (fxsave's layout);
- its memory: through its own page tables (`mm->pgd`), read-only pages too (as ptrace's FOLL_FORCE). A page of
  one of its areas that it has not touched yet is faulted in by the task itself (PTRACE_PEEKDATA: it reads a word
  as the process would, and stops again), so demand paging stays the kernel's.

Events, as Linux's ptrace options give them (`Tracee.set_options`: PTRACE_O_TRACEFORK, _TRACEVFORK, _TRACEVFORKDONE,
_TRACEEXEC): a fork, a vfork, the end of a vfork's wait and an exec stop the task in its system call, a stop whose
`event` says which (PTRACE_EVENT_*) and whose message (`Tracee.event_message`: the child's pid, an exec's former
tid) is PTRACE_GETEVENTMSG's; with fork events the child is traced too, with its parent's options, stopped quietly
before its first instruction. Without exec events an exec is the SIGTRAP at the new program's first instruction.

A fork of a traced process (fixtures/kernel/fork.c) gives the child a copy of its memory; the kernel tells the
machine before the child runs (PORT_PTRACE, %rsi FORKED), and the int3s held in the parent's memory are taken out
of the child's copy there and then (int3s.py: `Int3s.forked`), as gdbserver does for a fork child it does not
follow: all of them for an untraced child; a traced one keeps the debugger's breakpoints (the debugger takes them
out or keeps them), never the tracer's tracepoints. `forks` counts them. An exec of a traced process tells the
machine of its old address space before it goes (%rsi EXECED): the int3s recorded there are forgotten with it
(`Int3s.gone`).

A running process is attached (`Ptrace.attach`) through the kernel's PTRACE_ATTACH (a machine request, process.py):
every thread traced and stopped quietly. Requests (PTRACE_CONT, PTRACE_SINGLESTEP with a signal, PTRACE_DETACH,
PTRACE_KILL, PTRACE_PEEKDATA, and the machine's own PTRACE_JUMP_PAD: a mapping for fast tracepoints' jump pads) are
written into the task and its CPU is sent a reschedule IPI, whose handler makes it runnable (ptrace_wake_requested).
The offsets of the task's fields come from the kernel's `ptrace_abi` table.

| port | access | meaning |
|------|--------|---------|
| 0xe8 | outl | pid in %eax, %rdi = the task, %rsi = the signal it stopped with, its event << 8 (all ones: the thread ended; FORKED: %eax and %rdi are a traced process's fork child, %rdx its parent task; EXECED: a traced task's exec, %rdx its old mm) |

Why this module is long: it is the debugger's whole side of one kernel interface, ptrace: the stops and events the
kernel tells, the requests written into a task, and a stopped task's registers (pt_regs, fxsave) and memory, which
share the task layout and the stop table kept here.

Threads: `port_out` runs on the CPU thread (inside emulation) and calls the listeners there; every other method
runs on any thread, reading and writing through `Machine.run_on_cpu`, and waits for stops on a condition.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from unicorn import Uc, UcError
from unicorn import x86_const as X

from .errors import MachineError
from .int3s import DEBUGGER
from .layout import PAGE_SIZE
from .process import EXIT_ZOMBIE, REQUEST_PTRACE_ATTACH, TASK_DEAD
from .tasks import live_tasks

PORT_PTRACE = 0xE8
PTRACE_PEEKDATA, PTRACE_CONT, PTRACE_KILL, PTRACE_SINGLESTEP, PTRACE_DETACH = 2, 7, 8, 9, 17
#: the machine's own request: an area of the process for fast tracepoints' jump pads (fixtures/kernel/jumppad.c)
PTRACE_JUMP_PAD = 0x4280
TASK_TRACED = 0x8
#: PORT_PTRACE's %rsi for a thread of a traced process that ended (its process lives on)
THREAD_ENDED = (1 << 64) - 1
#: PORT_PTRACE's %rsi for a traced process's fork: %eax and %rdi are the child, %rdx the parent task
FORKED = (1 << 64) - 2
#: PORT_PTRACE's %rsi for a traced task's exec: %rdi is the task, %rdx its old mm (not released yet)
EXECED = (1 << 64) - 3
#: ptrace options (Linux's PTRACE_O_*: the events a traced task stops at) and the events (PTRACE_EVENT_*: a stop's
#: `event`); in the task, the options sit above PT_PTRACED (Linux's PT_OPT_FLAG_SHIFT)
PTRACE_O_TRACEFORK, PTRACE_O_TRACEVFORK, PTRACE_O_TRACEEXEC, PTRACE_O_TRACEVFORKDONE = 0x2, 0x4, 0x10, 0x20
PTRACE_EVENT_FORK, PTRACE_EVENT_VFORK, PTRACE_EVENT_EXEC, PTRACE_EVENT_VFORK_DONE = 1, 2, 4, 5
PT_PTRACED, PT_OPT_FLAG_SHIFT = 0x1, 3
#: what `Tracee.interrupt` asks: SIGINT (GDB's Ctrl-C), or a stop with no signal (gdbserver's stop of the other
#: threads when one reports an event; a new thread's first stop)
INTERRUPT_SIGINT, INTERRUPT_QUIET = 1, 2
RESCHEDULE_VECTOR = 0xF0
TASK_SIZE_MAX = 0x00007FFFFFFFF000
#: pt_regs.vector of an entry by a system call: `syscall` (SYSCALL_VECTOR) and int $0x80
SYSCALL_VECTORS = (0x100, 0x80)
SIGTRAP = 5
#: seconds a request may take before the debugger gives up on the task (the kernel serves one in a few ticks)
REQUEST_TIMEOUT = 10.0

#: struct pt_regs, in order (fixtures/kernel/include/kernel.h)
PT_REGS = ("r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "rcx", "rax", "rdi", "rsi", "rdx", "r10", "r8", "r9",
           "vector", "orig_rax", "rip", "cs", "eflags", "rsp", "ss")
#: the flags a debugger may change (Linux's FLAG_MASK: CF PF AF ZF SF TF DF OF NT RF AC ID)
FLAG_MASK = 0x254DD5
_ABI_FIELDS = ("size", "pid", "state", "cpu", "mm", "fsbase", "gsbase", "fpu", "stop_signal", "stop_regs", "request",
               "data", "result", "interrupt", "mm_pgd", "comm", "pt_regs_size", "tgid", "ptrace")


@dataclass(frozen=True)
class TaskLayout:
    """Offsets of what the debugger reads of a task, from the kernel's `ptrace_abi` table."""

    size: int
    pid: int
    state: int
    cpu: int
    mm: int
    fsbase: int
    gsbase: int
    fpu: int
    stop_signal: int
    stop_regs: int
    request: int
    data: int
    result: int
    interrupt: int
    mm_pgd: int
    comm: int
    pt_regs_size: int
    tgid: int
    ptrace: int  #: int task->ptrace: PT_PTRACED and the options' event bits

    @classmethod
    def read(cls, machine: Any) -> TaskLayout:
        symbol = machine.image.symbols.get("ptrace_abi")
        if symbol is None:
            raise MachineError("this kernel has no ptrace (no `ptrace_abi`): rebuild it with scripts/build-kernel")
        raw = machine.read_memory(symbol.address, 8 * len(_ABI_FIELDS))
        layout = cls(*struct.unpack(f"<{len(_ABI_FIELDS)}Q", raw))
        if layout.pt_regs_size != 8 * len(PT_REGS):
            raise MachineError(f"the kernel's struct pt_regs is {layout.pt_regs_size} bytes, not {8 * len(PT_REGS)}")
        return layout


@dataclass(frozen=True)
class PtraceStop:
    """A traced task stopped with `signal`; `serial` counts the stops the machine heard of. `event`: an event stop's
    PTRACE_EVENT_* (its signal SIGTRAP), 0 for a signal's."""

    pid: int
    task: int
    signal: int
    serial: int
    event: int = 0


class TraceeGone(MachineError):
    """The process ended (or was never traced): nothing to read, nothing to resume."""


class Ptrace:
    """The machine's traced processes: their stops (heard on the CPU thread) and the `Tracee` of each."""

    def __init__(self, machine: Any) -> None:
        self._machine = machine
        self._cond = threading.Condition()
        self._stops: dict[int, PtraceStop] = {}  #: pid -> its latest stop
        self._serial = 0
        self._layout: TaskLayout | None = None
        #: called on the CPU thread with the pid of each stop and of each traced process that ended
        self.listeners: list[Callable[[int], None]] = []
        #: traced processes' forks the machine heard of, and the int3s taken out of the children's memory
        self.forks = 0
        self.int3s_taken = 0
        machine.processes.exit_reporters.append(self._process_ended)  # after the host's own listeners

    @property
    def layout(self) -> TaskLayout:
        if self._layout is None:
            self._layout = TaskLayout.read(self._machine)
        return self._layout

    # ---- the CPU thread ------------------------------------------------------------------------------------

    def port_out(self, value: int, rdi: int) -> None:
        """PORT_PTRACE: a traced task is stopped and off its CPU."""
        pid = value & 0xFFFF_FFFF
        uc = self._machine.cpu.uc
        rsi = uc.reg_read(X.UC_X86_REG_RSI)
        if rsi == FORKED:
            self._forked(uc, rdi, uc.reg_read(X.UC_X86_REG_RDX))
            return
        if rsi == EXECED:
            self._execed(uc, uc.reg_read(X.UC_X86_REG_RDX))
            return
        with self._cond:
            self._serial += 1
            if rsi == THREAD_ENDED:  # one thread of a traced process ended, the others live on
                self._stops.pop(pid, None)
            else:
                self._stops[pid] = PtraceStop(pid, rdi, rsi & 0x7F, self._serial, rsi >> 8 & 0xFF)
            self._cond.notify_all()
        for listener in list(self.listeners):
            listener(pid)

    def _space_of_mm(self, uc: Any, mm: int) -> Any:
        root = struct.unpack("<Q", uc.mem_read(mm + self.layout.mm_pgd, 8))[0]
        return self._machine.kernel_space.space_at(root)

    def _forked(self, uc: Any, child: int, parent: int) -> None:
        """A traced process (task `parent`) forked (task `child`, its memory a copy, not run yet): the int3s of the
        parent's memory out of the child's, but the debugger's in a child it traces."""
        layout = self.layout

        def space(task: int) -> Any:
            return self._space_of_mm(uc, struct.unpack("<Q", uc.mem_read(task + layout.mm, 8))[0])

        traced = struct.unpack("<i", uc.mem_read(child + layout.ptrace, 4))[0] != 0
        self.forks += 1
        self.int3s_taken += self._machine.int3s.forked(space(parent), space(child),
                                                       keep=frozenset({DEBUGGER}) if traced else frozenset())

    def _execed(self, uc: Any, old_mm: int) -> None:
        """A traced task exec'd: its old address space (mm `old_mm`, released next) and the int3s recorded there go."""
        self._machine.int3s.gone(self._space_of_mm(uc, old_mm))

    def _process_ended(self, pid: int) -> None:
        with self._cond:
            self._stops.pop(pid, None)
            self._serial += 1
            self._cond.notify_all()
        for listener in list(self.listeners):
            listener(pid)

    # ---- any thread ------------------------------------------------------------------------------------------

    @property
    def serial(self) -> int:
        with self._cond:
            return self._serial

    def stop_of(self, pid: int) -> PtraceStop | None:
        with self._cond:
            return self._stops.get(pid)

    def wait(self, pid: int, after: int, timeout: float | None = REQUEST_TIMEOUT) -> PtraceStop | None:
        """The first stop of `pid` with a serial above `after`, waiting for it; None when the process ended
        first; MachineError when neither came within `timeout` seconds."""
        processes = self._machine.processes

        def ready() -> bool:
            stop = self._stops.get(pid)
            return (stop is not None and stop.serial > after) or pid in processes.exited()

        with self._cond:
            if not self._cond.wait_for(ready, timeout):
                raise MachineError(f"process {pid} neither stopped nor ended in {timeout:g} s")
            stop = self._stops.get(pid)
            return stop if stop is not None and stop.serial > after else None

    def threads_of(self, tgid: int) -> dict[int, int]:
        """The live threads of process `tgid`: tid -> task, from the kernel's tasks[] (a thread that ended, or
        whose slot waits to be freed, is not one)."""
        tasks = self._machine.run_on_cpu(lambda uc: live_tasks(uc, self._machine.image, self.layout))
        return {task.pid: task.address for task in tasks if task.tgid == tgid}

    def stopped_tids(self) -> dict[int, PtraceStop]:
        """Every traced task stopped now, by tid."""
        with self._cond:
            return dict(self._stops)

    def wait_serial(self, after: int, timeout: float | None = REQUEST_TIMEOUT) -> None:
        """Wait until the machine hears of a stop or an end after the one numbered `after` (`serial` read before
        looking at the state, so that nothing in between is missed); MachineError after `timeout` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._serial > after, timeout):
                raise MachineError(f"no traced task stopped or ended in {timeout:g} s")

    def spawn(self, path: str, argv: Sequence[str], envp: Sequence[str] = (), cpu: int = -1) -> Tracee:
        """Start a program traced: it stops at its first instruction (its exec's SIGTRAP), which this waits for.
        TraceeGone if it ended instead (a program the kernel cannot run)."""
        before = self.serial
        pid = self._machine.processes.spawn(path, argv, envp, cpu, traced=True)
        stop = self.wait(pid, before)
        if stop is None:
            raise TraceeGone(f"{path} (pid {pid}) ended before its first instruction")
        return Tracee(self, pid, stop.task)

    def attach(self, pid: int) -> dict[int, Tracee]:
        """PTRACE_ATTACH of a running process, every thread of it (ptrace.c: ptrace_attach, a machine request),
        waiting until each has stopped (quietly, or with a signal it was about to take); its threads by tid, the
        leader first. MachineError naming why when the kernel refuses: no such process, a kernel thread, or one
        traced already. A thread still being made then stops later, as a new thread does."""
        with self._cond:
            before, already = self._serial, set(self._stops)  # a thread stopped for the debugger before counts
        taken = self._machine.processes.request(REQUEST_PTRACE_ATTACH, pid)
        if taken < 0:
            reason = {3: "No such process", 1: "Operation not permitted"}.get(-taken, f"errno {-taken}")
            raise MachineError(f"Cannot attach to process {pid}: {reason} ({-taken})")
        while True:
            serial = self.serial
            if pid in self._machine.processes.exited():
                raise TraceeGone(f"process {pid} ended while being attached")
            threads = self.threads_of(pid)
            with self._cond:
                stopped = {tid for tid, stop in self._stops.items()
                           if tid in threads and (stop.serial > before or tid in already)}
            if threads and len(stopped) == len(threads):
                break
            self.wait_serial(serial)
        tids = sorted(threads, key=lambda tid: tid != pid)
        return {tid: Tracee(self, tid, threads[tid]) for tid in tids}


class Tracee:
    """One traced process (single-threaded: its thread is its pid). Registers need it stopped; memory is read and
    written stopped or running."""

    def __init__(self, ptrace: Ptrace, pid: int, task: int) -> None:
        self.ptrace = ptrace
        self.machine = ptrace._machine
        self.pid = pid
        self.task = task
        self.layout = ptrace.layout

    # ---- state ------------------------------------------------------------------------------------------

    @property
    def ended(self) -> int | None:
        """Its wait status once it has ended, else None."""
        return self.machine.processes.exited().get(self.pid)

    @property
    def stop(self) -> PtraceStop | None:
        """Its current stop, None while it runs (or once it ended)."""
        return self.ptrace.stop_of(self.pid)

    def set_options(self, options: int) -> bool:
        """The events it stops at (PTRACE_O_* bits), as PTRACE_SETOPTIONS sets them: written into the task (its
        `ptrace` word's option bits, PT_PTRACED kept), stopped or running (the kernel reads them at the event);
        a thread it makes later and a fork child it traces inherit them. False when it is not traced (any more)."""
        offset = self.layout.ptrace

        def write(uc: Any) -> bool:
            if not struct.unpack("<i", uc.mem_read(self.task + offset, 4))[0]:
                return False
            uc.mem_write(self.task + offset, struct.pack("<i", PT_PTRACED | (options & 0xFF) << PT_OPT_FLAG_SHIFT))
            return True

        return bool(self.machine.run_on_cpu(write))

    def event_message(self) -> int:
        """The message of the event it is stopped at (PTRACE_GETEVENTMSG): a fork's child pid, an exec's former tid."""
        self._require_stopped()
        return self.machine.access(lambda uc: struct.unpack("<q", uc.mem_read(self.task + self.layout.result, 8))[0])

    def _require_stopped(self) -> PtraceStop:
        stop = self.stop
        if stop is None:
            if self.ended is not None:
                raise TraceeGone(f"process {self.pid} has ended")
            raise MachineError(f"process {self.pid} is running")
        return stop

    def _u64(self, uc: Any, address: int) -> int:
        return struct.unpack("<Q", uc.mem_read(address, 8))[0]

    # ---- registers ----------------------------------------------------------------------------------------

    def _regs_address(self, uc: Any) -> int:
        address = self._u64(uc, self.task + self.layout.stop_regs)
        if not address:
            raise MachineError(f"process {self.pid} is not stopped for the debugger")
        return address

    def registers(self) -> dict[str, int]:
        """Its user registers: pt_regs by GDB's names (plus `orig_rax`, `fs_base`, `gs_base`, the data segments
        Linux gives a 64-bit process: 0) and its x87/SSE state (`fxsave`: GDB's i387 names, xmm0-15, mxcsr)."""
        self._require_stopped()
        layout = self.layout

        def read(uc: Any) -> tuple[bytes, int, int, bytes]:
            regs = bytes(uc.mem_read(self._regs_address(uc), layout.pt_regs_size))
            return (regs, self._u64(uc, self.task + layout.fsbase), self._u64(uc, self.task + layout.gsbase),
                    bytes(uc.mem_read(self.task + layout.fpu, 512)))

        raw, fs_base, gs_base, fxsave = self.machine.access(read)
        values = dict(zip(PT_REGS, struct.unpack(f"<{len(PT_REGS)}Q", raw)))
        if values.pop("vector") not in SYSCALL_VECTORS:  # Linux's -1 in orig_ax for an entry by exception
            values["orig_rax"] = (1 << 64) - 1
        values.update(ds=0, es=0, fs=0, gs=0, fs_base=fs_base, gs_base=gs_base)
        values["eflags"] &= 0xFFFF_FFFF
        values.update(decode_fxsave(fxsave))
        return values

    def pc(self) -> int:
        """Its RIP (one read: what a stop's first look needs)."""
        self._require_stopped()
        offset = 8 * PT_REGS.index("rip")
        return self.machine.access(lambda uc: self._u64(uc, self._regs_address(uc) + offset))

    def set_pc(self, value: int) -> None:
        if value >= TASK_SIZE_MAX:
            raise MachineError(f"rip {value:#x} is outside the user half")
        self._require_stopped()
        offset = 8 * PT_REGS.index("rip")
        self.machine.access(lambda uc: uc.mem_write(self._regs_address(uc) + offset, struct.pack("<Q", value)))

    def write_registers(self, values: dict[str, int]) -> None:
        """Change the registers `values` names (as `registers` names them); cs, ss and the data segments stay the
        user's (Linux's putreg refuses others), the flags a process cannot set are kept."""
        self._require_stopped()
        layout = self.layout

        def write(uc: Any) -> None:
            address = self._regs_address(uc)
            regs = dict(zip(PT_REGS, struct.unpack(f"<{len(PT_REGS)}Q", uc.mem_read(address, layout.pt_regs_size))))
            for name, value in values.items():
                if name == "eflags":
                    regs[name] = (value & FLAG_MASK) | (regs[name] & ~FLAG_MASK)
                elif name in regs and name not in ("cs", "ss", "vector"):
                    regs[name] = value & (1 << 64) - 1
            if "rip" in values and values["rip"] >= TASK_SIZE_MAX:
                raise MachineError(f"rip {values['rip']:#x} is outside the user half")
            uc.mem_write(address, struct.pack(f"<{len(PT_REGS)}Q", *(regs[name] for name in PT_REGS)))
            for name, offset in (("fs_base", layout.fsbase), ("gs_base", layout.gsbase)):
                if name in values and values[name] < TASK_SIZE_MAX:
                    uc.mem_write(self.task + offset, struct.pack("<Q", values[name]))
            if any(name in FXSAVE_NAMES for name in values):
                fxsave = bytearray(uc.mem_read(self.task + layout.fpu, 512))
                encode_fxsave(fxsave, values)
                uc.mem_write(self.task + layout.fpu, bytes(fxsave))

        self.machine.access(write)

    def siginfo(self) -> bytes:
        """The siginfo_t (128 bytes, Linux's x86_64 layout) of the signal it stopped with (PTRACE_GETSIGINFO), from
        the kernel's per-process signal state (`signal_abi`)."""
        self._require_stopped()
        symbol = self.machine.image.symbols.get("signal_abi")
        if symbol is None:
            raise MachineError("this kernel keeps no siginfo (no `signal_abi`)")
        states, size, last, first = struct.unpack("<4Q", self.machine.read_memory(symbol.address, 32))
        slot = (self.task - self.machine.image.address_of("tasks")) // self.layout.size - first
        return self.machine.read_memory(states + slot * size + last, 128)

    def signal_code(self) -> int:
        """The si_code of the signal it stopped with: SI_KERNEL (0x80) for an int3's SIGTRAP, TRAP_TRACE (2) for a
        single step's, SI_USER (0) for one sent by kill() or an exec (Linux's x86 values)."""
        return struct.unpack_from("<i", self.siginfo(), 8)[0]

    # ---- memory ------------------------------------------------------------------------------------------

    def _space(self, uc: Any) -> Any:
        mm = self._u64(uc, self.task + self.layout.mm)
        if not mm:
            raise TraceeGone(f"process {self.pid} has no address space any more")
        return self.machine.kernel_space.space_at(self._u64(uc, mm + self.layout.mm_pgd))

    def space(self) -> Any:
        """Its address space (uc_paging.AddressSpace of its page tables)."""
        return self.machine.run_on_cpu(self._space)

    def _page_present(self, page: int) -> bool:
        return self.machine.run_on_cpu(lambda uc: self._space(uc).translate(page) is not None)

    def fault_in(self, address: int) -> bool:
        """Make the page of `address` present, as the process touching it would (PTRACE_PEEKDATA); False when
        no area of the process covers it (or its area may not be read)."""
        if address >= TASK_SIZE_MAX:
            return False
        self._require_stopped()
        result = self._request(PTRACE_PEEKDATA, address & ~7, wait=True)
        return result is not None and not (-4096 < result < 0 and not self._page_present(address & ~(PAGE_SIZE - 1)))

    def map_jump_pad(self, near: int, pages: int) -> int:
        """A new area of `pages` pages (readable, writable, executable, present) within a rel32 jump of `near`, for
        fast tracepoints' jump pads: the process maps it itself (PTRACE_JUMP_PAD, fixtures/kernel/jumppad.c), so it
        is one of its areas as an mmap's, gone with the process. Its address; MachineError when none fits."""
        if not 0 < pages < PAGE_SIZE:
            raise ValueError(pages)
        self._require_stopped()
        result = self._request(PTRACE_JUMP_PAD, (near & ~(PAGE_SIZE - 1)) | pages, wait=True)
        if result is None:
            raise TraceeGone(f"process {self.pid} has ended")
        if result < 0:
            raise MachineError(f"process {self.pid}: no room for a jump pad within 2 GiB of {near:#x} "
                               f"(errno {-result})")
        return result

    def read_memory(self, address: int, length: int, hide_int3s: bool = False) -> bytes:
        """Bytes of its memory from `address`: as many as its pages give, faulting in a page of its areas it has
        not touched yet (empty: not even the first byte). `hide_int3s`: the bytes under the int3s the debugger and
        the tracer hold there (int3s.py) in their place, as the program sees its memory. A running one (a non-stop
        debugger reads while threads run, as gdbserver reads /proc/PID/mem) is read through its page tables as they
        are: a page it has not touched yet ends the read."""
        fault = self._may_fault_in()
        out = bytearray()
        while len(out) < length:
            at = address + len(out)
            chunk = min(length - len(out), PAGE_SIZE - (at & (PAGE_SIZE - 1)))
            data = self._page_bytes(at, chunk, write=None, hide_int3s=hide_int3s, fault=fault)
            if data is None:
                break
            out += data
        return bytes(out)

    def write_memory(self, address: int, data: bytes) -> None:
        """Write its memory (read-only pages too, as ptrace's POKEDATA); MachineError, after writing the pages
        before it, at the first address outside its areas. An int3 held there (int3s.py) stays: the byte under it
        is what was written. A running one is written as it is read, in the pages it has."""
        fault = self._may_fault_in()
        done = 0
        while done < len(data):
            at = address + done
            chunk = min(len(data) - done, PAGE_SIZE - (at & (PAGE_SIZE - 1)))
            if self._page_bytes(at, chunk, write=data[done: done + chunk], fault=fault) is None:
                raise MachineError(f"cannot write {at:#x}: outside the process's memory")
            done += chunk

    def debugger_int3s(self, coming: Sequence[int], leaving: Sequence[int]) -> list[bool]:
        """The debugger's int3s (int3s.py's DEBUGGER holds): those at `leaving` let go of, those at `coming` held,
        in one trip to the CPU thread when their pages are present (a page not yet faulted in is brought in
        first, only while it is stopped). For each of `coming`, whether it is in (False: outside the process's
        memory, or not brought in yet). How breakpoints go in and out, also while it runs (non-stop)."""
        fault = self._may_fault_in()
        int3s = self.machine.int3s

        def change(uc: Any, leaving: Sequence[int], coming: Sequence[int]) -> list[bool]:
            space = self._space(uc)
            for address in leaving:
                if int3s.release(space, address, DEBUGGER):
                    self.machine.cpu.remove_cache(address, 1, space)
            out = []
            for address in coming:
                first = not int3s.holders(space, address)
                out.append(int3s.hold(space, address, DEBUGGER) is not None)
                if out[-1] and first:
                    self.machine.cpu.remove_cache(address, 1, space)
            return out

        done = self.machine.run_on_cpu(lambda uc: change(uc, leaving, coming))
        for index, address in enumerate(coming):
            if not done[index] and fault and address < TASK_SIZE_MAX and self.fault_in(address):
                done[index] = self.machine.run_on_cpu(lambda uc, address=address: change(uc, (), (address,)))[0]
        return done

    def _may_fault_in(self) -> bool:
        """Stopped: a page not touched yet may be brought in (by the task); running: not. TraceeGone: ended."""
        if self.stop is not None:
            return True
        if self.ended is not None:
            raise TraceeGone(f"process {self.pid} has ended")
        return False

    def _page_bytes(self, address: int, length: int, write: bytes | None,
                    hide_int3s: bool = False, fault: bool = True) -> bytes | None:
        """Read (or write) [address, address + length) within one page; None if the page cannot be had."""

        def access(uc: Any) -> bytes | None:
            space = self._space(uc)
            physical = space.translate(address, length)
            if physical is None:
                return None
            if write is None:
                data = bytes(Uc.mem_read(uc, physical, length))
                return self.machine.int3s.hide(space, address, data) if hide_int3s else data
            self.machine.int3s.write(space, address, write)
            self.machine.cpu.remove_cache(address, length, space)
            return write

        data = self.machine.access(access)
        if data is None and fault and address < TASK_SIZE_MAX and self.fault_in(address):
            data = self.machine.access(access)
        return data

    # ---- run control -------------------------------------------------------------------------------------

    def resume(self, step: bool = False, signal: int = 0) -> int:
        """Let it run (PTRACE_CONT) or run one instruction (PTRACE_SINGLESTEP), taking `signal` (0: none);
        returns the serial the next stop will be above."""
        self._require_stopped()
        serial = self.ptrace.serial
        self._request(PTRACE_SINGLESTEP if step else PTRACE_CONT, signal & 0x7F, wait=False)
        return serial

    def detach(self, signal: int = 0) -> None:
        """Let it go on untraced (PTRACE_DETACH), taking `signal`; a running one is stopped first. Returns once it
        is untraced, as Linux's PTRACE_DETACH does: here the task serves the request itself, on its CPU, and an
        attach that came before it had (GDB's `detach` then `attach PID` at once) found it still traced, took its
        other threads and waited for a stop this one never made."""
        if self._stopped_then(PTRACE_DETACH, signal & 0x7F):
            self._wait_untraced()

    def _wait_untraced(self) -> None:
        """Until its `ptrace` word is clear or its task is gone (nothing in the kernel tells the machine: looked
        at every half millisecond, for at most REQUEST_TIMEOUT)."""
        layout = self.layout

        def traced(uc: Any) -> bool:
            state = struct.unpack("<q", uc.mem_read(self.task + layout.state, 8))[0]
            word = struct.unpack("<i", uc.mem_read(self.task + layout.ptrace, 4))[0]
            return bool(word) and state not in (EXIT_ZOMBIE, TASK_DEAD)

        deadline = time.monotonic() + REQUEST_TIMEOUT
        while self.machine.access(traced):
            if time.monotonic() > deadline:
                raise MachineError(f"process {self.pid} did not leave the debugger in {REQUEST_TIMEOUT:g} s")
            time.sleep(0.0005)

    def kill(self) -> None:
        """End it (PTRACE_KILL, or SIGKILL's effect on a running one: stopped at once, then ended)."""
        if self._stopped_then(PTRACE_KILL, 0):
            self.machine.processes.wait(self.pid, REQUEST_TIMEOUT)

    def _stopped_then(self, request: int, data: int) -> bool:
        """`request` for it, stopping it first if it runs; False when it ended before (nothing asked)."""
        if self.ended is not None:
            return False
        if self.stop is None:
            before = self.ptrace.serial
            self.interrupt()
            if self.ptrace.wait(self.pid, before) is None:
                return False
        self._request(request, data, wait=False)
        return True

    def interrupt(self, quiet: bool = False) -> None:
        """Ask it to stop on its way back to user mode: with SIGINT (GDB's Ctrl-C), or `quiet`ly, with no signal
        (it stops with signal 0)."""
        layout = self.layout
        kind = INTERRUPT_QUIET if quiet else INTERRUPT_SIGINT

        def ask(uc: Any) -> int:
            uc.mem_write(self.task + layout.interrupt, struct.pack("<Q", kind))
            return struct.unpack("<i", uc.mem_read(self.task + layout.cpu, 4))[0]

        cpu = self.machine.run_on_cpu(ask)
        self.machine.send_interrupt(cpu, RESCHEDULE_VECTOR)

    def _request(self, request: int, data: int, wait: bool) -> int | None:
        """Write a request into the stopped task and wake it; with `wait`, wait for it to stop again and return
        its result (None: it ended meanwhile)."""
        layout = self.layout
        with self.ptrace._cond:
            stop = self.ptrace._stops.pop(self.pid, None)
            serial = self.ptrace._serial
        if stop is None:
            raise MachineError(f"process {self.pid} is not stopped")

        def post(uc: Any) -> int:
            state = struct.unpack("<q", uc.mem_read(self.task + layout.state, 8))[0]
            if state != TASK_TRACED:
                raise MachineError(f"process {self.pid} is not stopped for the debugger (state {state:#x})")
            uc.mem_write(self.task + layout.data, struct.pack("<Q", data))
            if request in (PTRACE_CONT, PTRACE_SINGLESTEP, PTRACE_DETACH):  # a stop asked before this one is stale
                uc.mem_write(self.task + layout.interrupt, struct.pack("<Q", 0))
            uc.mem_write(self.task + layout.request, struct.pack("<q", request))
            return struct.unpack("<i", uc.mem_read(self.task + layout.cpu, 4))[0]

        try:
            cpu = self.machine.run_on_cpu(post)
        except (MachineError, UcError):
            with self.ptrace._cond:
                self.ptrace._stops.setdefault(self.pid, stop)
            raise
        self.machine.send_interrupt(cpu, RESCHEDULE_VECTOR)
        if not wait:
            return None
        again = self.ptrace.wait(self.pid, serial)
        if again is None:
            return None
        return self.machine.run_on_cpu(
            lambda uc: struct.unpack("<q", uc.mem_read(self.task + layout.result, 8))[0])


# ---- x87/SSE in fxsave's layout (Intel SDM vol. 1, 10.5.1; GDB's i387-tdep.c: i387_supply_fxsave) ----------

FXSAVE_NAMES = frozenset(("fctrl", "fstat", "ftag", "fiseg", "fioff", "foseg", "fooff", "fop", "mxcsr",
                          *(f"st{i}" for i in range(8)), *(f"xmm{i}" for i in range(16))))


def _tag_of(value: bytes) -> int:
    """The full tag of a non-empty x87 register (0 valid, 1 zero, 2 special), from its 80-bit value."""
    mantissa = int.from_bytes(value[:8], "little")
    exponent = int.from_bytes(value[8:10], "little") & 0x7FFF
    if exponent == 0x7FFF:
        return 2
    if exponent == 0:
        return 1 if mantissa == 0 else 2
    return 0 if mantissa >> 63 else 2


def decode_fxsave(area: bytes) -> dict[str, int]:
    """GDB's x87 and SSE registers from an fxsave64 area: the abridged tag widened to the full tag word."""
    fcw, fsw, ftw, fop, fip, fdp, mxcsr = struct.unpack_from("<HHBxHQQI", area, 0)
    top = fsw >> 11 & 7
    values = {"fctrl": fcw, "fstat": fsw, "fop": fop & 0x7FF, "mxcsr": mxcsr,
              "fioff": fip & 0xFFFF_FFFF, "fiseg": fip >> 32 & 0xFFFF, "fooff": fdp & 0xFFFF_FFFF,
              "foseg": fdp >> 32 & 0xFFFF}
    tag = 0
    for physical in range(8):
        if ftw >> physical & 1:
            st = (physical - top) & 7
            tag |= _tag_of(area[32 + 16 * st: 42 + 16 * st]) << 2 * physical
        else:
            tag |= 3 << 2 * physical
    values["ftag"] = tag
    for i in range(8):
        values[f"st{i}"] = int.from_bytes(area[32 + 16 * i: 42 + 16 * i], "little")
    for i in range(16):
        values[f"xmm{i}"] = int.from_bytes(area[160 + 16 * i: 176 + 16 * i], "little")
    return values


def encode_fxsave(area: bytearray, values: dict[str, int]) -> None:
    """Write the x87/SSE registers `values` names into an fxsave64 area (the tag word back to its abridged form)."""
    for name, offset, size in (("fctrl", 0, 2), ("fstat", 2, 2), ("fop", 6, 2), ("mxcsr", 24, 4)):
        if name in values:
            area[offset: offset + size] = (values[name] & (1 << 8 * size) - 1).to_bytes(size, "little")
    if "ftag" in values:
        area[4] = sum(1 << i for i in range(8) if (values["ftag"] >> 2 * i & 3) != 3)
    if "fioff" in values or "fiseg" in values:
        old = int.from_bytes(area[8:16], "little")
        value = (values.get("fioff", old & 0xFFFF_FFFF) & 0xFFFF_FFFF) | (values.get("fiseg", old >> 32) & 0xFFFF) << 32
        area[8:16] = value.to_bytes(8, "little")
    if "fooff" in values or "foseg" in values:
        old = int.from_bytes(area[16:24], "little")
        value = (values.get("fooff", old & 0xFFFF_FFFF) & 0xFFFF_FFFF) | (values.get("foseg", old >> 32) & 0xFFFF) << 32
        area[16:24] = value.to_bytes(8, "little")
    for i in range(8):
        if f"st{i}" in values:
            area[32 + 16 * i: 42 + 16 * i] = (values[f"st{i}"] & (1 << 80) - 1).to_bytes(10, "little")
    for i in range(16):
        if f"xmm{i}" in values:
            area[160 + 16 * i: 176 + 16 * i] = (values[f"xmm{i}"] & (1 << 128) - 1).to_bytes(16, "little")
