"""The trace buffer: a ring of trace frames in emulated memory, written by native code and read by Python.

Native detours reserve an entry, let the compiled actions append blocks, then commit it; Python (the interpreter
engine, qTStatus, QTFrame, qTBuffer) reads and writes the same bytes with the same rules, so the two can never
disagree about what was collected.

Positions are *logical*: `head` and `tail` only grow; the byte for logical position `p` lives at
`base + p % size`. An entry never wraps physically: when it would not fit before the end, a padding entry fills
the rest and the entry starts at physical 0. Entries are 8-byte aligned:

    u32 length (whole entry incl. this header)   u32 cpu (PAD_CPU for padding)
    u64 timestamp (TSC)                           u64 sequence number
    u16 tracepoint  u32 frame size  blocks...     (GDB's trace-frame format, what qTBuffer serves)

A frame may take at most half the ring. Circular mode evicts the oldest entries to make room, a page's worth
more than the entry needs (CTL_DISCARD); otherwise a frame that does not fit sets `full` and is dropped, which
stops the run with `tfull`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Protocol

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
#: min(tail + size, the end of head's lap).
CTL_PHYS = 0x40
CTL_LIMIT = 0x48
#: A circular ring that must evict frees this much more than the entry needs (or empties), as KGTP's ring
#: discards a page at a time: the hits that follow find room again on the short path. CTL_DISCARDS counts
#: those rounds (KGTP's `$gtp_rb_discard_page_number`).
CTL_DISCARD = 0x50
CTL_DISCARDS = 0x58
CTL_BYTES = 0x60
DISCARD = 0x1000

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


def reserve_and_commit_asm(ctl: int) -> str:
    """AT&T source of two routines sharing the control block at `ctl`.

    `ring_reserve`: in %rdi = tracepoint number, %rsi = the most bytes of blocks the frame may hold; out %rax =
    address where blocks go (0: no room, or not circular and full), %rdx = the limit for them. Clobbers rcx,
    rdx, r8-r11, flags. `ring_commit`: in %rdi = end of the blocks written; stamps sizes, timestamp and
    sequence, and publishes the entry. Interrupts must be off between the two (detours run with IF=0).
    Every number is written in hex: in AT&T mode the assembler reads decimal immediates and displacements
    as hex (`16(%r9)` became `0x16(%r9)`).
    """
    return f"""
ring_reserve:
    movabs ${ctl:#x}, %r8
    lea {BLOCKS_AT + 7:#x}(%rsi), %r9
    and $-8, %r9                         /* need = align8(BLOCKS_AT + max) */
    lea (%r9,%r9), %rax                  /* at most half the ring, so padding + entry always fit */
    cmp {CTL_SIZE:#x}(%r8), %rax
    ja ring_fail
    mov {CTL_HEAD:#x}(%r8), %r10
    lea (%r10,%r9), %rax
    cmp {CTL_LIMIT:#x}(%r8), %rax
    ja ring_slow                         /* padding or eviction needed */
    mov {CTL_PHYS:#x}(%r8), %rdx         /* rdx = entry address */
    jmp ring_entry
ring_slow:
    mov %r10, %rax
    xor %edx, %edx
    divq {CTL_SIZE:#x}(%r8)              /* rdx = physical offset of head */
    mov {CTL_SIZE:#x}(%r8), %r11
    sub %rdx, %r11                       /* r11 = bytes to the physical end */
    cmp %r9, %r11
    jae ring_room
    add %r11, %r9                        /* padding + entry */
    mov %r11, %rcx                       /* remember the padding length */
    jmp ring_evict
ring_room:
    xor %ecx, %ecx
ring_evict:
    mov {CTL_SIZE:#x}(%r8), %rax
    sub %r10, %rax
    add {CTL_TAIL:#x}(%r8), %rax         /* rax = free = size - (head - tail) */
    cmp %r9, %rax
    jae ring_fits
    cmpq $0x0, {CTL_CIRCULAR:#x}(%r8)
    je ring_full
    incq {CTL_DISCARDS:#x}(%r8)
    add {CTL_DISCARD:#x}(%r8), %r9       /* evict until this much more is free, or the ring is empty */
ring_discard:
    mov {CTL_TAIL:#x}(%r8), %rax         /* evict the oldest entry */
    push %rdx
    xor %edx, %edx
    divq {CTL_SIZE:#x}(%r8)
    add {CTL_BASE:#x}(%r8), %rdx
    mov (%rdx), %r11d                    /* its length */
    cmpl $-1, 0x4(%rdx)
    pop %rdx
    je ring_evicted_pad
    decq {CTL_FRAMES:#x}(%r8)
ring_evicted_pad:
    add %r11, {CTL_TAIL:#x}(%r8)
    mov {CTL_SIZE:#x}(%r8), %rax
    sub %r10, %rax
    add {CTL_TAIL:#x}(%r8), %rax         /* free */
    cmp %r9, %rax
    jae ring_fits
    cmp %r10, {CTL_TAIL:#x}(%r8)
    jb ring_discard                      /* tail < head: more to evict */
ring_fits:
    test %rcx, %rcx
    je ring_place
    add {CTL_BASE:#x}(%r8), %rdx         /* write the padding entry */
    movl %ecx, (%rdx)
    movl $-1, 0x4(%rdx)
    add %rcx, %r10
    mov %r10, {CTL_HEAD:#x}(%r8)
    xor %edx, %edx
ring_place:
    mov %r10, %rax
    sub %rdx, %rax
    add {CTL_SIZE:#x}(%r8), %rax         /* the end of head's lap */
    mov {CTL_TAIL:#x}(%r8), %rcx
    add {CTL_SIZE:#x}(%r8), %rcx
    cmp %rax, %rcx
    cmovb %rcx, %rax
    mov %rax, {CTL_LIMIT:#x}(%r8)        /* min(tail + size, lap end) */
    add {CTL_BASE:#x}(%r8), %rdx         /* rdx = entry address */
    mov %rdx, {CTL_PHYS:#x}(%r8)
ring_entry:
    movw %di, {FRAME_AT:#x}(%rdx)
    lea {BLOCKS_AT:#x}(%rdx), %rax
    add %rsi, %rdx
    add ${BLOCKS_AT:#x}, %rdx            /* limit = blocks + max */
    ret
ring_full:
    movq $0x1, {CTL_FULL:#x}(%r8)
ring_fail:
    xor %eax, %eax
    xor %edx, %edx
    ret

ring_commit:
    movabs ${ctl:#x}, %r8
    mov {CTL_PHYS:#x}(%r8), %rdx         /* rdx = entry address */
    mov %rdi, %rcx
    sub %rdx, %rcx                       /* rcx = entry length before alignment */
    lea {-BLOCKS_AT:#x}(%rcx), %r9
    movl %r9d, {FRAME_AT + 2:#x}(%rdx)   /* frame size */
    add $0x7, %rcx
    and $-8, %rcx
    movl %ecx, (%rdx)
    movl $0x0, 0x4(%rdx)                   /* cpu: the machine has one */
    mov %rdx, %r9
    rdtsc
    shl $0x20, %rdx
    or %rdx, %rax
    mov %rax, 0x8(%r9)
    mov {CTL_CREATED:#x}(%r8), %rax
    mov %rax, 0x10(%r9)
    incq {CTL_CREATED:#x}(%r8)
    incq {CTL_FRAMES:#x}(%r8)
    add %rcx, {CTL_PHYS:#x}(%r8)
    add %rcx, {CTL_HEAD:#x}(%r8)
    ret
"""


@dataclass
class Ring:
    """Python side of the ring at `ctl` (control block) in emulated memory accessed through `memory`."""

    memory: Memory
    ctl: int

    def initialize(self, base: int, size: int, circular: bool) -> None:
        """The control block follows the ring's bytes directly, so one read takes both (see `entries`)."""
        if size < MIN_SIZE or size % 8:
            raise ValueError(f"trace buffer size must be a multiple of 8 of at least {MIN_SIZE} bytes")
        if base + size != self.ctl:
            raise ValueError("the control block must follow the ring")
        self.memory.write(self.ctl, _CTL.pack(base, size, 0, 0, 0, 0, int(circular), 0, base, size, min(DISCARD, size // 4), 0))

    def state(self) -> RingState:
        return self._parse_state(self.memory.read(self.ctl, _CTL.size))

    @staticmethod
    def _parse_state(control: bytes) -> RingState:
        base, size, head, tail, frames, created, circular, full, _, _, _, discards = _CTL.unpack(control)
        return RingState(base, size, head, tail, frames, created, bool(circular), bool(full), discards)

    def set_circular(self, circular: bool) -> None:
        self.memory.write(self.ctl + CTL_CIRCULAR, struct.pack("<Q", int(circular)))

    def entries(self) -> list[TraceFrame]:
        """Every frame in the ring, oldest first, numbered by its position (what GDB calls the frame number).

        The ring and its control block are read in one piece (one trip to the CPU thread), then parsed: a
        snapshot taken between two instructions, so a live circular run cannot evict what is being parsed, and
        frame-by-frame reads would cost a machine round trip each (a full buffer holds tens of thousands).
        An entry between reserve and commit lies beyond `head`, outside the snapshot's frames.
        """
        base, size = struct.unpack("<QQ", self.memory.read(self.ctl, 16))  # fixed for the ring's life
        snapshot = self.memory.read(base, size + _CTL.size)
        ring, state = snapshot[:size], self._parse_state(snapshot[size:])
        if state.head == state.tail:
            return []
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
        """Drop the oldest entries up to and including the frame created `through_sequence`-th (a consuming
        reader, as KGTP's frame pipe): their room is free again. Must run between two instructions on the CPU
        thread with no hit between reserve and commit (`Tracer.consume_frames`). Returns the frames dropped."""
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
            self.memory.write(self.ctl + CTL_TAIL, struct.pack("<QQ", tail, frames))
            self.memory.write(self.ctl + CTL_PHYS, short_path_fields(state.base, state.size, state.head, tail))
        return dropped

    def append(self, tracepoint: int, blocks: bytes, timestamp: int, cpu: int = 0) -> bool:
        """Python-side writer with the same rules as the native routines (used by the interpreter engine)."""
        state = self.state()
        need = align8(BLOCKS_AT + len(blocks))
        if 2 * need > state.size:
            return False
        head, tail, frames = state.head, state.tail, state.frames
        to_end = state.size - head % state.size
        pad = to_end if to_end < need else 0
        if state.size - (head - tail) < need + pad:
            if not state.circular:
                self.memory.write(self.ctl + CTL_FULL, struct.pack("<Q", 1))
                return False
            discard, discards = struct.unpack("<QQ", self.memory.read(self.ctl + CTL_DISCARD, 16))
            self.memory.write(self.ctl + CTL_DISCARDS, struct.pack("<Q", discards + 1))
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
        entry = ENTRY_HEADER.pack(need, cpu, timestamp, state.created) + FRAME_HEADER.pack(tracepoint, len(blocks))
        self.memory.write(phys, entry + blocks)
        self.memory.write(
            self.ctl + CTL_HEAD,
            struct.pack("<QQQQ", head + need, tail, frames + 1, state.created + 1),
        )
        self.memory.write(self.ctl + CTL_PHYS, short_path_fields(state.base, state.size, head + need, tail))
        return True
