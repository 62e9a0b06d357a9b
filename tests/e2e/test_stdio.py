"""KGTP's transport: GDB starts the stub on a pipe (`target remote | kgtp-sim serve --stdio`), as KGTP users open
/sys/kernel/debug/gtp, and traces exactly as over TCP. The pipe carries packets only: every message goes to
stderr."""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest

from kgtp_sim.client import ROOT, kgtp_command
from kgtp_sim.rsp.codec import encode_packet

from ..conftest import run_gdb, wait_for_hits

pytestmark = pytest.mark.gdb

PIPE = "target remote | cd {root} && {command}".format(
    root=shlex.quote(str(ROOT)), command=" ".join(map(shlex.quote, kgtp_command("serve", "--stdio", "-v"))))


def test_gdb_traces_through_a_pipe(gdb):
    # on a loaded host a reply once took GDB's default 2 s: GDB went on without it and took it for the next
    # packet's ("Remote replied unexpectedly to 'vMustReplyEmpty': vCont;c;C;s;S;r"); the transport is what is tested
    out = run_gdb(gdb, None, "set remotetimeout 30", PIPE, "print jiffies", "trace kgtp_test_function", "actions",
                  "collect $regs", "collect kgtp_counter", "end", "tstart", *wait_for_hits(1, 3), "tstop",
                  "tstatus", "tfind 2", "print kgtp_counter", "tfind none", "print jiffies", "detach", attach=False)
    values = [int(v) for v in re.findall(r"^\$\d+ = (\d+)$", out, re.M)]
    assert len(values) == 3, out  # the session as GDB printed it, when it went otherwise
    first, counter, second = values
    assert second > first, out  # the kernel kept running while GDB was attached
    assert re.search(r"Collected \d+ trace frames", out) and counter > 0, out
    assert "kgtp-sim: kernel" in out and "serving the debugger on stdin/stdout" in out, out  # stderr reached GDB's
    assert "[Inferior 1 (Remote target) detached]" in out, out


def test_stdout_carries_packets_only():
    proc = subprocess.Popen(kgtp_command("serve", "--stdio", "-v"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT)
    packets = b"+".join(encode_packet(p) for p in (b"qSupported", b"?", b"qRcmd," + b"stats".hex().encode(), b"D"))
    out, err = proc.communicate(packets + b"+", timeout=60)
    assert proc.returncode == 0, err
    assert re.fullmatch(rb"(\+(\$[^$#]*#[0-9a-f]{2})+)+", out), out  # acks and packets, nothing else
    assert b"$O" in out  # the monitor output, as console packets
    assert b"T05thread:1;" in out and b"$OK#9a" in out, out
    assert b"kgtp-sim: kernel" in err and b"INFO" in err, err  # the log went to stderr
