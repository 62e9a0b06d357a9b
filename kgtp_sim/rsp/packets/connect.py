"""Packets GDB sends while attaching and for basic session control.

Thread: the server thread (`RspServer`), where the dispatcher parses these packets for the handlers of
kgtp_sim/stub/core.py, threads.py, run.py and monitor.py (qSupported: the dispatcher's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from .base import Packet, PacketError, Resume, parse_hex, parse_hex_bytes, parse_signed_hex


@dataclass(frozen=True)
class QSupported(Packet):
    PREFIX = b"qSupported"
    gdb_features: tuple[str, ...] = ()

    @classmethod
    def parse(cls, body: bytes) -> Self:
        if body and not body.startswith(b":"):
            raise PacketError("qSupported: expected ':' before the feature list")
        text = body[1:].decode("latin-1")
        return cls(tuple(f for f in text.split(";") if f))


@dataclass(frozen=True)
class StartNoAckMode(Packet):
    PREFIX = b"QStartNoAckMode"
    EXACT = True
    FEATURES = ("QStartNoAckMode+",)


@dataclass(frozen=True)
class MustReplyEmpty(Packet):
    PREFIX = b"vMustReplyEmpty"
    EXACT = True


#: Thread ids GDB gives a meaning of its own: 0 is "any thread", -1 "all threads" (remote.c: set_thread).
ANY_THREAD = 0
ALL_THREADS = -1


def parse_thread_id(text: bytes, what: str = "thread id") -> int:
    """A thread id as GDB writes it (remote.c: write_ptid): hex, `-1` (all threads) or `0` (any thread); the
    multiprocess form `p<pid>.<tid>` gives its thread part (`p<pid>` alone: any thread of that process). Any other
    negative number is malformed."""
    return parse_ptid(text, what)[1]


def parse_ptid(text: bytes, what: str = "thread id") -> tuple[int | None, int]:
    """A thread id with the process it names: (PID, thread) for the multiprocess form `p<pid>.<tid>` (`p<pid>` alone
    is (PID, any thread); `p<pid>.-1`, all threads of that process; a pid of -1, every process: None), (None,
    thread) for the plain form. The thread as `parse_thread_id` gives it."""
    process = None
    if text.startswith(b"p"):
        pid, dot, tid = text[1:].partition(b".")
        process = parse_signed_hex(pid, "process id")
        if process < ALL_THREADS:
            raise PacketError(f"process id: {process} is neither a process nor -1")
        if process == ALL_THREADS:
            process = None
        if not dot:
            return process, ANY_THREAD
        text = tid
    value = parse_signed_hex(text, what)
    if value < ALL_THREADS:
        raise PacketError(f"{what}: {value} is neither a thread nor -1")
    return process, value


@dataclass(frozen=True)
class SetThread(Packet):
    """`Hg<id>` (the thread `g`/`G`/`p`/`P` act on) / `Hc<id>` (the thread `c` resumes); `Hm` is GDB's old spelling
    of Hg. `id` is a CPU's thread, 0 (any) or -1 (all)."""

    PREFIX = b"H"
    op: str = "g"
    thread: int = 0
    #: multiprocess (`Hgp<pid>.<tid>`): the process named, None for the plain form
    process: int | None = None

    @classmethod
    def parse(cls, body: bytes) -> Self:
        if len(body) < 2 or body[:1] not in (b"g", b"c", b"m"):
            raise PacketError("H: expected Hg<thread> or Hc<thread>")
        process, thread = parse_ptid(body[1:])
        return cls(body[:1].decode(), thread, process)


@dataclass(frozen=True)
class HaltReason(Packet):
    PREFIX = b"?"
    EXACT = True


@dataclass(frozen=True)
class FirstThreadInfo(Packet):
    PREFIX = b"qfThreadInfo"
    EXACT = True


@dataclass(frozen=True)
class SubsequentThreadInfo(Packet):
    PREFIX = b"qsThreadInfo"
    EXACT = True


@dataclass(frozen=True)
class CurrentThread(Packet):
    PREFIX = b"qC"
    EXACT = True


@dataclass(frozen=True)
class ThreadAlive(Packet):
    """`T<id>`: is the thread still there (remote.c: remote_target::thread_alive)."""

    PREFIX = b"T"
    thread: int = 1

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(parse_thread_id(body))


@dataclass(frozen=True)
class ThreadExtraInfo(Packet):
    """`qThreadExtraInfo,<id>`: the text `info threads` shows in parentheses after the thread
    (remote.c: remote_target::extra_thread_info)."""

    PREFIX = b"qThreadExtraInfo,"
    thread: int = 1

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(parse_thread_id(body))


@dataclass(frozen=True)
class Attached(Packet):
    PREFIX = b"qAttached"

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls()


@dataclass(frozen=True)
class Offsets(Packet):
    PREFIX = b"qOffsets"
    EXACT = True


@dataclass(frozen=True)
class SymbolLookup(Packet):
    """`qSymbol::` (GDB offers to look up symbols); we need none, the ELF gives us every address."""

    PREFIX = b"qSymbol"

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls()


@dataclass(frozen=True)
class Detach(Packet):
    """`D`, or `D;PID` in multiprocess: detach from that one process (remote.c: remote_detach_pid; a fork child GDB
    does not follow goes that way)."""

    PREFIX = b"D"
    pid: int | None = None

    @classmethod
    def parse(cls, body: bytes) -> Self:
        if body and not body.startswith(b";"):
            raise PacketError("D: unexpected arguments")
        return cls(parse_hex(body[1:], "process id") if body[1:] else None)


@dataclass(frozen=True)
class ExtendedMode(Packet):
    """`!`: GDB's `target extended-remote` (remote.c: extended_remote_target::open): the server stays up when the
    process ends, is killed or detached, and takes vRun and vAttach (gdbserver's extended_protocol)."""

    PREFIX = b"!"
    EXACT = True


@dataclass(frozen=True)
class Restart(Packet):
    """`R XX`: restart the program last run, in extended mode (no reply: gdbserver's process_serial_event)."""

    PREFIX = b"R"

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls()


@dataclass(frozen=True)
class Kill(Packet):
    PREFIX = b"k"
    EXACT = True


@dataclass(frozen=True)
class Continue(Resume):
    """`c`: the kernel never stops, so continuing only means waiting for the user's Ctrl-C."""

    PREFIX = b"c"


@dataclass(frozen=True)
class ReadFeatures(Packet):
    """`qXfer:features:read:<annex>:<offset>,<length>`."""

    PREFIX = b"qXfer:features:read:"
    FEATURES = ("qXfer:features:read+",)
    annex: str = ""
    offset: int = 0
    length: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        annex, sep, window = body.rpartition(b":")
        if not sep:
            raise PacketError("qXfer: expected <annex>:<offset>,<length>")
        offset, comma, length = window.partition(b",")
        if not comma:
            raise PacketError("qXfer: expected <offset>,<length>")
        return cls(annex.decode("latin-1"), parse_hex(offset, "offset"), parse_hex(length, "length"))


@dataclass(frozen=True)
class ReadAuxv(ReadFeatures):
    """`qXfer:auxv:read::<offset>,<length>`: the process's auxiliary vector (gdbserver: handle_qxfer_auxv)."""

    PREFIX = b"qXfer:auxv:read:"
    FEATURES = ("qXfer:auxv:read+",)


@dataclass(frozen=True)
class ReadSiginfo(ReadFeatures):
    """`qXfer:siginfo:read::<offset>,<length>`: the siginfo of the signal the thread stopped with (gdbserver:
    handle_qxfer_siginfo, PTRACE_GETSIGINFO); GDB's `$_siginfo`."""

    PREFIX = b"qXfer:siginfo:read:"
    FEATURES = ("qXfer:siginfo:read+",)


@dataclass(frozen=True)
class ReadThreads(ReadFeatures):
    """`qXfer:threads:read::<offset>,<length>`: every thread with its name and core (gdbserver:
    handle_qxfer_threads), which GDB prefers to qfThreadInfo."""

    PREFIX = b"qXfer:threads:read:"
    FEATURES = ("qXfer:threads:read+",)


@dataclass(frozen=True)
class ReadExecFile(ReadFeatures):
    """`qXfer:exec-file:read:<pid>:<offset>,<length>`: the path of a process's program (gdbserver:
    handle_qxfer_exec_file); the annex is the pid in hex, empty for the current process."""

    PREFIX = b"qXfer:exec-file:read:"
    FEATURES = ("qXfer:exec-file:read+",)


@dataclass(frozen=True)
class ReadLibrariesSvr4(ReadFeatures):
    """`qXfer:libraries-svr4:read:<annex>:<offset>,<length>`: the dynamic linker's list of loaded objects
    (gdbserver: linux_process_target::qxfer_libraries_svr4; GDB: solib-svr4.c, svr4_current_sos_via_xfer_libraries).
    The annex is empty (every namespace from the program's r_debug) or, since GDB may send one when
    `augmented-libraries-svr4-read+` was announced, `name=hex` pairs separated by `;`: `start` (the link_map to
    walk from, in one namespace), `prev` (the one before it) and `lmid` (that namespace: its r_debug), read as
    gdbserver reads them: another name is skipped up to its `;`, and the first part without `=` ends the annex."""

    PREFIX = b"qXfer:libraries-svr4:read:"
    FEATURES = ("qXfer:libraries-svr4:read+", "augmented-libraries-svr4-read+")
    lmid: int = 0
    start: int = 0
    prev: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        window = super().parse(body)
        values = {"lmid": 0, "start": 0, "prev": 0}
        rest = window.annex
        while rest:
            name, equals, after = rest.partition("=")  # the name runs to the next '=', ';'s and all
            if not equals:
                break
            if name in values:
                value, _, rest = after.partition(";")
                values[name] = parse_hex(value.encode("latin-1"), f"{name}=") if value else 0
            else:
                _, semicolon, rest = after.partition(";")
                if not semicolon:
                    break
        return cls(window.annex, window.offset, window.length, **values)


@dataclass(frozen=True)
class ReadOsdata(ReadFeatures):
    """`qXfer:osdata:read:<annex>:<offset>,<length>`: a table of the operating system's (GDB's `info os`; the
    annex `processes` is `info os processes`: gdbserver's linux_xfer_osdata_processes), empty annex the tables."""

    PREFIX = b"qXfer:osdata:read:"
    FEATURES = ("qXfer:osdata:read+",)


@dataclass(frozen=True)
class MonitorCommand(Packet):
    """`qRcmd,<hex command>`: GDB's `monitor` command."""

    PREFIX = b"qRcmd,"
    command: str = ""

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(parse_hex_bytes(body, "monitor command").decode("utf-8", "replace"))
