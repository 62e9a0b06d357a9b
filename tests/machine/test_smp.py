"""The SMP kernel on 1, 2, 4 and 8 CPUs: every CPU boots with its per-CPU area and idle task, takes its ticks and
IPIs, runs its own threads; shared counters come out exact under the stress (fixtures/kernel/smp.c), and each
run queue's accounting adds up.

Every wait polls the kernel's own counters until a condition holds (generous deadlines): nothing sleeps a fixed
window, so a busy host only makes the tests slower.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from kgtp_sim.machine import KernelImage, Machine, smp
from kgtp_sim.machine.dwarf import CType, KernelDwarf
from kgtp_sim.machine.scheduler import TIMER_VECTOR
from kgtp_sim.machine.tracee import RESCHEDULE_VECTOR

from ..conftest import VMLINUX

DEADLINE_S = 90
TASK_UNINTERRUPTIBLE = 2


@pytest.fixture(scope="module")
def image() -> KernelImage:
    return KernelImage.load(VMLINUX)


@pytest.fixture(scope="module")
def dwarf():
    kernel = KernelDwarf(VMLINUX)
    yield kernel
    kernel.close()


def _decode(data: bytes, ctype: CType) -> Any:
    """A value of `ctype` from its bytes: dicts for structs, lists for arrays, ints for scalars."""
    if ctype.kind in ("struct", "union"):
        return {name: _decode(data[offset:offset + member.size], member)
                for name, offset, member in ctype.members if name}
    if ctype.kind == "array" and ctype.target is not None:
        if ctype.target.char:
            return data.split(b"\0", 1)[0].decode()
        size = ctype.target.size
        return [_decode(data[i * size:(i + 1) * size], ctype.target) for i in range(ctype.count or 0)]
    if ctype.kind == "typedef" and ctype.target is not None:
        return _decode(data, ctype.target)
    return int.from_bytes(data[:ctype.size], "little", signed=ctype.signed)


class Kernel:
    """Reads the kernel's SMP state in one trip to the CPU thread (one instant of every CPU)."""

    NAMES = ("cpu_data", "tasks", "nr_cpus_online", "cpu_online_mask", "nr_context_switches", "nr_syscalls",
             "nr_page_faults", "nr_traps", "stress_counter", "stress_a", "stress_b", "stress_done",
             "stress_errors", "stress_expected", "stress_completed", "stress_started", "stress_lock",
             "kgtp_counter")

    def __init__(self, machine: Machine, image: KernelImage, dwarf: KernelDwarf) -> None:
        self.machine, self.image = machine, image
        self.variables = {}
        for name in self.NAMES:
            found = dwarf.global_variable(name)
            assert found is not None, f"{name} has no DWARF"
            self.variables[name] = found

    def snapshot(self) -> dict[str, Any]:
        def read(uc) -> dict[str, bytes]:
            return {name: bytes(uc.mem_read(address, ctype.size)) for name, (address, ctype) in self.variables.items()}

        raw = self.machine.run_on_cpu(read)
        state = {name: _decode(raw[name], self.variables[name][1]) for name in raw}
        state["tasks_address"] = self.variables["tasks"][0]
        return state

    def write(self, name: str, value: int) -> None:
        address, ctype = self.variables.get(name) or (self.image.address_of(name), None)
        self.machine.write_memory(address, value.to_bytes(8, "little"))

    def wait(self, condition, message: str, timeout: float = DEADLINE_S) -> dict[str, Any]:
        """Poll snapshots until condition(snapshot) holds; the snapshot that satisfied it."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.snapshot()
            if condition(state):
                return state
            assert time.monotonic() < deadline, f"{message}; last state: {_summary(state)}"
            time.sleep(0.02)


def _summary(state: dict[str, Any]) -> str:
    cpus = [(c["cpu_number"], c["online"], c["stats"]) for c in state["cpu_data"]]
    return f"online {state['nr_cpus_online']} cpus {cpus}"


def _task_address(state, index: int, task_size: int) -> int:
    return state["tasks_address"] + index * task_size


def _task_index(cpu: int, slot: int) -> int:
    """kernel.h's CPU_TASK: CPU 0 has 6 tasks (pids 0..5), every other CPU 5."""
    return slot if cpu == 0 else 6 + (cpu - 1) * 5 + slot


@pytest.fixture
def boot(image, dwarf):
    machines = []

    def start(cpus: int, hz: int = 100) -> Kernel:
        machine = Machine(image, hz=hz, cpus=cpus)
        machines.append(machine)
        machine.start()
        kernel = Kernel(machine, image, dwarf)
        kernel.wait(lambda s: s["nr_cpus_online"] == cpus and all(c["online"] for c in s["cpu_data"][:cpus]),
                    f"not every one of {cpus} CPUs came online")
        return kernel

    yield start
    for machine in machines:
        machine.shutdown()


@pytest.mark.parametrize("cpus", [1, 2, 4, 8])
def test_every_cpu_boots_with_its_area_idle_task_and_ticks(boot, cpus):
    kernel = boot(cpus)
    machine = kernel.machine
    task_size = kernel.variables["tasks"][1].size // len(kernel.snapshot()["tasks"])
    state = kernel.wait(lambda s: all(c["stats"]["ticks"] >= 5 for c in s["cpu_data"][:cpus]),
                        "a CPU takes no ticks")
    assert state["cpu_online_mask"] == (1 << cpus) - 1
    for cpu, area in enumerate(state["cpu_data"]):
        assert area["cpu_number"] == cpu
        idle = _task_index(cpu, 0)
        assert area["rq"]["idle"] == _task_address(state, idle, task_size)
        assert state["tasks"][idle]["comm"] == f"swapper/{cpu}" and state["tasks"][idle]["cpu"] == cpu
        assert area["online"] == (cpu < cpus)
    for task in state["tasks"]:  # the tasks of CPUs the machine lacks never run
        if task["cpu"] >= cpus:
            assert task["state"] == TASK_UNINTERRUPTIBLE and task["sum_exec_runtime"] == 0, task["comm"]
    # the machine agrees: every CPU online, each one's %gs:8 is its number, its ticks delivered
    stats = machine.stats(count=False)
    assert stats.cpus == stats.cpus_online == cpus and all(t >= 5 for t in stats.ticks_per_cpu)
    assert [machine.on_cpu(cpu, smp.cpu_number) for cpu in range(cpus)] == list(range(cpus))
    states = machine.cpu_states()
    assert [s.state != "offline" for s in states] == [True] * cpus
    assert all(s.current_task for s in states)
    console = machine.console_text()
    assert f"smp: brought up {cpus} CPUs" in console
    assert all(f"CPU{cpu}: online, idle task swapper/{cpu}" in console for cpu in range(1, cpus))


def test_one_cpu_is_the_kernel_it_was(boot):
    kernel = boot(1)
    state = kernel.wait(lambda s: s["cpu_data"][0]["stats"]["syscalls"] > 10 and s["cpu_data"][0]["stats"]["traps"] > 2,
                        "the one CPU's threads never ran")
    names = [task["comm"] for task in state["tasks"][:5]]
    assert names == ["swapper/0", "kgtp_bench", "kmodload", "syscall_test", "pagefault_test"]
    assert [task["pid"] for task in state["tasks"][:5]] == [0, 1, 2, 3, 4]
    assert kernel.machine.stats(count=False).ipis == 0
    assert sum(c["stats"]["ipi_sent"] for c in state["cpu_data"]) == 0
    assert all(task["sum_exec_runtime"] == 0 for task in state["tasks"] if task["cpu"] != 0)


@pytest.mark.parametrize("cpus", [2, 4])
def test_workload_runs_on_every_cpu(boot, cpus):
    """kgtp_bench/N makes progress, system calls, page faults and traps happen on every CPU; the global counters
    (lock-prefixed increments) are the sums of the per-CPU ones."""
    kernel = boot(cpus)

    def busy_everywhere(s) -> bool:
        areas = s["cpu_data"][:cpus]
        return all(a["stats"]["bench_calls"] >= 1000 and a["stats"]["syscalls"] >= 5 and a["stats"]["page_faults"] >= 2
                   and a["stats"]["traps"] >= 2 for a in areas)

    kernel.wait(busy_everywhere, "some CPU's threads make no progress")

    def sums_agree(s) -> bool:
        per_cpu = lambda key: sum(a["stats"][key] for a in s["cpu_data"])  # noqa: E731
        return (s["nr_syscalls"], s["nr_page_faults"], s["nr_traps"]) == (
            per_cpu("syscalls"), per_cpu("page_faults"), per_cpu("traps"))

    kernel.wait(sums_agree, "global counters differ from the per-CPU ones")
    stats = kernel.machine.stats(count=False)
    assert stats.syscalls > 0 and stats.page_faults > 0 and stats.traps > 0


def _accounting_consistent(state, cpus: int) -> bool:
    """Per CPU: its tasks' sum_exec_runtime adds up to what its run queue charged, their nvcsw + nivcsw to its
    switches; taken only from a snapshot where no CPU is inside its update (rq.seq even)."""
    areas = state["cpu_data"][:cpus]
    if any(a["rq"]["seq"] % 2 for a in areas):
        return False
    for cpu, area in enumerate(areas):
        tasks = [t for t in state["tasks"] if t["cpu"] == cpu]
        assert sum(t["sum_exec_runtime"] for t in tasks) == area["rq"]["exec_charged"], f"CPU {cpu} runtime"
        assert sum(t["nvcsw"] + t["nivcsw"] for t in tasks) == area["rq"]["nr_switches"], f"CPU {cpu} switches"
    # nr_context_switches is bumped just after each run queue's update: at most one behind per CPU
    behind = sum(a["rq"]["nr_switches"] for a in areas) - state["nr_context_switches"]
    assert 0 <= behind <= cpus
    return True


def _run_generations(kernel: Kernel, cpus: int, iterations: int, generations: int) -> dict[str, Any]:
    kernel.write("stress_iterations", iterations)
    before = kernel.snapshot()
    first, base = before["stress_completed"] + 1, before["stress_expected"]
    state = {}
    for generation in range(first, first + generations):
        kernel.write("stress_generation", generation)
        state = kernel.wait(lambda s, g=generation: s["stress_completed"] == g,
                            f"stress generation {generation} never completed")
        total = base + (generation - first + 1) * cpus * iterations
        assert state["stress_expected"] == total
        assert state["stress_counter"] == total  # lock incq
        assert state["stress_a"] == total  # read-modify-write under stress_lock
        assert state["stress_b"] == 2 * total
        assert state["stress_done"] == total  # lock xaddq
        assert state["stress_errors"] == 0  # b == 2 * a held at every round, under the lock
    return state


@pytest.mark.parametrize("cpus", [2, 4])
def test_stress_totals_are_exact(boot, cpus):
    """Generations of 100,000 rounds per CPU, at least three and until the lock was contended at least once (a CPU
    switched out inside the critical section, another one waiting): every total exact after each."""
    kernel = boot(cpus)
    started, switches = time.monotonic(), kernel.machine.stats(count=False).cpu_switches
    generations = 0
    while True:
        state = _run_generations(kernel, cpus, iterations=100_000, generations=1)
        generations += 1
        if generations >= 3 and state["stress_lock"]["contended"]:
            break
        assert time.monotonic() - started < DEADLINE_S, "stress_lock was never contended"
    rounds = [a["stats"]["stress_rounds"] for a in state["cpu_data"]]
    assert rounds[:cpus] == [generations * 100_000] * cpus and not any(rounds[cpus:])
    print(f"{cpus} CPUs: {generations} generations of {cpus} x 100000 rounds in {time.monotonic() - started:.2f} s, "
          f"{kernel.machine.stats(count=False).cpu_switches - switches} CPU switches, stress_lock contended "
          f"{state['stress_lock']['contended']} times, {state['stress_lock']['yields']} yields")
    kernel.wait(lambda s: _accounting_consistent(s, cpus), "no snapshot outside a run queue update")


@pytest.mark.parametrize("cpus", [2, 4])
def test_ipis_are_delivered_and_counted(boot, cpus):
    """Call-function IPIs start each stress generation, the last CPU to finish wakes CPU 0's stress thread
    (a reschedule IPI when it is another CPU), every reclaim of a fault window shoots down the other CPUs' TLB
    entries. The kernel's sent and received counts agree with each other and with the machine's."""
    kernel = boot(cpus, hz=1000)  # windows of 256/cpus pages, one fault each 5 ticks: reclaim within a second
    deadline = time.monotonic() + DEADLINE_S
    while True:
        _run_generations(kernel, cpus, iterations=500, generations=1)
        state = kernel.snapshot()
        if sum(a["stats"]["ipi_resched"] for a in state["cpu_data"]) >= 1:
            break
        assert time.monotonic() < deadline, "no reschedule IPI in any generation"
    areas = lambda s: s["cpu_data"][:cpus]  # noqa: E731
    kernel.wait(lambda s: all(a["stats"]["ipi_call"] >= 1 for a in areas(s)[1:]), "no call-function IPI")
    # every CPU reclaims its window (sends a shootdown) and takes the others'
    kernel.wait(lambda s: all(a["stats"]["ipi_tlb"] >= 1 and a["stats"]["tlb_pages_flushed"] >= 256 // cpus
                              and a["stats"]["ipi_sent"] >= 1 for a in areas(s)), "a CPU never took a TLB shootdown")

    def counts_agree(s) -> bool:
        sent = sum(a["stats"]["ipi_sent"] for a in s["cpu_data"])
        received = sum(a["stats"][k] for a in s["cpu_data"] for k in ("ipi_resched", "ipi_call", "ipi_tlb"))
        return sent == received == kernel.machine.stats(count=False).ipis

    kernel.wait(counts_agree, "IPIs sent, received and counted by the machine differ")


def test_an_ipi_waiting_beside_a_tick_is_taken_first(boot):
    """A CPU with a tick and a reschedule IPI waiting takes the IPI first, as a local APIC serves the highest
    vector first; the tick went first once, and a CPU that seldom takes interrupts (a program stepped at every
    call) took a new tick at each chance while the debugger's IPI, which stops a thread asleep there, waited
    behind them for tenths of a second. Both are queued at once on the CPU thread, the tick before the IPI (in the
    order they came, the tick would go first too); the timer's own ticks come meanwhile."""
    machine = boot(1).machine
    queued: list[bool] = []
    taken: list[int] = []
    deliver = machine.cpu.deliver

    def noting_deliver(vector, error_code=None):
        if queued and vector in (TIMER_VECTOR, RESCHEDULE_VECTOR):
            taken.append(vector)
        deliver(vector, error_code)

    def queue(uc) -> None:
        machine.send_interrupt(0, TIMER_VECTOR)
        machine.send_interrupt(0, RESCHEDULE_VECTOR)
        queued.append(True)

    machine.cpu.deliver = noting_deliver
    try:
        machine.run_on_cpu(queue)
        deadline = time.monotonic() + DEADLINE_S
        while RESCHEDULE_VECTOR not in taken:
            assert time.monotonic() < deadline, f"the IPI never taken (taken: {taken})"
            time.sleep(0.01)
    finally:
        machine.cpu.deliver = deliver
    assert taken[0] == RESCHEDULE_VECTOR, f"taken in this order: {taken[:4]}"


@pytest.mark.parametrize("cpus", [1, 2, 4])
def test_run_queue_accounting_adds_up(boot, cpus):
    kernel = boot(cpus)
    kernel.wait(lambda s: all(a["rq"]["nr_switches"] >= 50 for a in s["cpu_data"][:cpus]), "too few switches")
    checked = 0
    deadline = time.monotonic() + DEADLINE_S
    while checked < 5:
        checked += _accounting_consistent(kernel.snapshot(), cpus)
        assert time.monotonic() < deadline, "no snapshot outside a run queue update"
        time.sleep(0.02)
