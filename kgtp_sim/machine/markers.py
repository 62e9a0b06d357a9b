"""The kernel's static tracepoint table (section `kgtp_markers`), decoded into frozen dataclasses.

The binary layout is defined, with the reasons behind it, in `fixtures/kernel/include/trace_event.h`; this module
is its only reader. A marker tells the tracer where the 5-byte NOP is, which register holds each TP_ARG at that
site, and how to build the event's entry from those arguments, so an enabled static tracepoint never runs kernel
code to collect its data.

Pure: the table is parsed once while the kernel image loads (image.py, on the loading thread); the frozen markers
are then read by any thread.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Callable

from .errors import KernelImageError

#: The instruction every marker site holds until a tracer patches it: `nopl 0x0(%rax,%rax,1)`.
SITE_NOP = bytes.fromhex("0f1f440000")

_RECORD = struct.Struct("<QQQ")  # site, event, locations
_EVENT = struct.Struct("<QQQQQQIHHQ")  # system name format print_args proto args entry_size nr_fields reserved fields
_FIELD = struct.Struct("<QQHHBBBBII")  # name type offset size is_signed kind arg reserved src_offset reserved2


class FieldKind(enum.IntEnum):
    """How an entry field is assigned from the TP_ARGS (A = the argument's value)."""

    VALUE = 0  #: the field is A, truncated to the field's size
    LOAD = 1  #: the field is the `size` bytes at A + src_offset
    ARRAY = 2  #: `size` bytes copied from A + src_offset
    STRING = 3  #: NUL-terminated copy from A + src_offset, at most size - 1 bytes, NUL-terminated


@dataclass(frozen=True)
class MarkerField:
    """One member of an event's entry structure and where its value comes from."""

    name: str
    type: str  #: C type text, e.g. "int", "unsigned long", "char[16]"
    offset: int  #: in the entry
    size: int
    signed: bool  #: of the scalar, or of an array's elements
    kind: FieldKind
    arg: int  #: index into the marker's TP_ARGS
    arg_name: str
    src_offset: int

    @property
    def assignment(self) -> str:
        """Human-readable source, e.g. `LOAD(8 bytes at prev + 24)`."""
        src = f"{self.arg_name} + {self.src_offset}" if self.src_offset else self.arg_name
        if self.kind is FieldKind.VALUE:
            return f"VALUE({self.arg_name})"
        if self.kind is FieldKind.LOAD:
            return f"LOAD({self.size} bytes at {src})"
        if self.kind is FieldKind.ARRAY:
            return f"ARRAY({self.size} bytes from {src})"
        return f"STRING(at most {self.size - 1} chars from {src})"


@dataclass(frozen=True)
class Marker:
    """One static tracepoint site (a TRACE_EVENT call site in the kernel)."""

    system: str
    name: str
    site: int  #: address of the 5-byte NOP
    format: str  #: TP_printk format
    print_args: str  #: TP_printk arguments, as written
    proto: str  #: TP_PROTO text
    args: tuple[str, ...]  #: TP_ARGS names
    entry_size: int
    fields: tuple[MarkerField, ...]
    arg_locations: tuple[str, ...]  #: where each TP_ARG is at the site, e.g. ("%edi", "%esi")

    @property
    def id(self) -> str:
        """GDB's marker id: `system::name`."""
        return f"{self.system}::{self.name}"

    def location_of(self, arg: str) -> str:
        """Register operand holding TP_ARG `arg` at the site."""
        return self.arg_locations[self.args.index(arg)]


def parse_markers(
    table: bytes, read: Callable[[int, int], bytes], read_string: Callable[[int], str], table_address: int
) -> tuple[Marker, ...]:
    """Decode the `kgtp_markers` section.

    `read(addr, n)` and `read_string(addr)` read the image's initialised memory (the records point into rodata);
    both raise KernelImageError for addresses outside the image.
    """
    if len(table) % _RECORD.size:
        raise KernelImageError(f"kgtp_markers: size {len(table)} is not a multiple of {_RECORD.size}")
    markers = []
    for index in range(len(table) // _RECORD.size):
        site, event_addr, locations_addr = _RECORD.unpack_from(table, index * _RECORD.size)
        where = f"kgtp_markers[{index}] at {table_address + index * _RECORD.size:#x}"
        (system_p, name_p, format_p, print_p, proto_p, args_p, entry_size, nr_fields, _, fields_p) = _EVENT.unpack(
            read(event_addr, _EVENT.size)
        )
        args = tuple(a.strip() for a in read_string(args_p).split(","))
        locations = tuple(read_string(locations_addr).split(","))
        if len(locations) != len(args):
            raise KernelImageError(f"{where}: {len(args)} TP_ARGS but {len(locations)} locations")
        fields = []
        for f in range(nr_fields):
            name_f, type_f, offset, size, signed, kind, arg, _, src_offset, _ = _FIELD.unpack(
                read(fields_p + f * _FIELD.size, _FIELD.size)
            )
            if arg >= len(args) or kind not in FieldKind._value2member_map_ or offset + size > entry_size:
                raise KernelImageError(f"{where}: malformed field {f}")
            fields.append(
                MarkerField(
                    name=read_string(name_f),
                    type=read_string(type_f),
                    offset=offset,
                    size=size,
                    signed=bool(signed),
                    kind=FieldKind(kind),
                    arg=arg,
                    arg_name=args[arg],
                    src_offset=src_offset,
                )
            )
        if read(site, len(SITE_NOP)) != SITE_NOP:
            raise KernelImageError(f"{where}: no 5-byte NOP at site {site:#x}")
        markers.append(
            Marker(
                system=read_string(system_p),
                name=read_string(name_p),
                site=site,
                format=read_string(format_p),
                print_args=read_string(print_p),
                proto=read_string(proto_p),
                args=args,
                entry_size=entry_size,
                fields=tuple(fields),
                arg_locations=locations,
            )
        )
    return tuple(sorted(markers, key=lambda m: m.site))
