"""What one evaluation of an expression costs, per engine.

For the two compilers the unit is emulated x86_64 instructions, from the function's first instruction to its
`ret` inclusive (helpers and the printf trap's `ret` included), counted in a `Sandbox` by a native unicorn code
hook. For the interpreter there are no machine instructions to count: the unit is bytecode operations executed,
and `Cost.unit` says so.

Thread: the caller's (the compiler tests in tests/agent); the compiled engines are measured in a `Sandbox` (the
caller's, or one made for the call).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .compile_naive import compile_naive
from .compile_opt import compile_opt
from .context import SimpleContext
from .interp import DEFAULT_LOOP_BUDGET, evaluate
from .sandbox import CODE_BASE, Sandbox
from .verify import Program, verify

ENGINES = ("interp", "naive", "opt")


@dataclass(frozen=True)
class Cost:
    engine: str
    count: int
    unit: str  # "x86 instructions" or "bytecode ops"
    ok: bool  # the evaluation ended without an error

    def __int__(self) -> int:
        return self.count

    def __str__(self) -> str:
        return f"{self.engine}: {self.count} {self.unit}"


def instruction_count(
    bytecode: bytes | Program,
    engine: str = "opt",
    *,
    memory: Mapping[int, bytes] | None = None,
    registers: Sequence[int] = (),
    tsvs: Mapping[int, int] | None = None,
    live_registers: frozenset[int] = frozenset(),
    loop_budget: int = DEFAULT_LOOP_BUDGET,
    sandbox: Sandbox | None = None,
) -> Cost:
    """Cost of one evaluation of `bytecode` with `engine` ("interp", "naive" or "opt").

    `memory` maps addresses to bytes the expression may read; `registers` are GDB regnums 0..23 (for `opt`, the
    registers in `live_registers` also hold their values at entry)."""
    program = bytecode if isinstance(bytecode, Program) else verify(bytecode)
    if engine == "interp":
        ctx = SimpleContext(registers=list(registers) + [0] * (24 - len(registers)), tsvs=dict(tsvs or {}))
        for addr, data in (memory or {}).items():
            ctx.map(addr, data)
        result = evaluate(program, ctx, loop_budget=loop_budget)
        return Cost(engine, result.steps, "bytecode ops", result.ok)
    if engine == "naive":
        compiled = compile_naive(program, CODE_BASE)
    elif engine == "opt":
        compiled = compile_opt(program, CODE_BASE, live_registers)
    else:
        raise ValueError(f"unknown engine {engine!r} (one of {ENGINES})")
    sb = sandbox or Sandbox()
    for addr, data in (memory or {}).items():
        sb.map_memory(addr, data)
    run = sb.run(compiled, registers, tsvs, loop_budget=loop_budget)
    return Cost(engine, run.instructions, "x86 instructions", run.result.ok)
