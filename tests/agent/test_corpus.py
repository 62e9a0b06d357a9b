"""The corpus of bytecode real GDB 13 emits (recorded by record_corpus.py): it verifies, and the interpreter and
both compilers agree on it; the thesis' expressions cost what the report says."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest

from kgtp_sim.agent.errors import ErrorCode
from kgtp_sim.agent.measure import instruction_count
from kgtp_sim.agent.verify import GDB_MAX_DEPTH, GDB_MAX_LENGTH, verify

from .harness import Differential

CORPUS = json.loads((Path(__file__).parent / "data" / "gdb13_corpus.json").read_text())
ENTRIES = {e["name"]: e for e in CORPUS["entries"]}
SYMBOLS = CORPUS["symbols"]


def memory() -> dict[int, bytes]:
    return {seg["address"]: bytes.fromhex(seg["hex"]) for seg in CORPUS["segments"]}


@pytest.fixture(scope="module")
def diff() -> Differential:
    return Differential(memory())


def poke_int(diff: Differential, name: str, value: int) -> None:
    addr, size = SYMBOLS[name]
    diff.poke(addr, (value & ((1 << (8 * size)) - 1)).to_bytes(size, "little"))


def test_corpus_is_gdb13() -> None:
    assert " 13." in CORPUS["gdb"]
    assert len(CORPUS["entries"]) >= 40
    for entry in CORPUS["entries"]:
        assert entry["command"].startswith("maint agent")


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_verifies_and_engines_agree(diff: Differential, name: str) -> None:
    entry = ENTRIES[name]
    code = bytes.fromhex(entry["bytecode"])
    program = verify(code, require_value=entry["kind"] == "eval")
    assert program.max_depth == entry["max_depth"] <= GDB_MAX_DEPTH
    rng = random.Random(name)
    for trial in range(4):
        if trial:  # vary the globals the expressions read
            for sym in ("counter1", "counter2", "ucount", "cvar", "ucvar", "svar", "usvar", "lvar", "ulvar"):
                poke_int(diff, sym, rng.choice([0, 1, -1, 7, -300, 2**31 - 1, -(2**31), rng.getrandbits(64)]))
        regs = [rng.getrandbits(64) for _ in range(24)]
        diff.check(code, regs, {1: rng.choice([0, 9, 10, 2**63])}, loop_budget=10)
    diff.check(code, [0] * 24, {}, trace_limit=20)  # the trace area fills up mid-expression


def test_limits_recorded_from_gdb() -> None:
    limits = CORPUS["limits"]
    assert "too complicated" in limits["depth_21_collect_refused"]
    assert "too complicated" in limits["length_185_collect_refused"]
    assert ENTRIES["depth_20"]["max_depth"] == GDB_MAX_DEPTH
    assert ENTRIES["length_184"]["length"] == GDB_MAX_LENGTH


def test_thesis_values(diff: Differential) -> None:
    """Figure 14 of the thesis: counter1=1, counter2=0 gives 2; the parameters come from %rdi/%rsi."""
    code = bytes.fromhex(ENTRIES["thesis_condition_params"]["bytecode"])
    regs = [0] * 24
    regs[5], regs[4] = 1, 0  # rdi = counter1, rsi = counter2
    assert diff.check(code, regs).value == 1
    regs[5], regs[4] = 2**32 - 5, 1  # (int)-5: 2*-5+3 < 0
    assert diff.check(code, regs).value == 0
    poke_int(diff, "counter1", 1)
    poke_int(diff, "counter2", 0)
    out = diff.check(bytes.fromhex(ENTRIES["thesis_collect"]["bytecode"]))
    assert [b[:1] for b in out.blocks] == [b"M", b"M"]
    assert struct.unpack_from("<QH", out.blocks[0], 1) == (SYMBOLS["counter1"][0], 4)


def test_division_errors_match_gdb_semantics(diff: Differential) -> None:
    poke_int(diff, "minval", -(2**63))
    poke_int(diff, "neg1", -1)
    poke_int(diff, "zero", 0)
    for name, code in (
        ("int64_min_div_minus1", ErrorCode.DIVIDE_OVERFLOW),
        ("int64_min_rem_minus1", ErrorCode.DIVIDE_OVERFLOW),
        ("div_by_zero", ErrorCode.DIVIDE_BY_ZERO),
    ):
        out = diff.check(bytes.fromhex(ENTRIES[name]["bytecode"]))
        assert out.error is not None and out.error[0] == code


def test_thesis_instruction_counts() -> None:
    """The optimized code for the thesis' condition + collected expression is well under a third of naive."""
    mem = memory()
    cond = bytes.fromhex(ENTRIES["thesis_condition"]["bytecode"])
    coll = bytes.fromhex(ENTRIES["thesis_collect"]["bytecode"])
    counts = {
        engine: [instruction_count(code, engine, memory=mem).count for code in (cond, coll)]
        for engine in ("naive", "opt")
    }
    naive, opt = sum(counts["naive"]), sum(counts["opt"])
    assert 3 * opt < naive, counts
    ops = instruction_count(cond, "interp", memory=mem)
    assert ops.unit == "bytecode ops" and ops.count == len(verify(cond).insns)
