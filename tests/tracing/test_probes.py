"""Probe placement rules and relocation of displaced instructions, checked by running both in unicorn."""

import pytest
from keystone import KS_ARCH_X86, KS_MODE_64, KS_OPT_SYNTAX_ATT, Ks
from unicorn import UC_ARCH_X86, UC_MODE_64, UC_TLB_VIRTUAL, Uc
from unicorn.x86_const import UC_X86_REG_RAX, UC_X86_REG_RSP

from kgtp_sim.tracing.patching.probes import ProbePlacementError, decode, jump, plan_probe, relocate, relocated_size_bound

TEXT = 0xFFFFFFFF81000000
DETOUR = 0xFFFFFFFFA0000000
STACK = 0xFFFFC90000000000


def assemble(source: str, base: int = TEXT) -> bytes:
    ks = Ks(KS_ARCH_X86, KS_MODE_64)
    ks.syntax = KS_OPT_SYNTAX_ATT
    code, _ = ks.asm(source, base)
    return bytes(code)


class Source:
    """A kernel with functions laid out back to back, as the ELF symbol table would describe them."""

    def __init__(self, functions: dict[str, str]):
        self.code = b""
        self.functions = []
        for name, body in functions.items():
            start = TEXT + len(self.code)
            for other, other_start, _ in self.functions:  # '{name}' in a body = that function's address
                body = body.replace("{" + other + "}", hex(other_start))
            blob = assemble(body, start)
            self.functions.append((name, start, start + len(blob)))
            self.code += blob
        self.text_range = (TEXT, TEXT + len(self.code))

    def function_bounds(self, address):
        return next(((n, s, e) for n, s, e in self.functions if s <= address < e), None)

    def read_code(self, address, length):
        return self.code[address - TEXT : address - TEXT + length]

    def address_of(self, name, index):
        _, start, end = next(f for f in self.functions if f[0] == name)
        return decode(self.read_code(start, end - start), start)[index].address


SIMPLE = Source({
    "f": "push %rbp; mov %rsp, %rbp; mov $0x5, %eax; add %edi, %eax; pop %rbp; ret",
    "loop": "xor %eax, %eax; top: add $0x1, %eax; cmp $0xa, %eax; jne top; ret",
    "table": "jmp *%rdi; nop; nop; nop; nop; ret",
    "callee": "mov $0x7, %eax; ret",
    "caller": "call {callee}; add $0x1, %eax; ret",
})


def test_refuses_outside_text_and_mid_instruction():
    with pytest.raises(ProbePlacementError, match="outside kernel text"):
        plan_probe(SIMPLE, TEXT - 1, "int3")
    with pytest.raises(ProbePlacementError, match="middle of an instruction"):
        plan_probe(SIMPLE, TEXT + 2, "jump")


def test_refuses_window_covering_a_jump_target():
    # 'xor %eax,%eax' is 2 bytes; a jump there covers 'top', the loop's branch target
    with pytest.raises(ProbePlacementError, match="jump target"):
        plan_probe(SIMPLE, SIMPLE.address_of("loop", 0), "jump")
    assert plan_probe(SIMPLE, SIMPLE.address_of("loop", 0), "int3").kind == "int3"


def test_refuses_window_crossing_function_end():
    with pytest.raises(ProbePlacementError, match="end of f"):
        plan_probe(SIMPLE, SIMPLE.address_of("f", 4), "jump")  # pop %rbp; ret: 2 bytes left


def test_refuses_function_with_indirect_jump():
    with pytest.raises(ProbePlacementError, match="indirect jump"):
        plan_probe(SIMPLE, SIMPLE.address_of("table", 0), "jump")


def test_plans_jump_over_whole_instructions():
    site = plan_probe(SIMPLE, SIMPLE.address_of("f", 0), "jump")
    assert [i.mnemonic for i in site.displaced] == ["push", "mov", "mov"]
    assert site.length == 1 + 3 + 5 and site.original == SIMPLE.code[: site.length]


def run(code: bytes, start: int, until: int, rdi: int = 0, extra: dict | None = None) -> int:
    uc = Uc(UC_ARCH_X86, UC_MODE_64)
    uc.ctl_set_tlb_mode(UC_TLB_VIRTUAL)
    uc.mem_map(TEXT, 0x10000)
    uc.mem_map(DETOUR, 0x1000)
    uc.mem_map(STACK, 0x4000)
    uc.mem_write(TEXT, code)
    for address, blob in (extra or {}).items():
        uc.mem_write(address, blob)
    uc.reg_write(UC_X86_REG_RSP, STACK + 0x3000)
    uc.mem_write(STACK + 0x3000, until.to_bytes(8, "little"))  # return address = stop address
    from unicorn.x86_const import UC_X86_REG_RDI

    uc.reg_write(UC_X86_REG_RDI, rdi)
    uc.emu_start(start, until, count=10_000)
    return uc.reg_read(UC_X86_REG_RAX)


def patched(source: Source, site) -> tuple[bytes, bytes]:
    """Kernel code with the probe's jump in place, and the detour: displaced code + jump back."""
    detour = relocate(site.displaced, DETOUR)
    detour += jump(DETOUR + len(detour), site.resume_address)
    offset = site.address - TEXT
    code = bytearray(source.code)
    code[offset : offset + site.length] = jump(site.address, DETOUR).ljust(site.length, b"\x90")
    return bytes(code), detour


@pytest.mark.parametrize("name", ["f", "caller"])
def test_relocated_code_computes_the_same(name):
    start = next(s for n, s, e in SIMPLE.functions if n == name)
    done = TEXT + 0x8000
    expected = run(SIMPLE.code, start, done, rdi=37)
    site = plan_probe(SIMPLE, start, "jump")
    code, detour = patched(SIMPLE, site)
    assert code != SIMPLE.code
    assert run(code, start, done, rdi=37, extra={DETOUR: detour}) == expected


def test_rip_relative_operand_is_relocated():
    source = Source({"g": "mov counter(%rip), %rax; ret; counter: .quad 0x1122334455667788"})
    site = plan_probe(source, TEXT, "jump")
    assert site.displaced[0].rip_disp_offset is not None
    code, detour = patched(source, site)
    done = TEXT + 0x8000
    assert run(code, TEXT, done, extra={DETOUR: detour}) == 0x1122334455667788


def test_conditional_branch_in_window_is_relocated():
    source = Source({"h": "test %edi, %edi; je zero; mov $0x1, %eax; ret; zero: mov $0x2, %eax; ret"})
    site = plan_probe(source, TEXT, "jump")
    assert [i.mnemonic for i in site.displaced] == ["test", "je", "mov"]
    code, detour = patched(source, site)
    done = TEXT + 0x8000
    for rdi, want in ((0, 2), (5, 1)):
        assert run(code, TEXT, done, rdi=rdi, extra={DETOUR: detour}) == want


def test_call_inside_window_is_refused_but_int3_is_fine():
    source = Source({"d": "ret", "c": "call {d}; nop; nop; ret"})
    # 'call d' is 5 bytes, so the window is just the call: allowed (call last)
    assert plan_probe(source, TEXT + 1, "jump").displaced[0].mnemonic == "call"
    source2 = Source({"c2": "int $0x80; nop; nop; nop; ret"})
    with pytest.raises(ProbePlacementError, match="return into the middle"):
        plan_probe(source2, TEXT, "jump")


def test_int3_site_resumes_after_the_whole_instruction():
    source = Source({"k": "addl $0x1, counter(%rip); nop; ret; counter: .long 0x0"})
    site = plan_probe(source, TEXT, "int3")
    assert site.length == 1 and site.resume_address == TEXT + site.displaced[0].size == TEXT + 7


def test_a_call_whose_return_address_no_imm32_reaches_is_relocated_with_two_stores():
    """A program's call (a PIE at 0x555555554000) relocated to a pad below it: the pushed return address is the
    original one, all 64 bits, and the flags are what the call leaves (lea and mov touch none)."""
    from unicorn.x86_const import UC_X86_REG_EFLAGS, UC_X86_REG_RIP

    base, pad, stack = 0x555555554000, 0x555515554000, 0x7FFFF0000000
    call = b"\xe8" + (0x100 - 5).to_bytes(4, "little")  # call base+0x100
    insn = decode(call, base)[0]
    body = relocate((insn,), pad)
    assert len(body) <= relocated_size_bound((insn,))
    uc = Uc(UC_ARCH_X86, UC_MODE_64)
    for address in (base, pad, stack):
        uc.mem_map(address, 0x1000)
    uc.mem_write(pad, body)
    uc.mem_write(base + 0x100, b"\x90")
    uc.reg_write(UC_X86_REG_RSP, stack + 0x800)
    uc.reg_write(UC_X86_REG_EFLAGS, 0x2D7)  # CF PF AF ZF SF set
    uc.emu_start(pad, base + 0x100, count=100)
    assert uc.reg_read(UC_X86_REG_RIP) == base + 0x100
    assert uc.reg_read(UC_X86_REG_RSP) == stack + 0x800 - 8
    assert int.from_bytes(uc.mem_read(stack + 0x800 - 8, 8), "little") == base + 5
    assert uc.reg_read(UC_X86_REG_EFLAGS) & 0xFFF == 0x2D7


def test_the_instructions_that_enter_the_kernel_are_told_apart():
    from kgtp_sim.tracing.patching.probes import enters_kernel

    for code in (b"\x0f\x05", b"\x0f\x34", b"\xcd\x80", b"\xcd\x03"):  # syscall, sysenter, int $0x80, int $3
        assert enters_kernel(code + b"\x90"), code
    for code in (b"\x0f\x0b", b"\x48\x89\xc7", b"\xcc", b"\x0f", b""):  # ud2, mov, int3, a prefix cut short
        assert not enters_kernel(code), code
