"""KGTP mode's target (stub/kernel.py) against a fake machine: CPUs as GDB threads, the thread packets, the
selection `g` and `p` follow, the stop replies, the refusals (unknown threads, malformed ids, register writes on any
CPU), and run control, which only a replay of recorded frames has."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from kgtp_sim.arch import amd64
from kgtp_sim.client import VMLINUX
from kgtp_sim.machine import MemoryFault, smp
from kgtp_sim.rsp.dispatch import Deferred, Dispatcher
from kgtp_sim.rsp.packets import connect as c
from kgtp_sim.rsp.packets import data as d
from kgtp_sim.stub.core import TargetHandlers
from kgtp_sim.stub.kernel import KernelTarget, TaskNames, comm_offset
from kgtp_sim.stub.replay import Replay

from .fake_tracer import register_frame

TASKS = 0xFFFFFFFF81200000
COMM = 4


@dataclass
class FakeControl:
    """The machine's run control as far as these tests go: a kernel that runs, breakpoints noted."""

    stopped: bool = False
    serial: int = 0
    event: object = None
    listeners: list = field(default_factory=list)
    breakpoints: list = field(default_factory=list)

    def insert_breakpoint(self, address, space=None):
        self.breakpoints.append(("software", address))

    def insert_hardware(self, kind, address, size, space=None):
        self.breakpoints.append((kind, address, size))

    def clear(self):
        self.breakpoints.clear()


@dataclass
class FakeMachine:
    """CPU k's registers have rax = k and rip = 0x1000 + k; task i's comm is `task/i` at TASKS + 0x100 * i."""

    cpu_count: int = 2
    states: tuple[str, ...] = ("running", "idle")
    tasks: tuple[int, ...] = (TASKS + 0x100, TASKS + 0x200)
    symbols: dict = field(default_factory=dict)
    written: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.image = SimpleNamespace(symbols=self.symbols, path=VMLINUX, text_range=(0, 0))
        self.control = FakeControl()
        self.regs = [self._registers(k) for k in range(self.cpu_count)]

    @staticmethod
    def _registers(k: int) -> dict[str, int]:
        values = {name: 0 for name in ("rax rbx rcx rdx rsi rdi rbp rsp r8 r9 r10 r11 r12 r13 r14 r15 rip eflags cs "
                                       "ss ds es fs gs").split()}
        values.update(rax=k, rip=0x1000 + k, cs=0x08, ss=0x10)
        return values

    def cpu_states(self):
        return [smp.CpuState(k, self.states[k], self.regs[k]["rip"], self.tasks[k] if self.states[k] != "offline"
                             else 0) for k in range(self.cpu_count)]

    def registers(self, cpu=None):
        return dict(self.regs[cpu or 0])

    def set_registers(self, values, cpu=None):
        self.written.append((cpu, dict(values)))
        self.regs[cpu or 0].update(values)

    def read_memory(self, address, length):
        index, offset = divmod(address - TASKS, 0x100)
        if 0 < index < 8 and offset == COMM:
            return f"task/{index}".encode().ljust(length, b"\0")
        if address in (entry.address for entry in self.symbols.values()):
            return (TASKS + 0x300).to_bytes(8, "little")
        raise MemoryFault(address, length)


def _stub(machine: FakeMachine | None = None, *, allow_writes: bool = False):
    machine = machine or FakeMachine()
    target = KernelTarget(machine, allow_writes, TaskNames(machine, comm_offset=COMM))  # type: ignore[arg-type]
    handlers = TargetHandlers(target)
    return Dispatcher(handlers.families), handlers, target, machine


def _extra(dispatcher, thread: int) -> str:
    return bytes.fromhex(dispatcher.dispatch(b"qThreadExtraInfo,%x" % thread).decode()).decode()


def _rax(dispatcher) -> int:
    return int.from_bytes(bytes.fromhex(dispatcher.dispatch(b"p0").decode()), "little")


@pytest.mark.parametrize("cpus", [1, 2, 8])
def test_one_thread_per_cpu(cpus):
    machine = FakeMachine(cpus, ("running",) * cpus, tuple(TASKS + 0x100 * (1 + k % 4) for k in range(cpus)))
    dispatcher, *_ = _stub(machine)
    assert dispatcher.dispatch(b"qfThreadInfo") == b"m" + b",".join(b"%x" % (k + 1) for k in range(cpus))
    assert dispatcher.dispatch(b"qsThreadInfo") == b"l"
    for thread in range(1, cpus + 1):
        assert dispatcher.dispatch(b"T%x" % thread) == b"OK"
    assert dispatcher.dispatch(b"T%x" % (cpus + 1)) == b"E05"


def test_hg_selects_the_cpu_registers_come_from():
    dispatcher, threads, _, _ = _stub()
    assert dispatcher.dispatch(b"qC") == b"QC1" and _rax(dispatcher) == 0
    assert dispatcher.dispatch(b"Hg2") == b"OK"
    assert dispatcher.dispatch(b"qC") == b"QC2"
    assert _rax(dispatcher) == 1
    block = amd64.decode_registers(bytes.fromhex(dispatcher.dispatch(b"g").replace(b"x", b"0").decode()))
    assert block["rax"] == 1 and block["rip"] == 0x1001
    assert dispatcher.dispatch(b"Hg1") == b"OK" and _rax(dispatcher) == 0


@pytest.mark.parametrize("any_or_all", [b"0", b"-1"])
def test_hg_any_or_all_keeps_the_selected_cpu(any_or_all):
    dispatcher, *_ = _stub()
    dispatcher.dispatch(b"Hg2")
    assert dispatcher.dispatch(b"Hg" + any_or_all) == b"OK"
    assert dispatcher.dispatch(b"qC") == b"QC2" and _rax(dispatcher) == 1


@pytest.mark.parametrize("packet", [b"Hg3", b"Hc3", b"Hg7fffffff", b"T0", b"T-1", b"T3", b"qThreadExtraInfo,3",
                                    b"qThreadExtraInfo,0", b"qThreadExtraInfo,-1"])
def test_threads_that_are_no_cpu_are_refused_and_change_nothing(packet):
    dispatcher, handlers, _, _ = _stub()
    dispatcher.dispatch(b"Hg2")
    assert dispatcher.dispatch(packet).startswith(b"E")
    assert dispatcher.dispatch(b"qC") == b"QC2" and handlers.selection.continue_thread == c.ANY_THREAD


@pytest.mark.parametrize("packet", [b"Hgzz", b"Hg-2", b"H", b"Hx1", b"Tzz", b"qThreadExtraInfo,", b"qThreadExtraInfo,1,2",
                                    b"qfThreadInfo1", b"qCC"])
def test_malformed_thread_packets_are_answered_not_crashed_on(packet):
    dispatcher, *_ = _stub()
    assert dispatcher.dispatch(packet) == (b"E01" if dispatcher.lookup(packet) else b"")
    assert dispatcher.dispatch(b"qC") == b"QC1"


def test_hc_is_kept_for_the_continue_thread():
    dispatcher, handlers, _, _ = _stub()
    assert dispatcher.dispatch(b"Hc-1") == b"OK" and handlers.selection.continue_thread == -1
    assert dispatcher.dispatch(b"Hc2") == b"OK" and handlers.selection.continue_thread == 2
    assert dispatcher.dispatch(b"qC") == b"QC1"  # Hc does not move the register view


def test_stop_replies_name_the_selected_thread_and_a_new_session_starts_on_cpu_0():
    dispatcher, handlers, _, _ = _stub()
    assert dispatcher.dispatch(b"?") == b"T05thread:1;"
    dispatcher.dispatch(b"Hg2")
    assert dispatcher.dispatch(b"?") == b"T05thread:2;" == handlers.stop_reply()
    handlers.forget_session()
    assert dispatcher.dispatch(b"?") == b"T05thread:1;" and _rax(dispatcher) == 0


def test_extra_info_says_what_each_cpu_runs():
    machine = FakeMachine(3, ("running", "idle", "offline"), (TASKS + 0x100, TASKS + 0x200, 0))
    dispatcher, *_ = _stub(machine)
    assert _extra(dispatcher, 1) == "CPU#0 [running] task/1"
    assert _extra(dispatcher, 2) == "CPU#1 [idle] task/2"
    assert _extra(dispatcher, 3) == "CPU#2 [offline]"


def test_extra_info_without_a_readable_task_or_comm_offset():
    machine = FakeMachine(2, ("running", "running"), (0, TASKS + 0x9000))
    dispatcher, _, target, _ = _stub(machine)
    assert _extra(dispatcher, 1) == "CPU#0 [running]"  # no per-CPU task and no global `current`
    assert _extra(dispatcher, 2) == "CPU#1 [running]"  # the task's memory cannot be read
    target.names.comm_offset = None
    target.names._looked_up = True
    machine.tasks = (TASKS + 0x100, TASKS + 0x200)
    assert _extra(dispatcher, 2) == "CPU#1 [running]"


def test_a_kernel_without_per_cpu_data_names_cpu_0_task_through_current():
    machine = FakeMachine(1, ("running",), (0,), {"current": SimpleNamespace(address=TASKS - 8)})
    dispatcher, *_ = _stub(machine)
    assert _extra(dispatcher, 1) == "CPU#0 [running] task/3"


def test_the_comm_offset_comes_from_the_kernels_dwarf():
    assert comm_offset(VMLINUX) == 4  # struct task_struct { int pid; char comm[16]; ... }
    assert comm_offset("/nonexistent/vmlinux") is None


# ---- registers of the selected CPU: writes, and trace frames ------------------------------------------------


@pytest.mark.parametrize("allow_writes", [False, True])
def test_register_writes_are_refused_on_every_cpu(allow_writes):
    """Registers of the running kernel stay read-only, also with --allow-writes (tests/e2e/test_security.py)."""
    dispatcher, _, _, machine = _stub(allow_writes=allow_writes)
    for thread in (b"1", b"2"):
        dispatcher.dispatch(b"Hg" + thread)
        assert dispatcher.dispatch(b"P0=" + b"01" * 8) == b"E03"
        assert dispatcher.dispatch(b"G" + dispatcher.dispatch(b"g").replace(b"x", b"0")) == b"E03"
    assert dispatcher.dispatch(b"P0=zz") == b"E01"
    assert machine.written == [] and machine.regs[1]["rax"] == 1


def test_a_selected_trace_frame_outranks_the_selected_cpu():
    dispatcher, _, target, _ = _stub()

    class Frame:
        def registers(self):
            return {"rax": 0x77}

        def read_memory(self, address, length):
            return b"\0" * length

    dispatcher.dispatch(b"Hg2")
    target.overlay.current = Frame()
    assert _rax(dispatcher) == 0x77
    target.overlay.current = None
    assert _rax(dispatcher) == 1


# ---- run control: the kernel never stops; a replay of recorded frames does ------------------------------------


def test_outside_a_replay_continue_waits_and_nothing_else_moves():
    """The running kernel: `c` waits, steps are refused; breakpoints go to the machine's run control (which
    stops it when one is hit: tests/stub/test_kernel_run_control.py), but read watchpoints, which x86 has not."""
    dispatcher, _, _, machine = _stub()
    assert isinstance(dispatcher.dispatch(b"c"), Deferred)
    for packet in (b"s", b"bs", b"bc", b"vCont;s:1;c"):
        assert dispatcher.dispatch(packet).startswith(b"E.the kernel never stops")
    kernel = 0xFFFF888000001000  # a kernel address (a process's are its own: tests/stub/test_kernel_user_breakpoints.py)
    assert dispatcher.dispatch(b"Z3,%x,1" % kernel) == b"" and dispatcher.dispatch(b"z3,%x,1" % kernel) == b""
    for kind in (0, 1, 2, 4):
        assert dispatcher.dispatch(b"Z%d,%x,1" % (kind, kernel)) == b"OK"
    assert machine.control.breakpoints == [("software", kernel), (0, kernel, 1), (1, kernel, 1), (2, kernel, 1)]
    assert b"ReverseStep+" in dispatcher.dispatch(b"qSupported").split(b";")


def test_a_replay_steps_continues_to_its_breakpoints_and_ends():
    dispatcher, _, target, _ = _stub()
    frames = [register_frame(n, 1, 0x2000 + n) for n in range(4)]
    target.overlay.replay = Replay(frames, 0, SimpleNamespace(segments=[]))
    dispatcher.dispatch(b"Hg2")
    assert dispatcher.dispatch(b"Z1,2002,1") == b""  # software breakpoints only
    assert dispatcher.dispatch(b"Z0,2002,1") == b"OK"
    assert dispatcher.dispatch(b"c") == b"T05thread:2;"
    assert amd64.decode_registers(bytes.fromhex(dispatcher.dispatch(b"g").replace(b"x", b"0").decode()))["rip"] \
        == 0x2002
    assert dispatcher.dispatch(b"s") == b"T05thread:2;"
    assert dispatcher.dispatch(b"c") == b"T05replaylog:end;thread:2;"
    assert dispatcher.dispatch(b"bc") == b"T05thread:2;" and target.overlay.replay.index == 2
    assert dispatcher.dispatch(b"z0,2002,1") == b"OK"
    assert dispatcher.dispatch(b"bc") == b"T05replaylog:begin;thread:2;"
    assert dispatcher.dispatch(b"M1000,1:00") == b"E03"  # no --allow-writes
