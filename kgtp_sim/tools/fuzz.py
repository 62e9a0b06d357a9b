"""Fuzzing the stub's protocol layer: generators of hostile RSP input, a harness that checks every answer, and a
time-bounded campaign (`scripts/fuzz [--seconds N] [--seed S]`).

The harness drives a real `kgtp_sim.app.Stub` in-process (its dispatcher, handlers, tracer and kernel, with the
machine running) through a `Session`, exactly the object the TCP server feeds. After every fuzzed packet it
checks that:

- the packet got an answer: `E..`, empty, or a reply (a `c` is answered by the stop the kernel made meanwhile, at
  a breakpoint, or once Ctrl-C follows, as GDB does it);
- no handler failed (the dispatcher's last-resort guard answers `E0f` and logs a traceback: that is a crash);
- the session still serves: `QTFrame:ffffffff` answers `OK` and `m<jiffies>,8` answers 8 bytes of hex;
- the kernel is alive (checked at the end: jiffies advanced, the machine neither crashed nor halted; a machine the
  packets stopped, breakpoints and `monitor stop` being fuzzed too, runs again once the session leaves, as after
  a GDB).

Inputs come from four generators, all driven by a `random.Random` so a campaign is reproducible from its seed
and the test suite can drive them from hypothesis: structured packets for every packet class the dispatcher
reaches (QTDP and QTFrame with their own grammars), mutations of the requests real GDB sent in
fixtures/transcripts, random bodies after a valid prefix, and damaged framing (bad checksums, escapes,
run-length counts, truncation, oversized packets).
"""

from __future__ import annotations

import argparse
import logging
import random
import re
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..agent.opcodes import assemble
from ..client import TRANSCRIPTS, VMLINUX
from ..rsp.codec import Decoder, EventKind, checksum, encode_packet
from ..rsp.packets.base import Packet
from .transcript import load

_HEX = b"0123456789abcdef"
_SEPARATORS = b":,;=-"
INTERESTING = (
    0, 1, 2, 7, 0x7F, 0x80, 0xFF, 0x100, 0x3FFF, 0x4000, 0x4001, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000,
    0xFFFFFFFE, 0xFFFFFFFF, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 1 << 64, (1 << 64) + 1, 1 << 80,
    (1 << 128) - 1,
)

# Bytecode the tracer must survive: loops, faults, deep stacks, missing variables, undecodable bytes.
HOSTILE_BYTECODE = tuple(
    assemble(text) if isinstance(text, str) else text
    for text in (
        "const8 1; if_goto 0; const8 1; end",  # loops until the budget
        "reg 5; const8 0; div_signed; end",
        "const64 0x8000000000000000; const8 0xff; ext 8; div_signed; end",
        "const8 0x10; ref64; end",  # unmapped
        "const8 0x10; const8 8; trace; const8 1; end",
        "const64 0xffffffff81004208; const32 0xffffffff; trace; const8 1; end",  # 4 GiB
        "getv 0x999; end",
        "const8 1; setv 0x999; end",
        "const8 1; " * 70 + "end",  # too deep
        "const8 1; goto 1; end",
        "reg 0x999; end",
        "reg 5; const8 1; bit_and; end",  # benign: counter1 odd
        "const8 1; end",
        b"\xff\x27",
        b"\x24\x00",
        b"",
    )
)


# ---- seeds -------------------------------------------------------------------------------------------------


def seed_packets(directory: Path = TRANSCRIPTS) -> list[bytes]:
    """Every distinct request real GDB sent in the recorded transcripts."""
    seen: dict[bytes, None] = {}
    for path in sorted(directory.glob("*.rsp")):
        for exchange in load(path):
            seen.setdefault(exchange.request, None)
    return list(seen)


def reachable_packet_classes(dispatcher) -> list[type[Packet]]:
    """Every packet class the dispatcher routes to a handler (qSupported included)."""
    return sorted(dispatcher.table, key=lambda c: c.PREFIX)


# ---- number, text and bytecode generators ------------------------------------------------------------------


@dataclass
class Vocabulary:
    """What the generators draw addresses from: functions of the kernel (and bytes just inside them)."""

    functions: list[tuple[int, int]] = field(default_factory=list)  # (start, end)
    data: list[int] = field(default_factory=list)

    @classmethod
    def from_image(cls, image) -> Vocabulary:
        functions, data = [], []
        for symbol in image.symbols.values():
            if symbol.type == "FUNC" and symbol.size:
                functions.append((symbol.address, symbol.address + symbol.size))
            elif symbol.type == "OBJECT":
                data.append(symbol.address)
        return cls(sorted(functions), sorted(data))


def number(rng: random.Random, vocab: Vocabulary | None = None) -> int:
    roll = rng.random()
    if roll < 0.35:
        return rng.choice(INTERESTING)
    if roll < 0.55 and vocab is not None and vocab.functions:
        start, end = rng.choice(vocab.functions)
        return start if rng.random() < 0.5 else rng.randrange(start, end)
    if roll < 0.65 and vocab is not None and vocab.data:
        return rng.choice(vocab.data) + rng.choice((0, 0, 1, 8, 0x1000))
    if roll < 0.8:
        return rng.randrange(0, 0x100)
    return rng.getrandbits(rng.choice((8, 16, 32, 48, 64, 72, 100)))


def hex_number(rng: random.Random, vocab: Vocabulary | None = None) -> bytes:
    """A number as GDB writes it, or a damaged one: leading zeros, upper case, a sign, overflow, junk."""
    value = number(rng, vocab)
    text = b"%x" % value
    roll = rng.random()
    if roll < 0.08:
        text = b"0" * rng.randrange(1, 40) + text
    elif roll < 0.14:
        text = text.upper()
    elif roll < 0.2:
        text = b"-" + text
    elif roll < 0.26:
        text = bytes(rng.choice(b"ghxyz G!@ \x00\xff") for _ in range(rng.randrange(1, 4))) + text
    elif roll < 0.3:
        text = b""
    elif roll < 0.33:
        text = b"f" * rng.randrange(17, 70)
    return text


def hex_text(rng: random.Random) -> bytes:
    """Hex-encoded text (names, notes, monitor commands), sometimes odd-length or not hex at all."""
    data = random_bytes(rng, 24)
    text = data.hex().encode()
    roll = rng.random()
    if roll < 0.1:
        text = text[:-1]
    elif roll < 0.18:
        text = text.replace(b"a", b"z")
    elif roll < 0.22:
        text += b" "
    return text


def random_bytes(rng: random.Random, limit: int = 64) -> bytes:
    size = rng.randrange(0, limit + 1)
    if rng.random() < 0.5:
        return bytes(rng.getrandbits(8) for _ in range(size))
    return bytes(rng.choice(b"0123456789abcdefABCDEF:,;-=XMRLSFEDT$#}*\x03") for _ in range(size))


def bytecode(rng: random.Random) -> bytes:
    roll = rng.random()
    if roll < 0.5:
        return rng.choice(HOSTILE_BYTECODE)
    if roll < 0.8:  # a random op sequence ending in `end` (most will be refused by the verifier)
        ops = bytes(rng.choice(b"\x02\x03\x04\x05\x0c\x0d\x0e\x0f\x16\x17\x1a\x20\x21\x22\x23\x24\x26\x28\x29\x2c"
                               b"\x2d\x2e\x2f\x32\x33") for _ in range(rng.randrange(1, 12)))
        return ops + random_bytes(rng, 6) + b"\x27"
    return random_bytes(rng, 40)


def agent_expression(rng: random.Random) -> bytes:
    """`X<len>,<hex>` with the length right, wrong, or absurd."""
    code = bytecode(rng)
    length = len(code)
    roll = rng.random()
    if roll < 0.15:
        length = rng.choice(INTERESTING)
    elif roll < 0.3:
        length = max(0, length + rng.choice((-2, -1, 1, 2)))
    body = code.hex().encode()
    if rng.random() < 0.1:
        body = body[:-1]
    return b"X%x," % length + body


# ---- structured packets ------------------------------------------------------------------------------------


def qtdp(rng: random.Random, vocab: Vocabulary) -> bytes:
    """`QTDP:<n>:<addr>:<E|D>:<step>:<pass>[:F<len>][:S][:X<len>,<bytecode>][-]`, right and wrong."""
    fields = [hex_number(rng, vocab), hex_number(rng, vocab),
              rng.choice((b"E", b"E", b"D", b"", b"e", b"X", b"ED")),
              b"0" if rng.random() < 0.7 else hex_number(rng), b"0" if rng.random() < 0.6 else hex_number(rng)]
    for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
        fields.append(rng.choice((b"F" + hex_number(rng), b"S", agent_expression(rng), random_bytes(rng, 8))))
    if rng.random() < 0.1:
        del fields[rng.randrange(len(fields))]
    return b"QTDP:" + b":".join(fields) + (b"-" if rng.random() < 0.4 else b"")


def action(rng: random.Random, vocab: Vocabulary) -> bytes:
    roll = rng.random()
    if roll < 0.25:
        digits = rng.choice((b"ff", b"01ffff", b"ffffffffff", b"f", b"", b"f" * rng.randrange(1, 600), b"zz"))
        return b"R" + digits
    if roll < 0.55:
        base = rng.choice((b"-1", b"7", b"0", b"1f", b"-2", b"ffffffff", hex_number(rng)))
        return b"M%s,%s,%s" % (base, hex_number(rng, vocab), hex_number(rng))
    if roll < 0.85:
        return agent_expression(rng)
    if roll < 0.92:
        return b"L"
    return random_bytes(rng, 6)


def qtdp_actions(rng: random.Random, vocab: Vocabulary) -> bytes:
    actions = b"".join(action(rng, vocab) for _ in range(rng.randrange(0, 5)))
    return (b"QTDP:-%s:%s:%s%s%s" % (hex_number(rng, vocab), hex_number(rng, vocab), b"S" if rng.random() < 0.2 else b"",
                                    actions, b"-" if rng.random() < 0.3 else b""))


def qtframe(rng: random.Random, vocab: Vocabulary) -> bytes:
    roll = rng.random()
    if roll < 0.3:
        body = hex_number(rng)
    elif roll < 0.4:
        body = rng.choice((b"ffffffff", b"-1", b"0", b"7fffffff", b"80000000", b"100000000"))
    elif roll < 0.55:
        body = b"pc:" + hex_number(rng, vocab)
    elif roll < 0.7:
        body = b"tdp:" + hex_number(rng)
    elif roll < 0.85:
        body = rng.choice((b"range:", b"outside:")) + hex_number(rng, vocab) + b":" + hex_number(rng, vocab)
    else:
        body = rng.choice((b"pc", b"tdp:", b"range:1", b"outside::", b"", b":")) + random_bytes(rng, 12)
    if rng.random() < 0.1:
        body += b":" + hex_number(rng)
    return b"QTFrame:" + body


MONITOR_WORDS = (
    "help", "stats", "hz", "pace", "console", "engine", "probes", "frames", "sdata", "stop", "go", "shell", "python",
    "source",
    "!", "pipe", "eval", "exec", "import", "open", "cat", "load",
)
MONITOR_ARGS = (
    "ls", "/etc/passwd", "../../etc/passwd", "$(id)", "`id`", "; id", "| id", "&& id", "print(open('/etc/passwd').read())",
    "__import__('os').system('id')", "opt", "interp", "naive", "0", "-1", "99999999999999999999", "0x10", "1e3",
    "'unterminated", '"', "\\", "\x00", "a" * 300, "%s%s%n", "\u202e\u0000", "20", "100", "0 5",
)


def monitor(rng: random.Random) -> bytes:
    words = [rng.choice(MONITOR_WORDS)] + [rng.choice(MONITOR_ARGS) for _ in range(rng.randrange(0, 3))]
    text = " ".join(words).encode("utf-8", "surrogateescape")
    return b"qRcmd," + text.hex().encode()


def generic(rng: random.Random, packet_class: type[Packet], vocab: Vocabulary) -> bytes:
    """The class's prefix followed by fields in its style, or by nothing, or by noise."""
    roll = rng.random()
    if roll < 0.15 or packet_class.EXACT and roll < 0.5:
        body = b""
    elif roll < 0.45:
        body = random_bytes(rng, 48)
    else:
        parts = []
        for _ in range(rng.randrange(1, 6)):
            kind = rng.random()
            parts.append(hex_number(rng, vocab) if kind < 0.6 else hex_text(rng) if kind < 0.8 else random_bytes(rng, 8))
        body = b""
        for part in parts:
            body += part + bytes([rng.choice(_SEPARATORS)])
        body = body[:-1]
        if rng.random() < 0.2:
            body = body[: rng.randrange(len(body) + 1)]
    return packet_class.PREFIX + body


def structured(rng: random.Random, packet_class: type[Packet], vocab: Vocabulary) -> bytes:
    prefix = packet_class.PREFIX
    if prefix == b"QTDP:":
        return qtdp(rng, vocab)
    if prefix == b"QTDP:-":
        return qtdp_actions(rng, vocab)
    if prefix.startswith(b"QTFrame:"):
        return qtframe(rng, vocab) if rng.random() < 0.5 else generic(rng, packet_class, vocab)
    if prefix == b"qRcmd,":
        return monitor(rng)
    return generic(rng, packet_class, vocab)


# ---- mutations of real GDB packets -------------------------------------------------------------------------


def _hex_runs(data: bytes) -> list[tuple[int, int]]:
    return [m.span() for m in re.finditer(rb"[0-9a-fA-F]+", data)]


def mutate(rng: random.Random, packet: bytes, seeds: list[bytes]) -> bytes:
    data = bytearray(packet)
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4))):
        op = rng.randrange(11)
        at = rng.randrange(len(data) + 1) if data else 0
        if op == 0 and data:  # flip a byte
            data[min(at, len(data) - 1)] = rng.getrandbits(8)
        elif op == 1 and data:  # a protocol-special byte
            data[min(at, len(data) - 1)] = rng.choice(b":,;-$#}*\x00\xff\x03+")
        elif op == 2:
            data[at:at] = random_bytes(rng, 8)
        elif op == 3 and data:
            end = min(len(data), at + rng.randrange(1, 16))
            del data[at:end]
        elif op == 4 and data:
            end = min(len(data), at + rng.randrange(1, 32))
            data[at:at] = data[at:end] * rng.randrange(1, 4)
        elif op == 5:
            del data[at:]
        elif op in (6, 7):  # a number: overflowing, or not a number
            runs = _hex_runs(bytes(data))
            if runs:
                lo, hi = rng.choice(runs)
                data[lo:hi] = hex_number(rng) if op == 6 else bytes(rng.choice(b"ghijkz -+") for _ in range(hi - lo))
        elif op == 8 and seeds:  # splice two real packets
            other = rng.choice(seeds)
            data = data[:at] + other[rng.randrange(len(other) + 1) :]
        elif op == 9:
            separators = [i for i, b in enumerate(data) if b in _SEPARATORS]
            if separators:
                data[rng.choice(separators)] = rng.choice(_SEPARATORS)
        elif op == 10 and data and len(data) < 4096:
            data = data * rng.randrange(2, 5)
    return bytes(data)


# ---- damaged framing ---------------------------------------------------------------------------------------


def damaged_frame(rng: random.Random, payload: bytes) -> bytes:
    """One packet on the wire, framed correctly or not."""
    good = encode_packet(payload, binary=True)
    roll = rng.randrange(10)
    if roll == 0:  # wrong checksum
        return good[:-2] + b"%02x" % ((checksum(good[1:-3]) + rng.randrange(1, 256)) & 0xFF)
    if roll == 1:  # checksum not hex
        return good[:-2] + bytes(rng.choice(b"zZ-$ \x00") for _ in range(2))
    if roll == 2:  # escape at the end of the body
        body = good[1:-3] + b"}"
        return b"$" + body + b"#%02x" % checksum(body)
    if roll == 3:  # run-length marker without a byte before it, or with a bad count
        body = rng.choice((b"*", b"a*", b"a*\x00", b"a* ", b"a*$")) + good[1:-3]
        return b"$" + body + b"#%02x" % checksum(body)
    if roll == 4:  # cut anywhere
        return good[: rng.randrange(len(good))]
    if roll == 5:  # noise before
        return random_bytes(rng, 16).replace(b"$", b"") + good
    if roll == 6:  # a second packet starts before this one ends
        return good[: rng.randrange(1, len(good))] + good
    if roll == 7:  # valid run-length encoding of a repeated byte
        body = good[1:-3] + b"0* "
        return b"$" + body + b"#%02x" % checksum(body)
    if roll == 8:  # ack/nack/interrupt bytes around it
        return bytes(rng.choice(b"+-\x03") for _ in range(rng.randrange(1, 4))) + good
    return good


def oversized(rng: random.Random, limit: int) -> bytes:
    """A packet that never ends within `limit` bytes."""
    return b"$" + bytes(rng.choice(b"0123456789abcdef,:") for _ in range(limit + rng.randrange(1, 64)))


# ---- one fuzzed packet ---------------------------------------------------------------------------------------


@dataclass
class Generator:
    classes: list[type[Packet]]
    seeds: list[bytes]
    vocab: Vocabulary

    def packet(self, rng: random.Random) -> tuple[str, bytes]:
        """(how it was made, payload)."""
        roll = rng.random()
        if roll < 0.35:
            return "mutation", mutate(rng, rng.choice(self.seeds), self.seeds)
        if roll < 0.55:
            prefix = rng.choice((b"QTDP:", b"QTDP:-", b"QTFrame:"))
            cls = next(c for c in self.classes if c.PREFIX == prefix)
            return "qtdp/qtframe", structured(rng, cls, self.vocab)
        if roll < 0.92:
            return "structured", structured(rng, rng.choice(self.classes), self.vocab)
        return "random", random_bytes(rng, 80)


# ---- the harness ---------------------------------------------------------------------------------------------


class FuzzFailure(AssertionError):
    """The stub did something it must never do; the message holds a reproducer."""


class _ErrorLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
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
        self.errors = _ErrorLog()
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
        before = len(self.errors.records)
        try:
            out = self.session.receive(data)
        except Exception as error:  # noqa: BLE001 - exactly what must never happen
            raise FuzzFailure(f"exception escaped the session: {type(error).__name__}: {error}") from error
        if len(self.errors.records) > before:
            record = self.errors.records[-1]
            where = ""
            if record.exc_info and record.exc_info[2] is not None:
                frame = traceback.extract_tb(record.exc_info[2])[-1]
                where = f" at {Path(frame.filename).name}:{frame.lineno} ({frame.line})"
            raise FuzzFailure(f"the stub logged an error: {record.name}: {record.getMessage()}"
                              + (f" ({record.exc_info[1]!r}{where})" if record.exc_info else ""))
        return [e.payload for e in Decoder().feed(out) if e.kind is EventKind.PACKET]

    def request(self, payload: bytes) -> list[bytes]:
        """Send one well-framed packet; return every packet the stub sent back for it."""
        replies = self._feed(encode_packet(payload, binary=True))
        if self.session.waiting_for_interrupt:  # `c`: the kernel stopped meanwhile, or the user presses Ctrl-C
            replies += [e.payload for e in Decoder().feed(self.session.poll()) if e.kind is EventKind.PACKET]
            if self.session.waiting_for_interrupt:
                replies += self._feed(b"\x03")
            if not replies or not self.STOP_REPLY.fullmatch(replies[-1]):
                raise FuzzFailure(f"Ctrl-C after {payload[:40]!r} was answered {replies!r}")
        return replies

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
        if self.started:
            self.machine.start()
        self._connect()
        self.first_jiffies = self.read_jiffies()

    def _tidy(self) -> None:
        """Keep a long run fast: undo settings that only slow the kernel down, forget piles of tracepoints."""
        if self.session.closing or len(self.stub.target.inserted) > self.MAX_BREAKPOINTS:
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


# ---- the campaign ----------------------------------------------------------------------------------------------


def signature(failure: str) -> str:
    """A failure's kind, with the numbers that vary between occurrences taken out."""
    return re.sub(r"0x[0-9a-f]+|\d+", "N", failure.split(" answering ")[0])[:160]


@dataclass
class Failure:
    message: str
    history: list[tuple[str, bytes]]  # the inputs that led to it, oldest first (state carries over)
    count: int = 1


def campaign(seconds: float, seed: int, report: Callable[[str], None] = print,
             dump: Path | None = None) -> tuple[Figures, float, list[Failure]]:
    stub = build_stub()
    harness = Harness(stub)
    generator = Generator(reachable_packet_classes(stub.dispatcher), seed_packets(),
                          Vocabulary.from_image(stub.machine.image))
    rng = random.Random(seed)
    failures: dict[str, Failure] = {}
    history: list[tuple[str, bytes]] = []
    since_rebuild: list[tuple[str, bytes]] = []  # everything the current stub saw: a replayable reproducer
    started = time.monotonic()
    next_report = started + 10

    def failed(message: str) -> None:
        harness.figures.crashes += 1
        key = signature(message)
        if key in failures:
            failures[key].count += 1
        else:
            failures[key] = Failure(message, list(history))
            report(f"FAILURE: {message}")
            if dump is not None:
                dump.mkdir(parents=True, exist_ok=True)
                path = dump / f"failure-{len(failures)}.txt"
                path.write_text(f"# {message}\n" + "".join(f"{src} {data.hex()}\n" for src, data in since_rebuild))
                report(f"  reproducer: {path} ({len(since_rebuild)} inputs; replay with --replay)")

    try:
        while time.monotonic() - started < seconds:
            source, payload = generator.packet(rng)
            try:
                if rng.random() < 0.85:
                    history.append((source, payload))
                    since_rebuild.append((source, payload))
                    harness.packet(payload, source)
                else:
                    wire = damaged_frame(rng, payload) if rng.random() < 0.9 else oversized(rng, 1 << 16)
                    history.append(("wire", wire))
                    since_rebuild.append(("wire", wire))
                    harness.raw(wire)
            except FuzzFailure as failure:
                failed(str(failure))
                harness.recover(build_stub())
                since_rebuild.clear()
            del history[:-40]
            if time.monotonic() >= next_report:
                next_report += 10
                f = harness.figures
                report(f"  {time.monotonic() - started:6.0f}s  packets {f.packets}  errors {f.answered_error}  "
                       f"crashes {f.crashes} ({len(failures)} kinds)")
        try:
            final_jiffies = harness.kernel_alive()
        except FuzzFailure as failure:
            failed(str(failure))
            final_jiffies = -1
        harness.figures.by_source["jiffies advanced"] = final_jiffies - harness.first_jiffies
    finally:
        harness.close()
        harness.machine.shutdown()
    return harness.figures, time.monotonic() - started, list(failures.values())


def replay(path: Path, report: Callable[[str], None] = print) -> str | None:
    """Feed a dumped input history to a fresh stub; returns the first failure (None if it did not recur)."""
    inputs = []
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            source, data = line.split(" ", 1)
            inputs.append((source, bytes.fromhex(data)))
    stub = build_stub()
    harness = Harness(stub)
    try:
        for index, (source, data) in enumerate(inputs):
            try:
                harness.raw(data) if source == "wire" else harness.packet(data, source)
            except FuzzFailure as failure:
                report(f"input {index} of {len(inputs)} ({source} {data[:120]!r}): {failure}")
                return str(failure)
        return None
    finally:
        harness.close()
        harness.machine.shutdown()


def format_figures(figures: Figures, elapsed: float, seed: int) -> str:
    f = figures
    lines = [
        f"fuzz campaign: seed {seed}, {elapsed:.1f} s",
        f"  packets sent        {f.packets}  ({f.packets / max(elapsed, 1e-9):.0f}/s)",
        f"  answered OK/data    {f.answered_ok}",
        f"  answered E..        {f.answered_error}  ({', '.join(f'{k} {v}' for k, v in f.errors_by_code.most_common())})",
        f"  answered empty      {f.answered_empty}",
        f"  damaged frames      {f.frames_damaged}",
        f"  health checks       {f.health_checks}",
        f"  reconnects          {f.reconnects}",
        f"  by source           {', '.join(f'{k} {v}' for k, v in f.by_source.items() if k != 'jiffies advanced')}",
        f"  jiffies advanced    {f.by_source.get('jiffies advanced', 0)}",
        f"  crashes             {f.crashes}",
    ]
    return "\n".join(lines)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180, help="how long to run (default: 180)")
    parser.add_argument("--seed", type=int, default=None, help="campaign seed (default: random, printed)")
    parser.add_argument("--history", type=int, default=12, help="inputs shown before each failure (default: 12)")
    parser.add_argument("--dump", type=Path, default=None, help="write a replayable reproducer per failure kind here")
    parser.add_argument("--replay", type=Path, default=None, help="replay a reproducer written by --dump and exit")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.replay is not None:
        logging.getLogger().addHandler(logging.NullHandler())
        failure = replay(args.replay)
        print("replay: " + ("did not fail" if failure is None else "failed"))
        return 1 if failure else 0
    seed = args.seed if args.seed is not None else random.SystemRandom().getrandbits(32)
    logging.getLogger().addHandler(logging.NullHandler())  # failures are caught and reported by the harness
    print(f"fuzz: {args.seconds:.0f} s against an in-process stub with a running kernel (seed {seed})", flush=True)
    figures, elapsed, failures = campaign(args.seconds, seed, dump=args.dump)
    print(format_figures(figures, elapsed, seed))
    for failure in failures:
        print(f"\n{failure.count} x {failure.message}\n  the last inputs before it (oldest first):")
        for source, payload in failure.history[-args.history:]:
            print(f"    {source:12} {payload[:160]!r}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
