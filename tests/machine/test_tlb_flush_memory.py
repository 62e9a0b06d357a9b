"""The machine's memory must not depend on how often the kernel drops its demand pages.

The kernel drops a page the way Linux does: it clears the page's entry and runs `invlpg` on it. A full TLB flush
instead would let unicorn 2.1.4 resize its TLB tables upwards at every flush of a busy CPU: an earlier design,
where the machine dropped pages itself with full flushes, saw the stub climb from 53 MiB to 230 MiB in steps at
each drop, then stay there. These tests fail if dropping pages goes back to anything of the kind, or if a
dropped page stays reachable without a fresh #PF through the kernel's handler.

Memory is measured in a child process, so the test suite's own memory stays out of it. The child also counts
the resident pages of unicorn's translated-code buffer (transparent huge pages off, so they are counted 4 KiB
at a time): the drops must not make it translate the same code again and again.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.cpu import Stop
from kgtp_sim.machine.layout import DEMAND_BASE

from ..conftest import ROOT, VMLINUX
from .test_machine import assemble

CHILD = r"""
import ctypes, faulthandler, re, sys, time
faulthandler.dump_traceback_later(170, exit=True)  # a hang shows every thread's stack in the test's failure
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE, before unicorn maps its code buffer
from keystone import KS_ARCH_X86, KS_MODE_64, Ks
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.layout import DEMAND_BASE, DEMAND_SIZE

def rss_mib():
    return next(int(l.split()[1]) // 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))

def code_buffer_kib():
    # the translated-code buffer: the one writable and executable mapping of 16 MiB or more (cpu.TRANSLATION_CACHE)
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", open("/proc/self/smaps").read()):
        start, end = (int(x, 16) for x in block.split()[0].split("-"))
        if " rwxp " in block.split("\n", 1)[0] and end - start >= 16 << 20:
            return int(re.search(r"^Rss:\s+(\d+)", block, re.M).group(1))
    raise SystemExit("no code buffer mapping found")

machine = Machine(KernelImage.load("fixtures/vmlinux"), hz=100, pace=1000000)
# touch the top 128 pages of the demand region (each a #PF the kernel resolves), then reclaim every page
code = machine.alloc_code(64)
first = DEMAND_BASE + DEMAND_SIZE - 128 * 4096
source = (f"mov rcx, 0x80; mov rax, {first:#x}; again: mov qword ptr [rax], rcx; add rax, 0x1000; dec rcx;"
          f" jnz again; mov rax, {machine.image.address_of('drop_demand_pages'):#x}; call rax; ret")
machine.write_memory(code, bytes(Ks(KS_ARCH_X86, KS_MODE_64).asm(source, code)[0]))
machine.start()
time.sleep(0.5)
before, code_before = rss_mib(), code_buffer_kib()
faults = machine.stats().page_faults
# The call runs where the kernel paused, as the task it paused: if that task holds a lock the call's code takes
# (demand_lock: the kernel's own fault thread drops its window now and then), the call would spin on it forever
# (and schedule other tasks). So it is made only while the CPU thread sees both locks free.
locks = [machine.image.address_of(name) for name in ("demand_lock", "frame_lock")]

def call_unless_locked(uc):
    if any(bytes(uc.mem_read(lock, 4)) != bytes(uc.mem_read(lock + 4, 4)) for lock in locks):  # ticket taken
        return False
    machine.call(code)
    return True

for drops in range(40):
    while not machine.run_on_cpu(call_unless_locked):
        time.sleep(0.001)
    time.sleep(0.05)
print(drops + 1, machine.stats().page_faults - faults, rss_mib() - before, code_buffer_kib() - code_before)
machine.shutdown()
"""


def test_forty_page_drops_of_a_busy_kernel_leave_memory_flat():
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    drops, faults, growth_mib, code_growth_kib = (int(v) for v in result.stdout.split())
    assert drops == 40 and faults >= 40 * 128  # every touch after a drop was a #PF the kernel resolved
    assert growth_mib < 16  # full flushes: 40 to 80 MiB here
    assert code_growth_kib < 1024


def test_a_dropped_page_faults_again_at_the_next_access_through_the_kernel():
    """A page is touched (its TLB entry in use), then the kernel reclaims it: the very next access is a #PF
    delivered to the kernel, whose handler maps a fresh zeroed frame."""
    machine = Machine(KernelImage.load(VMLINUX))
    cpu = machine.cpu
    for _ in range(100):  # boot until the kernel idles: its IDT is loaded
        if cpu.run(count=100_000) is Stop.HALT:
            break
    page = DEMAND_BASE + 0x3000
    code = machine.alloc_code(64)
    drop = machine.image.address_of("drop_demand_pages")
    # write 7 to the page, read it back (TLB entry in use), reclaim everything, read again
    machine.write_memory(code, assemble(
        f"mov qword ptr [rdi], 0x7; mov rbx, qword ptr [rdi]; push rdi; mov rax, {drop:#x}; call rax; pop rdi;"
        " mov rax, qword ptr [rdi]; shl rbx, 0x8; or rax, rbx; ret", code))
    faults = cpu.delivered[14]
    assert machine.call(code, page) == 7 << 8  # 7 before the drop, 0 (a fresh frame) after
    assert cpu.delivered[14] == faults + 2
    assert cpu.memory.demand_pages == {page} and machine.read_memory(page, 8) == bytes(8)
    assert cpu.memory.frames_in_use == 1
    machine.call("drop_demand_pages")
    assert not cpu.memory.demand_pages and cpu.memory.frames_in_use == 0
