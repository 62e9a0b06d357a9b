"""Tracepoints in a program (tracing/engines/userprobes.py), found by the combination suite's process space: an int3
hit and its probed instruction are one step; a fast tracepoint's hit may end the run, and so may a hit in one space
while the other's probes are in; `$kret` and watch tracepoints are refused with their reason.

An int3 hit and the probed instruction, run in place with the int3 lifted, are one step of the program: no
interrupt comes between them.

The step runs with TF set, and the scheduler switches no CPU while it is; but a tick that came due during the hit
was delivered before the stepped instruction (the program runs with interrupts on): the kernel's handler ran with
the int3 lifted, could switch to another thread of the program, which then ran the probed place unseen (a lost
hit), and beside watch tracepoints on the kernel's variables the tick's write of jiffies trapped into the step's #DB
hook, which took it for the end of its step in another space and stopped the machine ("patch it between runs").
The step now runs with IF cleared, as Linux's kprobes single-step.

The program is the combination suite's (fixtures/combinations/callers.c: a thread per CPU calling counted_function,
whose first instruction counts the call), under an in-process gdbserver role (kgtp_sim/gdbserver.py) fed RSP
packets; a fast timer (1000 Hz) makes a tick during a hit likely."""

from __future__ import annotations

import logging
import re
import time

import pytest

from kgtp_sim.agent.opcodes import assemble
from kgtp_sim.gdbserver import Options, Server
from kgtp_sim.rsp.codec import Decoder, EventKind, encode_packet
from kgtp_sim.tools.combinations.process import build_program, program_symbols
from kgtp_sim.tracing.core.builtins import BUILTIN_VARIABLES

N = {b.name: b.number for b in BUILTIN_VARIABLES}
WATCHED = ("jiffies", "kgtp_test_pace", "nr_modules_loaded", "nr_context_switches")


class Gdb:
    """An in-process gdbserver role on the program, and its session as GDB would feed it."""

    def __init__(self, program, cpus: int, engine: str = "opt") -> None:
        # KGTP's variables by KGTP's numbers, as `--kgtp-variables` uploads them (the tests speak those numbers)
        self.server = Server(Options(comm="stdio", program=[str(program), str(cpus)], cpus=cpus, hz=1000,
                                     engine=engine, kgtp_variables=True))
        self.server.start()
        self.session = self.server.make_session()
        self.server.on_connect()

    def _packets(self, data: bytes) -> list[bytes]:
        return [e.payload for e in Decoder().feed(data) if e.kind is EventKind.PACKET]

    def ask(self, payload: bytes) -> bytes:
        replies = self._packets(self.session.receive(encode_packet(payload, binary=True)))
        assert replies, payload
        return replies[-1]

    def ok(self, payload: bytes) -> None:
        reply = self.ask(payload)
        assert reply == b"OK", (payload, reply)

    def run_a_while(self, seconds: float) -> bytes:
        """`c`, then Ctrl-C: the stop reply."""
        assert not self._packets(self.session.receive(encode_packet(b"vCont;c")))
        time.sleep(seconds)
        replies = self._packets(self.session.poll() or self.session.receive(b"\x03"))
        assert len(replies) == 1, replies
        return replies[0]

    def u32(self, address: int) -> int:
        reply = self.ask(b"m%x,4" % address)
        assert re.fullmatch(rb"[0-9a-f]{8}", reply), f"m{address:x},4 answered {reply!r}"
        return int.from_bytes(bytes.fromhex(reply.decode()), "little")

    def close(self) -> None:
        self.server.shutdown()


def _x(code: str) -> bytes:
    program = assemble(code)
    return b"X%x,%s" % (len(program), program.hex().encode())


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    binary = build_program(tmp_path_factory.mktemp("step-in-place"))
    return binary, program_symbols(binary)


@pytest.mark.parametrize("watches", [False, True], ids=["alone", "beside watches"])
def test_every_hit_ran_its_probed_instruction_and_no_call_went_unseen(program, watches):
    binary, symbols = program
    function, counter = symbols["counted_function"], symbols["counter"]
    gdb = Gdb(binary, cpus=2)
    try:
        assert gdb.run_a_while(0.3).startswith(b"T02")  # the threads started
        gdb.ok(b"QTinit")
        gdb.ok(b"QTDP:1:%x:E:0:0-" % function)
        gdb.ok(b"QTDP:-1:%x:M-1,%x,4" % (function, counter))
        if watches:  # KGTP's watch tracepoints on the kernel's variables, in the same run
            image = gdb.server.machine.image
            for number, name in enumerate(WATCHED, start=5):
                at = image.address_of(name)
                gdb.ok(b"QTDP:%x:%x:E:0:0-" % (number, at))
                gdb.ok(b"QTDP:-%x:%x:%s-" % (number, at, _x(f"const8 1; setv {N['watch_static']:#x}; end")))
                gdb.ok(b"QTDP:-%x:%x:%s" % (number, at, _x(f"const8 4; setv {N['watch_size']:#x}; end")))
        first = gdb.u32(counter)
        gdb.ok(b"QTStart")
        problems = []
        for window in range(20):
            stop = gdb.run_a_while(0.05)
            if not stop.startswith(b"T02"):
                problems.append(f"window {window}: the program stopped with {stop!r}")
                break
            hits = int(gdb.ask(b"qTP:1:%x" % function)[1:].split(b":")[0], 16)
            calls = gdb.u32(counter) - first
            if hits != calls:
                problems.append(f"window {window}: {hits} hits, {calls} calls")
        gdb.ok(b"QTStop")
        values = []
        for frame in range(int(gdb.ask(b"qTStatus").split(b"tframes:")[1].split(b";")[0], 16)):
            reply = gdb.ask(b"QTFrame:%x" % frame)
            assert reply.startswith(b"F"), reply
            if reply.endswith(b"T1"):  # the watches' frames hold no counter
                values.append(gdb.u32(counter))
        gdb.ok(b"QTFrame:ffffffff")
        assert gdb.server.machine.stats(count=False).state != "crashed"
    finally:
        gdb.close()
    assert not problems, problems[:5]
    assert len(values) > 50 and sorted(values) == list(range(first, first + len(values)))


def test_a_return_probe_or_a_watch_tracepoint_in_the_program_is_refused_with_its_reason(program):
    """KGTP's `$kret` and watch tracepoints are the kernel's (a kretprobe, a hardware breakpoint of the kernel's):
    at the program's addresses tstart refuses them saying so, not that the address is no function's or unmapped."""
    binary, symbols = program
    function, counter = symbols["counted_function"], symbols["counter"]
    gdb = Gdb(binary, cpus=1)
    try:
        gdb.ok(b"QTinit")
        gdb.ok(b"QTDP:1:%x:E:0:0-" % function)
        gdb.ok(b"QTDP:-1:%x:%s" % (function, _x(f"const8 0; setv {N['kret']:#x}; end")))
        assert gdb.ask(b"QTStart") == (b"E.tracepoint 1 at %#x: kret is a return probe of a kernel function (KGTP's "
                                       b"kretprobe): a tracepoint in the program cannot set it" % function)
        gdb.ok(b"QTinit")
        gdb.ok(b"QTDP:1:%x:E:0:0-" % counter)
        gdb.ok(b"QTDP:-1:%x:%s" % (counter, _x(f"const8 1; setv {N['watch_static']:#x}; end")))
        assert gdb.ask(b"QTStart") == (b"E.tracepoint 1: a watch tracepoint is a hardware breakpoint of the kernel's "
                                       b"(KGTP's), on the kernel's memory: %#x is the program's" % counter)
        assert gdb.ask(b"qTStatus").startswith(b"T0")  # no run started
    finally:
        gdb.close()


@pytest.mark.parametrize("ending", ["passcount", "fault"])
def test_a_fast_tracepoint_whose_hit_ends_the_run_takes_its_jump_out_there(program, ending):
    """A hit in a fast tracepoint's pad that ends the run (its pass count, a condition that faults) takes the jump
    out of the program's code from inside the hit, the program's space loaded in ring 3: its translated code is
    dropped there (it once asked the machine to do it between runs, which stopped the machine). The program goes on
    through its own instruction: the count moves and no signal comes."""
    binary, symbols = program
    function, counter = symbols["counted_function"], symbols["counter"]
    gdb = Gdb(binary, cpus=2)
    try:
        assert gdb.run_a_while(0.3).startswith(b"T02")
        gdb.ok(b"QTinit")
        condition = b":" + _x("const8 8; ref32; end") if ending == "fault" else b""
        gdb.ok(b"QTDP:1:%x:E:0:%x:F7%s-" % (function, 3 if ending == "passcount" else 0, condition))
        gdb.ok(b"QTDP:-1:%x:M-1,%x,4" % (function, counter))
        gdb.ok(b"QTStart")
        stop = gdb.run_a_while(0.2)
        status = gdb.ask(b"qTStatus")
        before = gdb.u32(counter)
        again = gdb.run_a_while(0.1)
        after = gdb.u32(counter)
        assert gdb.server.machine.stats(count=False).state != "crashed"
    finally:
        gdb.close()
    assert stop.startswith(b"T02") and again.startswith(b"T02"), (stop, again)
    assert status.startswith(b"T0;" + (b"tpasscount:1" if ending == "passcount" else b"terror:")), status
    assert after > before


@pytest.mark.parametrize("ender", ["kernel", "program"])
def test_a_hit_in_one_space_that_ends_the_run_takes_the_other_spaces_probes_out(program, ender, caplog):
    """One run with tracepoints in the kernel and in the program: a hit of one ends it (the kernel's watch filling
    the buffer; the program's pass count), and the probes of the other come out from inside that hit, where the
    CPU cannot look that code up (the program's with the kernel's context loaded, the kernel's from user mode): its
    translated code is dropped once the run, which ends at the next block, has ended (it stopped the machine)."""
    binary, symbols = program
    function, counter = symbols["counted_function"], symbols["counter"]
    caplog.set_level(logging.ERROR, logger="kgtp_sim")
    gdb = Gdb(binary, cpus=2)
    image = gdb.server.machine.image
    try:
        assert gdb.run_a_while(0.3).startswith(b"T02")
        gdb.ok(b"QTinit")
        gdb.ok(b"QTBuffer:size:1000")
        if ender == "kernel":  # the program's tracepoint collects nothing; a watch of the kernel's benchmark
            # count, written by kernel threads (the kernel's space loaded), fills the buffer
            gdb.ok(b"QTDP:1:%x:E:0:0:%s-" % (function, _x("const8 0; end")))
            gdb.ok(b"QTDP:-1:%x:M-1,%x,4" % (function, counter))
            watched = image.address_of("kgtp_counter")
            gdb.ok(b"QTDP:2:%x:E:0:0-" % watched)
            gdb.ok(b"QTDP:-2:%x:%s-" % (watched, _x(f"const8 1; setv {N['watch_static']:#x}; end")))
            gdb.ok(b"QTDP:-2:%x:%s-" % (watched, _x(f"const8 4; setv {N['watch_size']:#x}; end")))
            gdb.ok(b"QTDP:-2:%x:R01ffff" % watched)
        else:  # the kernel's benchmark function on its jump; the program's third hit ends the run
            kernel = image.address_of("kgtp_test_function")
            gdb.ok(b"QTDP:1:%x:E:0:3-" % function)
            gdb.ok(b"QTDP:-1:%x:M-1,%x,4" % (function, counter))
            gdb.ok(b"QTDP:2:%x:E:0:0:%s" % (kernel, _x("const8 0; end")))
        gdb.ok(b"QTStart")
        stop = gdb.run_a_while(0.5)
        status = gdb.ask(b"qTStatus")
        before = gdb.u32(counter)
        again = gdb.run_a_while(0.1)
        after = gdb.u32(counter)
        assert gdb.server.machine.stats(count=False).state != "crashed"
    finally:
        gdb.close()
    assert stop.startswith(b"T02") and again.startswith(b"T02"), (stop, again)
    assert status.startswith(b"T0;" + (b"tfull:" if ender == "kernel" else b"tpasscount:1")), status
    assert after > before
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("engine", ["interp", "opt"])
def test_a_thread_that_took_a_fast_tracepoints_jump_before_its_removal_goes_back_to_the_instruction(program, engine):
    """A thread switched out between a fast tracepoint's jump and its pad's int3 comes back to the pad after the
    run took the jump out: it goes on at the instruction's own place (as a removed uprobe's int3 under a thread),
    so its call is made and counted, and the program gets no SIGTRAP (the int3 once reached the kernel, whose
    #BP gave the traced program one: GDB saw T05 for its Ctrl-C). A compiled pad (opt) has no int3: the thread runs
    through it, its gate now a bare return, and on after the instruction."""
    binary, symbols = program
    function, counter = symbols["counted_function"], symbols["counter"]
    gdb = Gdb(binary, cpus=2, engine=engine)
    try:
        assert gdb.run_a_while(0.3).startswith(b"T02")
        gdb.ok(b"QTinit")
        gdb.ok(b"QTDP:1:%x:E:0:0:F7-" % function)
        gdb.ok(b"QTDP:-1:%x:M-1,%x,4" % (function, counter))
        gdb.ok(b"QTStart")
        assert gdb.run_a_while(0.1).startswith(b"T02")
        pad = gdb.server.tracer.probes.program.sites[function].pad
        thread = gdb.ask(b"qfThreadInfo")[1:].split(b",")[-1]  # (no multiprocess ids in this session)
        gdb.ok(b"Hg%s" % thread)
        # as if the thread had called counted_function and taken the jump, then been switched out before the pad's
        # int3: the return address pushed, and no system call restarted (orig_rax -1, as GDB's inferior calls)
        regs = gdb.ask(b"g")
        rip, rsp = (int.from_bytes(bytes.fromhex(regs[16 * n:16 * n + 16].decode()), "little") for n in (16, 7))
        gdb.ok(b"M%x,8:%s" % (rsp - 8, rip.to_bytes(8, "little").hex().encode()))  # (stopped after a syscall)
        for number, value in ((7, rsp - 8), (0x39, (1 << 64) - 1), (0x10, pad)):  # rsp, orig_rax, rip
            gdb.ok(b"P%x=%s" % (number, value.to_bytes(8, "little").hex().encode()))
        assert gdb.u32(counter) is not None
        gdb.ok(b"QTStop")
        before = gdb.u32(counter)
        stop = gdb.run_a_while(0.2)
        after = gdb.u32(counter)
        regs = gdb.ask(b"g")
        where = [hex(int.from_bytes(bytes.fromhex(regs[16 * n:16 * n + 16].decode()), "little")) for n in (16, 7)]
        assert gdb.server.machine.stats(count=False).state != "crashed"
    finally:
        gdb.close()
    assert stop.startswith(b"T02"), (stop, where, hex(pad), hex(rip), hex(rsp), hex(function))
    assert after > before
