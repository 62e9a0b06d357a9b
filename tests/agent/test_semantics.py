"""Exact 64-bit semantics, edge by edge, checked on every engine (interpreter, naive, optimized, optimized with
live registers) through the differential harness."""

from __future__ import annotations

import struct

import pytest

from kgtp_sim.agent.context import SimpleContext
from kgtp_sim.agent.errors import ErrorCode
from kgtp_sim.agent.interp import evaluate
from kgtp_sim.agent.opcodes import assemble, encode
from kgtp_sim.agent.printf_format import FormatError, read_escapes
from kgtp_sim.agent.semantics import ext, signed, zero_ext
from kgtp_sim.agent.verify import verify

from .harness import DATA_ADDR, DATA_SIZE, STRING_ADDR, UNMAPPED, Differential, make_memory

M = 2**64 - 1
INT64_MIN = 2**63


@pytest.fixture(scope="module")
def diff() -> Differential:
    return Differential()


def c64(v: int) -> str:
    return f"const64 {v & M}"


def value(diff: Differential, text: str, **kw) -> int | None:
    out = diff.check(assemble(text), **kw)
    assert out.error is None, out.error
    return out.value


def error(diff: Differential, text: str, **kw) -> tuple[int, int]:
    out = diff.check(assemble(text), **kw)
    assert out.error is not None
    return out.error


@pytest.mark.parametrize(
    ("a", "b", "op", "expected"),
    [
        (-7, 2, "div_signed", -3),
        (-7, 2, "rem_signed", -1),
        (7, -2, "div_signed", -3),
        (7, -2, "rem_signed", 1),
        (-7, -2, "div_signed", 3),
        (INT64_MIN, 1, "div_signed", INT64_MIN),
        (INT64_MIN, 2, "div_signed", -(2**62)),
        (INT64_MIN, -2, "div_signed", 2**62),
        (-1, 2, "div_unsigned", M // 2),
        (-1, 10, "rem_unsigned", M % 10),
        (5, 1 << 63, "div_unsigned", 0),
        (INT64_MIN, 3, "rem_signed", -2),
    ],
)
def test_division(diff, a, b, op, expected) -> None:
    assert value(diff, f"{c64(a)}; {c64(b)}; {op}; end") == expected & M
    # the same with the divisor computed at run time (no constant folding)
    assert value(diff, f"{c64(a)}; reg 3; {op}; end", registers=[0, 0, 0, b & M]) == expected & M


@pytest.mark.parametrize("op", ["div_signed", "rem_signed"])
def test_int64_min_by_minus_one_is_an_error(diff, op) -> None:
    assert error(diff, f"{c64(INT64_MIN)}; {c64(-1)}; {op}; end") == (ErrorCode.DIVIDE_OVERFLOW, 18)
    regs = [INT64_MIN, 0, 0, M]
    assert error(diff, f"reg 0; reg 3; {op}; end", registers=regs) == (ErrorCode.DIVIDE_OVERFLOW, 6)
    # unsigned division of the same bits is fine
    assert value(diff, f"reg 0; reg 3; {op.replace('signed', 'unsigned')}; end", registers=regs) is not None


@pytest.mark.parametrize("op", ["div_signed", "div_unsigned", "rem_signed", "rem_unsigned"])
def test_division_by_zero(diff, op) -> None:
    assert error(diff, f"const8 5; const8 0; {op}; end") == (ErrorCode.DIVIDE_BY_ZERO, 4)
    assert error(diff, f"const8 5; reg 2; {op}; end") == (ErrorCode.DIVIDE_BY_ZERO, 5)


@pytest.mark.parametrize("count", [0, 1, 31, 32, 63, 64, 65, 127, 200, 2**32, 2**63, M])
@pytest.mark.parametrize("x", [1, 0x8000_0000_0000_0001, M, 0x1234_5678_9ABC_DEF0])
def test_shifts(diff, x, count) -> None:
    big = count >= 64
    expect = {
        "lsh": 0 if big else (x << count) & M,
        "rsh_unsigned": 0 if big else x >> count,
        "rsh_signed": (signed(x) >> min(count, 63)) & M,
    }
    for op, want in expect.items():
        assert value(diff, f"{c64(x)}; {c64(count)}; {op}; end") == want
        assert value(diff, f"reg 1; reg 2; {op}; end", registers=[0, x, count]) == want
        assert value(diff, f"reg 1; {c64(count)}; {op}; end", registers=[0, x]) == want


@pytest.mark.parametrize("bits", [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 200, 255])
@pytest.mark.parametrize("x", [0, 1, 0x7F, 0x80, 0xFF, 0x8000, 0xFFFF_FFFF, 0x8000_0000, M, 0x1234_5678_9ABC_DEF0])
def test_every_ext_width(diff, bits, x) -> None:
    assert value(diff, f"{c64(x)}; ext {bits}; end") == ext(x, bits)
    assert value(diff, f"{c64(x)}; zero_ext {bits}; end") == zero_ext(x, bits)
    assert value(diff, f"reg 9; ext {bits}; end", registers=[0] * 9 + [x]) == ext(x, bits)
    assert value(diff, f"reg 9; zero_ext {bits}; end", registers=[0] * 9 + [x]) == zero_ext(x, bits)


def test_ext_semantics_table() -> None:
    assert ext(0x80, 8) == M - 0x7F
    assert ext(0x7F, 8) == 0x7F
    assert ext(0xFFFF_FFFF, 32) == M
    assert ext(5, 64) == ext(5, 200) == 5
    assert ext(5, 0) == zero_ext(5, 0) == 0
    assert zero_ext(M, 33) == 2**33 - 1


@pytest.mark.parametrize(
    ("a", "b"), [(-1, 1), (1, -1), (-1, -2), (INT64_MIN, 1), (0, -1), (-1, 0), (5, 5), (2**31, -(2**31))]
)
def test_comparisons_signed_and_unsigned(diff, a, b) -> None:
    ua, ub = a & M, b & M
    for op, want in (("less_signed", signed(ua) < signed(ub)), ("less_unsigned", ua < ub), ("equal", ua == ub)):
        assert value(diff, f"{c64(a)}; {c64(b)}; {op}; end") == int(want)
        assert value(diff, f"reg 0; reg 1; {op}; end", registers=[ua, ub]) == int(want)
        assert value(diff, f"reg 0; reg 1; {op}; log_not; end", registers=[ua, ub]) == int(not want)
        # branch on it (fused compare-and-branch in the optimizer)
        code = f"reg 0; reg 1; {op}; if_goto 13; const8 7; end; const8 9; end"
        assert value(diff, code, registers=[ua, ub]) == (9 if want else 7)


def test_32bit_compare_after_ext(diff) -> None:
    """`ext 32` values compared with a small constant: the optimizer compares 32 bits, results must not change."""
    for x in (0, 1, 0xFFFF_FFFF, 0x8000_0000, 0x7FFF_FFFF, 0x1_0000_0001, M):
        for cmp in ("const8 0; swap; less_signed", "const8 0; less_signed", "const8 5; equal", "const32 4294967295; equal"):
            want = None
            out = value(diff, f"reg 3; ext 32; {cmp}; end", registers=[0, 0, 0, x])
            sx = signed(ext(x, 32))
            if cmp.startswith("const8 0; swap"):
                want = 0 < sx
            elif cmp.startswith("const8 0"):
                want = sx < 0
            elif cmp.startswith("const8 5"):
                want = ext(x, 32) == 5
            else:
                want = ext(x, 32) == 0xFFFF_FFFF
            assert out == int(want), (hex(x), cmp)


def test_refs_zero_extend(diff) -> None:
    mem = make_memory()
    for width in (8, 16, 32, 64):
        n = width // 8
        raw = int.from_bytes(mem[0x40 : 0x40 + n], "little")
        assert value(diff, f"const64 {DATA_ADDR + 0x40}; ref{width}; end") == raw
        if width < 64:
            assert value(diff, f"const64 {DATA_ADDR + 0x40}; ref{width}; ext {width}; end") == ext(raw, width)
        # through a register base + displacement, and a computed address
        assert value(diff, f"reg 6; const8 64; add; ref{width}; end", registers=[0] * 6 + [DATA_ADDR]) == raw


def test_ref_faults(diff) -> None:
    assert error(diff, f"const64 {UNMAPPED}; ref32; end") == (ErrorCode.MEMORY_FAULT, 9)
    # a read straddling the end of mapped memory faults too
    assert error(diff, f"const64 {DATA_ADDR + DATA_SIZE - 4}; ref64; end") == (ErrorCode.MEMORY_FAULT, 9)
    assert value(diff, f"const64 {DATA_ADDR + DATA_SIZE - 8}; ref64; end") is not None


def test_stack_ops(diff) -> None:
    assert value(diff, "const8 1; const8 2; const8 3; rot; end") == 2
    assert value(diff, "const8 1; const8 2; const8 3; rot; pop; end") == 1
    assert value(diff, "const8 1; const8 2; const8 3; rot; pop; pop; end") == 3
    assert value(diff, "const8 1; const8 2; const8 3; pick 2; end") == 1
    assert value(diff, "const8 1; const8 2; pick 0; add; end") == 4
    assert value(diff, "const8 1; const8 2; swap; sub; end") == 1
    assert value(diff, "const8 1; dup; add; end") == 2
    assert value(diff, "const8 1; pop; end") == 0  # empty stack at end: 0
    assert value(diff, "end") == 0


def test_tsvs(diff) -> None:
    out = diff.check(assemble("getv 1; const8 1; add; setv 1; tracev 1; setv 2; pop; getv 2; end"), tsvs={1: 41})
    assert out.value == 42 and out.tsvs == {1: 42, 2: 42}
    assert out.blocks == [b"V" + struct.pack("<iq", 1, 42)]
    out = diff.check(assemble("tracev 3; end"), tsvs={3: M})
    assert out.blocks == [b"V" + struct.pack("<iq", 3, -1)]


def test_trace_blocks(diff) -> None:
    mem = make_memory()
    out = diff.check(assemble(f"const64 {DATA_ADDR + 3}; trace_quick 5; const8 2; add; const8 7; trace; end"))
    assert out.blocks == [
        b"M" + struct.pack("<QH", DATA_ADDR + 3, 5) + mem[3:8],
        b"M" + struct.pack("<QH", DATA_ADDR + 5, 7) + mem[5:12],
    ]
    out = diff.check(assemble(f"const64 {DATA_ADDR}; trace16 300; end"))
    assert out.value == DATA_ADDR and out.blocks == [b"M" + struct.pack("<QH", DATA_ADDR, 300) + mem[:300]]
    # zero-length traces record nothing
    assert diff.check(assemble(f"const64 {DATA_ADDR}; trace_quick 0; const8 0; trace; end")).blocks == []


def test_trace_splits_big_blocks() -> None:
    big = Differential({DATA_ADDR: bytes(range(256)) * 600})  # 153600 bytes
    out = big.check(assemble(f"const64 {DATA_ADDR}; const32 140000; trace; end"))
    assert [len(b) - 11 for b in out.blocks] == [65535, 65535, 140000 - 2 * 65535]
    assert struct.unpack_from("<Q", out.blocks[1], 1)[0] == DATA_ADDR + 65535


def test_trace_room(diff) -> None:
    code = f"const64 {DATA_ADDR}; trace_quick 4; const64 {DATA_ADDR}; trace_quick 4; end"
    assert diff.check(assemble(code), trace_limit=30).blocks != []
    out = diff.check(assemble(code), trace_limit=29)
    assert out.error == (ErrorCode.TRACE_BUFFER_FULL, 20) and len(out.blocks) == 1
    assert error(diff, code, trace_limit=14) == (ErrorCode.TRACE_BUFFER_FULL, 9)
    assert error(diff, "tracev 1; end", trace_limit=12) == (ErrorCode.TRACE_BUFFER_FULL, 0)
    assert diff.check(assemble("tracev 1; end"), trace_limit=13).error is None


def test_trace_fault_keeps_earlier_blocks(diff) -> None:
    out = diff.check(assemble(f"const64 {DATA_ADDR}; trace_quick 4; const64 {DATA_ADDR + DATA_SIZE - 2}; const8 4; trace; end"))
    assert out.error == (ErrorCode.MEMORY_FAULT, 22) and len(out.blocks) == 1
    # room is checked before memory is read: a full buffer wins over a fault
    out = diff.check(assemble(f"const64 {UNMAPPED}; const8 4; trace; end"), trace_limit=10)
    assert out.error == (ErrorCode.TRACE_BUFFER_FULL, 11)


def test_tracenz(diff) -> None:
    def nz(addr: int, size: int, **kw):
        return diff.check(assemble(f"const64 {addr}; const32 {size}; tracenz; end"), **kw)

    assert nz(STRING_ADDR, 100).blocks == [b"M" + struct.pack("<QH", STRING_ADDR, 5) + b"kgtp\0"]
    assert nz(STRING_ADDR, 3).blocks == [b"M" + struct.pack("<QH", STRING_ADDR, 3) + b"kgt"]
    assert nz(STRING_ADDR + 15, 10).blocks == [b"M" + struct.pack("<QH", STRING_ADDR + 15, 1) + b"\0"]
    assert nz(STRING_ADDR, 0).blocks == []
    # a string running into unmapped memory faults; one ending just before it does not
    assert nz(DATA_ADDR + DATA_SIZE - 8, 100).error == (ErrorCode.MEMORY_FAULT, 14)
    assert nz(DATA_ADDR + DATA_SIZE - 8, 8).error is None
    assert nz(STRING_ADDR, 4, trace_limit=15).error is None
    assert nz(STRING_ADDR, 100, trace_limit=15).error == (ErrorCode.TRACE_BUFFER_FULL, 14)


def test_tracenz_long_string() -> None:
    big = Differential({DATA_ADDR: b"x" * 70000 + b"\0"})
    out = big.check(assemble(f"const64 {DATA_ADDR}; const32 100000; tracenz; end"))
    assert [len(b) - 11 for b in out.blocks] == [65535, 70001 - 65535]


def test_printf(diff) -> None:
    code = (
        encode("const64", STRING_ADDR) + encode("const8", 0xFF) + encode("const64", M) + encode("const8", 0)
        + encode("const8", 0) + encode("printf", 3, fmt=b"%ld %c %s|") + encode("const8", 5) + encode("end")
    )
    out = diff.check(code)
    assert out.output == ["-1 \xff kgtp|"] and out.value == 5


def test_printf_reads_c_escapes_only_when_asked() -> None:
    """GDB sends a dprintf's format as typed (`\\n` two characters); gdbserver's agent printf reads the escapes
    (format.cc's format_pieces), the tracer's prints the format as it came (KGTP has no printf op)."""
    raw = rb'a\tb\n\"%d\"\\\e\a\b\f\r\v' + b"|"
    code = encode("const8", 7) + encode("const8", 0) + encode("const8", 0) + encode("printf", 1, fmt=raw) + encode("end")
    program = verify(code)
    as_gdbserver, as_sent = SimpleContext(), SimpleContext()
    assert evaluate(program, as_gdbserver, escapes=True).error is None
    assert evaluate(program, as_sent).error is None
    assert as_gdbserver.output == ['a\tb\n"7"\\\x1b\a\b\f\r\v|']
    assert as_sent.output == [raw.replace(b"%d", b"7").decode()]
    assert read_escapes(b'x"y') == b"x"  # an unescaped quote ends it, as format_pieces' loop
    for bad in (rb"\q", rb"\101", b"end\\"):  # no other escape, octal neither; a lone backslash at the end
        with pytest.raises(FormatError, match="Unrecognized escape"):
            read_escapes(bad)


def test_loops_and_budget(diff) -> None:
    # sum 1..5 with a counted loop on the stack
    loop = "const8 0; const8 5; dup; log_not; if_goto 19; dup; rot; add; swap; const8 1; sub; goto 4; pop; end"
    assert value(diff, loop, loop_budget=5) == 15
    assert error(diff, loop, loop_budget=4) == (ErrorCode.LOOP_BUDGET, 16)
    assert error(diff, "goto 0; end", loop_budget=0) == (ErrorCode.LOOP_BUDGET, 0)
    assert error(diff, "const8 1; if_goto 0; end", loop_budget=3) == (ErrorCode.LOOP_BUDGET, 2)
