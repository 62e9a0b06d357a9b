"""Packets that resume threads with an action each: `vCont?` and `vCont` (remote.c: remote_target::remote_vcont_probe,
remote_resume_with_vcont).

GDB asks `vCont?` once per connection, before its first resumption; when the reply lists `c`, `C`, `s` and `S`, it
resumes with `vCont;ACTION[:THREAD];...` from then on instead of `Hc` + `c`/`s`, and with `r` listed it steps
through a source line with one range step (`rSTART,END`: step while the PC stays in [START, END)). For each thread
the leftmost action naming it, or naming no thread, applies; a thread no action names stays stopped (GDB's
scheduler-locking). `t` (stop a thread) belongs to non-stop mode.

Non-stop mode (GDB's `set non-stop on`; remote.c: remote_target::start_remote_1 sends `QNonStop:1`, or `QNonStop:0`
to a stub that offers it, remote_target::remote_stop_ns, remote_interrupt_ns; gdbserver's server.cc): `QNonStop`,
`vStopped` (GDB drains the queue of stop replies that a `%Stop` notification opened) and `vCtrlC` (Ctrl-C as a
packet, answered at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from .base import Packet, PacketError, parse_hex, parse_hex_bytes, split_exact
from .connect import ALL_THREADS, parse_ptid

#: the actions of a vCont packet (gdbserver: server.cc handle_v_cont)
CONTINUE, STEP, STOP, RANGE = "c", "s", "t", "r"


@dataclass(frozen=True)
class VContQuery(Packet):
    """`vCont?`: which actions the stub's vCont knows."""

    PREFIX = b"vCont?"
    EXACT = True


@dataclass(frozen=True)
class VContAction:
    """One action: `kind` is c (continue), s (step), t (stop) or r (step while the PC is in [start, end)); C and S
    are c and s with a signal. `thread` is the one it names, -1 (all threads) when it names none; `process` the
    process a multiprocess id names (`c:p<pid>.-1`: every thread of that process), None for every process."""

    kind: str
    thread: int = ALL_THREADS
    signal: int = 0
    start: int = 0
    end: int = 0
    process: int | None = None


@dataclass(frozen=True)
class VCont(Packet):
    """`vCont;ACTION[:THREAD][;ACTION[:THREAD]]...`."""

    PREFIX = b"vCont;"
    actions: tuple[VContAction, ...] = ()

    @classmethod
    def parse(cls, body: bytes) -> Self:
        actions = []
        for text in body.split(b";"):
            action, colon, thread = text.partition(b":")
            if colon and not thread:
                raise PacketError("vCont: empty thread id")
            actions.append(_action(action, *(parse_ptid(thread) if colon else (None, ALL_THREADS))))
        return cls(tuple(actions))


def _action(text: bytes, process: int | None, thread: int) -> VContAction:
    kind, rest = text[:1].decode("latin-1"), text[1:]
    if kind in (CONTINUE, STEP, STOP):
        if rest:
            raise PacketError(f"vCont: unexpected {rest[:16]!r} after {kind}")
        return VContAction(kind, thread, process=process)
    if kind in ("C", "S"):
        return VContAction(kind.lower(), thread, signal=parse_hex(rest, "signal", bits=8), process=process)
    if kind == RANGE:
        start, end = (parse_hex(value, "range") for value in split_exact(rest, b",", 2, "vCont;r"))
        return VContAction(RANGE, thread, start=start, end=end, process=process)
    raise PacketError(f"vCont: unknown action {text[:16]!r}")


@dataclass(frozen=True)
class NonStop(Packet):
    """`QNonStop:1` (non-stop) or `QNonStop:0` (all-stop); anything else is refused, as gdbserver's
    handle_general_set refuses an unknown mode."""

    PREFIX = b"QNonStop:"
    FEATURES = ("QNonStop+",)
    on: bool = False

    @classmethod
    def parse(cls, body: bytes) -> Self:
        if body not in (b"0", b"1"):
            raise PacketError(f"QNonStop: unknown mode {body[:16]!r}")
        return cls(body == b"1")


@dataclass(frozen=True)
class VStopped(Packet):
    """`vStopped`: GDB has the stop reply queued first; the stub answers the next one, `OK` when none is left
    (gdbserver's notif.cc: handle_notif_ack)."""

    PREFIX = b"vStopped"
    EXACT = True


@dataclass(frozen=True)
class VCtrlC(Packet):
    """`vCtrlC`: interrupt the program, answered `OK` at once; the stop follows as a `%Stop` notification
    (gdbserver: handle_v_requests, request_interrupt)."""

    PREFIX = b"vCtrlC"
    EXACT = True


def _signal_list(body: bytes) -> frozenset[int]:
    if not body:
        return frozenset()
    return frozenset(parse_hex(item, "signal", bits=8) for item in body.split(b";") if item)  # GDB ends it with ;


@dataclass(frozen=True)
class PassSignals(Packet):
    """`QPassSignals:SIG;SIG...`: signals (GDB's numbers) the stub gives the program at once, without stopping for
    GDB (gdbserver: pass_signals; GDB sends the `handle ... nostop noprint pass` ones)."""

    PREFIX = b"QPassSignals:"
    FEATURES = ("QPassSignals+",)
    signals: frozenset[int] = frozenset()

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(_signal_list(body))


@dataclass(frozen=True)
class ProgramSignals(Packet):
    """`QProgramSignals:SIG;SIG...`: the signals GDB lets reach the program when it resumes it with one (gdbserver:
    program_signals); any other it asks to deliver is dropped."""

    PREFIX = b"QProgramSignals:"
    FEATURES = ("QProgramSignals+",)
    signals: frozenset[int] = frozenset()

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(_signal_list(body))


@dataclass(frozen=True)
class VKill(Packet):
    """`vKill;PID`: kill a process (remote.c: remote_vkill, what `kill` sends in multiprocess mode)."""

    PREFIX = b"vKill;"
    pid: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(parse_hex(body, "process id"))


@dataclass(frozen=True)
class VRun(Packet):
    """`vRun;PROGRAM[;ARG]...`: start a program (hex-encoded path and arguments; an empty path: the last one run),
    stopped at its first instruction (remote.c: extended_remote_run; gdbserver: handle_v_run)."""

    PREFIX = b"vRun;"
    program: str = ""
    args: tuple[str, ...] = ()

    @classmethod
    def parse(cls, body: bytes) -> Self:
        words = [parse_hex_bytes(word, "vRun argument").decode("utf-8", "surrogateescape") for word in body.split(b";")]
        return cls(words[0], tuple(words[1:]))


@dataclass(frozen=True)
class VAttach(Packet):
    """`vAttach;PID`: attach to a running process (remote.c: extended_remote_attach; gdbserver: handle_v_attach)."""

    PREFIX = b"vAttach;"
    pid: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Self:
        return cls(parse_hex(body, "process id", bits=32))
