"""The `printf` bytecode's format strings: parsing (verifier) and formatting (interpreter and native trap).

Only integer and string directives exist in agent printf (GDB compiles `dprintf`/`maint agent-printf` to it): the
verifier refuses anything else, and checks that the argument count in the bytecode matches the format, so a bad
format is a define-time error, never a hit-time surprise. Formatting is done in one place for every engine, so the
interpreter and the compiled code's printf trap print the same text.

A format is the bytes GDB put in the bytecode: for a dprintf, the text the user typed between the quotes, its C
escapes not read (breakpoint.c: parse_cmd_to_aexpr hands ax-gdb.c's gen_printf the source text). gdbserver's agent
printf reads them when it prints (ax.cc: ax_printf parses the format with gdbsupport/format.cc's format_pieces):
`read_escapes` does what it does, for the target that plays gdbserver (its breakpoint commands: stub/conditions.py).
KGTP has no printf op (gtp.c), so the tracer's printf prints the format as it came.

Pure: formats are parsed where bytecode is verified (verify.py says where), and text is formatted at a hit, on the
CPU thread (interp.py), or in a test's `Sandbox` on the test's thread.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass

_DIRECTIVE = re.compile(rb"%(?P<flags>[-+ #0]*)(?P<width>\d*)(?:\.(?P<prec>\d*))?(?P<len>hh|h|ll|l|z|j|t)?(?P<conv>.)?")
_CONVERSIONS = b"diuxXocsp"


@dataclass(frozen=True)
class Piece:
    text: bytes  # literal text, or the directive itself
    conv: str = ""  # "" for literal text
    flags: str = ""
    width: str = ""
    prec: str | None = None
    length: str = ""


class FormatError(ValueError):
    pass


#: the C escapes gdbsupport/format.cc's format_pieces reads in a format, and their characters (no other: no octal)
_ESCAPES = {ord("\\"): b"\\", ord("a"): b"\a", ord("b"): b"\b", ord("e"): b"\x1b", ord("f"): b"\f", ord("n"): b"\n",
            ord("r"): b"\r", ord("t"): b"\t", ord("v"): b"\v", ord('"'): b'"'}


@functools.lru_cache(maxsize=256)
def read_escapes(fmt: bytes) -> bytes:
    """`fmt` as gdbserver's agent printf reads it (gdbsupport/format.cc's format_pieces, without GDB's extensions):
    each escape of `_ESCAPES` becomes its character, the text ends at a `"` no backslash escapes (GDB sends none:
    its own parse ends the format there), and any other escape is a FormatError, as format_pieces' error()."""
    out = bytearray()
    at = 0
    while at < len(fmt):
        byte = fmt[at]
        if byte == ord('"'):
            break
        if byte != ord("\\"):
            out.append(byte)
            at += 1
            continue
        escaped = fmt[at + 1:at + 2]
        if not escaped or escaped[0] not in _ESCAPES:
            shown = escaped.decode("latin-1") if escaped else "(end of the format)"
            raise FormatError(f"Unrecognized escape character \\{shown} in format string.")
        out += _ESCAPES[escaped[0]]
        at += 2
    return bytes(out)


def parse_format(fmt: bytes) -> list[Piece]:
    """Split a format into literal pieces and directives; raises FormatError for unsupported directives."""
    pieces: list[Piece] = []
    pos = 0
    literal = b""
    while pos < len(fmt):
        i = fmt.find(b"%", pos)
        if i < 0:
            literal += fmt[pos:]
            break
        literal += fmt[pos:i]
        if fmt[i + 1 : i + 2] == b"%":
            literal += b"%"
            pos = i + 2
            continue
        m = _DIRECTIVE.match(fmt, i)
        assert m is not None
        conv = m.group("conv")
        if conv is None or conv not in _CONVERSIONS:
            raise FormatError(f"unsupported printf directive {m.group(0).decode('latin-1')!r}")
        if literal:
            pieces.append(Piece(literal))
            literal = b""
        prec = m.group("prec")
        pieces.append(
            Piece(
                m.group(0),
                conv.decode(),
                m.group("flags").decode(),
                m.group("width").decode(),
                prec.decode() if prec is not None else None,
                (m.group("len") or b"").decode(),
            )
        )
        pos = m.end()
    if literal:
        pieces.append(Piece(literal))
    return pieces


def count_args(fmt: bytes) -> int:
    return sum(1 for p in parse_format(fmt) if p.conv)


def _signed(value: int, bits: int) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def format_printf(fmt: bytes, args: tuple[int, ...] | list[int], read_memory: Callable[[int, int], bytes]) -> str:
    """C-like formatting of 64-bit stack values. `%s` reads a NUL-terminated string (at most 4096 bytes)."""
    out: list[str] = []
    it = iter(args)
    for piece in parse_format(fmt):
        if not piece.conv:
            out.append(piece.text.decode("latin-1"))
            continue
        value = next(it, 0) & (2**64 - 1)
        bits = 64 if piece.length in ("l", "ll", "z", "j", "t") else {"hh": 8, "h": 16}.get(piece.length, 32)
        spec = "%" + piece.flags + piece.width + (f".{piece.prec}" if piece.prec is not None else "")
        conv = piece.conv
        if conv in "di":
            out.append((spec + "d") % _signed(value, bits))
        elif conv in "uxXo":
            number = value & ((1 << bits) - 1)
            text = (spec.replace("#", "") + ("d" if conv == "u" else conv)) % number
            if "#" in piece.flags and number:
                text = ("0x" if conv == "x" else "0X" if conv == "X" else "0" if conv == "o" else "") + text.lstrip()
            out.append(text)
        elif conv == "c":
            out.append((spec + "c") % chr(value & 0xFF))
        elif conv == "p":
            out.append(((spec + "s") % (f"0x{value:x}" if value else "(nil)")))
        else:  # s
            out.append((spec + "s") % _read_string(value, read_memory))
    return "".join(out)


def _read_string(addr: int, read_memory: Callable[[int, int], bytes]) -> str:
    if addr == 0:
        return "(null)"
    data = bytearray()
    try:
        while len(data) < 4096:
            byte = read_memory(addr + len(data), 1)
            if byte == b"\0":
                break
            data += byte
    except Exception:  # noqa: BLE001 - an unreadable string prints as what was read, then a marker
        return data.decode("latin-1") + f"<unreadable at 0x{addr + len(data):x}>"
    return data.decode("latin-1")
