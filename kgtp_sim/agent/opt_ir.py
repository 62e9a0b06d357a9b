"""The optimizing compiler's intermediate values: run-time values (`VReg`) and pure expression trees.

A tree node knows what it can about its value (sign- or zero-extended from how many bits), which is what lets
the optimizer drop redundant `ext`/`zero_ext` and compare in 32 bits. Trees are pure: everything with an effect
is emitted eagerly by the compiler and enters a tree only as a `V` leaf (a computed value).

Pure values of one compilation, on the thread that calls `compile_opt` (compile_naive.py says where the tracer
compiles).
"""

from __future__ import annotations

from collections.abc import Iterator

from . import abi
from . import semantics as sem

SCRATCH = ("rax", "rcx", "rdx", "r8", "r9", "r10", "r11")
_R32 = {"rax": "eax", "rcx": "ecx", "rdx": "edx", "rbx": "ebx", "rbp": "ebp", "rsi": "esi", "rdi": "edi"}
_R16 = {"rax": "ax", "rcx": "cx", "rdx": "dx", "rbx": "bx", "rbp": "bp", "rsi": "si", "rdi": "di"}
_R8 = {"rax": "al", "rcx": "cl", "rdx": "dl", "rbx": "bl", "rbp": "bpl", "rsi": "sil", "rdi": "dil"}
_MAX_NEED = 4  # trees needing more registers than this are split (children materialized first)


def r32(r: str) -> str:
    return _R32.get(r, r + "d")


def r16(r: str) -> str:
    return _R16.get(r, r + "w")


def r8(r: str) -> str:
    return _R8.get(r, r + "b")


def fits32(value: int) -> bool:
    """Whether the u64 `value` is a sign-extended imm32."""
    return value < 2**31 or value >= 2**64 - 2**31


def s32(value: int) -> int:
    return sem.signed(value)


def _sext_bits(value: int) -> int:
    for bits in (8, 16, 32):
        if sem.ext(value, bits) == value:
            return bits
    return 64


# --------------------------------------------------------------------------------------------- values and trees


class VReg:
    """A value computed at run time: in a scratch register, a frame slot, or both (values never change)."""

    __slots__ = ("reg", "slot", "refs", "sext", "zext", "home")

    def __init__(self, reg: str | None = None, slot: int | None = None, sext: int = 64, zext: int = 64) -> None:
        self.reg = reg
        self.slot = slot  # frame offset from %rsp
        self.refs = 1
        self.sext = sext  # the value is sign-extended from this many bits (64: no knowledge)
        self.zext = zext  # the value is below 2**zext
        self.home = False  # the canonical value of a stack position at block entry (slot = its home slot)


class Node:
    sext = 64
    zext = 64


class Const(Node):
    def __init__(self, value: int) -> None:
        self.value = value & sem.MASK
        self.zext = max(self.value.bit_length(), 1)
        self.sext = _sext_bits(self.value)


class BlockReg(Node):
    def __init__(self, n: int) -> None:
        self.n = n
        if abi.REG_SIZE[n] == 4:
            self.zext, self.sext = 32, 64


class LiveReg(Node):
    def __init__(self, reg: str) -> None:
        self.reg = reg


class V(Node):
    def __init__(self, v: VReg) -> None:
        self.v = v

    @property
    def sext(self) -> int:  # type: ignore[override]
        return self.v.sext

    @property
    def zext(self) -> int:  # type: ignore[override]
        return self.v.zext


class Op(Node):
    """A pure operation: add sub imul and or xor not shl shr sar (count `k` or node `b`), ext/zext (`k` bits)."""

    def __init__(self, name: str, a: Node, b: Node | None = None, k: int = 0) -> None:
        self.name, self.a, self.b, self.k = name, a, b, k
        if name == "ext":
            self.sext = k
        elif name == "zext":
            self.zext, self.sext = k, k + 1
        elif name == "and":
            self.zext = min(a.zext, b.zext if b else 64)
        elif name in ("or", "xor") and b is not None:
            self.zext = max(a.zext, b.zext)
        elif name == "shr" and b is None:
            self.zext = 64 - k
        elif name == "sar" and b is None:
            self.sext = 64 - k


class Cmp(Node):
    """0 or 1: `a` compared with `b` under x86 condition `cc`; `wide=False` compares the low 32 bits."""

    zext = 1
    sext = 2

    def __init__(self, cc: str, a: Node, b: Node, wide: bool = True) -> None:
        self.cc, self.a, self.b, self.wide = cc, a, b, wide


def leaves(node: Node) -> Iterator[VReg]:
    if isinstance(node, V):
        yield node.v
    elif isinstance(node, Op):
        yield from leaves(node.a)
        if node.b is not None:
            yield from leaves(node.b)
    elif isinstance(node, Cmp):
        yield from leaves(node.a)
        yield from leaves(node.b)


def need(node: Node) -> int:
    """Registers needed to evaluate a tree (Sethi-Ullman style, conservative)."""
    if isinstance(node, Op):
        la = need(node.a)
        lb = need(node.b) if node.b is not None else 0
        return max(la, lb) if la != lb else la + 1
    if isinstance(node, Cmp):
        la, lb = need(node.a), need(node.b)
        return max(la, lb) if la != lb else la + 1
    return 1


def needs_rcx(node: Node) -> bool:
    """Whether evaluating the tree shifts by a run-time count (which must be in %cl)."""
    if isinstance(node, Op):
        return node.name in ("shlv", "shrv", "sarv") or needs_rcx(node.a) or (node.b is not None and needs_rcx(node.b))
    if isinstance(node, Cmp):
        return needs_rcx(node.a) or needs_rcx(node.b)
    return False


def is_leaf(node: Node) -> bool:
    return isinstance(node, (Const, BlockReg, LiveReg, V))


_ALU = {"add": "add", "sub": "sub", "mul": "imul", "bit_and": "and", "bit_or": "or", "bit_xor": "xor"}
_COMMUTATIVE = {"add", "imul", "and", "or", "xor"}
_CMP_CC = {"equal": "e", "less_signed": "l", "less_unsigned": "b"}
_SIGNED_OR_EQ = {"e", "ne", "l", "ge", "le", "g"}


def strip_low(node: Node, bits: int) -> Node:
    """A cheaper tree equal to `node` in its low `bits` bits (drops extensions that cannot matter there)."""
    if isinstance(node, Op):
        if node.name in ("ext", "zext") and node.k >= bits:
            return strip_low(node.a, bits)
        if node.name in ("add", "sub", "imul", "and", "or", "xor") and node.b is not None:
            a, b = strip_low(node.a, bits), strip_low(node.b, bits)
            if a is not node.a or b is not node.b:
                return Op(node.name, a, b)
        elif node.name == "not":
            a = strip_low(node.a, bits)
            if a is not node.a:
                return Op("not", a)
        elif node.name == "shl" and node.b is None and node.k < bits:
            a = strip_low(node.a, bits - node.k)
            if a is not node.a:
                return Op("shl", a, k=node.k)
    return node


def _is_mem(node: Node) -> bool:
    return (isinstance(node, BlockReg) and abi.REG_SIZE[node.n] == 8) or (isinstance(node, V) and node.v.reg is None)


def _in_reg(node: Node, reg: str) -> bool:
    return isinstance(node, V) and node.v.reg == reg
