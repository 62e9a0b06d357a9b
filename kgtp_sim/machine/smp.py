"""What the machine and the kernel agree on for several CPUs: the per-CPU area, the SMP ports, the CPUs' states.

Owns constants and pure readers; no thread of its own (the readers run on the CPU thread, inside a hit or a
posted request, with the CPU they ask about loaded in the unicorn instance).

The per-CPU area. The kernel keeps `struct cpu_data cpu_data[NR_CPUS]` (fixtures/kernel/include/kernel.h); the
machine, as a bootloader does for the boot CPU, points each CPU's GS base at its element before the CPU's first
instruction, so `%gs:0` is the running task (the kernel's `current`) and `%gs:8` the CPU's number
(`smp_processor_id()`) on every CPU, and also on a machine that has not booted (a `Machine.call` runs on CPU 0's
statically initialised element). What a KGTP hit reads as `current` and `smp_processor_id()` is read the same way
here: Python through GS base, native code with `%gs:` operands.

The ports (`in`/`out` from the kernel):

| port | access | meaning |
|------|--------|---------|
| 0xe0 | inl  | how many CPUs the machine has (1..8) |
| 0xe1 | outl | start CPU `value` at the address in %rdi, in the bootloader's state, with %rdi = its number |
| 0xe2 | outl | inter-processor interrupt: `value` = target CPU << 8 \\| vector |
| 0xe3 | outl | yield: the calling CPU gives up the rest of its turn (a spinlock waiter whose holder is not running) |
"""

from __future__ import annotations

from dataclasses import dataclass

from unicorn import Uc, UcError
from unicorn import x86_const as X

MAX_CPUS = 8
PER_CPU_SYMBOL = "cpu_data"  #: the kernel's array of per-CPU areas, MAX_CPUS of them
PERCPU_CURRENT_TASK = 0x0  #: struct task_struct *current_task
PERCPU_CPU_NUMBER = 0x8  #: unsigned int cpu_number

MSR_KERNEL_GS_BASE = 0xC000_0102

PORT_SMP_CPUS = 0xE0
PORT_SMP_START = 0xE1
PORT_SMP_IPI = 0xE2
PORT_SMP_YIELD = 0xE3
SMP_PORTS = (PORT_SMP_CPUS, PORT_SMP_START, PORT_SMP_IPI, PORT_SMP_YIELD)


@dataclass(frozen=True)
class CpuState:
    """One CPU as `info threads` shows it."""

    index: int
    state: str  #: "running", "idle" (in hlt), or "offline" (the kernel has not started it)
    rip: int
    current_task: int  #: the task it runs (its per-CPU `current_task`), 0 if unknown


def per_cpu_area(image, cpu: int) -> int:
    """Where CPU `cpu`'s element of the kernel's per-CPU array is (0 if the kernel has none)."""
    symbol = image.symbols.get(PER_CPU_SYMBOL)
    if symbol is None or not symbol.size:
        return 0
    return symbol.address + cpu * (symbol.size // MAX_CPUS)


def _read(uc: Uc, offset: int, size: int) -> int:
    base = uc.reg_read(X.UC_X86_REG_GS_BASE)
    if uc.reg_read(X.UC_X86_REG_CS) & 3:  # in user mode the per-CPU area's base waits in KERNEL_GS_BASE (swapgs)
        base = uc.msr_read(MSR_KERNEL_GS_BASE)
    if not base:
        return 0
    try:
        return int.from_bytes(uc.mem_read(base + offset, size), "little")
    except UcError:
        return 0


def cpu_number(uc: Uc) -> int:
    """smp_processor_id() of the CPU loaded in `uc`."""
    return _read(uc, PERCPU_CPU_NUMBER, 4)


def current_task(uc: Uc) -> int:
    """`current` on the CPU loaded in `uc`: the address of its running task_struct."""
    return _read(uc, PERCPU_CURRENT_TASK, 8)
