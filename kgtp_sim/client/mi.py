"""A small driver for GDB's machine interface (MI): one GDB process, one command at a time, parsed results.

The soak's final check walks every trace frame of the buffer. In a batch command file the first failing command
ends the file, so one unavailable value would hide the rest of the buffer; through MI every command answers
`^done` or `^error` on its own and the walk goes on, and results come as structured records instead of text
meant for people.

Commands are sent and their result records awaited on the caller's thread; one daemon thread per GDB reads its
output into a queue. Records are matched to commands by token, so a command's answer is never confused with
output that came before it.

Why not pygdbmi (0.11.0.0, measured against GDB 18.1's output; the soak needs both things it gets wrong):
- its parser (`gdbmiparser.parse_response`) never returned (still spinning after 10 s) on the `-break-list`
  record of a tracepoint with actions, `body=[bkpt={...,script={"collect $regs","collect jiffies"},...}]`; the
  tuple of bare strings GDB gives a breakpoint's commands also raises TypeError as a record's last result and
  yields a key `'"a","b"},thread-groups'` elsewhere. It also drops the names of results inside lists
  (`body=[bkpt={...},bkpt={...}]` comes back as bare dicts). tests/e2e/test_soak_script.py checks this parser on
  that record.
- `GdbController.write` returns once GDB's output has paused for 0.2 s, not on the command's result record: 205 ms
  a `-data-evaluate-expression` against 0.1 ms here (the final walk sends two to five commands a frame, for up to
  5000 frames), and a command that printed and then worked for 0.5 s came back with its console output only, its
  `^done` left for a later read.
"""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .gdb import Gdb, gdb_environment, gdb_path
from .paths import VMLINUX

MiValue = str | list["MiValue"] | dict[str, "MiValue"]


class MiError(Exception):
    """GDB answered `^error`, went away, or did not answer in time."""


class MiSyntaxError(ValueError):
    """An MI record that does not follow the output grammar."""


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "a": "\a", "b": "\b", "f": "\f", "v": "\v"}


class _Parser:
    """Recursive descent over GDB's MI output grammar: c-strings, tuples `{}` and lists `[]`."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.at = 0

    def _peek(self) -> str:
        return self.text[self.at] if self.at < len(self.text) else ""

    def _expect(self, char: str) -> None:
        if self._peek() != char:
            raise MiSyntaxError(f"expected {char!r} at {self.at} in {self.text[:120]!r}")
        self.at += 1

    def cstring(self) -> str:
        self._expect('"')
        out: list[str] = []
        while True:
            char = self._peek()
            if not char:
                raise MiSyntaxError("unterminated c-string")
            self.at += 1
            if char == '"':
                return "".join(out)
            if char != "\\":
                out.append(char)
                continue
            escaped = self._peek()
            self.at += 1
            if escaped in _ESCAPES:
                out.append(_ESCAPES[escaped])
            elif escaped.isdigit():
                digits = escaped
                while len(digits) < 3 and self._peek().isdigit():
                    digits += self._peek()
                    self.at += 1
                out.append(chr(int(digits, 8)))
            else:
                out.append(escaped)

    def value(self) -> MiValue:
        char = self._peek()
        if char == '"':
            return self.cstring()
        if char == "{":
            self.at += 1
            if self._peek() in ('"', "{", "["):  # GDB's breakpoint `script={"...","..."}`: a tuple of bare values
                return self._values_until("}")
            return self._results_until("}")
        if char == "[":
            self.at += 1
            if self._peek() == "]":
                self.at += 1
                return []
            items: list[MiValue] = []
            while True:
                if self._peek() in ('"', "{", "["):
                    items.append(self.value())
                else:
                    name, item = self.result()
                    items.append({name: item})
                if self._peek() == ",":
                    self.at += 1
                    continue
                self._expect("]")
                return items
        raise MiSyntaxError(f"unexpected {char!r} at {self.at} in {self.text[:120]!r}")

    def _values_until(self, closing: str) -> list[MiValue]:
        items: list[MiValue] = []
        while True:
            items.append(self.value())
            if self._peek() == ",":
                self.at += 1
                continue
            self._expect(closing)
            return items

    def result(self) -> tuple[str, MiValue]:
        start = self.at
        while self._peek() not in ("=", ""):
            self.at += 1
        name = self.text[start : self.at]
        self._expect("=")
        return name, self.value()

    def _results_until(self, closing: str) -> dict[str, MiValue]:
        out: dict[str, MiValue] = {}
        if self._peek() == closing:
            self.at += 1
            return out
        while True:
            name, item = self.result()
            out[name] = item
            if self._peek() == ",":
                self.at += 1
                continue
            self._expect(closing)
            return out

    def results(self) -> dict[str, MiValue]:
        """`,name=value,...` to the end of the record."""
        out: dict[str, MiValue] = {}
        while self._peek() == ",":
            self.at += 1
            name, item = self.result()
            out[name] = item
        if self.at != len(self.text):
            raise MiSyntaxError(f"trailing text at {self.at} in {self.text[:120]!r}")
        return out


def parse_results(text: str) -> dict[str, MiValue]:
    """The `,name=value,...` part of a result or async record."""
    return _Parser(text).results()


def parse_cstring(text: str) -> str:
    return _Parser(text).cstring()


@dataclass
class MiResult:
    """One command's outcome: its result class (`done`, `connected`, `error`...), results and stream output."""

    klass: str
    results: dict[str, MiValue]
    console: str = ""

    def get(self, name: str, default: MiValue = "") -> MiValue:
        return self.results.get(name, default)


@dataclass
class GdbMi:
    """A GDB process under MI. Use as a context manager; `command` raises MiError on `^error` when asked to.

    With `mi_async`, execution commands (`-exec-continue`) answer `^running` and GDB takes commands while the target
    runs (`-exec-interrupt` is the user's Ctrl-C); `wait_stopped` waits for the stop GDB reports (`*stopped`)."""

    gdb: Gdb
    program: Path = VMLINUX
    timeout: float = 60.0
    mi_async: bool = False
    _proc: subprocess.Popen | None = field(init=False, default=None)
    _lines: queue.Queue = field(init=False, default_factory=queue.Queue)
    _token: int = field(init=False, default=0)
    _stops: list[dict[str, MiValue]] = field(init=False, default_factory=list)
    transcript: list[str] = field(init=False, default_factory=list)

    def __enter__(self) -> GdbMi:
        self._proc = subprocess.Popen(
            [gdb_path(self.gdb), "-nx", "-q", "--interpreter=mi3", str(self.program)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            env=gdb_environment(),
        )
        threading.Thread(target=self._pump, daemon=True).start()
        self._until_prompt()
        settings = ["-gdb-set pagination off", "-gdb-set confirm off", "-gdb-set print elements 200"]
        for setting in settings + (["-gdb-set mi-async on"] if self.mi_async else []):
            self.command(setting)
        return self

    def __exit__(self, *exc: object) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.write("-gdb-exit\n")
                proc.stdin.flush()
            proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """GDB dies without a word to the stub (SIGKILL), as a debugger that crashes or whose host goes away."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def _pump(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _next_line(self, deadline: float) -> str:
        try:
            line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise MiError("GDB did not answer in time; its last lines:\n" + "\n".join(self.transcript[-40:])) from None
        if line is None:
            raise MiError("GDB exited")
        self.transcript.append(line)
        if line.startswith("*stopped"):
            self._stops.append(parse_results(line[len("*stopped"):]) if line != "*stopped" else {})
        return line

    def wait_stopped(self, timeout: float | None = None) -> dict[str, MiValue]:
        """The stop GDB reported (`*stopped`: its reason, thread-id, frame...) since the last execution command
        (`-exec-continue`, `-exec-step`...), once it has; MiError when none comes within `timeout` seconds."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while not self._stops:
            self._next_line(deadline)
        return self._stops.pop(0)

    def _until_prompt(self) -> None:
        deadline = time.monotonic() + self.timeout
        while self._next_line(deadline).strip() != "(gdb)":
            pass

    def command(self, text: str, *, check: bool = True, timeout: float | None = None) -> MiResult:
        """Send one MI command and wait for its result record (console and target output are gathered)."""
        assert self._proc is not None and self._proc.stdin is not None
        if text.startswith("-exec-") and not text.startswith("-exec-interrupt"):
            self._stops.clear()  # `wait_stopped` waits for the stop this resumption ends with
        self._token += 1
        token = str(self._token)
        self.transcript.append(f"> {token}{text}")
        try:
            self._proc.stdin.write(f"{token}{text}\n")
            self._proc.stdin.flush()
        except OSError as error:
            raise MiError(f"GDB went away: {error}") from None
        deadline = time.monotonic() + (timeout or self.timeout)
        console: list[str] = []
        while True:
            line = self._next_line(deadline)
            if line[:1] in ("~", "@", "&") and line[1:2] == '"':
                if line[0] != "&":
                    console.append(parse_cstring(line[1:]))
                continue
            if line.startswith(token + "^"):
                klass, _, rest = line[len(token) + 1 :].partition(",")
                result = MiResult(klass, parse_results("," + rest) if rest else {}, "".join(console))
                self._until_prompt()
                if check and klass == "error":
                    raise MiError(f"{text}: {result.get('msg')}")
                return result

    def attach(self, address: str, patience: float = 30.0) -> MiResult:
        """`-target-select remote ADDRESS`, tried again while the stub refuses (its one debugger slot is still held
        by the previous client) until `patience` seconds have passed; the last result, `connected` on success."""
        deadline = time.monotonic() + patience
        while True:
            result = self.command(f"-target-select remote {address}", check=False)
            if result.klass == "connected" or time.monotonic() > deadline:
                return result
            time.sleep(0.5)

    def console(self, text: str, *, timeout: float | None = None) -> MiResult:
        """A CLI command through MI: its printed text is in `.console`, an error in `.klass`/`msg`."""
        quoted = text.replace("\\", "\\\\").replace('"', '\\"')
        return self.command(f'-interpreter-exec console "{quoted}"', check=False, timeout=timeout)

    def evaluate(self, expression: str) -> str | None:
        """An expression's value as GDB prints it, or None when GDB cannot evaluate it (e.g. not collected)."""
        quoted = expression.replace("\\", "\\\\").replace('"', '\\"')
        result = self.command(f'-data-evaluate-expression "{quoted}"', check=False)
        value = result.get("value", None)
        return value if result.klass == "done" and isinstance(value, str) else None
