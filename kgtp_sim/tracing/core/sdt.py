"""A program's static tracepoint markers: SystemTap's SDT probes (`<sys/sdt.h>`: STAP_PROBE, DTRACE_PROBE), as GDB
and SystemTap read them from the program's `.note.stapsdt` notes, and their `$_sdata`.

A probe is a `nop` at its site, with a note naming its provider and name and describing where each of its
arguments is at the site, in the assembler's operand syntax with a size (`-4@-20(%rbp) 8@%rax 4@$5`: a signed int
in the frame, an unsigned long in a register, a constant; `8@counter(%rip)`: a global, by its symbol). The marker
list is the program's (GDB's `info static-tracepoint-markers`, ids `provider:name`); `strace` at a site collects
`$_sdata`: at the hit each argument is read where its note says and kept as 8 bytes (`entry`), and GDB reads it
rendered as `arg1=5 arg2=-3` (`render`), the names SystemTap gives them.

Pure: notes are parsed on the server thread (the program's file as the machine holds it, its load bias from the
process's auxiliary vector), entries built on the CPU thread at a hit, rendered on the server thread.
"""

from __future__ import annotations

import io
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass


from .sdata import SdataError, argument_register

RIP = 16  #: GDB's register number of %rip

_OPERAND = re.compile(r"^(?P<size>-?\d+)@(?P<operand>.+)$")
_MEMORY = re.compile(r"^(?P<disp>[^(]*)\((?P<base>%\w+)?(?:,(?P<index>%\w+)(?:,(?P<scale>\d+))?)?\)$")
_DISPLACEMENT = re.compile(r"^(?P<symbol>[A-Za-z_.$][\w.$@]*)?(?P<offset>[+-]?(?:0x[0-9a-fA-F]+|\d+))?$")


@dataclass(frozen=True)
class Operand:
    """Where one argument is at the site: a register, a constant, or memory at disp + base + index * scale."""

    size: int  #: bytes: 1, 2, 4 or 8
    signed: bool
    register: int | None = None  #: a register operand's GDB number (its width: `width`)
    width: int = 8
    constant: int | None = None
    base: int | None = None  #: a memory operand's registers (GDB numbers) and displacement
    index: int | None = None
    scale: int = 1
    disp: int = 0


@dataclass(frozen=True)
class SdtMarker:
    """One SDT probe of a program, where the running process has it."""

    provider: str
    name: str
    site: int  #: the address of its `nop` in the process
    arguments: str  #: the note's argument text
    operands: tuple[Operand, ...]

    @property
    def id(self) -> str:
        """GDB's marker id: `provider:name`, as `-probe-stap` names it."""
        return f"{self.provider}:{self.name}"

    @property
    def format(self) -> str:
        """The free-form text GDB lists beside the marker: where its arguments are."""
        return self.arguments

    def entry(self, registers: list[int], read: Callable[[int, int], bytes | None]) -> bytes:
        """Each argument's value at a hit with `registers` (GDB order), 8 bytes each, sign-extended as the note
        says; one in memory that cannot be read is 0 (as a tracer reading through a NULL pointer)."""
        values = []
        for operand in self.operands:
            if operand.constant is not None:
                value = operand.constant
            elif operand.register is not None:
                value = registers[operand.register] & ((1 << (8 * operand.width)) - 1)
            else:
                address = operand.disp + (registers[operand.base] if operand.base is not None else 0) + \
                    (registers[operand.index] * operand.scale if operand.index is not None else 0)
                data = read(address & ((1 << 64) - 1), operand.size)
                value = int.from_bytes(data, "little") if data is not None and len(data) == operand.size else 0
            value &= (1 << (8 * operand.size)) - 1
            if operand.signed and value >> (8 * operand.size - 1):
                value -= 1 << (8 * operand.size)
            values.append(value & ((1 << 64) - 1))
        return struct.pack(f"<{len(values)}Q", *values)

    def render(self, entry: bytes) -> str:
        """The entry as GDB reads `$_sdata`: `arg1=5 arg2=-3` (an empty string for a probe without arguments)."""
        values = struct.unpack(f"<{len(entry) // 8}Q", entry)
        return " ".join(f"arg{n}={_signed(v) if o.signed else v}"
                        for n, (o, v) in enumerate(zip(self.operands, values), 1))


def _signed(value: int) -> int:
    return value - (1 << 64) if value >> 63 else value


def parse_operand(text: str, symbols: Callable[[str], int | None], pc: int) -> Operand:
    """One argument of a note (`-4@-20(%rbp)`); `symbols` gives a symbol's address in the process (for
    `sym(%rip)`), `pc` the site's. Raises SdataError for what it cannot read."""
    match = _OPERAND.match(text)
    if not match or abs(int(match["size"])) not in (1, 2, 4, 8):
        raise SdataError(f"SDT argument {text!r}: no size@operand")
    size, signed, operand = abs(int(match["size"])), match["size"].startswith("-"), match["operand"]
    if operand.startswith("$"):
        try:
            return Operand(size, signed, constant=int(operand[1:], 0))
        except ValueError:
            raise SdataError(f"SDT argument {text!r}: a constant that is not a number") from None
    if operand.startswith("%"):
        number, width = argument_register(operand)
        return Operand(size, signed, register=number, width=width)
    memory = _MEMORY.match(operand if "(" in operand else operand + "()")  # (`counter`: an absolute address)
    displacement = _DISPLACEMENT.match(memory["disp"]) if memory else None
    if memory is None or displacement is None:
        raise SdataError(f"SDT argument {text!r}: an operand this stub cannot read")
    disp = int(displacement["offset"] or "0", 0)
    base = index = None
    if memory["base"] == "%rip":
        if displacement["symbol"]:
            address = symbols(displacement["symbol"])
            if address is None:
                raise SdataError(f"SDT argument {text!r}: no symbol {displacement['symbol']} in the program")
            return Operand(size, signed, disp=address + disp)
        return Operand(size, signed, disp=pc + disp)  # (the site's own address: a nop has no next instruction)
    if displacement["symbol"]:
        address = symbols(displacement["symbol"])
        if address is None:
            raise SdataError(f"SDT argument {text!r}: no symbol {displacement['symbol']} in the program")
        disp += address
    if memory["base"]:
        base = argument_register(memory["base"])[0]
    if memory["index"]:
        index = argument_register(memory["index"])[0]
    return Operand(size, signed, base=base, index=index, scale=int(memory["scale"] or "1"), disp=disp)


def program_markers(elf: bytes, bias: int) -> tuple[SdtMarker, ...]:
    """The SDT probes of a program's ELF image (its bytes), at their addresses in a process that loaded it `bias`
    bytes from where it was linked (0 for a program that is not PIE). A probe whose arguments cannot be read is
    left out; an image that is no ELF or has no notes has none."""
    from elftools.common.exceptions import ELFError  # here: a server that never lists markers never loads it
    from elftools.elf.elffile import ELFFile

    try:
        image = ELFFile(io.BytesIO(elf))
        notes = image.get_section_by_name(".note.stapsdt")
        if notes is None:
            return ()
        stapsdt_base = image.get_section_by_name(".stapsdt.base")
        table = image.get_section_by_name(".symtab") or image.get_section_by_name(".dynsym")
        symbols: dict[str, int] = {}
        if table is not None:
            for symbol in table.iter_symbols():
                if symbol.name and symbol["st_shndx"] != "SHN_UNDEF":
                    symbols.setdefault(symbol.name, symbol["st_value"] + bias)
        found = []
        for note in notes.iter_notes():
            # (type 3, NT_STAPSDT: pyelftools names it by the GNU note of that number)
            if note["n_name"] != "stapsdt" or note["n_type"] not in (3, "NT_STAPSDT", "NT_GNU_BUILD_ID"):
                continue
            desc = note["n_desc"]
            raw = desc if isinstance(desc, bytes) else bytes.fromhex(desc) if isinstance(desc, str) else b""
            if len(raw) < 24:
                continue
            pc, base, _semaphore = struct.unpack_from("<QQQ", raw)
            provider, name, arguments = (raw[24:].split(b"\0") + [b"", b"", b""])[:3]
            # a prelinked image moved .stapsdt.base: the note's pc moves with it (SystemTap's sdt.h)
            pc += (stapsdt_base["sh_addr"] - base if stapsdt_base is not None else 0) + bias
            text = arguments.decode("latin-1")
            try:
                operands = tuple(parse_operand(a, symbols.get, pc) for a in text.split())
            except SdataError:
                continue
            found.append(SdtMarker(provider.decode("latin-1"), name.decode("latin-1"), pc, text, operands))
        return tuple(found)
    except (ELFError, ValueError, struct.error):
        return ()
