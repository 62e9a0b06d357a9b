"""The naive compiler: one x86_64 snippet per opcode, as in the thesis (§2.3.1) and gdbserver.

The top of the stack lives in %rax, the rest on the machine stack (`push`/`pop`); %rdi (register block) and %rsi
(agent_ctx) are never touched. Every opcode compiles, for conditions and actions alike: the trace opcodes call
the trace helpers of `runtime`, which write GDB trace blocks straight into emulated memory; printf calls the
trap in `ctx.printf_fn`. The five steps of the thesis:

1. a code buffer, plus the two tables: where each bytecode offset's snippet starts (`bc_<offset>` labels) and
   where each jump's displacement must be written (the buffer's fixups);
2. the prologue (save %rsp in the context; %rax = 0, the value of an empty stack);
3. one snippet per instruction, with its operands patched in;
4. the epilogue, error exits and helpers;
5. the jump displacements, patched from the two tables.

An empty stack is represented the way gdbserver does it: the first push stores the initial %rax (0) below the
first entry, so popping the last entry leaves %rax = 0, which is what `end` on an empty stack returns.

Thread: where the tracer installs a location with the naive engine (kgtp_sim/tracing/engines/native.py): on the CPU
thread at tstart (inside `Tracer._between_hits`), on the server thread for a location GDB downloads or enables
during a run (InstallInTrace, QTEnable), on the CPU thread for a hit's `$enable`; tests and `agent.measure` call it
on their own thread. The code it makes runs inside emulation, on the CPU thread.
"""

from __future__ import annotations

from . import abi
from .asm import CodeBuffer
from .compiled import CompiledExpr
from .errors import ErrorCode
from .opcodes import Insn
from .runtime import Stubs, emit_exits, emit_formats, emit_helpers
from .verify import Program

_SIMPLE: dict[str, str] = {
    "add": "pop %rcx\nadd %rcx,%rax",
    "sub": "pop %rcx\nsub %rax,%rcx\nmov %rcx,%rax",
    "mul": "pop %rcx\nimul %rcx,%rax",
    "bit_and": "pop %rcx\nand %rcx,%rax",
    "bit_or": "pop %rcx\nor %rcx,%rax",
    "bit_xor": "pop %rcx\nxor %rcx,%rax",
    "bit_not": "not %rax",
    "log_not": "test %rax,%rax\nsete %al\nmovzbl %al,%eax",
    "equal": "pop %rcx\ncmp %rax,%rcx\nsete %al\nmovzbl %al,%eax",
    "less_signed": "pop %rcx\ncmp %rax,%rcx\nsetl %al\nmovzbl %al,%eax",
    "less_unsigned": "pop %rcx\ncmp %rax,%rcx\nsetb %al\nmovzbl %al,%eax",
    "lsh": "mov %rax,%rcx\npop %rax\nshl %cl,%rax\ncmp $0x3f,%rcx\njbe L1\nxor %eax,%eax\nL1:",
    "rsh_unsigned": "mov %rax,%rcx\npop %rax\nshr %cl,%rax\ncmp $0x3f,%rcx\njbe L1\nxor %eax,%eax\nL1:",
    "rsh_signed": "mov %rax,%rcx\npop %rax\ncmp $0x3f,%rcx\njbe L1\nmov $0x3f,%ecx\nL1:\nsar %cl,%rax",
    "ref8": "movzbl (%rax),%eax",
    "ref16": "movzwl (%rax),%eax",
    "ref32": "mov (%rax),%eax",
    "ref64": "mov (%rax),%rax",
    "dup": "push %rax",
    "pop": "pop %rax",
    "swap": "pop %rcx\npush %rax\nmov %rcx,%rax",
    "rot": "mov (%rsp),%rcx\nmov 0x8(%rsp),%rdx\nmov %rax,0x8(%rsp)\nmov %rdx,(%rsp)\nmov %rcx,%rax",
}

_EXT = {8: "movsbq %al,%rax", 16: "movswq %ax,%rax", 32: "movslq %eax,%rax"}
_ZEXT = {8: "movzbl %al,%eax", 16: "movzwl %ax,%eax", 32: "mov %eax,%eax"}
_BUDGET = f"cmpq $0x0,0x{abi.CTX_LOOP_BUDGET:x}(%rsi)"
_BUDGET_DEC = f"decq 0x{abi.CTX_LOOP_BUDGET:x}(%rsi)"


def ext_text(bits: int, reg64: str = "rax") -> str:
    """Sign-extension of a register from `bits` (shared with the optimizing compiler's fallback)."""
    if bits >= 64:
        return ""
    if bits == 0:
        return f"xor %{reg64},%{reg64}"
    shift = 64 - bits
    return f"shl $0x{shift:x},%{reg64}\nsar $0x{shift:x},%{reg64}"


def compile_naive(program: Program, base: int) -> CompiledExpr:
    """Compile `program` for execution at address `base` (module space)."""
    cb = CodeBuffer()
    stubs = Stubs()
    helpers: set[str] = set()
    formats: dict[int, bytes] = {}
    ranges: list[tuple[int, int, int]] = []

    # step 2: prologue
    cb.emit(f"mov %rsp,0x{abi.CTX_SAVED_RSP:x}(%rsi)\nxor %eax,%eax")
    last = program.insns[-1]
    # step 3: one snippet per instruction
    for insn in program.insns:
        cb.label(f"bc_{insn.offset}")
        start = cb.here
        _snippet(cb, insn, program, stubs, helpers, formats, is_last=insn is last)
        ranges.append((start, cb.here, insn.offset))
    # step 4: epilogue, exits, stubs, helpers
    emit_exits(cb, restore_rsp=True)
    stubs.emit(cb)
    helper_start = cb.here
    emit_helpers(cb, helpers)
    helper_end = cb.here
    emit_formats(cb, formats)
    # step 5: jump displacements
    code = cb.finish()
    return CompiledExpr(
        engine="naive",
        program=program,
        base=base,
        code=code,
        fault_exit=base + cb.labels["fault_exit"],
        ranges=tuple((base + s, base + e, off) for s, e, off in ranges if e > s),
        helpers=(base + helper_start, base + helper_end) if helpers else None,
        stack_bytes=8 * (program.max_depth + 8),
    )


def _jump(cb: CodeBuffer, insn: Insn, stubs: Stubs) -> None:
    """Unconditional transfer to the jump's target; a backward one first spends one unit of loop budget."""
    if insn.arg <= insn.offset:
        cb.emit(_BUDGET)
        cb.jcc("e", stubs.label(ErrorCode.LOOP_BUDGET, insn.offset))
        cb.emit(_BUDGET_DEC)
    cb.jmp(f"bc_{insn.arg}")


def _snippet(
    cb: CodeBuffer,
    insn: Insn,
    program: Program,
    stubs: Stubs,
    helpers: set[str],
    formats: dict[int, bytes],
    is_last: bool,
) -> None:
    name = insn.name
    pc = insn.offset
    if name in _SIMPLE:
        cb.emit(_SIMPLE[name])
    elif name.startswith("const"):
        cb.emit("push %rax\nmovabs ${i64:value},%rax", value=insn.arg)
    elif name == "reg":
        n = insn.arg
        dst = "%rax" if abi.REG_SIZE[n] == 8 else "%eax"
        cb.emit(f"push %rax\nmov 0x{abi.REG_OFFSET[n]:x}(%rdi),{dst}")
    elif name == "ext":
        text = _EXT.get(insn.arg) or ext_text(insn.arg)
        if text:
            cb.emit(text)
    elif name == "zero_ext":
        bits = insn.arg
        if bits == 0:
            cb.emit("xor %eax,%eax")
        elif bits in _ZEXT:
            cb.emit(_ZEXT[bits])
        elif bits < 32:
            cb.emit("and ${s32:mask},%rax", mask=(1 << bits) - 1)
        elif bits < 64:
            cb.emit("movabs ${i64:mask},%rcx\nand %rcx,%rax", mask=(1 << bits) - 1)
    elif name in ("div_unsigned", "rem_unsigned"):
        cb.emit("mov %rax,%rcx\npop %rax\ntest %rcx,%rcx")
        cb.jcc("e", stubs.label(ErrorCode.DIVIDE_BY_ZERO, pc))
        cb.emit("xor %edx,%edx\ndiv %rcx" + ("\nmov %rdx,%rax" if name == "rem_unsigned" else ""))
    elif name in ("div_signed", "rem_signed"):
        cb.emit("mov %rax,%rcx\npop %rax\ntest %rcx,%rcx")
        cb.jcc("e", stubs.label(ErrorCode.DIVIDE_BY_ZERO, pc))
        # (dividend ^ INT64_MIN) | (divisor + 1) is zero exactly for INT64_MIN / -1
        cb.emit("lea 0x1(%rcx),%rdx\nmovabs $0x8000000000000000,%r8\nxor %rax,%r8\nor %rdx,%r8")
        cb.jcc("e", stubs.label(ErrorCode.DIVIDE_OVERFLOW, pc))
        cb.emit("cqo\nidiv %rcx" + ("\nmov %rdx,%rax" if name == "rem_signed" else ""))
    elif name == "if_goto":
        cb.emit("mov %rax,%rcx\npop %rax\ntest %rcx,%rcx")
        if insn.arg > pc:
            cb.jcc("ne", f"bc_{insn.arg}")
        else:
            cb.jcc("e", f"skip_{pc}")
            _jump(cb, insn, stubs)
            cb.label(f"skip_{pc}")
    elif name == "goto":
        _jump(cb, insn, stubs)
    elif name == "end":
        if not is_last:
            cb.jmp("exit")
    elif name == "pick":
        cb.emit("push %rax" + (f"\nmov 0x{8 * insn.arg:x}(%rsp),%rax" if insn.arg else ""))
    elif name == "getv":
        cb.emit(f"push %rax\nmov 0x{abi.CTX_TSV_BASE:x}(%rsi),%rcx\nmov {{s32:off}}(%rcx),%rax", off=8 * insn.arg)
    elif name == "setv":
        cb.emit(f"mov 0x{abi.CTX_TSV_BASE:x}(%rsi),%rcx\nmov %rax,{{s32:off}}(%rcx)", off=8 * insn.arg)
    elif name == "tracev":
        cb.emit(
            f"mov 0x{abi.CTX_TRACE_PTR:x}(%rsi),%rcx\nlea 0xd(%rcx),%rdx\ncmp 0x{abi.CTX_TRACE_LIMIT:x}(%rsi),%rdx"
        )
        cb.jcc("a", stubs.label(ErrorCode.TRACE_BUFFER_FULL, pc))
        cb.emit(
            "movb $0x56,(%rcx)\n"
            "movl ${u32:num},0x1(%rcx)\n"
            f"mov 0x{abi.CTX_TSV_BASE:x}(%rsi),%r8\n"
            "mov {s32:off}(%r8),%r8\n"
            "mov %r8,0x5(%rcx)\n"
            f"mov %rdx,0x{abi.CTX_TRACE_PTR:x}(%rsi)",
            num=insn.arg,
            off=8 * insn.arg,
        )
    elif name in ("trace", "tracenz"):
        helper = "trace_str" if name == "tracenz" else "trace_mem"
        helpers.add(helper)
        cb.emit("mov %rax,%r9\npop %r8\nmov ${u32:pc},%r10d", pc=pc)
        cb.call(helper)
        cb.emit("pop %rax")
    elif name in ("trace_quick", "trace16"):
        helpers.add("trace_mem")
        cb.emit("push %rax\nmov %rax,%r8\nmov ${u32:n},%r9d\nmov ${u32:pc},%r10d", n=insn.arg, pc=pc)
        cb.call("trace_mem")
        cb.emit("pop %rax")
    elif name == "printf":
        formats[pc] = insn.format
        cb.emit(f"push %rax\nmov 0x{abi.CTX_PRINTF_FN:x}(%rsi),%r11\ntest %r11,%r11")
        cb.jcc("e", f"noprintf_{pc}")
        cb.emit("push %rdi\npush %rsi\nmov %rsi,%rdi\nlea 0x20(%rsp),%rdx\nmov ${u32:n},%ecx\nmov ${u32:pc},%r8d", n=insn.arg, pc=pc)
        cb.lea_rsi(f"fmt_{pc}")
        cb.emit("call *%r11\npop %rsi\npop %rdi")
        cb.label(f"noprintf_{pc}")
        cb.emit("lea {s32:drop}(%rsp),%rsp\npop %rax", drop=8 * (2 + insn.arg))
    else:  # pragma: no cover - the verifier refuses everything else
        raise AssertionError(f"no snippet for {name}")
