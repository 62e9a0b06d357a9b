"""The thread packets and GDB's thread selection, for any target (stub/target.py).

Owns the thread packets (`qfThreadInfo`/`qsThreadInfo`, `qC`, `Hg`/`Hc`, `T<id>`, `qThreadExtraInfo`) and the
selection they make: the thread the register and memory packets act on (`Hg`, gdbserver's general_thread) and the
one `c` and `s` resume (`Hc`, its cont_thread). The threads themselves, and what is said of them, are the target's.
The selection belongs to the connection: `forget_session` gives the next debugger the target's first thread.

Runs on the server thread, as every handler does.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..rsp.dispatch import Reply, RspError, handles
from ..rsp.packets import connect as c
from .target import Target

#: E.. code of a thread id that names no thread of the target.
E_NO_THREAD = 0x05
#: E.. code of a packet that needs a process when there is none (gdbserver's write_enn: E01)
E_NO_PROCESS = 0x01


@dataclass
class Selection:
    """What GDB selected on this connection. `general` None: nothing yet, the target's first thread."""

    general: int | None = None
    continue_thread: int = c.ANY_THREAD
    #: GDB and the target speak multiprocess: thread ids go out as `pPID.TID`
    multiprocess: bool = False


@dataclass
class ThreadHandlers:
    """The thread packets; `selection` is read by the register, memory and run-control handlers too."""

    target: Target
    selection: Selection

    # ---- state the other families read ------------------------------------------------------------------

    @property
    def general_thread(self) -> int:
        """The thread `g`, `m` and their kind act on, and stop replies name when the target does not say."""
        if self.selection.general is None:
            threads = self.target.threads()
            if not threads:  # gdbserver's require_running: no process yet (extended mode)
                raise RspError(E_NO_PROCESS, "no process")
            return threads[0]
        return self.selection.general

    def forget_session(self) -> None:
        """A new debugger starts on the target's first thread."""
        self.selection.general = None
        self.selection.continue_thread = c.ANY_THREAD
        self.selection.multiprocess = False

    def supported(self, gdb_features: tuple[str, ...]) -> None:
        """qSupported: multiprocess thread ids when GDB offers them and the target is a process (gdbserver)."""
        self.selection.multiprocess = "multiprocess+" in gdb_features and self.target.is_process()

    def thread_id(self, thread: int) -> bytes:
        """A thread id as this session writes it: `TID`, or `pPID.TID` in multiprocess, PID its process's (remote.c:
        read_ptid)."""
        pid = self.target.process_of(thread) if self.selection.multiprocess else None
        return b"%x" % thread if pid is None else b"p%x.%x" % (pid, thread)

    def process_suffix(self, process: int | None = None) -> bytes:
        """What a `W`/`X` reply adds in multiprocess: `;process:PID`, of `process` (None: the target's)."""
        if not self.selection.multiprocess:
            return b""
        pid = process if process is not None else self.target.process_id()
        return b"" if pid is None else b";process:%x" % pid

    def require(self, thread: int) -> int:
        """`thread` when the target has it, else E05."""
        if thread <= 0 or not self.target.thread_alive(thread):
            raise RspError(E_NO_THREAD, f"no thread {thread}: the target has {len(self.target.threads())}")
        return thread

    # ---- packets ------------------------------------------------------------------------------------------

    @handles(c.FirstThreadInfo)
    def first_thread_info(self, packet: c.FirstThreadInfo) -> Reply:
        """Every thread in one reply; GDB asks for more with qsThreadInfo (remote.c:
        remote_target::remote_get_threads_with_qthreadinfo, called by remote_target::update_thread_list)."""
        threads = self.target.threads()
        if not threads:  # no process (extended mode, before vRun): gdbserver's empty list
            return b"l"
        return b"m" + b",".join(self.thread_id(thread) for thread in threads)

    @handles(c.SubsequentThreadInfo)
    def subsequent_thread_info(self, packet: c.SubsequentThreadInfo) -> Reply:
        return b"l"

    @handles(c.CurrentThread)
    def current_thread(self, packet: c.CurrentThread) -> Reply:
        """The selected thread, as gdbserver answers qC with its general thread (remote.c:
        remote_target::remote_current_thread reads `QC<id>`)."""
        return b"QC" + self.thread_id(self.general_thread)

    @handles(c.SetThread)
    def set_thread(self, packet: c.SetThread) -> Reply:
        """GDB's remote.c: remote_target::set_general_thread (`Hg`) and set_continue_thread (`Hc`); the meaning of
        0 and -1 as gdbserver's process_serial_event gives it: `Hg0`/`Hg-1` ("any"/"all") keep the selected
        thread, `Hgp<pid>.0` selects the first thread of that process, an id the target does not have is refused
        with E05 and changes nothing."""
        thread = None if packet.thread in (c.ANY_THREAD, c.ALL_THREADS) else self.require(packet.thread)
        if thread is None and packet.process and packet.op in ("g", "m"):  # (p0: any process, as GDB's null ptid)
            thread = next((t for t in self.target.threads() if self.target.process_of(t) == packet.process), None)
            if thread is None:
                raise RspError(E_NO_THREAD, f"no process {packet.process:x}")
        if packet.op in ("g", "m"):
            if thread is not None:
                self.selection.general = thread
        else:
            self.selection.continue_thread = packet.thread
        return b"OK"

    @handles(c.ThreadAlive)
    def thread_alive(self, packet: c.ThreadAlive) -> Reply:
        """remote.c: remote_target::thread_alive: `OK` for a thread the target has, E05 for any other id."""
        self.require(packet.thread)
        return b"OK"

    @handles(c.ThreadExtraInfo)
    def thread_extra_info(self, packet: c.ThreadExtraInfo) -> Reply:
        """remote.c: remote_target::extra_thread_info shows the hex-decoded reply in `info threads`."""
        text = self.target.thread_extra_info(self.require(packet.thread))
        return (text or "").encode().hex().encode()
