"""A second implementation of the target interface (kgtp_sim/stub/target.py), small enough to reason about: a
stopped process of two threads over 64 bytes of its own memory, with writable registers and memory, run control,
software breakpoints and a history to run backwards through. No machine, no kernel, no tracer.

Its instructions are one byte each, with two exceptions: `int3` (0xcc) traps (SIGTRAP, rip after it, as on x86),
`jmp .` (0xeb 0xfe) spins until the user's Ctrl-C (SIGINT) or, stopping by itself, until `wake_spinner` (SIGTRAP,
which the transport hears of through `notify_stops`); any other byte does nothing. A thread that runs off the end of
the memory ends the process (exit code 0). Continuing runs the resumed threads in turn, one instruction each, until
one arrives at a software breakpoint, traps, spins or ends; stepping runs one instruction of one thread. Each
thread takes the first action naming it, or every thread (vCont's rule); one no action names stays put.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kgtp_sim.arch import amd64
from kgtp_sim.rsp.dispatch import E_MEMORY, RspError
from kgtp_sim.rsp.packets.connect import ALL_THREADS, ANY_THREAD
from kgtp_sim.stub.target import (SIGTRAP, Breakpoints, BreakpointType, Exited, MemoryWrites, RegisterWrites,
                                  ReplayLog, Resume, ResumeAction, Reverse, Running, Signal, Stop, Target,
                                  ViewError)

BASE = 0x400000
SIZE = 0x40
SIGINT = 2
INT3 = b"\xcc"
SPIN = b"\xeb\xfe"


def _registers(thread: int) -> dict[str, int]:
    values = dict.fromkeys((r.name for r in amd64.REGISTERS), 0)
    values.update(rax=0x100 * thread, rip=BASE + 0x20 * (thread - 1), rsp=0x7FF000 - 0x1000 * thread)
    return values


@dataclass
class ToyProcess(Target):
    """Base operations only: two threads, registers, memory; what it lacks, the handlers answer as unsupported."""

    memory: bytearray = field(default_factory=lambda: bytearray(SIZE))
    registers: dict[int, dict[str, int]] = field(default_factory=lambda: {t: _registers(t) for t in (1, 2)})
    detached: bool = False
    killed: bool = False

    def threads(self) -> Sequence[int]:
        return sorted(self.registers)

    def thread_extra_info(self, thread: int) -> str:
        return f"toy thread {thread}"

    def read_registers(self, thread: int) -> dict[str, int | None]:
        return dict(self.registers[thread])

    def read_memory(self, address: int, length: int, thread: int, space: object | None = None) -> bytes:
        if not BASE <= address < BASE + SIZE:
            raise ViewError(f"{address:#x} is not mapped")
        return bytes(self.memory[address - BASE : address - BASE + length])

    def stop_reason(self) -> Stop:
        return Signal(SIGTRAP, self.threads()[0])

    def attached(self) -> bool:
        return False  # started by the stub, as `gdbserver :port prog` starts it

    def detach(self, process: int | None = None) -> None:
        self.detached = True

    def kill(self) -> None:
        self.killed = True


@dataclass
class ToyTarget(ToyProcess, RegisterWrites, MemoryWrites, Resume, Breakpoints):
    """The process with every extension but reverse execution; software breakpoints only."""

    breakpoints: set[int] = field(default_factory=set)
    history: list[tuple[int, int]] = field(default_factory=list)  # (thread, rip) before each instruction run
    spinning: int | None = None
    woke: Stop | None = None  # the stop a spinner made by itself, until polled
    notify: object = None

    def support_register_writes(self) -> RegisterWrites:
        return self

    def support_memory_writes(self) -> MemoryWrites:
        return self

    def support_resume(self) -> Resume:
        return self

    def support_breakpoints(self) -> Breakpoints:
        return self

    def write_registers(self, thread: int, values: dict[str, int]) -> None:
        self.registers[thread].update(values)

    def write_memory(self, address: int, data: bytes, thread: int, space: object | None = None) -> None:
        if not (BASE <= address and address + len(data) <= BASE + SIZE):
            raise ViewError(f"{address:#x} is not mapped")
        self.memory[address - BASE : address - BASE + len(data)] = data

    # ---- breakpoints ----

    def supports(self, type: BreakpointType) -> bool:
        return type == BreakpointType.SOFTWARE

    def insert_breakpoint(self, type: BreakpointType, address: int, kind: int,
                          thread: int | None = None) -> None:
        if not BASE <= address < BASE + SIZE:
            raise RspError(E_MEMORY, f"no code at {address:#x}")
        self.breakpoints.add(address)

    def remove_breakpoint(self, type: BreakpointType, address: int, kind: int,
                          thread: int | None = None) -> None:
        self.breakpoints.discard(address)

    # ---- run control ----

    def _execute(self, thread: int) -> Stop | Running | None:
        """Run one instruction of `thread`: the outcome it ends the run with, or None."""
        regs = self.registers[thread]
        rip = regs["rip"]
        if not BASE <= rip < BASE + SIZE:
            return Exited(0)
        code = self.memory[rip - BASE : rip - BASE + 2]
        if code == SPIN:
            self.spinning = thread
            return Running()
        self.history.append((thread, rip))
        regs["rip"] = rip + 1
        return Signal(SIGTRAP, thread) if code[:1] == INT3 else None

    def resume(self, actions: Sequence[ResumeAction]) -> Stop | Running:
        plan = {thread: next((a for a in actions if a.thread in (thread, ANY_THREAD, ALL_THREADS)), None)
                for thread in self.threads()}
        stepping = [thread for thread, action in plan.items() if action is not None and action.step]
        if stepping:
            return self._execute(stepping[0]) or Signal(SIGTRAP, stepping[0])
        resumed = [thread for thread, action in plan.items() if action is not None]
        for _ in range(SIZE + 1):
            for thread in resumed:
                outcome = self._execute(thread)
                if outcome is not None:
                    return outcome
                if self.registers[thread]["rip"] in self.breakpoints:
                    return Signal(SIGTRAP, thread)
        return Exited(0)

    def interrupt(self) -> Stop:
        thread, self.spinning = self.spinning, None
        return Signal(SIGINT, thread)

    def notify_stops(self, notify) -> None:
        self.notify = notify

    def wake_spinner(self) -> None:
        """The spinning thread stops by itself (as at a breakpoint hit while the process runs)."""
        thread, self.spinning = self.spinning, None
        self.woke = Signal(SIGTRAP, thread)
        if self.notify is not None:
            self.notify()

    def poll_stop(self) -> Stop | None:
        stop, self.woke = self.woke, None
        return stop


@dataclass
class ReversibleToy(ToyTarget, Reverse):
    """The toy with reverse execution through the history of the instructions it ran."""

    def support_reverse(self) -> Reverse:
        return self

    def reverse(self, *, step: bool) -> Stop:
        while self.history:
            thread, rip = self.history.pop()
            self.registers[thread]["rip"] = rip
            if step or rip in self.breakpoints:
                return Signal(SIGTRAP, thread)
        return ReplayLog(begin=True)
