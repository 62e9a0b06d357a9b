"""The machine's memory must not depend on how often the kernel drops its demand pages.

Making demand pages absent again means dropping their TLB entries. A full flush (UC_CTL_TLB_FLUSH) lets unicorn
2.1.4 resize its TLB tables upwards at every flush of a busy CPU: the soak saw the stub climb from 53 MiB to
230 MiB in steps at each drop, then stay there. The CPU now runs `invlpg` for each dropped page instead
(cpu.py, `_invalidate_stale_pages`); these tests fail if it goes back to full flushes, or if a dropped page
stays reachable without a fresh #PF.

That `invlpg` runs in an emulation run of its own, which must end the way the kernel's runs end (a `hlt`, not an
`until` address): with an `until` of its own, unicorn translated the `invlpg` block afresh for every page (176
KiB of new code at each drop of the idle kernel's pages), so the 1 GiB code buffer filled a little more every
12.8 s of a long run. The
child counts the resident pages of that buffer too (transparent huge pages off, so they are counted 4 KiB at a
time).

Memory is measured in a child process, so the test suite's own memory stays out of it.
"""

from __future__ import annotations

import subprocess
import sys

from unicorn import x86_const as X

from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.cpu import Stop
from kgtp_sim.machine.layout import DEMAND_BASE

from ..conftest import ROOT, VMLINUX

CHILD = r"""
import ctypes, re, time
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE, before unicorn maps its code buffer
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.layout import DEMAND_BASE, DEMAND_SIZE

def rss_mib():
    return next(int(l.split()[1]) // 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))

def code_buffer_kib():
    # the translated-code buffer: the one writable and executable mapping of 256 MiB or more
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", open("/proc/self/smaps").read()):
        start, end = (int(x, 16) for x in block.split()[0].split("-"))
        if " rwxp " in block.split("\n", 1)[0] and end - start >= 256 << 20:
            return int(re.search(r"^Rss:\s+(\d+)", block, re.M).group(1))
    raise SystemExit("no code buffer mapping found")

machine = Machine(KernelImage.load("fixtures/vmlinux"), hz=100, pace=1000000)
machine.start()
time.sleep(0.5)
before, code_before = rss_mib(), code_buffer_kib()
drops = 0
def drop(uc):
    # 128 pages present besides the kernel's own, as after its fault-test thread's rounds; all dropped at once
    for page in range(DEMAND_BASE + DEMAND_SIZE - 128 * 4096, DEMAND_BASE + DEMAND_SIZE, 4096):
        machine.cpu.map_demand_page(page)
    return machine.cpu.unmap_demand_pages()

while drops < 40:
    drops += machine.run_on_cpu(drop)
    time.sleep(0.05)
print(drops, machine.stats().page_faults, rss_mib() - before, code_buffer_kib() - code_before)
machine.shutdown()
"""


def test_forty_page_drops_of_a_busy_kernel_leave_memory_flat():
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    drops, faults, growth_mib, code_growth_kib = (int(v) for v in result.stdout.split())
    assert drops == 40 and faults >= drops  # the kernel faulted its page back in after every drop
    assert growth_mib < 16  # full flushes: 40 to 80 MiB here
    assert code_growth_kib < 1024  # a translation per dropped page: about 2.4 MiB here (170 KiB without)


def test_a_dropped_page_faults_again_at_the_next_access_and_the_kernel_state_is_kept():
    """The TLB entry of a present page is used, then the page is dropped: the very next access is a #PF, and
    the invalidation left the kernel's registers and the instruction count as they were."""
    machine = Machine(KernelImage.load(VMLINUX))
    cpu = machine.cpu
    for _ in range(100):  # boot until the kernel idles: its IDT is loaded
        if cpu.run(count=100_000) is Stop.HALT:
            break
    assert cpu.uc.reg_read(X.UC_X86_REG_IDTR)[2] > 14 * 16
    page = DEMAND_BASE + 0x3000
    assert cpu.map_demand_page(page)
    code = machine.alloc_code(32)
    # mov (%rdi), %rax; mov (%rdi), %rax -- the second load runs after the drop
    machine.write_memory(code, bytes.fromhex("488b07" "488b07" "f4"))
    uc = machine.uc
    uc.reg_write(X.UC_X86_REG_RDI, page)
    uc.reg_write(X.UC_X86_REG_RIP, code)
    cpu.run(until=code + 3)  # the first load fills the TLB
    assert cpu.page_present(page)
    before = {r: uc.reg_read(r) for r in (X.UC_X86_REG_RIP, X.UC_X86_REG_RDI, X.UC_X86_REG_RAX, X.UC_X86_REG_EFLAGS)}
    counted = cpu.counter.value
    assert cpu.unmap_demand_pages(page)
    assert {r: uc.reg_read(r) for r in before} == before and cpu.counter.value == counted
    faults = cpu.delivered[14]
    cpu.run(count=1)
    assert cpu.delivered[14] == faults + 1  # #PF delivered through the kernel's IDT, not a stale hit
    assert uc.reg_read(X.UC_X86_REG_CR2) == page
