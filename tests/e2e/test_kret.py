"""Return probes with real GDB: KGTP's howto example (`trace *vfs_read`, `teval $kret=0`) on the simulated
kernel's `do_syscall`, checked against what the kernel returned, and GDB's backtrace after the return."""

from __future__ import annotations

import re

import pytest

from ..conftest import run_gdb, wait_for_hits

pytestmark = pytest.mark.gdb

#: GDB Python: one line per frame of tracepoint 2 with the system call, its result, the counter, the PC and the
#: first two frames of GDB's backtrace
EACH_RETURN = (
    "python",
    "gdb.execute('tfind none')",
    "while 'Found trace frame' in gdb.execute('tfind tracepoint 2', to_string=True):",
    "    v = lambda e: int(gdb.parse_and_eval(e))",
    "    bt = gdb.execute('bt 2', to_string=True).replace(chr(10), '|')",
    "    print('RETURN %d %d %d %#x %s' % (v('regs->orig_ax'), v('$rax'), v('syscall_counter'), v('$pc'), bt))",
    "end",
)


def test_howto_return_probe_on_do_syscall(gdb, fresh_stub):
    """The howto's example adapted: do_interrupt's return is hijacked too while do_syscall runs (an outer
    return probe), so the stack `collect $bt` records holds a trampoline that GDB must never see."""
    out = run_gdb(
        gdb, fresh_stub,
        "trace *do_interrupt", "actions", "teval $kret=0", "end",
        "trace *do_syscall", "actions", "teval $kret=0", "collect $bt", "collect regs->orig_ax",
        "collect syscall_counter", "end",
        "tstart", *wait_for_hits(2, 8), "tstop", "monitor probes", *EACH_RETURN,
        "tfind none", "tstart", *wait_for_hits(2, 2), "tstop", "tstatus",
    )
    rows = re.findall(r"^RETURN (-?\d+) (-?\d+) (\d+) (0x[0-9a-f]+) (.*)$", out, re.M)
    assert len(rows) >= 8, out
    numbers = set()
    for nr, value, counter, pc, bt in rows:
        nr, value = int(nr), int(value)
        numbers.add(nr)
        # getpid is syscall_test's pid (3 on CPU 0, 8 on CPU 1: syscall_test/1); kgtp_count's value was the
        # counter then, and another CPU may count before the collection at the return
        if nr == 39:
            assert value in (3, 8), (nr, value, out)
        elif nr == 500:
            assert 0 < value <= int(counter), (nr, value, out)
        else:
            assert value == {1: 35, 24: 0, 35: 0}[nr], (nr, value, out)
        assert "do_interrupt" in bt.split("|")[0] and "common_entry" in bt.split("|")[1], bt
        assert "??" not in bt and "0xffffffffa" not in bt, bt  # no trampoline in module space
    assert {39, 500, 35} <= numbers, rows
    pcs = {pc for *_, pc, _ in rows}
    assert len(pcs) == 1, pcs  # do_interrupt's instruction after the call, every time
    assert re.search(r"^\s+2\s+0x[0-9a-f]+\s+int3\s+removed.*do_syscall, return probe: \d+ entered", out, re.M), out
    assert "pending at removal" in out, out  # syscall_test sleeps in do_syscall: tstop found it in flight
    assert re.search(r"Collected [1-9]\d* trace frames", out.split("RETURN")[-1]), out  # the second run


def test_a_return_probe_must_be_at_a_functions_first_address(gdb, fresh_stub):
    out = run_gdb(gdb, fresh_stub, "trace syscall.c:44", "actions", "teval $kret=0", "end", "info tracepoints",
                  "tstart", "tstatus")  # inside do_syscall, at `nr_syscalls++`
    assert "kret needs the first address of a function" in out and "Trace is running" not in out, out
    out = run_gdb(gdb, fresh_stub, "delete", "trace *do_syscall", "actions", "teval $kret=0", "end",
                  "tstart", "tstatus", "tstop")
    assert "Trace is running" in out, out
