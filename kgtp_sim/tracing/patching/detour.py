"""Native detours: the code a probe jumps to when conditions and actions run compiled (naive or opt engine).

One detour per probe location, in module space:

    pushfq; cli                       the detour runs with interrupts off (its CPU is never switched out inside
                                      stub code, so the shared agent_ctx is one hit's at a time)
    save rax..r15 into a `g`-layout block on the stack; rsp, rip, eflags and segments as at the site
    refresh the computed built-in trace variables the bytecode reads ($current_task, $rdtsc, ...)
    count the hit; condition (compiled); error -> hypercall
    reserve a frame in the ring; no room -> hypercall (tfull)
    actions: register block copy, compiled expressions (memory collections are compiled too)
    commit the frame; pass count reached -> hypercall
    restore, popfq, the displaced instructions (relocated), jmp back

A "hypercall" is an int3 at a known address inside the detour: the machine's breakpoint table sends it to Python,
which records the error or stops the run, then resumes after it. Every other hit never leaves native code.
Numbers are written in hex: the assembler reads decimal AT&T immediates and displacements as hex.

Pure code generation (text in, bytes out): called on the CPU thread when a location is installed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ...agent import abi
from ...agent.asm import assemble_text
from ...agent.errors import ErrorCode
from ...arch import amd64
from ...machine.smp import PERCPU_CPU_NUMBER
from ..core.builtins import native_refresh_asm, percpu_store_asm
from ..core.frames import ALL_GENERAL, COMPACT_HEADER, FRAME_HEADER
from ..core.ring import (BLOCKS_AT, CTL_CREATED, CTL_FRAMES, CTL_HEAD, CTL_LIMIT, CTL_PHYS, ENTRY_LENGTH, ENTRY_SEQUENCE,
                         ENTRY_TIMESTAMP, FRAME_AT, control_disp, reserve_and_commit_asm)
from .probes import decode

#: Bytes of the register block on the detour's stack: the 24 registers GDB's agent numbers, 8-aligned.
BLOCK_BYTES = (abi.REG_BLOCK_BYTES + 7) & ~7
#: Per-location counters in data memory: times the probe fired, hits (condition true, as gdbserver counts them
#: for passcount), frame bytes written, and the start of the frame being written (scratch).
COUNTERS = struct.Struct("<QQQQ")
FIRED, HITS, USAGE, FRAME_START = 0x0, 0x8, 0x10, 0x18
#: The counters have a page of their own, which holds no code, right before the detour's entry: the emulator
#: drops the translated code of a page its guest writes to (self-modifying code), so counters that shared a page
#: with code would have that code translated again at every hit (host memory grew with the hits).
DATA_PAGE = 0x1000
_DATA = ["counters:", ".quad 0x0, 0x0, 0x0, 0x0", f".space {DATA_PAGE - COUNTERS.size:#x}", "detour:"]

_GPR = ("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15")
#: What the compiled code and the ring routines may clobber (SysV caller-saved): restored from the block.
_CLOBBERED = ("rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11")


def assemble(source: str, base: int) -> bytes:
    return assemble_text(source, base)


@dataclass(frozen=True)
class Runtime:
    """Code shared by every detour of a run: the ring routines."""

    reserve: int
    commit: int
    code: bytes

    @classmethod
    def build(cls, base: int, ring_ctl: int, shared_ring: bool = False) -> Runtime:
        """The routines at `base`, on the per-CPU rings at `ring_ctl` (`shared_ring`: the one ring of every CPU)."""
        source = reserve_and_commit_asm(ring_ctl, shared_ring)
        code = assemble(source, base)
        commit = base + len(assemble(source.split("ring_commit:")[0], base))
        return cls(base, commit, code)


@dataclass(frozen=True)
class FastPath:
    """A false condition decided before the full save: only what the compiled condition reads or clobbers is
    stored, flags are kept only if they are live at the site. Used for pure conditions (no side effects), so
    the full path may evaluate the condition again when it is true.

    With `inline` (the condition compiled without pointers as a branch, see compile_opt: it reads the site's
    registers live and jumps to the full path when true) there is no register block and no call at all: the
    registers it clobbers are pushed, the branch runs in place, and they are popped again."""

    stores: tuple[str, ...]  # registers written into their block slots (read by `reg` ops, or clobbered)
    restores: tuple[str, ...]  # registers the condition (or the call setup) clobbers
    needs_ctx: bool  # the compiled code reads %rsi (TSVs, errors)
    can_fail: bool  # the condition may set ctx.error (then the full path reports it)
    flags_live: bool  # the displaced code reads flags before writing them
    save_flags: bool  # keep the site's flags for the full path (a register collection records them)
    tail: bytes  # the displaced instructions relocated to follow the fast path, and the jump back
    #: the condition as an inline branch (true: to `fast_slow`), if it compiles that way (empty: never true)
    inline: bytes | None = None


@dataclass(frozen=True)
class SdataPlan:
    """`collect $_sdata` built in place: the `S` block of a marker whose fields are all VALUE fields (TP_ARGS in
    registers, no memory to read), as (entry offset, field size, register block offset, argument width)."""

    entry_size: int
    fields: tuple[tuple[int, int, int, int], ...]


@dataclass(frozen=True)
class DetourPlan:
    """Everything one detour needs to know, all addresses absolute."""

    site: int
    tracepoint: int
    ctx: int
    runtime: Runtime
    condition: int | None  # entry of the compiled condition
    #: the general registers the frame records (frames.compact_mask; 0: none, ALL_GENERAL: a full `R` block)
    register_mask: int
    #: (entry, faults lose a block, loops); None = $_sdata through a hypercall, SdataPlan = $_sdata built in place
    actions: tuple[tuple[int | SdataPlan | None, bool, bool], ...]
    max_frame: int  # bytes of blocks a frame may take
    pass_count: int
    builtin_slots: tuple[tuple[int, str], ...]  # (tsv number, how to compute) refreshed at entry
    reads_segments: bool = False  # some bytecode reads cs..gs (`reg` 18..23)
    condition_loops: bool = False  # the condition has backward jumps: its loop budget is reset per evaluation
    loop_budget: int = 10000
    fast: FastPath | None = None
    fast_tail_address: int = 0  # where FastPath.tail sits (the full path ends there too)
    #: ring control block; with `lean`, a hit whose frame is only its compact register block and register-built
    #: `$_sdata` records it on the short path (see `_lean_path`), the full path only when the ring needs padding
    #: or eviction
    ring_ctl: int = 0
    lean: bool = False
    #: a program's location (userprobes.py): entered from ring 3 through a call gate (machine/gates.py), whose
    #: frame on the kernel stack holds the program's RIP, CS, RSP and SS; the kernel's GS base swapped in and out;
    #: the detour ends by going back (`lretq`) to the program's pad, which runs the displaced instruction (no
    #: fast or short path here: the pad runs the false condition in ring 3)
    from_user: bool = False


#: The call gate's frame above the detour's saved flags (machine/gates.py): the program's RIP, CS, RSP, SS.
GATE_CS, GATE_RSP, GATE_SS = 0x10, 0x18, 0x20


@dataclass(frozen=True)
class Detour:
    base: int  # the entry (the probe jumps here)
    code: bytes
    error_call: int  # address of the int3 reached when ctx.error is set
    full_call: int  # ... when the ring refused a frame
    pass_call: int  # ... when the pass count is reached
    sdata_calls: tuple[int, ...] = ()  # ... where `collect $_sdata` builds the entry
    counters: int = 0  # the location's COUNTERS (fired, hits, bytes, scratch), on the page before the entry


def _save_block(site: int, segments: bool, from_user: bool = False) -> list[str]:
    lines = ["pushfq", "cli", f"sub ${BLOCK_BYTES:#x}, %rsp"]
    for index, name in enumerate(_GPR):
        if name != "rsp":
            lines.append(f"mov %{name}, {amd64.OFFSETS[index]:#x}(%rsp)")
    eflags = amd64.OFFSETS[amd64.REGISTER_INDEX["eflags"]]
    cs = amd64.OFFSETS[amd64.REGISTER_INDEX["cs"]]
    lines += [
        f"mov {BLOCK_BYTES + GATE_RSP:#x}(%rsp), %rax" if from_user else f"lea {BLOCK_BYTES + 8:#x}(%rsp), %rax",
        f"mov %rax, {amd64.OFFSETS[amd64.SP_REGNUM]:#x}(%rsp)",
        f"movabs ${site:#x}, %rax",
        f"mov %rax, {amd64.OFFSETS[amd64.PC_REGNUM]:#x}(%rsp)",
        f"mov {BLOCK_BYTES:#x}(%rsp), %rax",
        f"mov %eax, {eflags:#x}(%rsp)",
    ]
    if segments:  # only when something reads them: a register collection or `reg` 18..23
        for index, name in enumerate(("cs", "ss", "ds", "es", "fs", "gs")):
            if from_user and name in ("cs", "ss"):  # the program's, from the gate's frame
                source = f"{BLOCK_BYTES + (GATE_CS if name == 'cs' else GATE_SS):#x}(%rsp)"
            else:
                source = f"%{name}"
            lines += [f"mov {source}, %eax", f"mov %eax, {cs + 4 * index:#x}(%rsp)"]
    return lines


def _restore_block() -> list[str]:
    lines = []
    for name in _CLOBBERED:
        lines.append(f"mov {amd64.OFFSETS[amd64.REGISTER_INDEX[name]]:#x}(%rsp), %{name}")
    lines += [f"add ${BLOCK_BYTES:#x}, %rsp", "popfq"]
    return lines


def _builtins(plan: DetourPlan) -> list[str]:
    """Refresh the slots of the computed built-in variables the bytecode reads (code from builtins.py)."""
    lines = []
    for number, kind in plan.builtin_slots:
        lines += native_refresh_asm(number, kind)
    if lines:
        lines = ["mov (%rsi), %rsi"] + lines + [f"movabs ${plan.ctx:#x}, %rsi"]
    return lines


def _percpu_store(plan: DetourPlan) -> list[str]:
    """At the detour's end, every path: the per-CPU variables the hit used go back to the hitting CPU's copies
    (loaded at entry by `_builtins`; percpu.py)."""
    lines = []
    for number, kind in plan.builtin_slots:
        if kind.startswith("percpu_") and kind.split()[0].endswith("_w"):
            lines += percpu_store_asm(number, kind)
    if lines:
        lines = [f"movabs ${plan.ctx:#x}, %rsi", "mov (%rsi), %rsi"] + lines
    return lines


def _fast_path(plan: DetourPlan) -> list[str]:
    fast = plan.fast
    assert fast is not None and plan.condition is not None
    if fast.inline is not None:  # (a condition that is never true compiles to no code at all)
        return _inline_fast_path(fast)
    keep = fast.flags_live or fast.save_flags
    lines = ["pushfq"] if keep else []
    lines.append(f"incq counters+{FIRED:#x}(%rip)")
    lines.append(f"sub ${BLOCK_BYTES:#x}, %rsp")
    for name in fast.stores:
        lines.append(f"mov %{name}, {amd64.OFFSETS[amd64.REGISTER_INDEX[name]]:#x}(%rsp)")
    lines.append("mov %rsp, %rdi")
    if fast.needs_ctx or plan.condition_loops:
        lines.append(f"movabs ${plan.ctx:#x}, %rsi")
    if plan.condition_loops:
        lines.append(f"movq ${plan.loop_budget:#x}, {abi.CTX_LOOP_BUDGET:#x}(%rsi)")
    lines.append(f"call {plan.condition:#x}")
    if fast.can_fail:
        lines += [f"cmpq $0x0, {abi.CTX_ERROR:#x}(%rsi)", "jne fast_slow"]
    lines += ["test %rax, %rax", "jne fast_slow"]
    restore = [f"mov {amd64.OFFSETS[amd64.REGISTER_INDEX[name]]:#x}(%rsp), %{name}" for name in fast.restores]
    if fast.flags_live:
        lines += restore + [f"add ${BLOCK_BYTES:#x}, %rsp", "popfq"]
    else:  # dead flags: drop the saved copy, if any, with the block
        lines += restore + [f"add ${BLOCK_BYTES + (8 if keep else 0):#x}, %rsp"]
    lines.append(_TAIL)  # displaced code + jmp back
    # true (or failed): undo the partial save and give the full path the site's flags to record
    lines += ["fast_slow:"] + restore + [f"add ${BLOCK_BYTES:#x}, %rsp"] + (["popfq"] if keep else [])
    return lines


#: Where the fast path's byte blobs go in its lines (`_expand` writes them out; `fast_path_offset` finds them).
_INLINE, _TAIL = "@inline", "@tail"


def _inline_fast_path(fast: FastPath) -> list[str]:
    keep = fast.flags_live or fast.save_flags
    lines = ["pushfq"] if keep else []
    lines.append(f"incq counters+{FIRED:#x}(%rip)")
    lines += [f"push %{name}" for name in fast.restores]
    lines.append(_INLINE)  # the condition: jumps to fast_slow when true, falls through when false
    pops = [f"pop %{name}" for name in reversed(fast.restores)]
    if fast.flags_live:
        lines += pops + ["popfq"]
    else:  # dead flags: drop the saved copy, if any
        lines += pops + (["add $0x8, %rsp"] if keep else [])
    lines.append(_TAIL)  # displaced code + jmp back
    # true: give the full path the site's registers and flags to record
    return lines + ["fast_slow:"] + pops + (["popfq"] if keep else [])


def _expand(lines: list[str], fast: FastPath) -> list[str]:
    blobs = {_INLINE: fast.inline or b"", _TAIL: fast.tail}
    return [".byte " + ",".join(f"{b:#x}" for b in blobs[line]) if line in blobs else line for line in lines
            if blobs.get(line, True)]


def fast_path_offset(plan: DetourPlan, base: int, where: str) -> int:
    """Bytes from `base` to where the fast path's inline condition (`where="inline"`) or tail (`"tail"`) goes.
    Blobs before it count with their current length (a placeholder of the right size will do); a short forward
    jump to fast_slow has the same size with the label right after, as long as what follows stays under 128
    bytes."""
    assert plan.fast is not None
    lines = _DATA + _fast_path(plan)
    prefix = _expand(lines[: lines.index({"inline": _INLINE, "tail": _TAIL}[where])], plan.fast) + ["fast_slow:"]
    return len(assemble("\n".join(prefix), base))


def build(plan: DetourPlan, base: int) -> Detour:
    """Assemble the detour at `base`. Without a fast path the caller appends the displaced-code tail; with one,
    the tail sits right after the fast path (see FastPath) and the full path ends by jumping to it."""
    ctx = plan.ctx
    # The location's counters open the allocation on a page of their own (never executed); the detour's entry
    # starts the next page, so any path counts with one RIP-relative instruction and no write lands on code.
    lines = list(_DATA)
    assert not plan.from_user or (plan.fast is None and not plan.lean)
    if plan.from_user:
        lines.append("swapgs")  # the kernel's GS base: %gs:0x8 is the CPU's number again
    if plan.fast is not None:
        lines += _expand(_fast_path(plan), plan.fast)
    if plan.lean:
        lines += _lean_path(plan)
    lines += _save_block(plan.site, bool(plan.register_mask & _SEGMENTS) or plan.reads_segments, plan.from_user)
    lines += [f"movabs ${ctx:#x}, %rsi"]
    if plan.fast is None and not plan.lean:  # else the fast or the short path counted the hit already
        lines.append(f"incq counters+{FIRED:#x}(%rip)")
    lines += _builtins(plan)
    if plan.condition is not None:
        if plan.condition_loops:
            lines.append(f"movq ${plan.loop_budget:#x}, {abi.CTX_LOOP_BUDGET:#x}(%rsi)")
        lines += [
            "mov %rsp, %rdi",
            f"movabs ${plan.condition:#x}, %rax",
            "call *%rax",
            f"movabs ${ctx:#x}, %rsi",
            f"cmpq $0x0, {abi.CTX_ERROR:#x}(%rsi)",
            "jne error_call",
            "test %rax, %rax",
            "je done",
        ]
    lines += [
        f"incq counters+{HITS:#x}(%rip)",
        f"mov ${plan.tracepoint:#x}, %edi",
        f"mov ${plan.max_frame:#x}, %esi",
        f"movabs ${plan.runtime.reserve:#x}, %rax",
        "call *%rax",
        "test %rax, %rax",
        "je full_call",
        f"mov %rax, counters+{FRAME_START:#x}(%rip)",
        f"movabs ${ctx:#x}, %rsi",
        f"mov %rax, {abi.CTX_TRACE_PTR:#x}(%rsi)",
        f"mov %rdx, {abi.CTX_TRACE_LIMIT:#x}(%rsi)",
    ]
    lines += _collect_registers(plan)
    for index, (entry, fault_tolerant, loops) in enumerate(plan.actions):
        if entry is None:  # $_sdata: a hypercall writes the entry at ctx.trace_ptr
            lines += ["int3", f"movabs ${ctx:#x}, %rsi"]
            continue
        if isinstance(entry, SdataPlan):
            lines += _sdata_in_place(entry, index)
            continue
        if loops:
            lines.append(f"movq ${plan.loop_budget:#x}, {abi.CTX_LOOP_BUDGET:#x}(%rsi)")
        lines += [
            "mov %rsp, %rdi",
            f"movabs ${entry:#x}, %rax",
            "call *%rax",
            f"movabs ${ctx:#x}, %rsi",
            f"cmpq $0x0, {abi.CTX_ERROR:#x}(%rsi)",
        ]
        if fault_tolerant:
            # a memory range that cannot be read is left out of the frame (GDB shows it <unavailable>)
            lines += [
                f"je action{index}_done",
                f"cmpq ${int(ErrorCode.MEMORY_FAULT):#x}, {abi.CTX_ERROR:#x}(%rsi)",
                "jne error_call",
                f"movq $0x0, {abi.CTX_ERROR:#x}(%rsi)",
                f"action{index}_done:",
            ]
        else:
            lines.append("jne error_call")
    lines += [
        f"mov {abi.CTX_TRACE_PTR:#x}(%rsi), %rdi",
        "mov %rdi, %rdx",
        f"sub counters+{FRAME_START:#x}(%rip), %rdx",
        "add $0x6, %rdx",  # + the frame header, as qTP's usage counts it
        f"add %rdx, counters+{USAGE:#x}(%rip)",
        f"movabs ${plan.runtime.commit:#x}, %rax",
        "call *%rax",
    ]
    if plan.pass_count:
        if plan.pass_count < 1 << 31:  # cmp takes a sign-extended 32-bit immediate
            lines.append(f"cmpq ${plan.pass_count:#x}, counters+{HITS:#x}(%rip)")
        else:  # %rax is free again once the commit returned
            lines += [f"movabs ${plan.pass_count:#x}, %rax", f"cmp %rax, counters+{HITS:#x}(%rip)"]
        lines += [
            "jb done",
            "pass_call:",
            "int3",
            "jmp done",
        ]
    lines += [
        "jmp done",
        "error_call:",
        "int3",
        "jmp done",
        "full_call:",
        "int3",
        "done:",
    ] + _percpu_store(plan) + _restore_block()
    lines.append(_to_tail(plan) if plan.fast is not None else "detour_tail:")
    if plan.from_user:  # back to the program's pad, its GS base back
        lines += ["swapgs", "lretq"]
    code = assemble("\n".join(lines), base)
    entry = base + DATA_PAGE
    # The hypercall int3s, in source order: [pass_call,] error_call, full_call (decoded, so an 0xcc inside an
    # immediate is never mistaken for one).
    calls = [insn.address for insn in decode(code[DATA_PAGE:], entry) if insn.mnemonic == "int3"]
    sdata = sum(1 for entry, *_ in plan.actions if entry is None)  # only the hypercall form has an int3
    sdata_calls, calls = tuple(calls[:sdata]), calls[sdata:]
    if plan.pass_count:
        pass_call, error_call, full_call = calls
    else:
        (error_call, full_call), pass_call = calls, 0
    return Detour(entry, code, error_call, full_call, pass_call, sdata_calls, counters=base)


#: Register mask bits of cs..gs.
_SEGMENTS = sum(1 << amd64.REGISTER_INDEX[name] for name in ("cs", "ss", "ds", "es", "fs", "gs"))


def _collect_registers(plan: DetourPlan) -> list[str]:
    """The register block at the frame's start (%rax), from the block on the stack: all of GDB's `R` block
    (the x87 part zero), or the compact `r` block of the registers the mask names (frames.py)."""
    mask = plan.register_mask
    if not mask:
        return []
    lines = ["mov %rax, %rdi"]
    if mask == ALL_GENERAL:
        # 'R' + the 24 registers + zeros up to the `g` packet's length (x87 state: not collected)
        zero_bytes = amd64.G_PACKET_SIZE - abi.REG_BLOCK_BYTES
        assert zero_bytes % 8 == 0 and BLOCK_BYTES - abi.REG_BLOCK_BYTES == 4
        lines += [
            "movb $0x52, (%rdi)",
            "inc %rdi",
            "mov %rsp, %rsi",
            f"mov ${BLOCK_BYTES // 8:#x}, %ecx",  # qwords: the block's 4 bytes of padding are zeroed next
            "rep movsq",
            "sub $0x4, %rdi",
            "xor %eax, %eax",
            f"mov ${zero_bytes // 8:#x}, %ecx",
            "rep stosq",
        ]
    else:
        lines += ["movb $0x72, (%rdi)", f"movl ${mask:#x}, 0x1(%rdi)"]
        at = 1 + COMPACT_HEADER.size
        for index, register in enumerate(amd64.GENERAL_REGISTERS):
            if mask >> index & 1:
                source = "%rax" if register.size == 8 else "%eax"  # a 32-bit load zero-extends
                lines += [f"mov {amd64.OFFSETS[index]:#x}(%rsp), {source}", f"mov %rax, {at:#x}(%rdi)"]
                at += 8
        lines.append(f"add ${at:#x}, %rdi")
    return lines + [f"movabs ${plan.ctx:#x}, %rsi", f"mov %rdi, {abi.CTX_TRACE_PTR:#x}(%rsi)"]


def _to_tail(plan: DetourPlan) -> str:
    """The jump to the displaced instructions: they follow the fast path, or the detour's code."""
    return f"jmp {plan.fast_tail_address:#x}" if plan.fast is not None else "jmp detour_tail"


#: The entry header's fields, as ring.py lays them out (the GDB frame header after it: u16 tracepoint, u32 size).
_LENGTH, _TIMESTAMP, _SEQUENCE = ENTRY_LENGTH, ENTRY_TIMESTAMP, ENTRY_SEQUENCE
_TRACEPOINT, _FRAME_SIZE = FRAME_AT, FRAME_AT + 2


def _lean_path(plan: DetourPlan) -> list[str]:
    """A frame of a compact register block and `$_sdata` entries built from registers only, written straight
    into the ring: its size is known here, so when the ring's short-path limit shows it fits with no padding and
    no eviction, the entry is stamped and published in place, registers stored from where they are, with none of
    the full path's block save, calls or hypercalls. Otherwise it falls through to the full path with the site's
    state untouched (the condition, pure, is then evaluated again there). Reached with the site's registers and
    flags, right after the fast path found the condition true, or at the entry."""
    mask = plan.register_mask
    sdata = [entry for entry, _, _ in plan.actions]
    assert all(isinstance(entry, SdataPlan) for entry in sdata) and mask != ALL_GENERAL and (mask or sdata)
    assert not mask or plan.site >= (1 << 64) - (1 << 31)  # rip is stored as a sign-extended imm32
    frame_size = register_bytes(mask) + sum(3 + entry.entry_size for entry in sdata)

    def ctl(field: int) -> str:  # the hitting CPU's control field (ring.py: r8 = the CPU number)
        return f"{control_disp(plan.ring_ctl, field)}(,%r8,8)"

    need = (BLOCKS_AT + max(frame_size, 8) + 7) & ~7  # what ring_reserve would take for it
    pushed = ("rax", "rcx", "rdx", "r8")
    lines = ["pushfq", "cli"]
    if plan.fast is None:
        lines.append(f"incq counters+{FIRED:#x}(%rip)")
    lines += [f"push %{name}" for name in pushed]
    slot = {name: 8 * (len(pushed) - 1 - i) for i, name in enumerate(pushed)}  # where each pushed one is
    flags_slot, site_rsp = 8 * len(pushed), 8 * len(pushed) + 8
    lines += [
        "rdtsc",
        "shl $0x20, %rdx",
        "or %rax, %rdx",  # the timestamp
        f"mov %gs:{PERCPU_CPU_NUMBER:#x}, %r8d",  # this CPU's ring: its fields are ctl(field)(,%r8,8)
        f"mov {ctl(CTL_HEAD)}, %rax",
        f"add ${need:#x}, %rax",
        f"cmp {ctl(CTL_LIMIT)}, %rax",
        "ja lean_slow",
        f"mov {ctl(CTL_PHYS)}, %rcx",  # the entry
        f"mov %rdx, {_TIMESTAMP:#x}(%rcx)",
        f"movl ${need:#x}, {_LENGTH:#x}(%rcx)",  # length
        f"mov %r8d, {_LENGTH + 4:#x}(%rcx)",  # cpu
        f"mov {ctl(CTL_CREATED)}, %rdx",
        f"mov %rdx, {_SEQUENCE:#x}(%rcx)",
        f"movw ${plan.tracepoint:#x}, {_TRACEPOINT:#x}(%rcx)",
        f"movl ${frame_size:#x}, {_FRAME_SIZE:#x}(%rcx)",
    ]
    at = BLOCKS_AT
    if mask:
        lines += [f"movb $0x72, {at:#x}(%rcx)", f"movl ${mask:#x}, {at + 1:#x}(%rcx)"]
        at += 1 + COMPACT_HEADER.size
    for index, register in enumerate(amd64.GENERAL_REGISTERS):
        if not mask >> index & 1:
            continue
        name = register.name
        if name == "rip":
            lines.append(f"movq ${plan.site - (1 << 64):#x}, {at:#x}(%rcx)")
        elif name == "eflags":
            lines += [f"mov {flags_slot:#x}(%rsp), %edx", f"mov %rdx, {at:#x}(%rcx)"]
        elif register.size == 4:  # a segment register: its selector, zero-extended
            lines += [f"mov %{name}, %edx", f"mov %rdx, {at:#x}(%rcx)"]
        elif name in slot or name == "rsp":
            lines += _into_rdx(name, 8, slot, site_rsp) + [f"mov %rdx, {at:#x}(%rcx)"]
        else:
            lines.append(f"mov %{name}, {at:#x}(%rcx)")
        at += 8
    for entry in sdata:  # `collect $_sdata`: the marker's fields from the argument registers, as _sdata_in_place
        lines += [f"movb $0x53, {at:#x}(%rcx)", f"movw ${entry.entry_size:#x}, {at + 1:#x}(%rcx)"]
        lines += _zero_gaps(entry, "%rcx", at + 3, "rdx")
        for offset, field_size, block_offset, width in entry.fields:
            lines += _into_rdx(_BLOCK_REGISTER[block_offset], width, slot, site_rsp)
            lines.append(f"mov %{_SUB['rdx'][field_size]}, {at + 3 + offset:#x}(%rcx)")
        at += 3 + entry.entry_size
    pops = [f"pop %{name}" for name in reversed(pushed)] + ["popfq"]
    return lines + [
        f"incq {ctl(CTL_CREATED)}",
        f"incq {ctl(CTL_FRAMES)}",
        f"addq ${need:#x}, {ctl(CTL_PHYS)}",
        f"incq counters+{HITS:#x}(%rip)",
        f"addq ${frame_size + FRAME_HEADER.size:#x}, counters+{USAGE:#x}(%rip)",  # what qTP's usage counts
        f"mov %rax, {ctl(CTL_HEAD)}",  # published
        *pops,
        _to_tail(plan),
        "lean_slow:",
        *pops,
    ]


#: The general registers by their offset in the register block, and each one's names by width.
_BLOCK_REGISTER = {amd64.OFFSETS[i]: r.name for i, r in enumerate(amd64.GENERAL_REGISTERS[:16])}
_SUB = {
    **{name: {8: name, 4: "e" + name[1:], 2: name[1:], 1: name[1] + "l"} for name in ("rax", "rbx", "rcx", "rdx")},
    **{name: {8: name, 4: "e" + name[1:], 2: name[1:], 1: name[1:] + "l"} for name in ("rsi", "rdi", "rbp", "rsp")},
    **{f"r{n}": {8: f"r{n}", 4: f"r{n}d", 2: f"r{n}w", 1: f"r{n}b"} for n in range(8, 16)},
}


def _into_rdx(name: str, width: int, slot: dict[str, int], site_rsp: int) -> list[str]:
    """%rdx = the low `width` bytes of the site's register `name`, zero-extended, on the short path: the
    registers it pushed are on the stack, rsp is above them."""
    if name in slot:
        source = f"{slot[name]:#x}(%rsp)"
        return [{8: f"mov {source}, %rdx", 4: f"mov {source}, %edx", 2: f"movzwl {source}, %edx",
                 1: f"movzbl {source}, %edx"}[width]]
    lines = [f"lea {site_rsp:#x}(%rsp), %rdx"] if name == "rsp" else []
    source = "rdx" if name == "rsp" else name
    if width == 8:
        return lines + ([] if source == "rdx" else [f"mov %{source}, %rdx"])
    if width == 4:
        return lines + [f"mov %{_SUB[source][4]}, %edx"]
    return lines + [f"movz{'w' if width == 2 else 'b'}l %{_SUB[source][width]}, %edx"]


def _zero_gaps(sdata: SdataPlan, pointer: str, at: int, zero: str) -> list[str]:
    """Zero the bytes of an `S` entry (at `at`(`pointer`)) that no field covers: padding reads as zero."""
    covered = set()
    for offset, field_size, _, _ in sdata.fields:
        covered.update(range(offset, offset + field_size))
    gaps = [i for i in range(sdata.entry_size) if i not in covered]
    if not gaps:
        return []
    lines = [f"xor %{_SUB[zero][4]}, %{_SUB[zero][4]}"]
    position = 0
    while position < sdata.entry_size:
        step = next(w for w in (8, 4, 2, 1) if position % w == 0 and position + w <= sdata.entry_size)
        if any(position <= g < position + step for g in gaps):
            lines.append(f"mov %{_SUB[zero][step]}, {at + position:#x}({pointer})")
        position += step
    return lines


def register_bytes(mask: int) -> int:
    """Bytes the register block of `mask` takes in a frame."""
    if not mask:
        return 0
    return 1 + (amd64.G_PACKET_SIZE if mask == ALL_GENERAL else COMPACT_HEADER.size + 8 * mask.bit_count())


_LOAD = {8: "mov {src}, %rax", 4: "mov {src}, %eax", 2: "movzwl {src}, %eax", 1: "movzbl {src}, %eax"}
_STORE = {8: "%rax", 4: "%eax", 2: "%ax", 1: "%al"}


def _sdata_in_place(sdata: SdataPlan, index: int) -> list[str]:
    """The `S` block at ctx.trace_ptr (ctx in %rsi, the register block at %rsp): header, the entry zeroed, each
    field from its argument register (zero-extended from the argument's width, stored in the field's size). A
    frame without room for it goes on without it, as the hypercall form does."""
    size = 3 + sdata.entry_size
    lines = [
        f"mov {abi.CTX_TRACE_PTR:#x}(%rsi), %rdi",
        f"lea {size:#x}(%rdi), %rdx",
        f"cmp {abi.CTX_TRACE_LIMIT:#x}(%rsi), %rdx",
        f"ja sdata{index}_done",
        "movb $0x53, (%rdi)",
        f"movw ${sdata.entry_size:#x}, 0x1(%rdi)",
    ]
    lines += _zero_gaps(sdata, "%rdi", 3, "rax")
    for offset, field_size, block_offset, width in sdata.fields:
        lines.append(_LOAD[width].format(src=f"{block_offset:#x}(%rsp)"))
        lines.append(f"mov {_STORE[field_size]}, {3 + offset:#x}(%rdi)")
    lines += [f"mov %rdx, {abi.CTX_TRACE_PTR:#x}(%rsi)", f"sdata{index}_done:"]
    return lines


def collect_memory_bytecode(basereg: int, offset: int, length: int) -> bytes:
    """An `M` action as agent bytecode (`trace` of a fixed range), so the compilers handle it like any other."""
    code = bytearray()
    if basereg >= 0:
        code += bytes((0x26,)) + basereg.to_bytes(2, "big")  # reg N
        code += b"\x25" + (offset & (2**64 - 1)).to_bytes(8, "big")  # const64
        code += b"\x02"  # add
    else:
        code += b"\x25" + (offset & (2**64 - 1)).to_bytes(8, "big")
    code += b"\x23" + min(length, 0xFFFF).to_bytes(2, "big")  # const16
    code += b"\x0c"  # trace
    code += b"\x27"  # end
    return bytes(code)
