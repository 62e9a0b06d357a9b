"""The machine's CPUs as GDB threads, as QEMU's gdbstub shows them: thread k+1 is CPU k.

Owns the thread packets (`qfThreadInfo`/`qsThreadInfo`, `qC`, `Hg`/`Hc`, `T<id>`, `qThreadExtraInfo`), which thread
the stop replies name, and which CPU the live view's registers come from (the `Hg` selection, kept in
`LiveView.cpu`). Every CPU is listed, also one the kernel has not started yet (its extra info says `offline`), so
`info threads` shows the machine's CPU count from the start.

Runs on the server thread, as every handler does: the CPUs' states and registers are read through the machine
(`Machine.cpu_states`, `Machine.registers(cpu=...)`), which runs the read on the CPU thread. The selection belongs
to the connection: `forget_session` puts it back on CPU 0 for the next debugger.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..machine import Machine, MemoryFault
from ..rsp.dispatch import Reply, RspError, handles
from ..rsp.packets import connect as c
from .live import LiveView

log = logging.getLogger(__name__)

#: E.. code of a thread id that names no CPU.
E_NO_THREAD = 0x05
#: What GDB reads of a task's name (TASK_COMM_LEN).
COMM_LENGTH = 16


def thread_of(cpu: int) -> int:
    return cpu + 1


def cpu_of(thread: int) -> int:
    return thread - 1


@dataclass
class TaskNames:
    """Reads the name (`comm`) of the task a CPU runs, at the offset the kernel's DWARF gives `struct task_struct`'s
    `comm` (found once, on first use: the stub starts without reading the DWARF)."""

    machine: Machine
    comm_offset: int | None = None
    _looked_up: bool = field(default=False, init=False)

    def _offset(self) -> int | None:
        if self.comm_offset is None and not self._looked_up:
            self._looked_up = True
            self.comm_offset = comm_offset(self.machine.image.path)
        return self.comm_offset

    def task_of(self, cpu: int, task: int) -> int:
        """The task CPU `cpu` runs: its per-CPU `current_task`; on a kernel without per-CPU data (one CPU), the
        global `current` for CPU 0."""
        if task or cpu != 0:
            return task
        symbol = self.machine.image.symbols.get("current")
        if symbol is None:
            return 0
        try:
            return int.from_bytes(self.machine.read_memory(symbol.address, 8), "little")
        except MemoryFault:
            return 0

    def comm(self, task: int) -> str:
        offset = self._offset()
        if not task or offset is None:
            return ""
        try:
            raw = self.machine.read_memory(task + offset, COMM_LENGTH)
        except MemoryFault:
            return ""
        return raw.split(b"\0", 1)[0].decode("latin-1")


def comm_offset(path) -> int | None:
    """Offset of `comm` in the kernel's `struct task_struct`, from its DWARF: through the per-CPU area's
    `current_task`, the `tasks` array or the `current` pointer, whichever the kernel has."""
    from ..machine.dwarf import KernelDwarf

    try:
        dwarf = KernelDwarf(path)
    except Exception as error:  # noqa: BLE001 (no DWARF: threads are shown without their task's name)
        log.info("no DWARF for task names: %s", error)
        return None
    try:
        return dwarf.task_comm_offset()
    finally:
        dwarf.close()


@dataclass
class ThreadHandlers:
    """The thread packets. `live.cpu` is the `Hg` selection; `continue_thread` the `Hc` one (kept, as nothing
    resumes a CPU apart from the others: `c` only waits for the user's Ctrl-C)."""

    machine: Machine
    live: LiveView
    names: TaskNames | None = None
    continue_thread: int = c.ANY_THREAD

    def __post_init__(self) -> None:
        if self.names is None:
            self.names = TaskNames(self.machine)

    # ---- state the other families read ------------------------------------------------------------------

    @property
    def cpu_count(self) -> int:
        return self.machine.cpu_count

    @property
    def general_thread(self) -> int:
        return thread_of(self.live.cpu)

    def stop_reply(self) -> bytes:
        """What GDB is told about the (never really stopped) kernel: a SIGTRAP stop of the selected thread (the
        thread GDB looks at stays the one it looks at; CPU 0 after connecting, as QEMU's first CPU)."""
        return b"T05thread:%x;" % self.general_thread

    def forget_session(self) -> None:
        """A new debugger starts on CPU 0."""
        self.live.cpu = 0
        self.continue_thread = c.ANY_THREAD

    def _known(self, thread: int) -> bool:
        return 1 <= thread <= self.cpu_count

    def _require(self, thread: int) -> int:
        """The CPU of an existing thread, or E05."""
        if not self._known(thread):
            raise RspError(E_NO_THREAD, f"no thread {thread}: the machine has {self.cpu_count} CPUs")
        return cpu_of(thread)

    # ---- packets ------------------------------------------------------------------------------------------

    @handles(c.FirstThreadInfo)
    def first_thread_info(self, packet: c.FirstThreadInfo) -> Reply:
        """Every CPU in one reply (8 at most); GDB asks for more with qsThreadInfo (remote.c:
        remote_target::remote_get_threads_with_qthreadinfo, called by remote_target::update_thread_list)."""
        return b"m" + b",".join(b"%x" % thread_of(cpu) for cpu in range(self.cpu_count))

    @handles(c.SubsequentThreadInfo)
    def subsequent_thread_info(self, packet: c.SubsequentThreadInfo) -> Reply:
        return b"l"

    @handles(c.CurrentThread)
    def current_thread(self, packet: c.CurrentThread) -> Reply:
        """The selected thread, as gdbserver answers qC with its general thread (remote.c:
        remote_target::remote_current_thread reads `QC<id>`)."""
        return b"QC%x" % self.general_thread

    @handles(c.SetThread)
    def set_thread(self, packet: c.SetThread) -> Reply:
        """GDB's remote.c: remote_target::set_general_thread (`Hg`) and set_continue_thread (`Hc`); the meaning of
        0 and -1 as gdbserver's process_serial_event gives it: `Hg0`/`Hg-1` ("any"/"all") keep the selected CPU,
        a thread that is no CPU is refused with E05 and changes nothing."""
        if packet.thread not in (c.ANY_THREAD, c.ALL_THREADS):
            cpu = self._require(packet.thread)
        else:
            cpu = None
        if packet.op in ("g", "m"):
            if cpu is not None:
                self.live.cpu = cpu
        else:
            self.continue_thread = packet.thread
        return b"OK"

    @handles(c.ThreadAlive)
    def thread_alive(self, packet: c.ThreadAlive) -> Reply:
        """remote.c: remote_target::thread_alive: `OK` for every CPU of the machine (a CPU the kernel has not
        started is there, only offline), E05 for any other id."""
        self._require(packet.thread)
        return b"OK"

    @handles(c.ThreadExtraInfo)
    def thread_extra_info(self, packet: c.ThreadExtraInfo) -> Reply:
        """remote.c: remote_target::extra_thread_info shows the hex-decoded reply in `info threads`:
        `CPU#1 [running] kgtp_bench/1`, QEMU's `CPU#<index> [<state>]` followed by the name of the task the CPU
        runs (read from the task_struct its per-CPU `current_task` points at); `[offline]` for a CPU the kernel
        has not started, which runs no task."""
        cpu = self._require(packet.thread)
        state = self.machine.cpu_states()[cpu]
        text = f"CPU#{cpu} [{state.state}]"
        if state.state != "offline":
            assert self.names is not None
            name = self.names.comm(self.names.task_of(cpu, state.current_task))
            if name:
                text += f" {name}"
        return text.encode().hex().encode()
