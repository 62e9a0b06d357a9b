"""The GDB testsuite harness (scripts/gdb-testsuite) without running the testsuite: gdb.sum parsing, the
side-by-side table and the by-name differences on small summaries written here, the file sets, the flags and the
stub's wrapper. No apt, no make."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kgtp_sim.tools import gdb_testsuite as gt
from kgtp_sim.tools.gdb_testsuite import Cache, Result, Run

HEAD = """Test run by root on Wed Nov 25 17:18:34 2026
Native configuration is x86_64-pc-linux-gnu

\t\t=== gdb tests ===

Schedule of variations:
    native-gdbserver

Running target native-gdbserver
"""
TAIL = """
\t\t=== gdb Summary ===

# of expected passes\t\t3
/usr/bin/gdb version  13.1-3) -nw -nx
"""
#: what DejaGnu appends after the summary when the last file broke: its Tcl error again, which counts nothing
ERROR_TAIL = """
ERROR: -------------------------------------------
ERROR: in testcase /c/src/gdb/gdb/testsuite/gdb.trace/ftrace.exp
ERROR:  error copying "/c/build/gdb/testsuite/../../gdbserver/libinproctrace.so": no such file or directory
ERROR:  tcl error code POSIX ENOENT {no such file or directory}
"""
RUNNING = "Running /c/build/gdb/testsuite/../../../src/gdb/gdb/testsuite/{} ...\n"

#: every outcome kind, a name that repeats (DejaGnu notes it with DUPLICATE), notes that are not outcomes, a file
#: that counted nothing, and a file that broke with a Tcl error at its end
GDBSERVER_SUM = HEAD + (
    RUNNING.format("gdb.trace/actions.exp")
    + "PASS: gdb.trace/actions.exp: 5.1a: set three tracepoints\n"
    + "PASS: gdb.trace/actions.exp: continue\n"
    + "DUPLICATE: gdb.trace/actions.exp: continue\n"
    + "PASS: gdb.trace/actions.exp: continue\n"
    + "FAIL: gdb.trace/actions.exp: tfind none (timeout)\n"
    + "XFAIL: gdb.trace/actions.exp: collect \\$_sdata\n"
    + "KFAIL: gdb.trace/actions.exp: print anarg (PRMS: gdb/13808)\n"
    + "XPASS: gdb.trace/actions.exp: an expected failure that passed\n"
    + "WARNING: Timed out waiting for EOF in server after monitor exit\n"
    + RUNNING.format("gdb.trace/empty.exp")
    + RUNNING.format("gdb.trace/strace.exp")
    + "UNSUPPORTED: gdb.trace/strace.exp: target does not support static tracepoints\n"
    + "UNTESTED: gdb.trace/strace.exp: failed to compile\n"
    + "KPASS: gdb.trace/strace.exp: a known failure that passed (PRMS: gdb/1)\n"
    + RUNNING.format("gdb.trace/ftrace.exp")
    + "PASS: gdb.trace/ftrace.exp: IPA loaded\n"
    + "ERROR: tcl error sourcing /c/src/gdb/gdb/testsuite/gdb.trace/ftrace.exp.\n"
    + "ERROR: tcl error code POSIX ENOENT {no such file or directory}\n"
    + "    while executing\n"
    + "\"file copy -force $fromfile $tofile\"\n"
    + "UNRESOLVED: gdb.trace/ftrace.exp: testcase '/c/src/gdb/gdb/testsuite/gdb.trace/ftrace.exp' aborted due to "
      "Tcl error\n"
    + "PATH: gdb.trace/ftrace.exp: testcase '/c/src/gdb/gdb/testsuite/gdb.trace/ftrace.exp' aborted due to Tcl error\n"
) + TAIL + ERROR_TAIL

#: the other server: the second `continue` and `IPA loaded` fail, `tfind none` passes, strace.exp is not run
STUB_SUM = HEAD + (
    RUNNING.format("gdb.trace/actions.exp")
    + "PASS: gdb.trace/actions.exp: 5.1a: set three tracepoints\n"
    + "PASS: gdb.trace/actions.exp: continue\n"
    + "FAIL: gdb.trace/actions.exp: continue\n"
    + "PASS: gdb.trace/actions.exp: tfind none\n"
    + "XFAIL: gdb.trace/actions.exp: collect \\$_sdata\n"
    + "KFAIL: gdb.trace/actions.exp: print anarg (PRMS: gdb/13808)\n"
    + RUNNING.format("gdb.trace/ftrace.exp")
    + "FAIL: gdb.trace/ftrace.exp: IPA loaded\n"
) + TAIL


def outcomes(results):
    return [(r.file, r.name, r.occurrence, r.outcome) for r in results]


def test_every_outcome_line_is_read_with_its_file_and_name():
    results = gt.parse_sum(GDBSERVER_SUM)
    assert outcomes(results) == [
        ("gdb.trace/actions.exp", "5.1a: set three tracepoints", 1, "PASS"),
        ("gdb.trace/actions.exp", "continue", 1, "PASS"),
        ("gdb.trace/actions.exp", "continue", 2, "PASS"),
        ("gdb.trace/actions.exp", "tfind none", 1, "FAIL"),  # the reason is not part of the name
        ("gdb.trace/actions.exp", "collect \\$_sdata", 1, "XFAIL"),
        ("gdb.trace/actions.exp", "print anarg (PRMS: gdb/13808)", 1, "KFAIL"),
        ("gdb.trace/actions.exp", "an expected failure that passed", 1, "XPASS"),
        ("gdb.trace/strace.exp", "target does not support static tracepoints", 1, "UNSUPPORTED"),
        ("gdb.trace/strace.exp", "failed to compile", 1, "UNTESTED"),
        ("gdb.trace/strace.exp", "a known failure that passed (PRMS: gdb/1)", 1, "KPASS"),
        ("gdb.trace/ftrace.exp", "IPA loaded", 1, "PASS"),
        ("gdb.trace/ftrace.exp", "tcl error sourcing /c/src/gdb/gdb/testsuite/gdb.trace/ftrace.exp.", 1, "ERROR"),
        ("gdb.trace/ftrace.exp", "tcl error code POSIX ENOENT {no such file or directory}", 1, "ERROR"),
        ("gdb.trace/ftrace.exp", "testcase '/c/src/gdb/gdb/testsuite/gdb.trace/ftrace.exp' aborted due to Tcl error",
         1, "UNRESOLVED"),
    ]  # and nothing of the ERROR lines after the summary
    assert gt.files_of(GDBSERVER_SUM) == ["gdb.trace/actions.exp", "gdb.trace/empty.exp", "gdb.trace/strace.exp",
                                          "gdb.trace/ftrace.exp"]


def test_counts_per_file_cover_every_kind():
    counts = gt.count(gt.parse_sum(GDBSERVER_SUM))
    assert counts["gdb.trace/actions.exp"] == {"PASS": 3, "FAIL": 1, "XFAIL": 1, "KFAIL": 1, "XPASS": 1}
    assert counts["gdb.trace/strace.exp"] == {"UNSUPPORTED": 1, "UNTESTED": 1, "KPASS": 1}
    assert counts["gdb.trace/ftrace.exp"] == {"PASS": 1, "UNRESOLVED": 1, "ERROR": 2}
    assert "gdb.trace/empty.exp" not in counts
    seen = {kind for per in counts.values() for kind in per}
    assert seen == set(gt.OUTCOMES) | set(gt.RARE_OUTCOMES)


def test_a_name_outside_any_file_and_a_path_without_testsuite():
    text = "ERROR: no board\nRunning /x/gdb.base/break.exp ...\nPASS: gdb.base/break.exp: run\n"
    assert outcomes(gt.parse_sum(text)) == [("", "no board", 1, "ERROR"), ("gdb.base/break.exp", "run", 1, "PASS")]


def test_differences_name_the_tests_by_occurrence_and_the_other_outcome():
    runs = {"gdbserver": gt.parse_sum(GDBSERVER_SUM), "kgtp-sim": gt.parse_sum(STUB_SUM)}
    found = [(d.passes_with, d.file, d.label, d.other_outcome) for d in gt.differences(runs)]
    assert found == [
        ("gdbserver", "gdb.trace/actions.exp", "continue (#2)", "FAIL"),
        ("kgtp-sim", "gdb.trace/actions.exp", "tfind none", "FAIL (timeout)"),
        ("gdbserver", "gdb.trace/ftrace.exp", "IPA loaded", "FAIL"),
    ]
    text = gt.format_differences(gt.differences(runs))
    assert "pass with gdbserver, not with kgtp-sim (2):" in text
    assert "  gdb.trace/actions.exp: continue (#2)  [kgtp-sim: FAIL]" in text
    assert "pass with kgtp-sim, not with gdbserver (1):" in text


def test_a_failure_named_with_its_reason_is_the_same_test_as_the_pass():
    """gdb_test_multiple appends why a test failed to its name: that FAIL is the other server's PASS of the bare
    name, with the reason beside the outcome; a reason it does not write (a KFAIL's PRMS, a name of the test's own
    in parentheses) stays in the name, and a PASS keeps its whole name."""
    lines = ["FAIL: gdb.base/sigstep.exp: leave handler (the program is no longer running)",
             "FAIL: gdb.base/sigstep.exp: continue to signal (the program exited)",
             "UNRESOLVED: gdb.base/sigstep.exp: listed args (after initial) (timeout)",
             "FAIL: gdb.base/sigstep.exp: call function when asleep (wrong output)",
             "PASS: gdb.base/sigstep.exp: step to handler (timeout)"]
    text = HEAD + RUNNING.format("gdb.base/sigstep.exp") + "\n".join(lines) + "\n" + TAIL
    results = gt.parse_sum(text)
    assert [(r.name, r.outcome, r.reason) for r in results] == [
        ("leave handler", "FAIL", "the program is no longer running"),
        ("continue to signal", "FAIL", "the program exited"),
        ("listed args (after initial)", "UNRESOLVED", "timeout"),
        ("call function when asleep (wrong output)", "FAIL", ""),
        ("step to handler (timeout)", "PASS", ""),
    ]
    passed = gt.parse_sum(HEAD + RUNNING.format("gdb.base/sigstep.exp") + "PASS: gdb.base/sigstep.exp: leave handler\n"
                          + TAIL)
    (difference,) = gt.differences({"gdbserver": passed, "kgtp-sim": results[:1]})
    assert (difference.label, difference.other_outcome) == ("leave handler", "FAIL (the program is no longer running)")


def test_a_test_the_other_server_never_ran_is_a_difference():
    stub = STUB_SUM.replace("PASS: gdb.trace/actions.exp: 5.1a: set three tracepoints\n", "")
    runs = {"gdbserver": gt.parse_sum(GDBSERVER_SUM), "kgtp-sim": gt.parse_sum(stub)}
    first = gt.differences(runs)[0]
    assert (first.label, first.other_outcome) == ("5.1a: set three tracepoints", None)
    assert "[kgtp-sim: not run]" in gt.format_differences([first])


def test_identical_runs_and_a_single_run_have_no_differences():
    same = gt.parse_sum(GDBSERVER_SUM)
    assert gt.differences({"gdbserver": same, "kgtp-sim": list(same)}) == []
    assert gt.differences({"gdbserver": same}) == []
    assert gt.format_differences([]) == "no test passes with one server and not with the other"


def runs():
    return [Run("native-gdbserver", "gdbserver", gt.files_of(GDBSERVER_SUM), gt.parse_sum(GDBSERVER_SUM), 12.5),
            Run("native-gdbserver", "kgtp-sim", gt.files_of(STUB_SUM), gt.parse_sum(STUB_SUM), 30.25)]


def test_the_table_puts_both_servers_side_by_side_per_file_and_in_total():
    header, rows = gt.table_rows(runs())
    kinds = list(gt.OUTCOMES) + ["XPASS", "KPASS"]  # shown because a run has some
    assert header == ["file"] + [f"{s} {gt.HEADINGS.get(k, k)}" for s in ("gdbserver", "kgtp-sim") for k in kinds]
    by_file = {row[0]: dict(zip(header[1:], row[1:])) for row in rows}
    assert list(by_file) == ["gdb.trace/actions.exp", "gdb.trace/empty.exp", "gdb.trace/ftrace.exp",
                             "gdb.trace/strace.exp", "total"]
    assert by_file["gdb.trace/actions.exp"]["gdbserver PASS"] == "3"
    assert by_file["gdb.trace/actions.exp"]["kgtp-sim PASS"] == "3"
    assert by_file["gdb.trace/actions.exp"]["kgtp-sim FAIL"] == "1"
    assert by_file["gdb.trace/empty.exp"]["gdbserver PASS"] == "0"  # ran, counted nothing
    assert by_file["gdb.trace/empty.exp"]["kgtp-sim PASS"] == "-"  # not run
    assert by_file["gdb.trace/ftrace.exp"]["gdbserver ERROR"] == "2"
    assert by_file["gdb.trace/ftrace.exp"]["gdbserver UNRES"] == "1"
    total = by_file["total"]
    assert (total["gdbserver PASS"], total["gdbserver FAIL"], total["kgtp-sim FAIL"]) == ("4", "1", "2")
    assert sum(int(v) for k, v in total.items() if k.startswith("gdbserver")) == len(gt.parse_sum(GDBSERVER_SUM))


def test_the_text_table_lines_up_and_the_report_has_wall_times():
    text = gt.format_table(runs())
    lines = text.splitlines()
    assert lines[0].split() == ["|", "gdbserver", "|", "kgtp-sim"]
    assert lines[1].split("|")[1].split() == ["PASS", "FAIL", "XFAIL", "KFAIL", "UNRES", "UNSUP", "UNTST", "ERROR",
                                              "XPASS", "KPASS"]
    assert len({line.index("|") for line in lines}) == 1  # the file column has one width
    assert len({line.rindex("|") for line in lines}) == 1
    report = gt.report("native-gdbserver", runs(), {})
    assert report.startswith("== native-gdbserver: 4 files; wall time: gdbserver 12.5 s, kgtp-sim 30.2 s")
    assert "continue (#2)" in report
    single = gt.report("native-gdbserver", runs()[:1], {"kgtp-sim": "the stub has no gdbserver role yet"})
    assert "(kgtp-sim not run: the stub has no gdbserver role yet)" in single
    assert "pass with" not in single and "no test passes" not in single


def test_the_markdown_table_has_a_row_per_file_and_a_total():
    lines = gt.markdown_table(runs()).splitlines()
    assert lines[0].startswith("| file | gdbserver PASS | gdbserver FAIL |")
    assert lines[1] == "|---" * (1 + 2 * 10) + "|"
    assert lines[2].startswith("| `gdb.trace/actions.exp` | 3 | 1 | 1 | 1 |")
    assert lines[-1].startswith("| **total** | 4 |")


def test_only_gdbserver_differs_between_the_servers_flags():
    a = gt.runtest_flags("native-gdbserver", "/usr/bin/gdbserver", ["gdb.trace/tfind.exp"])
    b = gt.runtest_flags("native-gdbserver", "/c/bin/kgtp-sim-gdbserver", ["gdb.trace/tfind.exp"])
    assert a == ("GDB=/usr/bin/gdb GDBSERVER=/usr/bin/gdbserver GDB_DATA_DIRECTORY=/usr/share/gdb "
                 "--target_board=native-gdbserver gdb.trace/tfind.exp")
    assert a.replace("/usr/bin/gdbserver", "/c/bin/kgtp-sim-gdbserver") == b


@pytest.fixture
def cache(tmp_path):
    cache = Cache(tmp_path)
    for name in ("gdb.trace/tfind.exp", "gdb.trace/actions.exp", "gdb.trace/actions.c", *gt.RUN_CONTROL):
        path = cache.testsuite / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    return cache


def test_files_sets_and_patterns_expand_in_order_once(cache):
    assert cache.expand(["@trace"]) == ["gdb.trace/actions.exp", "gdb.trace/tfind.exp"]
    assert cache.expand(["gdb.trace/tfind.exp", "gdb.trace/*.exp"]) == ["gdb.trace/tfind.exp",
                                                                         "gdb.trace/actions.exp"]
    assert cache.expand(["@run-control"]) == list(gt.RUN_CONTROL)
    with pytest.raises(ValueError, match="no testsuite file matches gdb.trace/nothing.exp"):
        cache.expand(["gdb.trace/nothing.exp"])
    with pytest.raises(ValueError, match="unknown set @nothing"):
        cache.expand(["@nothing"])


def test_the_run_control_set_is_gdb_base_and_gdb_threads_files_once_each():
    assert len(set(gt.RUN_CONTROL)) == len(gt.RUN_CONTROL)
    assert {name.split("/")[0] for name in gt.RUN_CONTROL} == {"gdb.base", "gdb.threads"}


def test_the_stub_wrapper_runs_the_stubs_gdbserver_role_with_the_arguments_given(cache):
    wrapper = cache.stub_wrapper(sys.executable)
    direct = subprocess.run([sys.executable, "-m", "kgtp_sim", "gdbserver", "--help"], capture_output=True,
                            text=True, cwd=gt.ROOT)
    through = subprocess.run([str(wrapper), "--help"], capture_output=True, text=True, cwd="/")
    assert (through.returncode, through.stdout) == (direct.returncode, direct.stdout)
    assert (gt.server_answers(wrapper) is None) == (direct.returncode == 0)


def test_the_stub_wrapper_names_the_shared_objects_beside_each_program_run(cache, tmp_path):
    """The wrapper passes `--with '$ORIGIN/*.so'` and the like to the role untouched (no shell expands `$ORIGIN` or
    the patterns, whatever the working directory holds), then the testsuite's arguments: one rule for every test."""
    echo = tmp_path / "echo-args"
    echo.write_text("#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done\n")
    echo.chmod(0o755)
    (tmp_path / "lib.so").write_text("")  # something a shell's expansion would take
    wrapper = cache.stub_wrapper(str(echo))
    through = subprocess.run([str(wrapper), "--once", "localhost:2345", "/b/prog", "x"], capture_output=True,
                             text=True, cwd=tmp_path, check=True)
    assert through.stdout.splitlines() == ["-S", "-m", "kgtp_sim", "gdbserver", "--with", "$ORIGIN/*.so", "--with",
                                           "$ORIGIN/*.so.*", "--with", "$ORIGIN/*.sl", "--once", "localhost:2345",
                                           "/b/prog", "x"]


def test_the_stub_wrapper_starts_a_cold_server_though_its_python_reads_no_site_packages(cache):
    """The wrapper runs Python without its site-packages (-S: a warm start's launcher needs none); with no warm
    server, the role loads them itself and its machine (unicorn's, from the site-packages) boots."""
    wrapper = cache.stub_wrapper(sys.executable)
    env = {k: v for k, v in os.environ.items() if k != "KGTP_SIM_WARM"}
    proc = subprocess.Popen([str(wrapper), "--once", "--multi", "127.0.0.1:0"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd="/")
    try:
        first = proc.stderr.readline()
        assert first.startswith("Listening on port "), first + proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_a_server_that_cannot_start_says_why(tmp_path):
    assert gt.server_answers("/bin/true") is None
    assert gt.server_answers(tmp_path / "absent") is not None
    script = tmp_path / "refuses"
    script.write_text("#!/bin/sh\necho 'usage: refuses' >&2\necho 'refuses: no such role' >&2\nexit 2\n")
    script.chmod(0o755)
    assert gt.server_answers(script) == "refuses: no such role"


def test_the_stub_wrapper_leaves_the_packages_bytecode_compiled_for_every_start(cache):
    """Hundreds of servers start in a run: each reads the package's bytecode the wrapper compiled, even where
    Python is told not to write any (PYTHONDONTWRITEBYTECODE), instead of compiling every module again."""
    import importlib.util

    cache.stub_wrapper(sys.executable)
    for module in ("kgtp_sim/gdbserver.py", "kgtp_sim/stub/extended.py", "kgtp_sim/machine/procfs.py"):
        source = gt.ROOT / module
        compiled = Path(importlib.util.cache_from_source(str(source)))
        assert compiled.exists() and compiled.stat().st_mtime >= source.stat().st_mtime, module
