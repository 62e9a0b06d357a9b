"""Breakpoint conditions and commands run by the target at a hit, as gdbserver runs them (mem-break.cc:
gdb_condition_true_at_breakpoint, gdb_no_commands_at_breakpoint, run_breakpoint_commands; linux-low.cc's wait_1
decides from them whether GDB hears of the hit).

GDB sends them with `Z0`/`Z1` when the target announces ConditionalBreakpoints+ and BreakpointCommands+ (`set
breakpoint condition-evaluation target`, `set dprintf-style agent`; rsp/packets/replay.py reads them, stub/run.py
verifies them). At a hit (`BreakpointOptions.judge`):

- the commands run first, each in turn until one leaves a non-zero value or fails (a failure ends the list); their
  `printf` text goes to the target's output (gdbserver's own stdout), its format's C escapes read first, as
  gdbserver's ax_printf reads them (GDB sends a dprintf's format as typed: `\\n` is two characters);
- the conditions are evaluated in turn until one is true (non-zero); one that fails to evaluate (memory it cannot
  read, a division by zero) counts as true, so the user sees the stop;
- GDB hears of the hit when there are no commands and no condition or a true one; else the thread goes on.

Evaluation is the project's one agent-expression interpreter (agent/interp.py) against the stopped thread's
registers (GDB's numbers in the target's register layout) and its process's memory (the int3s hidden). A
breakpoint's expressions may not touch trace state: no trace frame is being collected, and GDB compiles no
breakpoint condition that reads a trace state variable's value on the target (getv/setv read 0 and write nothing;
trace blocks have no room).

Pure: the process target (stub/process.py) calls it on the server thread, with the thread stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..agent.errors import UnreadableMemory
from ..agent.interp import evaluate
from ..agent.verify import Program
from ..arch import amd64

log = logging.getLogger(__name__)


@dataclass
class _Context:
    """What a breakpoint's expression sees (agent/interp.py's AgentContext): the thread's registers by GDB's number
    in `layout`, memory through `read` (the readable prefix, maybe empty), `printf` to the target's output."""

    registers: dict[str, int | None]
    layout: amd64.RegisterLayout
    read: Callable[[int, int], bytes]
    output: Callable[[str], None]

    def read_memory(self, addr: int, n: int) -> bytes:
        data = self.read(addr, n)
        if len(data) < n:
            raise UnreadableMemory(addr + len(data), n - len(data))
        return data

    def register(self, n: int) -> int:
        registers = self.layout.registers
        value = self.registers.get(registers[n].name) if n < len(registers) else None
        return value or 0

    def tsv_get(self, n: int) -> int:
        return 0

    def tsv_set(self, n: int, value: int) -> None:
        pass

    def trace_room(self) -> int | None:
        return 0

    def trace_block(self, block: bytes) -> None:
        pass

    def printf(self, text: str) -> None:
        self.output(text)


@dataclass(frozen=True)
class BreakpointOptions:
    """One breakpoint's conditions and commands, verified (the last `Z` GDB sent for it)."""

    conditions: tuple[Program, ...] = ()
    commands: tuple[Program, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.conditions or self.commands)

    def judge(self, registers: dict[str, int | None], layout: amd64.RegisterLayout, read: Callable[[int, int], bytes],
              output: Callable[[str], None]) -> bool:
        """Run the commands and decide: True when GDB is to hear of this hit (module docstring)."""
        context = _Context(registers, layout, read, output)
        for command in self.commands:
            result = evaluate(command, context, escapes=True)
            if result.error is not None:
                log.info("breakpoint command: %s", result.error)
                break
            if result.value:
                break
        if self.commands:
            return False
        if not self.conditions:
            return True
        for condition in self.conditions:
            result = evaluate(condition, context, escapes=True)
            if result.error is not None:
                log.info("breakpoint condition: %s: the hit is reported", result.error)
                return True
            if result.value:
                return True
        return False
