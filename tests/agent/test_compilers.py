"""Both compilers: every opcode compiles, the ABI holds (registers, stack, faults), live registers, speed."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from unicorn.x86_const import UC_X86_REG_RIP

from kgtp_sim.agent import abi
from kgtp_sim.agent.compile_naive import compile_naive
from kgtp_sim.agent.compile_opt import compile_opt
from kgtp_sim.agent.compiled import fault_fixup
from kgtp_sim.agent.errors import ErrorCode
from kgtp_sim.agent.measure import instruction_count
from kgtp_sim.agent.opcodes import OPCODES, OpClass, assemble, encode
from kgtp_sim.agent.sandbox import CODE_BASE, Sandbox
from kgtp_sim.agent.verify import verify

from .harness import DATA_ADDR, STRING_ADDR, UNMAPPED, Differential

CORPUS = json.loads((Path(__file__).parent / "data" / "gdb13_corpus.json").read_text())
COMPILERS = {"naive": compile_naive, "opt": compile_opt}

# one small program per supported opcode (the opcode under test in the middle)
PROGRAMS = {
    "add": "const8 1; const8 2; add; end", "sub": "const8 1; const8 2; sub; end", "mul": "reg 1; const8 3; mul; end",
    "div_signed": "reg 1; const8 3; div_signed; end", "div_unsigned": "reg 1; reg 2; div_unsigned; end",
    "rem_signed": "reg 1; reg 2; rem_signed; end", "rem_unsigned": "reg 1; const8 3; rem_unsigned; end",
    "lsh": "reg 1; reg 2; lsh; end", "rsh_signed": "reg 1; const8 3; rsh_signed; end",
    "rsh_unsigned": "reg 1; reg 2; rsh_unsigned; end", "trace": f"const64 {DATA_ADDR}; reg 3; trace; end",
    "trace_quick": f"const64 {DATA_ADDR}; trace_quick 9; end", "log_not": "reg 1; log_not; end",
    "bit_and": "reg 1; reg 2; bit_and; end", "bit_or": "reg 1; const8 6; bit_or; end",
    "bit_xor": "reg 1; reg 2; bit_xor; end", "bit_not": "reg 1; bit_not; end", "equal": "reg 1; reg 2; equal; end",
    "less_signed": "reg 1; reg 2; less_signed; end", "less_unsigned": "reg 1; reg 2; less_unsigned; end",
    "ext": "reg 1; ext 12; end", "ref8": f"const64 {DATA_ADDR}; ref8; end", "ref16": f"const64 {DATA_ADDR}; ref16; end",
    "ref32": f"const64 {DATA_ADDR}; ref32; end", "ref64": f"const64 {DATA_ADDR}; ref64; end",
    "if_goto": "reg 1; if_goto 9; const8 1; end; const8 2; end", "goto": "goto 4; end; const8 7; end",
    "const8": "const8 200; end", "const16": "const16 60000; end", "const32": "const32 4000000000; end",
    "const64": "const64 18446744073709551615; end", "reg": "reg 17; end", "end": "end", "dup": "reg 1; dup; mul; end",
    "pop": "reg 1; reg 2; pop; end", "zero_ext": "reg 1; zero_ext 40; end", "swap": "reg 1; reg 2; swap; sub; end",
    "getv": "getv 2; end", "setv": "reg 1; setv 2; end", "tracev": "tracev 2; end",
    "tracenz": f"const64 {STRING_ADDR}; const8 50; tracenz; end", "trace16": f"const64 {DATA_ADDR}; trace16 300; end",
    "pick": "reg 1; reg 2; reg 3; pick 2; end", "rot": "reg 1; reg 2; reg 3; rot; end",
}


def _program_for(name: str) -> bytes:
    if name == "printf":
        return encode("reg", 1) + encode("const8", 0) + encode("const8", 0) + encode("printf", 1, fmt=b"%lx") + b"\x27"
    return assemble(PROGRAMS[name])


@pytest.fixture(scope="module")
def diff() -> Differential:
    return Differential()


@pytest.mark.parametrize("name", [op.name for op in OPCODES if op.supported])
def test_every_opcode_compiles_and_agrees(diff, name) -> None:
    code = _program_for(name)
    assert any(op_name == name for op_name in _names(code))
    for regs in ([0, 7, 3, 12], [0, 2**64 - 1, 64, 5], [0, 2**63, 2**64 - 1, 0]):
        diff.check(code, regs, {2: 99})


@pytest.mark.parametrize("loads", [5, 6, 7, 8])
def test_a_compare_keeps_its_left_operand_when_the_right_one_needs_a_register(diff, loads) -> None:
    """`loads` values held in registers, the division's %rax and %rdx taken, then `getv 0 == reg 19` (a 4-byte
    slot, so it needs a register): the allocator used to spill the left operand to make room and then compare
    the right one with itself, so 0 == 1 came out true and a division by zero went unnoticed (found by the fuzz
    test)."""
    code = assemble("; ".join([f"const64 {DATA_ADDR:#x}; ref8"] * loads
                              + ["reg 0", "getv 0", "reg 19", "equal", "div_signed"] + ["add"] * loads + ["end"]))
    regs = [0] * 24
    regs[19] = 1
    assert diff.check(code, regs, {}).error == (ErrorCode.DIVIDE_BY_ZERO, 10 * loads + 10)
    regs[19] = 0  # now equal: 0 / 1, and the sum of the loads
    assert diff.check(code, regs, {}).error is None


def _names(code: bytes) -> list[str]:
    return [i.name for i in verify(code).insns]


def test_float_opcodes_are_refused_before_compiling() -> None:
    for op in OPCODES:
        if op.cls is OpClass.FLOAT:
            with pytest.raises(ValueError):
                verify(bytes([op.code, 0x27]))


def test_code_is_position_independent() -> None:
    program = verify(bytes.fromhex(CORPUS["entries"][1]["bytecode"]))
    for compile_ in COMPILERS.values():
        a, b = compile_(program, CODE_BASE), compile_(program, CODE_BASE + 0x12340)
        assert a.code == b.code and b.fault_exit - b.base == a.fault_exit - a.base


def test_fault_fixup_in_body_and_in_helper() -> None:
    sb = Sandbox()
    sb.map_memory(DATA_ADDR, bytes(64))
    for compile_ in COMPILERS.values():
        ref = compile_(verify(assemble(f"const8 1; const64 {UNMAPPED + 8}; ref16; end")), CODE_BASE)
        run = sb.run(ref)
        assert run.result.error.code == ErrorCode.MEMORY_FAULT and run.result.error.offset == 11
        assert run.result.error.address == UNMAPPED + 8
        helper = compile_(verify(assemble(f"const64 {DATA_ADDR + 4096 - 60}; const16 1000; trace; end")), CODE_BASE + 0x1000)
        run = sb.run(helper)
        assert (run.result.error.code, run.result.error.offset) == (ErrorCode.MEMORY_FAULT, 12)
        assert run.trace == b""


def test_fault_fixup_ignores_other_code() -> None:
    sb = Sandbox()
    compiled = compile_naive(verify(assemble("const8 1; end")), CODE_BASE)
    sb.load(compiled)
    sb.uc.reg_write(UC_X86_REG_RIP, CODE_BASE + 0x8000)
    assert fault_fixup(sb.uc, compiled, 0) is False
    assert sb.uc.reg_read(UC_X86_REG_RIP) == CODE_BASE + 0x8000


def test_live_registers_are_read_live() -> None:
    sb = Sandbox()
    code = verify(assemble("reg 1; reg 12; add; reg 15; add; end"))
    regs = [0] * 24
    regs[1], regs[12], regs[15] = 1, 10, 100
    live = {1: 2, 12: 20, 15: 200}
    assert sb.run(compile_opt(code, CODE_BASE), regs, live=live).result.value == 111
    assert sb.run(compile_opt(code, CODE_BASE, {1, 12, 15}), regs, live=live).result.value == 222
    assert sb.run(compile_opt(code, CODE_BASE, {1}), regs, live=live).result.value == 112
    with pytest.raises(ValueError):
        compile_opt(code, CODE_BASE, {0})


def test_pointerless_compiles_read_the_site_registers_and_agree_with_the_interpreter() -> None:
    """The false-condition fast path calls its condition with the site's own %rdi and %rsi in place (no register
    block, no context). GDB's real conditions that qualify give the interpreter's value; what needs a pointer is
    refused."""
    from kgtp_sim.agent.context import SimpleContext
    from kgtp_sim.agent.interp import evaluate

    sb = Sandbox()
    compiled_any = False
    for entry in CORPUS["entries"]:
        program = verify(bytes.fromhex(entry["bytecode"]))
        read = {i.arg for i in program.insns if i.name == "reg"}
        try:
            code = compile_opt(program, CODE_BASE, read, pointerless=True)
        except ValueError:
            continue
        compiled_any = True
        for regs in ([0] * 24, [(7 * n + 3) << (n % 5 * 12) for n in range(24)], [2**64 - 1 - n for n in range(24)]):
            regs = [v & (2**64 - 1) if abi.REG_SIZE[n] == 8 else v & 0xFFFFFFFF for n, v in enumerate(regs)]
            expected = evaluate(program, SimpleContext(registers=regs)).value
            assert sb.run(code, regs).result.value == expected, entry["expression"]
    assert compiled_any
    refused = ("reg 5; reg 0; add; end", "reg 5; getv 1; add; end", "reg 5; ref8; end", "reg 4; const8 0; div_signed; end")
    for source in refused:  # rax is not kept live; TSVs and memory need the context; division can fail
        with pytest.raises(ValueError, match="without pointers"):
            program = verify(assemble(source))
            compile_opt(program, CODE_BASE, {i.arg for i in program.insns if i.name == "reg"} & {4, 5}, pointerless=True)


def test_branch_compiles_jump_where_the_condition_is_true_and_fall_through_where_false() -> None:
    """The fast path's inline form: no `ret`, no value; non-zero jumps to `true_exit`, zero falls off the end.
    Checked in unicorn against the interpreter's truthiness, with the site's registers in place."""
    from unicorn import UC_ARCH_X86, UC_MODE_64, Uc
    from unicorn.x86_const import UC_X86_REG_RAX, UC_X86_REG_RBX, UC_X86_REG_RDI, UC_X86_REG_RSI

    from kgtp_sim.agent.context import SimpleContext
    from kgtp_sim.agent.interp import evaluate

    base, true_exit = 0x10000, 0x11000
    sources = [e["bytecode"] for e in CORPUS["entries"]] + [assemble(text).hex() for text in (
        "reg 5; const8 3; less_signed; end",  # a compare: the jcc itself
        "reg 5; reg 4; sub; end",  # a value: test and jne
        "const8 1; end", "const8 0; end",  # constants: a jmp, or nothing at all
        "reg 5; if_goto 10; reg 4; end; reg 1; const8 9; equal; end",  # two `end`s: the first jumps to the false exit
        "reg 5; reg 4; less_unsigned; reg 1; const8 0; equal; log_not; bit_or; end",
    )]
    checked = 0
    for source in sources:
        program = verify(bytes.fromhex(source))
        live = {i.arg for i in program.insns if i.name == "reg"}
        try:
            code = compile_opt(program, base, live, pointerless=True, true_exit=true_exit).code
        except ValueError:
            continue
        uc = Uc(UC_ARCH_X86, UC_MODE_64)
        uc.mem_map(base, 0x2000)
        # false: fall off the end into `mov $2,%eax; hlt`; true: `mov $1,%eax; hlt`
        uc.mem_write(base, code + bytes.fromhex("b802000000f4"))
        uc.mem_write(true_exit, bytes.fromhex("b801000000f4"))
        for values in ((0, 0, 0), (5, 7, 9), (2, 1, 9), (2**64 - 1, 3, 0), (9, 2**63, 1)):
            regs = [0] * 24
            regs[5], regs[4], regs[1] = values
            for reg, value in zip((UC_X86_REG_RDI, UC_X86_REG_RSI, UC_X86_REG_RBX), values):
                uc.reg_write(reg, value)
            uc.emu_start(base, 0xFFFF_FFFF_FFFF_FFFF)
            truth = bool(evaluate(program, SimpleContext(registers=regs)).value)
            assert uc.reg_read(UC_X86_REG_RAX) == (1 if truth else 2), (source, values)
            checked += 1
    assert checked >= 5 * 8
    with pytest.raises(ValueError, match="only a pointerless compile"):
        compile_opt(verify(assemble("reg 1; end")), base, {1}, true_exit=true_exit)


def test_printf_without_trap_only_pops() -> None:
    sb = Sandbox()
    code = verify(_program_for("printf")[:-1] + encode("const8", 3) + b"\x27")
    for compile_ in COMPILERS.values():
        assert sb.run(compile_(code, CODE_BASE), [0, 255], printf=True).output == ["ff"]
        run = sb.run(compile_(code, CODE_BASE), [0, 255], printf=False)
        assert run.output == [] and run.result.value == 3


def test_deep_expressions(diff) -> None:
    """Depth 20 (GDB's limit) and 64 (ours): register pressure, spills and canonical slots at joins."""
    for depth in (20, 64):
        leaves = [f"reg {i % 24}" if i % 3 else f"const64 {DATA_ADDR + 8 * i}; ref64" for i in range(depth)]
        ops = ["add", "mul", "bit_xor", "sub", "less_unsigned", "bit_or"]
        body = "; ".join(leaves) + "; " + "; ".join(ops[i % len(ops)] for i in range(depth - 1))
        code = assemble(body + "; end")
        assert verify(code).max_depth == depth
        regs = [(i * 0x9E3779B97F4A7C15) & (2**64 - 1) for i in range(24)]
        diff.check(code, regs)
        # the same values kept across a join: every entry must survive in its canonical slot
        branchy = _join_program(leaves[: depth - 1], ops)
        diff.check(branchy, regs)
        diff.check(branchy, [0] * 24)


def _join_program(leaves: list[str], ops: list[str]) -> bytes:
    """leaves...; reg 2; if_goto T; const8 1; goto J; T: const8 2; J: <reduce everything>; end"""
    head = assemble("; ".join(leaves) + "; reg 2")
    n = len(head)
    t = n + 3 + 2 + 3
    j = t + 2
    mid = encode("if_goto", t) + encode("const8", 1) + encode("goto", j) + encode("const8", 2)
    tail = assemble("; ".join(ops[i % len(ops)] for i in range(len(leaves))) + "; end")
    return head + mid + tail


def test_warm_compiles_call_no_assembler(monkeypatch) -> None:
    """Compiling at tstart is template copies and patches once the templates are warm: keystone is not called
    (counted, not timed; the timings are the benchmark's), and the code is the same as the cold compile's."""
    from kgtp_sim.agent import asm

    programs = [verify(bytes.fromhex(e["bytecode"])) for e in CORPUS["entries"]]
    cold = [(compile_naive(p, CODE_BASE).code, compile_opt(p, CODE_BASE).code) for p in programs]

    def no_keystone():
        raise AssertionError("keystone called on a warm compile")

    monkeypatch.setattr(asm, "_keystone", no_keystone)
    warm = [(compile_naive(p, CODE_BASE).code, compile_opt(p, CODE_BASE).code) for p in programs]
    assert warm == cold and len(warm) > 10


def test_opt_never_costs_more_than_naive_on_gdb_bytecode() -> None:
    memory = {seg["address"]: bytes.fromhex(seg["hex"]) for seg in CORPUS["segments"]}
    sb = Sandbox()
    for entry in CORPUS["entries"]:
        code = bytes.fromhex(entry["bytecode"])
        naive = instruction_count(code, "naive", memory=memory, sandbox=sb)
        opt = instruction_count(code, "opt", memory=memory, sandbox=sb)
        assert opt.count <= naive.count, (entry["name"], opt.count, naive.count)


def test_agent_ctx_layout() -> None:
    ctx = abi.AgentCtx(tsv_base=1, trace_ptr=2, trace_limit=3, error=4, error_pc=5, saved_rsp=6, loop_budget=7, printf_fn=8, fault_addr=9)
    raw = ctx.pack()
    assert len(raw) == abi.CTX_SIZE == 0x48
    for offset, value in ((abi.CTX_TSV_BASE, 1), (abi.CTX_TRACE_PTR, 2), (abi.CTX_TRACE_LIMIT, 3), (abi.CTX_ERROR, 4),
                          (abi.CTX_ERROR_PC, 5), (abi.CTX_SAVED_RSP, 6), (abi.CTX_LOOP_BUDGET, 7),
                          (abi.CTX_PRINTF_FN, 8), (abi.CTX_FAULT_ADDR, 9)):
        assert struct.unpack_from("<Q", raw, offset)[0] == value
    assert abi.AgentCtx.unpack(raw) == ctx
    assert abi.REG_OFFSET[16] == 128 and abi.REG_OFFSET[17] == 136 and abi.REG_SIZE[17] == 4 and abi.REG_BLOCK_BYTES == 164
