"""The verifier refuses every malformed expression with a message naming the offset and the op."""

from __future__ import annotations

import pytest

from kgtp_sim.agent.errors import BytecodeError
from kgtp_sim.agent.opcodes import assemble, encode
from kgtp_sim.agent.verify import GDB_MAX_DEPTH, HARD_MAX_DEPTH, verify


def refused(code: bytes, **kw) -> BytecodeError:
    with pytest.raises(BytecodeError) as info:
        verify(code, **kw)
    return info.value


@pytest.mark.parametrize(
    ("code", "offset", "insn", "words"),
    [
        (b"", None, None, "empty"),
        (b"\x22\x01\x99", 2, "<unknown 0x99>", "unknown opcode 0x99"),
        (b"\x22\x01\x31\x27", 2, "<unknown 0x31>", "unknown opcode 0x31"),
        (b"\x22\x01\x24\x00\x00", 2, "<truncated const32>", "truncated const32"),
        (b"\x20\x00", 0, "<truncated if_goto>", "truncated"),
        (b"\x22\x01\x1b\x27", 2, "ref_float", "unsupported"),
        (b"\x01\x27", 0, "float", "unsupported"),
        (b"\x22\x01\x1e\x27", 2, "l_to_d", "unsupported"),
        (assemble("goto 9; end"), 0, "goto 9", "outside the expression"),
        (assemble("const8 1; if_goto 1; end"), 2, "if_goto 1", "instruction boundary"),
        (assemble("const8 1; const8 2; add"), 4, "add", "past the last instruction"),
        (assemble("add; end"), 0, "add", "underflow"),
        (assemble("const8 1; rot; end"), 2, "rot", "underflow"),
        (assemble("const8 1; pick 1; end"), 2, "pick 1", "underflow"),
        (assemble("const8 1; swap; end"), 2, "swap", "underflow"),
        (assemble("trace; end"), 0, "trace", "underflow"),
        (assemble("reg 24; end"), 0, "reg 24", "register 24"),
        # the taken branch arrives with 1 entry, the fall-through with 2
        (assemble("const8 1; const8 1; if_goto 9; const8 2; end"), 7, "const8 2", "depth"),
    ],
)
def test_refusals_name_offset_and_op(code, offset, insn, words) -> None:
    err = refused(code)
    assert err.offset == offset and err.insn == insn
    assert words in str(err)
    if offset is not None:
        assert f"at offset {offset} ({insn})" in str(err)


def test_depth_limits() -> None:
    def pushes(n: int) -> bytes:
        return assemble("; ".join(["const8 1"] * n) + "; end")

    assert verify(pushes(GDB_MAX_DEPTH)).max_depth == 20
    assert verify(pushes(HARD_MAX_DEPTH)).max_depth == 64
    err = refused(pushes(HARD_MAX_DEPTH + 1))
    assert "overflow" in str(err) and err.offset == 128
    assert "overflow" in str(refused(pushes(21), max_depth=20))
    # dup in a loop would grow without bound: refused as a depth mismatch at the join
    assert "depth" in str(refused(assemble("const8 1; dup; goto 2; end")))


def test_condition_needs_a_value() -> None:
    code = assemble("getv 1; tracev 1; pop; end")  # GDB's `collect $v`: legal as an action
    assert verify(code).max_depth == 1
    err = refused(code, require_value=True)
    assert err.offset == 7 and "empty stack" in str(err)


def test_tsv_numbers_checked_when_known() -> None:
    code = assemble("getv 3; setv 4; tracev 5; end")
    verify(code)
    err = refused(code, tsv_slots=5)
    assert err.offset == 6 and "trace state variable 5" in str(err)


def test_printf_checks() -> None:
    ok = encode("const8", 1) + encode("const8", 0) + encode("const8", 0) + encode("printf", 1, fmt=b"%d\n") + b"\x27"
    assert verify(ok).max_depth == 3
    wrong_count = encode("const8", 0) + encode("const8", 0) + encode("printf", 1, fmt=b"none") + b"\x27"
    assert "argument" in str(refused(wrong_count))
    bad_directive = encode("const8", 1) + encode("const8", 0) + encode("const8", 0) + encode("printf", 1, fmt=b"%f") + b"\x27"
    assert "unsupported printf directive" in str(refused(bad_directive))
    unterminated = encode("const8", 0) + encode("const8", 0) + b"\x34\x00\x00\x02hi\x27"
    assert "NUL" in str(refused(unterminated))


def test_program_annotations() -> None:
    p = verify(assemble("const8 3; dup; if_goto 8; pop; end; const8 1; sub; dup; if_goto 2; end"))
    assert p.jump_targets == {8, 2}
    assert p.backward_jumps == {12}
    assert p.depth[0] == 0 and p.depth[8] == 1 and p.max_depth == 2
    unreachable = verify(assemble("goto 4; add; end; end"))
    assert not unreachable.reachable(3) and unreachable.reachable(4)
