"""The one table of GDB agent-expression opcodes (GDB 13's gdbsupport/ax.def), and the decoder built on it.

Every other agent module (verifier, interpreter, disassembler, both compilers) looks opcodes up here, so adding or
changing an opcode is a one-line edit. Each row gives the opcode byte, its name as GDB prints it (`maint agent`),
the sizes of its big-endian operands, and its *real* stack effect: the number of entries it needs, pops and pushes.

The real effect differs from ax.def's CONSUMED/PRODUCED columns in three places, on purpose:

- `tracev` is declared 0 -> 1 in ax.def, but no implementation touches the stack (gdbserver and KGTP only record
  the variable); GDB's own `collect $v` bytecode, `getv n; tracev n; pop; end`, relies on that.
- `pick n` is declared 0 -> 1; it needs n + 1 entries and pushes one.
- `printf` is declared 0 -> 0; it pops 2 + nargs (function, channel, then the arguments).

`swap`/`rot`/`dup` are declared as they behave (2 -> 2, 3 -> 3, 1 -> 2). ax.def's numbers are kept in
`OpInfo.declared` for reference only.

Pure: the table is constant; decoding runs wherever bytecode is verified or disassembled (verify.py says where),
`assemble` on the thread of the tool or test that writes bytecode (tools/fuzz_inputs.py, bench/record.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum


class OpClass(Enum):
    """What kind of work an opcode does; the compilers and the verifier dispatch on it."""

    ARITH = "arith"  # pure: pops operands, pushes a result
    MEMORY = "memory"  # ref8..ref64: may fault
    CONST = "const"
    REG = "reg"
    STACK = "stack"  # dup pop swap rot pick
    JUMP = "jump"  # goto if_goto
    END = "end"
    TSV = "tsv"  # getv setv
    TRACE = "trace"  # trace trace_quick trace16 tracenz tracev
    PRINTF = "printf"
    FLOAT = "float"  # defined by GDB, never generated, not supported here
    INVALID = "invalid"  # placeholder rows in ax.def


@dataclass(frozen=True)
class OpInfo:
    """One row of the opcode table."""

    name: str
    code: int
    operands: tuple[int, ...]  # byte size of each fixed operand (big-endian, unsigned)
    needs: int  # entries that must be on the stack (pick: depends on its operand, see stack_effect)
    pops: int
    pushes: int
    cls: OpClass
    declared: tuple[int, int]  # ax.def's (CONSUMED, PRODUCED), for reference
    data_bits: int = 0  # ax.def's DATA_SIZE (ref/const width)

    @property
    def supported(self) -> bool:
        return self.cls not in (OpClass.FLOAT, OpClass.INVALID)

    @property
    def fixed_size(self) -> int:
        """Encoded size including the opcode byte, for every opcode but printf."""
        return 1 + sum(self.operands)


def _op(
    name: str,
    code: int,
    operands: tuple[int, ...],
    needs: int,
    pops: int,
    pushes: int,
    cls: OpClass,
    declared: tuple[int, int] | None = None,
    data_bits: int = 0,
) -> OpInfo:
    return OpInfo(name, code, operands, needs, pops, pushes, cls, declared or (pops, pushes), data_bits)


A = OpClass
OPCODES: tuple[OpInfo, ...] = (
    _op("float", 0x01, (), 0, 0, 0, A.FLOAT),
    _op("add", 0x02, (), 2, 2, 1, A.ARITH),
    _op("sub", 0x03, (), 2, 2, 1, A.ARITH),
    _op("mul", 0x04, (), 2, 2, 1, A.ARITH),
    _op("div_signed", 0x05, (), 2, 2, 1, A.ARITH),
    _op("div_unsigned", 0x06, (), 2, 2, 1, A.ARITH),
    _op("rem_signed", 0x07, (), 2, 2, 1, A.ARITH),
    _op("rem_unsigned", 0x08, (), 2, 2, 1, A.ARITH),
    _op("lsh", 0x09, (), 2, 2, 1, A.ARITH),
    _op("rsh_signed", 0x0A, (), 2, 2, 1, A.ARITH),
    _op("rsh_unsigned", 0x0B, (), 2, 2, 1, A.ARITH),
    _op("trace", 0x0C, (), 2, 2, 0, A.TRACE),
    _op("trace_quick", 0x0D, (1,), 1, 1, 1, A.TRACE),
    _op("log_not", 0x0E, (), 1, 1, 1, A.ARITH),
    _op("bit_and", 0x0F, (), 2, 2, 1, A.ARITH),
    _op("bit_or", 0x10, (), 2, 2, 1, A.ARITH),
    _op("bit_xor", 0x11, (), 2, 2, 1, A.ARITH),
    _op("bit_not", 0x12, (), 1, 1, 1, A.ARITH),
    _op("equal", 0x13, (), 2, 2, 1, A.ARITH),
    _op("less_signed", 0x14, (), 2, 2, 1, A.ARITH),
    _op("less_unsigned", 0x15, (), 2, 2, 1, A.ARITH),
    _op("ext", 0x16, (1,), 1, 1, 1, A.ARITH),
    _op("ref8", 0x17, (), 1, 1, 1, A.MEMORY, data_bits=8),
    _op("ref16", 0x18, (), 1, 1, 1, A.MEMORY, data_bits=16),
    _op("ref32", 0x19, (), 1, 1, 1, A.MEMORY, data_bits=32),
    _op("ref64", 0x1A, (), 1, 1, 1, A.MEMORY, data_bits=64),
    _op("ref_float", 0x1B, (), 1, 1, 1, A.FLOAT),
    _op("ref_double", 0x1C, (), 1, 1, 1, A.FLOAT),
    _op("ref_long_double", 0x1D, (), 1, 1, 1, A.FLOAT),
    _op("l_to_d", 0x1E, (), 1, 1, 1, A.FLOAT),
    _op("d_to_l", 0x1F, (), 1, 1, 1, A.FLOAT),
    _op("if_goto", 0x20, (2,), 1, 1, 0, A.JUMP),
    _op("goto", 0x21, (2,), 0, 0, 0, A.JUMP),
    _op("const8", 0x22, (1,), 0, 0, 1, A.CONST, data_bits=8),
    _op("const16", 0x23, (2,), 0, 0, 1, A.CONST, data_bits=16),
    _op("const32", 0x24, (4,), 0, 0, 1, A.CONST, data_bits=32),
    _op("const64", 0x25, (8,), 0, 0, 1, A.CONST, data_bits=64),
    _op("reg", 0x26, (2,), 0, 0, 1, A.REG),
    _op("end", 0x27, (), 0, 0, 0, A.END),
    _op("dup", 0x28, (), 1, 1, 2, A.STACK),
    _op("pop", 0x29, (), 1, 1, 0, A.STACK),
    _op("zero_ext", 0x2A, (1,), 1, 1, 1, A.ARITH),
    _op("swap", 0x2B, (), 2, 2, 2, A.STACK),
    _op("getv", 0x2C, (2,), 0, 0, 1, A.TSV),
    _op("setv", 0x2D, (2,), 1, 1, 1, A.TSV),
    _op("tracev", 0x2E, (2,), 0, 0, 0, A.TRACE, declared=(0, 1)),
    _op("tracenz", 0x2F, (), 2, 2, 0, A.TRACE),
    _op("trace16", 0x30, (2,), 1, 1, 1, A.TRACE),
    _op("invalid2", 0x31, (), 0, 0, 0, A.INVALID),
    _op("pick", 0x32, (1,), 1, 0, 1, A.STACK, declared=(0, 1)),
    _op("rot", 0x33, (), 3, 3, 3, A.STACK),
    # printf's operands are variable: u8 nargs, u16 length, then `length` bytes of NUL-terminated format.
    _op("printf", 0x34, (1, 2), 2, 2, 0, A.PRINTF, declared=(0, 0)),
)

BY_CODE: dict[int, OpInfo] = {op.code: op for op in OPCODES}
BY_NAME: dict[str, OpInfo] = {op.name: op for op in OPCODES}
OP: dict[str, int] = {op.name: op.code for op in OPCODES}  # name -> opcode byte, for building bytecode by hand


@dataclass(frozen=True)
class Insn:
    """One decoded instruction: where it is, what it is, its operand values (and printf's format bytes)."""

    offset: int
    op: OpInfo
    operands: tuple[int, ...] = ()
    size: int = 1
    data: bytes = field(default=b"", repr=False)  # printf: the raw format field (length bytes, NUL included)

    @property
    def name(self) -> str:
        return self.op.name

    @property
    def next_offset(self) -> int:
        return self.offset + self.size

    @property
    def arg(self) -> int:
        """The first operand (most opcodes have exactly one)."""
        return self.operands[0]

    @property
    def format(self) -> bytes:
        """printf: the format string up to its first NUL."""
        return self.data.split(b"\0", 1)[0]

    def stack_effect(self) -> tuple[int, int, int]:
        """(entries needed, popped, pushed), with the operand-dependent cases resolved."""
        if self.op.name == "pick":
            return self.arg + 1, 0, 1
        if self.op.name == "printf":
            n = 2 + self.arg
            return n, n, 0
        return self.op.needs, self.op.pops, self.op.pushes


class DecodeError(ValueError):
    """Raised by `decode_at` for a byte that is no opcode or an operand that runs past the end."""

    def __init__(self, message: str, offset: int) -> None:
        super().__init__(message)
        self.offset = offset


def decode_at(code: bytes, offset: int) -> Insn:
    """Decode the instruction at `offset`. Unsupported (float) opcodes decode fine; callers decide."""
    byte = code[offset]
    op = BY_CODE.get(byte)
    if op is None or op.cls is OpClass.INVALID:
        raise DecodeError(f"unknown opcode 0x{byte:02x}", offset)
    pos = offset + 1
    values: list[int] = []
    for width in op.operands:
        if pos + width > len(code):
            raise DecodeError(
                f"truncated {op.name}: needs {op.fixed_size if op.name != 'printf' else 'at least 4'} bytes,"
                f" {len(code) - offset} left",
                offset,
            )
        values.append(int.from_bytes(code[pos : pos + width], "big"))
        pos += width
    data = b""
    if op.name == "printf":
        length = values[1]
        if pos + length > len(code):
            raise DecodeError(f"truncated printf: format of {length} bytes, {len(code) - pos} left", offset)
        data = bytes(code[pos : pos + length])
        pos += length
    return Insn(offset, op, tuple(values), pos - offset, data)


def decode_all(code: bytes) -> tuple[Insn, ...]:
    """Linear decode of a whole expression; raises DecodeError at the first bad byte."""
    out: list[Insn] = []
    offset = 0
    while offset < len(code):
        insn = decode_at(code, offset)
        out.append(insn)
        offset = insn.next_offset
    return tuple(out)


def encode(name: str, *operands: int, fmt: bytes | None = None) -> bytes:
    """Encode one instruction by name (tests, the corpus recorder and hand-written bytecode use this).

    printf takes `fmt` (the format without its terminator) and writes it the way GDB 13 does: the length field
    counts the format plus two NUL bytes, and both are present.
    """
    op = BY_NAME[name]
    if name == "printf":
        (nargs,) = operands
        assert fmt is not None
        body = fmt + b"\0\0"
        return bytes([op.code, nargs]) + len(body).to_bytes(2, "big") + body
    if len(operands) != len(op.operands):
        raise ValueError(f"{name} takes {len(op.operands)} operand(s)")
    out = bytes([op.code])
    for width, value in zip(op.operands, operands):
        out += (value & ((1 << (8 * width)) - 1)).to_bytes(width, "big")
    return out


#: the instructions whose operand is a trace state variable's number
VARIABLE_OPS = ("getv", "setv", "tracev")


def renumber_variables(code: bytes, number: Callable[[int], int]) -> bytes:
    """`code` with the variable number of each getv, setv and tracev replaced by `number(old)` (a target whose
    numbers are not GDB's: stub/variables.py). Bytecode that does not decode is returned as it is, for the
    verifier to refuse with its own message."""
    try:
        insns = decode_all(code)
    except DecodeError:
        return code
    out = bytearray(code)
    for insn in insns:
        if insn.name in VARIABLE_OPS:
            out[insn.offset + 1: insn.offset + 3] = (number(insn.arg) & 0xFFFF).to_bytes(2, "big")
    return bytes(out)


def assemble(text: str) -> bytes:
    """Bytecode from `name operand` lines or `;`-separated items, e.g. "const8 2; const8 3; add; end".

    Jump operands are absolute offsets, as in GDB's listing. printf is written `printf "fmt" nargs`.
    """
    out = b""
    for item in text.replace("\n", ";").split(";"):
        item = item.strip()
        if not item:
            continue
        if item.startswith("printf"):
            rest = item[len("printf") :].strip()
            q = rest.rindex('"')
            fmt = rest[1:q].encode().decode("unicode_escape").encode("latin-1")
            out += encode("printf", int(rest[q + 1 :].strip() or "0", 0), fmt=fmt)
            continue
        name, *args = item.split()
        out += encode(name, *(int(a, 0) for a in args))
    return out
