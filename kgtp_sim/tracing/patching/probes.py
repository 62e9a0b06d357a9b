"""Where a probe may go and how the instructions it displaces run elsewhere (kprobes / optprobes rules).

A probe replaces code at its address: one byte (int3) or five (a `jmp rel32` to a detour, like optimized
kprobes). The instructions it covers are copied, relocated, into the detour and executed there before jumping
back. That is only correct when nothing can land inside the covered bytes, so a jump probe is refused when:

- the address is not an instruction boundary of a function in kernel text;
- the five bytes would run past the end of the function;
- another instruction of the function branches into the covered bytes (after the first);
- the function has an indirect jump (a jump table could target the covered bytes: we cannot know);
- a call or software interrupt sits inside the window but not last (its return address would point inside);
- an instruction of the window is in the kernel's exception table, or a fixup target lies inside the window
  (any probe: such an instruction faults by design and its fixup is found by its own address).

An int3 probe covers one instruction and only needs the first rule. Relocation rewrites RIP-relative operands
and relative branches for the new address; calls become `push return; jmp target` so the return address on the
stack is the original one.

Pure: decoding and planning read code through a `CodeSource` and keep no state; called on the CPU thread
at tstart and by the stub's `monitor probes`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol

from ...optional import LazyModule

# capstone, loaded at the first decode (a server that places no probe never loads it)
C = LazyModule("capstone")
X = LazyModule("capstone.x86_const")

JUMP_SIZE = 5
INT3 = b"\xcc"


@cache
def disassembler() -> Any:
    """capstone's x86_64 decoder, with details (operands, groups), made once: any thread may decode with it."""
    cs = C.Cs(C.CS_ARCH_X86, C.CS_MODE_64)
    cs.detail = True
    return cs


@dataclass(frozen=True)
class _Kinds:
    cond_jumps: dict[int, int]  #: a conditional jump's id -> its condition code
    short_only: frozenset[int]  #: branches with no rel32 form
    ends_flow: frozenset[int]
    call_like: frozenset[int]


@cache
def _kinds() -> _Kinds:
    return _Kinds(
        {X.X86_INS_JO: 0x0, X.X86_INS_JNO: 0x1, X.X86_INS_JB: 0x2, X.X86_INS_JAE: 0x3, X.X86_INS_JE: 0x4,
         X.X86_INS_JNE: 0x5, X.X86_INS_JBE: 0x6, X.X86_INS_JA: 0x7, X.X86_INS_JS: 0x8, X.X86_INS_JNS: 0x9,
         X.X86_INS_JP: 0xA, X.X86_INS_JNP: 0xB, X.X86_INS_JL: 0xC, X.X86_INS_JGE: 0xD, X.X86_INS_JLE: 0xE,
         X.X86_INS_JG: 0xF},
        frozenset({X.X86_INS_LOOP, X.X86_INS_LOOPE, X.X86_INS_LOOPNE, X.X86_INS_JRCXZ, X.X86_INS_JECXZ}),
        frozenset({X.X86_INS_RET, X.X86_INS_JMP, X.X86_INS_UD2, X.X86_INS_IRETQ, X.X86_INS_HLT}),
        frozenset({X.X86_INS_CALL, X.X86_INS_INT, X.X86_INS_INT3, X.X86_INS_SYSCALL, X.X86_INS_INT1}))


class ProbePlacementError(ValueError):
    """A probe cannot go there; the message says why, in the user's terms."""


class CodeSource(Protocol):
    text_range: tuple[int, int]

    def function_bounds(self, address: int) -> tuple[str, int, int] | None:
        """(name, start, end) of the function containing `address`, or None."""

    def read_code(self, address: int, length: int) -> bytes:
        """Original bytes of the kernel image (not the live, possibly patched, memory)."""


@dataclass(frozen=True)
class Instruction:
    address: int
    size: int
    code: bytes
    mnemonic: str
    op_str: str
    id: int
    branch_target: int | None  # direct relative branch/call target
    rip_disp_offset: int | None  # byte offset of a RIP-relative displacement inside `code`
    indirect_jump: bool

    @property
    def end(self) -> int:
        return self.address + self.size

    def __str__(self) -> str:
        return f"{self.address:#x}: {self.mnemonic} {self.op_str}".rstrip()


def enters_kernel(code: bytes) -> bool:
    """Is `code` an instruction by which user code enters the kernel (`syscall`, `sysenter`, `int N`)? Such an
    instruction cannot be single-stepped in place for a probe: the kernel runs in between, with the step's TF
    taken for a debugger's (a traced task gets SIGTRAP after the call), and may switch to the program's other
    threads, or deliver a signal, with the probe's int3 lifted."""
    return code[:2] in (b"\x0f\x05", b"\x0f\x34") or code[:1] == b"\xcd"


def decode(code: bytes, address: int) -> list[Instruction]:
    """Linear sweep; stops at the first byte capstone cannot decode."""
    out = []
    for insn in disassembler().disasm(code, address):
        target = None
        rip_offset = None
        indirect = False
        operands = insn.operands
        if insn.group(X.X86_GRP_JUMP) or insn.group(X.X86_GRP_CALL):
            if operands and operands[0].type == C.CS_OP_IMM and insn.group(X.X86_GRP_BRANCH_RELATIVE):
                target = operands[0].imm & ((1 << 64) - 1)
            elif insn.group(X.X86_GRP_JUMP):
                indirect = True
        for op in operands:
            if op.type == C.CS_OP_MEM and op.mem.base == X.X86_REG_RIP:
                rip_offset = insn.disp_offset
        out.append(
            Instruction(insn.address, insn.size, bytes(insn.bytes), insn.mnemonic, insn.op_str, insn.id,
                        target, rip_offset, indirect)
        )
    return out


@dataclass(frozen=True)
class ProbeSite:
    """A vetted probe location: what it overwrites and what must be executed out of line."""

    address: int
    function: str
    kind: str  # "jump" or "int3"
    displaced: tuple[Instruction, ...]
    original: bytes

    @property
    def length(self) -> int:
        return len(self.original)

    @property
    def resume_address(self) -> int:
        """Where the kernel continues after the displaced code: past the last instruction it covers (for int3,
        more than the one byte patched)."""
        return self.displaced[-1].end


def _function_instructions(source: CodeSource, address: int) -> tuple[str, int, int, list[Instruction]]:
    low, high = source.text_range
    if not low <= address < high:
        raise ProbePlacementError(f"{address:#x} is outside kernel text ({low:#x}-{high:#x})")
    bounds = source.function_bounds(address)
    if bounds is None:
        raise ProbePlacementError(f"{address:#x} is not inside a known kernel function")
    name, start, end = bounds
    instructions = decode(source.read_code(start, end - start), start)
    if not any(i.address == address for i in instructions):
        raise ProbePlacementError(f"{address:#x} is in the middle of an instruction of {name}")
    return name, start, end, instructions


def instruction_at(source: CodeSource, address: int) -> Instruction:
    """The instruction of a kernel function that starts at `address`; ProbePlacementError (saying why) when no
    instruction does: outside kernel text or any function, or in the middle of an instruction. The first rule of
    every probe, and what a debugger's breakpoint needs too."""
    _name, _start, _end, instructions = _function_instructions(source, address)
    return next(insn for insn in instructions if insn.address == address)


def plan_probe(source: CodeSource, address: int, kind: str) -> ProbeSite:
    """Check `address` for a probe of `kind` ("jump" or "int3") and return what it displaces."""
    name, _start, end, instructions = _function_instructions(source, address)
    index = next(i for i, insn in enumerate(instructions) if insn.address == address)
    table = getattr(source, "exception_table", ())
    faulting = {insn for insn, _ in table}
    if kind == "int3":
        displaced = (instructions[index],)
        _check_relocatable(displaced, name)
        _check_not_faulting(displaced, faulting, name)
        return ProbeSite(address, name, "int3", displaced, displaced[0].code[:1])
    if kind != "jump":
        raise ValueError(kind)

    window: list[Instruction] = []
    covered = 0
    for insn in instructions[index:]:
        window.append(insn)
        covered += insn.size
        if covered >= JUMP_SIZE:
            break
    if covered < JUMP_SIZE or address + covered > end:
        raise ProbePlacementError(f"a 5-byte jump at {address:#x} would cross the end of {name}")
    inside = {insn.address for insn in window[1:]}
    _check_not_faulting(tuple(window), faulting, name)
    fixups = {fixup for _, fixup in table}
    if inside & fixups:
        raise ProbePlacementError(f"a 5-byte jump at {address:#x} would cover an exception fixup target")
    for insn in instructions:
        if insn.indirect_jump:
            raise ProbePlacementError(f"{name} has an indirect jump ({insn}); a jump probe there is unsafe")
        if insn.branch_target in inside:
            raise ProbePlacementError(
                f"a 5-byte jump at {address:#x} would cover {insn.branch_target:#x}, a jump target of {insn}"
            )
    for insn in window[:-1]:
        if insn.id in _kinds().call_like:
            raise ProbePlacementError(f"{insn} inside the 5-byte window would return into the middle of it")
        if insn.id in _kinds().ends_flow:
            raise ProbePlacementError(f"{insn} inside the 5-byte window ends the flow before the window does")
    _check_relocatable(tuple(window), name)
    original = source.read_code(address, covered)
    return ProbeSite(address, name, "jump", tuple(window), original)


def _check_not_faulting(instructions: tuple[Instruction, ...], faulting: set[int], function: str) -> None:
    """An instruction in the kernel's exception table faults on purpose and is fixed up by its address: run
    out of line it would fault at the copy's address, no fixup would match, and the kernel would die."""
    for insn in instructions:
        if insn.address in faulting:
            raise ProbePlacementError(f"{insn} in {function} is in the kernel's exception table (it may fault "
                                      "by design); it cannot run out of line")


def _check_relocatable(instructions: tuple[Instruction, ...], function: str) -> None:
    for insn in instructions:
        if insn.id in _kinds().short_only:
            raise ProbePlacementError(f"{insn} in {function} has only a short form and cannot be relocated")
        if insn.id in (X.X86_INS_INT3, X.X86_INS_INT1):
            raise ProbePlacementError(f"{insn} in {function} is already a breakpoint")


def _rel32(source_end: int, target: int) -> bytes:
    delta = target - source_end
    if not -(2**31) <= delta < 2**31:
        raise ProbePlacementError(f"target {target:#x} is out of rel32 reach from {source_end:#x}")
    return struct.pack("<i", delta)


def jump(at: int, target: int) -> bytes:
    """`jmp rel32` placed at `at` going to `target`."""
    return b"\xe9" + _rel32(at + JUMP_SIZE, target)


def relocated_size_bound(instructions: tuple[Instruction, ...]) -> int:
    """Bytes `relocate` may need: a call grows to push+jmp (10, or 25 when its return address needs two stores),
    a short branch to its rel32 form (6)."""
    return sum(max(insn.size, 25 if insn.id == X.X86_INS_CALL and _far_return(insn.end) else 10)
               for insn in instructions)


def _far_return(ret: int) -> bool:
    """A return address no sign-extended imm32 push can give (neither the top 2 GiB nor the low 2 GiB)."""
    return (1 << 31) <= ret < (1 << 64) - (1 << 31)


def relocate(instructions: tuple[Instruction, ...], at: int) -> bytes:
    """Re-encode `instructions` to run at address `at` with the same effect as at their own address."""
    out = bytearray()
    for insn in instructions:
        here = at + len(out)
        if insn.branch_target is not None:
            target = insn.branch_target
            if insn.id == X.X86_INS_JMP:
                out += jump(here, target)
            elif insn.id == X.X86_INS_CALL:
                # push the original return address: a sign-extended imm32 reaches the kernel's top 2 GiB and a
                # program's low 2 GiB; elsewhere (a PIE program) the two halves are stored under a lowered rsp
                # (lea and mov leave the flags alone, as the call does)
                ret = insn.end
                if not _far_return(ret):
                    push = b"\x68" + struct.pack("<i", ret - (1 << 64) if ret >> 63 else ret)
                else:
                    push = b"\x48\x8d\x64\x24\xf8"  # lea -8(%rsp),%rsp
                    push += b"\xc7\x04\x24" + struct.pack("<I", ret & 0xFFFFFFFF)  # movl $lo,(%rsp)
                    push += b"\xc7\x44\x24\x04" + struct.pack("<I", ret >> 32)  # movl $hi,4(%rsp)
                out += push
                out += jump(here + len(push), target)
            elif insn.id in _kinds().cond_jumps:
                out += bytes((0x0F, 0x80 | _kinds().cond_jumps[insn.id])) + _rel32(here + 6, target)
            else:
                raise ProbePlacementError(f"cannot relocate branch {insn}")
        elif insn.rip_disp_offset is not None:
            code = bytearray(insn.code)
            (disp,) = struct.unpack_from("<i", code, insn.rip_disp_offset)
            absolute = insn.end + disp
            code[insn.rip_disp_offset : insn.rip_disp_offset + 4] = _rel32(here + insn.size, absolute)
            out += code
        elif insn.id == X.X86_INS_NOP:
            continue  # marker sites and alignment padding: nothing to execute
        else:
            out += insn.code
    return bytes(out)
