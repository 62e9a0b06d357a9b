"""Retired code (patching/retire.py) is freed only when nothing can run it any more, including through other
retired code: a return probe's trampoline returns to the address in its own immediate, which is another
trampoline when two return probes caught one call (schedule tail-calling switch_stacks under `kgtp-fbt *`)."""

from __future__ import annotations

from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.tracing.kgtp.kret import trampoline_code
from kgtp_sim.tracing.patching.retire import RetiredCode

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)


def test_a_trampoline_kept_by_a_stack_keeps_the_one_it_returns_to():
    machine = Machine(IMAGE)
    inner, outer = machine.alloc_code(0x40), machine.alloc_code(0x40)
    caller = IMAGE.address_of("kgtp_bench_loop") + 0x1E  # a return address
    machine.write_memory(inner, trampoline_code(caller))
    machine.write_memory(outer, trampoline_code(inner))  # returns into the inner trampoline
    word = IMAGE.address_of("jiffies")  # a word of the kernel's writable memory: a task's stack slot here
    machine.write_memory(word, outer.to_bytes(8, "little"))
    retired = RetiredCode(machine)
    retired.add([(inner, inner + 0x40), (outer, outer + 0x40)])
    retired.release()
    assert sorted(retired.regions) == sorted([(inner, inner + 0x40), (outer, outer + 0x40)])
    machine.write_memory(word, caller.to_bytes(8, "little"))  # that call returned
    retired.release()
    assert retired.regions == []


def test_a_detour_kept_by_a_stack_keeps_the_link_it_jumps_to():
    """A detour of a chain (several locations at one address) goes on to its link by `jmp rel32`, not through an
    absolute word: the link stays while the detour does, and goes with it."""
    from kgtp_sim.tracing.patching.probes import jump

    machine = Machine(IMAGE)
    link, detour = machine.alloc_code(0x20), machine.alloc_code(0x40)
    machine.write_memory(detour, b"\x90" * 8 + jump(detour + 8, link))
    word = IMAGE.address_of("jiffies")  # a task's saved RIP inside the detour
    machine.write_memory(word, (detour + 4).to_bytes(8, "little"))
    retired = RetiredCode(machine)
    retired.add([(link, link + 0x20), (detour, detour + 0x40)])
    retired.release()
    assert sorted(retired.regions) == sorted([(link, link + 0x20), (detour, detour + 0x40)])
    assert machine.alloc_code(0x20) not in (link, detour)  # neither is free for the next allocation
    machine.write_memory(word, bytes(8))  # that task went on
    retired.release()
    assert retired.regions == []


def test_the_words_found_are_the_aligned_words_in_the_range_and_only_those():
    """stacks_point_into finds a range's words by the top bytes they share: checked against every aligned word,
    for ranges sharing eight to none of their top bytes, with words planted at aligned and unaligned places."""
    import array
    import random

    from kgtp_sim.machine.layout import MODULE_BASE
    from kgtp_sim.tracing.patching.retire import stacks_point_into, writable_memory

    machine = Machine(IMAGE)
    base = IMAGE.address_of("jiffies") & ~7
    planted = MODULE_BASE + 0x12340
    machine.write_memory(base, planted.to_bytes(8, "little"))  # aligned: counts
    machine.write_memory(base + 8 * 5 + 3, (MODULE_BASE + 0x56780).to_bytes(8, "little"))  # unaligned: does not
    memory = writable_memory(machine, machine.uc)

    def every_word(low: int, high: int) -> bool:
        return any(low <= word < high for data in memory for word in array.array("Q", data))

    random.seed(7)
    ranges = [(planted, planted + 1), (planted - 0x40, planted), (planted + 1, planted + 0x40),
              (MODULE_BASE + 0x56780, MODULE_BASE + 0x56788), (MODULE_BASE, MODULE_BASE + (64 << 20)),
              (0, 1 << 64), (0, 0x1000), (planted, planted), (1 << 63, (1 << 64) - 1)]
    text = IMAGE.address_of("schedule")
    ranges += [(text + 1, text + 5), (0xFFFF_FFFF_8100_0000, 0xFFFF_FFFF_8200_0000)]
    for _ in range(40):
        low = random.choice([MODULE_BASE, 0xFFFF_FFFF_8100_0000, base, 0]) + random.randrange(1 << 20)
        ranges.append((low, low + random.choice([1, 7, 8, 64, 4096, 1 << 20, 1 << 40])))
    found = [stacks_point_into(machine, machine.uc, low, min(high, 1 << 64), memory) for low, high in ranges]
    assert found == [every_word(low, min(high, 1 << 64)) for low, high in ranges]
    assert found[:5] == [True, False, False, False, True]  # the planted word; the unaligned one is no word
    assert any(found[5:]) and not all(found[5:])
