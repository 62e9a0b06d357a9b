"""Code both compilers append after an expression's body: exits, error stubs, trace helpers, printf formats.

Exits: `exit` returns %rax (restoring %rsp from `ctx.saved_rsp` when the body moved it); `error_exit` stores
%edx (ErrorCode) and %ecx (bytecode offset) into the context and falls into `fault_exit`, which returns 0. Error
stubs are out of line, one per (error, bytecode offset), so the hot path only has a not-taken jcc.

The trace helpers copy memory into the trace area without calling Python:
`trace_mem` (r8 = address, r9 = length, r10d = bytecode offset) records `M` blocks of at most 65535 bytes;
`trace_str` (same registers) stops after the first NUL, reading one byte at a time as GDB's tracenz must.
Each block is written at `ctx.trace_ptr` after a room check and committed (trace_ptr advanced) only once
complete, so a fault in the middle leaves no partial block. They clobber rax rcx rdx r8 r9 r11 and keep r10
(`fault_fixup` reads the bytecode offset from it when a fault hits inside a helper).

Pure code generation, called by both compilers on their thread (compile_naive.py says which); the code itself runs
inside emulation, on the CPU thread.
"""

from __future__ import annotations

from . import abi
from .asm import CodeBuffer
from .errors import ErrorCode


class Stubs:
    """Out-of-line error stubs, created on demand and emitted after the body."""

    def __init__(self) -> None:
        self.wanted: dict[tuple[int, int], str] = {}

    def label(self, code: ErrorCode, pc: int) -> str:
        return self.wanted.setdefault((int(code), pc), f"err_{int(code)}_{pc}")

    def emit(self, cb: CodeBuffer) -> None:
        for (code, pc), name in self.wanted.items():
            cb.label(name)
            cb.emit("mov ${u32:code},%edx\nmov ${u32:pc},%ecx", code=code, pc=pc)
            cb.jmp("error_exit")


def emit_exits(cb: CodeBuffer, restore_rsp: bool) -> None:
    cb.label("exit")
    if restore_rsp:
        cb.emit(f"mov 0x{abi.CTX_SAVED_RSP:x}(%rsi),%rsp")
    cb.emit("ret")
    cb.label("error_exit")
    cb.emit(f"mov %rdx,0x{abi.CTX_ERROR:x}(%rsi)\nmov %rcx,0x{abi.CTX_ERROR_PC:x}(%rsi)")
    cb.label("fault_exit")
    if restore_rsp:
        cb.emit(f"mov 0x{abi.CTX_SAVED_RSP:x}(%rsi),%rsp")
    cb.emit("xor %eax,%eax\nret")


def _emit_block(cb: CodeBuffer, prefix: str) -> None:
    """Inline: write one `M` block of r11 bytes from r8 (1 <= r11 <= 65535), advance r8, commit."""
    cb.emit(
        f"mov 0x{abi.CTX_TRACE_PTR:x}(%rsi),%rdx\n"
        "lea 0xb(%rdx,%r11),%rcx\n"
        f"cmp 0x{abi.CTX_TRACE_LIMIT:x}(%rsi),%rcx"
    )
    cb.jcc("a", f"{prefix}_full")
    cb.emit(
        "movb $0x4d,(%rdx)\n"
        "mov %r8,0x1(%rdx)\n"
        "mov %r11w,0x9(%rdx)\n"
        "add $0xb,%rdx\n"
        # eight bytes at a time, then a 4/2/1 tail: never reads a byte past the range
        "Lq:\n"
        "cmp $0x8,%r11\n"
        "jb Lt\n"
        "mov (%r8),%rax\n"
        "mov %rax,(%rdx)\n"
        "add $0x8,%r8\n"
        "add $0x8,%rdx\n"
        "sub $0x8,%r11\n"
        "jmp Lq\n"
        "Lt:\n"
        "test $0x4,%r11b\n"
        "je L2\n"
        "mov (%r8),%eax\n"
        "mov %eax,(%rdx)\n"
        "add $0x4,%r8\n"
        "add $0x4,%rdx\n"
        "L2:\n"
        "test $0x2,%r11b\n"
        "je L1\n"
        "movzwl (%r8),%eax\n"
        "mov %ax,(%rdx)\n"
        "add $0x2,%r8\n"
        "add $0x2,%rdx\n"
        "L1:\n"
        "test $0x1,%r11b\n"
        "je L0\n"
        "movzbl (%r8),%eax\n"
        "mov %al,(%rdx)\n"
        "inc %r8\n"
        "L0:\n"
        f"mov %rcx,0x{abi.CTX_TRACE_PTR:x}(%rsi)"
    )


def emit_helpers(cb: CodeBuffer, needed: set[str]) -> None:
    """Emit the helpers named in `needed` ("trace_mem", "trace_str")."""
    if "trace_mem" in needed:
        cb.label("trace_mem")
        cb.emit("test %r9,%r9")
        cb.jcc("e", "trace_mem_ret")
        cb.emit("mov $0xffff,%r11d\ncmp %r11,%r9\ncmovb %r9,%r11\nsub %r11,%r9")
        _emit_block(cb, "trace_mem")
        cb.jmp("trace_mem")
        cb.label("trace_mem_ret")
        cb.emit("ret")
        cb.label("trace_mem_full")
        cb.emit(f"mov $0x{int(ErrorCode.TRACE_BUFFER_FULL):x},%edx\nmov %r10,%rcx")
        cb.jmp("error_exit")
    if "trace_str" in needed:
        cb.label("trace_str")
        cb.emit("test %r9,%r9")
        cb.jcc("e", "trace_str_ret")
        cb.emit(
            "mov $0xffff,%r11d\n"
            "cmp %r11,%r9\n"
            "cmovb %r9,%r11\n"
            "xor %ecx,%ecx\n"
            "Ls:\n"
            "cmp %r11,%rcx\n"
            "jae Ld\n"
            "movzbl (%r8,%rcx),%eax\n"
            "inc %rcx\n"
            "test %al,%al\n"
            "jne Ls\n"
            "mov %rcx,%r9\n"  # found the NUL: this block is the last
            "Ld:\n"
            "sub %rcx,%r9\n"
            "mov %rcx,%r11"
        )
        _emit_block(cb, "trace_str")
        cb.jmp("trace_str")
        cb.label("trace_str_ret")
        cb.emit("ret")
        cb.label("trace_str_full")
        cb.emit(f"mov $0x{int(ErrorCode.TRACE_BUFFER_FULL):x},%edx\nmov %r10,%rcx")
        cb.jmp("error_exit")


def emit_formats(cb: CodeBuffer, formats: dict[int, bytes]) -> None:
    """printf formats (NUL-terminated), labelled `fmt_<bytecode offset>`."""
    for pc, fmt in formats.items():
        cb.label(f"fmt_{pc}")
        cb.raw(fmt + b"\0")
