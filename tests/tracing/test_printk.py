"""KGTP's direct output, `$dump_stack`, `$enable`/`$disable` and `$current`, driving the tracer directly under
every engine (`kgtp_sim/tracing/kgtp/printk.py`).

Each run calls kernel functions with `machine.call` (deterministic, no timer): `kgtp_bench_loop(n)` calls
`kgtp_test_function(i + 1, i)` n times. The printed lines are compared with what KGTP's gtp_action_printk prints
for the same bytes, written out here one by one.
"""

from __future__ import annotations

import re
import struct

import pytest

from kgtp_sim.agent.opcodes import assemble
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.rsp.packets import trace as t
from kgtp_sim.tracing import TraceError, Tracer
from kgtp_sim.tracing.core.builtins import BUILTIN_VARIABLES
from kgtp_sim.tracing.core.frames import CompactRegisters, MemoryBlock, RegisterBlock, TsvBlock
from kgtp_sim.tracing.kgtp.printk import PrintkError, expression_names, render, split_items

from ..conftest import VMLINUX

IMAGE = KernelImage.load(VMLINUX)
SITE = IMAGE.address_of("kgtp_test_function")
LOOP = IMAGE.address_of("kgtp_bench_loop")
ENGINES = ("interp", "naive", "opt")
N = {b.name: b.number for b in BUILTIN_VARIABLES}
USER = len(BUILTIN_VARIABLES) + 1  # the first user variable's number, as GDB gives it
#: the scratch buffer every format test prints from: a byte, a short, an int and a long with high bits set,
#: then a string and bytes past its NUL
BUFFER = b"\xff\x80\x7f\x00\x01\x02\x03\x04" + b"kgtp-sim\x00" + b"\xee" * 7


def _x(code: str) -> t.EvalExpression:
    return t.EvalExpression(assemble(code))


def _setv(name: str, value: int) -> t.EvalExpression:
    return _x(f"const8 {value:#x}; setv {N[name]:#x}; end")


def _tracer(engine: str) -> tuple[Machine, Tracer]:
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    return machine, Tracer(machine, engine)


def _define(tracer: Tracer, number: int, address: int, actions, lines=(), condition: bytes | None = None) -> None:
    tracer.definitions.define(t.DefineTracepoint(number=number, address=address, condition=condition, more=True))
    tracer.definitions.add_actions(t.TracepointActions(number=number, address=address, actions=tuple(actions)))
    for line in lines:
        tracer.definitions.add_source(t.TracepointSource(number, address, "cmd", 0, len(line), line))


def _user_variable(tracer: Tracer, name: str = "c") -> None:
    tracer.definitions.define_variable(t.DefineTraceVariable(number=USER, value=0, name=name))


def _printed(machine: Machine) -> list[str]:
    return [line for line in machine.console_text().splitlines() if "gtp " in line]


# ---- the value's layout ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt, data, text", [
    # A: 1, 2, 4, 8 bytes as U; else as B (more than 8 bytes are cut to 8 first, so they print as U)
    (0, b"\x05", b"5"), (0, b"\xff", b"4294967295"), (0, b"\x01\x02\x03", b"010203"),
    (0, b"kgtp-sim\x00abc", str(int.from_bytes(b"kgtp-sim", "little")).encode()),
    # D: signed, a char and a short promoted to int
    (1, b"\xff", b"-1"), (1, b"\xff\x80", b"-32513"), (1, b"\xff\xff\xff\xff", b"-1"),
    (1, b"\xfe" + b"\xff" * 7, b"-2"),
    # U: the signed char / short promoted to int, printed as unsigned int
    (2, b"\x80", b"4294967168"), (2, b"\xff\x80", b"4294934783"), (2, b"\xff\xff\xff\xff", b"4294967295"),
    (2, b"\xff" * 8, b"18446744073709551615"),
    # X
    (3, b"\x80", b"0xffffff80"), (3, b"\x34\x12", b"0x1234"), (3, b"\xff\x80\x7f\x00", b"0x7f80ff"),
    (3, b"\x01" + bytes(7), b"0x1"),
    # S: up to the NUL
    (4, b"kgtp\x00sim", b"kgtp"), (4, b"abc", b"abc"), (4, b"\x00", b""),
    # B: each byte as %02x of a signed char
    (5, b"\x01\x7f\x80\xff", b"017fffffff80ffffffff"), (5, b"", b""),
])
def test_each_format_prints_what_kgtp_prints(fmt, data, text):
    assert render(fmt, data) == text


def test_a_value_prints_at_most_8_bytes_and_a_string_255():
    assert render(4, b"x" * 300) == b"x" * 255
    assert render(5, b"\x01" * 300) == b"01" * 255
    assert render(3, bytes(range(1, 17))) == b"0x807060504030201"


@pytest.mark.parametrize("fmt, data", [(1, b"abc"), (2, b"abcde"), (3, b"abcdefg"), (6, b"a"), (99, b"ab")])
def test_what_kgtp_cannot_print_is_an_error(fmt, data):
    with pytest.raises(PrintkError):
        render(fmt, data)


def test_collect_items_split_at_top_level_commas():
    assert split_items(' a, f(b, c), "x,y" , s[1,2] ') == ["a", "f(b, c)", '"x,y"', "s[1,2]"]


def test_names_follow_gdbs_x_actions():
    tp = t.Tracepoint(1, SITE, actions=[t.CollectRegisters(1), t.CollectMemory(-1, 0, 4)] + [
        t.EvalExpression(b"\x27")] * 6)
    for line in ("teval $printk_level=0", "collect $regs, kgtp_counter, $c, $rax", "collect/s name",
                 "collect p->comm, $_sdata", "while-stepping 2", "collect $c", "end", "teval $printk_tmp=1, $c=2"):
        tp.sources.append(t.TracepointSource(1, SITE, "cmd", 0, len(line), line))
    names = expression_names(tp, IMAGE)
    assert names.by_action == ("$printk_level=0", "$c", "name", "p->comm", "$printk_tmp=1", "$c=2")
    tp.actions.append(t.EvalExpression(b"\x27"))  # one more X than the text explains: KGTP's way, in turn
    assert expression_names(tp, IMAGE).in_turn == ("$c", "name", "p->comm")


# ---- direct output at the hit ------------------------------------------------------------------------------


def _format_run(engine: str, fmt: int, level: int = 4):
    machine, tracer = _tracer(engine)
    buffer = machine.alloc_data(len(BUFFER))
    machine.write_memory(buffer, BUFFER)
    _define(tracer, 1, SITE, [
        _setv("printk_level", level), _setv("printk_format", fmt),
        _x(f"const64 {buffer:#x}; trace_quick 0x1; end"),
        _x(f"const64 {buffer:#x}; trace_quick 0x2; end"),
        _x(f"const64 {buffer:#x}; const8 0x4; trace; end"),
        _x(f"const64 {buffer:#x}; trace_quick 0x8; end"),
        _x(f"const64 {buffer + 8:#x}; trace_quick 0x10; end"),
        _x(f"const8 0x0; reg 0x5; ext 0x20; sub; setv {N['printk_tmp']:#x}; tracev {N['printk_tmp']:#x}; end"),
    ], [f"teval $printk_level={level}", f"teval $printk_format={fmt}", "collect *(char *)buf",
        "collect *(short *)buf", "collect *(int *)buf, *(long *)buf", "collect *(char (*)[16])(buf + 8)",
        "collect $printk_tmp=-counter1"])
    tracer.start()
    native = [item.native is not None for item in tracer.probes.installed.values()]
    machine.call("kgtp_bench_loop", 1)
    return machine, tracer, native


#: what each collect of _format_run prints, by format (A, D, U, X, S, B)
LAYOUTS = {
    0: ["4294967295", "4294934783", "8356095", "289077004408422655", str(int.from_bytes(b"kgtp-sim", "little")),
        "18446744073709551615"],
    1: ["-1", "-32513", "8356095", "289077004408422655", str(int.from_bytes(b"kgtp-sim", "little")), "-1"],
    2: ["4294967295", "4294934783", "8356095", "289077004408422655", str(int.from_bytes(b"kgtp-sim", "little")),
        "18446744073709551615"],
    3: ["0xffffffff", "0xffff80ff", "0x7f80ff", "0x4030201007f80ff", hex(int.from_bytes(b"kgtp-sim", "little")),
        "0xffffffffffffffff"],
    4: ["\ufffd", "\ufffd\ufffd", "\ufffd\ufffd\x7f", "\ufffd\ufffd\x7f", "kgtp-sim", "\ufffd" * 8],
    5: ["ffffffff", "ffffffffffffff80", "ffffffffffffff807f00", "ffffffffffffff807f0001020304",
        "6b6774702d73696d00" + "ffffffee" * 7, "ffffffff" * 8],
}
NAMES = ["*(char *)buf", "*(short *)buf", "*(int *)buf", "*(long *)buf", "*(char (*)[16])(buf + 8)",
         "$printk_tmp=-counter1"]


@pytest.mark.parametrize("fmt", sorted(LAYOUTS))
@pytest.mark.parametrize("engine", ENGINES)
def test_collects_print_their_lines_in_every_engine(engine, fmt):
    machine, tracer, native = _format_run(engine, fmt)
    assert native == [False]  # the Python hit path, whatever the engine
    assert _printed(machine) == [f"<4>CPU0 gtp 1 {SITE:016x}:{name}={value}"
                                 for name, value in zip(NAMES, LAYOUTS[fmt])]
    assert tracer.frames() == [] and tracer.location_status(1, SITE) == (1, 0)  # printed, hit, no frame
    assert tracer.running


@pytest.mark.parametrize("engine", ENGINES)
def test_a_size_the_format_cannot_print_stops_the_run(engine):
    machine, tracer = _tracer(engine)
    _define(tracer, 1, SITE, [_setv("printk_level", 0), _setv("printk_format", 1),
                              _x(f"const64 {IMAGE.address_of('kgtp_counter'):#x}; trace_quick 0x3; end")])
    tracer.start()
    machine.call("kgtp_bench_loop", 1)
    assert not tracer.running and tracer.stop_reason is t.StopReason.ERROR
    assert tracer.stop_note == "tracepoint 1: direct output: $printk_format 1 cannot print 3 bytes"


@pytest.mark.parametrize("engine", ENGINES)
def test_a_printing_collect_records_nothing_while_the_others_record(engine):
    machine, tracer = _tracer(engine)
    _user_variable(tracer)
    counter = IMAGE.address_of("kgtp_counter")
    _define(tracer, 1, SITE, [
        t.CollectRegisters(0x3F),  # GDB sends registers and ranges first: they run at level 8
        t.CollectMemory(-1, counter, 4),
        _x(f"getv {USER:#x}; const8 0x1; add; setv {USER:#x}; tracev {USER:#x}; end"),  # level 8: recorded
        _setv("printk_level", 6),
        _x(f"const64 {counter:#x}; trace_quick 0x4; end"),  # printed
        _setv("printk_level", 8),
        _x(f"reg 0x5; ext 0x20; setv {N['printk_tmp']:#x}; tracev {N['printk_tmp']:#x}; end"),  # recorded
    ], ["collect $regs, kgtp_counter", "collect $c=$c+1", "teval $printk_level=6", "collect *&kgtp_counter",
        "teval $printk_level=8", "collect $printk_tmp=counter1"])
    tracer.start()
    machine.call("kgtp_bench_loop", 3)
    frames = tracer.frames()
    assert _printed(machine) == [f"<6>CPU0 gtp 1 {SITE:016x}:*&kgtp_counter={n}" for n in (1, 2, 3)]
    assert len(frames) == 3
    for n, frame in enumerate(frames, 1):
        kinds = [type(b) for b in frame.blocks]
        assert kinds == [CompactRegisters, MemoryBlock, TsvBlock, TsvBlock]  # nothing of the printed collect
        assert frame.tsv_values() == [(USER, n), (N["printk_tmp"], n)]
    assert tracer.location_status(1, SITE)[0] == 3


PRINTED = _x(f"reg 0x5; setv {N['printk_tmp']:#x}; tracev {N['printk_tmp']:#x}; end")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("actions, kinds", [
    ([_setv("printk_level", 0), PRINTED], []),  # rdi was there for the printed collect only
    ([_x("end"), _setv("printk_level", 0), PRINTED], [CompactRegisters]),  # `collect counter1` wants rdi
    ([_setv("printk_level", 0), PRINTED, _setv("printk_level", 8), _x(f"tracev {N['cpu_id']:#x}; end")],
     [CompactRegisters, TsvBlock]),
])
def test_registers_gdb_adds_for_printed_collects_are_not_recorded(engine, actions, kinds):
    """GDB merges the registers of every collect into one `R` action, sent first."""
    machine, tracer = _tracer(engine)
    _define(tracer, 1, SITE, [t.CollectRegisters(1 << 5), *actions])
    tracer.start()
    machine.call("kgtp_bench_loop", 2)
    assert len(_printed(machine)) == 2
    assert [[type(b) for b in f.blocks] for f in tracer.frames()] == ([kinds] * 2 if kinds else [])


@pytest.mark.parametrize("engine", ENGINES)
def test_the_level_starts_at_8_at_each_hit(engine):
    """A condition sets it at some hits only: the others record."""
    machine, tracer = _tracer(engine)
    _user_variable(tracer)
    _define(tracer, 1, SITE, [
        _x(f"reg 0x5; ext 0x20; const8 0x2; rem_signed; if_goto 0x11; const8 0x3; setv {N['printk_level']:#x}; "
           "pop; end"),
        _x(f"reg 0x5; ext 0x20; setv {N['printk_tmp']:#x}; tracev {N['printk_tmp']:#x}; end"),
    ], ["teval $printk_level = counter1 % 2 ? 8 : 3", "collect $printk_tmp=counter1"])
    tracer.start()
    machine.call("kgtp_bench_loop", 4)
    assert _printed(machine) == [f"<3>CPU0 gtp 1 {SITE:016x}:$printk_tmp=counter1={n}" for n in (2, 4)]
    assert [f.tsv_values() for f in tracer.frames()] == [[(N["printk_tmp"], n)] for n in (1, 3)]


@pytest.mark.parametrize("engine", ENGINES)
def test_without_source_text_the_line_names_what_was_traced(engine):
    machine, tracer = _tracer(engine)
    _user_variable(tracer, "hits")
    counter = IMAGE.address_of("kgtp_counter")
    _define(tracer, 1, SITE, [_setv("printk_level", 0),
                              _x(f"getv {USER:#x}; const8 0x1; add; setv {USER:#x}; tracev {USER:#x}; end"),
                              _x(f"const64 {counter:#x}; trace_quick 0x4; end")])
    tracer.start()
    machine.call("kgtp_bench_loop", 1)
    assert _printed(machine) == [f"<0>CPU0 gtp 1 {SITE:016x}:$hits=1", f"<0>CPU0 gtp 1 {SITE:016x}:*{counter:#x}@4=1"]


def test_other_tracepoints_keep_their_native_paths():
    machine, tracer = _tracer("opt")
    _define(tracer, 1, SITE, [_x(f"tracev {N['cpu_id']:#x}; end")])
    _define(tracer, 2, LOOP, [_setv("printk_level", 0), _x(f"tracev {N['cpu_id']:#x}; end")])
    tracer.start()
    kinds = {row.number: row.kind for row in tracer.probe_rows()}
    native = {key[0]: item.native is not None for key, item in tracer.probes.installed.items()}
    tracer.stop(t.StopReason.STOP_COMMAND)
    assert native == {1: True, 2: False} and kinds[1] == "jump"


@pytest.mark.parametrize("code, text", [
    ("printk_level", "while-stepping actions cannot print"),
])
def test_printing_in_while_stepping_fails_tstart(code, text):
    machine, tracer = _tracer("opt")
    tracer.definitions.define(t.DefineTracepoint(number=1, address=SITE, step_count=2, more=True))
    tracer.definitions.add_actions(t.TracepointActions(number=1, address=SITE, actions=(_setv(code, 0),),
                                                       stepping=True))
    with pytest.raises(TraceError, match=re.escape(text)):
        tracer.start()


# ---- $dump_stack ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_dump_stack_prints_the_backtrace_on_the_console(engine):
    machine, tracer = _tracer(engine)
    _define(tracer, 1, SITE, [_x(f"tracev {N['dump_stack']:#x}; end")])
    tracer.start()
    machine.call("kgtp_bench_loop", 1)
    task = machine.current_task()
    pid = int.from_bytes(machine.read_memory(task, 4), "little", signed=True)
    comm = machine.read_memory(task + 4, 16).split(b"\0")[0].decode()
    name, low, high = IMAGE.function_bounds(SITE)
    lines = machine.console_text().splitlines()
    start = lines.index(f"CPU0 gtp 1 {SITE:016x}:CPU: 0 PID: {pid} Comm: {comm} Not tainted")
    assert lines[start + 1:start + 3] == ["Call Trace:", f" [<{SITE:016x}>] kgtp_test_function+0x0/{high - low:#x}"]
    assert lines[start + 3].startswith(" [<") and "] kgtp_bench_loop+0x" in lines[start + 3]
    assert [type(b) for b in tracer.frames()[0].blocks] == [TsvBlock]  # collected: it reads 0
    assert tracer.frames()[0].tsv_values() == [(N["dump_stack"], 0)]


@pytest.mark.parametrize("engine", ENGINES)
def test_dump_stack_under_direct_output_prints_both(engine):
    machine, tracer = _tracer(engine)
    _define(tracer, 1, SITE, [_setv("printk_level", 1), _x(f"tracev {N['dump_stack']:#x}; end")],
            ["teval $printk_level=1", "collect $dump_stack"])
    tracer.start()
    machine.call("kgtp_bench_loop", 1)
    lines = machine.console_text().splitlines()
    assert lines[-1] == f"<1>CPU0 gtp 1 {SITE:016x}:$dump_stack=0"
    assert any(line.startswith(f"CPU0 gtp 1 {SITE:016x}:CPU: 0 PID:") for line in lines)
    assert tracer.frames() == []


# ---- $enable / $disable ------------------------------------------------------------------------------------------


def _on_loop_argument(n: int) -> bytes:
    return assemble(f"reg 0x5; const8 {n:#x}; equal; end")


@pytest.mark.parametrize("engine", ENGINES)
def test_one_tracepoint_disables_another_after_n_hits(engine):
    """Tracepoint 2 counts its hits in $c; tracepoint 1, at the caller, disables it once $c reached 2: its
    frames stop at 2, compiled or not."""
    machine, tracer = _tracer(engine)
    _user_variable(tracer)
    _define(tracer, 1, LOOP, [_setv("disable", 2)], condition=assemble(f"getv {USER:#x}; const8 0x2; equal; end"))
    _define(tracer, 2, SITE, [_x(f"getv {USER:#x}; const8 0x1; add; setv {USER:#x}; tracev {USER:#x}; end")])
    tracer.start()
    target = tracer.probes.installed[(2, SITE)]
    assert (target.native is not None) == (engine != "interp")
    for _ in range(3):
        machine.call("kgtp_bench_loop", 2)
    frames = tracer.frames()
    assert [f.tsv_values() for f in frames if f.tracepoint == 2] == [[(USER, 1)], [(USER, 2)]]
    assert [f.tracepoint for f in frames] == [2, 2, 1, 1]
    assert not tracer.is_armed((2, SITE)) and tracer.running
    assert machine.read_memory(SITE, 8) == IMAGE.read_code(SITE, 8)  # the probe is out of the kernel
    assert not tracer.definitions.tracepoints[(2, SITE)].enabled  # what a reconnecting GDB is told (qTfP)
    assert tracer.location_status(2, SITE) == (2, target.usage)


@pytest.mark.parametrize("engine", ENGINES)
def test_enable_switches_a_disabled_tracepoint_back_on(engine):
    """kgtp_bench_loop(2) disables tracepoint 1, kgtp_bench_loop(3) enables it again; both setters share one
    address (one int3 in Python), the target runs compiled in the compiled engines before and after."""
    machine, tracer = _tracer(engine)
    _define(tracer, 1, SITE, [_x(f"reg 0x5; ext 0x20; setv {N['printk_tmp']:#x}; tracev {N['printk_tmp']:#x}; end")])
    _define(tracer, 2, LOOP, [_setv("disable", 1)], condition=_on_loop_argument(2))
    _define(tracer, 3, LOOP, [_setv("enable", 1)], condition=_on_loop_argument(3))
    tracer.start()
    for n in (1, 2, 4, 3, 1):
        machine.call("kgtp_bench_loop", n)
    target = tracer.probes.installed[(1, SITE)]
    assert (target.native is not None) == (engine != "interp")
    counters = [f.tsv_values()[0][1] for f in tracer.frames() if f.tracepoint == 1]
    assert counters == [1, 1, 2, 3, 1]  # kgtp_bench_loop(1), then (3) and (1): nothing of (2) and (4)
    assert tracer.location_status(1, SITE)[0] == 5  # the counters go on across the switch
    assert tracer.definitions.tracepoints[(1, SITE)].enabled


@pytest.mark.parametrize("engine", ENGINES)
def test_switching_a_tracepoint_off_and_on_again_compiles_nothing_new(engine):
    """A compiled location switched on again in the same run goes back to the detour it had (KGTP users switch
    tracing on and off around every system call): no compiling, no module space, its counters and frames go
    on as if it had stayed armed while on."""
    machine, tracer = _tracer(engine)
    _define(tracer, 1, SITE, [_x(f"reg 0x5; ext 0x20; setv {N['printk_tmp']:#x}; tracev {N['printk_tmp']:#x}; end")])
    _define(tracer, 2, LOOP, [_setv("disable", 1)], condition=_on_loop_argument(2))
    _define(tracer, 3, LOOP, [_setv("enable", 1)], condition=_on_loop_argument(3))
    tracer.start()
    machine.call("kgtp_bench_loop", 2)
    machine.call("kgtp_bench_loop", 3)
    code = machine._code.allocated
    for _ in range(30):
        machine.call("kgtp_bench_loop", 2)  # off
        machine.call("kgtp_bench_loop", 3)  # on: three hits
    assert machine._code.allocated == code or engine == "interp"
    counters = [f.tsv_values()[0][1] for f in tracer.frames() if f.tracepoint == 1]
    assert counters == [1, 2, 3] * 31
    assert tracer.location_status(1, SITE)[0] == 93
    assert machine.read_memory(SITE, 1) != IMAGE.read_code(SITE, 1)  # armed: the site is patched


@pytest.mark.parametrize("engine", ENGINES)
def test_disable_zero_switches_off_every_other_tracepoint(engine):
    machine, tracer = _tracer(engine)
    _define(tracer, 1, SITE, [])
    _define(tracer, 2, IMAGE.address_of("load_module"), [])
    _define(tracer, 3, LOOP, [_setv("disable", 0)])
    tracer.start()
    machine.call("kgtp_bench_loop", 2)
    machine.call("kgtp_bench_loop", 2)
    assert [f.tracepoint for f in tracer.frames()] == [3, 3]  # its own hits go on, tracepoint 1 never ran
    assert sorted(key[0] for key in tracer.probes.installed) == [3]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_tracepoint_disables_itself(engine):
    machine, tracer = _tracer(engine)
    _user_variable(tracer)
    _define(tracer, 1, SITE, [_x(f"getv {USER:#x}; const8 0x1; add; setv {USER:#x}; tracev {USER:#x}; "
                                 f"const8 0x3; equal; setv {N['disable']:#x}; end")])
    tracer.start()
    machine.call("kgtp_bench_loop", 5)
    # $disable = ($c == 3): 0 (all others: none) twice, then 1 (itself) at its third hit, recorded
    assert [f.tsv_values() for f in tracer.frames()] == [[(USER, n)] for n in (1, 2, 3)]


# ---- $current ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_current_makes_a_pt_regs_the_hits_registers(engine):
    machine, tracer = _tracer(engine)
    regs = machine.alloc_data(22 * 8)
    # struct pt_regs: r15 r14 r13 r12 bp bx r11 cx ax di si dx r10 r8 r9 vector orig_ax ip cs flags sp ss
    words = [0x1500 + i for i in range(15)] + [0x80, 9999, 0xFFFFFFFF81001234, 0x08, 0x246, 0xFFFF888000001000, 0x10]
    machine.write_memory(regs, struct.pack("<22Q", *words))
    syscall = IMAGE.address_of("do_syscall")
    _define(tracer, 1, syscall, [
        t.CollectRegisters((1 << 20) - 1),
        _x(f"reg 0x5; setv {N['current']:#x}; end"),  # KGTP's get_regs: runs first, whatever its place
    ], ["collect $regs", "teval $current = regs"], condition=assemble("reg 0x2; const16 0x1507; equal; end"))
    tracer.start()
    assert machine.call("do_syscall", regs) == 2**64 - 38  # -ENOSYS: the kernel read the same pt_regs
    frames = tracer.frames()
    assert len(frames) == 1  # the condition saw the pt_regs' rcx
    got = frames[0].registers
    assert (got["r15"], got["r12"], got["rbp"], got["rbx"], got["rcx"], got["rax"], got["rdi"], got["r9"]) == (
        0x1500, 0x1503, 0x1504, 0x1505, 0x1507, 0x1508, 0x1509, 0x150E)
    assert (got["rip"], got["cs"], got["eflags"], got["rsp"], got["ss"]) == (
        0xFFFFFFFF81001234, 0x08, 0x246, 0xFFFF888000001000, 0x10)


@pytest.mark.parametrize("actions, condition, text", [
    ([], assemble(f"reg 0x5; setv {N['current']:#x}; end"), "$current can only be set in an action"),
    ([_x(f"reg 0x5; setv {N['current']:#x}; end")] * 2, None, "$current is set by more than one action"),
])
def test_what_current_cannot_mean_here_fails_tstart(actions, condition, text):
    machine, tracer = _tracer("opt")
    _define(tracer, 1, SITE, actions, condition=condition)
    with pytest.raises(TraceError, match=re.escape(text)):
        tracer.start()


def test_current_cannot_be_read_while_stepping():
    machine, tracer = _tracer("opt")
    tracer.definitions.define(t.DefineTracepoint(number=1, address=SITE, step_count=2, more=True))
    tracer.definitions.add_actions(t.TracepointActions(number=1, address=SITE, stepping=True,
                                                       actions=(_x(f"tracev {N['current']:#x}; end"),)))
    with pytest.raises(TraceError, match=re.escape("while-stepping actions cannot read $current")):
        tracer.start()
