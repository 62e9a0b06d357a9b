"""Tree code generation for the optimizing compiler: a small register allocator over the seven caller-saved
scratch registers (spilling to frame slots), tree construction with constant folding and extension elimination,
and instruction selection with immediates and memory operands.

Invariant that keeps %cl available for run-time shift counts: a tree that shifts by a run-time count is always
materialized before anything is pinned (`prepare`), so %rcx is never pinned while such a tree is evaluated.

Pure code generation with no state beyond one compilation: runs on the thread that calls `compile_opt` (where the
tracer installs a location: compile_naive.py says where; tests and `agent.measure` on their own).
"""

from __future__ import annotations

from . import abi
from . import semantics as sem
from .asm import INVERSE_CC, SWAPPED_CC, CodeBuffer
from .opt_ir import (
    _ALU,
    _CMP_CC,
    _COMMUTATIVE,
    _MAX_NEED,
    _SIGNED_OR_EQ,
    SCRATCH,
    BlockReg,
    Cmp,
    Const,
    LiveReg,
    Node,
    Op,
    V,
    VReg,
    _is_mem,
    fits32,
    is_leaf,
    leaves,
    need,
    needs_rcx,
    r8,
    r16,
    r32,
    s32,
    strip_low,
)
from .verify import Program


class TreeCodegen:
    """Register allocation and code generation for pure trees (the optimizing compiler's lower half)."""

    def __init__(self, program: Program) -> None:
        self.p = program
        self.cb = CodeBuffer()
        self.owner: dict[str, VReg | None] = dict.fromkeys(SCRATCH)
        self.pinned: set[str] = set()
        self.uses_frame = False
        # frame, from %rsp up: printf arguments, saved %rdi/%rsi, one home slot per stack position, spill slots
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
        # the left operand's register stays put while the right one is evaluated: were it spilled to make room,
        # `cmp` would compare the right operand with whatever then took that register (itself, once)
        held = lt.reg if lt is not None else a.v.reg if isinstance(a, V) else None
        pin = held is not None and held not in self.pinned
        if pin:
            self.pinned.add(held)  # type: ignore[arg-type]
        text, holes, t = self.operand(b, "k", allow_mem=not left.endswith(")"))
        if not node.wide and text.startswith("%"):
            text = f"%{r32(text[1:])}"
        self.e(f"cmp{'q' if node.wide else 'l'} {text},{left}", **holes)
        self.use(b, t)
        if pin:
            self.pinned.discard(held)  # type: ignore[arg-type]
        if lt is not None:
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
