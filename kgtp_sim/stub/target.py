"""The target: what GDB looks at, as one interface the packet handlers speak to, whatever the stub debugs.

Modelled on gdbstub's `Target` trait (base operations every target has, plus optional extensions a target hands
out through `support_*()`, None when it has none) and on gdbserver's process_stratum_target (gdbserver/target.h:
one interface, one implementation per kind of target). The handlers of stub/core.py, stub/run.py and
stub/threads.py know only this module; what they are given decides what GDB sees. KGTP mode's implementation is
stub/kernel.py: the running kernel, its CPUs as threads, with a selected trace frame or a replay laid over it.

Base (every target): its threads, their registers, memory, why it is stopped (`?`), its target description, and
what detaching or killing does. Optional extensions:

| extension                  | packets              | without it                                          |
|----------------------------|----------------------|-----------------------------------------------------|
| `support_register_writes`  | G, P                 | E03: the registers are read-only                    |
| `support_memory_writes`    | M, X                 | E03: the memory is read-only                        |
| `support_resume`           | c, s, vCont, Ctrl-C  | empty reply (the packet is not supported)           |
| `support_reverse`          | bs, bc               | not in the dispatch table, so not in qSupported     |
| `support_breakpoints`      | Z, z                 | empty reply, as gdbserver for a type it lacks       |
| `support_non_stop`         | QNonStop, vStopped,  | not in the dispatch table, so QNonStop+ is not in   |
|                            | vCtrlC               | qSupported (GDB's `set non-stop on` is refused)     |
| `support_breakpoint_       | Z0/Z1 with `;X...`,  | `Z` reads no options: ConditionalBreakpoints+ and   |
|  conditions`               | `;cmds:`             | BreakpointCommands+ not in qSupported               |

An extension is asked for at each packet (a target may lend one only in some states: KGTP's breakpoints exist only
in a replay, `supports` says which types); what qSupported announces follows the extensions the target has when
the handlers are assembled (core.TargetHandlers), as the dispatch table is built once.

Conventions the handlers rely on:
  - thread ids are GDB's, positive; 0 (any) and -1 (all) reach a target only in a `ResumeAction`;
  - a refusal is an `RspError` (its code is the `E..` GDB gets); memory the target cannot supply is `ViewError`;
  - registers are a dict by amd64 register name (arch/amd64.py), None or absent for an unavailable one;
  - outcomes of run control are typed (`Signal`, `ReplayLog`, `Exited`, `Terminated`, a process's events `Forked`,
    `VforkDone`, `Execd`, or `Running` when the stop comes later);
    the handlers turn them into stop replies (stub/run.py). A stop that comes later, by the target's own doing (a
    breakpoint hit while it runs), is handed out by `Resume.poll_stop`, after the target called the function given
    to `Resume.notify_stops` (from whichever thread it stopped on).

Every method is called from a packet handler, on the server thread, but the function given to `notify_stops`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from ..agent.verify import Program
from ..arch import amd64
from ..tracing.core.frames import ViewError

__all__ = [
    "SIGINT", "SIGTRAP", "Signal", "DataAccess", "ReplayLog", "Exited", "Terminated", "Forked", "VforkDone", "Execd",
    "Stop", "Running", "ResumeAction",
    "BreakpointType", "ViewError",
    "Target", "RegisterWrites", "MemoryWrites", "Resume", "Reverse", "Breakpoints", "NonStop",
]

SIGINT = 2
SIGTRAP = 5

_TARGET_XML = amd64.target_xml().encode()


# ---- outcomes of run control (gdbstub: MultiThreadStopReason) --------------------------------------------------


@dataclass(frozen=True)
class DataAccess:
    """A watchpoint's trap: the data address it watches and which kind it is (`watch:`, `rwatch:` or `awatch:` in
    the stop reply, which GDB matches to its watchpoint)."""

    type: BreakpointType
    address: int


@dataclass(frozen=True)
class Signal:
    """Stopped by `signal` (`T<signal>thread:<id>;`). `thread` None: the thread GDB selected (`Hg`), which is
    what a target that never really stops reports (KGTP: the thread GDB looks at stays the one it looks at).
    `watch`: the stop is a watchpoint's."""

    signal: int = SIGTRAP
    thread: int | None = None
    watch: DataAccess | None = None
    #: a software breakpoint's trap whose PC the target has already set back to the breakpoint (`swbreak:;`)
    swbreak: bool = False
    #: a hardware breakpoint's (`hwbreak:;`)
    hwbreak: bool = False


@dataclass(frozen=True)
class ReplayLog:
    """A replay ran out of recorded history, at its `begin` (going backwards) or its end: GDB's `replaylog` stop
    reason (remote.c: remote_target::process_stop_reply reads it), which makes GDB say "No more reverse-execution
    history"."""

    begin: bool
    thread: int | None = None
    signal: int = SIGTRAP


@dataclass(frozen=True)
class Exited:
    """The process exited with `code` (`W<code>`); `process` names it (`;process:PID` in multiprocess), None: the
    target's (which process it was is not part of what the end is: equal ends compare equal)."""

    code: int = 0
    process: int | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Terminated:
    """A signal ended the process (`X<signal>`); `process` as `Exited`'s."""

    signal: int
    process: int | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Forked:
    """`thread` forked (`vfork`: vforked): the child process `child` (its one thread's id is its pid), stopped before
    its first instruction, is the debugger's to follow or detach (`T05fork:pCHILD.CHILD;`, `vfork:`; gdbserver's
    TARGET_WAITKIND_FORKED and _VFORKED, remote.c: remote_parse_stop_reply)."""

    thread: int
    child: int
    vfork: bool = False
    signal: int = SIGTRAP


@dataclass(frozen=True)
class VforkDone:
    """`thread`'s vfork child exec'd or ended: the memory they shared is the parent's again (`T05vforkdone:;`)."""

    thread: int
    signal: int = SIGTRAP


@dataclass(frozen=True)
class Execd:
    """`thread`'s process runs a new program, `path`, stopped at its first instruction; the old image is gone
    (`T05exec:HEXPATH;`: GDB loads the new program's symbols and sets its breakpoints again)."""

    thread: int
    path: str
    signal: int = SIGTRAP


Stop = Signal | ReplayLog | Exited | Terminated | Forked | VforkDone | Execd


@dataclass(frozen=True)
class Running:
    """Resumed, no stop yet: the stop reply comes later, at the user's Ctrl-C (`Resume.interrupt`) or when the
    target stops by itself (`Resume.poll_stop`)."""


@dataclass(frozen=True)
class ResumeAction:
    """What one thread does when GDB resumes the target (gdbserver's struct thread_resume; one action of `vCont`).
    `thread` is the thread the action names: 0 (any) or -1 (all) mean every thread; for each thread the first
    action naming it (or every thread) applies, and a thread no action names stays stopped. `step` with `range`:
    step while the PC stays in [start, end) (vCont's `r`). `signal` is the one GDB passes (`C`, `S`), 0 for none.
    `stop`: non-stop's `t`, the thread is to stop (reported as a stop with signal 0). `process`: the process a
    wildcard `thread` is limited to (`pPID.-1`), None: every process."""

    thread: int
    step: bool = False
    range: tuple[int, int] | None = None
    signal: int = 0
    stop: bool = False
    process: int | None = None


class BreakpointType(IntEnum):
    """The type digit of `Z<type>`/`z<type>` (gdbserver's Z_PACKET_* numbers)."""

    SOFTWARE = 0
    HARDWARE = 1
    WRITE_WATCHPOINT = 2
    READ_WATCHPOINT = 3
    ACCESS_WATCHPOINT = 4


# ---- the base interface -------------------------------------------------------------------------------------


class Target(ABC):
    """What every target answers; the extensions below are lent through `support_*()`."""

    # -- threads (gdbstub: MultiThreadBase::list_active_threads, is_thread_alive; ThreadExtraInfo) --

    @abstractmethod
    def threads(self) -> Sequence[int]:
        """Every thread, in the order `qfThreadInfo` lists them; the first is the one a new debugger looks at."""

    def thread_alive(self, thread: int) -> bool:
        """`T<id>`; also what the thread packets check before acting on an id (E05 otherwise)."""
        return thread in self.threads()

    def thread_extra_info(self, thread: int) -> str | None:
        """The text `info threads` shows after a thread (`qThreadExtraInfo`); None: nothing to say."""
        return None

    # -- registers and memory (gdbserver: fetch_registers, read_memory) --

    @abstractmethod
    def read_registers(self, thread: int) -> dict[str, int | None]:
        """The registers of `thread` by amd64 name; None (or absent) when one is unavailable."""

    @abstractmethod
    def read_memory(self, address: int, length: int, thread: int, space: object | None = None) -> bytes:
        """`length` bytes at `address`, or the readable prefix of them; ViewError when not even the first byte is.

        `space` is the address space to read; None: that of `thread`, the thread GDB selected (gdbserver reads
        the memory of the general thread's process). Nothing passes one yet: it is the place for the machine's
        address spaces."""

    # -- stops --

    @abstractmethod
    def stop_reason(self) -> Stop:
        """Why the target is stopped: the answer to `?` (gdbserver: the last status its `wait` gave)."""

    # -- description and session --

    def process_id(self) -> int | None:
        """The process the threads belong to, when the target is one (GDB's multiprocess thread ids `pPID.TID`
        and `W..;process:PID` then name it); None: no process (KGTP's kernel)."""
        return None

    def process_of(self, thread: int) -> int | None:
        """The process `thread` belongs to (a target debugging several processes tells them apart); by default the
        target's."""
        return self.process_id()

    def is_process(self) -> bool:
        """Does it debug processes (GDB's multiprocess thread ids then apply), whether or not it has one now?"""
        return self.process_id() is not None

    def register_layout(self) -> amd64.RegisterLayout:
        """The register file `g`, `G`, `p` and `P` carry (amd64.CORE by default: KGTP mode's)."""
        return amd64.CORE

    def feature_document(self, annex: str) -> bytes | None:
        """The target description document `annex` (`qXfer:features:read`); None when there is none by that
        name. The default: the amd64 description every register packet follows."""
        return _TARGET_XML if annex == "target.xml" else None

    def attached(self) -> bool:
        """`qAttached`: True when GDB attached to something that existed before it (quitting GDB then detaches
        instead of killing)."""
        return True

    def detach(self, process: int | None = None) -> None:
        """`D`: GDB leaves; the target goes on without it. `process` (`D;PID`, multiprocess): the one process GDB
        detaches from (RspError when the target has no such process)."""

    def kill(self) -> None:
        """`k`: GDB asks the target to end (its session ends with it)."""

    # -- optional extensions --

    def gdb_features(self, features: tuple[str, ...]) -> None:
        """What GDB's qSupported offers (`fork-events+`, ...), at each connection: the target reports the events
        GDB asked for (gdbserver: report_fork_events and the others)."""

    def support_register_writes(self) -> RegisterWrites | None:
        return None

    def support_memory_writes(self) -> MemoryWrites | None:
        return None

    def support_resume(self) -> Resume | None:
        return None

    def support_reverse(self) -> Reverse | None:
        return None

    def support_breakpoints(self) -> Breakpoints | None:
        return None

    def support_non_stop(self) -> NonStop | None:
        return None

    def support_breakpoint_conditions(self) -> BreakpointConditions | None:
        """Asked once, where the handlers are assembled (the `Z` that reads conditions is the table's then)."""
        return None


# ---- extensions ---------------------------------------------------------------------------------------------


class RegisterWrites(ABC):
    """`G` and `P` (gdbserver: store_registers)."""

    @abstractmethod
    def write_registers(self, thread: int, values: dict[str, int]) -> None:
        """Set the registers `values` names (all of them for `G`, one for `P`) in `thread`."""


class MemoryWrites(ABC):
    """`M` and `X` (gdbserver: write_memory)."""

    @abstractmethod
    def write_memory(self, address: int, data: bytes, thread: int, space: object | None = None) -> None:
        """Write `data` at `address` (`space` as in `Target.read_memory`); ViewError when it cannot be written,
        RspError when the target refuses."""


class Resume(ABC):
    """Run control: `c`, `s`, `vCont` and the user's Ctrl-C (gdbserver: resume, request_interrupt; gdbstub:
    MultiThreadResume, its range stepping extension)."""

    @abstractmethod
    def resume(self, actions: Sequence[ResumeAction]) -> Stop | Running:
        """Resume as `actions` say: the stop, when it is known at once, or Running. RspError refuses (KGTP: a
        step while the kernel runs)."""

    @abstractmethod
    def interrupt(self) -> Stop:
        """The user pressed Ctrl-C while the target was Running: the stop to report."""

    def range_stepping(self) -> bool:
        """Does `resume` take a step action's `range` (announced as `r` in the reply to `vCont?`)?"""
        return False

    def notify_stops(self, notify: Callable[[], None]) -> None:
        """Call `notify()`, from any thread, when the target stops by itself after `resume` answered Running; the
        caller then asks `poll_stop`. A target that only stops at Ctrl-C never calls it."""

    def poll_stop(self) -> Stop | None:
        """The stop of a target that was Running and stopped by itself (a breakpoint), once; None while it runs
        on."""
        return None


class Reverse(ABC):
    """Reverse execution: `bs` and `bc` (gdbstub: ReverseStep, ReverseCont), over a recorded history."""

    @abstractmethod
    def reverse(self, *, step: bool) -> Stop:
        """One step back (`step`) or back to a breakpoint or the history's start; RspError refuses."""


class Breakpoints(ABC):
    """`Z` and `z` (gdbserver: supports_z_point_type, insert_point, remove_point; gdbstub: Breakpoints)."""

    @abstractmethod
    def supports(self, type: BreakpointType) -> bool:
        """Whether breakpoints of `type` can be set now; the handlers answer the empty reply for those that
        cannot (GDB then falls back on its own, e.g. an int3 written with M/X)."""

    @abstractmethod
    def insert_breakpoint(self, type: BreakpointType, address: int, kind: int, thread: int | None = None) -> None:
        """Set one; RspError refuses (GDB says it cannot insert the breakpoint). `thread`: the one GDB selected
        (`Hg`), whose process's memory a process's breakpoint goes in; None: the target's first."""

    @abstractmethod
    def remove_breakpoint(self, type: BreakpointType, address: int, kind: int, thread: int | None = None) -> None:
        """Remove one (from `thread`'s process); removing one that is not set is no error."""


class BreakpointConditions(ABC):
    """Conditions and commands of breakpoints (`Z0`/`Z1` with `;X...` and `;cmds:`), run by the target at each hit
    (gdbserver's ConditionalBreakpoints and BreakpointCommands: mem-break.cc's add_breakpoint_condition,
    add_breakpoint_commands, gdb_condition_true_at_breakpoint, run_breakpoint_commands). A hit whose conditions are
    all false, or a breakpoint with commands, is not reported: the thread goes on by itself."""

    @abstractmethod
    def set_conditions(self, type: BreakpointType, address: int, conditions: Sequence[Program],
                       commands: Sequence[Program] = (), thread: int | None = None) -> None:
        """The conditions and commands of the breakpoint just inserted at `address` (of `thread`'s process), in
        place of any it had (GDB sends the whole list again when it changes); none: it always stops."""



class NonStop(ABC):
    """Non-stop run control (GDB's `set non-stop on`; gdbserver's non_stop): each thread runs and stops on its own,
    a resumption is answered at once, and every stop reaches GDB later, as a notification. Lent by a target that
    also lends `Resume` (all-stop, the default mode, stays that extension's)."""

    @abstractmethod
    def non_stop(self) -> bool:
        """Is non-stop mode on?"""

    @abstractmethod
    def set_non_stop(self, on: bool) -> None:
        """`QNonStop`: switch modes; RspError refuses."""

    @abstractmethod
    def resume_threads(self, actions: Sequence[ResumeAction], held: Collection[int] = ()) -> None:
        """Non-stop `vCont`: each thread an action names continues, steps or (`stop`) is stopped; a thread named by
        none, and a running thread told to run, go on as they are; a thread in `held` (its stop told, GDB has not
        taken it yet: it thinks the thread runs) stays stopped. Returns at once; the stops come through
        `stop_events` (after the function given to `Resume.notify_stops` was called)."""

    @abstractmethod
    def stop_events(self) -> list[Stop]:
        """The stops GDB has not heard of yet, each once: a thread's (naming it) or the process's end."""

    @abstractmethod
    def stopped_threads(self) -> list[Stop]:
        """`?` in non-stop: the stop of every stopped thread, the last it reported (gdbserver's handle_status)."""

    @abstractmethod
    def request_interrupt(self) -> None:
        """`vCtrlC`, Ctrl-C in non-stop: interrupt the program (SIGINT) without waiting for the stop."""
