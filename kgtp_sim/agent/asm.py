"""Native code assembly for the compilers: keystone templates assembled once, then copied and patched.

This is the thesis' scheme (§2.3.1) with keystone standing in for GCC's inline assembly: an instruction snippet is
written once in AT&T syntax with named holes (`{s32:value}`), assembled the first time it is used with a unique
magic number in each hole, and cached as bytes plus the offsets of the holes. Emitting a snippet is then a copy
and a few patched bytes, so compiling at `tstart` costs no keystone calls once the templates are warm.

Holes: `{s32:NAME}` 32-bit immediate or displacement that the CPU sign-extends, `{u32:NAME}` 32-bit immediate
that is zero-extended (e.g. `mov $imm, %r32`), `{u16:NAME}`, `{i64:NAME}` (movabs). Write every other immediate
in hex: this keystone reads `$11` as 0x11.

Jumps and calls between snippets (bytecode jump targets, error stubs, helpers) are not assembled: `CodeBuffer`
writes them as rel32 instructions and patches them when the layout is final (the thesis' two address tables).

Thread: any; the one keystone instance is used under a lock, and templates are cached for the process. In the stub
the compilers and the detours (kgtp_sim/tracing/patching/detour.py) assemble where a location is installed
(compile_naive.py says where); tests and `agent.measure` assemble on their own thread.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from keystone import Ks

_HOLE = re.compile(r"\{(s32|u32|u16|i64):(\w+)\}")
_WIDTH = {"s32": 4, "u32": 4, "u16": 2, "i64": 8}
_lock = threading.Lock()
_ks: Ks | None = None


def _keystone() -> Ks:
    """The assembler, made (and keystone loaded) on the first use: a server that never compiles never loads it."""
    global _ks
    if _ks is None:
        from keystone import KS_ARCH_X86, KS_MODE_64, KS_OPT_SYNTAX_ATT, Ks

        ks = Ks(KS_ARCH_X86, KS_MODE_64)
        ks.syntax = KS_OPT_SYNTAX_ATT
        _ks = ks
    return _ks


def assemble_text(text: str, base: int = 0) -> bytes:
    """Assemble AT&T text placed at `base` (labels and %rip operands depend on it). Raises ValueError with the
    text on failure, including the failures keystone reports only by returning no code (an immediate out of
    range, for one): half a detour must never reach the kernel."""
    from keystone import KsError

    with _lock:
        try:
            encoding, _ = _keystone().asm(text, base)
        except KsError as exc:
            raise ValueError(f"keystone cannot assemble {text!r}: {exc}") from None
    if encoding is None and any(line.strip() and not line.strip().endswith(":") for line in text.splitlines()):
        raise ValueError(f"keystone cannot assemble {text!r}")
    return bytes(encoding or b"")


@dataclass(frozen=True)
class Template:
    code: bytes
    holes: dict[str, tuple[int, str]]  # name -> (byte offset, kind)

    def instantiate(self, values: dict[str, int]) -> bytes:
        out = bytearray(self.code)
        for name, (offset, kind) in self.holes.items():
            value = values[name]
            width = _WIDTH[kind]
            if kind == "s32" and not -(2**31) <= value < 2**31:
                raise ValueError(f"{name}={value:#x} does not fit a sign-extended imm32")
            if kind in ("u32", "u16") and not 0 <= value < 1 << (8 * width):
                raise ValueError(f"{name}={value:#x} does not fit {kind}")
            out[offset : offset + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
        return bytes(out)


def _magic(kind: str, index: int, attempt: int) -> int:
    if kind == "i64":
        return 0x7A5A_3C00_0000_0000 + (attempt << 40) + index + 0x1111
    if kind == "u16":
        return 0x5A00 + (attempt << 8) % 0x2000 + index + 0x21
    return 0x7A5A_0000 + (attempt << 12) + index + 0x111  # > 0x7f: keystone must use the 32-bit form


@lru_cache(maxsize=None)
def template(text: str) -> Template:
    """The cached template for `text` (see the module doc for the hole syntax)."""
    holes = [(m.group(1), m.group(2)) for m in _HOLE.finditer(text)]
    for attempt in range(8):
        values = {name: _magic(kind, i, attempt) for i, (kind, name) in enumerate(holes)}
        code = assemble_text(_HOLE.sub(lambda m: hex(values[m.group(2)]), text))
        found: dict[str, tuple[int, str]] = {}
        ok = True
        for kind, name in holes:
            pattern = values[name].to_bytes(_WIDTH[kind], "little")
            if code.count(pattern) != 1:
                ok = False
                break
            found[name] = (code.index(pattern), kind)
        if ok:
            tpl = Template(code, found)
            _check_holes(text, tpl, values)
            return tpl
    raise ValueError(f"cannot locate the holes of {text!r}")


def _check_holes(text: str, tpl: Template, magic: dict[str, int]) -> None:
    """Re-assemble with other values (sign bit set) and compare with the patched template: a hole must be the
    whole immediate, not the low part of a wider one (keystone turns `mov $imm,%rax` into movabs, for one)."""
    other = {}
    for name, (_, kind) in tpl.holes.items():
        if kind == "s32":
            other[name] = -magic[name]
        elif kind == "u32":
            other[name] = magic[name] | 0x8000_0000
        elif kind == "u16":
            other[name] = magic[name] | 0x8000
        else:
            other[name] = magic[name] | (1 << 63)
    direct = assemble_text(_HOLE.sub(lambda m: hex(other[m.group(2)]) if other[m.group(2)] >= 0 else f"-{hex(-other[m.group(2)])}", text))
    if direct != tpl.instantiate(other):
        raise ValueError(f"a hole of {text!r} is not a plain immediate/displacement of its size")


_CC = {"o": 0, "no": 1, "b": 2, "ae": 3, "e": 4, "ne": 5, "be": 6, "a": 7, "s": 8, "ns": 9, "l": 12, "ge": 13, "le": 14, "g": 15}
INVERSE_CC = {"e": "ne", "ne": "e", "l": "ge", "ge": "l", "le": "g", "g": "le", "b": "ae", "ae": "b", "be": "a", "a": "be", "s": "ns", "ns": "s"}
#: Condition for `b OP a` when `a OP b` is `cc` (operands swapped).
SWAPPED_CC = {"e": "e", "ne": "ne", "l": "g", "g": "l", "le": "ge", "ge": "le", "b": "a", "a": "b", "be": "ae", "ae": "be"}


class CodeBuffer:
    """Native code under construction: snippets, labels, and rel32 jumps patched by `finish`."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.labels: dict[str, int] = {}
        self._fixups: list[tuple[int, str]] = []  # (offset of the rel32 field, label)

    @property
    def here(self) -> int:
        return len(self.buf)

    def emit(self, text: str, **values: int) -> None:
        self.buf += template(text).instantiate(values)

    def raw(self, data: bytes) -> None:
        self.buf += data

    def label(self, name: str) -> None:
        if name in self.labels:
            raise ValueError(f"label {name} defined twice")
        self.labels[name] = len(self.buf)

    def _rel32(self, opcode: bytes, label: str) -> None:
        self.buf += opcode
        self._fixups.append((len(self.buf), label))
        self.buf += b"\0\0\0\0"

    def jmp(self, label: str) -> None:
        self._rel32(b"\xe9", label)

    def call(self, label: str) -> None:
        self._rel32(b"\xe8", label)

    def jcc(self, cc: str, label: str) -> None:
        self._rel32(bytes((0x0F, 0x80 + _CC[cc])), label)

    def lea_rsi(self, label: str) -> None:
        """`lea label(%rip),%rsi` (printf passes its format this way)."""
        self._rel32(b"\x48\x8d\x35", label)

    def append(self, other: CodeBuffer) -> None:
        """Append another buffer (labels and pending jumps included), e.g. a body after its prologue."""
        shift = len(self.buf)
        self.buf += other.buf
        for name, at in other.labels.items():
            if name in self.labels:
                raise ValueError(f"label {name} defined twice")
            self.labels[name] = at + shift
        self._fixups += [(at + shift, label) for at, label in other._fixups]

    def finish(self) -> bytes:
        """Patch every jump; the result is position-independent (all references are relative)."""
        for field_at, label in self._fixups:
            target = self.labels[label]
            self.buf[field_at : field_at + 4] = (target - (field_at + 4)).to_bytes(4, "little", signed=True)
        return bytes(self.buf)
