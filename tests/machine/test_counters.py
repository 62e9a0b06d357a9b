"""The machine's performance counters (machine/counters.py) against independent figures: the machine's own
instruction counter (a native hook on every instruction), the kernel's own accounting of context switches, the
#PF the machine delivered, and kernel code reading them through the ports.

Live runs compare two readings taken in one trip to the CPU thread (one instant), over whatever the kernel did
in between; nothing depends on how much it did.
"""

from __future__ import annotations

import time

import pytest

from capstone import CS_ARCH_X86, CS_MODE_64, Cs
from capstone import x86_const as CX
from unicorn import UC_HOOK_CODE
from unicorn import x86_const as UX

from kgtp_sim.machine import KernelImage, Machine, MachineError
from kgtp_sim.machine.counters import (
    PORT_PERF_HI,
    PORT_PERF_LO,
    PORT_PERF_SELECT,
    CounterError,
    EventAttr,
    HwEvent,
    PerfType,
    Source,
    SwEvent,
)
from kgtp_sim.machine.dwarf import KernelDwarf

from ..conftest import VMLINUX
from ..programs import compile_program

IMAGE = KernelImage.load(VMLINUX)
INSTRUCTIONS = EventAttr(PerfType.HARDWARE, HwEvent.INSTRUCTIONS)
BRANCHES = EventAttr(PerfType.HARDWARE, HwEvent.BRANCH_INSTRUCTIONS)
CYCLES = EventAttr(PerfType.HARDWARE, HwEvent.CPU_CYCLES)
SOFTWARE = {name: EventAttr(PerfType.SOFTWARE, config) for name, config in (
    ("cpu-clock", SwEvent.CPU_CLOCK), ("task-clock", SwEvent.TASK_CLOCK), ("page-faults", SwEvent.PAGE_FAULTS),
    ("context-switches", SwEvent.CONTEXT_SWITCHES), ("cpu-migrations", SwEvent.CPU_MIGRATIONS),
    ("minor-faults", SwEvent.PAGE_FAULTS_MIN), ("major-faults", SwEvent.PAGE_FAULTS_MAJ))}
FAULTS = (0, 6, 14)  #: #DE, #UD, #PF: the faulting instruction runs again after the handler


def _open(machine: Machine, cpu: int, attr: EventAttr):
    return machine.run_on_cpu(lambda uc: machine.counters.open(cpu, attr, enabled=True))


def _wait(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_kernel_call_is_counted_exactly():
    """kgtp_bench_loop(N): 9 instructions a call plus 6, 3 branches a call (call, ret, jne) plus the jle and the
    final ret, as the machine's own counter and the code say."""
    machine = Machine(IMAGE)
    instructions, branches = _open(machine, 0, INSTRUCTIONS), _open(machine, 0, BRANCHES)
    machine.set_counting(True)
    for n in (1, 10, 1000):
        before = machine.instructions(), instructions.read().value, branches.read().value
        machine.call("kgtp_bench_loop", n)
        machine_count = machine.instructions() - before[0]
        assert instructions.read().value - before[1] == machine_count == 9 * n + 6
        assert branches.read().value - before[2] == 3 * n + 2


def test_nothing_is_counted_and_nothing_hooked_until_a_counter_is_enabled():
    machine = Machine(IMAGE)
    counter = machine.run_on_cpu(lambda uc: machine.counters.open(0, INSTRUCTIONS))
    machine.call("kgtp_bench_loop", 100)
    assert counter.read().value == 0 and machine.counters.source(0, Source.INSTRUCTIONS_KERNEL) == 0
    machine.run_on_cpu(lambda uc: counter.enable())
    machine.call("kgtp_bench_loop", 100)
    assert counter.read().value == 906
    machine.run_on_cpu(lambda uc: counter.disable())
    machine.call("kgtp_bench_loop", 100)
    assert counter.read().value == 906
    assert machine.counters.source(0, Source.INSTRUCTIONS_KERNEL) == 2 * 906  # the machine counts while open
    machine.run_on_cpu(lambda uc: machine.counters.close(counter))
    assert machine.cpu.observer is None  # the CPU reports nothing any more, the hooks are gone
    machine.call("kgtp_bench_loop", 100)
    assert machine.counters.source(0, Source.INSTRUCTIONS_KERNEL) == 2 * 906


def test_events_the_machine_does_not_count_are_refused_as_perf_refuses_them():
    machine = Machine(IMAGE, cpus=2)
    for attr in (EventAttr(PerfType.HARDWARE, HwEvent.CACHE_MISSES), EventAttr(PerfType.HW_CACHE, 0),
                 EventAttr(PerfType.SOFTWARE, SwEvent.ALIGNMENT_FAULTS), EventAttr(PerfType.RAW, 0xC0)):
        with pytest.raises(CounterError) as refused:
            machine.counters.open(0, attr)
        assert refused.value.errno == 2  # ENOENT, as perf_event_open
    with pytest.raises(CounterError):
        machine.counters.open(2, INSTRUCTIONS)
    assert machine.cpu.observer is None


@pytest.mark.parametrize("cpus", [1, 2])
def test_the_running_kernel_counted_per_cpu_agrees_with_the_machine_and_the_kernel(cpus):
    """Over a window of the running kernel: the counters' instructions on every CPU add up to the machine's own
    count minus the faulting instructions (which its hook counts at each attempt, and which retire once); context
    switches add up to the kernel's nr_context_switches, page faults to the #PF the machine delivered."""
    machine = Machine(IMAGE, cpus=cpus)
    dwarf = KernelDwarf(VMLINUX)
    try:
        switches_at, switches_type = dwarf.global_variable("nr_context_switches")
    finally:
        dwarf.close()
    counters = {(cpu, name): _open(machine, cpu, attr) for cpu in range(cpus)
                for name, attr in (("instructions", INSTRUCTIONS), ("branches", BRANCHES), ("cycles", CYCLES),
                                   *SOFTWARE.items())}
    machine.set_counting(True)
    machine.start()
    try:
        def snapshot(uc) -> dict:
            values = {key: counter.read().value for key, counter in counters.items()}
            values["machine"] = machine.instructions()
            values["faults"] = sum(machine.cpu.delivered[v] for v in FAULTS)
            values["pf"] = machine.cpu.delivered[14]
            values["kernel switches"] = int.from_bytes(uc.mem_read(switches_at, switches_type.size), "little")
            return values

        first = machine.run_on_cpu(snapshot)
        _wait(lambda: machine.run_on_cpu(snapshot)["pf"] >= first["pf"] + 6 * cpus, "page faults on every CPU")
        last = machine.run_on_cpu(snapshot)
    finally:
        machine.shutdown()
    delta = {key: last[key] - first[key] for key in first}

    def total(name: str) -> int:
        return sum(delta[(cpu, name)] for cpu in range(cpus))

    assert delta["faults"] > 0
    assert total("instructions") == delta["machine"] - delta["faults"]
    assert total("context-switches") == delta["kernel switches"] > 0
    assert total("page-faults") == total("minor-faults") == delta["pf"]
    assert total("major-faults") == 0  # every fault is resolved from memory
    assert total("cpu-migrations") == 0  # every task of this kernel is bound to its CPU
    for cpu in range(cpus):
        assert delta[(cpu, "instructions")] > delta[(cpu, "branches")] > 0
        assert delta[(cpu, "cycles")] > 0 and delta[(cpu, "task-clock")] > 0
        assert delta[(cpu, "cpu-clock")] >= delta[(cpu, "task-clock")]  # the CPU idles in hlt meanwhile


def test_kernel_code_reads_its_cpus_counts_through_the_ports():
    """Code of the kernel's (ring 0, here in module space, which is never counted itself) selects an event on
    port 0xea and reads its CPU's count on 0xeb/0xec: what the machine counted, to the instruction."""
    machine = Machine(IMAGE, cpus=2)
    counter = _open(machine, 1, INSTRUCTIONS)
    select = PerfType.HARDWARE << 8 | HwEvent.INSTRUCTIONS
    # mov $select, %eax; out %eax, $0xea; in $0xeb, %eax; mov %eax, %ecx; in $0xec, %eax; shl $32, %rax;
    # or %rcx, %rax; ret
    code = (b"\xb8" + select.to_bytes(4, "little") + bytes((0xE7, PORT_PERF_SELECT, 0xE5, PORT_PERF_LO))
            + b"\x89\xc1" + bytes((0xE5, PORT_PERF_HI)) + b"\x48\xc1\xe0\x20" + b"\x48\x09\xc8" + b"\xc3")
    reader = machine.alloc_code(len(code))
    machine.write_memory(reader, code)

    def on_cpu1(uc):
        machine.call("kgtp_bench_loop", 50)
        return machine.call(reader), counter.read().value

    read, counted = machine.on_cpu(1, on_cpu1, stay=False)
    assert read == counted == 9 * 50 + 6
    assert machine.on_cpu(0, lambda uc: machine.call(reader), stay=False) == 0  # CPU 0 counted nothing


def test_a_counter_opened_on_a_machine_without_native_hooks_says_why():
    machine = Machine(IMAGE)
    machine.counters.available = False
    with pytest.raises(MachineError, match="native hooks"):
        machine.counters.open(0, INSTRUCTIONS)
    machine.counters.open(0, SOFTWARE["page-faults"])  # counted in Python: still there


def _mode(attr: EventAttr, user: bool) -> EventAttr:
    """attr counting one mode: user (exclude_kernel) or kernel (exclude_user)."""
    return EventAttr(attr.type, attr.config, exclude_user=not user, exclude_kernel=user)


@pytest.mark.parametrize("cpus", [1, 2])
def test_a_program_is_counted_by_mode_against_an_instruction_by_instruction_decoder(tmp_path, cpus):
    """A process making system calls without end (tests/programs/counted.c): over a window with no fault in user
    code, its instructions (`:u`) and branches (`:u`) are what an independent hook on each of its instructions,
    decoding it, counts; the kernel's (`:k`) with them add up to the counters of both modes and to the machine's
    own count less the faulting instructions; cycles split into a user and a kernel part that both grew."""
    from kgtp_sim.machine.initramfs import Archive

    program = compile_program("counted", "musl-static", tmp_path)
    archive = Archive()
    inside = archive.add_program(program)
    machine = Machine(IMAGE, cpus=cpus)
    machine.processes.load_archive(archive.pack())
    machine.processes.sink = lambda fd, data: None
    decoder = Cs(CS_ARCH_X86, CS_MODE_64)
    decoder.detail = True
    branch_groups = (CX.X86_GRP_JUMP, CX.X86_GRP_CALL, CX.X86_GRP_RET, CX.X86_GRP_IRET, CX.X86_GRP_INT)
    decoded: dict[tuple[int, int], bool] = {}
    oracle = {"instructions": 0, "branches": 0}

    def each_user_instruction(uc, address, size, _data):
        key = (uc.reg_read(UX.UC_X86_REG_CR3), address)
        if key not in decoded:
            insn = next(decoder.disasm(bytes(uc.mem_read(address, size)), address))
            decoded[key] = insn.id != CX.X86_INS_INT3 and (
                insn.id in (CX.X86_INS_SYSCALL, CX.X86_INS_SYSRET) or any(insn.group(g) for g in branch_groups))
        oracle["instructions"] += 1
        oracle["branches"] += decoded[key]

    machine.uc.hook_add(UC_HOOK_CODE, each_user_instruction, None, 0, (1 << 47) - 1)
    names = {"instructions": INSTRUCTIONS, "branches": BRANCHES, "cycles": CYCLES}
    counters = {(cpu, name + suffix): _open(machine, cpu, _mode(attr, suffix == ":u") if suffix else attr)
                for cpu in range(cpus) for name, attr in names.items() for suffix in ("", ":u", ":k")}
    faults = {cpu: _open(machine, cpu, _mode(SOFTWARE["page-faults"], True)) for cpu in range(cpus)}
    machine.set_counting(True)
    machine.start()
    try:
        machine.processes.spawn(inside, [str(program)])

        def snapshot(uc) -> dict:
            values = {key: counter.read().value for key, counter in counters.items()}
            values.update(oracle)
            values["machine"] = machine.instructions()
            values["faults"] = sum(machine.cpu.delivered[v] for v in FAULTS)
            values["user faults"] = sum(counter.read().value for counter in faults.values())
            return values

        _wait(lambda: machine.run_on_cpu(snapshot)["instructions"] > 20_000, "the program running")
        while True:  # a window without a fault in user code (its pages are in after the first rounds)
            first = machine.run_on_cpu(snapshot)
            _wait(lambda: machine.run_on_cpu(snapshot)["instructions"] >= first["instructions"] + 20_000,
                  "the program's next rounds")
            last = machine.run_on_cpu(snapshot)
            if last["user faults"] == first["user faults"]:
                break
    finally:
        machine.shutdown()
    delta = {key: last[key] - first[key] for key in first}

    def total(name: str) -> int:
        return sum(delta[(cpu, name)] for cpu in range(cpus))

    assert total("instructions:u") == delta["instructions"] > 0
    assert total("branches:u") == delta["branches"] > 0
    assert total("instructions:u") > total("branches:u")
    assert total("instructions:u") + total("instructions:k") == total("instructions") == \
        delta["machine"] - delta["faults"]
    assert total("branches:u") + total("branches:k") == total("branches")
    assert total("cycles:u") > 0 and total("cycles:k") > 0
    # the three cycle counters are read one after the other: each split is the whole to within those reads
    assert abs(total("cycles:u") + total("cycles:k") - total("cycles")) < total("cycles") // 10


def test_a_kernel_without_processes_counts_nothing_in_user_mode():
    machine = Machine(IMAGE)
    counters = [_open(machine, 0, _mode(attr, True)) for attr in (INSTRUCTIONS, BRANCHES, CYCLES)]
    whole = _open(machine, 0, CYCLES)
    machine.call("kgtp_bench_loop", 1000)
    assert [counter.read().value for counter in counters] == [0, 0, 0]
    assert whole.read().value > 0


def test_the_kernel_takes_page_faults_after_the_counting_hooks_go(tmp_path):
    """Hooks over user code removed after a program ran (the counters' and the machine's instruction counter):
    unicorn drops their code by an instruction fetch through the loaded CPU's tables, which faults and left a #PF in
    flight; the kernel's next page faults were swallowed and its demand-paging thread spun for ever."""
    from kgtp_sim.machine.initramfs import Archive

    program = compile_program("hello", "musl-static", tmp_path)
    archive = Archive()
    inside = archive.add_program(program)
    machine = Machine(IMAGE, cpus=1)
    machine.processes.load_archive(archive.pack())
    machine.processes.sink = lambda fd, data: None
    counter = _open(machine, 0, _mode(BRANCHES, True))
    machine.set_counting(True)
    machine.start()
    try:
        assert machine.processes.wait(machine.processes.spawn(inside, ["hello"]), 60) is not None
        machine.run_on_cpu(lambda uc: machine.counters.close(counter))
        machine.set_counting(False)
        faults = machine.run_on_cpu(lambda uc: machine.cpu.delivered[14])
        _wait(lambda: machine.run_on_cpu(lambda uc: machine.cpu.delivered[14]) > faults + 3,
              "page faults delivered after the hooks went")
    finally:
        machine.shutdown()
