"""The opcode table against GDB 13's ax.def, the decoder, and the disassembler's text."""

from __future__ import annotations

import pytest

from kgtp_sim.agent.disasm import describe_at, disassemble, format_insn, listing
from kgtp_sim.agent.opcodes import BY_CODE, BY_NAME, OPCODES, OpClass, assemble, decode_all, encode

# (name, opcode, operand bytes, ax.def CONSUMED, ax.def PRODUCED): the protocol's numbers, from ax.def.
AX_DEF = [
    ("float", 0x01, 0, 0, 0), ("add", 0x02, 0, 2, 1), ("sub", 0x03, 0, 2, 1), ("mul", 0x04, 0, 2, 1),
    ("div_signed", 0x05, 0, 2, 1), ("div_unsigned", 0x06, 0, 2, 1), ("rem_signed", 0x07, 0, 2, 1),
    ("rem_unsigned", 0x08, 0, 2, 1), ("lsh", 0x09, 0, 2, 1), ("rsh_signed", 0x0A, 0, 2, 1),
    ("rsh_unsigned", 0x0B, 0, 2, 1), ("trace", 0x0C, 0, 2, 0), ("trace_quick", 0x0D, 1, 1, 1),
    ("log_not", 0x0E, 0, 1, 1), ("bit_and", 0x0F, 0, 2, 1), ("bit_or", 0x10, 0, 2, 1), ("bit_xor", 0x11, 0, 2, 1),
    ("bit_not", 0x12, 0, 1, 1), ("equal", 0x13, 0, 2, 1), ("less_signed", 0x14, 0, 2, 1),
    ("less_unsigned", 0x15, 0, 2, 1), ("ext", 0x16, 1, 1, 1), ("ref8", 0x17, 0, 1, 1), ("ref16", 0x18, 0, 1, 1),
    ("ref32", 0x19, 0, 1, 1), ("ref64", 0x1A, 0, 1, 1), ("ref_float", 0x1B, 0, 1, 1), ("ref_double", 0x1C, 0, 1, 1),
    ("ref_long_double", 0x1D, 0, 1, 1), ("l_to_d", 0x1E, 0, 1, 1), ("d_to_l", 0x1F, 0, 1, 1),
    ("if_goto", 0x20, 2, 1, 0), ("goto", 0x21, 2, 0, 0), ("const8", 0x22, 1, 0, 1), ("const16", 0x23, 2, 0, 1),
    ("const32", 0x24, 4, 0, 1), ("const64", 0x25, 8, 0, 1), ("reg", 0x26, 2, 0, 1), ("end", 0x27, 0, 0, 0),
    ("dup", 0x28, 0, 1, 2), ("pop", 0x29, 0, 1, 0), ("zero_ext", 0x2A, 1, 1, 1), ("swap", 0x2B, 0, 2, 2),
    ("getv", 0x2C, 2, 0, 1), ("setv", 0x2D, 2, 1, 1), ("tracev", 0x2E, 2, 0, 1), ("tracenz", 0x2F, 0, 2, 0),
    ("trace16", 0x30, 2, 1, 1), ("invalid2", 0x31, 0, 0, 0), ("pick", 0x32, 1, 0, 1), ("rot", 0x33, 0, 3, 3),
    ("printf", 0x34, 0, 0, 0),
]


@pytest.mark.parametrize(("name", "code", "size", "consumed", "produced"), AX_DEF)
def test_table_matches_ax_def(name, code, size, consumed, produced) -> None:
    op = BY_CODE[code]
    assert op.name == name and BY_NAME[name] is op
    assert op.declared == (consumed, produced)
    if name != "printf":
        assert sum(op.operands) == size


def test_every_ax_def_opcode_and_nothing_else() -> None:
    assert sorted(op.code for op in OPCODES) == [row[1] for row in AX_DEF]
    assert {op.name for op in OPCODES if op.cls is OpClass.FLOAT} == {
        "float", "ref_float", "ref_double", "ref_long_double", "l_to_d", "d_to_l"
    }


def test_real_stack_effects_where_ax_def_is_approximate() -> None:
    (tracev,) = decode_all(encode("tracev", 3))
    assert tracev.stack_effect() == (0, 0, 0)
    (pick,) = decode_all(encode("pick", 2))
    assert pick.stack_effect() == (3, 0, 1)
    (printf,) = decode_all(encode("printf", 2, fmt=b"%d %d"))
    assert printf.stack_effect() == (4, 4, 0)


def test_encode_decode_round_trip() -> None:
    code = assemble("const8 255; const16 65535; const32 4294967295; const64 18446744073709551615; reg 23; pick 4; end")
    insns = decode_all(code)
    assert [i.operands for i in insns] == [(255,), (65535,), (2**32 - 1,), (2**64 - 1,), (23,), (4,), ()]
    assert [i.offset for i in insns] == [0, 2, 5, 10, 19, 22, 24]
    assert encode("const16", 0x1234) == b"\x23\x12\x34"  # operands are big-endian


def test_printf_encoding_matches_gdb() -> None:
    """GDB 13 writes the format with two NULs, both counted by the length (`maint agent-printf` offsets)."""
    code = encode("printf", 0, fmt=b"hello\n")
    assert code == b"\x34\x00\x00\x08hello\n\x00\x00"
    (insn,) = decode_all(code)
    assert insn.format == b"hello\n" and insn.size == 12
    assert format_insn(insn) == 'printf "hello\\n", 0 args'


def test_disassembly_text() -> None:
    code = assemble("const8 2; reg 6; ext 32; if_goto 0; trace_quick 4; end")
    assert disassemble(code) == [(0, "const8 2"), (2, "reg 6"), (5, "ext 32"), (7, "if_goto 0"), (10, "trace_quick 4"), (12, "end")]
    assert listing(code).splitlines()[1] == "  2  reg 6"


def test_disassembly_of_bad_bytes() -> None:
    assert describe_at(b"\x24\x00\x01", 0) == "<truncated const32>"
    assert describe_at(b"\x99", 0) == "<unknown 0x99>"
    assert describe_at(b"\x31", 0) == "<unknown 0x31>"
    assert describe_at(b"\x27", 5) == "<past the end>"
    assert disassemble(b"\x27\x99\x27") == [(0, "end"), (1, "<unknown 0x99>")]
