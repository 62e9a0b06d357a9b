"""The trace buffer: one ring of trace frames per CPU in emulated memory, written by native code and read by Python.

Native detours reserve an entry, let the compiled actions append blocks, then commit it; Python (the interpreter
engine, qTStatus, QTFrame, qTBuffer) reads and writes the same bytes with the same rules, so the two can never
disagree about what was collected. No thread of its own: writers run on the CPU thread (inside a hit), readers on
any thread through `Memory` (the machine's coherent reads).

Per CPU, as KGTP's `gtp_rb` (one ring per CPU, `per_cpu_ptr(gtp_rb, cpu)` in gtp_rb.c): CPU k writes only ring k
and its control fields, with no lock and no shared counter (`Rings`). The control fields of every CPU live in one
control area in module space laid out field by field: field F (a CTL_* offset) of CPU k is the u64 at
`ctl + F * MAX_CPUS + 8 * k` (`field_address`). So native code picks its CPU's fields with the CPU number itself,
`mov %gs:0x8, %r8d` (smp_processor_id(), smp.py) and `disp32(,%r8,8)` operands, which costs what the
`movabs $ctl, %r8` of a single ring cost, and keeps the number at hand for the entry's cpu field. The area must sit
in the top 2 GiB (module space) for the sign-extended disp32.

Positions are *logical*: `head` and `tail` only grow; the byte for logical position `p` lives at
`base + p % size`. An entry never wraps physically: when it would not fit before the end, a padding entry fills
the rest and the entry starts at physical 0. Entries are 8-byte aligned:

    u32 length (whole entry incl. this header)   u32 cpu (PAD_CPU for padding)
    u64 timestamp (TSC)                           u64 sequence number
    u16 tracepoint  u32 frame size  blocks...     (GDB's trace-frame format, what qTBuffer serves)

A frame may take at most half the ring. Circular mode evicts the oldest entries to make room, a page's worth
more than the entry needs (CTL_DISCARD); otherwise a frame that does not fit sets `full` and is dropped, which
stops the run with `tfull`. A frame the ring could never hold (more than half of it) sets `full` in either mode,
as gdbserver stops when it cannot allocate a frame even after discarding all the others.

One buffer for every CPU (`Rings(..., shared=True)`, the gdbserver role's: gdbserver has one trace buffer of the
size GDB asks for): a single ring, CPU 0's control fields, that every CPU's writer uses (the routines load 0
instead of the CPU number; the CPUs are interleaved on one host thread and never switched inside the tracer's
code, so no two writers are ever between reserve and commit at once). Each entry still names the CPU that wrote
it; its sequence number counts the buffer's frames. It may be smaller than MIN_SIZE (GDB may ask gdbserver for
a few bytes): a ring too small for any frame stops the run at its first hit, full.

A reader that keeps up with the writers (the follow channel's drain, `Rings.read_since`) takes each ring's
committed bytes from the logical position it reached to `head`, without parsing them.
"""

from __future__ import annotations

import heapq
import struct
from dataclasses import dataclass, replace
from typing import Protocol

from ...machine.smp import MAX_CPUS, PERCPU_CPU_NUMBER
from .frames import FRAME_HEADER, TraceFrame, parse_blocks

# Control block: u64 fields.
CTL_BASE = 0x00
CTL_SIZE = 0x08
CTL_HEAD = 0x10
CTL_TAIL = 0x18
CTL_FRAMES = 0x20
CTL_CREATED = 0x28
CTL_CIRCULAR = 0x30
CTL_FULL = 0x38
#: Kept by every writer for the detours' short path (`detour.py`, lean frames): the address of the byte at
#: `head`, and the logical position up to which an entry fits with no padding and no eviction,
#: min(tail + size, the end of head's lap). When an entry ends exactly at the end of a lap the native writers
#: leave CTL_PHYS at `base + size` (one add, no wrap on the hot path): CTL_LIMIT is then `head` itself, so no
#: entry is placed by it, and whatever raises the limit (the slow path, `consume`) writes both fields again.
CTL_PHYS = 0x40
CTL_LIMIT = 0x48
#: A circular ring that must evict frees this much more than the entry needs (or empties), as KGTP's ring
#: discards a page at a time: the hits that follow find room again on the short path. CTL_DISCARDS counts
#: those rounds (KGTP's `$gtp_rb_discard_page_number`).
CTL_DISCARD = 0x50
CTL_DISCARDS = 0x58
CTL_BYTES = 0x60
DISCARD = 0x1000
#: Bytes of the control area: CTL_BYTES of fields, one u64 per CPU each.
CONTROL_BYTES = CTL_BYTES * MAX_CPUS

ENTRY_HEADER = struct.Struct("<IIQQ")
#: Where ENTRY_HEADER's length (with the cpu after it), timestamp and sequence sit in an entry.
ENTRY_LENGTH, ENTRY_TIMESTAMP, ENTRY_SEQUENCE = 0x0, 0x8, 0x10
#: A padding entry (to the ring's physical end) is only its length and PAD_CPU: it may be as short as 8 bytes.
PAD_CPU = 0xFFFFFFFF
_PAD = struct.Struct("<II")
#: Offset of the GDB frame inside an entry, and of its first block.
FRAME_AT = ENTRY_HEADER.size
BLOCKS_AT = FRAME_AT + FRAME_HEADER.size
#: The smallest ring that still holds a frame with a full register block.
MIN_SIZE = 0x1000

_CTL = struct.Struct("<12Q")
_FIELDS = CTL_BYTES // 8


def field_address(ctl: int, field: int, cpu: int) -> int:
    """Where CPU `cpu`'s control field `field` (a CTL_* offset) is, in the control area at `ctl`."""
    return ctl + field * MAX_CPUS + 8 * cpu


def control_disp(ctl: int, field: int) -> str:
    """The disp32 of `field` for `disp(,%r8,8)` operands (r8 = the CPU number): signed, in hex."""
    address = field_address(ctl, field, 0)
    value = address - (1 << 64) if address >> 63 else address
    if not -(1 << 31) <= value < (1 << 31):
        raise ValueError(f"ring control area at {ctl:#x} is not in the top 2 GiB")
    return f"-{-value:#x}" if value < 0 else f"{value:#x}"


def align8(n: int) -> int:
    return (n + 7) & ~7


def short_path_fields(base: int, size: int, head: int, tail: int) -> bytes:
    """CTL_PHYS and CTL_LIMIT for these positions."""
    return struct.pack("<QQ", base + head % size, min(tail + size, head - head % size + size))


class Memory(Protocol):
    def read(self, address: int, length: int) -> bytes: ...

    def write(self, address: int, data: bytes) -> None: ...


@dataclass
class RingState:
    base: int
    size: int
    head: int
    tail: int
    frames: int
    created: int
    circular: bool
    full: bool
    discards: int = 0  # rounds of eviction (CTL_DISCARDS)

    @property
    def used(self) -> int:
        return self.head - self.tail

    @property
    def free(self) -> int:
        return self.size - self.used


def reserve_and_commit_asm(ctl: int, shared: bool = False) -> str:
    """AT&T source of two routines working on the ring of the CPU that runs them, its control fields in the
    control area at `ctl` (%r8 holds the CPU number, from %gs:0x8), or, `shared`, on the one ring every CPU
    writes (%r8 is 0; the entry's cpu field is still the writer's).

    `ring_reserve`: in %rdi = tracepoint number, %rsi = the most bytes of blocks the frame may hold; out %rax =
    address where blocks go (0: the frame does not fit, and `full` is set), %rdx = the limit for them. Clobbers
    rcx, rdx, r8-r11, flags. `ring_commit`: in %rdi = end of the blocks written; stamps sizes, timestamp and
    sequence, and publishes the entry. Interrupts must be off between the two (detours run with IF=0).
    Every number is written in hex: in AT&T mode the assembler reads decimal immediates and displacements
    as hex (`16(%r9)` became `0x16(%r9)`).
    """
    which = ("xor %r8d, %r8d                       /* the one ring of every CPU */" if shared else
             f"mov %gs:{PERCPU_CPU_NUMBER:#x}, %r8d       /* this CPU's ring */")
    writer = (f"mov %gs:{PERCPU_CPU_NUMBER:#x}, %eax\n    mov %eax, 0x4(%rdx)                  /* cpu: the writer's */"
              if shared else "mov %r8d, 0x4(%rdx)                  /* cpu: the writer's */")
    return f"""
ring_reserve:
    {which}
    lea {BLOCKS_AT + 7:#x}(%rsi), %r9
    and $-8, %r9                         /* need = align8(BLOCKS_AT + max) */
    lea (%r9,%r9), %rax                  /* at most half the ring, so padding + entry always fit */
    cmp {control_disp(ctl, CTL_SIZE)}(,%r8,8), %rax
    ja ring_full                         /* a frame the ring can never hold */
    mov {control_disp(ctl, CTL_HEAD)}(,%r8,8), %r10
    lea (%r10,%r9), %rax
    cmp {control_disp(ctl, CTL_LIMIT)}(,%r8,8), %rax
    ja ring_slow                         /* padding or eviction needed */
    mov {control_disp(ctl, CTL_PHYS)}(,%r8,8), %rdx         /* rdx = entry address */
    jmp ring_entry
ring_slow:
    mov %r10, %rax
    xor %edx, %edx
    divq {control_disp(ctl, CTL_SIZE)}(,%r8,8)              /* rdx = physical offset of head */
    mov {control_disp(ctl, CTL_SIZE)}(,%r8,8), %r11
    sub %rdx, %r11                       /* r11 = bytes to the physical end */
    cmp %r9, %r11
    jae ring_room
    add %r11, %r9                        /* padding + entry */
    mov %r11, %rcx                       /* remember the padding length */
    jmp ring_evict
ring_room:
    xor %ecx, %ecx
ring_evict:
    mov {control_disp(ctl, CTL_SIZE)}(,%r8,8), %rax
    sub %r10, %rax
    add {control_disp(ctl, CTL_TAIL)}(,%r8,8), %rax         /* rax = free = size - (head - tail) */
    cmp %r9, %rax
    jae ring_fits
    cmpq $0x0, {control_disp(ctl, CTL_CIRCULAR)}(,%r8,8)
    je ring_full
    incq {control_disp(ctl, CTL_DISCARDS)}(,%r8,8)
    add {control_disp(ctl, CTL_DISCARD)}(,%r8,8), %r9       /* evict until this much more is free, or the ring is empty */
ring_discard:
    mov {control_disp(ctl, CTL_TAIL)}(,%r8,8), %rax         /* evict the oldest entry */
    push %rdx
    xor %edx, %edx
    divq {control_disp(ctl, CTL_SIZE)}(,%r8,8)
    add {control_disp(ctl, CTL_BASE)}(,%r8,8), %rdx
    mov (%rdx), %r11d                    /* its length */
    cmpl $-1, 0x4(%rdx)
    pop %rdx
    je ring_evicted_pad
    decq {control_disp(ctl, CTL_FRAMES)}(,%r8,8)
ring_evicted_pad:
    add %r11, {control_disp(ctl, CTL_TAIL)}(,%r8,8)
    mov {control_disp(ctl, CTL_SIZE)}(,%r8,8), %rax
    sub %r10, %rax
    add {control_disp(ctl, CTL_TAIL)}(,%r8,8), %rax         /* free */
    cmp %r9, %rax
    jae ring_fits
    cmp %r10, {control_disp(ctl, CTL_TAIL)}(,%r8,8)
    jb ring_discard                      /* tail < head: more to evict */
ring_fits:
    test %rcx, %rcx
    je ring_place
    add {control_disp(ctl, CTL_BASE)}(,%r8,8), %rdx         /* write the padding entry */
    movl %ecx, (%rdx)
    movl $-1, 0x4(%rdx)
    add %rcx, %r10
    mov %r10, {control_disp(ctl, CTL_HEAD)}(,%r8,8)
    xor %edx, %edx
ring_place:
    mov %r10, %rax
    sub %rdx, %rax
    add {control_disp(ctl, CTL_SIZE)}(,%r8,8), %rax         /* the end of head's lap */
    mov {control_disp(ctl, CTL_TAIL)}(,%r8,8), %rcx
    add {control_disp(ctl, CTL_SIZE)}(,%r8,8), %rcx
    cmp %rax, %rcx
    cmovb %rcx, %rax
    mov %rax, {control_disp(ctl, CTL_LIMIT)}(,%r8,8)        /* min(tail + size, lap end) */
    add {control_disp(ctl, CTL_BASE)}(,%r8,8), %rdx         /* rdx = entry address */
    mov %rdx, {control_disp(ctl, CTL_PHYS)}(,%r8,8)
ring_entry:
    movw %di, {FRAME_AT:#x}(%rdx)
    lea {BLOCKS_AT:#x}(%rdx), %rax
    add %rsi, %rdx
    add ${BLOCKS_AT:#x}, %rdx            /* limit = blocks + max */
    ret
ring_full:
    movq $0x1, {control_disp(ctl, CTL_FULL)}(,%r8,8)
    xor %eax, %eax
    xor %edx, %edx
    ret

ring_commit:
    {which}
    mov {control_disp(ctl, CTL_PHYS)}(,%r8,8), %rdx         /* rdx = entry address */
    mov %rdi, %rcx
    sub %rdx, %rcx                       /* rcx = entry length before alignment */
    lea {-BLOCKS_AT:#x}(%rcx), %r9
    movl %r9d, {FRAME_AT + 2:#x}(%rdx)   /* frame size */
    add $0x7, %rcx
    and $-8, %rcx
    movl %ecx, (%rdx)
    {writer}
    mov %rdx, %r9
    rdtsc
    shl $0x20, %rdx
    or %rdx, %rax
    mov %rax, 0x8(%r9)
    mov {control_disp(ctl, CTL_CREATED)}(,%r8,8), %rax
    mov %rax, 0x10(%r9)
    incq {control_disp(ctl, CTL_CREATED)}(,%r8,8)
    incq {control_disp(ctl, CTL_FRAMES)}(,%r8,8)
    add %rcx, {control_disp(ctl, CTL_PHYS)}(,%r8,8)
    add %rcx, {control_disp(ctl, CTL_HEAD)}(,%r8,8)
    ret
"""


@dataclass
class Ring:
    """Python side of CPU `cpu`'s ring, its control fields in the control area at `ctl`, in emulated memory
    accessed through `memory`."""

    memory: Memory
    ctl: int
    cpu: int = 0

    def field(self, field: int) -> int:
        return field_address(self.ctl, field, self.cpu)

    def _put(self, **fields: int) -> None:
        for name, value in fields.items():
            self.memory.write(self.field(globals()["CTL_" + name.upper()]), struct.pack("<Q", value))

    def initialize(self, base: int, size: int, circular: bool) -> None:
        if size < MIN_SIZE or size % 8:
            raise ValueError(f"trace buffer size must be a multiple of 8 of at least {MIN_SIZE} bytes")
        values = (base, size, 0, 0, 0, 0, int(circular), 0, base, size, min(DISCARD, size // 4), 0)
        for index, value in enumerate(values):
            self.memory.write(self.field(8 * index), struct.pack("<Q", value))

    def state(self) -> RingState:
        return self._parse_state(self.memory.read(self.ctl, CONTROL_BYTES), self.cpu)

    @staticmethod
    def _parse_state(control: bytes, cpu: int) -> RingState:
        fields = struct.unpack_from(f"<{_FIELDS * MAX_CPUS}Q", control)
        base, size, head, tail, frames, created, circular, full, _, _, _, discards = (
            fields[index * MAX_CPUS + cpu] for index in range(12))
        return RingState(base, size, head, tail, frames, created, bool(circular), bool(full), discards)

    def set_circular(self, circular: bool) -> None:
        self._put(circular=int(circular))

    def entries(self) -> list[TraceFrame]:
        """Every frame in the ring, oldest first, numbered by its position (see `Rings.entries`)."""
        base, size = self.state().base, self.state().size
        ring, control = _read_together(self.memory, [(base, size), (self.ctl, CONTROL_BYTES)])
        return self._parse(ring, self._parse_state(control, self.cpu))

    def _parse(self, ring: bytes, state: RingState) -> list[TraceFrame]:
        frames: list[TraceFrame] = []
        pos = state.tail
        while pos < state.head:
            phys = pos % state.size
            length, cpu = _PAD.unpack_from(ring, phys)  # padding may be shorter than an entry header
            if length < _PAD.size or length % 8 or (cpu != PAD_CPU and length < BLOCKS_AT):
                raise ValueError(f"corrupt trace buffer entry at logical {pos:#x} (length {length})")
            if cpu != PAD_CPU:
                _, _, timestamp, sequence = ENTRY_HEADER.unpack_from(ring, phys)
                tracepoint, size = FRAME_HEADER.unpack_from(ring, phys + FRAME_AT)
                body = ring[phys + BLOCKS_AT : phys + BLOCKS_AT + size]
                frames.append(TraceFrame(len(frames), tracepoint, parse_blocks(body), timestamp, cpu, sequence))
            pos += length
        return frames

    def consume(self, through_sequence: int) -> int:
        """Drop the oldest entries up to and including the frame created `through_sequence`-th on this CPU (a
        consuming reader, as KGTP's frame pipe): their room is free again. Must run between two instructions on
        the CPU thread with no hit between reserve and commit (`Tracer.consume_frames`). Returns the frames
        dropped."""
        state = self.state()
        tail, frames, dropped = state.tail, state.frames, 0
        while tail < state.head:
            phys = state.base + tail % state.size
            length, cpu = _PAD.unpack(self.memory.read(phys, _PAD.size))
            if cpu != PAD_CPU:
                _, _, _, sequence = ENTRY_HEADER.unpack(self.memory.read(phys, ENTRY_HEADER.size))
                if sequence > through_sequence:
                    break
                frames -= 1
                dropped += 1
            tail += length
        if dropped:
            phys, limit = struct.unpack("<QQ", short_path_fields(state.base, state.size, state.head, tail))
            self._put(tail=tail, frames=frames, phys=phys, limit=limit)
        return dropped

    def append(self, tracepoint: int, blocks: bytes, timestamp: int, writer: int | None = None) -> bool:
        """Python-side writer with the same rules as the native routines (used by the interpreter engine); the
        entry's cpu field is `writer`, by default this ring's CPU. False: the frame does not fit (`full` is then
        set, unless a circular ring wrapped)."""
        state = self.state()
        need = align8(BLOCKS_AT + len(blocks))
        if 2 * need > state.size:  # never fits, as ring_reserve
            self._put(full=1)
            return False
        head, tail, frames = state.head, state.tail, state.frames
        to_end = state.size - head % state.size
        pad = to_end if to_end < need else 0
        if state.size - (head - tail) < need + pad:
            if not state.circular:
                self._put(full=1)
                return False
            discard = struct.unpack("<Q", self.memory.read(self.field(CTL_DISCARD), 8))[0]
            self._put(discards=state.discards + 1)
            while tail < head and state.size - (head - tail) < need + pad + discard:
                phys = state.base + tail % state.size
                length, cpu_field = _PAD.unpack(self.memory.read(phys, _PAD.size))
                if cpu_field != PAD_CPU:
                    frames -= 1
                tail += length
        if pad:
            self.memory.write(state.base + head % state.size, _PAD.pack(pad, PAD_CPU))
            head += pad
        phys = state.base + head % state.size
        cpu = self.cpu if writer is None else writer
        entry = ENTRY_HEADER.pack(need, cpu, timestamp, state.created) + FRAME_HEADER.pack(tracepoint, len(blocks))
        self.memory.write(phys, entry + blocks)
        phys, limit = struct.unpack("<QQ", short_path_fields(state.base, state.size, head + need, tail))
        self._put(head=head + need, tail=tail, frames=frames + 1, created=state.created + 1, phys=phys, limit=limit)
        return True


def _read_together(memory: Memory, ranges: list[tuple[int, int]]) -> list[bytes]:
    """Several ranges read at one instant when the memory can (`read_many`: one trip to the CPU thread, between
    two instructions, so a live circular run cannot evict what is being parsed)."""
    read_many = getattr(memory, "read_many", None)
    if read_many is not None:
        return read_many(ranges)
    return [memory.read(address, length) for address, length in ranges]


@dataclass(frozen=True)
class RawEntries:
    """One CPU's committed entries between two logical positions, as the ring holds them (`Rings.read_since`).

    `data` is the bytes of [start, head) in logical order: whole entries, padding entries included (the ring's
    physical end falls between entries). `start` is the reader's position, or the ring's tail when a circular
    ring overwrote entries the reader had not read (their sequence numbers are then missing from the data).
    `created` is how many frames the CPU had committed at the read: the last entry's sequence is `created - 1`.
    """

    cpu: int
    start: int
    head: int
    tail: int
    created: int
    size: int  #: the ring's size
    data: bytes


def merge_key(frame: TraceFrame) -> tuple[int, int, int]:
    """Frames of several CPUs in one order: by timestamp, ties broken by CPU, then by sequence."""
    return frame.timestamp, frame.cpu, frame.sequence


@dataclass
class Rings:
    """Every CPU's ring, seen as one trace buffer, as GDB sees KGTP's per-CPU buffers.

    - Each CPU's ring has `size` bytes (QTBuffer:size and `--buffer-size` set each CPU's size; KGTP allocates
      GTP_FRAME_SIZE for every CPU, gtp_rb_page_alloc) and is circular or not on its own: a CPU wraps without
      touching another's frames.
    - qTStatus (`state`) reports what KGTP's gtp_get_status does: frames and created summed over CPUs, tsize
      the per-CPU size times the CPUs, tfree the free bytes summed; a non-circular ring that fills stops the
      run with tfull (KGTP's gtp_stop_frame_full, whichever CPU filled).
    - Frames (`entries`) are every ring's, merged by timestamp (ties: CPU, then the CPU's sequence), each CPU's
      in its ring's order, and numbered in that order: what tfind, tdump, qTBuffer/tsave, the follow channel and
      the export see. A frame's `sequence` is its CPU's creation count (unique with its `cpu`).

    `shared` (gdbserver's one buffer, see the module): a single ring of `size` bytes for the `count` CPUs, whose
    frames are in the order they were committed and whose sequences count the buffer's frames; qTStatus's
    tsize and tfree are its own.
    """

    memory: Memory
    ctl: int
    count: int
    shared: bool = False

    def __post_init__(self) -> None:
        self.rings = [Ring(self.memory, self.ctl, cpu) for cpu in range(1 if self.shared else self.count)]

    def __getitem__(self, cpu: int) -> Ring:
        return self.rings[cpu]

    def initialize(self, base: int, size: int, circular: bool) -> None:
        """The rings' bytes: `count` rings of `size` bytes from `base`, CPU 0's first (shared: one ring, of any
        size that is a multiple of 8)."""
        fields = [0] * (_FIELDS * MAX_CPUS)
        for cpu in range(len(self.rings)):
            start = base + cpu * size
            smallest = 8 if self.shared else MIN_SIZE
            if size % 8 or size < smallest:
                raise ValueError(f"trace buffer size must be a multiple of 8 of at least {smallest} bytes")
            values = (start, size, 0, 0, 0, 0, int(circular), 0, start, size, min(DISCARD, size // 4), 0)
            for index, value in enumerate(values):
                fields[index * MAX_CPUS + cpu] = value
        self.memory.write(self.ctl, struct.pack(f"<{len(fields)}Q", *fields))

    def states(self) -> list[RingState]:
        control = self.memory.read(self.ctl, CONTROL_BYTES)
        return [Ring._parse_state(control, cpu) for cpu in range(len(self.rings))]

    def state(self) -> RingState:
        """The rings summed as qTStatus reports them (`free` and `size` over every CPU)."""
        states = self.states()
        first = states[0]
        return RingState(first.base, sum(s.size for s in states), sum(s.head for s in states),
                         sum(s.tail for s in states), sum(s.frames for s in states),
                         sum(s.created for s in states), first.circular, any(s.full for s in states),
                         sum(s.discards for s in states))

    def set_circular(self, circular: bool) -> None:
        for ring in self.rings:
            ring.set_circular(circular)

    def entries(self) -> list[TraceFrame]:
        """Every CPU's frames in one snapshot (one trip to the CPU thread), merged (see the class)."""
        states = self.states()
        base = states[0].base
        total = sum(s.size for s in states)
        raw, control = _read_together(self.memory, [(base, total), (self.ctl, CONTROL_BYTES)])
        per_cpu = []
        for cpu, ring in enumerate(self.rings):
            state = Ring._parse_state(control, cpu)
            start = state.base - base
            per_cpu.append(ring._parse(raw[start : start + state.size], state))
        if len(per_cpu) == 1:
            return per_cpu[0]
        merged = list(heapq.merge(*per_cpu, key=merge_key))
        return [replace(frame, number=index) for index, frame in enumerate(merged)]

    def read_since(self, positions: dict[int, int]) -> list[RawEntries]:
        """Every CPU's entries committed since its logical position in `positions` (a `head` an earlier read
        returned; a CPU left out, or a position the ring no longer spans after a new tstart, reads from the
        tail), read at one instant (one trip to the CPU thread when the memory can: `atomically`). A reader
        that drains the rings this way parses nothing here; what it got ends at `head`, where its next read
        begins. Entries a circular ring evicted before they were read are skipped: `start` is then the tail."""

        def read_all(read) -> list[RawEntries]:
            control = read(self.ctl, CONTROL_BYTES)
            out = []
            for cpu in range(len(self.rings)):
                state = Ring._parse_state(control, cpu)
                position = positions.get(cpu, state.tail)
                start = position if state.tail <= position <= state.head else state.tail
                pieces, at = [], start
                while at < state.head:  # at most two pieces: to the ring's physical end, then from its start
                    phys = at % state.size
                    length = min(state.head - at, state.size - phys)
                    pieces.append(read(state.base + phys, length))
                    at += length
                out.append(RawEntries(cpu, start, state.head, state.tail, state.created, state.size,
                                      b"".join(pieces)))
            return out

        atomically = getattr(self.memory, "atomically", None)
        return atomically(read_all) if atomically is not None else read_all(self.memory.read)

    def consume(self, through: dict[int, int]) -> int:
        """Drop each CPU's frames up to its sequence in `through` (cpu -> sequence). Returns the frames dropped."""
        return sum(self.rings[cpu].consume(sequence) for cpu, sequence in through.items() if cpu < len(self.rings))

    def append(self, tracepoint: int, blocks: bytes, timestamp: int, cpu: int = 0) -> bool:
        """A frame written by CPU `cpu` (its ring, or the shared one)."""
        return self.rings[0 if self.shared else cpu].append(tracepoint, blocks, timestamp, writer=cpu)
