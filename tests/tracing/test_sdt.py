"""A program's SDT probes as static tracepoint markers (tracing/core/sdt.py): the notes' argument operands read as
the assembler wrote them, each argument's value at a hit (sized, sign-extended, unreadable memory as 0) and
`$_sdata`'s text; the markers of a program built with <sys/sdt.h>, where a process loaded it."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest

from kgtp_sim.tracing.core.sdata import SdataError, build_entry, render
from kgtp_sim.tracing.core.sdt import Operand, SdtMarker, parse_operand, program_markers

SYMBOLS = {"counter": 0x404010, "table": 0x405000}.get
PC = 0x401234


@pytest.mark.parametrize("text, operand", [
    ("8@%rax", Operand(8, False, register=0, width=8)),
    ("-4@%esi", Operand(4, True, register=4, width=4)),
    ("1@%r9b", Operand(1, False, register=9, width=1)),
    ("-4@$7", Operand(4, True, constant=7)),
    ("8@$-3", Operand(8, False, constant=-3)),
    ("-8@-8(%rbp)", Operand(8, True, base=6, disp=-8)),
    ("4@(%rdi)", Operand(4, False, base=5)),
    ("8@16(%rsp,%rcx,8)", Operand(8, False, base=7, index=2, scale=8, disp=16)),
    ("-4@counter(%rip)", Operand(4, True, disp=0x404010)),
    ("8@table+8(%rip)", Operand(8, False, disp=0x405008)),
    ("8@8(%rip)", Operand(8, False, disp=PC + 8)),
    ("2@0x10", Operand(2, False, disp=0x10)),
    ("-4@counter", Operand(4, True, disp=0x404010)),
])
def test_operands_read_as_the_assembler_wrote_them(text, operand):
    assert parse_operand(text, SYMBOLS, PC) == operand


@pytest.mark.parametrize("text", ["3@%rax", "8@%xmm0", "8@nowhere(%rip)", "%rax", "8@$x", "8@(%rax"])
def test_operands_the_stub_cannot_read_are_refused(text):
    with pytest.raises(SdataError):
        parse_operand(text, SYMBOLS, PC)


def test_an_entry_holds_each_argument_sized_and_signed_and_renders_as_sdata():
    operands = tuple(parse_operand(t, SYMBOLS, PC) for t in ("-4@%esi", "8@-8(%rbp)", "-1@$-2", "4@counter(%rip)",
                                                            "8@(%rdi)"))
    marker = SdtMarker("kgtp", "step", PC, "...", operands)
    registers = [0] * 24
    registers[4] = 0xFFFF_FFFF_FFFF_FFFE  # %rsi: -2 in its low half
    registers[6] = 0x7FFF_0000  # %rbp
    registers[5] = 0xDEAD  # %rdi: nothing readable there
    memory = {0x7FFF_0000 - 8: struct.pack("<Q", 1 << 40), 0x404010: struct.pack("<I", 0xFFFF_FFFF)}
    entry = build_entry(marker, registers, lambda address, size: memory.get(address, b"")[:size] or None)
    assert entry == struct.pack("<5Q", (1 << 64) - 2, 1 << 40, (1 << 64) - 2, 0xFFFF_FFFF, 0)
    assert render(marker, entry) == "arg1=-2 arg2=1099511627776 arg3=-2 arg4=4294967295 arg5=0"
    assert render(SdtMarker("kgtp", "start", PC, "", ()), b"") == ""
    assert marker.id == "kgtp:step"


def test_the_markers_of_a_program_built_with_sdt_h(tmp_path):
    source = Path(__file__).resolve().parents[1] / "programs" / "probes.c"
    if not Path("/usr/include/x86_64-linux-gnu/sys/sdt.h").exists():
        pytest.skip("no <sys/sdt.h> (Debian's systemtap-sdt-dev: scripts/test installs it)")
    program = tmp_path / "probes"
    subprocess.run(["gcc", "-O2", str(source), "-o", str(program)], check=True, capture_output=True)
    markers = {m.id: m for m in program_markers(program.read_bytes(), 0x1000_0000)}
    notes = subprocess.run(["readelf", "-n", str(program)], check=True, capture_output=True, text=True).stdout
    assert set(markers) == {"kgtp:start", "kgtp:step", "kgtp:round"}
    for marker in markers.values():  # where binutils reads each note, moved with the process's load address
        assert f"Name: {marker.name}\n    Location: {marker.site - 0x1000_0000:#018x}" in notes, notes
        assert f"Arguments: {marker.arguments}\n" in notes, notes
    assert len(markers["kgtp:step"].operands) == 3 and markers["kgtp:start"].operands == ()
    assert program_markers(b"not an ELF", 0) == () and program_markers(source.read_bytes(), 0) == ()
