"""KGTP mode's run control on the wire (stub/kernel.py over machine/runcontrol.py), packet by packet against a
running two-CPU stub in this process: what GDB sends and reads back for a breakpoint, a step, a range step, a
watchpoint, Ctrl-C in each case, `monitor stop`/`go`, detach and a GDB that leaves; and the refusals, each with
its reason in an `E.` reply. A session that never asks for run control gets KGTP's never-stopping kernel.

A stop that comes while the machine runs is handed to the session when the target's notification says so (the
transport's wake-up, here an event): every wait is for that event.
"""

from __future__ import annotations

import threading

import pytest

from kgtp_sim.app import Stub
from kgtp_sim.arch import amd64
from kgtp_sim.client import VMLINUX
from kgtp_sim.machine import MODULE_BASE, KernelImage, Machine
from kgtp_sim.rsp.codec import Decoder, EventKind, encode_packet

from ..conftest import wait_until

IMAGE = KernelImage.load(VMLINUX)
DO_SYSCALL = IMAGE.symbols["do_syscall"]
TEST_FUNCTION = IMAGE.address_of("kgtp_test_function")
JIFFIES = IMAGE.address_of("jiffies")
WAIT_S = 60


class Wire:
    """One debugger's session with the stub, in no-ack mode as GDB has it."""

    def __init__(self, stub: Stub) -> None:
        self.stub = stub
        self.session = stub.make_session()
        self.woken = threading.Event()
        stub.target.notify_stops(self.woken.set)
        stub.on_connect()
        assert self.send(b"QStartNoAckMode") == [b"OK"]
        self.session.receive(b"+")

    def _packets(self, data: bytes) -> list[bytes]:
        return [e.payload for e in Decoder().feed(data) if e.kind is EventKind.PACKET]

    def send(self, payload: bytes) -> list[bytes]:
        return self._packets(self.session.receive(encode_packet(payload)))

    def request(self, payload: bytes) -> bytes:
        (reply,) = self.send(payload)
        return reply

    def ctrl_c(self) -> list[bytes]:
        return self._packets(self.session.receive(b"\x03"))

    def resume(self, payload: bytes) -> bytes:
        """A resumption's stop reply: at once, or once the stop wakes the transport."""
        self.woken.clear()
        replies = self.send(payload)
        if replies:
            return replies[-1]
        assert self.woken.wait(WAIT_S), f"{payload!r}: no stop in {WAIT_S} s"
        (reply,) = self._packets(self.session.poll())
        return reply

    def rip(self) -> int:
        return amd64.decode_registers(bytes.fromhex(self.request(b"g").replace(b"x", b"0").decode()))["rip"]

    def monitor(self, line: str) -> str:
        *text, final = self.send(b"qRcmd," + line.encode().hex().encode())
        assert final == b"OK"
        return "".join(bytes.fromhex(p[1:].decode()).decode() for p in text)


@pytest.fixture(scope="module")
def stub():
    machine = Machine(IMAGE, hz=100, cpus=2)
    machine.start()
    wait_until(lambda: machine.stats(count=False).cpus_online == 2, "CPU 1 online")
    yield Stub(machine)
    machine.shutdown()


@pytest.fixture
def wire(stub):
    wire = Wire(stub)
    yield wire
    stub.on_disconnect()
    assert not stub.machine.control.stopped and not stub.machine.control.breakpoints


def _running(stub: Stub) -> None:
    """The kernel runs: jiffies moves on."""
    jiffies = stub.machine.read_symbol("jiffies")
    wait_until(lambda: stub.machine.read_symbol("jiffies") > jiffies, "jiffies to move on")


def _thread(reply: bytes) -> int:
    assert reply.startswith(b"T05") and reply.endswith(b";"), reply
    return int(reply.split(b"thread:")[1][:-1], 16)


def test_a_session_that_asks_for_no_run_control_has_kgtps_kernel(wire, stub):
    assert wire.request(b"vCont?") == b"vCont;c;C;s;S;r"
    assert wire.request(b"?") == b"T05thread:1;"
    assert wire.send(b"vCont;c") == []  # waits
    assert wire.ctrl_c() == [b"T05thread:1;"]  # the kernel never stopped
    _running(stub)
    assert wire.send(b"c") == [] and wire.ctrl_c() == [b"T05thread:1;"]
    for packet in (b"vCont;s:1;c", b"s", b"vCont;r%x,%x:1" % (DO_SYSCALL.address, DO_SYSCALL.end)):
        assert wire.request(packet).startswith(b"E.the kernel never stops unless asked"), packet
    assert not stub.machine.control.stopped


def test_a_breakpoint_stops_the_machine_and_names_the_cpu(wire, stub):
    assert wire.request(b"Z0,%x,1" % DO_SYSCALL.address) == b"OK"
    reply = wire.resume(b"vCont;c")
    thread = _thread(reply)
    assert stub.machine.control.stopped
    assert wire.request(b"qC") == b"QC%x" % thread and wire.rip() == DO_SYSCALL.address  # GDB's thread follows
    assert wire.request(b"?") == reply
    assert wire.request(b"m%x,4" % DO_SYSCALL.address) == IMAGE.read_code(DO_SYSCALL.address, 4).hex().encode()
    jiffies = wire.request(b"m%x,8" % JIFFIES)
    assert wire.request(b"m%x,8" % JIFFIES) == jiffies  # time stands still

    # GDB steps over the breakpoint (lifted), with the other CPU stopped, then single steps and range steps
    assert wire.request(b"z0,%x,1" % DO_SYSCALL.address) == b"OK"
    assert wire.resume(b"vCont;s:%x" % thread) == b"T05thread:%x;" % thread
    assert wire.rip() == DO_SYSCALL.address + 1  # push %rbp
    assert wire.resume(b"vCont;s:%x;c" % thread) == b"T05thread:%x;" % thread
    assert wire.rip() == DO_SYSCALL.address + 2
    reply = wire.resume(b"vCont;r%x,%x:%x;c" % (DO_SYSCALL.address, DO_SYSCALL.end, thread))
    assert reply == b"T05thread:%x;" % thread and not DO_SYSCALL.address <= wire.rip() < DO_SYSCALL.end

    # continued without a breakpoint, Ctrl-C stops every CPU: SIGINT, GDB's thread stays
    assert wire.send(b"vCont;c") == []
    assert wire.ctrl_c() == [b"T02thread:%x;" % thread] and stub.machine.control.stopped
    # and the machine, stopped, continues: the same again
    assert wire.send(b"c") == [] and wire.ctrl_c() == [b"T02thread:%x;" % thread]


def test_with_scheduler_locking_only_the_stepped_cpu_runs(wire, stub):
    assert wire.request(b"Z0,%x,1" % DO_SYSCALL.address) == b"OK"
    thread = _thread(wire.resume(b"vCont;c"))
    wire.request(b"z0,%x,1" % DO_SYSCALL.address)
    other = 3 - thread
    wire.request(b"Hg%x" % other)
    before = wire.request(b"g")
    for _ in range(3):
        assert wire.resume(b"vCont;s:%x" % thread) == b"T05thread:%x;" % thread
    wire.request(b"Hg%x" % other)
    assert wire.request(b"g") == before


def test_a_watchpoint_reports_its_address(wire, stub):
    assert wire.request(b"Z3,%x,8" % JIFFIES) == b""  # no read watchpoint on x86: GDB falls back on Z4
    assert wire.request(b"Z2,%x,8" % JIFFIES) == b"OK"
    assert wire.resume(b"vCont;c") == b"T05watch:%x;thread:1;" % JIFFIES  # CPU 0 keeps time
    assert wire.request(b"z2,%x,8" % JIFFIES) == b"OK"
    assert wire.request(b"Z4,%x,8" % JIFFIES) == b"OK"
    assert wire.resume(b"vCont;c").startswith(b"T05awatch:%x;thread:" % JIFFIES)


def test_hbreak_takes_a_debug_register(wire, stub):
    assert wire.request(b"Z1,%x,1" % DO_SYSCALL.address) == b"OK"
    assert stub.machine.debug_registers.in_use == 1
    _thread(wire.resume(b"c"))
    assert wire.rip() == DO_SYSCALL.address
    assert wire.request(b"z1,%x,1" % DO_SYSCALL.address) == b"OK" and stub.machine.debug_registers.in_use == 0


def test_monitor_stop_and_go(wire, stub):
    assert wire.monitor("stop").startswith("machine stopped: CPU 0 at 0x")
    assert stub.machine.control.stopped and wire.request(b"?") == b"T05thread:1;"
    assert "stopped by the debugger" in wire.monitor("stats")
    assert wire.resume(b"vCont;s:1") == b"T05thread:1;"  # a stopped machine steps
    assert wire.monitor("go") == "machine running\n"
    _running(stub)
    assert wire.monitor("go") == "the machine is running\n"


def test_detach_and_leaving_take_the_breakpoints_and_leave_the_kernel_running(stub):
    for leave in (lambda wire: wire.request(b"D") == b"OK", lambda wire: stub.on_disconnect() or True):
        wire = Wire(stub)
        assert wire.request(b"Z0,%x,1" % DO_SYSCALL.address) == b"OK"
        assert wire.request(b"Z2,%x,8" % JIFFIES) == b"OK"
        _thread(wire.resume(b"vCont;c"))
        assert leave(wire)
        control = stub.machine.control
        assert not control.stopped and not control.breakpoints and not control.hardware
        calls = stub.machine.read_symbol("nr_syscalls")
        wait_until(lambda: stub.machine.read_symbol("nr_syscalls") > calls + 5, "system calls")
        assert not control.stopped


def test_breakpoints_where_the_machine_cannot_stop_are_refused_with_the_reason(wire, stub):
    refused = {
        MODULE_BASE + 0x40: b"module space, the stub's own code",
        DO_SYSCALL.address + 3: b"in the middle of an instruction of do_syscall",
        0x400000: b"no process maps it",
        JIFFIES: b"not mapped as code",
    }
    for address, reason in refused.items():
        for kind in (0, 1):
            reply = wire.request(b"Z%d,%x,1" % (kind, address))
            assert reply.startswith(b"E.cannot insert a breakpoint at %#x" % address) and reason in reply, reply
    assert wire.request(b"Z2,400000,8").startswith(b"E.cannot insert a breakpoint at 0x400000")
    assert not stub.machine.control.breakpoints and not stub.machine.control.hardware


def test_a_breakpoint_and_a_tracepoint_at_one_address(wire, stub):
    """The tracepoint's jump probe and the breakpoint at kgtp_test_function: the machine stops before the probe;
    a step over it collects once. A breakpoint inside the bytes a jump probe replaced (do_syscall's first three
    instructions) is refused: they run displaced, in the probe's detour."""
    for packet in (b"QTinit", b"QTDP:1:%x:E:0:0-" % TEST_FUNCTION, b"QTDP:-1:%x:R01" % TEST_FUNCTION,
                   b"QTDP:2:%x:E:0:0-" % DO_SYSCALL.address, b"QTDP:-2:%x:R01" % DO_SYSCALL.address, b"QTStart"):
        assert wire.request(packet) == b"OK", packet
    try:
        assert [row.kind for row in stub.tracer.probe_rows()] == ["jump", "jump"]
        reply = wire.request(b"Z0,%x,1" % (DO_SYSCALL.address + 1))
        assert reply.startswith(b"E.") and b"tracepoint 2's jump probe" in reply, reply
        assert wire.request(b"Z0,%x,1" % TEST_FUNCTION) == b"OK"
        thread = _thread(wire.resume(b"vCont;c"))
        frames = stub.tracer.status().frames
        wire.request(b"z0,%x,1" % TEST_FUNCTION)
        assert wire.resume(b"vCont;s:%x" % thread) == b"T05thread:%x;" % thread
        assert stub.tracer.status().frames == frames + 1 and wire.rip() == TEST_FUNCTION + 7
        wire.request(b"Z0,%x,1" % TEST_FUNCTION)
        _thread(wire.resume(b"vCont;c"))
        assert wire.rip() == TEST_FUNCTION
    finally:
        wire.request(b"QTStop")


def test_watchpoints_and_while_stepping_are_not_in_one_run(wire, stub):
    """Both take the CPU's one single-step trap, as KGTP keeps watch tracepoints and while-stepping apart: a
    watchpoint during a run that steps is refused, and so is a tstart that would step while GDB's watchpoints are
    in."""
    define = (b"QTinit", b"QTDP:1:%x:E:5:0-" % TEST_FUNCTION, b"QTDP:-1:%x:SR01" % TEST_FUNCTION)
    for packet in define:
        assert wire.request(packet) == b"OK", packet
    assert wire.request(b"Z2,%x,8" % JIFFIES) == b"OK"
    assert wire.request(b"QTStart").startswith(b"E"), "tstart with while-stepping and a watchpoint in"
    assert wire.request(b"z2,%x,8" % JIFFIES) == b"OK"
    assert wire.request(b"QTStart") == b"OK"
    try:
        reply = wire.request(b"Z2,%x,8" % JIFFIES)
        assert reply.startswith(b"E.cannot insert a breakpoint") and b"while-stepping" in reply, reply
        assert wire.request(b"Z1,%x,1" % DO_SYSCALL.address) == b"OK"  # an instruction breakpoint is no trap
    finally:
        wire.request(b"QTStop")
