"""Disassembler: bytecode -> text in the style of GDB's `maint agent` (`const8 2`, `if_goto 14`).

Used by every error message (verifier and evaluation errors name the op) and by tests and tools that list bytecode. It never
raises: a bad byte is shown as `<unknown 0xNN>` and a truncated operand as `<truncated NAME>`, so it can describe
exactly the bytecode the verifier refused.

Pure: runs on the thread that describes an error (errors.py: the one verifying or evaluating the bytecode) and in
tests.
"""

from __future__ import annotations

from .opcodes import BY_CODE, DecodeError, Insn, decode_at


def format_insn(insn: Insn) -> str:
    """`const8 2`, `reg 6`, `printf "%d\\n", 1 args` (GDB's spelling)."""
    name = insn.op.name
    if name == "printf":
        text = insn.format.decode("latin-1").encode("unicode_escape").decode("ascii").replace('"', '\\"')
        return f'printf "{text}", {insn.arg} args'
    if not insn.operands:
        return name
    return f"{name} {' '.join(str(v) for v in insn.operands)}"


def describe_at(code: bytes, offset: int) -> str:
    """The text of the instruction at `offset`, or a description of why it cannot be decoded."""
    if not 0 <= offset < len(code):
        return "<past the end>"
    try:
        return format_insn(decode_at(code, offset))
    except DecodeError:
        op = BY_CODE.get(code[offset])
        if op is None or op.name == "invalid2":
            return f"<unknown 0x{code[offset]:02x}>"
        return f"<truncated {op.name}>"


def disassemble(code: bytes) -> list[tuple[int, str]]:
    """(offset, text) for every instruction of a linear decode; stops after the first undecodable byte."""
    out: list[tuple[int, str]] = []
    offset = 0
    while offset < len(code):
        try:
            insn = decode_at(code, offset)
        except DecodeError:
            out.append((offset, describe_at(code, offset)))
            break
        out.append((offset, format_insn(insn)))
        offset = insn.next_offset
    return out


def listing(code: bytes) -> str:
    """Multi-line listing with offsets right-aligned, as `maint agent` prints it."""
    return "\n".join(f"{offset:>3}  {text}" for offset, text in disassemble(code))
