"""The shared packet handlers (stub/core.py, stub/run.py, stub/threads.py) against a second target, the toy process
of tests/stub/toy_target.py: they speak to the target interface only, and what the target declares (its
extensions) is what GDB is told, as gdbserver would tell it. KGTP's own replies are tests/stub/test_threads.py's
and the e2e tests'."""

from __future__ import annotations

import pytest

from kgtp_sim.arch import amd64
from kgtp_sim.rsp.codec import Decoder, EventKind, encode_packet
from kgtp_sim.rsp.dispatch import Dispatcher
from kgtp_sim.rsp.session import Session
from kgtp_sim.stub.core import TargetHandlers

from ..test_layers import PACKAGE, _imports
from .toy_target import BASE, INT3, SIZE, SPIN, ReversibleToy, ToyProcess, ToyTarget

#: What the shared handler modules may import: the interface, each other, the wire and the register layout.
HANDLER_MODULES = ("core", "run", "threads")


def _stub(target):
    handlers = TargetHandlers(target)
    return Dispatcher(handlers.families), handlers


def _registers(dispatcher) -> dict[str, int]:
    return amd64.decode_registers(bytes.fromhex(dispatcher.dispatch(b"g").decode()))


def _features(dispatcher) -> list[bytes]:
    return dispatcher.dispatch(b"qSupported").split(b";")


def test_the_handlers_know_the_target_interface_only():
    """No handler module reaches the machine, the tracer or KGTP's target: all they know is stub/target.py."""
    allowed = ("kgtp_sim.rsp", "kgtp_sim.arch", "kgtp_sim.stub.target",
               *(f"kgtp_sim.stub.{name}" for name in HANDLER_MODULES))
    for name in HANDLER_MODULES:
        imported = [i for i in _imports(PACKAGE / "stub" / f"{name}.py") if i.startswith("kgtp_sim")]
        assert imported and all(i.startswith(allowed) for i in imported), (name, imported)


# ---- threads ----------------------------------------------------------------------------------------------------


def test_the_threads_are_the_targets():
    dispatcher, handlers = _stub(ToyTarget())
    assert dispatcher.dispatch(b"qfThreadInfo") == b"m1,2" and dispatcher.dispatch(b"qsThreadInfo") == b"l"
    assert dispatcher.dispatch(b"qC") == b"QC1"
    assert dispatcher.dispatch(b"T2") == b"OK" and dispatcher.dispatch(b"T3") == b"E05"
    assert bytes.fromhex(dispatcher.dispatch(b"qThreadExtraInfo,2").decode()) == b"toy thread 2"
    assert dispatcher.dispatch(b"Hg3") == b"E05" and dispatcher.dispatch(b"qC") == b"QC1"


def test_session_packets_reach_the_target():
    target = ToyTarget()
    dispatcher, _ = _stub(target)
    assert dispatcher.dispatch(b"qAttached") == b"0"  # the toy was started, not attached to: GDB kills it on quit
    assert dispatcher.dispatch(b"D") == b"OK" and target.detached and not target.killed
    assert dispatcher.dispatch(b"k") == b"OK" and target.killed


# ---- registers and memory -------------------------------------------------------------------------------------


def test_registers_are_those_of_the_selected_thread_and_written_there():
    target = ToyTarget()
    dispatcher, _ = _stub(target)
    assert _registers(dispatcher)["rax"] == 0x100
    assert dispatcher.dispatch(b"Hg2") == b"OK" and _registers(dispatcher)["rax"] == 0x200
    assert dispatcher.dispatch(b"P0=" + (0x1234).to_bytes(8, "little").hex().encode()) == b"OK"
    assert dispatcher.dispatch(b"p0") == (0x1234).to_bytes(8, "little").hex().encode()
    assert target.registers[2]["rax"] == 0x1234 and target.registers[1]["rax"] == 0x100
    block = amd64.encode_registers({**target.registers[2], "rbx": 0x55})
    assert dispatcher.dispatch(b"G" + block.hex().encode()) == b"OK"
    assert target.registers[2]["rbx"] == 0x55 and target.registers[2]["rax"] == 0x1234
    # a target with register writes checks what is written (KGTP refuses every write first: E03)
    assert dispatcher.dispatch(b"P99=" + b"00" * 8) == b"E01"
    assert dispatcher.dispatch(b"P0=0000") == b"E01"  # rax is 8 bytes


def test_memory_reads_writes_and_holes():
    target = ToyTarget()
    target.memory[:4] = b"\x90\x91\x92\x93"
    dispatcher, _ = _stub(target)
    assert dispatcher.dispatch(b"m%x,4" % BASE) == b"90919293"
    assert dispatcher.dispatch(b"m%x,8" % (BASE + SIZE - 2)) == b"0000"  # the readable prefix
    assert dispatcher.dispatch(b"m%x,4" % (BASE + SIZE)) == b"E02"
    assert dispatcher.dispatch(b"M%x,2:abcd" % BASE) == b"OK"
    assert dispatcher.dispatch(b"X%x,2:\x01\x02" % (BASE + 2)) == b"OK"
    assert bytes(target.memory[:4]) == b"\xab\xcd\x01\x02"
    assert dispatcher.dispatch(b"M%x,2:abcd" % (BASE + SIZE - 1)) == b"E02"


def test_the_target_description_is_the_targets():
    default, _ = _stub(ToyTarget())
    assert default.dispatch(b"qXfer:features:read:target.xml:0,fff").data == b"l" + amd64.target_xml().encode()
    target = ToyTarget()
    target.feature_document = {"target.xml": b"<target>toy</target>"}.get  # type: ignore[method-assign]
    dispatcher, _ = _stub(target)
    assert dispatcher.dispatch(b"qXfer:features:read:target.xml:0,8").data == b"m<target>"
    assert dispatcher.dispatch(b"qXfer:features:read:target.xml:8,fff").data == b"ltoy</target>"
    assert dispatcher.dispatch(b"qXfer:features:read:other.xml:0,fff") == b"E00"


# ---- what a target lacks --------------------------------------------------------------------------------------


def test_a_target_with_base_operations_only_refuses_writes_and_supports_no_run_control():
    """Read-only registers and memory: E03 (KGTP's answer); no resume and no breakpoints: the empty reply, as
    gdbserver gives for what it does not support; reverse execution is not even in the dispatch table."""
    target = ToyProcess()
    dispatcher, handlers = _stub(target)
    assert handlers.reverse is None
    registers = dispatcher.dispatch(b"g")
    for packet in (b"G" + registers, b"P0=" + b"00" * 8, b"M%x,1:cc" % BASE, b"X%x,1:\xcc" % BASE):
        assert dispatcher.dispatch(packet) == b"E03", packet
    for packet in (b"c", b"s", b"bs", b"bc", *(b"Z%d,%x,1" % (kind, BASE) for kind in range(5)), b"z0,%x,1" % BASE):
        assert dispatcher.dispatch(packet) == b"", packet
    assert dispatcher.dispatch(b"?") == b"T05thread:1;"
    assert bytes(target.memory) == bytes(SIZE)


def test_qsupported_follows_the_extensions_the_target_declares():
    plain, reversible = _features(_stub(ToyTarget())[0]), _features(_stub(ReversibleToy())[0])
    for features in (plain, reversible):
        assert b"qXfer:features:read+" in features and b"QStartNoAckMode+" in features
    assert b"ReverseStep+" not in plain and b"ReverseContinue+" not in plain
    assert b"ReverseStep+" in reversible and b"ReverseContinue+" in reversible
    # neither runs breakpoint conditions: a `Z0` reads none (tests/stub/test_breakpoint_conditions.py: the process's)
    for features in (plain, reversible):
        assert b"ConditionalBreakpoints+" not in features and b"BreakpointCommands+" not in features


# ---- breakpoints and run control ------------------------------------------------------------------------------


def test_only_the_breakpoint_types_the_target_declares_are_set():
    target = ToyTarget()
    dispatcher, _ = _stub(target)
    assert dispatcher.dispatch(b"Z0,%x,1" % (BASE + 4)) == b"OK" and target.breakpoints == {BASE + 4}
    for kind in range(1, 5):  # hardware breakpoints and watchpoints: unsupported, GDB falls back
        assert dispatcher.dispatch(b"Z%d,%x,1" % (kind, BASE + 4)) == b""
        assert dispatcher.dispatch(b"z%d,%x,1" % (kind, BASE + 4)) == b""
    assert dispatcher.dispatch(b"Z0,%x,1" % (BASE + SIZE)) == b"E02"  # the target refuses it
    assert dispatcher.dispatch(b"m%x,1" % (BASE + 4)) == b"00"  # a breakpoint is not an int3 in memory
    assert dispatcher.dispatch(b"z0,%x,1" % (BASE + 4)) == b"OK" and not target.breakpoints


def test_continue_stops_at_a_breakpoint_and_selects_the_thread_that_hit_it():
    target = ToyTarget()
    dispatcher, _ = _stub(target)
    dispatcher.dispatch(b"Z0,%x,1" % (BASE + 0x23))
    assert dispatcher.dispatch(b"c") == b"T05thread:2;"  # thread 2 starts at BASE + 0x20
    assert dispatcher.dispatch(b"qC") == b"QC2" and _registers(dispatcher)["rip"] == BASE + 0x23
    assert target.registers[1]["rip"] == BASE + 3  # all-stop: thread 1 ran as far
    dispatcher.dispatch(b"z0,%x,1" % (BASE + 0x23))
    assert dispatcher.dispatch(b"c") == b"W00"  # thread 2 ran off the end: the process exited


def test_step_runs_one_instruction_of_the_continue_thread():
    target = ToyTarget()
    dispatcher, _ = _stub(target)
    assert dispatcher.dispatch(b"Hc2") == b"OK"
    assert dispatcher.dispatch(b"s") == b"T05thread:2;"
    assert target.registers[2]["rip"] == BASE + 0x21 and target.registers[1]["rip"] == BASE


def test_without_breakpoints_gdb_plants_an_int3_with_m_and_it_traps():
    """What GDB does when Z0 gets the empty reply: it writes the breakpoint instruction itself."""
    target = ToyTarget()
    target.supports = lambda type: False  # type: ignore[method-assign]
    dispatcher, _ = _stub(target)
    assert dispatcher.dispatch(b"Z0,%x,1" % (BASE + 2)) == b""
    assert dispatcher.dispatch(b"M%x,1:%s" % (BASE + 2, INT3.hex().encode())) == b"OK"
    assert dispatcher.dispatch(b"c") == b"T05thread:1;" and target.registers[1]["rip"] == BASE + 3


def test_a_running_target_is_stopped_by_ctrl_c():
    """`c` that does not stop at once is answered only after the user's Ctrl-C, with the target's stop."""
    target = ToyTarget()
    target.memory[5:7] = SPIN
    dispatcher, handlers = _stub(target)
    session = Session(dispatcher, stop_reply=handlers.stop_reply)

    def exchange(data: bytes) -> list[bytes]:
        return [e.payload for e in Decoder().feed(session.receive(data)) if e.kind is EventKind.PACKET]

    assert exchange(encode_packet(b"Hc1")) == [b"OK"]
    assert exchange(encode_packet(b"c")) == []
    assert exchange(b"\x03") == [b"T02thread:1;"]
    assert target.registers[1]["rip"] == BASE + 5


def test_reverse_execution_through_the_targets_history():
    target = ReversibleToy()
    dispatcher, _ = _stub(target)
    dispatcher.dispatch(b"Hc1")
    for _ in range(3):
        assert dispatcher.dispatch(b"s") == b"T05thread:1;"
    assert dispatcher.dispatch(b"bs") == b"T05thread:1;" and target.registers[1]["rip"] == BASE + 2
    dispatcher.dispatch(b"Z0,%x,1" % (BASE + 1))
    assert dispatcher.dispatch(b"bc") == b"T05thread:1;" and target.registers[1]["rip"] == BASE + 1
    assert dispatcher.dispatch(b"bc") == b"T05replaylog:begin;thread:1;" and target.registers[1]["rip"] == BASE


@pytest.mark.parametrize("target", [ToyProcess, ToyTarget, ReversibleToy])
def test_a_new_debugger_starts_on_the_first_thread(target):
    dispatcher, handlers = _stub(target())
    dispatcher.dispatch(b"Hg2")
    dispatcher.dispatch(b"Hc2")
    handlers.forget_session()
    assert dispatcher.dispatch(b"qC") == b"QC1" and handlers.selection.continue_thread == 0


# ---- vCont and stops a running target makes by itself -----------------------------------------------------------


def test_vcont_announces_what_the_target_resumes_with():
    assert _stub(ToyProcess())[0].dispatch(b"vCont?") == b""  # no resume: GDB keeps to c and s (which fail too)
    dispatcher, _ = _stub(ToyTarget())
    assert dispatcher.dispatch(b"vCont?") == b"vCont;c;C;s;S"  # no range stepping
    assert dispatcher.dispatch(b"vCont;r%x,%x:1" % (BASE, BASE + 4)).startswith(b"E")
    assert dispatcher.dispatch(b"vCont;t:1").startswith(b"E")  # non-stop only
    assert dispatcher.dispatch(b"vCont;c:3") == b"E05"  # no thread 3


def test_vcont_steps_and_continues_the_threads_it_names():
    target = ToyTarget()
    dispatcher, _ = _stub(target)
    assert dispatcher.dispatch(b"vCont;s:2;c") == b"T05thread:2;"
    assert target.registers[2]["rip"] == BASE + 0x21 and target.registers[1]["rip"] == BASE
    assert dispatcher.dispatch(b"qC") == b"QC2"
    dispatcher.dispatch(b"Z0,%x,1" % (BASE + 3))
    assert dispatcher.dispatch(b"vCont;c:1") == b"T05thread:1;"  # thread 2, named by no action, stayed
    assert target.registers[1]["rip"] == BASE + 3 and target.registers[2]["rip"] == BASE + 0x21
    assert dispatcher.dispatch(b"vCont;S05:1") == b"T05thread:1;" and target.registers[1]["rip"] == BASE + 4


def test_s_with_any_thread_steps_the_selected_thread():
    """gdbserver's myresume: `s` after `Hc0` steps the thread `Hg` selected, the others continuing."""
    target = ToyTarget()
    dispatcher, _ = _stub(target)
    dispatcher.dispatch(b"Hg2")
    assert dispatcher.dispatch(b"s") == b"T05thread:2;" and target.registers[2]["rip"] == BASE + 0x21


def test_a_stop_the_target_makes_itself_reaches_the_waiting_session():
    target = ToyTarget()
    target.memory[5:7] = SPIN
    dispatcher, handlers = _stub(target)
    session = Session(dispatcher, stop_reply=handlers.stop_reply, async_stop=handlers.pending_stop)
    woken = []
    target.notify_stops(lambda: woken.append(True))

    def packets(data: bytes) -> list[bytes]:
        return [e.payload for e in Decoder().feed(data) if e.kind is EventKind.PACKET]

    assert packets(session.receive(encode_packet(b"vCont;c:1"))) == []
    assert packets(session.poll()) == []  # it spins on
    target.wake_spinner()
    assert woken and packets(session.poll()) == [b"T05thread:1;"]
    assert packets(session.receive(b"\x03")) == []  # answered already
