"""Shared objects a program only dlopen()s, under `kgtp-sim gdbserver --with`, with real GDB 13.1 and 18.1, beside
Debian's gdbserver on the same program: GDB sees the library loaded during a run, and a tracepoint's location in it
resolved and installed while the trace runs, as GDB's testsuite checks it (gdb.trace/pending.exp,
gdb.trace/change-loc.exp).

tests/programs/plugins.c is the program, built as GDB's testsuite builds its own: libraries beside it found through
its RUNPATH of $ORIGIN, one a DT_NEEDED (libkgtpfirst.so), one loaded by dlopen() after marker(1) and closed after
marker(2) (libkgtpsecond.so); each object has its own kgtp_step(). The machine holds no file of the host but those
named: the dlopen()ed library is there only when `--with` names it (`$ORIGIN/*.so`, or its path); without it the
program's dlopen() fails inside, where it loads under gdbserver.

- a tracepoint pending on the library, set before `tstart`: resolved when the library loads, installed while the
  trace runs, its three hits collected; the same session as under gdbserver;
- a tracepoint with locations in the program and libkgtpfirst.so at `tstart`: the library loaded during the run
  adds a third, installed on the target, which goes pending (GDB 13; GDB 18 drops it) once the library is
  closed, while the other two go on collecting (six frames); the same with a fast tracepoint, whose jump in the
  closed library is gone with it at `tstop`. gdbserver 13 refuses this one: GDB downloads the
  tracepoint again when the library loads (QTDP of a number it has) and gdbserver answers E01, so `continue` fails
  (change-loc.exp's FAILs under it); the stub's run is checked on its own;
- extended-remote: `run` (vRun) packs the libraries beside each program it starts, as on the command line;
- the rule: without `--with` the library is not in the machine (the program's dlopen() fails, it exits 1), and a
  `$ORIGIN/` name not beside the program makes GDB's `run` fail, saying which.

Every wait is for an event (a line a server prints, GDB's end); each test stops the servers it started.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from kgtp_sim.client import GDB_CLIENTS, GdbClient

from ..programs import MODES, SOURCES, compile_program
from .test_gdbserver_extended import attempt, extended_session, multi  # noqa: F401
from .test_gdbserver_role import (KINDS, MAIN_MODE, Server, assert_in_order, normalized, run_session,  # noqa: F401
                                  servers)

pytestmark = pytest.mark.gdb

#: what names the libraries beside the program: the testsuite harness's rule (tools/gdb_testsuite.py: STUB_OPTIONS)
BESIDE = ("--with", "$ORIGIN/*.so")
SECOND = "libkgtpsecond.so"


@pytest.fixture(scope="module")
def plugins(tmp_path_factory) -> Path:
    """tests/programs/plugins.c and its two libraries (plugin.c), a glibc PIE with its debugging information, in a
    directory of their own."""
    out_dir = tmp_path_factory.mktemp("plugins")
    compile_program("hello", MAIN_MODE, out_dir)  # skips as that does if the mode cannot be built here
    compiler = MODES[MAIN_MODE][0]
    for name, entry in (("libkgtpfirst.so", "first_entry"), (SECOND, "second_entry")):
        subprocess.run([compiler, "-g", "-O0", "-shared", "-fPIC", f"-DENTRY={entry}", str(SOURCES / "plugin.c"),
                        "-o", str(out_dir / name)], check=True, capture_output=True)
    program = out_dir / "plugins"
    subprocess.run([compiler, "-g", "-O0", str(SOURCES / "plugins.c"), "-o", str(program), f"-L{out_dir}",
                    "-lkgtpfirst", "-Wl,-rpath,$ORIGIN", "-Wl,--enable-new-dtags", "-ldl"], check=True,
                   capture_output=True)
    return program


def _options(kind: str, *with_options: str) -> tuple[str, ...]:
    return ("--once", *with_options) if kind == "kgtp-sim" else ("--once",)


def session(servers, kind: str, gdb: GdbClient, program: Path, commands: list[str], *args: str,
            with_options: tuple[str, ...] = BESIDE) -> tuple[str, Server]:
    """One server of `kind` for `program ARGS` (ours with `with_options`), one GDB session on it; GDB's output and
    the server, once it ended."""
    server = servers(kind, program, *args, options=_options(kind, *with_options))
    try:
        out = run_session(gdb, program, server.listening(), ["set remotetimeout 30", *commands])
    except AssertionError as error:
        raise AssertionError(f"{error}\n---- the server printed:\n{server.text()}") from None
    assert server.wait() == 0, server.text()
    return out, server


#: tstatus lines that differ between two correct servers: the buffer each frame takes (gdbserver's frames hold
#: its register block), the clock
_TSTATUS = re.compile(r"^(Trace buffer has \d+ bytes|Trace started at )")


def comparable(out: str) -> list[str]:
    return [line for line in normalized(out) if not _TSTATUS.match(line)]


PENDING = ["set breakpoint pending on", "break main", "continue", "delete 1", "trace second_entry", "actions",
           "collect x", "end", "break marker", "tstart", "continue", "continue", "info trace", "continue", "tstop",
           "tstatus", "tfind start", "tfind", "tfind", "tfind", "tfind none", "delete", "continue"]


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_a_pending_tracepoint_is_resolved_and_installed_when_its_library_loads_during_the_trace(plugins, servers,
                                                                                                gdb):
    outs = {kind: session(servers, kind, gdb, plugins, PENDING)[0] for kind in KINDS}
    ours = outs["kgtp-sim"]
    assert_in_order(ours, r"^Tracepoint 2 \(second_entry\) pending\.$",
                    r"^Breakpoint 3, marker \(round=1\)", r"^Breakpoint 3, marker \(round=2\)",
                    r"^2\s+tracepoint\s+keep y\s+0x00007ff[0-9a-f]+ in second_entry at \S*plugin\.c:\d+\n"
                    r"\s+collect x\n\s+installed on target$",
                    r"^Collected 3 trace frames\.$", r"^Found trace frame 0, tracepoint 2$",
                    r"^Found trace frame 2, tracepoint 2$", r"^\[Inferior 1 \(.*\) exited normally\]$")
    assert comparable(ours) == comparable(outs["gdbserver"])


def change_loc(command: str) -> list[str]:
    """change-loc.exp's session: `COMMAND` (a tracepoint) at main, `tstart`, then the stops at marker(1), (2) and
    (3), `info trace` at each of the last two, `tstop`, the program run to its end."""
    return ["break main", "continue", "delete 1", command, "actions", "collect $rip", "end", "break marker", "tstart",
            "continue", "info trace", "continue", "info trace", "continue", "info trace", "tstop", "tstatus",
            "delete", "continue"]


def _locations(out: str, marker: int) -> list[str]:
    """What `info trace` said of tracepoint 2's locations after the stop at marker(`marker`): each `2.N` line's
    address or <PENDING> (or the tracepoint's own line's address when it has one location), with `installed` when
    the line after says so."""
    text = out.split(f"Breakpoint 3, marker (round={marker})")[1].split("Breakpoint 3, marker")[0]
    found = (re.findall(r"^2\.\d+\s+y\s+(<PENDING>|0x[0-9a-f]+) .*\n(\s+installed on target)?", text, re.M)
             or re.findall(r"^2\s+(?:fast )?tracepoint\s+keep y\s+(0x[0-9a-f]+) .*\n\s+collect \$rip\n"
                           r"(\s+installed on target)?", text, re.M))  # one location: on the tracepoint's line
    return [f"{where}{' installed' if installed else ''}" for where, installed in found]


#: (the tracepoint, its locations at tstart, the frames it collects after tstart): `trace kgtp_step` has one in the
#: program and one in libkgtpfirst.so, and collects the program's kgtp_step(0), libkgtpfirst.so's twice and
#: libkgtpsecond.so's three times; `ftrace kgtp_fast_point` (a jump over the libraries' 5-byte nop) has one in each
#: library and collects all but the program's
CHANGE_LOC = {"trace": ("trace kgtp_step", 2, 6), "ftrace": ("ftrace kgtp_fast_point", 1, 5)}


@pytest.mark.parametrize("kind", CHANGE_LOC)
@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_a_library_loaded_during_the_trace_adds_an_installed_location_pending_once_it_is_closed(plugins, servers,
                                                                                                gdb, kind):
    """A fast tracepoint's jump in the closed library went with its pages: `tstop` does not write it back there
    (it failed with E0f, `tstop` refused, the trace left running)."""
    command, at_start, frames = CHANGE_LOC[kind]
    out, server = session(servers, "kgtp-sim", gdb, plugins, change_loc(command))
    assert re.search(r"^(Fast t|T)racepoint 2 at 0x[0-9a-f]+: ", out, re.M), out
    first, loaded, closed = (_locations(out, marker) for marker in (1, 2, 3))
    assert len(first) == at_start and all(location.endswith(" installed") for location in first), out
    assert len(loaded) == at_start + 1 and all(location.endswith(" installed") for location in loaded), out
    assert set(first) < set(loaded), out  # the locations of before stay where they were
    # GDB 13 keeps the closed library's location as pending (change-loc.exp's expectation); GDB 18 drops it
    assert sorted(closed) == sorted([*first, *(["<PENDING>"] if gdb.version == "13" else [])]), out
    assert "Target returns error code" not in out, out
    assert re.search(rf"^Collected {frames} trace frames\.$", out, re.M), out
    assert re.search(r"^\[Inferior 1 \(.*\) exited normally\]$", out, re.M), out
    assert "sum 123" in server.text("stdout")


RUN = ["break marker", "run", "continue", "info sharedlibrary", "delete", "continue"]


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_run_in_extended_remote_packs_the_libraries_beside_the_program(plugins, multi, gdb):  # noqa: F811
    outs = {}
    for kind in KINDS:
        server = multi(kind, *(BESIDE if kind == "kgtp-sim" else ()))
        try:
            out = extended_session(gdb, plugins, server.listening(), ["set remotetimeout 30",
                                                                      f"set remote exec-file {plugins}", *RUN,
                                                                      "monitor exit"])
        except AssertionError as error:
            raise AssertionError(f"{error}\n---- the server printed:\n{server.text()}") from None
        assert server.wait() == 0, server.text()
        outs[kind] = out
    ours = outs["kgtp-sim"]
    assert_in_order(ours, r"^Breakpoint 1, marker \(round=1\)", r"^Breakpoint 1, marker \(round=2\)",
                    rf"^0x[0-9a-f]+\s+0x[0-9a-f]+\s+Yes\s+\S*/{SECOND}$", r"^\[Inferior 1 \(.*\) exited normally\]$")
    assert normalized(ours) == normalized(outs["gdbserver"])


def test_only_the_files_named_are_in_the_machine(plugins, servers, multi):  # noqa: F811
    """Without `--with` the dlopen() fails inside and the program says so and exits 1; named by its path, the
    library loads; a `$ORIGIN/` name that is not beside the program run fails GDB's `run`, the server saying why."""
    gdb = GDB_CLIENTS[0]
    out, server = session(servers, "kgtp-sim", gdb, plugins, ["continue"], with_options=())
    assert re.search(r"^\[Inferior 1 \(.*\) exited with code 01\]$", out, re.M), out
    assert f"dlopen: {SECOND}: cannot open shared object file" in server.text("stdout")
    out, server = session(servers, "kgtp-sim", gdb, plugins, ["continue"], with_options=(
        "--with", str(plugins.parent / SECOND)))
    assert re.search(r"^\[Inferior 1 \(.*\) exited normally\]$", out, re.M), out
    server = multi("kgtp-sim", "--with", "$ORIGIN/libabsent.so")
    out = extended_session(gdb, plugins, server.listening(), [
        f"set remote exec-file {plugins}", attempt("run"), "monitor exit"])
    assert server.wait() == 0, server.text()
    assert re.search(rf'Running "{re.escape(str(plugins))}" on the remote target failed', out), out
    assert (f"cannot run {plugins}: --with $ORIGIN/libabsent.so ({plugins.parent}/libabsent.so): no such file "
            "on this host") in server.text(), server.text()
