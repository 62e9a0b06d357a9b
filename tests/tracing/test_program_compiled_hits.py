"""A compiled hit of a tracepoint in a program (tracing/engines/userprobes.py, patching/userpad.py, machine/gates.py):
under the naive and optimizing engines a `trace` or `ftrace` in the program runs its condition and actions in
emulated code (the pad in ring 3, the detour behind a call gate in ring 0), no Python per hit, and records what
the Python path (the interpreting engine) records: every call seen once, in order, with the program's registers
(PC at the tracepoint, its CS and SS) and the memory it collects.

The program is the combination suite's (fixtures/combinations/callers.c: a thread per CPU calling counted_function,
whose first instruction counts the call in `counter`), under an in-process gdbserver role fed RSP packets."""

from __future__ import annotations

import re

import pytest
import time

from unicorn import UC_HOOK_CODE
from unicorn.x86_const import UC_X86_REG_RIP

from kgtp_sim.arch import amd64
from kgtp_sim.gdbserver import Options, Server
from kgtp_sim.tools.combinations.process import build_program, program_symbols

from .test_program_step_in_place import Gdb, _x


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    binary = build_program(tmp_path_factory.mktemp("compiled-hits"))
    return binary, program_symbols(binary)


class EngineGdb(Gdb):
    def __init__(self, program, cpus: int, engine: str) -> None:  # noqa: D107 - Gdb's, with the engine
        self.server = Server(Options(comm="stdio", program=[str(program), str(cpus)], cpus=cpus, hz=1000,
                                     engine=engine))
        self.server.start()
        self.session = self.server.make_session()
        self.server.on_connect()


def _frames(gdb: Gdb, counter: int) -> list[tuple[dict[str, int], int]]:
    """Each frame's registers (the process's layout, as GDB reads them) and the counter it collected."""
    out = []
    count = int(gdb.ask(b"qTStatus").split(b"tframes:")[1].split(b";")[0], 16)
    for frame in range(count):
        assert gdb.ask(b"QTFrame:%x" % frame).startswith(b"F")
        raw = bytes.fromhex(gdb.ask(b"g").decode().replace("x", "0"))
        assert len(raw) == amd64.LINUX.size
        registers = {r.name: int.from_bytes(raw[amd64.OFFSETS[i]:amd64.OFFSETS[i] + r.size], "little")
                     for i, r in enumerate(amd64.GENERAL_REGISTERS)}
        out.append((registers, gdb.u32(counter)))
    gdb.ok(b"QTFrame:ffffffff")
    return out


@pytest.mark.parametrize("cpus", [1, 2])
@pytest.mark.parametrize("kind", ["trace", "ftrace"])
@pytest.mark.parametrize("engine", ["interp", "naive", "opt"])
def test_a_program_tracepoint_runs_compiled_and_records_what_the_python_path_records(program, engine, kind, cpus):
    binary, symbols = program
    function, counter = symbols["counted_function"], symbols["counter"]
    gdb = EngineGdb(binary, cpus, engine)
    try:
        assert gdb.run_a_while(0.3).startswith(b"T02")
        gdb.ok(b"QTinit")
        fast = b":F7" if kind == "ftrace" else b""  # counted_function's first instruction: 7 bytes
        # a condition on a register that is always true (callers.c passes counter1 >= 1), registers and the counter
        gdb.ok(b"QTDP:1:%x:E:0:0%s:X%s-" % (function, fast, _x("const8 0; reg 5; less_signed; end")[1:]))
        gdb.ok(b"QTDP:-1:%x:R%x-" % (function, 0xFFFFFF))
        gdb.ok(b"QTDP:-1:%x:M-1,%x,4" % (function, counter))
        machine = gdb.server.machine
        python_before = machine.cpu.breakpoint_hits
        first = gdb.u32(counter)
        gdb.ok(b"QTStart")
        for _ in range(20):  # a round of calls at least (a busy host runs fewer in a while)
            stop = gdb.run_a_while(0.3)
            assert stop.startswith(b"T02"), stop
            if gdb.u32(counter) - first >= 16:
                break
        hits = int(gdb.ask(b"qTP:1:%x" % function)[1:].split(b":")[0], 16)
        calls = gdb.u32(counter) - first
        python_hits = machine.cpu.breakpoint_hits - python_before
        gdb.ok(b"QTStop")
        frames = _frames(gdb, counter)
    finally:
        gdb.close()
    assert hits == len(frames) >= 16, (hits, len(frames))
    values = sorted(value for _, value in frames)
    if engine == "interp" and kind == "ftrace":
        # the Python path's pad runs the counted instruction after the hit, where the stop may come between
        # (interrupts on, as gdbserver's jump pad between its collection and the relocated instruction): each
        # CPU's task may have been hit and not counted yet
        assert calls <= hits <= calls + cpus, (hits, calls)
    else:  # a hit and its instruction are one step (the int3's, in place) or one stretch of the stub's code
        # (compiled: the detour and the pad's tail): no stop between them
        assert hits == calls, (hits, calls)
        assert values == list(range(first, first + len(frames)))  # each call seen once, before its count
    for registers, _ in frames:
        assert registers["rip"] == function and registers["cs"] == 0x33 and registers["ss"] == 0x2B, registers
        assert registers["rdi"] >= 1 and 0x7F0000000000 < registers["rsp"] < 0x800000000000, registers
    if engine == "interp":
        assert python_hits >= hits
    else:  # the compiled path: no Python per hit
        assert python_hits < hits // 10, (python_hits, hits)


# ---- what a compiled hit costs, what it records, whom it hits: the thesis workload as a program --------------------
# (kgtp_sim/tools/program_hits.py: fixtures/peer/thesis_workload.c under the role on one CPU, stopped at bench_sync()
# between batches, windows around kgtp_bench_loop's calls; only windows no interrupt entered count, so their
# instruction counts are exact)


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    from kgtp_sim.tools.program_hits import build

    return build(tmp_path_factory.mktemp("thesis-workload"))


def _count_in(workload, ranges: dict[str, tuple[int, int]]) -> dict[str, int]:
    """Instructions the CPU runs in each named range from now on (a hook per range, never deleted: see
    bench/programs.Booted), whatever the CPU ran before (translated code flushed)."""
    counts = dict.fromkeys(ranges, 0)

    def install(uc) -> None:
        for name, (start, end) in ranges.items():
            def count(_uc, _address, _size, _data, name=name) -> None:
                counts[name] += 1
            uc.hook_add(UC_HOOK_CODE, count, None, start, end - 1)
        uc.ctl_flush_tb()

    workload.machine.run_on_cpu(install)
    return counts


@pytest.mark.parametrize("case", ["false-cond", "expr", "cond+expr"])
@pytest.mark.parametrize("kind", ["int3", "jump"])
def test_a_compiled_hit_runs_its_pad_and_detour_and_nothing_else(workload, kind, case):
    """Under the optimizing engine each hit costs exactly the instructions of the site (its int3 or jump), the
    pad and the location's detour, less the probed instruction no longer run in place: the machine's count of a
    clean window grows by those (with the ring routines the detour calls) and nothing else (no kernel entry, no #BP, no interrupt), no Python hit handler
    runs, and a false condition (a register-only one: decided in the pad, in ring 3) never enters the detour."""
    from kgtp_sim.tools.program_hits import RoleWorkload, definition

    calls, batches = 50, 4  # short windows at a slow tick (the counting hooks run Python at each instruction)
    w = RoleWorkload(workload, engine="opt", counting=True, hz=10)
    try:
        site = _count_in(w, {"site": (w.function, w.function + 1)})
        untraced = w.run(batches, calls)
        in_place = site["site"]
        hit: dict[str, dict[str, int]] = {}

        def armed(w) -> None:
            tracer = w.server.tracer
            probes = tracer.probes.program
            there = probes.sites[w.function]
            assert there.compiled and there.jump == (kind == "jump")
            (item,) = there.items
            pad_end = probes._live_pads[there.pad][0]
            assert item.native.regions  # its detour and compiled expressions, among the run's code
            # the run's compiled code: the shared ring routines, this location's detour and expressions
            regions = {f"detour{i}": region for i, region in enumerate(tracer.native.code_regions)}
            hit["counts"] = _count_in(w, {"pad": (there.pad, pad_end), **regions})
            hit["site"] = dict(site)  # (from here on)

        traced = w.run(batches, calls, definition(w.function, kind, case, w.insn_length), armed=armed)
        ran_at_site = site["site"] - hit["site"]["site"]
        hit = hit["counts"]
    finally:
        w.close()
    total = batches * calls
    assert in_place == total and ran_at_site == total  # once a call: the probed instruction, then the int3 or jump
    assert untraced.windows and traced.windows, (untraced, traced)
    (base,) = {window.insns for window in untraced.windows}
    (insns,) = {window.insns for window in traced.windows}  # every clean window the same: exact
    detour = sum(n for name, n in hit.items() if name.startswith("detour"))
    assert hit["pad"] % total == 0 and detour % total == 0, hit
    # the site's int3 or jump replaces the probed instruction one for one; the pad runs that instruction
    # relocated and jumps back; the rest is the hit itself
    assert insns - base == (hit["pad"] + detour) / total * calls, (insns - base, hit)
    assert traced.python_hits == 0
    if case == "false-cond":
        assert detour == 0 and traced.hits == traced.frames == 0, (hit, traced)
    else:
        assert detour > 0 and traced.hits == traced.frames == total, (hit, traced)


def _session(w, condition: bytes, collect: bytes) -> list[bytes]:
    """A condition, every register, the program's call counter and an expression, at kgtp_test_function."""
    counter = _symbol(w, "kgtp_counter")
    return [b"QTDP:1:%x:E:0:0%s:X%x,%s-" % (w.function, b":F%x" % w.insn_length if w.kind == "jump" else b"",
                                               len(condition), condition.hex().encode()),
            b"QTDP:-1:%x:R%x-" % (w.function, 0xFFFFFF),
            b"QTDP:-1:%x:M-1,%x,4-" % (w.function, counter),
            b"QTDP:-1:%x:X%x,%s" % (w.function, len(collect), collect.hex().encode())]


def _symbol(w, name: str) -> int:
    from elftools.elf.elffile import ELFFile

    with open(w.binary, "rb") as f:
        return ELFFile(f).get_section_by_name(".symtab").get_symbol_by_name(name)[0]["st_value"]


def _recorded(w) -> dict[int, tuple[bytes, bytes]]:
    """Each frame's call (the program's counter, collected) -> its register block (`g`) and the counter's bytes."""
    counter = _symbol(w, "kgtp_counter")
    out = {}
    for frame in range(int(re.search(rb"tframes:([0-9a-f]+)", w.ask(b"qTStatus")).group(1), 16)):
        assert w.ask(b"QTFrame:%x" % frame).startswith(b"F")
        memory = w.ask(b"m%x,4" % counter)
        call = int.from_bytes(bytes.fromhex(memory.decode()), "little")
        assert call not in out, call  # each call once
        out[call] = (w.ask(b"g"), memory)
    w.ok(b"QTFrame:ffffffff")
    return out


def _pc(w) -> int:
    return int.from_bytes(bytes.fromhex(w.ask(b"p10").decode()), "little")


def _stopped_in_pad(w, kind: str, at) -> int:
    """The thesis tracepoint compiled (condition + expression) and running, one call of the workload let go, and the
    task stopped at the debugger's breakpoint on `at(site)`, an address in the pad (the breakpoint taken out
    again); returns that address."""
    from kgtp_sim.tools.program_hits import definition

    for packet in [b"QTinit", *definition(w.function, kind, "cond+expr", w.insn_length), b"QTStart"]:
        w.ok(packet)
    address = at(w.server.tracer.probes.program.sites[w.function])
    w.ok(b"M%x,8:%s" % (w.calls_at, (1).to_bytes(8, "little").hex().encode()))
    w.ok(b"z0,%x,1" % w.sync)
    w.ok(b"Z0,%x,1" % address)
    w.resume(b"vCont;c")
    assert _pc(w) == address
    w.ok(b"z0,%x,1" % address)
    return address


def _thesis(workload, engine: str, kind: str):
    from kgtp_sim.tools.program_hits import RoleWorkload

    w = RoleWorkload(workload, engine=engine)
    w.binary, w.kind = workload, kind
    return w


@pytest.mark.parametrize("kind", ["int3", "jump"])
def test_the_compiled_path_records_the_frames_the_python_path_records(workload, kind):
    """The same session (the thesis condition, `$regs`, the call counter, the thesis expression) on the same calls
    of two runs of the program, one on the Python path (interp) and one compiled (opt): the same frames, register
    block for register block and byte for byte, for every call."""
    from kgtp_sim.bench.record import FIXTURE, load

    site = load(FIXTURE)["sites"]["dynamic"]
    condition = bytes.fromhex(site["true_condition"]["bytecode"])
    collect = bytes.fromhex(site["collect"]["bytecode"])
    recorded, python = {}, {}
    for engine in ("interp", "opt"):
        w = _thesis(workload, engine, kind)
        try:
            # one batch: the first after the program's start, whose caller leaves the same registers in both runs
            # (a later batch's %rdx still holds the previous batch's clock reading, the host's time)
            run = w.run(1, 80, _session(w, condition, collect))
            recorded[engine], python[engine] = _recorded(w), run.python_hits
        finally:
            w.close()
    assert python == {"interp": 80, "opt": 0}, python
    assert sorted(recorded["opt"]) == list(range(1, 81)), sorted(recorded["opt"])  # kgtp_counter starts at 1
    assert recorded["opt"] == recorded["interp"]
    rip = next(iter(recorded["opt"].values()))[0][16 * 16:17 * 16]
    assert int.from_bytes(bytes.fromhex(rip.decode()), "little") == w.function  # the PC at the tracepoint


def test_another_process_running_the_program_at_the_same_address_hits_nothing(workload):
    """A second process of the same program (the same code at the same addresses, a space of its own), run to its
    end while the first's compiled `trace` is armed: the tracepoint's hits and frames are the first's calls
    only."""
    from kgtp_sim.tools.program_hits import definition

    w = _thesis(workload, "opt", "int3")
    seen = {}

    def other(w) -> None:
        pid = w.machine.processes.spawn(w.server.inside, ["thesis_workload", "300", "2"], cpu=0)
        ended = w.machine.processes.wait(pid, timeout=120)
        seen["exit"] = None if ended is None else ended.code
        seen["counts"] = w.counts()

    try:
        assert w.server.tracer.engine == "opt"
        run = w.run(2, 50, definition(w.function, "int3", "expr", w.insn_length), armed=other)
    finally:
        w.close()
    assert seen == {"exit": 0, "counts": (0, 0)}, seen  # its 600 calls ran (kgtp_bench_loop's result checked)
    assert (run.hits, run.frames, run.python_hits) == (100, 100, 0), run


@pytest.mark.parametrize("where", ["condition", "gate"])
@pytest.mark.parametrize("kind", ["int3", "jump"])
def test_a_task_stopped_inside_a_pad_steps_out_of_it_after_the_probed_instruction(workload, kind, where):
    """The debugger's breakpoint inside a compiled pad (in its ring-3 condition, its flags saved on the stack; or on
    its `lcall`) stops the task there; one single step from there ends after the probed instruction, as a step of
    that instruction would, the hit collected once, and the program goes on. (The pad's popfq would load the flags
    saved before the step, TF clear, and the step would never end; a step of the `lcall` keeps TF through the call
    gate, and its #DB came in ring 0, where the kernel took it in the middle of the detour and the machine
    stopped.)"""
    from kgtp_sim.tracing.patching.probes import decode
    from kgtp_sim.tracing.patching.userpad import LCALL_SIZE

    w = _thesis(workload, "opt", kind)

    def in_pad(site) -> int:
        pad = decode(bytes.fromhex(w.ask(b"m%x,%x" % (site.pad, site.tail - site.pad)).decode()), site.pad)
        assert [i.code[:1] for i in pad[:2]] == [b"\x48", b"\x9c"] and pad[-1].address == site.tail - LCALL_SIZE
        return pad[-1].address if where == "gate" else pad[3].address  # (lea, pushfq, push, then here)

    try:
        _stopped_in_pad(w, kind, in_pad)
        w.resume(b"vCont;s")
        assert _pc(w) == w.function + w.insn_length
        assert w.counts() == (1, 1)
        w.ok(b"Z0,%x,1" % w.sync)
        w.resume(b"vCont;c")
        assert _pc(w) == w.sync and w.counts() == (1, 1)
        assert int.from_bytes(bytes.fromhex(w.ask(b"m%x,8" % w.result_at).decode()), "little") == 1
    finally:
        w.close()


@pytest.mark.parametrize("kind", ["int3", "jump"])
def test_a_task_left_at_a_pads_gate_after_the_run_steps_back_into_the_pad(workload, kind):
    """The debugger's breakpoint on a compiled pad's `lcall` stops the task there; the run stops (the pad stays,
    its gate now a bare return) and the task single-steps: the step ends after the `lcall`, at the pad's relocated
    instruction, nothing collected, and the program goes on. (A step of the `lcall` keeps TF through the gate; the
    #DB in ring 0 at the gate's target was let go only while the run had the pad, and after it the kernel took it
    with the program's GS base loaded: the machine stopped.)"""
    from kgtp_sim.tracing.patching.userpad import LCALL_SIZE

    w = _thesis(workload, "opt", kind)
    try:
        tail = _stopped_in_pad(w, kind, lambda site: site.tail - LCALL_SIZE) + LCALL_SIZE
        w.ok(b"QTStop")
        w.resume(b"vCont;s")
        assert _pc(w) == tail
        assert w.counts() == (0, 0)
        w.ok(b"Z0,%x,1" % w.sync)
        w.resume(b"vCont;c")
        assert _pc(w) == w.sync
        assert int.from_bytes(bytes.fromhex(w.ask(b"m%x,8" % w.result_at).decode()), "little") == 1
    finally:
        w.close()



def _run_until(gdb: Gdb, counter: int, calls: int) -> None:
    """Runs the program until `calls` more calls have been counted (a busy host runs fewer in a while)."""
    first = gdb.u32(counter)
    for _ in range(40):
        stop = gdb.run_a_while(0.2)
        assert stop.startswith(b"T02"), stop
        if gdb.u32(counter) - first >= calls:
            return
    raise AssertionError(f"fewer than {calls} calls")


@pytest.mark.parametrize("second", ["trace", "ftrace"])
@pytest.mark.parametrize("first", ["trace", "ftrace"])
@pytest.mark.parametrize("engine", ["naive", "opt"])
def test_a_tracepoint_added_during_the_run_joins_the_compiled_one_at_its_address(program, engine, first, second):
    """GDB defines a tracepoint during a run where one already runs compiled (trace-break.exp's fifth case): the
    compiled one leaves its pad for the Python path with its counts, and from then on every call collects a frame
    of each, the first's before the second's."""
    binary, symbols = program
    function, counter = symbols["counted_function"], symbols["counter"]
    gdb = EngineGdb(binary, 2, engine)
    fast = {"trace": b"", "ftrace": b":F7"}  # counted_function's first instruction: 7 bytes
    try:
        assert gdb.run_a_while(0.3).startswith(b"T02")
        gdb.ok(b"QTinit")
        gdb.ok(b"QTDP:1:%x:E:0:0%s-" % (function, fast[first]))
        gdb.ok(b"QTDP:-1:%x:M-1,%x,4" % (function, counter))
        machine = gdb.server.machine
        gdb.ok(b"QTStart")
        python_before = machine.cpu.breakpoint_hits
        _run_until(gdb, counter, 16)
        compiled_hits = int(gdb.ask(b"qTP:1:%x" % function)[1:].split(b":")[0], 16)
        assert machine.cpu.breakpoint_hits - python_before < compiled_hits // 4  # it ran compiled
        gdb.ok(b"QTDP:2:%x:E:0:0%s-" % (function, fast[second]))
        gdb.ok(b"QTDP:-2:%x:M-1,%x,4" % (function, counter))
        _run_until(gdb, counter, 16)
        hits = [int(gdb.ask(b"qTP:%x:%x" % (n, function))[1:].split(b":")[0], 16) for n in (1, 2)]
        gdb.ok(b"QTStop")
        frames = []
        count = int(gdb.ask(b"qTStatus").split(b"tframes:")[1].split(b";")[0], 16)
        for n in range(count):
            reply = gdb.ask(b"QTFrame:%x" % n)
            assert reply.startswith(b"F"), reply
            frames.append((int(reply.split(b"T")[1], 16), gdb.u32(counter)))
        gdb.ok(b"QTFrame:ffffffff")
    finally:
        gdb.close()
    numbers = [number for number, _ in frames]
    assert hits == [numbers.count(1), numbers.count(2)], (hits, numbers)  # the first's count went on from its pad's
    assert compiled_hits <= numbers.index(2) and hits[1] >= 16, (compiled_hits, hits)
    joined = frames[numbers.index(2) - 1:]
    # from the join on, each hit runs both in order (one Python hit, no other CPU meanwhile): the same call's value
    assert [number for number, _ in joined] == [1, 2] * (len(joined) // 2), numbers
    assert all(a[1] == b[1] for a, b in zip(joined[::2], joined[1::2])), joined


@pytest.mark.parametrize("kind", ["int3", "jump"])
def test_a_run_stopped_while_a_cpu_is_in_a_pad_counts_that_hit(workload, kind):
    """QTStop (or any change to the run's probes) served while the program's thread is inside a pad, its false
    condition not yet counted (non-stop: the thread runs meanwhile): the CPU first runs out of the pad, as out of a
    detour, so the removal reads a count that includes that hit. Every entry into the pad is counted once."""
    from kgtp_sim.machine.scheduler import _Request
    from kgtp_sim.rsp.packets.trace import StopReason
    from kgtp_sim.tools.program_hits import definition

    w = _thesis(workload, "opt", kind)
    try:
        for packet in [b"QTinit", *definition(w.function, kind, "false-cond", w.insn_length), b"QTStart"]:
            w.ok(packet)
        tracer, cpu = w.server.tracer, w.machine.cpu
        pad = tracer.probes.program.sites[w.function].pad
        entered, at_removal = [0], []

        def stop_run(uc) -> None:  # served by the machine's loop right after the hook's stop: RIP at the pad
            assert uc.reg_read(UC_X86_REG_RIP) == pad
            at_removal.append(entered[0])
            tracer.stop(StopReason.STOP_COMMAND)  # as QTStop has it done on this thread

        def at_pad(uc, _address, _size, _data) -> None:
            entered[0] += 1
            if entered[0] == 20:  # a thread now inside the pad, its false condition not counted yet
                request = _Request(stop_run)
                requests.append(request)
                w.machine._sched._requests.append(request)
                uc.emu_stop()  # before the pad's first instruction runs

        requests: list = []
        hook = w.machine.run_on_cpu(lambda uc: uc.hook_add(UC_HOOK_CODE, at_pad, None, pad, pad))
        w.machine.run_on_cpu(lambda uc: uc.ctl_flush_tb())
        w.ok(b"M%x,8:%s" % (w.calls_at, (200).to_bytes(8, "little").hex().encode()))
        w._continue()  # the batch, to its end at bench_sync(): untraced from the removal on
        assert requests and requests[0].done.is_set() and requests[0].error is None, requests
        w.machine.run_on_cpu(lambda uc: cpu.delete_hook(hook, code_at=pad))
        fired = {row.number: row.fired for row in tracer.probe_rows()}
    finally:
        w.close()
    # the entry held at the pad's start went on after the removal (and hit the hook again): its count is in
    assert at_removal == [20] and entered[0] == 21, (at_removal, entered)
    assert fired == {1: 20}, fired
