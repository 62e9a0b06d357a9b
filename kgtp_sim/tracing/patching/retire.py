"""Code the tracer stopped using but the kernel may still execute: detours, compiled expressions, out-of-line
copies.

A run's code cannot be freed when the run ends. The kernel is preemptive: a task interrupted inside a detour's
relocated instructions, or inside an out-of-line copy, resumes there whenever it is scheduled again, and its
saved RIP sits on its stack (the interrupt frame). So removed code is retired instead, and freed between runs
only when neither any CPU's RIP nor any word of the kernel's writable memory (every task stack and saved
register frame lives there) points into it. Freed too early, the next run's allocation would overwrite
instructions a task is about to execute.

Runs on the CPU thread (between two instructions, inside a run change).
"""

from __future__ import annotations

import array

from unicorn import Uc

from ...machine import Machine


def writable_memory(machine: Machine, uc: Uc) -> list[bytes]:
    """The kernel's writable segments as they are now (page-aligned; whole 8-byte words), for several
    `stacks_point_into` at one stop."""
    return [bytes(uc.mem_read(segment.vaddr, segment.memsz & ~7)) for segment in machine.image.segments
            if segment.writable]


def stacks_point_into(machine: Machine, uc: Uc, low: int, high: int, memory: list[bytes] | None = None) -> bool:
    """Does any aligned 8-byte word of the kernel's writable memory (stacks, saved frames: 1.8 MB) point into
    [low, high)? Call on the CPU thread, between two instructions; `memory`: `writable_memory` read at this stop.

    Every address of the range has the same top bytes (a few dozen bytes of code: seven of eight), so the words
    are found where those bytes are, at C speed (`bytes.find`), and only those are read: testing every word in
    Python took 18 ms a range, at each tstart for each retired region and each jump probe's window."""
    if high <= low:
        return False
    top, bottom = (high - 1).to_bytes(8, "little"), low.to_bytes(8, "little")
    shared = 0  # the top bytes every address of the range has in common (little-endian: the last ones)
    while shared < 8 and top[7 - shared] == bottom[7 - shared]:
        shared += 1
    tail = top[8 - shared:]
    for data in memory if memory is not None else writable_memory(machine, uc):
        if not shared:  # a range across the top byte: every word
            if any(low <= word < high for word in array.array("Q", data)):
                return True
            continue
        at = data.find(tail, 8 - shared)
        while at >= 0:
            start = at - (8 - shared)
            if start % 8 == 0 and low <= int.from_bytes(data[start:start + 8], "little") < high:
                return True
            at = data.find(tail, at + 1)
    return False


def _targets(uc: Uc, low: int, high: int) -> list[int]:
    """Every address the code in [low, high) may go to: each 8-byte word at any byte offset (an absolute target,
    as a chain link's or a trampoline's immediate, need not be aligned), and the target of each `jmp rel32`,
    `call rel32` and `jcc rel32` read at any byte offset (a detour of a chain goes on to its link by a relative
    jump). Read at every offset, so a byte that only looks like an opcode adds a target too: a region kept for
    it is only freed later, never too early."""
    data = bytes(uc.mem_read(low, high - low))
    targets = [int.from_bytes(data[at:at + 8], "little") for at in range(len(data) - 7)]
    for at in range(len(data) - 4):
        if data[at] in (0xE8, 0xE9):
            end = at + 5
        elif data[at] == 0x0F and 0x80 <= data[at + 1] <= 0x8F and at + 6 <= len(data):
            end = at + 6
        else:
            continue
        targets.append(low + end + int.from_bytes(data[end - 4:end], "little", signed=True))
    return targets


def in_use(machine: Machine, uc: Uc, low: int, high: int, memory: list[bytes] | None = None) -> bool:
    """Could the kernel still execute [low, high): a CPU is in it, or a task would return or resume into it."""
    return any(low <= rip < high for rip in machine.cpu_rips()) or stacks_point_into(machine, uc, low, high, memory)


class RetiredCode:
    """Code regions waiting until no task can reach them (`release` frees the others)."""

    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        self.regions: list[tuple[int, int]] = []  # (start, end); start is the allocation's address

    def add(self, regions: list[tuple[int, int]]) -> None:
        self.regions += regions

    def release(self) -> None:
        """Free what nothing can reach any more; keep the rest for a later call (between runs). Retired code
        kept reaches code too: a return probe's trampoline returns to the address in its own immediate, which is
        another trampoline when two return probes caught one call (kret.py), so a region that a kept region's
        code points into is kept as well, and so is one it jumps to: a detour of a chain (several locations at
        one address) goes on by a relative jump to its link, a region of its own."""

        def still_reachable(uc: Uc) -> list[tuple[int, int]]:
            memory = writable_memory(self.machine, uc) if self.regions else []
            kept = [(low, high) for low, high in self.regions if in_use(self.machine, uc, low, high, memory)]
            waiting = [region for region in self.regions if region not in kept]
            while waiting:
                words = [word for low, high in kept for word in _targets(uc, low, high)]
                reached = [(low, high) for low, high in waiting if any(low <= word < high for word in words)]
                if not reached:
                    break
                kept += reached
                waiting = [region for region in waiting if region not in reached]
            return kept

        kept = self.machine.run_on_cpu(still_reachable)
        for low, high in self.regions:
            if (low, high) not in kept:
                self.machine.free_code(low)
        self.regions = kept
