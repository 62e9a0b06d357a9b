"""The optimizing compiler's opcodes with effects: memory loads that may fault, divisions and their checks, trace
state variable reads and writes, inlined and helper-called trace collection, and printf.

Each is emitted at its place in bytecode order, with its operands materialized first, so the first error, the
trace blocks and the TSVs are the interpreter's (agent/interp.py). Errors leave through the error exits
(`runtime.Stubs`) this class asks for; the helpers and printf formats it uses are collected for the final link
(compile_opt.py). The pure trees these effects consume, and the register allocator, are `opt_codegen`'s; the
blocks, branches and the virtual stack's canonical place are compile_opt.py's.

Runs on whichever thread calls `compile_opt`: the CPU thread when the tracer builds a detour
(tracing/engines/native.py, at tstart and when a location is armed during a run), the caller's in tests and
`agent.measure`.
"""

from __future__ import annotations

from . import abi
from . import semantics as sem
from .errors import ErrorCode
from .opcodes import Insn
from .opt_codegen import TreeCodegen
from .opt_ir import BlockReg, Const, LiveReg, Node, Op, V, VReg, fits32, leaves, needs_rcx, r8, r16, r32, s32
from .runtime import Stubs
from .verify import Program

#: `trace`/`trace_quick`/`trace16` of at most this many bytes are inlined (room check, header, unrolled copy).
INLINE_TRACE_MAX = 64


class EffectCodegen(TreeCodegen):
    """The opcodes with an effect, over the virtual stack `stack` of the block being compiled."""

    def __init__(self, program: Program) -> None:
        super().__init__(program)
        self.stubs = Stubs()  # the error exits the code jumps to
        self.helpers: set[str] = set()  # runtime helpers called (trace_mem, trace_str)
        self.formats: dict[int, bytes] = {}  # printf formats by bytecode offset
        self.stack: list[Node] = []

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
