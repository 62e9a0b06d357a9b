"""`kgtp-sim serve` as a child process, started the way users start it, on a free loopback port.

`start_stub` returns once the stub printed the line saying where it listens: a daemon thread reads the stub's
output from the start (so the stub never blocks on a full pipe), keeps every line in `StubProcess.output`, and
sets an event at the listening line or at the end of the output. Nothing waits for a fixed time.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from .paths import ROOT

LISTENING = re.compile(r"listening on [\d.]+:(\d+)")
FOLLOWING = re.compile(r"follow channel \(read-only\) on [\d.]+:(\d+)")


def kgtp_command(*args: str) -> list[str]:
    """`kgtp-sim ARGS` as a command line for this interpreter (the package need not be installed)."""
    return [sys.executable, "-m", "kgtp_sim", *args]


@dataclass
class StubProcess:
    """A running `kgtp-sim serve`: its process, the RSP port it listens on, and everything it printed so far."""

    proc: subprocess.Popen
    port: int
    output: list[str]
    #: the read-only follow channel's port, when the stub announced one
    follow_port: int | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def dump_threads(self, settle_s: float = 1.0) -> None:
        """Have the stub print every thread's Python stack into its output (SIGUSR1): what it was doing when a
        client gave up on it. The dump has no end marker, so this leaves it `settle_s` to be written."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(settle_s)

    def stop(self, timeout: float = 10) -> None:
        """Terminate the stub (it shuts its kernel down), killing it if it has not exited after `timeout` s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_stub(*extra: str, cpus: int | None = None, timeout: float = 30) -> StubProcess:
    """`kgtp-sim serve --port 0 EXTRA...` as a user runs it; returns once it prints the port it listens on.

    `cpus`: the machine's CPU count (`--cpus`); None leaves it to `kgtp-sim serve`'s own default, so a test that
    does not care runs the machine users get.

    Raises RuntimeError with everything the stub printed if it exits, or stays silent about its port for
    `timeout` seconds.
    """
    if cpus is not None:
        extra = ("--cpus", str(cpus), *extra)
    proc = subprocess.Popen(kgtp_command("serve", "--port", "0", *extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    output: list[str] = []
    ports: dict[str, int] = {}
    ready = threading.Event()

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            if "listen" in ports:
                continue
            for name, pattern in (("follow", FOLLOWING), ("listen", LISTENING)):
                if match := pattern.search(line):
                    ports[name] = int(match.group(1))
            if "listen" in ports:
                ready.set()
        ready.set()  # the stub exited (before listening, or later)

    threading.Thread(target=drain, daemon=True, name=f"stub-{proc.pid}-output").start()
    if not ready.wait(timeout) or "listen" not in ports:
        proc.kill()
        proc.wait()
        raise RuntimeError("the stub did not start:\n" + "".join(output))
    return StubProcess(proc, ports["listen"], output, ports.get("follow"))


def serve_until_exit(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """`kgtp-sim serve --port 0 ARGS...` for a command line that must be refused before anything listens: runs it
    to its exit and returns what it printed (stdout and stderr apart)."""
    return subprocess.run(kgtp_command("serve", "--port", "0", *args), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
