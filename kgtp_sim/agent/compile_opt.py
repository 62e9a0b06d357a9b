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
The pieces: `opt_ir` (values and trees), `opt_codegen` (register allocation and tree code generation), this
module (blocks, effects, the compiler's entry point).

Why this module is long: the translation of each opcode class and of each effect has to see the virtual stack
and the block state at once; split further, every piece would pass the same compiler state around.
"""

from __future__ import annotations

from . import abi
from . import semantics as sem
from .asm import INVERSE_CC, CodeBuffer
from .compiled import CompiledExpr
from .errors import ErrorCode
from .opcodes import Insn, OpClass
from .opt_codegen import TreeCodegen
from .opt_ir import (
    SCRATCH,
    BlockReg,
    Cmp,
    Const,
    LiveReg,
    Node,
    Op,
    V,
    VReg,
    _in_reg,
    fits32,
    leaves,
    needs_rcx,
    r8,
    r16,
    r32,
    s32,
)
from .runtime import Stubs, emit_exits, emit_formats, emit_helpers
from .verify import Program

INLINE_TRACE_MAX = 64


class _Compiler(TreeCodegen):
    """Basic blocks, the canonical stack at their boundaries, and the opcodes with effects."""

    def __init__(self, program: Program, live: dict[int, str], branch: bool = False) -> None:
        super().__init__(program)
        self.live = live  # GDB regnum -> the register that still holds it
        self.branch_exits = branch  # `end` jumps to exit_true when the value is non-zero, else falls off the end
        self.stubs = Stubs()
        self.helpers: set[str] = set()
        self.formats: dict[int, bytes] = {}
        self.ranges: list[tuple[int, int, int]] = []
        self.stack: list[Node] = []

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
            st.append(LiveReg(self.live[n]) if n in self.live else BlockReg(n))
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
        elif name == "end" and self.branch_exits:
            self.finish_branch()
            if not is_last:
                self.cb.jmp("exit_false")
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

    def finish_branch(self) -> None:
        """`end` of a branching compile: to exit_true if the value is non-zero; a compare is its own jcc."""
        st = self.stack
        if not st:
            return
        top = st.pop()
        self.discard_stack()
        if isinstance(top, Const):
            if top.value:
                self.cb.jmp("exit_true")
            return
        if not isinstance(top, Cmp):
            top = Cmp("ne", top, Const(0))
        self.cb.jcc(self.flags(top), "exit_true")

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


#: Classes of ops that need the context (%rsi) whatever their operands (memory reads may fault, TSVs live there,
#: traces and printf write through it); and divisions, which may fail. Pointerless code has no context.
_NEEDS_CONTEXT = (OpClass.MEMORY, OpClass.TSV, OpClass.TRACE, OpClass.PRINTF)


def compile_opt(program: Program, base: int, live_registers: frozenset[int] | set[int] = frozenset(), *,
                pointerless: bool = False, true_exit: int | None = None) -> CompiledExpr:
    """Compile `program` for `base`. `live_registers`: GDB regnums (callee-saved only, see abi.LIVE_CANDIDATES)
    that still hold their probe-site values when the compiled function is entered; `reg N` reads them directly.

    `pointerless`: the caller passes neither the register block nor the context, so %rdi and %rsi may be read live
    too (abi.POINTERLESS_LIVE_CANDIDATES) and every `reg` must be; only side-effect-free programs that cannot fail
    and have no loops qualify (ValueError otherwise). The false-condition fast path uses it to evaluate a
    condition without saving the register block first.

    `true_exit` (pointerless only): compile a branch instead of a function, to be placed inline: where the value
    is non-zero the code jumps to the absolute address `true_exit`, where it is zero it falls off its end (no
    `ret`, nothing returned); a final compare becomes the jump itself."""
    live = frozenset(live_registers)
    candidates = abi.POINTERLESS_LIVE_CANDIDATES if pointerless else abi.LIVE_CANDIDATES
    bad = live - set(candidates)
    if bad:
        raise ValueError(f"registers {sorted(bad)} cannot be read live (only {sorted(candidates)})")
    if pointerless:
        needs = sorted({i.name for i in program.insns
                        if i.op.cls in _NEEDS_CONTEXT or i.name.startswith(("div", "rem"))}
                       | {f"reg {i.arg}" for i in program.insns if i.name == "reg" and i.arg not in live})
        if needs or program.backward_jumps:
            raise ValueError(f"cannot compile without pointers: {', '.join(needs) or 'backward jumps'}")
    if true_exit is not None and not pointerless:
        raise ValueError("only a pointerless compile can branch")
    c = _Compiler(program, {n: candidates[n] for n in live}, branch=true_exit is not None)
    c.compile()
    if pointerless and (c.uses_frame or c.helpers or c.formats or c.stubs.wanted):
        raise ValueError("cannot compile without pointers: the code needs a frame, helpers or error exits")
    if true_exit is not None:
        c.cb.label("exit_false")
        c.cb.labels["exit_true"] = true_exit - base  # outside the code: the buffer is linked at `base`
        code = c.cb.finish()
        return CompiledExpr(engine="opt", program=program, base=base, code=code, fault_exit=base + len(code),
                            ranges=tuple((base + s, base + e, off) for s, e, off in c.ranges), helpers=None,
                            stack_bytes=0, live_registers=live, pointerless=True)
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
        pointerless=pointerless,
    )
