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
The pieces, each a layer of one compiler object: `opt_ir` (values and trees), `opt_codegen` (register allocation
and tree code generation), `opt_effects` (the opcodes with effects, over the virtual stack), this module (basic
blocks, the canonical stack at their boundaries, branches, the walk over the instructions and the compiler's
entry point, which links the code, its error exits, helpers and formats).

Runs on whichever thread calls `compile_opt`: the CPU thread when the tracer builds a detour
(tracing/engines/native.py, at tstart and when a location is armed during a run), the caller's in tests and
`agent.measure`.
"""

from __future__ import annotations

from . import abi
from . import semantics as sem
from .asm import INVERSE_CC, CodeBuffer
from .compiled import CompiledExpr
from .errors import ErrorCode
from .opcodes import Insn, OpClass
from .opt_effects import INLINE_TRACE_MAX, EffectCodegen
from .opt_ir import SCRATCH, BlockReg, Cmp, Const, LiveReg, V, VReg, _in_reg, fits32, s32
from .runtime import emit_exits, emit_formats, emit_helpers
from .verify import Program

__all__ = ["INLINE_TRACE_MAX", "compile_opt"]


class _Compiler(EffectCodegen):
    """Basic blocks, the canonical stack at their boundaries, branches and jumps, and the walk over the
    instructions that hands each opcode to the tree builders (opt_codegen) or the effects (opt_effects)."""

    def __init__(self, program: Program, live: dict[int, str], branch: bool = False) -> None:
        super().__init__(program)
        self.live = live  # GDB regnum -> the register that still holds it
        self.branch_exits = branch  # `end` jumps to exit_true when the value is non-zero, else falls off the end
        self.ranges: list[tuple[int, int, int]] = []

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
