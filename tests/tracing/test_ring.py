"""The trace ring: native reserve/commit (run in unicorn) and the Python writer obey the same rules."""

import struct

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from unicorn import UC_ARCH_X86, UC_MODE_64, UC_TLB_VIRTUAL, Uc
from unicorn.x86_const import UC_X86_REG_GS_BASE, UC_X86_REG_RAX, UC_X86_REG_RDI, UC_X86_REG_RDX, UC_X86_REG_RSI, UC_X86_REG_RSP

from kgtp_sim.tracing.core.frames import MemoryBlock, encode_block
from kgtp_sim.tracing.patching.detour import Runtime
from kgtp_sim.tracing.core.ring import (BLOCKS_AT, CTL_LIMIT, CTL_PHYS, DISCARD, ENTRY_HEADER, PAD_CPU, Rings, align8,
                                        short_path_fields)

CODE = 0xFFFFFFFFA0000000
DATA = 0xFFFFC90000100000
DATA_MAPPED = 0x100000
STACK = 0xFFFFC90000200000
RETURN = CODE + 0xF00  # a 'hlt' the routines return to
CONTROL = CODE + 0x1000  # the control area (ring.py)
PERCPU = STACK + 0xC00  # per-CPU areas, 0x10 bytes each


class UcMemory:
    def __init__(self, uc):
        self.uc = uc

    def read(self, address, length):
        return bytes(self.uc.mem_read(address, length))

    def write(self, address, data):
        self.uc.mem_write(address, data)


def machine(size: int, circular: bool, cpus: int = 1):
    """A bare CPU with the ring routines at CODE, the rings' control area after them (module space: native code
    reaches it with a disp32), `cpus` rings of `size` bytes at DATA, and a per-CPU area whose cpu_number is 0
    (`on_cpu` changes it, as a CPU switch changes GS base)."""
    assert cpus * size + 0x1000 <= DATA_MAPPED
    uc = Uc(UC_ARCH_X86, UC_MODE_64)
    uc.ctl_set_tlb_mode(UC_TLB_VIRTUAL)
    for base, length in ((CODE, 0x2000), (DATA, DATA_MAPPED), (STACK, 0x1000)):
        uc.mem_map(base, length)
    runtime = Runtime.build(CODE, CONTROL)
    uc.mem_write(CODE, runtime.code)
    uc.mem_write(RETURN, b"\xf4")
    on_cpu(uc, 0)
    rings = Rings(UcMemory(uc), CONTROL, cpus)
    rings.initialize(DATA, size, circular)
    return uc, (rings[0] if cpus == 1 else rings), runtime.commit


def on_cpu(uc, cpu: int) -> None:
    """Load CPU `cpu`: GS base at its per-CPU area, whose cpu_number (offset 8) is `cpu`."""
    area = PERCPU + 0x10 * cpu
    uc.mem_write(area + 8, cpu.to_bytes(4, "little"))
    uc.reg_write(UC_X86_REG_GS_BASE, area)


def short_fields(ring) -> bytes:
    """CTL_PHYS and CTL_LIMIT as short_path_fields gives them. A native writer's entry ending a lap leaves them
    at `base + size` and `head` (ring.py: no entry placed by them, the next writer takes the slow path, which
    writes both): that state reads as the fields it stands for."""
    phys, limit = (int.from_bytes(ring.memory.read(ring.field(f), 8), "little") for f in (CTL_PHYS, CTL_LIMIT))
    state = ring.state()
    if phys == state.base + state.size and state.head % state.size == 0 and limit == state.head:
        return short_path_fields(state.base, state.size, state.head, state.tail)
    return phys.to_bytes(8, "little") + limit.to_bytes(8, "little")


def call(uc, address, regs):
    uc.reg_write(UC_X86_REG_RSP, STACK + 0x800)
    uc.mem_write(STACK + 0x800, RETURN.to_bytes(8, "little"))
    for name, value in regs.items():
        uc.reg_write(name, value)
    uc.emu_start(address, RETURN, count=100_000)
    return uc.reg_read(UC_X86_REG_RAX), uc.reg_read(UC_X86_REG_RDX)


def native_append(uc, commit_at, tracepoint, blocks):
    where, limit = call(uc, CODE, {UC_X86_REG_RDI: tracepoint, UC_X86_REG_RSI: len(blocks)})
    if where == 0:
        return False
    assert limit == where + len(blocks)
    uc.mem_write(where, blocks)
    call(uc, commit_at, {UC_X86_REG_RDI: where + len(blocks)})
    return True


frames = st.lists(st.tuples(st.integers(1, 5), st.binary(max_size=300)), min_size=1, max_size=60)


@settings(max_examples=40, deadline=None)
@given(frames, st.booleans(), st.sampled_from([0x1000, 0x1238, 0x2000]))
def test_native_and_python_writers_agree(sequence, circular, size):
    native, native_ring, commit_at = machine(size, circular)
    python, python_ring, _ = machine(size, circular)
    accepted = []
    for tp, payload in sequence:
        blocks = encode_block(MemoryBlock(0x1000 + tp, payload))
        ok_native = native_append(native, commit_at, tp, blocks)
        ok_python = python_ring.append(tp, blocks, timestamp=0)
        assert ok_native == ok_python
        if ok_native:
            accepted.append((tp, payload))
    n_state, p_state = native_ring.state(), python_ring.state()
    for ring, state in ((native_ring, n_state), (python_ring, p_state)):  # the detours' short path relies on it
        assert short_fields(ring) == short_path_fields(state.base, state.size, state.head,
                                                                                state.tail)
    assert (n_state.head, n_state.tail, n_state.frames, n_state.created, n_state.full, n_state.discards) == (
        p_state.head, p_state.tail, p_state.frames, p_state.created, p_state.full, p_state.discards)
    entries = native_ring.entries()
    assert len(entries) == n_state.frames
    got = [(e.tracepoint, e.blocks[0].data) for e in entries]
    assert [(e.tracepoint, e.blocks) for e in entries] == [(e.tracepoint, e.blocks) for e in python_ring.entries()]
    if circular:
        assert got == accepted[len(accepted) - len(got):]  # the newest frames survive, in order
        assert n_state.created == len(accepted)
    else:
        assert got == accepted  # nothing evicted; what did not fit was refused
        assert n_state.full == (len(accepted) < len(sequence))
    assert [e.sequence for e in entries] == list(range(n_state.created - len(entries), n_state.created))


def test_full_non_circular_buffer_refuses_and_flags():
    uc, ring, commit_at = machine(0x1000, circular=False)
    blocks = encode_block(MemoryBlock(0, bytes(200)))
    accepted = 0
    while native_append(uc, commit_at, 1, blocks):
        accepted += 1
    state = ring.state()
    assert state.full and state.frames == accepted and accepted == 0x1000 // align8(BLOCKS_AT + len(blocks))


def test_frame_larger_than_half_the_ring_is_refused():
    uc, ring, commit_at = machine(0x1000, circular=True)
    assert not native_append(uc, commit_at, 1, bytes(0x900))
    assert not ring.append(1, bytes(0x900), timestamp=0)
    assert ring.state().frames == 0


def test_commit_stamps_timestamp_and_sequence():
    uc, ring, commit_at = machine(0x1000, circular=True)
    for _ in range(3):
        assert native_append(uc, commit_at, 7, encode_block(MemoryBlock(1, b"x")))
    entries = ring.entries()
    assert [e.sequence for e in entries] == [0, 1, 2]
    assert all(e.timestamp > 0 for e in entries)
    assert entries[0].timestamp <= entries[1].timestamp <= entries[2].timestamp


def test_bad_sizes_are_refused():
    uc, ring, _ = machine(0x1000, circular=False)
    with pytest.raises(ValueError):
        ring.initialize(DATA, 0x100, False)
    with pytest.raises(ValueError):
        ring.initialize(DATA, 0x1004, False)


@pytest.mark.parametrize("left", [8, 16])
def test_padding_shorter_than_an_entry_header_is_read_back(left):
    """The fuzzer's find: 8 or 16 bytes left before the ring's physical end become a padding entry shorter
    than an entry header; reading the ring must step over it, not fail on it."""
    uc, ring, commit_at = machine(0x1000, circular=True)
    def blocks(length: int) -> bytes:  # one memory block of exactly `length` bytes
        return encode_block(MemoryBlock(0x1000, bytes(length - 11)))

    half = 0x800  # the most one entry may take
    assert ring.append(1, blocks(half - BLOCKS_AT - 2), 0) and ring.append(2, blocks(half - left - BLOCKS_AT - 2), 0)
    assert ring.state().head == 0x1000 - left
    assert ring.append(3, blocks(16), 0)  # padding, the first entry evicted, this one at the start
    assert [f.tracepoint for f in ring.entries()] == [2, 3]
    native_append(uc, commit_at, 4, blocks(16))
    assert [f.tracepoint for f in ring.entries()] == [2, 3, 4]


#: entries that fill the 0x1000 ring to its last byte, the native one ending the lap; then consumed and written
#: again: the writer after `consume` must place its entry at the ring's start, not past its end
LAP_ENDS_NATIVELY = [(False, n, 0) for n in (1, 1, 8, 40, 56, 72, 96, 104, 160, 184, 200, 232, 240, 248, 256, 272,
                                            280, 288, 296)] + [(True, 104, 1), (True, 1, 0), (False, 1, 0)]
#: the same end of a lap, its oldest frame consumed before (the tail past the ring's start): the native writer
#: leaves CTL_LIMIT at head, below tail + size, until the next writer's slow path
LAP_ENDS_AFTER_CONSUME = [(False, n, 0) for n in (88, 120, 136, 152, 152, 168, 176, 184, 200, 200, 232, 240, 240, 264,
                                                  288)] + [(False, 288, 1), (True, 152, 0), (True, 80, 0)]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 300), st.integers(0, 3)), min_size=1, max_size=80))
@example(LAP_ENDS_NATIVELY)
@example(LAP_ENDS_AFTER_CONSUME)
def test_consuming_keeps_the_short_path_fields(steps):
    """Consumed frames free their room: the limit the detours' short path checks follows the tail, and every
    entry stays inside the ring."""
    uc, ring, commit_at = machine(0x1000, circular=False)
    for native, length, consume in steps:
        blocks = encode_block(MemoryBlock(0, bytes(length)))
        if native:
            native_append(uc, commit_at, 1, blocks)
        else:
            ring.append(1, blocks, timestamp=0)
        if consume:
            entries = ring.entries()
            if entries:
                ring.consume(entries[min(consume, len(entries)) - 1].sequence)
        state = ring.state()
        assert short_fields(ring) == short_path_fields(state.base, state.size, state.head,
                                                                                state.tail)
        assert all(f.blocks for f in ring.entries())  # parsed in place: none written past the end


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_circular_ring_that_must_evict_frees_a_page_more(native):
    """KGTP's ring discards a page at a time: one round of eviction leaves room for the entry and a page's worth
    (a quarter of a small ring) more, so the hits that follow write on the short path again."""
    size = 0x4000
    uc, ring, commit_at = machine(size, circular=True)
    blocks = encode_block(MemoryBlock(0, bytes(100)))
    need = align8(BLOCKS_AT + len(blocks))
    append = (lambda: native_append(uc, commit_at, 1, blocks)) if native else (lambda: ring.append(1, blocks, 0))
    while ring.state().discards == 0:
        before = ring.state()
        assert append()
    after = ring.state()
    assert before.free < need  # this one had to evict
    assert after.free >= DISCARD and after.discards == 1  # ... a page's worth more than it needed
    rounds = 0
    for _ in range(200):
        assert append()
        rounds = ring.state().discards
    assert 1 < rounds < 200 * need // DISCARD + 2  # about one round per page written, not one per entry


def test_each_cpu_writes_its_own_ring_and_wraps_alone():
    """Two CPUs on per-CPU rings: the routines pick the ring from %gs:0x8, stamp the writer's CPU, and a circular
    ring that wraps on one CPU leaves the other's frames alone (KGTP's per-CPU gtp_rb)."""
    uc, rings, commit_at = machine(0x1000, circular=True, cpus=2)
    blocks = encode_block(MemoryBlock(0x1000, bytes(0x40)))
    on_cpu(uc, 1)
    assert native_append(uc, commit_at, 7, blocks)
    first = rings[1].entries()[0].timestamp
    assert rings[1].append(8, blocks, timestamp=first + 1)  # the Python writer of CPU 1's ring
    on_cpu(uc, 0)
    for _ in range(200):  # CPU 0's ring laps several times
        assert native_append(uc, commit_at, 1, blocks)
    zero, one = rings[0].state(), rings[1].state()
    assert (one.frames, one.created, one.discards) == (2, 2, 0)
    assert zero.created == 200 and zero.frames < 200 and zero.discards > 0
    assert [(f.tracepoint, f.cpu, f.sequence) for f in rings[1].entries()] == [(7, 1, 0), (8, 1, 1)]
    assert {f.cpu for f in rings[0].entries()} == {0}
    total = rings.state()
    assert (total.frames, total.created, total.size) == (zero.frames + 2, 202, 0x2000)
    assert total.free == zero.free + one.free
    merged = rings.entries()
    assert [f.number for f in merged] == list(range(len(merged)))
    assert [(f.timestamp, f.cpu, f.sequence) for f in merged] == sorted((f.timestamp, f.cpu, f.sequence) for f in merged)


def test_a_full_ring_on_one_cpu_refuses_there_only():
    uc, rings, commit_at = machine(0x1000, circular=False, cpus=2)
    blocks = encode_block(MemoryBlock(0x1000, bytes(0x100)))
    while native_append(uc, commit_at, 1, blocks):
        pass
    assert rings[0].state().full and not rings[1].state().full
    on_cpu(uc, 1)
    assert native_append(uc, commit_at, 2, blocks)
    assert rings.state().full  # qTStatus: the run stops with tfull whichever CPU filled


def drained(raw) -> list[tuple[int, int]]:
    """(cpu, sequence) of each frame in a drain's bytes, padding entries stepped over."""
    out, at = [], 0
    while at < len(raw.data):
        length, cpu = struct.unpack_from("<II", raw.data, at)
        if cpu != PAD_CPU:
            out.append((cpu, ENTRY_HEADER.unpack_from(raw.data, at)[3]))
        at += length
    assert at == len(raw.data)  # whole entries only
    return out


def test_the_drain_reads_each_cpus_new_entries_and_skips_what_was_overwritten():
    """`read_since`: every CPU's committed bytes from the reader's position to head, whole entries; a position
    a circular ring lapped reads from the tail (the gap in sequences says what was lost); a position a new run
    no longer spans reads from the start."""
    uc, rings, commit_at = machine(0x1000, circular=True, cpus=2)
    blocks = encode_block(MemoryBlock(0x1000, bytes(0x40)))
    for cpu, count in ((0, 5), (1, 3)):
        on_cpu(uc, cpu)
        for _ in range(count):
            assert native_append(uc, commit_at, 1, blocks)
    raws = rings.read_since({})
    assert [drained(raw) for raw in raws] == [[(0, n) for n in range(5)], [(1, n) for n in range(3)]]
    assert [(raw.start, raw.created) for raw in raws] == [(0, 5), (0, 3)]
    positions = {raw.cpu: raw.head for raw in raws}
    on_cpu(uc, 0)
    assert native_append(uc, commit_at, 1, blocks)
    raws = rings.read_since(positions)
    assert [drained(raw) for raw in raws] == [[(0, 5)], []]
    positions = {raw.cpu: raw.head for raw in raws}
    for _ in range(100):  # CPU 0's ring laps past the reader
        assert native_append(uc, commit_at, 1, blocks)
    raw = rings.read_since(positions)[0]
    assert raw.start == raw.tail > positions[0]
    assert drained(raw) == [(0, f.sequence) for f in rings[0].entries()]
    assert drained(raw)[0][1] > 6 and drained(raw)[-1][1] == raw.created - 1 == 105
    rings.initialize(DATA, 0x1000, True)  # a new run: positions past the new head read from the start
    on_cpu(uc, 1)
    assert native_append(uc, commit_at, 1, blocks)
    assert [drained(raw) for raw in rings.read_since({0: 9999, 1: 9999})] == [[], [(1, 0)]]
