"""Breakpoint conditions and commands the gdbserver role's target runs at a hit (stub/conditions.py, the step over a
breakpoint GDB is not to hear of in stub/process.py, the `Z` of stub/run.py's ConditionalBreakpointHandlers), at the
packet level: the process target behind the shared handlers, tests/programs/conditions.c (not PIE, f(i) at its
symbol, i in %rdi there) on the machine, without GDB.

Conditions are bytecode as GDB compiles them: `reg 5` is %rdi in GDB's amd64 numbering."""

from __future__ import annotations

import pytest

from kgtp_sim.machine import MachineError
from kgtp_sim.programs import install_program
from kgtp_sim.rsp.dispatch import Dispatcher
from kgtp_sim.stub.core import TargetHandlers
from kgtp_sim.stub.process import ProcessTarget
from kgtp_sim.stub.target import BreakpointType

from ..programs import compile_program
from .processes import next_stop, started_machine, symbol

INT3 = 0xCC


@pytest.fixture(scope="module")
def machine():
    yield from started_machine(cpus=2)


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    return compile_program("conditions", "glibc-static", tmp_path_factory.mktemp("conditions"))


def _rdi_is(value: int) -> bytes:
    """`$rdi == value` as GDB compiles it: reg 5, const16, equal, end."""
    code = bytes([0x26, 0, 5, 0x23]) + value.to_bytes(2, "big") + bytes([0x13, 0x27])
    return b"X%x,%s" % (len(code), code.hex().encode())


#: 0 (a false condition), 1 (a true one); `reg 5, reg 5, div_unsigned, end` errs only when %rdi is 0
FALSE, TRUE = b"X3,220027", b"X3,220127"


def _stub(machine, program, *args: str):
    inside = install_program(machine, program)
    del machine.written[:]
    target = ProcessTarget(machine.ptrace.spawn(inside, [inside, *args]), exec_path=inside)
    handlers = TargetHandlers(target)
    dispatcher = Dispatcher(handlers.families)
    return dispatcher, handlers, target


def _wait(handlers, target) -> bytes:
    """The stop reply of a `c` answered later, as the server polls for it when the machine hears of a stop."""
    return next_stop(target.machine, handlers.pending_stop)


def _continue(dispatcher, handlers, target) -> bytes:
    assert dispatcher.dispatch(b"vCont;c") is not None
    return _wait(handlers, target)


def _on_from(dispatcher, handlers, target, insert: bytes, thread: int | None = None) -> bytes:
    """What GDB does to go on from its breakpoint, where `thread` stopped: out, a step of that thread, in again
    (`insert`, with the conditions it has now), continue; the next stop reply."""
    address = insert.split(b",")[1]
    assert dispatcher.dispatch(b"z0,%s,1" % address) == b"OK"
    assert dispatcher.dispatch(b"vCont;s:%x" % (thread or target.pid)) is not None
    assert _wait(handlers, target).startswith(b"T05")
    assert dispatcher.dispatch(insert) == b"OK"
    return _continue(dispatcher, handlers, target)


def _rdi(target, thread: int | None = None) -> int:
    return target.read_registers(thread or target.pid)["rdi"]


def test_conditions_are_announced_and_only_a_true_one_stops(machine, program):
    dispatcher, handlers, target = _stub(machine, program)
    features = dispatcher.dispatch(b"qSupported").split(b";")
    assert b"ConditionalBreakpoints+" in features and b"BreakpointCommands+" in features
    f = symbol(program, "f")
    assert dispatcher.dispatch(b"Z0,%x,1;%s" % (f, _rdi_is(500))) == b"OK"
    reply = _continue(dispatcher, handlers, target)
    assert reply.startswith(b"T05swbreak:;"), reply
    assert _rdi(target) == 500 and target.read_registers(target.pid)["rip"] == f
    assert target.silent_hits == 499  # f(1) .. f(499) went on without a stop reply
    # GDB sends the breakpoint again with its new condition list: it replaces the old one (two conditions: either)
    reply = _on_from(dispatcher, handlers, target, b"Z0,%x,1;%s%s" % (f, _rdi_is(3), _rdi_is(700)))
    assert reply.startswith(b"T05swbreak:;") and _rdi(target) == 700, reply
    assert target.silent_hits == 499 + 199  # 501 .. 699
    # no condition any more: every hit stops
    reply = _on_from(dispatcher, handlers, target, b"Z0,%x,1" % f)
    assert reply.startswith(b"T05swbreak:;") and _rdi(target) == 701, reply
    assert target.silent_hits == 499 + 199
    assert dispatcher.dispatch(b"z0,%x,1" % f) == b"OK"
    assert _continue(dispatcher, handlers, target) == b"W00"
    assert bytes(machine.written) == b"sum 500500\n"


def test_a_bad_expression_or_option_is_refused_and_nothing_is_inserted(machine, program):
    dispatcher, handlers, target = _stub(machine, program)
    f = symbol(program, "f")
    before = target.tracee.read_memory(f, 1)
    for packet in (b"Z0,%x,1;X1,27" % f,          # `end` with nothing on the stack: a condition needs a value
                   b"Z0,%x,1;X1,ff" % f,          # no such opcode
                   b"Z0,%x,1;X3,2201" % f,        # shorter than it says
                   b"Z0,%x,1;Y3,220127" % f,      # no such option
                   b"Z0,%x,1;%s;cmds:1,X1,ff" % (f, TRUE),  # a bad command
                   b"Z0,%x,1;cmds:0,%s" % (f, _printf(rb"f %d\q", 5))):  # an escape gdbserver's printf refuses
        reply = dispatcher.dispatch(packet)
        assert reply.startswith(b"E"), (packet, reply)
        assert not target._wanted and target.tracee.read_memory(f, 1) == before, packet
    # a breakpoint already there stays as it was, its condition too
    assert dispatcher.dispatch(b"Z0,%x,1;%s" % (f, _rdi_is(2))) == b"OK"
    assert dispatcher.dispatch(b"Z0,%x,1;X1,ff" % f).startswith(b"E")
    reply = _continue(dispatcher, handlers, target)
    assert reply.startswith(b"T05swbreak:;") and _rdi(target) == 2, reply
    dispatcher.dispatch(b"k")


def test_a_condition_that_cannot_be_evaluated_stops(machine, program):
    """gdbserver's gdb_condition_true_at_breakpoint: an error counts as true (the user sees the stop)."""
    dispatcher, handlers, target = _stub(machine, program)
    f = symbol(program, "f")
    unreadable = bytes([0x22, 0, 0x18, 0x27])  # const8 0, ref64 (a read at address 0), end
    assert dispatcher.dispatch(b"Z0,%x,1;%s;X%x,%s" % (f, FALSE, len(unreadable), unreadable.hex().encode())) == b"OK"
    reply = _continue(dispatcher, handlers, target)
    assert reply.startswith(b"T05swbreak:;") and _rdi(target) == 1, reply
    assert target.silent_hits == 0
    dispatcher.dispatch(b"k")


def test_threads_hitting_one_conditional_breakpoint_at_once(machine, program):
    """Four threads run the loop on two CPUs: the breakpoint stops each only at its own f(500), the 3996 other hits
    go on unreported, each stepped over the breakpoint while the others are stopped (none runs past it unseen)."""
    dispatcher, handlers, target = _stub(machine, program, "4")
    f = symbol(program, "f")
    insert = b"Z0,%x,1;%s" % (f, _rdi_is(500))
    assert dispatcher.dispatch(insert) == b"OK"
    stops: list[tuple[int, int]] = []
    reply = _continue(dispatcher, handlers, target)
    while reply.startswith(b"T05swbreak:;"):
        thread = int(reply.split(b"thread:")[1].rstrip(b";"), 16)
        stops.append((thread, _rdi(target, thread)))
        reply = _on_from(dispatcher, handlers, target, insert, thread)
    assert reply == b"W00", reply
    assert len(stops) == 4 and {value for _thread, value in stops} == {500}, stops
    assert len({thread for thread, _value in stops}) == 4, stops
    assert bytes(machine.written) == b"sum 2002000\n"


def _joining(target) -> None:
    """Main, stopped with the others, stopped again in pthread_join's futex: the hit may come while main is still
    on its way there from pthread_create (a new thread runs at once on the other CPU), so main alone goes on, and
    is stopped again (quietly), until a stop finds it in the futex; the other threads stay where they are."""
    main = target.threads_by_tid[target.pid].tracee
    ptrace = target.machine.ptrace
    while main.registers()["orig_rax"] != 202:
        serial = main.resume()
        try:
            ptrace.wait(main.pid, serial, timeout=0.05)  # no stop comes: it runs on, or sleeps in the futex
        except MachineError:
            pass
        if main.stop is None:
            serial = ptrace.serial
            main.interrupt(quiet=True)
            assert ptrace.wait(main.pid, serial) is not None


def test_a_thread_gdb_left_stopped_is_not_stepped_over_its_breakpoint(machine, program):
    """A thread waits at the breakpoint, its hit one GDB is not to hear of (as `_classify` leaves a thread met at a
    false hit while another's event stopped everyone), and GDB resumes another thread only: the waiting one stays
    where it is, as gdbserver's need_step_over_p leaves a thread GDB did not resume. Here GDB steps the main thread,
    waiting in pthread_join's futex: its step does not end, the step-over stops it quietly to step the other past
    the breakpoint, and then went on with that one (continued, with no breakpoint in memory while the step lasts)."""
    dispatcher, handlers, target = _stub(machine, program, "2")
    f = symbol(program, "f")
    assert dispatcher.dispatch(b"Z0,%x,1;%s" % (f, _rdi_is(500))) == b"OK"
    reply = _continue(dispatcher, handlers, target)
    assert reply.startswith(b"T05swbreak:;"), reply
    waiting = target.threads_by_tid[int(reply.split(b"thread:")[1].rstrip(b";"), 16)]
    _joining(target)
    assert target.read_registers(target.pid)["orig_rax"] == 202  # main: in futex(), joining
    waiting.step_over = (BreakpointType.SOFTWARE, f)
    assert dispatcher.dispatch(b"vCont;s:%x" % target.pid) is not None
    ptrace = target.machine.ptrace
    for _ in range(5):  # the server's polls as the machine hears of stops
        serial = ptrace.serial
        assert handlers.pending_stop() is None
        try:
            ptrace.wait_serial(serial, 0.5)
        except MachineError:
            pass
    assert waiting.after is None and waiting.tracee.pc() == f and waiting.step_over is not None
    dispatcher.dispatch(b"k")


def _printf(text: bytes, register: int) -> bytes:
    """`printf "<text>", $<register>` as GDB compiles a dprintf's (ax-gdb.c: gen_printf): the argument, the function
    and the channel (0, 0), then printf with its argument count and the format as the user typed it (its C escapes
    not read: breakpoint.c's parse_cmd_to_aexpr hands gen_printf the source text), NUL-terminated; `end`."""
    code = (bytes([0x26, 0, register, 0x22, 0, 0x22, 0, 0x34, 1]) + (len(text) + 1).to_bytes(2, "big") + text
            + bytes([0, 0x27]))
    return b"X%x,%s" % (len(code), code.hex().encode())


def test_a_commands_format_reads_c_escapes_as_gdbservers_printf(machine, program):
    """GDB sends `dprintf f,"f\\t%d\\n"` with its escapes as typed; gdbserver's ax_printf reads them (format.cc)."""
    dispatcher, handlers, target = _stub(machine, program)
    f = symbol(program, "f")
    command = _printf(rb'f\t%d \"\\\n', 5)
    assert dispatcher.dispatch(b"Z0,%x,1;cmds:0,%s" % (f, command)) == b"OK"
    assert _continue(dispatcher, handlers, target) == b"W00"
    lines = bytes(machine.written).decode().splitlines()
    assert lines == [f'f\t{i} "\\' for i in range(1, 1001)] + ["sum 500500"]


def test_commands_run_at_each_hit_and_nothing_is_reported(machine, program):
    """A breakpoint with commands (GDB's dprintf with `set dprintf-style agent`): its printf at every hit, on the
    program's standard output as gdbserver's on its own, and no stop."""
    dispatcher, handlers, target = _stub(machine, program)
    f = symbol(program, "f")
    # printf "f %d\n", $rdi as GDB compiles it: the argument (reg 5), the function and the channel (0, 0), then
    # printf with its argument count and format
    text = b"f %d\n\0"
    code = bytes([0x26, 0, 5, 0x22, 0, 0x22, 0, 0x34, 1]) + len(text).to_bytes(2, "big") + text + bytes([0x27])
    assert dispatcher.dispatch(b"Z0,%x,1;cmds:0,X%x,%s" % (f, len(code), code.hex().encode())) == b"OK"
    assert _continue(dispatcher, handlers, target) == b"W00"
    assert target.silent_hits == 1000
    lines = bytes(machine.written).decode().splitlines()
    assert lines == [f"f {i}" for i in range(1, 1001)] + ["sum 500500"]
