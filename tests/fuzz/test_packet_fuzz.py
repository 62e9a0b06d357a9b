"""Fuzzing every packet parser and handler of a real stub (kgtp_sim.app.Stub: its dispatcher, the tracer and
the kernel), QTDP and QTFrame above all, through a Session as the TCP server feeds it.

Inputs: structured packets for each packet class the dispatcher reaches (kgtp_sim/tools/fuzz_inputs.py has the
grammars), mutations of the requests real GDB sent (fixtures/transcripts), random bodies after valid prefixes,
and whole tracing sessions (define, start, let the kernel hit the probes, select frames, read the buffer).
Property, after every packet: it was answered (E.., empty or a reply), no handler failed (the dispatcher's
last-resort E0f and its logged traceback count as a crash), and the session still serves the next packet
(QTFrame:ffffffff answers OK, `m` of jiffies answers 8 bytes). The kernel keeps computing: the sessions check
kgtp_bench_loop's result and kgtp_counter, and a run against the started machine checks that jiffies advances.

The bugs this fuzzer found have a test each at the end of this file (and in tests/tracing/test_probe_sweep.py
for runs changed while a hit is in flight). `scripts/fuzz` runs the same generators for minutes.
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kgtp_sim.app import Stub, StubConfig
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.tools import fuzz
from kgtp_sim.tools.fuzz import Generator, Harness, Vocabulary, reachable_packet_classes, seed_packets

from ..conftest import VMLINUX

EXTRA = int(os.environ.get("KGTP_FUZZ_EXAMPLES", "0"))
IMAGE = KernelImage.load(VMLINUX)
SITE = IMAGE.address_of("kgtp_test_function")
VOCAB = Vocabulary.from_image(IMAGE)
SEEDS = seed_packets()
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def examples(default: int) -> int:
    return max(default, EXTRA)


def new_stub(engine: str = "opt") -> Stub:
    return Stub(Machine(IMAGE), StubConfig(engine=engine))


CLASSES = reachable_packet_classes(new_stub().dispatcher)


@pytest.fixture(scope="module")
def harness():
    """One stub for the whole module, its kernel not running: every outcome is deterministic (the sessions
    below run the kernel themselves with machine.call)."""
    h = Harness(new_stub(), started=False)
    yield h
    h.close()


def test_every_packet_class_of_the_stub_is_fuzzed():
    assert len(CLASSES) >= 55
    prefixes = {c.PREFIX for c in CLASSES}
    assert {b"QTDP:", b"QTDP:-", b"QTFrame:", b"QTFrame:pc:", b"qTBuffer:", b"m", b"X", b"qRcmd,"} <= prefixes
    # every class has a real GDB packet among the seeds, or is reached through the structured generator
    assert len(SEEDS) > 60 and all(s.startswith(tuple(prefixes)) or s in (b"?",) for s in SEEDS)


@pytest.mark.parametrize("packet_class", CLASSES, ids=lambda c: c.__name__)
@settings(max_examples=examples(25), **SETTINGS)
@given(rng=st.randoms(use_true_random=False), raw=st.binary(max_size=48))
def test_each_packet_class(harness, packet_class, rng, raw):
    harness.packet(fuzz.structured(rng, packet_class, VOCAB), "structured")
    harness.packet(packet_class.PREFIX + raw, "random")


@settings(max_examples=examples(300), **SETTINGS)
@given(rng=st.randoms(use_true_random=False))
def test_mutations_of_real_gdb_packets(harness, rng):
    seed = rng.choice(SEEDS)
    harness.packet(fuzz.mutate(rng, seed, SEEDS), "mutation")


@settings(max_examples=examples(300), **SETTINGS)
@given(rng=st.randoms(use_true_random=False))
def test_qtdp_create_and_actions(harness, rng):
    harness.packet(fuzz.qtdp(rng, VOCAB), "qtdp")
    harness.packet(fuzz.qtdp_actions(rng, VOCAB), "qtdp")
    if len(harness.stub.tracer.definitions.tracepoints) > 8:
        harness.packet(b"QTinit", "qtdp")


@settings(max_examples=examples(200), **SETTINGS)
@given(rng=st.randoms(use_true_random=False), raw=st.binary(max_size=64))
def test_damaged_framing(harness, rng, raw):
    harness.raw(fuzz.damaged_frame(rng, raw if rng.random() < 0.5 else rng.choice(SEEDS)))


@pytest.fixture(scope="module")
def session_harness():
    h = Harness(new_stub(), started=False)
    yield h
    h.close()


@settings(max_examples=examples(60), **SETTINGS)
@given(rng=st.randoms(use_true_random=False), engine=st.sampled_from(["interp", "naive", "opt"]))
def test_tracing_sessions_with_fuzzed_definitions_and_frame_selection(session_harness, rng, engine):
    """QTinit, fuzzed and real definitions, QTStart, the kernel hitting the probes, then fuzzed QTFrame,
    qTBuffer and friends over real frames, QTStop: each answered, the session alive, the kernel exact."""
    h = session_harness
    machine = h.machine
    h.packet(("qRcmd," + f"engine {engine}".encode().hex()).encode(), "session")
    h.packet(b"QTinit", "session")
    real = [b"QTDP:1:%x:E:0:0-" % SITE, b"QTDP:-1:%x:R01ffff" % SITE]  # one sure tracepoint with frames
    for packet in real:
        assert h.packet(packet, "session")[-1] == b"OK"
    for _ in range(rng.randrange(0, 5)):
        maker = rng.choice((fuzz.qtdp, fuzz.qtdp_actions, lambda r, v: fuzz.mutate(r, r.choice(SEEDS), SEEDS)))
        h.packet(maker(rng, VOCAB), "session")
    started = h.packet(b"QTStart", "session")[-1]
    counter = machine.read_symbol("kgtp_counter")
    assert machine.call("kgtp_bench_loop", 5, max_instructions=20_000_000) == 5  # the kernel computes exactly
    assert machine.read_symbol("kgtp_counter") == counter + 5
    status = h.packet(b"qTStatus", "session")[-1]
    assert status.startswith((b"T0", b"T1")), status
    h.packet(b"QTStop", "session")
    if started == b"OK" and b"tframes:0;" not in status:
        assert h.packet(b"QTFrame:0", "session")[-1].startswith(b"F0T")
    for _ in range(rng.randrange(1, 8)):
        cls = rng.choice([c for c in CLASSES if c.PREFIX.startswith((b"QTFrame", b"qTBuffer", b"qXfer:t",
                                                                     b"qXfer:s", b"qTV", b"qTP", b"g", b"m"))])
        h.packet(fuzz.structured(rng, cls, VOCAB), "session")
    h.packet(b"QTFrame:ffffffff", "session")


@pytest.mark.slow
def test_a_fuzz_run_against_the_running_kernel_leaves_it_running():
    """The campaign of scripts/fuzz in small: the kernel runs on its own threads (timer, scheduler, workload),
    probes fire for real while packets arrive; at the end jiffies has advanced and nothing crashed."""
    stub = new_stub()
    h = Harness(stub, started=True)
    try:
        generator = Generator(CLASSES, SEEDS, VOCAB)
        rng = random.Random(0x6B677470)
        for _ in range(examples(1500)):
            source, payload = generator.packet(rng)
            if rng.random() < 0.85:
                h.packet(payload, source)
            else:
                h.raw(fuzz.damaged_frame(rng, payload))
        assert h.figures.packets > 1000 and h.figures.answered_error > 100 and h.figures.answered_ok > 100
        jiffies = h.kernel_alive()
        assert jiffies > h.first_jiffies
        assert stub.machine.stats().state in ("running", "idle")
    finally:
        h.close()
        stub.machine.shutdown()


# ---- bugs this fuzzer found, fixed ------------------------------------------------------------------------------------


def dispatch(stub: Stub, payload: bytes) -> bytes:
    reply = stub.dispatcher.dispatch(payload)
    assert isinstance(reply, bytes), reply
    return reply


def test_a_trace_variable_number_too_large_is_refused_cleanly():
    """Bytecode names variables in 16 bits: a larger number is refused, never sized into a huge array."""
    stub = new_stub()
    assert dispatch(stub, b"QTDV:ffffffff:0:0:" + b"big".hex().encode()) == b"E01"
    for payload in (b"QTDP:1:%x:E:0:0" % SITE, b"QTStart"):
        assert dispatch(stub, payload) == b"OK", payload
    dispatch(stub, b"QTinit")
    for payload in (b"QTDP:1:%x:E:0:0" % SITE, b"QTStart"):
        assert dispatch(stub, payload) == b"OK", payload  # and a good experiment works again afterwards


def test_a_client_cannot_make_its_variable_outlive_qtinit():
    """Only the stub's own variables are built-in; a client's builtin flag must not pin one across QTinit."""
    stub = new_stub()
    assert dispatch(stub, b"QTDV:7f:5:1:" + b"mine".hex().encode()) == b"OK"
    assert 0x7F in stub.tracer.definitions.variables
    dispatch(stub, b"QTinit")
    assert 0x7F not in stub.tracer.definitions.variables
    assert any(v.builtin for v in stub.tracer.definitions.variables.values())  # the stub's own stay


@pytest.mark.parametrize("engine", ["interp", "opt"])
def test_tracepoint_numbers_beyond_16_bits_are_refused_or_kept(engine):
    stub = new_stub(engine)
    replies = [dispatch(stub, p) for p in (b"QTinit", b"QTDP:10001:%x:E:0:0" % SITE, b"QTStart")]
    if replies[1].startswith(b"E") or replies[2].startswith(b"E"):
        return  # refused with an error: fine
    assert stub.machine.call("kgtp_bench_loop", 3) == 3
    dispatch(stub, b"QTStop")
    assert dispatch(stub, b"QTFrame:0") == b"F0T10001"


@pytest.mark.parametrize("engine", ["naive", "opt"])
def test_pass_counts_of_2_31_and_more_work_in_native_engines(engine):
    stub = new_stub(engine)
    for payload in (b"QTinit", b"QTDP:1:%x:E:0:80000000" % SITE, b"QTStart"):
        assert dispatch(stub, payload) == b"OK", payload
    assert stub.machine.call("kgtp_bench_loop", 3) == 3
    assert dispatch(stub, b"qTStatus").startswith(b"T1;tnotrun:0;tframes:3;")


@pytest.mark.parametrize("engine", ["interp", "opt"])
def test_frames_read_while_the_kernel_runs_are_a_consistent_snapshot(engine):
    machine = Machine(IMAGE)
    machine.call("kgtp_bench_loop", 0)
    stub = Stub(machine, StubConfig(engine=engine))
    loop = IMAGE.address_of("kgtp_bench_loop")
    counter = IMAGE.address_of("kgtp_counter")
    for payload in (b"QTinit", b"QTBuffer:circular:1", b"QTBuffer:size:1000", b"QTDP:1:%x:E:0:0-" % SITE,
                    b"QTDP:-1:%x:R01ffff" % SITE, b"QTDP:2:%x:E:0:0-" % loop, b"QTDP:-2:%x:M-1,%x,4" % (loop, counter),
                    b"QTStart"):
        assert dispatch(stub, payload) == b"OK", payload
    machine.call("kgtp_bench_loop", 30)
    # the kernel runs between the stub's two reads, as the CPU thread does between two requests
    memory = stub.tracer.ring.memory
    read, reads = memory.read, []

    def read_while_running(address, length):
        data = read(address, length)
        reads.append(address)
        if address == stub.tracer.ring.ctl and len(reads) == 2:
            machine.call("kgtp_bench_loop", 3)
        return data

    memory.read = read_while_running
    frames = stub.tracer.frames()
    sequences = [f.sequence for f in frames]
    assert sequences == sorted(set(sequences)) and sequences[-1] - sequences[0] == len(frames) - 1
    assert all(f.tracepoint in (1, 2) for f in frames)
