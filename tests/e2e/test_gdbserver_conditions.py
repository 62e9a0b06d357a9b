"""Breakpoint conditions evaluated by the target, end to end: GDB 13.1 and 18.1 with `set breakpoint
condition-evaluation target` against `kgtp-sim gdbserver` and Debian's gdbserver, on tests/programs/conditions.c (a
loop of 1000 calls to f(i), built -g -O0). `break f if i == 500` stops once, at i == 500, and the 999 other hits
reach GDB as no stop reply at all: GDB's `set debug remote 1` shows every packet, and the stop replies on the wire
are counted. With `set dprintf-style agent` a dprintf's printf runs in the server at each of the 1000 hits, on the
output the program shares, and no stop reaches GDB.

The servers and GDB's batch sessions are tests/e2e/test_gdbserver_role.py's."""

from __future__ import annotations

import re
import subprocess

import pytest

from kgtp_sim.client import GDB_CLIENTS

from ..programs import MODES, SOURCES, compile_program
from .test_gdbserver_role import KINDS, MAIN_MODE, debug, servers  # noqa: F401 - the fixture

pytestmark = pytest.mark.gdb

SOURCE = SOURCES / "conditions.c"
#: to main first: its libraries are read then (host I/O whose binary data `set debug remote` would print)
AT_MAIN = ("tbreak main", "continue")


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("conditions")
    compile_program("hello", MAIN_MODE, out_dir)  # skips as that does when the mode cannot be built here
    out = out_dir / "conditions"
    subprocess.run([*MODES[MAIN_MODE], "-pthread", "-g", "-O0", str(SOURCE), "-o", str(out)], check=True,
                   capture_output=True)
    return out


def _stop_replies(out: str) -> list[str]:
    """The stop replies GDB received (its `set debug remote 1` lines): `T..` packets."""
    return re.findall(r"(?:Packet received|Received): (T[0-9a-f]{2}[^\s]*)", out)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_a_condition_the_target_evaluates_stops_once(servers, program, gdb, kind):  # noqa: F811
    out, server = debug(servers, kind, gdb, program, (), [
        *AT_MAIN,
        "set breakpoint condition-evaluation target",
        "break f if i == 500",
        "set debug remote 1",
        "continue",
        "set debug remote 0",
        "print i",
        "info breakpoints",
        "set debug remote 1",
        "continue",
        "set debug remote 0",
    ])
    assert re.search(r"Sending packet: \$Z0,[0-9a-f]+,1;X[0-9a-f]+,[0-9a-f]+#", out), out  # the condition went
    assert "Breakpoint 2, f (i=500)" in out and "$1 = 500" in out, out
    assert "stop only if i == 500 (target evals)" in out and "breakpoint already hit 1 time" in out, out
    breaks = [reply for reply in _stop_replies(out) if "swbreak" in reply]
    assert len(breaks) == 1, breaks  # the 999 other hits: no stop reply on the wire
    assert "sum 500500" in server.text("stdout") and "exited normally" in out, out


@pytest.mark.parametrize("kind", KINDS)
def test_threads_each_stop_once_at_their_own_500(servers, program, kind):  # noqa: F811
    gdb = GDB_CLIENTS[0]
    out, server = debug(servers, kind, gdb, program, ("3",), [
        *AT_MAIN,
        "set breakpoint condition-evaluation target",
        "break f if i == 500",
        "set debug remote 1",
        "continue", "continue", "continue", "continue",
        "set debug remote 0",
    ])
    assert out.count("Breakpoint 2, f (i=500)") == 3, out
    breaks = [reply for reply in _stop_replies(out) if "swbreak" in reply]
    # Debian's gdbserver may send one more, a hit it had pending when another thread's was reported, whose condition
    # GDB then finds false (GDB evaluates it again at each stop)
    assert len(breaks) == 3 if kind == "kgtp-sim" else len(breaks) >= 3, breaks
    assert "sum 1501500" in server.text("stdout") and "exited normally" in out, out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_an_agent_dprintf_prints_in_the_server_and_never_stops(servers, program, gdb, kind):  # noqa: F811
    out, server = debug(servers, kind, gdb, program, (), [
        *AT_MAIN,
        "set dprintf-style agent",
        'dprintf f,"f %d\\n",i',  # GDB sends `\n` as typed; the server's agent printf reads it (format.cc)
        "set debug remote 1",
        "continue",
        "set debug remote 0",
    ])
    assert re.search(r"Sending packet: \$Z0,[0-9a-f]+,1;cmds:", out), out
    assert not [reply for reply in _stop_replies(out) if "swbreak" in reply]
    assert re.search(r"Sending packet: \$Z0,[0-9a-f]+,1;cmds:[01],X[0-9a-f]+,[0-9a-f]*5c6e0027#", out), out  # `\n` raw
    printed = [line for line in server.text("stdout").splitlines() if line.startswith("f ")]
    assert printed == [f"f {i}" for i in range(1, 1001)], printed[:5]
    assert "sum 500500" in server.text("stdout") and "exited normally" in out, out
