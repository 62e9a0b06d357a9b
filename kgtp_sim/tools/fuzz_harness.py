"""The fuzzer's harness: a real `kgtp_sim.app.Stub` in-process (its dispatcher, handlers, tracer and kernel, with
the machine running) driven through a `Session`, exactly the object the TCP server feeds, and the checks after
every fuzzed input.

After every packet it checks that the packet got an answer (`E..`, empty, or a reply; a `c` is answered by the stop
the kernel made meanwhile, at a breakpoint, or once Ctrl-C follows, as GDB does it), that no handler failed (the dispatcher's last-resort guard answers `E0f` and logs
a traceback: that is a crash), and that the session still serves (`QTFrame:ffffffff` answers `OK` and
`m<jiffies>,8` answers 8 bytes of hex); `kernel_alive` checks at the end that jiffies advanced and the machine
neither crashed nor halted (a machine the packets stopped, breakpoints and `monitor stop` being fuzzed too, runs
again once the session leaves, as after a GDB). A broken rule raises `FuzzFailure`; `Figures` counts what was sent and answered.

Thread: the caller's (the campaign's or a test's) feeds the session in place of the server thread, while the
machine's CPU and tick threads run the kernel.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..client import VMLINUX
from ..rsp.codec import Decoder, EventKind, encode_packet

class FuzzFailure(AssertionError):
    """The stub did something it must never do; the message holds a reproducer."""


class _ErrorLog(logging.Handler):
    """The errors of one harness: logged on the thread feeding its session while it feeds, or on its machine's
    own threads (a process may hold several harnesses, each with its machine)."""

    def __init__(self, machine) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []
        self.machine = machine
        self.feeding: int | None = None  #: the thread feeding the session now, if any

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.feeding or record.thread in self.machine.thread_ids():
            self.records.append(record)


def is_error_reply(reply: bytes) -> bool:
    return re.fullmatch(rb"E[0-9a-fA-F]{2}", reply) is not None or reply.startswith(b"E.")


@dataclass
class Figures:
    packets: int = 0
    answered_ok: int = 0
    answered_error: int = 0
    answered_empty: int = 0
    frames_damaged: int = 0
    health_checks: int = 0
    reconnects: int = 0
    crashes: int = 0
    by_source: Counter = field(default_factory=Counter)
    errors_by_code: Counter = field(default_factory=Counter)


class Harness:
    """A stub with its kernel, one session at a time, and the checks after each packet."""

    #: definitions above this many are cleared (QTinit) so a long campaign does not slow every tstart down
    MAX_TRACEPOINTS = 16
    #: breakpoints above this many go (the session is left and a new one comes): each is a hook the kernel runs
    MAX_BREAKPOINTS = 16
    #: the answers to Ctrl-C after `c`: KGTP's never-stopped kernel (SIGTRAP), a machine under run control (SIGINT),
    #: or the stop it made meanwhile (a breakpoint, a watchpoint, a step)
    STOP_REPLY = re.compile(rb"T0[25](?:[a-z]+:[0-9a-f]+;)?thread:[0-9a-f]+;")

    def __init__(self, stub, *, started: bool = True) -> None:
        self.stub = stub
        self.machine = stub.machine
        self.jiffies = self.machine.image.address_of("jiffies")
        self.started = started
        if started and not self.machine.started:
            self.machine.start()
        self.hz, self.pace = self.machine.hz, self.machine.pace
        self.figures = Figures()
        self.errors = _ErrorLog(self.machine)
        self._errors_seen = 0  #: errors reported so far (`check_errors`)
        self._logger = logging.getLogger("kgtp_sim")
        self._level = self._logger.level
        if self._logger.getEffectiveLevel() > logging.ERROR:
            self._logger.setLevel(logging.ERROR)  # handler failures are logged at ERROR: they must reach us
        self._logger.addHandler(self.errors)
        self._connect()
        self.first_jiffies = self.read_jiffies()

    def close(self) -> None:
        self._logger.removeHandler(self.errors)
        self._logger.setLevel(self._level)

    def _connect(self) -> None:
        self.session = self.stub.make_session()
        self.stub.on_connect()

    def reconnect(self) -> None:
        """What the server does when GDB goes and another comes."""
        self.stub.on_disconnect()
        self._connect()
        self.figures.reconnects += 1

    # -- wire --

    def _feed(self, data: bytes) -> list[bytes]:
        self.errors.feeding = threading.get_ident()
        try:
            out = self.session.receive(data)
        except Exception as error:  # noqa: BLE001 - exactly what must never happen
            raise FuzzFailure(f"exception escaped the session: {type(error).__name__}: {error}") from error
        finally:
            self.errors.feeding = None
        self.check_errors()
        return [e.payload for e in Decoder().feed(out) if e.kind is EventKind.PACKET]

    def _poll(self) -> list[bytes]:
        """The session's stop reply, if the target stopped by itself (as the server polls it when woken)."""
        self.errors.feeding = threading.get_ident()
        try:
            out = self.session.poll()
        finally:
            self.errors.feeding = None
        self.check_errors()
        return [e.payload for e in Decoder().feed(out) if e.kind is EventKind.PACKET]

    def check_errors(self) -> None:
        """No error logged since the last look: by a handler, or by the machine's threads meanwhile (a crashed
        CPU thread's error comes between two packets)."""
        if len(self.errors.records) > self._errors_seen:
            self._errors_seen = len(self.errors.records)
            record = self.errors.records[-1]
            where = ""
            if record.exc_info and record.exc_info[2] is not None:
                frame = traceback.extract_tb(record.exc_info[2])[-1]
                where = f" at {Path(frame.filename).name}:{frame.lineno} ({frame.line})"
            raise FuzzFailure(f"the stub logged an error: {record.name}: {record.getMessage()}"
                              + (f" ({record.exc_info[1]!r}{where})" if record.exc_info else ""))

    def request(self, payload: bytes) -> list[bytes]:
        """Send one well-framed packet; return every packet the stub sent back for it."""
        replies = self._feed(encode_packet(payload, binary=True))
        if self.session.waiting_for_interrupt:  # `c`: the kernel stopped meanwhile, or the user presses Ctrl-C
            replies += self._poll()
            if self.session.waiting_for_interrupt:
                replies += self._feed(b"\x03")
            if not replies or not self.STOP_REPLY.fullmatch(replies[-1]):
                raise FuzzFailure(f"Ctrl-C after {payload[:40]!r} was answered {replies!r}")
        return replies

    def resume(self, payload: bytes = b"vCont;c") -> bytes | None:
        """A resumption GDB leaves running (`c`, `vCont;c`), as `request` sends it but without the Ctrl-C after
        it: None while the target runs (`stop` ends that), or the reply that came at once (a stop the target had
        pending, an error)."""
        replies = self._feed(encode_packet(payload, binary=True))
        if self.session.waiting_for_interrupt:
            return None
        if not replies:
            raise FuzzFailure(f"no answer to {payload[:40]!r}")
        return replies[-1]

    def stop(self) -> bytes:
        """The stop reply of the resumption `resume` left running: the target's own stop if it made one (the
        session's `poll`, as the server calls it when woken), else the answer to Ctrl-C."""
        replies = self._poll()
        if self.session.waiting_for_interrupt:
            replies += self._feed(b"\x03")
        if len(replies) != 1:
            raise FuzzFailure(f"a stop after a resumption was answered {replies!r}")
        return replies[0]

    # -- checks --

    def read_jiffies(self) -> int:
        replies = self.request(b"m%x,8" % self.jiffies)
        if len(replies) != 1 or not re.fullmatch(rb"[0-9a-f]{16}", replies[0]):
            raise FuzzFailure(f"m of jiffies answered {replies!r}")
        return int.from_bytes(bytes.fromhex(replies[0].decode()), "little")

    def health_check(self) -> int:
        """The next packets are served: leave any frame, read jiffies (a GDB retransmits once if it must)."""
        self.figures.health_checks += 1
        replies = self.request(b"QTFrame:ffffffff")
        if not replies:  # a damaged frame left the decoder mid-checksum: GDB retransmits after a NACK
            replies = self.request(b"QTFrame:ffffffff")
        if replies[-1:] != [b"OK"]:
            raise FuzzFailure(f"QTFrame:ffffffff answered {replies!r}")
        return self.read_jiffies()

    def recover(self, stub=None) -> None:
        """After a failure, which may be sticky: a new session, on a new stub (and kernel) when given one."""
        if stub is None:
            self.reconnect()
            return
        self.machine.shutdown()
        self.stub, self.machine = stub, stub.machine
        self.errors.machine = stub.machine
        if self.started:
            self.machine.start()
        self._connect()
        self.first_jiffies = self.read_jiffies()

    def _tidy(self) -> None:
        """Keep a long run fast: undo settings that only slow the kernel down, forget piles of tracepoints."""
        if self.session.closing or len(getattr(self.stub.target, "inserted", ())) > self.MAX_BREAKPOINTS:
            self.reconnect()
        if (self.machine.hz, self.machine.pace) != (self.hz, self.pace):
            self.machine.set_hz(self.hz)
            self.machine.set_pace(self.pace)
        if len(self.stub.tracer.definitions.tracepoints) > self.MAX_TRACEPOINTS:
            self.request(b"QTinit")

    # -- one input --

    def packet(self, payload: bytes, source: str = "") -> list[bytes]:
        """A fuzzed packet: it must be answered, and the session must go on serving."""
        self.figures.packets += 1
        self.figures.by_source[source] += 1
        replies = self.request(payload)
        if not replies:
            raise FuzzFailure(f"no answer to {payload[:200]!r}")
        final = replies[-1]
        if is_error_reply(final):
            self.figures.answered_error += 1
            self.figures.errors_by_code[final[:3].decode("latin-1")] += 1
            if final == b"E0f":
                raise FuzzFailure(f"internal error answering {payload[:200]!r}")
        elif final == b"":
            self.figures.answered_empty += 1
        else:
            self.figures.answered_ok += 1
        self._tidy()
        self.health_check()
        return replies

    def raw(self, data: bytes) -> None:
        """Bytes on the wire with any framing; the session must survive them and serve the next packet."""
        self.figures.frames_damaged += 1
        self._feed(data)
        if self.session.waiting_for_interrupt:
            self._feed(b"\x03")
        self._tidy()
        self.health_check()

    def kernel_alive(self, wait: float = 0.3) -> int:
        """jiffies advanced since the harness started (machine running) and the machine is neither crashed
        nor halted. Returns jiffies."""
        self._tidy()
        if self.stub.tracer.running:
            self.request(b"QTStop")
        if self.machine.control.stopped:  # the packets stopped it: it runs again once the debugger leaves
            self.reconnect()
        state = self.machine.stats(count=False).state
        if state.startswith(("crashed", "halted")):
            raise FuzzFailure(f"the kernel stopped: {state}; console:\n{self.machine.console_text()[-600:]}")
        deadline = time.monotonic() + max(wait, 2.0)
        jiffies = self.health_check()
        while self.started and jiffies <= self.first_jiffies:
            if time.monotonic() > deadline:
                raise FuzzFailure(f"jiffies stuck at {jiffies} (was {self.first_jiffies} at the start)")
            time.sleep(0.02)
            jiffies = self.health_check()
        return jiffies


#: CPUs of the fuzzed machine, as `serve` has by default
FUZZ_CPUS = 2


def build_stub(engine: str = "opt", cpus: int = FUZZ_CPUS):
    from ..app import Stub, StubConfig
    from ..machine import KernelImage, Machine

    machine = Machine(KernelImage.load(VMLINUX), cpus=cpus)
    return Stub(machine, StubConfig(engine=engine))
