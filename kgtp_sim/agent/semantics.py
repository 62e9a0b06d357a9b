"""Exact 64-bit semantics of the pure agent opcodes, shared by the interpreter and constant folding.

Values are unsigned 64-bit integers (Python ints in 0..2**64-1). Definitions that GDB leaves to the host C
compiler are fixed here, and the native code of both compilers implements exactly these:

- `div_signed`/`rem_signed` truncate toward zero (C99); `rem` takes the dividend's sign. A zero divisor is
  `DIVIDE_BY_ZERO`; INT64_MIN / -1 and INT64_MIN % -1 are `DIVIDE_OVERFLOW` (x86 `idiv` traps on both: GDB 13's
  own `print` dies of SIGFPE there and gdbserver's interpreter would too).
- Shift counts are the whole 64-bit top of stack, unsigned. A count of 64 or more gives what GDB 13 prints for
  the same C expression (`print 1L << 64` is 0, `print -8L >> 200` is -1): `lsh` and `rsh_unsigned` give 0,
  `rsh_signed` gives 0 or -1 (the sign filled in). gdbserver compiles `a << b` in C, which is undefined for such
  counts and on amd64 would take the count modulo 64; GDB's answer is the defined one, so it is the one here.
- `ext n` sign-extends from bit n-1; for n >= 64 it is a no-op (as agentexpr.texi says). `ext 0` and
  `zero_ext 0` give 0 (zero significant bits). `zero_ext n` keeps the low n bits.
- `ref8..ref64` push the value zero-extended (unlike gdbserver's amd64 ref8/ref16 native snippets).
- Comparisons push 1 or 0; `log_not` pushes 1 for 0, else 0.

Pure functions: the interpreter calls them at a hit, on the CPU thread; the optimizing compiler folds constants with
them where a location is compiled (compile_naive.py says where); tests call them on their own thread.
"""

from __future__ import annotations

from .errors import ErrorCode

MASK = (1 << 64) - 1
SIGN = 1 << 63
INT64_MIN = SIGN


def signed(value: int) -> int:
    return value - (1 << 64) if value & SIGN else value


def ext(value: int, bits: int) -> int:
    if bits >= 64:
        return value
    if bits == 0:
        return 0
    value &= (1 << bits) - 1
    if value >> (bits - 1):
        value -= 1 << bits
    return value & MASK


def zero_ext(value: int, bits: int) -> int:
    if bits >= 64:
        return value
    return value & ((1 << bits) - 1)


def _div_trunc(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def binary(name: str, a: int, b: int) -> int | ErrorCode:
    """`a` is the next-to-top entry, `b` the top; returns the result or an ErrorCode."""
    if name == "add":
        return (a + b) & MASK
    if name == "sub":
        return (a - b) & MASK
    if name == "mul":
        return (a * b) & MASK
    if name == "bit_and":
        return a & b
    if name == "bit_or":
        return a | b
    if name == "bit_xor":
        return a ^ b
    if name == "equal":
        return int(a == b)
    if name == "less_signed":
        return int(signed(a) < signed(b))
    if name == "less_unsigned":
        return int(a < b)
    if name == "lsh":
        return (a << b) & MASK if b < 64 else 0
    if name == "rsh_unsigned":
        return a >> b if b < 64 else 0
    if name == "rsh_signed":
        return (signed(a) >> min(b, 63)) & MASK
    if name in ("div_unsigned", "rem_unsigned"):
        if b == 0:
            return ErrorCode.DIVIDE_BY_ZERO
        return a // b if name == "div_unsigned" else a % b
    if name in ("div_signed", "rem_signed"):
        if b == 0:
            return ErrorCode.DIVIDE_BY_ZERO
        if a == INT64_MIN and b == MASK:
            return ErrorCode.DIVIDE_OVERFLOW
        sa, sb = signed(a), signed(b)
        q = _div_trunc(sa, sb)
        return (q if name == "div_signed" else sa - q * sb) & MASK
    raise KeyError(name)


def unary(name: str, a: int, arg: int = 0) -> int:
    if name == "log_not":
        return int(a == 0)
    if name == "bit_not":
        return a ^ MASK
    if name == "ext":
        return ext(a, arg)
    if name == "zero_ext":
        return zero_ext(a, arg)
    raise KeyError(name)


BINARY_OPS = frozenset(
    "add sub mul div_signed div_unsigned rem_signed rem_unsigned lsh rsh_signed rsh_unsigned bit_and bit_or bit_xor"
    " equal less_signed less_unsigned".split()
)
UNARY_OPS = frozenset(("log_not", "bit_not", "ext", "zero_ext"))
