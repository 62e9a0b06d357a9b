"""Static tracepoint data (`$_sdata`): the TRACE_EVENT entry built at a hit, and its TP_printk rendering.

At the hit the stub records the entry structure in binary (the thesis' §3.1 improvement on copying a string at
every hit): each field is assigned from the TP_ARGS, found in the registers the marker record names, exactly as
the event's TP_fast_assign would. What GDB reads as `$_sdata` is that entry rendered by the event's TP_printk
format, so `print $_sdata` reads like ftrace output; the rendering happens when GDB asks, not at the hit.

Pure: entries are built on the CPU thread at a hit, rendered on the server thread when GDB asks.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from typing import Protocol

from ...arch import amd64
from ...machine import FieldKind, Marker, MarkerField


class OwnEntry(Protocol):
    """A marker that builds and renders its `$_sdata` itself (a program's SDT probe: sdt.py)."""

    def entry(self, registers: list[int], read: Callable[[int, int], bytes | None]) -> bytes: ...

    def render(self, entry: bytes) -> str: ...

# register operand text as the compiler printed it -> (GDB register number, width in bytes)
_REGISTER_WIDTHS: dict[str, tuple[int, int]] = {}
for _index, _name in enumerate(("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp")):
    _base = _name[1:]
    _REGISTER_WIDTHS[_name] = (_index, 8)
    _REGISTER_WIDTHS["e" + _base] = (_index, 4)
    _REGISTER_WIDTHS[_base] = (_index, 2)
for _number in range(8, 16):
    _REGISTER_WIDTHS[f"r{_number}"] = (_number, 8)
    _REGISTER_WIDTHS[f"r{_number}d"] = (_number, 4)
    _REGISTER_WIDTHS[f"r{_number}w"] = (_number, 2)
    _REGISTER_WIDTHS[f"r{_number}b"] = (_number, 1)
for _low, _number in (("al", 0), ("bl", 1), ("cl", 2), ("dl", 3), ("sil", 4), ("dil", 5), ("bpl", 6), ("spl", 7)):
    _REGISTER_WIDTHS[_low] = (_number, 1)


class SdataError(ValueError):
    """A marker record the stub cannot interpret (an argument location that is not a register)."""


def argument_register(location: str) -> tuple[int, int]:
    """`%edi` -> (5, 4): the GDB register number holding a TP_ARG at the site, and the width the compiler used."""
    name = location.strip().lstrip("%")
    if name not in _REGISTER_WIDTHS:
        raise SdataError(f"argument location {location!r} is not a general register")
    return _REGISTER_WIDTHS[name]


def build_entry(marker: Marker | OwnEntry, registers: list[int], read: Callable[[int, int], bytes | None]) -> bytes:
    """The entry structure of `marker` at a hit with `registers` (GDB order); `read` returns None when memory
    cannot be read, and such a field is left zero (like a tracer reading through a NULL pointer). A program's
    SDT probe (sdt.py) builds its own: its arguments' values."""
    if not isinstance(marker, Marker):
        return marker.entry(registers, read)
    args = []
    for location in marker.arg_locations:
        number, width = argument_register(location)
        args.append(registers[number] & ((1 << (8 * width)) - 1))
    entry = bytearray(marker.entry_size)
    for field in marker.fields:
        entry[field.offset : field.offset + field.size] = _assign(field, args[field.arg], read)
    return bytes(entry)


def _assign(field: MarkerField, arg: int, read: Callable[[int, int], bytes | None]) -> bytes:
    size = field.size
    if field.kind is FieldKind.VALUE:
        return (arg & ((1 << (8 * size)) - 1)).to_bytes(size, "little")
    address = (arg + field.src_offset) & ((1 << 64) - 1)
    if field.kind is FieldKind.STRING:
        data = read(address, size - 1) or b""
        data = data.split(b"\0", 1)[0]
        return data.ljust(size, b"\0")
    data = read(address, size)
    return data if data is not None and len(data) == size else bytes(size)


_SPEC = re.compile(r"%(?P<flags>[-+ #0]*)(?P<width>\d*)(?:\.(?P<precision>\d+))?(?P<length>hh|h|ll|l|z|j|t)?"
                   r"(?P<conversion>[diouxXcsp%])")
_ENTRY_ARG = re.compile(r"^__entry->(\w+)(?:\[(\d+)\])?$|^__get_str\((\w+)\)$")


def render(marker: Marker | OwnEntry, entry: bytes) -> str:
    """The entry as TP_printk prints it: `counter1=5 counter2=4` (a program's SDT probe: as sdt.py renders it)."""
    if not isinstance(marker, Marker):
        return marker.render(entry)
    fields = {f.name: f for f in marker.fields}
    values = [_value(fields, entry, text) for text in split_top_level(marker.print_args)]
    out = []
    position = 0
    index = 0
    for match in _SPEC.finditer(marker.format):
        out.append(marker.format[position : match.start()])
        position = match.end()
        conversion = match.group("conversion")
        if conversion == "%":
            out.append("%")
            continue
        value = values[index] if index < len(values) else "?"
        index += 1
        out.append(_convert(match, value))
    out.append(marker.format[position:])
    return "".join(out)


def split_top_level(text: str) -> list[str]:
    """`a, b[1], f(x, y)` -> ["a", "b[1]", "f(x, y)"]: split at commas outside brackets and parentheses."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
            continue
        depth += ch in "([" and 1 or (ch in ")]" and -1 or 0)
        current.append(ch)
    if "".join(current).strip():
        parts.append("".join(current).strip())
    return parts


def _value(fields: dict[str, MarkerField], entry: bytes, text: str) -> int | str:
    match = _ENTRY_ARG.match(text)
    if not match:
        return "?"
    name = match.group(1) or match.group(3)
    field = fields.get(name)
    if field is None:
        return "?"
    raw = entry[field.offset : field.offset + field.size]
    if field.kind in (FieldKind.STRING,) or field.type.startswith("char["):
        return raw.split(b"\0", 1)[0].decode("latin-1")
    if match.group(2) is not None:  # an element of an array field
        count = int(field.type.split("[", 1)[1].rstrip("]")) if "[" in field.type else 1
        element = field.size // max(count, 1)
        start = int(match.group(2)) * element
        raw = raw[start : start + element]
    return int.from_bytes(raw, "little", signed=field.signed)


def _convert(spec: re.Match[str], value: int | str) -> str:
    conversion = spec.group("conversion")
    python = "%" + spec.group("flags") + spec.group("width")
    if spec.group("precision"):
        python += "." + spec.group("precision")
    if conversion == "s":
        return (python + "s") % (value if isinstance(value, str) else str(value))
    if isinstance(value, str):
        return value
    if conversion in "uxXo" and value < 0:  # an unsigned conversion of a signed field: C's reinterpretation
        bits = {"hh": 8, "h": 16, None: 32}.get(spec.group("length"), 64)
        value &= (1 << bits) - 1
    if conversion == "p":
        return "0x%x" % value
    if conversion == "c":
        return chr(value & 0xFF)
    return (python + {"i": "d", "u": "d"}.get(conversion, conversion)) % value


__all__ = ["SdataError", "argument_register", "build_entry", "render", "amd64"]
