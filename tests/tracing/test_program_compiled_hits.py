"""A compiled hit of a tracepoint in a program (tracing/engines/userprobes.py, patching/userpad.py, machine/gates.py):
under the naive and optimizing engines a `trace` or `ftrace` in the program runs its condition and actions in
emulated code (the pad in ring 3, the detour behind a call gate in ring 0), no Python per hit, and records what
the Python path (the interpreting engine) records: every call seen once, in order, with the program's registers
(PC at the tracepoint, its CS and SS) and the memory it collects.

The program is the combination suite's (fixtures/combinations/callers.c: a thread per CPU calling counted_function,
whose first instruction counts the call in `counter`), under an in-process gdbserver role fed RSP packets."""

from __future__ import annotations

import struct

import pytest

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
        stop = gdb.run_a_while(0.3)
        assert stop.startswith(b"T02"), stop
        hits = int(gdb.ask(b"qTP:1:%x" % function)[1:].split(b":")[0], 16)
        calls = gdb.u32(counter) - first
        python_hits = machine.cpu.breakpoint_hits - python_before
        gdb.ok(b"QTStop")
        frames = _frames(gdb, counter)
    finally:
        gdb.close()
    assert hits == calls == len(frames) >= 16, (hits, calls, len(frames))  # a round of calls at least
    values = sorted(value for _, value in frames)
    if not (engine == "interp" and kind == "ftrace"):  # (the Python path's pad may be left between hit and count)
        assert values == list(range(first, first + len(frames)))  # each call seen once, before its count
    for registers, _ in frames:
        assert registers["rip"] == function and registers["cs"] == 0x33 and registers["ss"] == 0x2B, registers
        assert registers["rdi"] >= 1 and 0x7F0000000000 < registers["rsp"] < 0x800000000000, registers
    if engine == "interp":
        assert python_hits >= hits
    else:  # the compiled path: no Python per hit
        assert python_hits < hits // 10, (python_hits, hits)
