"""The optimizing compiler: the bytecode optimizer the thesis proposes (§2.4.1, §3.1) but never built.

Same ABI, same results as the interpreter; much less code per hit. Inside a basic block the bytecode stack is a
*virtual* stack of expression trees, so:

- push/pop pairs disappear: `swap`, `rot`, `dup`, `pick`, `pop` move or drop tree references, no code; a `pop`
  of a pure value drops its whole computation (the value of `collect (2*c1+3*c2)` is never computed);
- constants fold (`const8 2; ext 32` is the constant 2), `ext`/`zero_ext` vanish when the value is already
  extended (after a constant, a sign-extending load, an earlier `ext`), and an `ext 32` that only feeds
  arithmetic whose result is itself `ext 32`-ed is dropped (only the low 32 bits matter);
- `refN; ext N` becomes one sign-extending load, a constant address becomes an absolute operand, `addr+k`
  a displacement; constants become immediates and block registers memory operands;
- comparisons fuse with what consumes them: `less_signed; if_goto` is `cmp; jl`, `swap; less_signed` flips the
  condition, `log_not` inverts it, `end` after a compare is `setcc`; `ext 32` values compare in 32 bits;
- `reg N` reads the live register itself when the caller says it still holds its probe-site value;
- `trace_quick`/`trace16`/`trace` of at most 64 bytes are inlined (room check, header, unrolled copy), so
  collection needs no helper call.

Everything with an effect (memory reads that may fault, division checks, trace writes, TSV reads and writes,
printf, backward jumps) is emitted at its place in bytecode order, with its operands materialized first, so the
first error, the trace blocks and the TSVs are the interpreter's. Pure trees are generated lazily with a small
register allocator over the seven caller-saved scratch registers (spilling to frame slots when they run out).

At block boundaries (jump targets, branches) the stack is put in a canonical place: the top in %rax, the other
entries in fixed frame slots, one per stack position (the verifier guarantees one depth per instruction).
"""

from __future__ import annotations

from collections.abc import Iterator

from . import abi
from . import semantics as sem
from .asm import INVERSE_CC, SWAPPED_CC, CodeBuffer
from .compiled import CompiledExpr
from .errors import ErrorCode
from .opcodes import Insn, OpClass
from .runtime import Stubs, emit_exits, emit_formats, emit_helpers
from .verify import Program

SCRATCH = ("rax", "rcx", "rdx", "r8", "r9", "r10", "r11")
_R32 = {"rax": "eax", "rcx": "ecx", "rdx": "edx", "rbx": "ebx", "rbp": "ebp", "rsi": "esi", "rdi": "edi"}
_R16 = {"rax": "ax", "rcx": "cx", "rdx": "dx", "rbx": "bx", "rbp": "bp", "rsi": "si", "rdi": "di"}
_R8 = {"rax": "al", "rcx": "cl", "rdx": "dl", "rbx": "bl", "rbp": "bpl", "rsi": "sil", "rdi": "dil"}
INLINE_TRACE_MAX = 64
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


# --------------------------------------------------------------------------------------------------- compiler


class _Compiler:
    def __init__(self, program: Program, live: frozenset[int]) -> None:
        self.p = program
        self.live = live
        self.cb = CodeBuffer()
        self.stubs = Stubs()
        self.helpers: set[str] = set()
        self.formats: dict[int, bytes] = {}
        self.ranges: list[tuple[int, int, int]] = []
        self.stack: list[Node] = []
        self.owner: dict[str, VReg | None] = dict.fromkeys(SCRATCH)
        self.pinned: set[str] = set()
        self.uses_frame = False
        nargs = [i.arg for i in program.insns if i.name == "printf"]
        self.args_base = 0
        self.save_base = 8 * max(nargs, default=0)
        self.home_base = self.save_base + 16
        self.spill_base = self.home_base + 8 * max(program.max_depth, 1)
        self.spill_count = 0
        self.free_spills: list[int] = []
        self.label_seq = 0

    # ------------------------------------------------------------------------------------------- emission
    def e(self, text: str, **holes: int) -> None:
        self.cb.emit(text, **holes)

    def new_label(self) -> str:
        self.label_seq += 1
        return f"L{self.label_seq}"

    # ----------------------------------------------------------------------------------------- allocation
    def home(self, position: int) -> int:
        self.uses_frame = True
        return self.home_base + 8 * position

    def new_slot(self) -> int:
        self.uses_frame = True
        if self.free_spills:
            return self.free_spills.pop()
        self.spill_count += 1
        return self.spill_base + 8 * (self.spill_count - 1)

    def take(self, reg: str, v: VReg) -> None:
        self.owner[reg] = v
        v.reg = reg

    def spill(self, v: VReg) -> None:
        if v.slot is None:
            v.slot = self.new_slot()
            self.e(f"mov %{v.reg},0x{v.slot:x}(%rsp)")
        assert v.reg is not None
        self.owner[v.reg] = None
        v.reg = None

    def alloc(self, avoid: tuple[str, ...] = (), prefer: str | None = None) -> str:
        order = ((prefer,) if prefer else ()) + SCRATCH
        for r in order:
            if self.owner[r] is None and r not in self.pinned and r not in avoid:
                return r
        for r in reversed(SCRATCH):  # spill the value least likely to be the stack's top
            v = self.owner[r]
            if v is not None and r not in self.pinned and r not in avoid:
                self.spill(v)
                return r
        raise AssertionError("register allocator: every register is pinned")

    def evict(self, reg: str, avoid: tuple[str, ...] = ()) -> None:
        """Make `reg` free, moving its value to another register (or a slot)."""
        assert reg not in self.pinned, f"evicting pinned {reg}"
        v = self.owner[reg]
        if v is None:
            return
        free = [r for r in SCRATCH if self.owner[r] is None and r not in self.pinned and r not in avoid and r != reg]
        if free:
            self.e(f"mov %{reg},%{free[0]}")
            self.owner[reg] = None
            self.take(free[0], v)
        else:
            self.spill(v)

    def release(self, v: VReg) -> None:
        v.refs -= 1
        if v.refs == 0:
            if v.reg is not None:
                self.owner[v.reg] = None
                v.reg = None
            if v.slot is not None and not v.home:
                self.free_spills.append(v.slot)
            v.slot = None

    def drop(self, node: Node) -> None:
        for v in list(leaves(node)):
            self.release(v)

    def temp(self, reg: str, sext: int = 64, zext: int = 64) -> VReg:
        v = VReg(sext=sext, zext=zext)
        self.take(reg, v)
        return v

    def spill_all(self, keep: tuple[VReg, ...] = ()) -> None:
        for r in SCRATCH:
            v = self.owner[r]
            if v is not None and v not in keep:
                self.spill(v)

    def clobber_all(self) -> None:
        """After a call: no value is in a register any more (they were all spilled first)."""
        for r in SCRATCH:
            v = self.owner[r]
            if v is not None:
                assert v.slot is not None, "live value lost across a call"
                v.reg = None
            self.owner[r] = None

    # ---------------------------------------------------------------------------------------- tree building
    def leafify(self, node: Node) -> Node:
        """Turn a tree into a V leaf (materialized), so it can be shared or used as an address base."""
        if is_leaf(node):
            return node
        return V(self.gen(node))

    def share(self, node: Node) -> Node:
        """A second reference to a leaf (dup/pick)."""
        if isinstance(node, V):
            node.v.refs += 1
        return node

    def bound(self, node: Node) -> Node:
        """Keep trees within the register budget: materialize the hungriest child when needed."""
        if isinstance(node, (Op, Cmp)) and need(node) > _MAX_NEED:
            if isinstance(node, Op):
                if node.b is not None and need(node.b) >= need(node.a):
                    node.b = self.leafify(node.b)
                else:
                    node.a = self.leafify(node.a)
            else:
                if need(node.b) >= need(node.a):
                    node.b = self.leafify(node.b)
                else:
                    node.a = self.leafify(node.a)
        return node

    def mk_binary(self, name: str, a: Node, b: Node) -> Node:
        if isinstance(a, Const) and isinstance(b, Const):
            return Const(sem.binary(name, a.value, b.value))  # type: ignore[arg-type]
        if name in _CMP_CC:
            cc = _CMP_CC[name]
            if name == "less_unsigned" and isinstance(b, Const) and b.value == 0:
                self.drop(a)
                return Const(0)
            wide = True
            if cc in _SIGNED_OR_EQ and isinstance(b, Const) and b.sext <= 32 and isinstance(a, Op) and a.name == "ext" and a.k == 32:
                a, wide = a.a, False
            elif cc in _SIGNED_OR_EQ and isinstance(a, Const) and a.sext <= 32 and isinstance(b, Op) and b.name == "ext" and b.k == 32:
                a, b, cc, wide = b.a, a, SWAPPED_CC[cc], False
            return self.bound(Cmp(cc, a, b, wide))
        if name in ("lsh", "rsh_unsigned", "rsh_signed"):
            if isinstance(b, Const):
                if b.value == 0:
                    return a
                if b.value >= 64:
                    if name == "rsh_signed":
                        return self.bound(Op("sar", a, k=63))
                    self.drop(a)
                    return Const(0)
                return self.bound(Op({"lsh": "shl", "rsh_unsigned": "shr", "rsh_signed": "sar"}[name], a, k=b.value))
            return self.bound(Op({"lsh": "shlv", "rsh_unsigned": "shrv", "rsh_signed": "sarv"}[name], a, b))
        op = _ALU[name]
        if op in _COMMUTATIVE and isinstance(a, Const):
            a, b = b, a
        if isinstance(b, Const):
            v = b.value
            if v == 0 and op in ("add", "sub", "or", "xor"):
                return a
            if v == 0 and op in ("imul", "and"):
                self.drop(a)
                return Const(0)
            if v == 1 and op == "imul":
                return a
            if v == sem.MASK and op == "and":
                return a
        return self.bound(Op(op, a, b))

    def mk_unary(self, name: str, a: Node, k: int) -> Node:
        if isinstance(a, Const):
            return Const(sem.unary(name, a.value, k))
        if name == "log_not":
            if isinstance(a, Cmp):
                return Cmp(INVERSE_CC[a.cc], a.a, a.b, a.wide)
            return self.bound(Cmp("e", a, Const(0)))
        if name == "bit_not":
            return self.bound(Op("not", a))
        if name == "ext":
            if k >= 64 or a.sext <= k:
                return a
            if k == 0:
                self.drop(a)
                return Const(0)
            return self.bound(Op("ext", strip_low(a, k), k=k))
        # zero_ext
        if k >= 64 or a.zext <= k:
            return a
        if k == 0:
            self.drop(a)
            return Const(0)
        return self.bound(Op("zext", strip_low(a, k), k=k))

    # ------------------------------------------------------------------------------------------- codegen
    def gen(self, node: Node, prefer: str | None = None) -> VReg:
        """Evaluate `node` into a register the caller owns (a fresh VReg, refs=1); consumes the node."""
        if isinstance(node, V):
            v = node.v
            if v.refs == 1 and v.reg is not None and v.reg not in self.pinned:
                reg = v.reg
                out = VReg(sext=v.sext, zext=v.zext)
                self.owner[reg] = None
                v.reg = None
                self.release(v)
                self.take(reg, out)
                return out
            r = self.alloc(prefer=prefer)
            if v.reg is not None:
                self.e(f"mov %{v.reg},%{r}")
            else:
                assert v.slot is not None
                self.e(f"mov 0x{v.slot:x}(%rsp),%{r}")
            out = self.temp(r, v.sext, v.zext)
            self.release(v)
            return out
        if isinstance(node, Const):
            r = self.alloc(prefer=prefer)
            self.load_const(r, node.value)
            return self.temp(r, node.sext, node.zext)
        if isinstance(node, BlockReg):
            r = self.alloc(prefer=prefer)
            dst = f"%{r}" if abi.REG_SIZE[node.n] == 8 else f"%{r32(r)}"
            self.e(f"mov 0x{abi.REG_OFFSET[node.n]:x}(%rdi),{dst}")
            return self.temp(r, node.sext, node.zext)
        if isinstance(node, LiveReg):
            r = self.alloc(prefer=prefer)
            self.e(f"mov %{node.reg},%{r}")
            return self.temp(r)
        if isinstance(node, Cmp):
            cc = self.flags(node)
            r = self.alloc(prefer=prefer)  # mov-only spills: the flags survive
            self.e(f"set{cc} %{r8(r)}\nmovzbl %{r8(r)},%{r32(r)}")
            return self.temp(r, 2, 1)
        assert isinstance(node, Op)
        return self.gen_op(node, prefer)

    def load_const(self, r: str, value: int) -> None:
        if value == 0:
            self.e(f"xor %{r32(r)},%{r32(r)}")
        elif value < 2**32:
            self.e(f"mov ${{u32:v}},%{r32(r)}", v=value)
        elif fits32(value):
            self.e(f"movq ${{s32:v}},%{r}", v=s32(value))
        else:
            self.e(f"movabs ${{i64:v}},%{r}", v=value)

    def operand(self, node: Node, hole: str, allow_mem: bool = True) -> tuple[str, dict[int | str, int], VReg | None]:
        """An instruction source operand for `node`: imm32, register or memory; or a temp register.

        Returns (text, holes, temp-to-release). Leaves are only read; V leaves are released by the caller
        through `self.drop` after the instruction (the temp, if any, is released instead)."""
        if isinstance(node, Const) and fits32(node.value):
            return f"${{s32:{hole}}}", {hole: s32(node.value)}, None
        if isinstance(node, LiveReg):
            return f"%{node.reg}", {}, None
        if isinstance(node, BlockReg) and abi.REG_SIZE[node.n] == 8 and allow_mem:
            return f"0x{abi.REG_OFFSET[node.n]:x}(%rdi)", {}, None
        if isinstance(node, V):
            if node.v.reg is not None:
                return f"%{node.v.reg}", {}, None
            if allow_mem:
                assert node.v.slot is not None
                return f"0x{node.v.slot:x}(%rsp)", {}, None
        t = self.gen(node)
        return f"%{t.reg}", {}, t

    def use(self, node: Node, temp: VReg | None) -> None:
        """After an instruction read `node` through `operand`: release what it held."""
        if temp is not None:
            self.release(temp)
        else:
            self.drop(node)

    def prepare(self, node: Op | Cmp) -> None:
        """Before anything is pinned: materialize children that need %rcx (run-time shift counts), so that
        %rcx is never pinned while such a tree is evaluated."""
        if needs_rcx(node.a) and not is_leaf(node.a):
            node.a = self.leafify(node.a)
        if node.b is not None and needs_rcx(node.b) and not is_leaf(node.b):
            node.b = self.leafify(node.b)

    def gen_op(self, node: Op, prefer: str | None) -> VReg:
        name = node.name
        self.prepare(node)
        if name in ("shlv", "shrv", "sarv"):
            return self.gen_var_shift(node, prefer)
        a, b = node.a, node.b
        if name in _COMMUTATIVE and b is not None and is_leaf(a) and not is_leaf(b):
            a, b = b, a
        if b is not None and not is_leaf(b) and need(b) > need(a):
            if name in _COMMUTATIVE:
                a, b = b, a
            else:
                node.b = b = self.leafify(b)
        va = self.gen(a, prefer)
        r = va.reg
        assert r is not None
        if name in _COMMUTATIVE or name == "sub":
            assert b is not None
            self.pinned.add(r)
            if name == "imul" and isinstance(b, Const) and fits32(b.value):
                self.e(f"imul ${{s32:k}},%{r},%{r}", k=s32(b.value))
                self.drop(b)
            else:
                text, holes, t = self.operand(b, "k")
                self.e(f"{name} {text},%{r}", **holes)
                self.use(b, t)
            self.pinned.discard(r)
        elif name == "not":
            self.e(f"not %{r}")
        elif name in ("shl", "shr", "sar"):
            self.e(f"{name} $0x{node.k:x},%{r}")
        elif name == "ext":
            k = node.k
            if k == 8:
                self.e(f"movsbq %{r8(r)},%{r}")
            elif k == 16:
                self.e(f"movswq %{r16(r)},%{r}")
            elif k == 32:
                self.e(f"movslq %{r32(r)},%{r}")
            else:
                self.e(f"shl $0x{64 - k:x},%{r}\nsar $0x{64 - k:x},%{r}")
        elif name == "zext":
            k = node.k
            if k == 8:
                self.e(f"movzbl %{r8(r)},%{r32(r)}")
            elif k == 16:
                self.e(f"movzwl %{r16(r)},%{r32(r)}")
            elif k == 32:
                self.e(f"mov %{r32(r)},%{r32(r)}")
            elif k < 32:
                self.e(f"and ${{s32:m}},%{r}", m=(1 << k) - 1)
            else:
                self.e(f"shl $0x{64 - k:x},%{r}\nshr $0x{64 - k:x},%{r}")
        else:  # pragma: no cover
            raise AssertionError(name)
        va.sext, va.zext = node.sext, node.zext
        return va

    def gen_var_shift(self, node: Op, prefer: str | None) -> VReg:
        """Shift by a run-time count: the count goes to %rcx; counts of 64 or more follow `semantics`."""
        assert node.b is not None
        vc = self.gen(node.b, prefer="rcx")
        if vc.reg != "rcx":
            self.evict("rcx")
            self.e(f"mov %{vc.reg},%rcx")
            self.owner[vc.reg] = None  # type: ignore[index]
            self.take("rcx", vc)
        self.pinned.add("rcx")
        va = self.gen(node.a, prefer=prefer if prefer != "rcx" else None)
        r = va.reg
        self.pinned.discard("rcx")
        skip = self.new_label()
        if node.name == "sarv":
            self.e("cmp $0x3f,%rcx")
            self.cb.jcc("be", skip)
            self.e("mov $0x3f,%ecx")
            self.cb.label(skip)
            self.e(f"sar %cl,%{r}")
        else:
            self.e(f"{node.name[:3]} %cl,%{r}\ncmp $0x3f,%rcx")
            self.cb.jcc("be", skip)
            self.e(f"xor %{r32(r)},%{r32(r)}")
            self.cb.label(skip)
        self.release(vc)
        return va

    def flags(self, node: Cmp) -> str:
        """Emit a compare for `node`; returns the condition code that is true when the node is 1."""
        self.prepare(node)
        a, b, cc = node.a, node.b, node.cc
        if isinstance(a, Const):
            a, b, cc = b, a, SWAPPED_CC[cc]
        width = (lambda r: f"%{r}") if node.wide else (lambda r: f"%{r32(r)}")
        if isinstance(b, Const) and b.value == 0:
            if isinstance(a, V) and a.v.reg is not None:
                self.e(f"test {width(a.v.reg)},{width(a.v.reg)}")
                self.drop(a)
            elif isinstance(a, LiveReg):
                self.e(f"test {width(a.reg)},{width(a.reg)}")
            else:
                va = self.gen(a)
                self.e(f"test {width(va.reg)},{width(va.reg)}")  # type: ignore[arg-type]
                self.release(va)
            return cc
        # left operand (destination position of `cmp`): register or memory
        if isinstance(a, V) and a.v.reg is not None:
            left, lt = width(a.v.reg), None
        elif isinstance(a, LiveReg):
            left, lt = width(a.reg), None
        elif node.wide and isinstance(a, BlockReg) and abi.REG_SIZE[a.n] == 8 and not _is_mem(b):
            left, lt = f"0x{abi.REG_OFFSET[a.n]:x}(%rdi)", None
        elif node.wide and isinstance(a, V) and not _is_mem(b):
            left, lt = f"0x{a.v.slot:x}(%rsp)", None
        else:
            lt = self.gen(a)
            left = width(lt.reg)  # type: ignore[arg-type]
        if lt is not None:
            self.pinned.add(lt.reg)  # type: ignore[arg-type]
        text, holes, t = self.operand(b, "k", allow_mem=not left.endswith(")"))
        if not node.wide and text.startswith("%"):
            text = f"%{r32(text[1:])}"
        self.e(f"cmp{'q' if node.wide else 'l'} {text},{left}", **holes)
        self.use(b, t)
        if lt is not None:
            self.pinned.discard(lt.reg)  # type: ignore[arg-type]
            self.release(lt)
        else:
            self.drop(a)
        return cc

    def gen_into(self, node: Node, reg: str) -> VReg:
        """Evaluate `node` into exactly `reg`."""
        if isinstance(node, V) and node.v.reg == reg and node.v.refs == 1:
            return self.gen(node)
        self.evict(reg)
        v = self.gen(node, prefer=reg)
        if v.reg != reg:
            self.evict(reg)
            self.e(f"mov %{v.reg},%{reg}")
            self.owner[v.reg] = None  # type: ignore[index]
            self.take(reg, v)
        return v

    # ------------------------------------------------------------------------------------ block boundaries
    def start_block(self, depth: int) -> None:
        self.owner = dict.fromkeys(SCRATCH)
        self.pinned = set()
        self.free_spills = []
        self.stack = []
        for i in range(depth - 1):
            v = VReg(slot=self.home(i))
            v.home = True
            self.stack.append(V(v))
        if depth:
            self.stack.append(V(self.temp("rax")))

    def canonicalize(self) -> None:
        """Put the stack in its canonical place: top in %rax, position i < top in home slot i."""
        st = self.stack
        d = len(st)
        top = d - 1

        def in_place(i: int) -> bool:
            node = st[i]
            if not isinstance(node, V):
                return False
            if i == top:
                return node.v.reg == "rax"
            return node.v.home and node.v.slot == self.home_base + 8 * i

        # phase 1: anything that is not a plain value or that lives in another position's home slot -> register
        for i in range(d):
            node = st[i]
            if in_place(i):
                continue
            if isinstance(node, V) and not node.v.home:
                continue
            if i != top and isinstance(node, (LiveReg,)):
                continue
            if i != top and isinstance(node, Const) and fits32(node.value):
                continue
            st[i] = V(self.gen(node, prefer="rax" if i == top else None))
        # phase 2: stores to home slots; register-resident values first, then spilled ones
        for spilled_pass in (False, True):
            for i in range(top):
                node = st[i]
                if in_place(i):
                    continue
                slot = self.home(i)
                if isinstance(node, Const):
                    if not spilled_pass:
                        self.e(f"movq ${{s32:k}},0x{slot:x}(%rsp)", k=s32(node.value))
                elif isinstance(node, LiveReg):
                    if not spilled_pass:
                        self.e(f"mov %{node.reg},0x{slot:x}(%rsp)")
                elif isinstance(node, V):
                    if node.v.reg is not None and not spilled_pass:
                        self.e(f"mov %{node.v.reg},0x{slot:x}(%rsp)")
                    elif node.v.reg is None and spilled_pass:
                        t = self.alloc(avoid=("rax",) if top >= 0 and _in_reg(st[top], "rax") else ())
                        self.e(f"mov 0x{node.v.slot:x}(%rsp),%{t}\nmov %{t},0x{slot:x}(%rsp)")
        if d:
            node = st[top]
            if not in_place(top):
                assert isinstance(node, V)
                v = node.v
                if self.owner["rax"] is not None and self.owner["rax"] is not v:
                    self.evict("rax", avoid=(v.reg,) if v.reg else ())
                if v.reg is not None:
                    self.e(f"mov %{v.reg},%rax")
                    self.owner[v.reg] = None
                else:
                    self.e(f"mov 0x{v.slot:x}(%rsp),%rax")
                self.take("rax", v)
        # the entries below the top now live in their home slots: forget their registers
        for i in range(max(top, 0)):
            if not in_place(i):
                self.drop(st[i])
                v = VReg(slot=self.home_base + 8 * i)
                v.home = True
                st[i] = V(v)

    def discard_stack(self) -> None:
        for node in self.stack:
            self.drop(node)
        self.stack = []

    # ---------------------------------------------------------------------------------------- instructions
    def compile(self) -> None:
        p = self.p
        insns = p.insns
        leaders = set(p.jump_targets) | {0}
        for i, insn in enumerate(insns):
            if insn.op.cls in (OpClass.JUMP, OpClass.END) and i + 1 < len(insns):
                leaders.add(insns[i + 1].offset)
        falls_through = False
        skip_next = False
        last_reachable = max(o for o in p.depth)
        for i, insn in enumerate(insns):
            off = insn.offset
            if skip_next:
                skip_next = False
                continue
            if off not in p.depth:
                falls_through = False
                continue
            if off in leaders:
                if falls_through:
                    self.canonicalize()
                    self.discard_stack()
                self.cb.label(f"bc_{off}")
                self.start_block(p.depth[off])
            start = self.cb.here
            nxt = insns[i + 1] if i + 1 < len(insns) else None
            fuse = (
                nxt is not None
                and nxt.offset not in leaders
                and insn.name in ("ref8", "ref16", "ref32")
                and nxt.name == "ext"
                and nxt.arg == insn.op.data_bits
            )
            # GDB's `if_goto A; goto B; A:` (every && and ||): one inverted branch to B, falling into A
            if (
                insn.name == "if_goto"
                and nxt is not None
                and i + 2 < len(insns)
                and nxt.name == "goto"
                and nxt.arg > nxt.offset
                and nxt.offset not in p.jump_targets
                and insn.arg == insns[i + 2].offset
            ):
                fuse = True
                self.branch(insn, else_target=nxt.arg)
            else:
                self.insn(insn, fuse, is_last=off == last_reachable)
            skip_next = fuse
            if self.cb.here > start:
                self.ranges.append((start, self.cb.here, off))
            falls_through = insn.name not in ("goto", "end")

    def insn(self, insn: Insn, fuse_ext: bool, is_last: bool) -> None:
        name = insn.name
        st = self.stack
        pc = insn.offset
        if name.startswith("const"):
            st.append(Const(insn.arg))
        elif name == "reg":
            n = insn.arg
            st.append(LiveReg(abi.LIVE_CANDIDATES[n]) if n in self.live else BlockReg(n))
        elif name in sem.BINARY_OPS:
            b = st.pop()
            a = st.pop()
            if name.startswith(("div", "rem")):
                st.append(self.divide(name, a, b, pc))
            else:
                st.append(self.mk_binary(name, a, b))
        elif name in sem.UNARY_OPS:
            st.append(self.mk_unary(name, st.pop(), insn.arg if insn.operands else 0))
        elif name.startswith("ref"):
            st.append(self.load(st.pop(), insn.op.data_bits, fuse_ext))
        elif name == "pop":
            self.drop(st.pop())
        elif name == "dup":
            st[-1] = self.leafify(st[-1])
            st.append(self.share(st[-1]))
        elif name == "pick":
            k = -1 - insn.arg
            st[k] = self.leafify(st[k])
            st.append(self.share(st[k]))
        elif name == "swap":
            st[-1], st[-2] = st[-2], st[-1]
        elif name == "rot":
            a, b, c = st[-3:]
            st[-3:] = [c, a, b]
        elif name == "getv":
            r = self.alloc()
            self.e(f"mov 0x{abi.CTX_TSV_BASE:x}(%rsi),%{r}\nmov {{s32:off}}(%{r}),%{r}", off=8 * insn.arg)
            st.append(V(self.temp(r)))
        elif name == "setv":
            self.setv(insn)
        elif name == "tracev":
            self.tracev(insn)
        elif name in ("trace_quick", "trace16"):
            self.trace_const(insn, insn.arg, keep=True)
        elif name == "trace":
            size = st[-1]
            if isinstance(size, Const) and size.value <= INLINE_TRACE_MAX:
                st.pop()
                self.trace_const(insn, size.value, keep=False)
            else:
                self.trace_call(insn, "trace_mem")
        elif name == "tracenz":
            self.trace_call(insn, "trace_str")
        elif name == "printf":
            self.printf(insn)
        elif name == "if_goto":
            self.branch(insn)
        elif name == "goto":
            self.canonicalize()
            self.discard_stack()
            self.jump(insn, f"bc_{insn.arg}")
        elif name == "end":
            self.finish_value()
            if not is_last:
                self.cb.jmp("exit")
        else:  # pragma: no cover
            raise AssertionError(name)

    def branch(self, insn: Insn, else_target: int | None = None) -> None:
        """if_goto: jump to its target when the popped value is non-zero. With `else_target` (fused with the
        following forward goto), jump there when it is zero and fall into the if_goto's target."""
        cond = self.stack.pop()
        self.canonicalize()
        target = f"bc_{insn.arg}"
        if isinstance(cond, Const):
            if cond.value and else_target is None:
                self.jump(insn, target)
            elif not cond.value and else_target is not None:
                self.cb.jmp(f"bc_{else_target}")
        else:
            if not isinstance(cond, Cmp):
                cond = Cmp("ne", cond, Const(0))
            cc = self.flags(cond)
            if else_target is not None:
                self.cb.jcc(INVERSE_CC[cc], f"bc_{else_target}")
            elif insn.arg > insn.offset:
                self.cb.jcc(cc, target)
            else:
                skip = self.new_label()
                self.cb.jcc(INVERSE_CC[cc], skip)
                self.jump(insn, target)
                self.cb.label(skip)
        self.discard_stack()

    def jump(self, insn: Insn, target: str) -> None:
        if insn.arg <= insn.offset:
            self.e(f"cmpq $0x0,0x{abi.CTX_LOOP_BUDGET:x}(%rsi)")
            self.cb.jcc("e", self.stubs.label(ErrorCode.LOOP_BUDGET, insn.offset))
            self.e(f"decq 0x{abi.CTX_LOOP_BUDGET:x}(%rsi)")
        self.cb.jmp(target)

    def finish_value(self) -> None:
        st = self.stack
        if not st:
            self.evict("rax")
            self.e("xor %eax,%eax")
            return
        top = st.pop()
        self.discard_stack()
        if isinstance(top, Cmp):
            cc = self.flags(top)
            self.evict("rax")
            self.e(f"set{cc} %al\nmovzbl %al,%eax")
        elif isinstance(top, Const):
            self.evict("rax")
            self.load_const("rax", top.value)
        else:
            v = self.gen_into(top, "rax")
            self.release(v)

    # ------------------------------------------------------------------------------------------- effects
    def address(self, node: Node, hole: str) -> tuple[str, dict[str, int], VReg | None]:
        """A memory operand for address `node`: absolute disp32, base+disp32, or (base)."""
        if isinstance(node, Const) and fits32(node.value):
            return f"{{s32:{hole}}}(,%riz,1)", {hole: s32(node.value)}, None
        disp = 0
        base = node
        if isinstance(node, Op) and node.name in ("add", "sub") and isinstance(node.b, Const):
            k = node.b.value if node.name == "add" else (-node.b.value) & sem.MASK
            if fits32(k):
                disp, base = s32(k), node.a
        if isinstance(base, LiveReg):
            return f"{{s32:{hole}}}(%{base.reg})", {hole: disp}, None
        if isinstance(base, V) and base.v.reg is not None:
            return f"{{s32:{hole}}}(%{base.v.reg})", {hole: disp}, None
        t = self.gen(base)
        return f"{{s32:{hole}}}(%{t.reg})", {hole: disp}, t

    def load(self, addr: Node, bits: int, sign: bool) -> Node:
        mem, holes, t = self.address(addr, "a")
        if t is not None:
            r = t.reg
        else:
            bases = tuple(v.reg for v in leaves(addr) if v.reg is not None)
            self.pinned.update(bases)
            r = self.alloc()
            self.pinned.difference_update(bases)
        assert r is not None
        if sign:
            ins = {8: f"movsbq {mem},%{r}", 16: f"movswq {mem},%{r}", 32: f"movslq {mem},%{r}"}[bits]
        else:
            ins = {
                8: f"movzbl {mem},%{r32(r)}",
                16: f"movzwl {mem},%{r32(r)}",
                32: f"mov {mem},%{r32(r)}",
                64: f"mov {mem},%{r}",
            }[bits]
        self.e(ins, **holes)
        if t is not None:
            self.owner[r] = None
            t.reg = None
            self.release(t)
        else:
            self.drop(addr)
        v = self.temp(r, sext=bits if sign else (bits + 1 if bits < 64 else 64), zext=64 if sign else bits)
        return V(v)

    def divide(self, name: str, a: Node, b: Node, pc: int) -> Node:
        if isinstance(a, Const) and isinstance(b, Const):
            out = sem.binary(name, a.value, b.value)
            if not isinstance(out, ErrorCode):
                return Const(out)
        unsigned = name.endswith("unsigned")
        if unsigned and isinstance(b, Const) and b.value and b.value & (b.value - 1) == 0:
            k = b.value.bit_length() - 1
            if name == "div_unsigned":
                return self.bound(Op("shr", a, k=k)) if k else a
            return self.mk_binary("bit_and", a, Const(b.value - 1))
        # rax = dividend, divisor in a register other than rax/rdx
        if needs_rcx(a):
            a = self.leafify(a)
        if needs_rcx(b):
            b = self.leafify(b)
        if not (isinstance(a, V) and a.v.reg == "rax" and a.v.refs == 1):
            self.evict("rax")
        self.evict("rdx")
        self.pinned.update(("rax", "rdx"))
        vb = self.gen(b)
        self.pinned.add(vb.reg)  # type: ignore[arg-type]
        self.pinned.discard("rax")
        va = self.gen_into(a, "rax")
        self.pinned.add("rax")
        rb = vb.reg
        bval = b.value if isinstance(b, Const) else None
        if bval is None or bval == 0:
            self.e(f"test %{rb},%{rb}")
            self.cb.jcc("e", self.stubs.label(ErrorCode.DIVIDE_BY_ZERO, pc))
        if not unsigned and (bval is None or bval == sem.MASK) and va.sext == 64:
            self.pinned.discard("rdx")
            t = self.alloc(avoid=("rdx",))
            self.e(f"lea 0x1(%{rb}),%rdx\nmovabs $0x8000000000000000,%{t}\nxor %rax,%{t}\nor %rdx,%{t}")
            self.cb.jcc("e", self.stubs.label(ErrorCode.DIVIDE_OVERFLOW, pc))
            self.pinned.add("rdx")
        self.e(f"xor %edx,%edx\ndiv %{rb}" if unsigned else f"cqo\nidiv %{rb}")
        self.pinned.difference_update(("rax", "rdx", rb))
        self.release(vb)
        if name.startswith("div"):
            va.sext = va.zext = 64
            return V(va)
        self.release(va)
        return V(self.temp("rdx"))

    def setv(self, insn: Insn) -> None:
        st = self.stack
        off = 8 * insn.arg
        base = f"mov 0x{abi.CTX_TSV_BASE:x}(%rsi),%{{t}}\n"
        if isinstance(st[-1], Const) and fits32(st[-1].value):
            t = self.alloc()
            self.e(base.format(t=t) + f"movq ${{s32:k}},{{s32:off}}(%{t})", k=s32(st[-1].value), off=off)
            return
        st[-1] = self.leafify(st[-1])
        node = st[-1]
        temp = None
        if isinstance(node, LiveReg):
            src = node.reg
        elif isinstance(node, V) and node.v.reg is not None:
            src = node.v.reg
        else:
            temp = self.gen(self.share(node))
            src = temp.reg
        self.pinned.add(src)
        t = self.alloc()
        self.pinned.discard(src)
        self.e(base.format(t=t) + f"mov %{src},{{s32:off}}(%{t})", off=off)
        if temp is not None:
            self.release(temp)

    def tracev(self, insn: Insn) -> None:
        w = self.alloc()
        self.pinned.add(w)
        e = self.alloc()
        self.pinned.add(e)
        self.e(f"mov 0x{abi.CTX_TRACE_PTR:x}(%rsi),%{w}\nlea 0xd(%{w}),%{e}\ncmp 0x{abi.CTX_TRACE_LIMIT:x}(%rsi),%{e}")
        self.cb.jcc("a", self.stubs.label(ErrorCode.TRACE_BUFFER_FULL, insn.offset))
        t = self.alloc()
        self.e(
            f"movb $0x56,(%{w})\nmovl ${{u32:num}},0x1(%{w})\nmov 0x{abi.CTX_TSV_BASE:x}(%rsi),%{t}\n"
            f"mov {{s32:off}}(%{t}),%{t}\nmov %{t},0x5(%{w})\nmov %{e},0x{abi.CTX_TRACE_PTR:x}(%rsi)",
            num=insn.arg,
            off=8 * insn.arg,
        )
        self.pinned.difference_update((w, e))

    def trace_const(self, insn: Insn, size: int, keep: bool) -> None:
        """Record `size` bytes at the address on the stack (kept there for trace_quick/trace16)."""
        st = self.stack
        if size > INLINE_TRACE_MAX:
            self.trace_call(insn, "trace_mem", size=size)
            return
        if keep:
            st[-1] = self.leafify(st[-1])
            addr = st[-1]
        else:
            addr = self.leafify(st.pop())
        if size == 0:
            if not keep:
                self.drop(addr)
            return
        if isinstance(addr, Const) and not fits32(addr.value):
            v = self.gen(addr)
            addr = V(v)
            if keep:
                st[-1] = addr
        if isinstance(addr, BlockReg):
            v = self.gen(addr)
            addr = V(v)
            if keep:
                st[-1] = addr
        if isinstance(addr, V) and addr.v.reg is None:
            r = self.alloc()
            self.e(f"mov 0x{addr.v.slot:x}(%rsp),%{r}")
            v = self.temp(r, addr.v.sext, addr.v.zext)
            self.drop(addr)
            addr = V(v)
            if keep:
                st[-1] = addr
        base = addr.reg if isinstance(addr, LiveReg) else addr.v.reg if isinstance(addr, V) else None
        if base is not None:
            self.pinned.add(base)
        w = self.alloc()
        self.pinned.add(w)
        e = self.alloc()
        self.pinned.add(e)
        self.e(f"mov 0x{abi.CTX_TRACE_PTR:x}(%rsi),%{w}\nlea 0x{11 + size:x}(%{w}),%{e}\ncmp 0x{abi.CTX_TRACE_LIMIT:x}(%rsi),%{e}")
        self.cb.jcc("a", self.stubs.label(ErrorCode.TRACE_BUFFER_FULL, insn.offset))
        if base is None:
            assert isinstance(addr, Const)
            self.e(f"movb $0x4d,(%{w})\nmovq ${{s32:a}},0x1(%{w})\nmovw ${{u16:n}},0x9(%{w})", a=s32(addr.value), n=size)
        else:
            self.e(f"movb $0x4d,(%{w})\nmov %{base},0x1(%{w})\nmovw ${{u16:n}},0x9(%{w})", n=size)
        t = self.alloc()
        pos = 0
        for chunk in (8, 4, 2, 1):
            while size - pos >= chunk:
                if base is None:
                    src, holes = "{s32:s}(,%riz,1)", {"s": s32((addr.value + pos) & sem.MASK)}  # type: ignore[union-attr]
                else:
                    src, holes = f"0x{pos:x}(%{base})", {}
                dst = f"0x{11 + pos:x}(%{w})"
                if chunk == 8:
                    self.e(f"mov {src},%{t}\nmov %{t},{dst}", **holes)
                elif chunk == 4:
                    self.e(f"mov {src},%{r32(t)}\nmov %{r32(t)},{dst}", **holes)
                elif chunk == 2:
                    self.e(f"movzwl {src},%{r32(t)}\nmov %{r16(t)},{dst}", **holes)
                else:
                    self.e(f"movzbl {src},%{r32(t)}\nmov %{r8(t)},{dst}", **holes)
                pos += chunk
        self.e(f"mov %{e},0x{abi.CTX_TRACE_PTR:x}(%rsi)")
        self.pinned.difference_update((w, e))
        if base is not None:
            self.pinned.discard(base)
        if not keep:
            self.drop(addr)

    def trace_call(self, insn: Insn, helper: str, size: int | None = None) -> None:
        """trace/tracenz (and big trace_quick): through the runtime helper (r8 addr, r9 size, r10d pc)."""
        st = self.stack
        self.helpers.add(helper)
        self.uses_frame = True
        keep = size is not None
        if keep:
            st[-1] = self.leafify(st[-1])
            addr_node = self.share(st[-1])
            size_node: Node = Const(size)  # type: ignore[arg-type]
        else:
            size_node = st.pop()
            addr_node = st.pop()
        va = self.gen_into(addr_node, "r8")
        self.pinned.add("r8")
        vs = self.gen_into(size_node, "r9")
        self.pinned.add("r9")
        self.evict("r10")
        self.e("mov ${u32:pc},%r10d", pc=insn.offset)
        self.pinned.difference_update(("r8", "r9"))
        self.spill_all(keep=(va, vs))
        self.cb.call(helper)
        self.owner["r8"] = self.owner["r9"] = None
        va.reg = vs.reg = None
        self.release(va)
        self.release(vs)
        self.clobber_all()

    def printf(self, insn: Insn) -> None:
        st = self.stack
        nargs = insn.arg
        pc = insn.offset
        self.formats[pc] = insn.format
        self.uses_frame = True
        self.drop(st.pop())  # function
        self.drop(st.pop())  # channel
        args = [st.pop() for _ in range(nargs)]
        self.spill_all()
        for k, node in enumerate(args):
            dst = f"0x{self.args_base + 8 * k:x}(%rsp)"
            if isinstance(node, Const) and fits32(node.value):
                self.e(f"movq ${{s32:v}},{dst}", v=s32(node.value))
            else:
                v = self.gen(node)
                self.e(f"mov %{v.reg},{dst}")
                self.release(v)
        self.spill_all()
        skip = self.new_label()
        self.e(
            f"mov %rdi,0x{self.save_base:x}(%rsp)\nmov %rsi,0x{self.save_base + 8:x}(%rsp)\n"
            f"mov 0x{abi.CTX_PRINTF_FN:x}(%rsi),%r11\ntest %r11,%r11"
        )
        self.cb.jcc("e", skip)
        self.e(f"mov %rsi,%rdi\nlea 0x{self.args_base:x}(%rsp),%rdx\nmov ${{u32:n}},%ecx\nmov ${{u32:pc}},%r8d", n=nargs, pc=pc)
        self.cb.lea_rsi(f"fmt_{pc}")
        self.e(f"call *%r11\nmov 0x{self.save_base:x}(%rsp),%rdi\nmov 0x{self.save_base + 8:x}(%rsp),%rsi")
        self.cb.label(skip)
        self.clobber_all()


def _is_mem(node: Node) -> bool:
    return (isinstance(node, BlockReg) and abi.REG_SIZE[node.n] == 8) or (isinstance(node, V) and node.v.reg is None)


def _in_reg(node: Node, reg: str) -> bool:
    return isinstance(node, V) and node.v.reg == reg


def compile_opt(program: Program, base: int, live_registers: frozenset[int] | set[int] = frozenset()) -> CompiledExpr:
    """Compile `program` for `base`. `live_registers`: GDB regnums (callee-saved only, see abi.LIVE_CANDIDATES)
    that still hold their probe-site values when the compiled function is entered; `reg N` reads them directly."""
    live = frozenset(live_registers)
    bad = live - set(abi.LIVE_CANDIDATES)
    if bad:
        raise ValueError(f"registers {sorted(bad)} cannot be read live (only {sorted(abi.LIVE_CANDIDATES)})")
    c = _Compiler(program, live)
    c.compile()
    body = c.cb
    emit_exits(body, restore_rsp=c.uses_frame)
    c.stubs.emit(body)
    helper_start = body.here
    emit_helpers(body, c.helpers)
    helper_end = body.here
    emit_formats(body, c.formats)

    frame = c.spill_base + 8 * c.spill_count if c.uses_frame else 0
    final = CodeBuffer()
    if c.uses_frame:
        final.emit(f"mov %rsp,0x{abi.CTX_SAVED_RSP:x}(%rsi)\nsub ${{s32:f}},%rsp", f=frame)
    shift = final.here
    final.append(body)
    code = final.finish()
    return CompiledExpr(
        engine="opt",
        program=program,
        base=base,
        code=code,
        fault_exit=base + final.labels["fault_exit"],
        ranges=tuple((base + shift + s, base + shift + e, off) for s, e, off in c.ranges),
        helpers=(base + shift + helper_start, base + shift + helper_end) if c.helpers else None,
        stack_bytes=frame + 16,
        live_registers=live,
    )
