"""Run control at a process's user addresses in KGTP mode, with real GDB 13.1 and 18.1: a program runs on the kernel
(`serve --run`), GDB loads its symbols (`add-symbol-file`), `break getppid` stops the whole machine when the
process runs there, GDB shows the CPU that hit with the process's registers and stack (`bt` down to main), `stepi`
and `continue` go on in the program; an address no process maps is refused ("Cannot insert breakpoint N", the
reason in the stub's log) and the kernel and the program keep running; detaching leaves both running."""

from __future__ import annotations

import re

import pytest

from kgtp_sim.client import RspClient
from kgtp_sim.client.gdb import gdb_each

from ..conftest import run_gdb, start_stub, wait_until
from ..programs import compile_program

pytestmark = pytest.mark.gdb


@pytest.fixture(params=[1, 2], ids=lambda cpus: f"{cpus}cpu")
def program_stub(request, tmp_path):
    program = compile_program("syscalls", "glibc-static", tmp_path)
    server = start_stub("--run", f"{program} forever", cpus=request.param)
    wait_until(lambda: any("round" in line for line in server.output), "the program's first output")
    yield server, program
    server.stop()


def _program_runs(server) -> None:
    """The program goes on writing its rounds, and the machine is not stopped."""
    rounds = sum("round" in line for line in server.output)
    wait_until(lambda: sum("round" in line for line in server.output) > rounds, "the program's next round")
    with RspClient.connect_when_free(server, timeout=30) as client:
        assert "stopped by the debugger" not in client.monitor("stats")


def test_break_in_the_program_stops_the_machine_where_the_process_runs(gdb, program_stub):
    server, program = program_stub
    out = run_gdb(gdb, server, f"add-symbol-file {program}", "break getppid", "continue",
                  "bt", "print $cs", "print $pc == getppid", "x/2i $pc",
                  "stepi", "print (long)$pc - (long)getppid", "print $cs",
                  "continue", "print $pc == getppid", "info threads", "delete", "detach", timeout=120)
    hits = re.findall(r"^(?:Thread \d+ hit )?Breakpoint 1, 0x[0-9a-f]+ in getppid \(\)$", out, re.M)
    assert len(hits) == 2, out + "".join(server.output[-20:])
    walk = re.findall(r"^#\d+\s+(?:0x[0-9a-f]+ in )?(\w+) \(", out, re.M)
    assert walk[:2] == ["getppid", "main"], out  # the program's own stack, read through its page tables
    assert re.findall(r"^\$\d+ = (.*)$", out, re.M) == ["51", "1", "5", "51", "1"], out  # ring 3's CS; one step
    assert re.search(r"=> 0x[0-9a-f]+ <getppid>:\s+mov\s+\$0x6e,%eax", out), out  # its code, never patched
    assert "[Inferior 1 (Remote target) detached]" in out, out
    _program_runs(server)


def test_user_addresses_no_process_maps_are_refused(gdb, program_stub):
    server, program = program_stub
    out = gdb_each(gdb, server, "break *0x7f0000000000", "continue", "delete", "hbreak *0x7f0000001000",
                   "continue", "delete", "monitor process 4242", "detach", timeout=120)
    assert len(re.findall(r"Cannot insert (hardware )?breakpoint \d+", out)) == 2, out
    assert "no process 4242 runs" in out, out
    log = "".join(server.output)
    for address in ("0x7f0000000000", "0x7f0000001000"):
        assert re.search(rf"{address} is not mapped as code in the kernel's address space \(no process maps it\)",
                         log), log[-3000:]
    _program_runs(server)
