"""Function-boundary tracing (DTrace's FBT provider, seed 004): which functions of the kernel image take an entry
probe and a return probe (`$kret`), and why not, for the `kgtp-fbt` GDB command (`monitor fbt`).

Pure: reads the image's code, symbols and DWARF; called on the server thread, once per image (`Tracer`).

- **Entry** (`trace *FUNCTION`): a 5-byte jump where optprobes would allow one at the function's first
  instruction, else an int3 (the row says why the jump was refused: probes.plan_probe's reason); refused
  only where even an int3 cannot go (an instruction that may fault by design, a breakpoint already there, a
  branch with only a short form).
- **Return** (`teval $kret=0`, kret.py): the entry hijacks the return address at [%rsp], so the function must be
  entered by a call (or by a tail jump from a function that was): a C function (its DWARF line table says which
  source file its first instruction comes from) or the target of a direct call. The kernel's entry code in
  assembly (the interrupt and exception stubs, `common_entry`, `ret_from_kthread`, `_start`) is entered by the
  CPU or a jump, with an interrupt frame or nothing at [%rsp]: a return probe there would overwrite it. A
  function that never returns (no `ret`, no jump out of it) would only hold an instance forever: refused too, as
  FBT makes no return probe for it.

KGTP (kprobes) also refuses the functions its own handler runs; the tracer here runs no kernel function at a hit
(its hit paths are Python and module-space code), so no function is refused for that reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..patching.probes import X, ProbePlacementError, decode, plan_probe


@dataclass(frozen=True)
class FunctionProbes:
    """One function as `monitor fbt` lists it."""

    name: str
    address: int
    entry: str  #: "jump", "int3", or "" when no probe can go at its first instruction
    entry_note: str  #: why the entry is an int3 (optprobes' refusal of the jump), or why it has no probe
    return_note: str  #: why it takes no return probe ("" when it does)

    @property
    def returns(self) -> bool:
        return bool(self.entry) and not self.return_note


def function_probes(image, source_of: Callable[[int], str | None]) -> list[FunctionProbes]:
    """Every function of the image's text (by address; an alias keeps the first name), in address order.
    `source_of(address)`: the source file of the instruction there (the DWARF line table), None if unknown."""
    low, high = image.text_range
    functions: dict[int, tuple[str, int]] = {}
    for symbol in sorted(image.symbols.values(), key=lambda s: (s.address, s.name)):
        if symbol.type == "FUNC" and symbol.size and low <= symbol.address < high:
            functions.setdefault(symbol.address, (symbol.name, symbol.end))
    decoded = {start: decode(image.read_code(start, end - start), start) for start, (_, end) in functions.items()}
    compiled = {start for start in functions if _compiled(source_of(start))}
    called = {insn.branch_target for start, code in decoded.items() for insn in code
              if insn.id == X.X86_INS_CALL or (insn.id == X.X86_INS_JMP and start in compiled)}  # tail calls
    rows = []
    for start, (name, end) in sorted(functions.items()):
        entry, note = _entry(image, start)
        entered = start in called or start in compiled
        rows.append(FunctionProbes(name, start, entry, note,
                                   _return_note(source_of(start), start, end, decoded[start], entered, entry)))
    return rows


def _compiled(source: str | None) -> bool:
    """Compiled from C (a .c file, or a header's inline code), as opposed to assembly."""
    return source is not None and not source.endswith((".S", ".s"))


def _entry(image, address: int) -> tuple[str, str]:
    try:
        plan_probe(image, address, "jump")
        return "jump", ""
    except ProbePlacementError as refused:
        jump_refused = str(refused)
    try:
        plan_probe(image, address, "int3")
    except ProbePlacementError as refused:
        return "", str(refused)
    return "int3", jump_refused


def _return_note(source: str | None, start: int, end: int, code, entered: bool, entry: str) -> str:
    if not entry:
        return "no entry probe to hijack the return from"
    if not entered:
        return (f"entry code in assembly ({(source or '?').rsplit('/', 1)[-1]}), entered by the CPU or a jump: "
                "[%rsp] holds no return address to hijack")
    leaves = any(insn.id in (X.X86_INS_RET, X.X86_INS_IRETQ) or (insn.id == X.X86_INS_JMP and (
        insn.indirect_jump or insn.branch_target is None or not start <= insn.branch_target < end))
        for insn in code)
    if not leaves:
        return "never returns (no ret, no jump out of it)"
    return ""
