"""Differential harness: one bytecode, four engines (interpreter, naive, optimized, optimized with live
registers), the same memory, registers, TSVs and trace room; every observable must agree."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kgtp_sim.agent.blocks import split_blocks
from kgtp_sim.agent.compile_naive import compile_naive
from kgtp_sim.agent.compile_opt import compile_opt
from kgtp_sim.agent.context import SimpleContext
from kgtp_sim.agent.interp import evaluate
from kgtp_sim.agent.opcodes import OpClass
from kgtp_sim.agent.sandbox import CODE_BASE, Sandbox, TRACE_SIZE
from kgtp_sim.agent.verify import Program, verify
from kgtp_sim.agent import abi

DATA_ADDR = 0xFFFFFFFF81200000  # readable test memory (kernel-like address: fits a sign-extended disp32)
DATA_SIZE = 0x2000
STRING_ADDR = DATA_ADDR + 0x1F00  # a few NUL-terminated strings, the last one runs into unmapped memory
UNMAPPED = 0xFFFFFFFF81F00000
ALL_LIVE = frozenset(abi.LIVE_CANDIDATES)


def make_memory(seed: int = 1) -> bytes:
    rng = random.Random(seed)
    data = bytearray(rng.randbytes(DATA_SIZE))
    strings = b"kgtp\0tracepoint\0\0x\0" + b"A" * 40 + b"\0"
    off = STRING_ADDR - DATA_ADDR
    data[off : off + len(strings)] = strings
    data[-8:] = b"unterm!!"  # no NUL before the end of the mapping
    return bytes(data)


@dataclass
class Outcome:
    value: int | None
    error: tuple[int, int] | None
    blocks: list[bytes]
    tsvs: dict[int, int]
    output: list[str] = field(default_factory=list)
    cost: int = 0


class Differential:
    def __init__(self, memory: Mapping[int, bytes] | None = None) -> None:
        self.sb = Sandbox()
        source = dict(memory) if memory is not None else {DATA_ADDR: make_memory()}
        # whole pages, zero-filled: the sandbox maps pages, and the interpreter must see the same bytes
        self.memory = {}
        for addr, data in source.items():
            start, end = addr & ~0xFFF, (addr + len(data) + 0xFFF) & ~0xFFF
            self.memory[start] = bytearray(addr - start) + bytearray(data) + bytearray(end - addr - len(data))
        for addr, data in self.memory.items():
            self.sb.map_memory(addr, bytes(data))

    def poke(self, address: int, data: bytes) -> None:
        """Change memory for every engine (the address must be inside a mapped region)."""
        for start, buf in self.memory.items():
            if start <= address and address + len(data) <= start + len(buf):
                buf[address - start : address - start + len(data)] = data
                self.sb.map_memory(address, data)
                return
        raise ValueError(f"0x{address:x} is not in the test memory")

    def interp(self, program: Program, registers: Sequence[int], tsvs: Mapping[int, int], trace_limit: int, loop_budget: int) -> Outcome:
        ctx = SimpleContext(registers=list(registers), tsvs=dict(tsvs), trace_limit=trace_limit)
        for addr, data in self.memory.items():
            ctx.map(addr, bytes(data))
        res = evaluate(program, ctx, loop_budget=loop_budget)
        numbers = _tsv_numbers(program)
        return Outcome(
            res.value,
            (int(res.error.code), res.error.offset) if res.error else None,
            split_blocks(bytes(ctx.trace)),
            {n: ctx.tsv_get(n) for n in numbers},
            ctx.output,
            res.steps,
        )

    def native(self, compiled, registers, tsvs, trace_limit, loop_budget) -> Outcome:
        run = self.sb.run(compiled, registers, tsvs, trace_limit=trace_limit, loop_budget=loop_budget)
        err = run.result.error
        return Outcome(
            run.result.value,
            (int(err.code), err.offset) if err else None,
            run.blocks,
            run.tsvs,
            run.output,
            run.instructions,
        )

    def run(
        self,
        code: bytes | Program,
        registers: Sequence[int] = (),
        tsvs: Mapping[int, int] | None = None,
        *,
        trace_limit: int = TRACE_SIZE,
        loop_budget: int = 100,
    ) -> dict[str, Outcome]:
        program = code if isinstance(code, Program) else verify(code)
        regs = list(registers) + [0] * (24 - len(registers))
        regs = [v & (2**64 - 1) if abi.REG_SIZE[i] == 8 else v & 0xFFFFFFFF for i, v in enumerate(regs)]
        tsvs = dict(tsvs or {})
        out = {"interp": self.interp(program, regs, tsvs, trace_limit, loop_budget)}
        out["naive"] = self.native(compile_naive(program, CODE_BASE), regs, tsvs, trace_limit, loop_budget)
        out["opt"] = self.native(compile_opt(program, CODE_BASE + 0x40000), regs, tsvs, trace_limit, loop_budget)
        out["opt_live"] = self.native(
            compile_opt(program, CODE_BASE + 0x80000, ALL_LIVE), regs, tsvs, trace_limit, loop_budget
        )
        return out

    def check(self, code: bytes | Program, *args, **kwargs) -> Outcome:
        """Run every engine and assert they agree; returns the interpreter's outcome."""
        out = self.run(code, *args, **kwargs)
        ref = out["interp"]
        for engine, got in out.items():
            for attr in ("error", "value", "blocks", "tsvs", "output"):
                assert getattr(got, attr) == getattr(ref, attr), (
                    f"{engine} differs from the interpreter in {attr}: {getattr(got, attr)!r} != {getattr(ref, attr)!r}"
                    f"\nbytecode: {(code.code if isinstance(code, Program) else code).hex()}"
                )
        return ref


def _tsv_numbers(program: Program) -> list[int]:
    return sorted({i.arg for i in program.insns if i.op.cls is OpClass.TSV or i.name == "tracev"})
