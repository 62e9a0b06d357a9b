"""`monitor` commands (qRcmd): a fixed table of named commands, never a shell or a file reader.

A kernel debug stub runs with the power of the kernel; `monitor` must not become a way to run host code or
read host files, so commands are looked up by exact name in this table and take only numbers or words.

Thread: commands are registered while the stub is assembled (app.py), before any debugger connects; they run on the
server thread, where the dispatcher calls `monitor_command` (qRcmd).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field

from ..rsp.dispatch import Reply, WithOutput, handles
from ..rsp.packets.connect import MonitorCommand


class MonitorUsageError(Exception):
    """Bad arguments: the message (and the command's usage) is shown to the user."""


@dataclass(frozen=True)
class Command:
    name: str
    usage: str
    summary: str
    run: Callable[[list[str]], str]

    @property
    def most_arguments(self) -> int:
        """How many words the usage allows after the name (`frames [FIRST [COUNT]]`: 2). More are refused,
        never half-obeyed. A usage ending in `...` (`run PROG [ARG...]`) takes any number."""
        if self.usage.rstrip("]").endswith("..."):
            return 1 << 16
        return len(re.findall(r"[^\s\[\]]+", self.usage)) - 1


@dataclass
class Monitor:
    commands: dict[str, Command] = field(default_factory=dict)

    def register(self, name: str, usage: str, summary: str) -> Callable[[Callable[[list[str]], str]], Callable]:
        def add(run: Callable[[list[str]], str]) -> Callable[[list[str]], str]:
            if name in self.commands:
                raise ValueError(f"monitor command {name!r} registered twice")
            self.commands[name] = Command(name, usage, summary, run)
            return run

        return add

    def execute(self, line: str) -> str:
        try:
            words = shlex.split(line)
        except ValueError as error:
            return f"monitor: {error}\n"
        if not words or words[0] == "help":
            return self.help()
        command = self.commands.get(words[0])
        if command is None:
            return f"monitor: unknown command {words[0]!r}; try 'monitor help'\n"
        try:
            if len(words) - 1 > command.most_arguments:
                raise MonitorUsageError("too many arguments")
            text = command.run(words[1:])
        except MonitorUsageError as error:
            return f"monitor {command.name}: {error}\nusage: monitor {command.usage}\n"
        return text if text.endswith("\n") or not text else text + "\n"

    def help(self) -> str:
        width = max((len(c.usage) for c in self.commands.values()), default=4)
        lines = ["kgtp-sim monitor commands:", f"  {'help':<{width}}  this list"]
        lines += [f"  {c.usage:<{width}}  {c.summary}" for c in sorted(self.commands.values(), key=lambda c: c.name)]
        return "\n".join(lines) + "\n"

    @handles(MonitorCommand)
    def monitor_command(self, packet: MonitorCommand) -> Reply:
        return WithOutput(self.execute(packet.command))


def parse_int(word: str, what: str, *, low: int, high: int) -> int:
    try:
        value = int(word, 0)
    except ValueError:
        raise MonitorUsageError(f"{what} must be a number, not {word!r}") from None
    if not low <= value <= high:
        raise MonitorUsageError(f"{what} must be between {low} and {high}")
    return value
