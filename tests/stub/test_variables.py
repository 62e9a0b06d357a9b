"""GDB's trace state variable numbers and the tracer's (stub/variables.py), and the bytecode renumbering they need
(agent/opcodes.renumber_variables)."""

from __future__ import annotations

from kgtp_sim.agent.opcodes import assemble, decode_all, renumber_variables
from kgtp_sim.stub.variables import VariableNumbers


def numbers() -> VariableNumbers:
    """KGTP's cpu_id (2) and current_task_pid (12), gdbserver's trace_timestamp (49, uploaded as GDB's 1)."""
    return VariableNumbers({"cpu_id": 2, "current_task_pid": 12, "trace_timestamp": 49}, {"trace_timestamp": 1}, 50)


def test_a_name_of_the_tracer_is_its_variable_and_any_other_gets_a_number_above_the_tracer_s():
    table = numbers()
    assert table.known(1) == 49 and table.wire(49) == 1
    assert table.declare(2, "hits") == 50  # GDB's 2 is the user's, not KGTP's cpu_id
    assert table.declare(3, "current_task_pid") == 12 and table.declare(4, "cpu_id") == 2
    assert [table.wire(n) for n in (50, 12, 2)] == [2, 3, 4]
    assert table.declare(2, "hits") == 50  # downloaded again at the next tstart: the same number
    assert table.wire(7) is None and table.known(9) is None
    assert table.tracer(9) == 51 and table.wire(51) == 9  # used before any QTDV named it
    assert table.declare(9, "late") == 51
    assert table.uploaded([2, 12, 7, 49, 50]) == [(2, 4), (12, 3), (49, 1), (50, 2)]


def test_a_number_gdb_gives_to_another_name_moves_to_it():
    table = numbers()
    table.declare(2, "hits")
    assert table.declare(2, "cpu_id") == 2  # a new GDB numbered differently
    assert table.wire(50) is None and table.wire(2) == 2


def test_renumbering_touches_the_variable_operands_alone():
    code = assemble("getv 2; const16 2; add; setv 2; pop; tracev 3; const8 2; if_goto 15; end")
    out = renumber_variables(code, {2: 50, 3: 12}.get)
    names = [(i.name, i.operands) for i in decode_all(out)]
    assert names == [("getv", (50,)), ("const16", (2,)), ("add", ()), ("setv", (50,)), ("pop", ()),
                     ("tracev", (12,)), ("const8", (2,)), ("if_goto", (15,)), ("end", ())]
    assert len(out) == len(code)


def test_bytecode_that_does_not_decode_is_left_for_the_verifier():
    bad = bytes([0x2C, 0x00])  # getv cut short
    assert renumber_variables(bad, lambda n: n + 1) == bad
