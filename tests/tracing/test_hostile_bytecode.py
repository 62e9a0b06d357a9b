"""Hostile agent bytecode through the tracer, for each engine: endless loops, unmapped and huge ranges, deep
stacks, division by zero, variables that do not exist, undecodable code.

Whatever a tracepoint's bytecode does, the kernel must go on computing exactly as without it: every run below
drives `kgtp_bench_loop(n)` through the traced site with `machine.call` (deterministic, no timer), then again
after the run, and checks that `kgtp_counter` advanced by exactly the calls made, that `kgtp_bench_loop` returned
`n`, and that the site's bytes are the image's again once the probe is gone. Bytecode the verifier can refuse
is refused at tstart (no probe goes in); faults at hit time record `terror` (KGTP's `$ignore_error` is about
tstart, never about hits), or, for a collection that only traces memory, lose that block while the run goes on.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kgtp_sim.agent.opcodes import assemble
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing.core.builtins import BUILTIN_VARIABLES
from kgtp_sim.tracing import TraceError, Tracer

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)
SITE = IMAGE.address_of("kgtp_test_function")
_, FUNC_LO, FUNC_HI = IMAGE.function_bounds(SITE)
COUNTER = IMAGE.address_of("kgtp_counter")
ENGINES = ("interp", "naive", "opt")
IGNORE_ERROR = BUILTIN_VARIABLES.by_name("ignore_error").number
UNMAPPED = 0x10  # the zero page: never mapped in the simulated machine
# first number after KGTP's special variables (GDB numbers user variables from there)
USER_TSV = max(b.number for b in BUILTIN_VARIABLES) + 1
MISSING_TSV = 152  # no such variable

# The condition `counter1 is odd` (counter1 is the first argument, %rdi = register 5).
ODD = "reg 5; const8 1; bit_and"
# 0: const8 1; 2: if_goto 0  -> loops forever (the stack stays balanced: the verifier has no reason to refuse)
FOREVER = "const8 1; if_goto 0; const8 1; end"


def x_action(code: bytes) -> t.EvalExpression:
    return t.EvalExpression(code)


@dataclass
class Outcome:
    refused: TraceError | None
    status: t.TraceStatus
    frames: list
    hits: tuple[int, int] | None


def traced_run(engine: str, *, condition: str | bytes | None = None, actions=(), calls: int = 20,
               variables: tuple[tuple[int, int], ...] = (), ignore_error: bool = False) -> Outcome:
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    tracer = Tracer(machine, engine)
    for number, value in variables:
        tracer.definitions.define_variable(t.DefineTraceVariable(number=number, value=value, name=f"v{number}"))
    if ignore_error:
        tracer.definitions.define_variable(
            t.DefineTraceVariable(number=IGNORE_ERROR, value=1, builtin=True, name="ignore_error"))
    cond = assemble(condition) if isinstance(condition, str) else condition
    tracer.definitions.define(t.DefineTracepoint(number=1, address=SITE, condition=cond, more=bool(actions)))
    for action in actions:
        tracer.definitions.add_actions(t.TracepointActions(number=1, address=SITE, actions=(action,)))
    before = machine.read_symbol("kgtp_counter")
    refused = None
    try:
        tracer.start()
    except TraceError as error:
        refused = error
    if refused is not None:
        assert not tracer.running and not tracer.probes.installed
    assert machine.call("kgtp_bench_loop", calls, max_instructions=50_000_000) == calls
    status, frames, hits = tracer.status(), tracer.frames(), tracer.location_status(1, SITE)
    tracer.stop(t.StopReason.STOP_COMMAND)
    # after the run the kernel computes exactly as it did before any probe went in
    assert machine.call("kgtp_bench_loop", calls) == calls
    assert machine.read_symbol("kgtp_counter") == before + 2 * calls
    assert machine.read_memory(FUNC_LO, FUNC_HI - FUNC_LO) == IMAGE.read_code(FUNC_LO, FUNC_HI - FUNC_LO)
    assert not machine.stats().state.startswith("crashed")
    return Outcome(refused, status, frames, hits)


def stopped_by_error(outcome: Outcome, text: str) -> None:
    assert outcome.refused is None
    assert not outcome.status.running and outcome.status.stop_reason is t.StopReason.ERROR, outcome.status
    assert text in outcome.status.stop_note and outcome.status.stopping_tracepoint == 1, outcome.status.stop_note


# ---- endless loops: the loop budget ends them ---------------------------------------------------------------


FAST_PATH_SWALLOWS_LOOP_ERRORS = (
    "bug: the opt engine's false-condition fast path (tracing/patching/fastpath.py can_fail) only checks agent_ctx.error "
    "after conditions with div/rem/ref ops; a loop-budget error (backward jump) is taken as 'false', the hit "
    "is silently dropped, and the error stays in agent_ctx for the next tracepoint to report as its own")


@pytest.mark.parametrize("engine", ["interp", "naive", "opt"])
def test_endless_loop_in_a_condition_stops_the_run_with_terror(engine):
    outcome = traced_run(engine, condition=FOREVER, actions=[t.CollectRegisters(0xFFFF)])
    stopped_by_error(outcome, "loop budget exhausted")
    assert "if_goto 0" in outcome.status.stop_note  # names the backward jump, as the interpreter reports it
    assert outcome.frames == []


@pytest.mark.parametrize("engine", ["interp", "naive", "opt"])
def test_an_error_is_reported_on_the_tracepoint_that_failed(engine):
    # tracepoint 1 loops forever in its condition; tracepoint 2 (on the caller) has a condition that can fail
    # (a division) but never does. The run stops with tracepoint 1's error, never tracepoint 2's.
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    tracer = Tracer(machine, engine)
    caller = IMAGE.address_of("kgtp_bench_loop")
    tracer.definitions.define(t.DefineTracepoint(number=1, address=SITE, condition=assemble(FOREVER)))
    tracer.definitions.define(t.DefineTracepoint(
        number=2, address=caller, condition=assemble("reg 5; const8 1; add; const8 1; div_unsigned; end")))
    tracer.start()
    for _ in range(3):
        assert machine.call("kgtp_bench_loop", 3) == 3
    status = tracer.status()
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert status.stop_reason is t.StopReason.ERROR and status.stopping_tracepoint == 1, status
    assert status.stop_note.startswith("tracepoint 1: loop budget exhausted"), status.stop_note


@pytest.mark.parametrize("engine", ENGINES)
def test_endless_loop_in_an_action_stops_the_run_with_terror(engine):
    outcome = traced_run(engine, actions=[t.CollectRegisters(0xFFFF), x_action(assemble(FOREVER))])
    stopped_by_error(outcome, "loop budget exhausted")
    assert outcome.frames == []  # the failing hit records nothing, and it was the first


@pytest.mark.parametrize("engine", ENGINES)
def test_endless_loop_under_ignore_error_still_stops_the_run(engine):
    # KGTP's $ignore_error lets tstart leave out tracepoints it cannot install; an error at a hit is terror
    outcome = traced_run(engine, condition=FOREVER, calls=6, ignore_error=True)
    stopped_by_error(outcome, "loop budget exhausted")
    assert outcome.frames == []


# A loop whose trip count depends on the hit: counter1 % 8 backward jumps, then `counter1 is odd`.
BOUNDED = assemble(
    "reg 5; const8 8; rem_unsigned; dup; if_goto 0xd; goto 0x14; "  # 0..12: k = counter1 % 8; k == 0 skips
    "const8 1; sub; dup; if_goto 0xd; "  # 13..19: k -= 1 until 0 (k backward jumps)
    f"pop; {ODD}; end"  # 20..
)


@pytest.mark.parametrize("engine", ENGINES)
def test_bounded_loops_give_the_same_frames_in_every_engine(engine):
    outcome = traced_run(engine, condition=BOUNDED, actions=[t.CollectMemory(-1, COUNTER, 4)], calls=40)
    assert outcome.refused is None and outcome.status.running, outcome.status
    assert len(outcome.frames) == 20  # every odd counter1, whatever the loop did first
    values = [int.from_bytes(f.blocks[0].data, "little") for f in outcome.frames]
    assert values == list(range(values[0], values[0] + 40, 2))


LOOP_9 = assemble("const8 9; const8 1; sub; dup; if_goto 2; const8 1; add; end")  # 8 backward jumps, then true


@pytest.mark.parametrize("engine", [
    "interp",
    "naive",
    "opt",
])
def test_a_short_loop_never_exhausts_the_budget_however_many_hits(engine):
    outcome = traced_run(engine, condition=LOOP_9, calls=8200)  # 8 x 8200 > 65536 backward jumps in all
    assert outcome.status.running, outcome.status.stop_note
    assert len(outcome.frames) == 8200


LOOP_12000 = assemble("const16 0x2ee0; const8 1; sub; dup; if_goto 3; const8 1; add; end")  # 11999 jumps


@pytest.mark.parametrize("engine", [
    "naive",
    "opt",
])
def test_a_long_loop_has_the_same_outcome_in_every_engine(engine):
    reference = traced_run("interp", condition=LOOP_12000, calls=2)
    outcome = traced_run(engine, condition=LOOP_12000, calls=2)
    assert (outcome.status.stop_reason, len(outcome.frames)) == (reference.status.stop_reason, len(reference.frames))


# ---- memory that cannot be traced ---------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_tracing_unmapped_memory_loses_that_block_and_the_run_goes_on(engine):
    trace_unmapped = assemble(f"const8 {UNMAPPED:#x}; const8 8; trace; end")
    outcome = traced_run(engine, actions=[t.CollectMemory(-1, COUNTER, 4), x_action(trace_unmapped),
                                          t.CollectMemory(-1, UNMAPPED, 8)], calls=12)
    assert outcome.refused is None and outcome.status.running, outcome.status
    assert len(outcome.frames) == 12
    for frame in outcome.frames:
        assert frame.memory_ranges() == [(COUNTER, 4)], frame  # the unmapped ranges are simply absent


@pytest.mark.parametrize("engine", ENGINES)
def test_reading_unmapped_memory_in_an_action_is_terror(engine):
    outcome = traced_run(engine, actions=[x_action(assemble(f"const8 {UNMAPPED:#x}; ref64; const8 8; trace; end"))])
    stopped_by_error(outcome, "memory fault")


@pytest.mark.parametrize("engine", ENGINES)
def test_huge_ranges_are_clamped_or_refused_never_fatal(engine):
    # A memory action asking for 4 GiB is clamped to one block of 0xffff bytes; a range running off the end of
    # the kernel's mapped data is not collected at all.
    end = IMAGE.address_of("_end")
    page_end = (end | 0xFFF) + 1
    outcome = traced_run(engine, actions=[t.CollectMemory(-1, COUNTER, 0xFFFFFFFF),
                                          t.CollectMemory(-1, page_end - 8, 0x100)], calls=3)
    assert outcome.refused is None and outcome.status.running, outcome.status
    assert len(outcome.frames) == 3
    for frame in outcome.frames:
        assert frame.memory_ranges() == [(COUNTER, 0xFFFF)]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_trace_of_four_gib_from_bytecode_never_harms_the_kernel(engine):
    # `trace` of 4 GiB from kgtp_counter: blocks of 0xffff are recorded until the frame has no room or the
    # range runs off the kernel's data; either way at most terror, and the kernel is untouched (traced_run).
    outcome = traced_run(engine, actions=[x_action(assemble(f"const64 {COUNTER:#x}; const32 0xffffffff; trace; end"))],
                         calls=3)
    assert outcome.refused is None
    if outcome.status.stop_reason is t.StopReason.ERROR:
        assert "trace buffer full" in outcome.status.stop_note or "memory fault" in outcome.status.stop_note
    else:
        assert outcome.status.running and len(outcome.frames) == 3
        assert all(length <= 0xFFFF for f in outcome.frames for _, length in f.memory_ranges())


@pytest.mark.parametrize("engine", ["naive", "opt"])
def test_a_16k_trace_from_bytecode_is_collected_as_by_the_interpreter(engine):
    code = assemble(f"const64 {COUNTER:#x}; const16 0x4000; trace; end")
    reference = traced_run("interp", actions=[x_action(code)], calls=3)
    assert reference.status.running and [f.memory_ranges() for f in reference.frames] == [[(COUNTER, 0x4000)]] * 3
    outcome = traced_run(engine, actions=[x_action(code)], calls=3)
    assert outcome.status.running, outcome.status.stop_note
    assert [f.blocks for f in outcome.frames] == [f.blocks for f in reference.frames]


# ---- arithmetic faults ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("code, text", [
    ("reg 5; const8 0; div_signed; end", "division by zero"),
    ("reg 5; const8 0; rem_unsigned; end", "division by zero"),
    ("const64 0x8000000000000000; const8 0xff; ext 8; div_signed; end", "division overflow"),
])
def test_division_faults_in_an_action_stop_the_run(engine, code, text):
    outcome = traced_run(engine, actions=[t.CollectRegisters(0xFFFF), x_action(assemble(code))])
    stopped_by_error(outcome, text)
    assert outcome.frames == []


@pytest.mark.parametrize("engine", ENGINES)
def test_division_by_zero_under_ignore_error_stops_at_the_first_failing_hit(engine):
    outcome = traced_run(engine, condition="reg 5; const8 1; bit_and; dup; if_goto 0xd; const8 0; div_signed; end",
                         calls=10, ignore_error=True)
    # odd counter1: true without dividing; even: divides by zero -> terror at the first even call
    stopped_by_error(outcome, "division by zero")
    assert len(outcome.frames) <= 1


# ---- the verifier refuses at tstart: nothing is installed, the kernel never sees the code ------------------


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("where", ["condition", "action"])
@pytest.mark.parametrize("code, text", [
    (f"getv {MISSING_TSV:#x}; end", "(getv 152): trace state variable 152 does not exist"),
    (f"const8 1; setv {MISSING_TSV:#x}; end", "(setv 152): trace state variable 152 does not exist"),
    (f"tracev {MISSING_TSV:#x}; const8 1; end", "(tracev 152): trace state variable 152 does not exist"),
    ("const8 1; " * 65 + "end", "depth 65 exceeds the limit of 64"),
    ("const8 1; goto 0x40; end", "jump target 64 is outside the expression"),
    ("const8 1; goto 1; end", "jump target 1 is not on an instruction boundary"),
    ("const8 1; float; end", "floating-point opcode float is unsupported"),
    (b"\x22\x01\xff\x27", "unknown opcode 0xff"),
    (b"\x24\x00\x01", "truncated const32"),
    (b"\x22\x01" * 0x8001, "expression of 65538 bytes, the limit is 65536"),
], ids=["getv", "setv", "tracev", "depth", "goto-out", "goto-mid", "float", "opcode", "truncated", "length"])
def test_unverifiable_bytecode_is_refused_at_tstart(engine, where, code, text):
    bytecode = assemble(code) if isinstance(code, str) else code
    if where == "condition":
        outcome = traced_run(engine, condition=bytecode, calls=5)
    else:
        outcome = traced_run(engine, actions=[x_action(bytecode)], calls=5)
    assert outcome.refused is not None, outcome.status
    message = str(outcome.refused)
    assert message.startswith(f"tracepoint 1 at {SITE:#x}: {where} rejected: bad agent expression"), message
    assert text in message, message
    assert outcome.frames == [] and not outcome.status.running


@pytest.mark.parametrize("engine", ENGINES)
def test_variables_that_exist_are_read_and_written(engine):
    # the counterpart of the refusals above: a defined user variable is fine, and counts every hit
    code = assemble(f"getv {USER_TSV:#x}; const8 1; add; setv {USER_TSV:#x}; pop; const8 1; end")
    machine_calls = 25
    outcome = traced_run(engine, condition=code, variables=((USER_TSV, 100),), calls=machine_calls)
    assert outcome.status.running and len(outcome.frames) == machine_calls


@pytest.mark.parametrize("engine", ENGINES)
def test_the_deepest_stack_allowed_computes_the_right_value(engine):
    # 64 values on the stack (the hard limit), summed back down: the condition is `64 == 64`
    code = assemble("const8 1; " * 64 + "add; " * 63 + "const8 0x40; equal; end")
    outcome = traced_run(engine, condition=code, actions=[t.CollectRegisters(0xFFFF)], calls=7)
    assert outcome.refused is None and outcome.status.running, outcome
    assert len(outcome.frames) == 7
    assert [f.registers["rdi"] for f in outcome.frames] == list(range(1, 8))
