"""KGTP's `monitor replay` with real GDB: a while-stepping recording of load_module (KGTP's howto example with
this kernel's function) is stepped through with `next`, `step`, `continue` to a breakpoint, `reverse-step` and
`reverse-continue`, registers and collected memory read at each step, while the live kernel keeps running."""

from __future__ import annotations

import re

import pytest

from ..conftest import run_gdb, wait_for_trace_stop

pytestmark = pytest.mark.gdb

RECORD = ("trace load_module", "passcount 1", "actions", "collect $bt", "collect $step_count", "collect $step_id",
          "while-stepping 300", "collect $bt", "collect $step_count", "collect $step_id", "collect nr_modules_loaded",
          "end", "end", "tstart", *wait_for_trace_stop())


def _printed(out: str) -> list[str]:
    return re.findall(r"^\$\d+ = (.*)$", out, re.M)


def test_step_next_continue_and_reverse_through_a_recording(gdb, fresh_stub):
    out = run_gdb(
        gdb, fresh_stub, *RECORD, "tfind 0", "monitor replay", "tfind -1", "print $pc == load_module",
        "next", "next", "print $step_count", "print nr_modules_loaded", "info line *$pc",
        "break 60", "continue", "print nr_modules_loaded", "print $step_count",
        "reverse-step", "print $step_count", "reverse-continue", "print $pc == load_module", "print $step_count",
        "monitor replay stop", "print jiffies > 0",
    )
    assert re.search(r"replaying \d+ frames of tracepoint 1 \(\$step_id 1\)", out), out
    assert re.search(r"^55\s+strlcpy", out, re.M) and re.search(r"^56\s+mod->taints = taints;", out, re.M), out
    values = _printed(out)
    assert values[0] == "1", out  # the replay starts at the tracepoint's own frame
    next_step, before = int(values[1]), int(values[2])
    assert next_step > 2, out  # `next` went over strlcpy's steps
    assert re.search(r"Breakpoint 2, load_module .* at fixtures/kernel/module.c:60", out), out
    after, at_break, back = int(values[3]), int(values[4]), int(values[5])
    assert after == before + 1, out  # line 59 ran between the two steps: the memory collected there says so
    assert at_break > next_step and back < at_break, out
    assert values[6:8] == ["1", "0"], out  # reverse-continue went back to the hit itself
    assert "replay stopped" in out and values[8] == "1", out


def test_replay_needs_a_frame_with_step_id(gdb, fresh_stub):
    out = run_gdb(gdb, fresh_stub, "trace kgtp_test_function", "passcount 1", "actions", "collect $regs", "end",
                  "tstart", *wait_for_trace_stop(), "monitor replay", "tfind 0", "monitor replay")
    assert "select a frame of a while-stepping tracepoint with tfind first" in out, out
    assert "cannot replay: the selected trace frame did not collect $step_id" in out, out
