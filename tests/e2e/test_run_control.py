"""Run control of the kernel with real GDB 13.1 and 18.1 (QEMU's gdbstub as the model, opt-in): a breakpoint stops
the whole machine and GDB shows the CPU that hit it, on each CPU; `stepi`, `finish`, `next`, `step` on that CPU;
`continue` resumes every CPU; the kernel's time stands still while stopped; the SMP stress and jiffies come out
exact; a breakpoint and a tracepoint at one address; `hbreak`, `watch`; Ctrl-C with and without run control;
detach with breakpoints in place and a GDB killed while the machine is stopped leave the kernel running;
breakpoints where the machine cannot stop are refused, the reason in the stub's log.

Every wait is for an event (a stop GDB reports, a counter the kernel or the ticker moves), never a time window.
"""

from __future__ import annotations

import json
import re

import pytest

from kgtp_sim.client import RspClient
from kgtp_sim.client.gdb import gdb_each
from kgtp_sim.client.mi import GdbMi
from kgtp_sim.machine import KernelImage

from ..conftest import VMLINUX, assert_kernel_ticks, run_gdb, start_stub, wait_until

pytestmark = pytest.mark.gdb

IMAGE = KernelImage.load(VMLINUX)
JIFFIES = IMAGE.address_of("jiffies")
NR_SYSCALLS = IMAGE.address_of("nr_syscalls")
TEST_FUNCTION = IMAGE.address_of("kgtp_test_function")
WAIT_S = 90


@pytest.fixture
def stub2():
    """Two CPUs, memory writable (the test asks the kernel for a stress generation)."""
    server = start_stub("--allow-writes", cpus=2)
    yield server
    server.stop()


def _python(*lines: str) -> tuple[str, ...]:
    return ("python", *lines, "end")


#: GDB Python helpers: values, `monitor stats` as a dict, a wait for a condition (an event, with a deadline)
HELPERS = _python(
    "import json, re, time",
    "def val(expression): return int(gdb.parse_and_eval(expression))",
    "def stats():",
    "    text = gdb.execute('monitor stats', to_string=True)",
    r"    return dict(re.findall(r'^(\w+)\s+(.*)$', text, re.M))",
    f"def wait(condition, what, timeout={WAIT_S}):",
    "    deadline = time.monotonic() + timeout",
    "    while not condition():",
    "        if time.monotonic() > deadline: raise gdb.GdbError('timed out waiting for ' + what)",
    "        time.sleep(0.01)",
)


def _kernel_runs(stub) -> None:
    """The kernel runs and no breakpoint is left in it: system calls go on, the machine never stops."""
    with RspClient.connect_when_free(stub, timeout=30) as client:
        assert_kernel_ticks(client, JIFFIES)
        calls = client.read_u64(NR_SYSCALLS)
        wait_until(lambda: client.read_u64(NR_SYSCALLS) > calls + 10, "system calls")
        assert "stopped by the debugger" not in client.monitor("stats")
        assert client.request(b"?") == b"T05thread:1;"


def test_stopped_at_a_breakpoint_on_each_cpu_stepped_and_resumed_with_the_counters_exact(gdb, stub2):
    script = (*HELPERS, *_python(
        # the breakpoint in the kernel before the generation starts (GDB would insert it at `continue` only, by
        # which time each CPU may have run all its rounds)
        "gdb.execute('set breakpoint always-inserted on')",
        "bp = gdb.Breakpoint('stress_step')",
        # the first of a round's three calls (stress_a = stress_step(a, 1), before it changes stress_a): `finish`
        # returns to its line, `next` goes to the second call's line, `step` enters stress_step; stopped at the
        # third, `next` went on to spin_unlock_irqrestore's line
        "bp.condition = 'stress_b == 2 * stress_a'",
        "gdb.execute('set var stress_iterations = 20000')",
        "generation = val('stress_completed') + 1",
        "gdb.execute(f'set var stress_generation = {generation}')",
        "seen = {}",
        "deadline = time.monotonic() + 120",
        "while len(seen) < 2:",
        "    if time.monotonic() > deadline: raise gdb.GdbError(f'stress_step hit on threads {sorted(seen)} only')",
        "    gdb.execute('continue')",
        "    thread = gdb.selected_thread().num",
        "    if thread in seen: continue",
        "    stop = {'function': gdb.selected_frame().name(), 'pc': val('$pc')}",
        # the machine stands still, its time with it: five ticks the ticker held, nothing moved
        "    still = (val('jiffies'), val('$rdtsc'), val('kgtp_counter'))",
        "    held = int(stats()['ticks_held'])",
        "    wait(lambda: int(stats()['ticks_held']) >= held + 5, 'five held ticks')",
        "    stop['still'] = (val('jiffies'), val('$rdtsc'), val('kgtp_counter')) == still",
        "    s = stats()",
        "    stop['jiffies'], stop['ticks'], stop['state'] = val('jiffies'), int(s['ticks']), s['state']",
        "    length = gdb.selected_frame().architecture().disassemble(stop['pc'])[0]['length']",
        "    bp.enabled = False",
        "    gdb.execute('stepi')",
        "    stop['stepi'] = val('$pc') - stop['pc'] == length",
        "    threads = [gdb.selected_thread().num]",
        "    gdb.execute('finish')",
        "    stop['finished_in'] = gdb.selected_frame().name()",
        "    threads.append(gdb.selected_thread().num)",
        "    gdb.execute('next')",
        "    threads.append(gdb.selected_thread().num)",
        "    gdb.execute('step')",
        "    stop['stepped_into'] = gdb.selected_frame().name()",
        "    threads.append(gdb.selected_thread().num)",
        "    stop['threads'] = threads",
        "    bp.enabled = True",
        "    seen[thread] = stop",
        "bp.delete()",
        "gdb.execute('monitor go')",
        "wait(lambda: val('stress_completed') == generation, 'the stress generation')",
        "totals = {name: val(name) for name in ('stress_counter', 'stress_a', 'stress_b', 'stress_done',"
        " 'stress_errors', 'stress_expected')}",
        "print('RESULT ' + json.dumps({'stops': seen, 'totals': totals}))",
    ), "detach")
    out = run_gdb(gdb, stub2, *script, timeout=300)
    found = re.search(r"^RESULT (.*)$", out, re.M)
    assert found, out
    result = json.loads(found.group(1))
    stops, totals = result["stops"], result["totals"]
    assert sorted(stops) == ["1", "2"], out  # a stop on each CPU, GDB on the CPU that hit
    assert re.search(r"^Thread 2 hit Breakpoint \d+, stress_step", out, re.M), out
    for thread, stop in stops.items():
        assert stop["function"] == "stress_step" and stop["still"], (thread, stop)
        assert stop["state"] == "stopped by the debugger"
        assert stop["ticks"] - 1 <= stop["jiffies"] <= stop["ticks"], stop  # every tick given counted once
        assert stop["stepi"] and stop["finished_in"] == "stress_rounds" and stop["stepped_into"] == "stress_step"
        assert stop["threads"] == [int(thread)] * 4, stop  # stepping stayed on that CPU
    expected = totals["stress_expected"]
    assert totals["stress_counter"] == totals["stress_done"] == totals["stress_a"] == expected, totals
    assert totals["stress_b"] == 2 * expected and totals["stress_errors"] == 0, totals
    _kernel_runs(stub2)


def test_a_breakpoint_and_a_tracepoint_at_one_address(gdb, stub2):
    """The machine stops before the tracepoint's probe; `stepi` with only that CPU running runs the probe (one
    frame more) and lands on the next kernel instruction; both keep working while the machine runs."""
    script = (*HELPERS,
              "trace kgtp_test_function", "actions", "collect $regs", "end", "tstart",
              "break kgtp_test_function", "continue", "set scheduler-locking on",
              *_python("frames = lambda: int(re.search(r'Collected (\\d+) trace frames',"
                       " gdb.execute('tstatus', to_string=True)).group(1))",
                       "before = frames()"),
              "stepi",
              *_python("print('STEPPED', frames() - before, val('$pc') - val('&kgtp_test_function'))"),
              "set scheduler-locking off", "continue",
              *_python("print('AGAIN', val('$pc') == val('&kgtp_test_function'), frames() > before)"),
              "delete", "tstop", "tfind start", "detach")
    out = run_gdb(gdb, stub2, *script, timeout=180)
    assert re.search(r"^STEPPED 1 7$", out, re.M), out  # addl $1, kgtp_counter(%rip) is 7 bytes
    assert re.search(r"^AGAIN True True$", out, re.M), out
    assert re.search(r"Found trace frame 0, tracepoint 1", out), out
    _kernel_runs(stub2)


def test_hbreak_and_watch_on_the_debug_registers(gdb, stub2):
    out = gdb_each(gdb, stub2, "hbreak do_syscall", "continue", "info registers rip", "delete",
                   "watch jiffies", "continue", "delete", "detach", timeout=120)
    assert re.search(r"^Hardware assisted breakpoint 1 at 0x[0-9a-f]+: file fixtures/kernel/syscall.c", out, re.M), out
    assert re.search(r"^Thread \d hit Breakpoint 1, do_syscall ", out, re.M), out
    assert re.search(r"^rip\s+0x[0-9a-f]+\s+0x[0-9a-f]+ <do_syscall>", out, re.M), out
    found = re.search(r"Thread 1 hit Hardware watchpoint 2: jiffies\s+Old value = (\d+)\s+New value = (\d+)", out)
    assert found and int(found.group(2)) == int(found.group(1)) + 1, out  # CPU 0 keeps time
    _kernel_runs(stub2)


def test_ctrl_c_stops_nothing_without_run_control_and_every_cpu_with_it(gdb, stub2):
    with GdbMi(gdb, mi_async=True) as mi:
        assert mi.attach(stub2.address).klass == "connected"
        mi.command("-exec-continue")
        mi.command("-exec-interrupt")
        stop = mi.wait_stopped()
        assert stop.get("signal-name") == "SIGTRAP", stop  # KGTP: the kernel never stopped
        first = mi.evaluate("jiffies")
        wait_until(lambda: mi.evaluate("jiffies") != first, "jiffies to move on")

        mi.console("break panic")  # never hit: run control asked for
        mi.command("-exec-continue")
        mi.command("-exec-interrupt")
        stop = mi.wait_stopped()
        assert stop.get("signal-name") == "SIGINT" and stop.get("stopped-threads") == "all", stop
        assert "stopped by the debugger" in mi.console("monitor stats").console
        jiffies = mi.evaluate("jiffies")
        held = re.search(r"ticks_held\s+(\d+)", mi.console("monitor stats").console)
        wait_until(lambda: int(re.search(r"ticks_held\s+(\d+)", mi.console("monitor stats").console).group(1))
                   >= int(held.group(1)) + 3, "held ticks")
        assert mi.evaluate("jiffies") == jiffies
        mi.console("delete")
        mi.command("-exec-continue")  # a stopped machine continues: Ctrl-C stops it again
        mi.command("-exec-interrupt")
        assert mi.wait_stopped().get("signal-name") == "SIGINT"
        mi.console("detach")
    _kernel_runs(stub2)


def test_monitor_stop_and_go_without_a_breakpoint(gdb, stub2):
    """`monitor stop` stops every CPU where it is (GDB, which saw a running kernel, reads the registers again);
    the time stands still; a CPU steps; `monitor go` lets the kernel run on, GDB looking at it live again."""
    script = (*HELPERS, "monitor stop", "maint flush register-cache", *_python(
        "j, t = val('jiffies'), val('$rdtsc')",
        "held = int(stats()['ticks_held'])",
        "wait(lambda: int(stats()['ticks_held']) >= held + 3, 'held ticks')",
        "print('STILL', (val('jiffies'), val('$rdtsc')) == (j, t), stats()['state'])",
        "pc = val('$pc')",
        "length = gdb.selected_frame().architecture().disassemble(pc)[0]['length']",
        "halted = gdb.execute('monitor cpus', to_string=True).splitlines()[0].split()[2] == 'idle'",
    ), "stepi", *_python(
        "moved = gdb.selected_frame().name().startswith('asm_') if halted else val('$pc') - pc == length",
        "print('STEPPED', moved)",
    ), "monitor go", *_python(
        "j = val('jiffies')",
        "wait(lambda: val('jiffies') > j, 'jiffies to move on')",
        "print('RUNNING', stats()['state'])",
    ), "detach")
    out = run_gdb(gdb, stub2, *script, timeout=120)
    assert re.search(r"^machine stopped: CPU 0 at 0x[0-9a-f]+ \(\w+\+0x[0-9a-f]+\), CPU 1 at ", out, re.M), out
    assert re.search(r"^STILL True stopped by the debugger$", out, re.M), out
    assert re.search(r"^STEPPED True$", out, re.M), out  # one instruction; a halted CPU, into its wake-up interrupt
    assert re.search(r"^RUNNING (running|idle)$", out, re.M), out
    _kernel_runs(stub2)


def test_detach_with_breakpoints_in_place_leaves_the_kernel_running(gdb, stub2):
    out = run_gdb(gdb, stub2, "break do_syscall", "hbreak kgtp_test_function", "watch kgtp_counter",
                  "set breakpoint always-inserted on", "continue", "info breakpoints", "detach", timeout=120)
    assert re.search(r"^Thread \d hit ", out, re.M), out
    assert "[Inferior 1 (Remote target) detached]" in out, out
    _kernel_runs(stub2)


def test_a_gdb_killed_while_the_machine_is_stopped_leaves_it_running(gdb, stub2):
    mi = GdbMi(gdb, mi_async=True)
    with mi:
        assert mi.attach(stub2.address).klass == "connected"
        mi.console("break do_syscall")
        mi.command("-exec-continue")
        assert mi.wait_stopped().get("reason") == "breakpoint-hit"
        assert "stopped by the debugger" in mi.console("monitor stats").console
        mi.kill()
    _kernel_runs(stub2)


def test_breakpoints_where_the_machine_cannot_stop_are_refused(gdb, stub2):
    out = gdb_each(gdb, stub2, "break *(do_syscall+3)", "continue", "delete", "break *0xffffffffa0000000",
                   "continue", "delete", "hbreak *0x400000", "continue", "delete", "detach", timeout=120)
    assert len(re.findall(r"Cannot insert (hardware )?breakpoint \d+", out)) == 3, out
    reasons = (r"0xffffffff[0-9a-f]+ is in the middle of an instruction of do_syscall",
               r"0xffffffffa0000000 is in module space, the stub's own code",
               r"0x400000 is not mapped as code in the kernel's address space \(no process maps it\)")
    # the stub logs each reason before its error reply, but the test's reader thread may not have taken the
    # line from the pipe yet when GDB is done: wait for the lines
    try:
        wait_until(lambda: all(re.search(reason, "".join(stub2.output)) for reason in reasons), "the reasons logged")
    except AssertionError:
        raise AssertionError("".join(stub2.output)[-3000:]) from None
    _kernel_runs(stub2)
