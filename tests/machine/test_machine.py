"""The machine running the bundled kernel: boot, timer, scheduling, system calls, faults and traps through the
IDT, coherent access from other threads, the tracer's tables, deterministic calls, and an idle host CPU."""

from __future__ import annotations

import struct
import threading
import time

import pytest
from keystone import KS_ARCH_X86, KS_MODE_64, Ks

from kgtp_sim.machine import (
    DEMAND_BASE,
    MODULE_BASE,
    KernelImage,
    Machine,
    MachineError,
    MemoryFault,
)

from ..conftest import VMLINUX

REGISTER_NAMES = (
    "rax rbx rcx rdx rsi rdi rbp rsp r8 r9 r10 r11 r12 r13 r14 r15 rip eflags cs ss ds es fs gs".split()
)


@pytest.fixture(scope="module")
def image() -> KernelImage:
    return KernelImage.load(VMLINUX)


@pytest.fixture(scope="module")
def running(image):
    """One booted machine for the whole module, after 1.2 s of its own uptime (every thread has done its rounds).

    Kernel time, not host time: on a loaded host the kernel just takes longer to get there."""
    machine = Machine(image, hz=200)
    machine.start()
    eventually(lambda: machine.stats().jiffies >= 240, "the kernel never reached 240 jiffies")
    yield machine
    machine.shutdown()


def eventually(condition, message: str, timeout: float = 30) -> None:
    """Poll `condition` until it holds; fail with `message` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.01)


def assemble(source: str, address: int) -> bytes:
    """Intel syntax on purpose: keystone's AT&T mode read `$11` as 0x11 here. Immediates are written in hex:
    once any AT&T source was assembled in the process, Intel mode reads a bare `50` as 0x50."""
    encoding, _ = Ks(KS_ARCH_X86, KS_MODE_64).asm(source, address)
    return bytes(encoding)


def comm(machine: Machine, image: KernelImage, index: int) -> str:
    tasks = image.symbols["tasks"]
    size = tasks.size // 65  # NR_TASKS: 41 kernel threads, 24 process slots (include/kernel.h)
    raw = machine.read_memory(tasks.address + index * size + 4, 16)
    return raw.split(b"\0")[0].decode()


# ---- the kernel runs -----------------------------------------------------------------------------------------


def test_kernel_boots_ticks_and_switches(running, image):
    stats = running.stats()
    assert stats.state in ("running", "idle"), stats.state
    assert stats.jiffies >= 100 and stats.ticks >= stats.jiffies
    assert stats.context_switches > stats.jiffies  # every thread sleeps and wakes each round
    assert "kgtp-sim kernel: 10 static tracepoints" in running.console_text()
    assert [comm(running, image, i) for i in range(5)] == [
        "swapper/0", "kgtp_bench", "kmodload", "syscall_test", "pagefault_test"]
    current = running.current_task()
    tasks = image.symbols["tasks"]
    assert tasks.address <= current < tasks.address + tasks.size
    eventually(lambda: running.stats().jiffies > stats.jiffies, "jiffies stopped")


def test_workload_threads_do_their_work(running):
    stats = running.stats()
    assert running.read_symbol("kgtp_counter", signed=True) > 100 * 100  # pace 100 per tick
    assert running.read_symbol("nr_modules_loaded") >= 2
    assert stats.syscalls > 50 and running.read_symbol("nr_syscalls") > 50
    assert running.read_symbol("syscall_counter") > 10
    assert "syscall_test: hello from int $0x80" in running.console_text()


def test_page_faults_and_traps_go_through_the_idt(running):
    def snapshot(uc):  # both sides read at the same instruction boundary
        cpu = running.cpu
        return dict(cpu.delivered), running.read_symbol("nr_page_faults"), running.read_symbol("nr_traps")

    delivered, kernel_faults, kernel_traps = running.run_on_cpu(snapshot)
    assert delivered[14] >= 10 and kernel_faults == delivered[14]
    assert all(delivered[v] >= 3 for v in (0, 3, 6))  # #DE, #BP, #UD, each fixed up by do_trap
    assert kernel_traps == delivered[0] + delivered[3] + delivered[6]
    # the faulting thread keeps going: more faults and traps later
    eventually(lambda: running.stats().page_faults > delivered[14] and running.stats().traps > kernel_traps,
               "the faulting thread stopped faulting")
    assert "crashed" not in running.stats().state


def test_demand_paging_maps_pages_on_first_touch(running):
    pages = sorted(running.cpu.memory.demand_pages)
    assert 1 <= len(pages) <= 256 and len(pages) <= running.stats().page_faults
    time_stamp, index = struct.unpack("<QQ", running.read_memory(pages[1], 16))  # page[0] = jiffies on a write
    assert time_stamp > 0 and index == 1
    untouched = DEMAND_BASE + 0xFF000
    assert untouched not in pages
    with pytest.raises(MemoryFault):  # absent for the debugger too, though unicorn has it mapped
        running.read_memory(untouched, 8)


def test_registers_are_the_amd64_set(running, image):
    regs = running.registers()
    assert tuple(regs) == tuple(REGISTER_NAMES)
    assert regs["cs"] == 0x08 and regs["ss"] == 0x10
    lo, hi = image.text_range
    assert lo <= regs["rip"] < hi


def test_run_on_cpu_runs_on_the_cpu_thread_between_instructions(running):
    seen = running.run_on_cpu(lambda uc: threading.current_thread().name)
    assert seen == "kgtp-cpu"
    with pytest.raises(ZeroDivisionError):
        running.run_on_cpu(lambda uc: 1 // 0)


def test_an_access_runs_on_the_callers_thread_while_the_cpu_thread_waits_and_holds_it_there(running):
    """Machine.access: the machine stopped, the CPU thread waits for work, and a read runs on the caller's thread
    (no hand-off); the CPU thread runs nothing meanwhile; an error is the caller's; resumed, the kernel goes on."""
    jiffies = running.image.address_of("jiffies")
    running.control.stop()
    try:
        def read(uc):
            before = running.stats(count=False).context_switches
            value = bytes(uc.mem_read(jiffies, 8))
            return threading.current_thread().name, value, before == running.stats(count=False).context_switches

        name, value, quiet = running.access(read)
        assert name == threading.current_thread().name != "kgtp-cpu" and quiet
        assert running.read_memory(jiffies, 8) == value  # stopped: nothing changed it since
        with pytest.raises(ZeroDivisionError):
            running.access(lambda uc: 1 // 0)
        # what only the CPU thread may do still goes to it
        assert running.run_on_cpu(lambda uc: threading.current_thread().name) == "kgtp-cpu"
    finally:
        running.control.resume()
    start = int.from_bytes(value, "little")
    eventually(lambda: int.from_bytes(running.read_memory(jiffies, 8), "little") > start, "jiffies stopped")


def test_reads_while_running_are_coherent(running):
    """jiffies only grows, and the kernel keeps running while another thread hammers it with reads."""
    address = running.image.address_of("jiffies")
    values = [int.from_bytes(running.read_memory(address, 8), "little") for _ in range(300)]
    assert values == sorted(values)
    eventually(lambda: int.from_bytes(running.read_memory(address, 8), "little") > values[0], "jiffies stopped")


def test_settings(running):
    running.set_pace(7)
    assert running.read_symbol("kgtp_test_pace") == 7 and running.stats().pace == 7
    running.set_pace(100)
    with pytest.raises(ValueError):
        running.set_hz(0)
    running.set_hz(250)
    assert running.hz == 250
    running.set_hz(200)


def test_memory_fault_for_unmapped_reads(running):
    with pytest.raises(MemoryFault, match="not mapped"):
        running.read_memory(0x1000, 8)


# ---- deterministic calls (the benchmark) ---------------------------------------------------------------------


def test_call_bench_loop_is_exact_and_repeatable(image):
    machine = Machine(image)
    assert machine.set_counting(True)
    before = machine.read_symbol("kgtp_counter", signed=True)
    counts = []
    for _ in range(2):
        start = machine.instructions()
        assert machine.call("kgtp_bench_loop", 10000) == 10000
        counts.append(machine.instructions() - start)
    assert machine.read_symbol("kgtp_counter", signed=True) == before + 20000
    assert counts[0] == counts[1]
    assert 8 * 10000 <= counts[0] <= 12 * 10000  # ~9 instructions per kgtp_test_function call


def test_call_on_a_running_machine_pauses_it(running):
    before = running.read_symbol("kgtp_counter", signed=True)
    assert running.call("kgtp_bench_loop", 1000) == 1000
    assert running.read_symbol("kgtp_counter", signed=True) >= before + 1000


def test_call_instruction_budget(image):
    machine = Machine(image)
    with pytest.raises(MachineError, match="did not return within"):
        machine.call("kgtp_bench_loop", 10**9, max_instructions=5000)


# ---- tables for the tracer -----------------------------------------------------------------------------------


def test_breakpoint_table_sees_int3_before_the_idt(image):
    machine = Machine(image)  # not booted: an int3 reaching the IDT would fail
    code = machine.alloc_code(64)
    assert MODULE_BASE <= code
    snippet = assemble("mov eax, 0x7; int3; add eax, 0x1; ret", code)
    machine.write_memory(code, snippet)
    int3_at = code + snippet.index(b"\xcc")
    hits = []

    def on_int3(uc):
        from unicorn.x86_const import UC_X86_REG_RAX, UC_X86_REG_RIP

        hits.append(uc.reg_read(UC_X86_REG_RIP))
        uc.reg_write(UC_X86_REG_RAX, uc.reg_read(UC_X86_REG_RAX) + 0x10)
        uc.reg_write(UC_X86_REG_RIP, int3_at + 1)

    machine.breakpoints[int3_at] = on_int3
    assert machine.call(code) == 0x18
    assert hits == [int3_at] and machine.stats().breakpoint_hits == 1
    del machine.breakpoints[int3_at]
    with pytest.raises(MachineError, match="vector 3"):
        machine.call(code)


def test_fault_fixups_resolve_faults_in_stub_code(image):
    machine = Machine(image)
    code = machine.alloc_code(64)
    snippet = assemble("mov rax, qword ptr [rdi]; ret; mov rax, -0xe; ret", code)
    machine.write_memory(code, snippet)
    fault_exit = code + 4  # after `mov rax, [rdi]` (3 bytes) and `ret`
    faults = []

    def fixup(uc, address):
        from unicorn.x86_const import UC_X86_REG_RIP

        faults.append(address)
        uc.reg_write(UC_X86_REG_RIP, fault_exit)

    machine.fault_fixups.add(code, code + len(snippet), fixup)
    assert machine.call(code, DEMAND_BASE + 0x123) == (-14) & (2**64 - 1)
    assert faults == [DEMAND_BASE + 0x123]
    data = machine.alloc_data(8)
    machine.write_memory(data, struct.pack("<Q", 42))
    assert machine.call(code, data) == 42
    machine.fault_fixups.remove(code)
    with pytest.raises(MachineError, match="vector 14"):  # now a real #PF, and nothing booted to take it
        machine.call(code, DEMAND_BASE)


def test_absent_demand_pages_fault_again_after_the_kernel_drops_them(image):
    """Present pages need nothing from the machine; absent ones fault with the exact address, also after the
    kernel's reclaim (entry cleared, invlpg) dropped a page whose TLB entry was in use."""
    machine = Machine(image)
    code = machine.alloc_code(32)
    snippet = assemble("mov rax, qword ptr [rdi + 0x8]; ret; mov rax, -0xe; ret", code)
    machine.write_memory(code, snippet)
    faults = []

    def fixup(uc, address):
        from unicorn.x86_const import UC_X86_REG_RIP

        faults.append(address)
        uc.reg_write(UC_X86_REG_RIP, code + 5)

    machine.fault_fixups.add(code, code + len(snippet), fixup)
    page = DEMAND_BASE + 0x3000
    assert machine.call(code, page + 0x10) == 2**64 - 14
    assert faults == [page + 0x18]
    assert machine.call("do_anonymous_page", page) == 0  # the kernel's minor fault: a frame, then its entry
    machine.write_memory(page + 0x18, struct.pack("<Q", 1234))
    assert machine.call(code, page + 0x10) == 1234
    machine.call("drop_demand_pages")  # every page: entry cleared, TLB entry dropped, frame given back
    assert machine.call(code, page + 0x10) == 2**64 - 14 and len(faults) == 2
    machine.call("do_anonymous_page", page)
    assert machine.call(code, page + 0x10) == 0  # a fresh, zeroed frame


def test_write_memory_invalidates_translated_code(image):
    machine = Machine(image)
    code = machine.alloc_code(16)
    machine.write_memory(code, assemble("mov eax, 0x1; ret", code))
    assert machine.call(code) == 1
    machine.write_memory(code, assemble("mov eax, 0x2; ret", code))
    assert machine.call(code) == 2


def test_allocators_reuse_freed_blocks(image):
    machine = Machine(image)
    a = machine.alloc_data(100)
    b = machine.alloc_data(100)
    assert b >= a + 100
    machine.free_data(a)
    assert machine.alloc_data(50) == a
    with pytest.raises(ValueError):
        machine.free_code(a)


def test_data_blocks_start_zeroed_when_reused(image):
    machine = Machine(image)
    size = 3 * 4096 + 100  # across pages: zeroed through the frames behind vmalloc space (memory.zero_stub_data)
    a = machine.alloc_data(size)
    machine.write_memory(a, b"\xaa" * size)
    machine.free_data(a)
    assert machine.alloc_data(size) == a
    assert machine.read_memory(a, size) == bytes(size)


def test_stops_asked_by_other_threads_never_replay_instructions():
    """Other threads' stops (the server's requests, timer ticks) end emulation at a block boundary, exactly.

    A block with two counters bumped in it is run while another thread asks for stops as fast as it can; after
    thousands of stops and restarts from RIP the two counters agree. (`uc.emu_stop()` from another thread ends
    a block in the middle and QEMU resumes from the block's start, so the first counter ran ahead.)
    """
    from unicorn import UC_ARCH_X86, UC_MODE_64, Uc
    from unicorn.x86_const import UC_X86_REG_RIP

    from kgtp_sim.machine.cpu import BlockStopper

    code, data = 0x1000, 0x2000
    body = "; ".join(["loop: inc qword ptr [0x2000]"] + ["nop"] * 20 + ["inc qword ptr [0x2008]"] + ["nop"] * 20)
    uc = Uc(UC_ARCH_X86, UC_MODE_64)
    uc.mem_map(code, 0x1000)
    uc.mem_map(data, 0x1000)
    uc.mem_write(code, bytes(Ks(KS_ARCH_X86, KS_MODE_64).asm(body + "; jmp loop", code)[0]))
    stopper = BlockStopper(uc)
    asking = threading.Event()
    asking.set()

    def ask_for_stops() -> None:
        while asking.is_set():
            stopper.request()
            time.sleep(0.0001)

    thread = threading.Thread(target=ask_for_stops)
    thread.start()
    rip = code
    try:
        for _ in range(2000):
            stopper.clear()
            uc.emu_start(rip, 0)
            rip = uc.reg_read(UC_X86_REG_RIP)
    finally:
        asking.clear()
        thread.join()
    first, second = struct.unpack("<QQ", uc.mem_read(data, 16))
    assert first > 1000
    assert first - second in (0, 1)  # 1: stopped between the two


def _stopper_cpu(monkeypatch, native: bool, *pages: int):
    """A scratch CPU with `pages` mapped and the stopper module (its native hook refused unless `native`)."""
    from unicorn import UC_ARCH_X86, UC_MODE_64, Uc

    from kgtp_sim.machine import stopper as stopper_module

    if not native:
        monkeypatch.setattr(stopper_module, "add_native_hook", lambda *args: None)
    uc = Uc(UC_ARCH_X86, UC_MODE_64)
    for base in pages:
        uc.mem_map(base, 0x1000)
    return uc, stopper_module


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_stop_outside_a_range_ends_at_the_first_block_leaving_it(monkeypatch, native):
    """The CPU thread arms it when a timer tick waits on a detour: emulation runs on through every block of
    the stub's code and ends where the kernel's code resumes, before any of its instructions ran."""
    from unicorn.x86_const import UC_X86_REG_RCX, UC_X86_REG_RIP

    detour, kernel, data = 0x10000, 0x20000, 0x30000
    ks = Ks(KS_ARCH_X86, KS_MODE_64)
    # the "detour": 50 passes through a loop of several blocks, then a jump back into the "kernel"
    uc, stopper_module = _stopper_cpu(monkeypatch, native, detour, kernel, data)
    # immediates in hex: once any AT&T source was assembled in the process, keystone's Intel mode reads `50` as 0x50
    uc.mem_write(detour, bytes(ks.asm(
        "mov ecx, 0x32; again: inc qword ptr [0x30000]; test ecx, 1; jz even; nop; even: dec ecx; jnz again;"
        f" mov rax, {kernel:#x}; jmp rax", detour)[0]))
    uc.mem_write(kernel, bytes(ks.asm("inc qword ptr [0x30008]; jmp 0x20000", kernel)[0]))
    stopper = stopper_module.BlockStopper(uc)

    stopper.stop_outside(detour, detour + 0x1000)
    uc.emu_start(detour, 0, 0, 100_000)
    assert uc.reg_read(UC_X86_REG_RIP) == kernel
    assert struct.unpack("<QQ", uc.mem_read(data, 16)) == (50, 0)
    assert uc.reg_read(UC_X86_REG_RCX) == 0

    stopper.clear()  # nothing asked: runs on to the instruction bound
    uc.emu_start(kernel, 0, 0, 20)
    assert struct.unpack("<QQ", uc.mem_read(data, 16)) == (50, 10)

    stopper.stop_outside(detour, detour + 0x1000)
    stopper.request()  # another thread's stop widens it: the very next block
    uc.emu_start(detour, 0, 0, 100_000)
    assert uc.reg_read(UC_X86_REG_RIP) == detour
    assert struct.unpack("<QQ", uc.mem_read(data, 16)) == (50, 10)


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_stop_when_interruptible_ends_at_the_first_block_with_interrupts_on(monkeypatch, native):
    """The CPU thread arms it when an interrupt waits for a CPU running with IF clear: emulation runs on through
    the code with interrupts off (however long it takes) and ends at the first block after they are on again,
    before any of its instructions ran, as a CPU takes a waiting interrupt after `sti` or `popf`."""
    from unicorn.x86_const import UC_X86_REG_EFLAGS, UC_X86_REG_RIP, UC_X86_REG_RSP

    code, data, stack = 0x10000, 0x30000, 0x40000
    ks = Ks(KS_ARCH_X86, KS_MODE_64)
    uc, stopper_module = _stopper_cpu(monkeypatch, native, code, data, stack)
    # interrupts off: 30 passes through a loop of several blocks; on again by popf (the flags cli found), then by
    # sti after a second stretch with them off
    source = ("cli; mov ecx, 0x1e; again: inc qword ptr [0x30000]; test ecx, 1; jz even; nop; even: dec ecx;"
              " jnz again; push 0x202; popfq; on: inc qword ptr [0x30008]; cli; mov ecx, 0x5; off: inc qword ptr"
              " [0x30010]; dec ecx; jnz off; sti; after: inc qword ptr [0x30018]; jmp after")
    assembled = bytes(ks.asm(source, code)[0])
    uc.mem_write(code, assembled)
    on = code + len(bytes(ks.asm(source.split(" on:")[0], code)[0]))
    after = code + len(bytes(ks.asm(source.split(" after:")[0], code)[0]))
    uc.reg_write(UC_X86_REG_RSP, stack + 0x800)
    uc.reg_write(UC_X86_REG_EFLAGS, 0x2)  # interrupts off from the start (the stop would be at once otherwise)
    stopper = stopper_module.BlockStopper(uc)

    stopper.stop_when_interruptible()
    uc.emu_start(code, 0, 0, 100_000)
    assert uc.reg_read(UC_X86_REG_RIP) == on
    assert struct.unpack("<QQQQ", uc.mem_read(data, 32)) == (30, 0, 0, 0)

    stopper.clear()  # nothing asked: runs on to `cli` and past it, to the instruction bound
    uc.emu_start(on, 0, 0, 3)
    assert uc.reg_read(UC_X86_REG_EFLAGS) & 0x200 == 0
    stopper.stop_when_interruptible()
    uc.emu_start(uc.reg_read(UC_X86_REG_RIP), 0, 0, 100_000)
    assert uc.reg_read(UC_X86_REG_RIP) == after
    assert struct.unpack("<QQQQ", uc.mem_read(data, 32)) == (30, 1, 5, 0)

    stopper.stop_when_interruptible()  # interrupts are on: the very next block
    uc.emu_start(after, 0, 0, 100_000)
    assert uc.reg_read(UC_X86_REG_RIP) == after
    assert struct.unpack("<QQQQ", uc.mem_read(data, 32)) == (30, 1, 5, 0)
