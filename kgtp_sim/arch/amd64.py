"""The amd64 register file as GDB sees it: one table for the `g` packet, `p`, target.xml and trace frames.

GDB's amd64 core feature numbers the registers in this order; the target description we serve describes
exactly these, so the `g` reply, a trace frame's register block and GDB's regnums all agree by construction.
That is KGTP mode's layout (`CORE`, and the module's constants). A Linux process has more (`LINUX`, the layout
gdbserver's x86-64 Linux description gives: the core, then SSE, then `orig_rax`, then `fs_base` and `gs_base`);
a `RegisterLayout` is one register file with its `g` encoding and its target description.

Pure (constants and conversions): used on the server thread (`g`, `p`, `G`, target.xml), on the CPU thread (a hit's
register block), and wherever a frame's register block is read (the server thread for the frame `tfind` selects; the
view commands, in their own process).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass


@dataclass(frozen=True)
class Register:
    name: str
    size: int  # bytes in the `g` packet
    gdb_type: str
    group: str = "general"


_GPR = ("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15")
_TYPES = {"rbp": "data_ptr", "rsp": "data_ptr", "rip": "code_ptr", "eflags": "i386_eflags"}

REGISTERS: tuple[Register, ...] = (
    *(Register(name, 8, _TYPES.get(name, "int64")) for name in _GPR),
    Register("rip", 8, "code_ptr"),
    Register("eflags", 4, "i386_eflags"),
    *(Register(name, 4, "int32") for name in ("cs", "ss", "ds", "es", "fs", "gs")),
    # x87 state: GDB's amd64 core feature requires it; the kernel never uses it, values are real anyway.
    *(Register(f"st{i}", 10, "i387_ext", "float") for i in range(8)),
    *(
        Register(name, 4, "int", "float")
        for name in ("fctrl", "fstat", "ftag", "fiseg", "fioff", "foseg", "fooff", "fop")
    ),
)

REGISTER_INDEX: dict[str, int] = {reg.name: i for i, reg in enumerate(REGISTERS)}
OFFSETS: tuple[int, ...] = tuple(sum(r.size for r in REGISTERS[:i]) for i in range(len(REGISTERS)))
G_PACKET_SIZE: int = sum(r.size for r in REGISTERS)
PC_REGNUM = REGISTER_INDEX["rip"]
SP_REGNUM = REGISTER_INDEX["rsp"]
#: Registers a tracepoint's register block (`collect $regs`) holds: GPRs, rip, eflags and segments.
GENERAL_REGISTERS: tuple[Register, ...] = REGISTERS[: REGISTER_INDEX["gs"] + 1]


_GENERAL_FORMAT = struct.Struct("<" + "".join("Q" if r.size == 8 else "I" for r in GENERAL_REGISTERS))
_REST = bytes(G_PACKET_SIZE - _GENERAL_FORMAT.size)


def encode_general(values: list[int]) -> bytes:
    """Raw `g` block from the general registers in GDB order (a hit's snapshot), the rest zero-filled; the fast
    path of `encode_registers` for trace frames."""
    return _GENERAL_FORMAT.pack(*values) + _REST


def encode_registers(values: dict[str, int]) -> bytes:
    """Raw `g` block (little-endian, GDB order). Registers missing from `values` are zero-filled."""
    out = bytearray()
    for reg in REGISTERS:
        out += (values.get(reg.name, 0) & ((1 << (8 * reg.size)) - 1)).to_bytes(reg.size, "little")
    return bytes(out)


def decode_registers(block: bytes) -> dict[str, int]:
    """Inverse of `encode_registers` for as many registers as the block holds."""
    return CORE.decode(block)


def hex_registers(values: dict[str, int | None]) -> str:
    """The `g` reply text: hex per register, `xx…` for a register whose value is unavailable (None/missing)."""
    return CORE.hex(values)


def target_xml() -> str:
    """Target description for GDB (`qXfer:features:read:target.xml`)."""
    lines = [
        '<?xml version="1.0"?>',
        "<target>",
        "<architecture>i386:x86-64</architecture>",
        '<feature name="org.gnu.gdb.i386.core">',
        '<flags id="i386_eflags" size="4">',
    ]
    for bit, name in ((0, "CF"), (2, "PF"), (4, "AF"), (6, "ZF"), (7, "SF"), (8, "TF"), (9, "IF"), (10, "DF"), (11, "OF")):
        lines.append(f'<field name="{name}" start="{bit}" end="{bit}"/>')
    lines.append("</flags>")
    for regnum, reg in enumerate(REGISTERS):
        lines.append(
            f'<reg name="{reg.name}" bitsize="{reg.size * 8}" type="{reg.gdb_type}" regnum="{regnum}"'
            f' group="{reg.group}"/>'
        )
    lines += ["</feature>", "</target>"]
    return "\n".join(lines) + "\n"


# ---- layouts: a register file, its `g` encoding and its target description ----------------------------------

_SSE = (*(Register(f"xmm{i}", 16, "vec128", "vector") for i in range(16)), Register("mxcsr", 4, "i386_mxcsr", "vector"))
_LINUX_EXTRA = (Register("orig_rax", 8, "int", "system"), Register("fs_base", 8, "int", "system"),
                Register("gs_base", 8, "int", "system"))

#: GDB's features, each a run of registers: (feature name, first register, registers, types it needs)
_SSE_TYPES = """<vector id="v4f" type="ieee_single" count="4"/>
<vector id="v2d" type="ieee_double" count="2"/>
<vector id="v16i8" type="int8" count="16"/>
<vector id="v8i16" type="int16" count="8"/>
<vector id="v4i32" type="int32" count="4"/>
<vector id="v2i64" type="int64" count="2"/>
<union id="vec128">
<field name="v4_float" type="v4f"/>
<field name="v2_double" type="v2d"/>
<field name="v16_int8" type="v16i8"/>
<field name="v8_int16" type="v8i16"/>
<field name="v4_int32" type="v4i32"/>
<field name="v2_int64" type="v2i64"/>
<field name="uint128" type="uint128"/>
</union>
<flags id="i386_mxcsr" size="4">
""" + "".join(f'<field name="{name}" start="{bit}" end="{bit}"/>\n' for bit, name in enumerate(
    ("IE", "DE", "ZE", "OE", "UE", "PE", "DAZ", "IM", "DM", "ZM", "OM", "UM", "PM", "FZ"))) + "</flags>"


class RegisterLayout:
    """One register file as the `g` packet carries it and its target description (features in order)."""

    def __init__(self, features: tuple[tuple[str, tuple[Register, ...], str], ...], osabi: str | None = None) -> None:
        self.features = features
        self.osabi = osabi
        self.registers: tuple[Register, ...] = tuple(reg for _, regs, _ in features for reg in regs)
        self.index = {reg.name: i for i, reg in enumerate(self.registers)}
        self.offsets = tuple(sum(r.size for r in self.registers[:i]) for i in range(len(self.registers)))
        self.size = sum(r.size for r in self.registers)

    def hex(self, values: dict[str, int | None]) -> str:
        """The `g` reply text: hex per register, `xx…` for an unavailable one (None or missing)."""
        parts = []
        for reg in self.registers:
            value = values.get(reg.name)
            if value is None:
                parts.append("xx" * reg.size)
            else:
                parts.append((value & ((1 << (8 * reg.size)) - 1)).to_bytes(reg.size, "little").hex())
        return "".join(parts)

    def decode(self, block: bytes) -> dict[str, int]:
        """The registers of a `G` block, as many as it holds."""
        values: dict[str, int] = {}
        for reg, offset in zip(self.registers, self.offsets):
            if offset + reg.size > len(block):
                break
            values[reg.name] = int.from_bytes(block[offset: offset + reg.size], "little")
        return values

    def target_xml(self) -> str:
        lines = ['<?xml version="1.0"?>', '<!DOCTYPE target SYSTEM "gdb-target.dtd">', "<target>",
                 "<architecture>i386:x86-64</architecture>"]
        if self.osabi:
            lines.append(f"<osabi>{self.osabi}</osabi>")
        for name, regs, types in self.features:
            lines.append(f'<feature name="{name}">')
            if types:
                lines.append(types)
            for reg in regs:
                lines.append(f'<reg name="{reg.name}" bitsize="{reg.size * 8}" type="{reg.gdb_type}"'
                             f' regnum="{self.index[reg.name]}" group="{reg.group}"/>')
            lines.append("</feature>")
        lines.append("</target>")
        return "\n".join(lines) + "\n"


_EFLAGS_TYPE = '<flags id="i386_eflags" size="4">\n' + "".join(
    f'<field name="{name}" start="{bit}" end="{bit}"/>\n' for bit, name in (
        (0, "CF"), (2, "PF"), (4, "AF"), (6, "ZF"), (7, "SF"), (8, "TF"), (9, "IF"), (10, "DF"), (11, "OF"))) + "</flags>"

#: KGTP mode's: the kernel's CPUs and trace frames (GDB's amd64 core feature)
CORE = RegisterLayout((("org.gnu.gdb.i386.core", REGISTERS, _EFLAGS_TYPE),))
#: a Linux process's, as gdbserver's x86-64 Linux description (amd64-linux without AVX)
LINUX = RegisterLayout((("org.gnu.gdb.i386.core", REGISTERS, _EFLAGS_TYPE), ("org.gnu.gdb.i386.sse", _SSE, _SSE_TYPES),
                        ("org.gnu.gdb.i386.linux", _LINUX_EXTRA[:1], ""),
                        ("org.gnu.gdb.i386.segments", _LINUX_EXTRA[1:], "")), osabi="GNU/Linux")
