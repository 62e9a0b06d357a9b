"""The fuzzer's inputs: generators of hostile RSP input, all driven by a `random.Random` so a campaign is
reproducible from its seed and the test suite can drive them from hypothesis.

Four kinds: structured packets for every packet class the dispatcher reaches (QTDP, QTDP:- and QTFrame with their
own grammars, `monitor` commands with shell-like arguments), mutations of the requests real GDB sent in
fixtures/transcripts, random bodies after a valid prefix, and damaged framing (bad checksums, escapes,
run-length counts, truncation, oversized packets). `Generator` picks one of them for each fuzzed packet.

Pure functions of their random source; they run on the thread of the campaign (fuzz.py) or of the test that
calls them.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..agent.opcodes import assemble
from ..client import TRANSCRIPTS
from ..rsp.codec import checksum, encode_packet
from ..rsp.packets.base import Packet
from .transcript import load

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
