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
