"""The CPU's interrupt hook in machine code: an int3 of the jump table goes on at its target with no Python.

The compiled engines' int3 probes enter their detours this way, as jump probes do; every other interrupt (the
kernel's own int3, int $0x80, faults, the stub's Python breakpoints and hypercalls) still reaches the Python
handler unchanged.
"""

from __future__ import annotations

import random

import pytest

from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.cpu import InterruptDispatch
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import Tracer

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)
SITE = IMAGE.address_of("kgtp_test_function")


def test_table_entries_survive_collisions_and_removals():
    machine = Machine(IMAGE)
    jumps = machine.cpu.jumps
    rng = random.Random(7)
    base = 0xFFFFFFFF81000000
    # many keys on few home slots: long probe runs, removals from their middle
    keys = [base + InterruptDispatch.SLOTS * rng.randrange(64) + rng.randrange(8) for _ in range(300)]
    keys = list(dict.fromkeys(keys))
    for i, key in enumerate(keys):
        jumps.set(key, 0x1000 + i, space=0x2000 * (i % 2))
    for key in keys[::3]:
        jumps.remove(key)
    kept = {key: 0x1000 + i for i, key in enumerate(keys) if i % 3}
    assert jumps.table == kept
    for key, target in kept.items():  # what the machine code finds: the slot its probe run reaches
        at = 4 * jumps._find(key)
        assert tuple(jumps._slots[at:at + 3]) == (key, target, 0x2000 * ((target - 0x1000) % 2))
    occupied = sum(1 for i in range(InterruptDispatch.SLOTS) if jumps._slots[4 * i])
    assert occupied == len(kept)


@pytest.mark.parametrize("engine", ["naive", "opt"])
def test_a_compiled_int3_probe_runs_no_python_per_hit(engine):
    frames = {}
    for probe in ("int3", "auto"):
        machine = Machine(IMAGE)
        machine.call("kgtp_bench_loop", 0)
        tracer = Tracer(machine, engine, probe=probe)
        tracer.definitions.define(t.DefineTracepoint.parse(b"1:%x:E:0:0-" % SITE))
        tracer.definitions.add_actions(t.TracepointActions.parse(b"1:%x:R01ffff" % SITE))
        tracer.start()
        python_before = machine.cpu.breakpoint_hits
        machine.call("kgtp_bench_loop", 50)
        frames[probe] = [f.blocks for f in tracer.frames()]
        native_hits = machine.cpu.jumps.hits
        python_hits = machine.cpu.breakpoint_hits - python_before
        tracer.stop(t.StopReason.STOP_COMMAND)
        if probe == "int3":
            assert tracer.probe_rows()[0].kind == "int3"
            assert native_hits == 50 and python_hits == 0  # every hit dispatched in machine code
            assert machine.read_memory(SITE, 1) == IMAGE.read_code(SITE, 1) and not machine.cpu.jumps.table
    assert len(frames["int3"]) == 50 and frames["int3"] == frames["auto"]  # the same frames as through the jump


def test_other_interrupts_still_reach_the_kernel():
    """A running kernel takes its ticks, system calls and faults through the Python handler as before."""
    machine = Machine(IMAGE, hz=1000)
    machine.start()
    try:
        import time

        deadline = time.monotonic() + 30
        while machine.stats(count=False).jiffies < 20:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        delivered = dict(machine.cpu.delivered)
    finally:
        machine.shutdown()
    assert delivered.get(32, 0) >= 20 and delivered.get(0x80, 0) > 0 and delivered.get(14, 0) > 0


def test_the_committed_code_is_its_source_assembled():
    """InterruptDispatch.CODE is SOURCE as keystone assembles it (the bytes are committed so that building a CPU
    loads no assembler); the PC-sync slot is there once, and filled it is the flag's store, or a 7-byte nop."""
    from capstone import CS_ARCH_X86, CS_MODE_64, Cs

    from kgtp_sim.machine.dispatch import PC_SYNC_SLOT, PC_SYNC_SLOT_SOURCE, assemble, fill_pc_sync_slot, hook_source
    from kgtp_sim.uc_native import pc_sync_flag_offset

    assert InterruptDispatch.CODE == assemble(hook_source(InterruptDispatch.SOURCE, InterruptDispatch.REGISTERS))
    assert assemble(PC_SYNC_SLOT_SOURCE) == PC_SYNC_SLOT and InterruptDispatch.CODE.count(PC_SYNC_SLOT) == 1
    filled = fill_pc_sync_slot(InterruptDispatch.CODE)
    at = InterruptDispatch.CODE.index(PC_SYNC_SLOT)
    assert filled[:at] + filled[at + 7:] == InterruptDispatch.CODE[:at] + InterruptDispatch.CODE[at + 7:]
    (store,) = Cs(CS_ARCH_X86, CS_MODE_64).disasm(filled[at: at + 7], 0)
    offset = pc_sync_flag_offset()
    expected = ("nop", "dword ptr [rax]") if offset is None else ("mov", f"byte ptr [rbx + {offset:#x}], 0")
    assert (store.size, store.mnemonic, store.op_str) == (7, *expected)
