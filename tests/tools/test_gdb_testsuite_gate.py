"""The regression gate (scripts/gdb-testsuite --gate) without running the testsuite: the expected file written and
read back, and runs judged against it, on small summaries written here (a regression, a new pass, names the
testsuite repeats, a file not run, a Tcl ERROR, a list changed without an update). No apt; `make` only for a
check target that writes no gdb.sum."""

from __future__ import annotations

import pytest

from kgtp_sim.tools import gdb_testsuite as gt
from kgtp_sim.tools import gdb_testsuite_gate as gate
from kgtp_sim.tools.gdb_testsuite_gate import Change, Expected

from .test_gdb_testsuite import HEAD, RUNNING, TAIL

FILES = ("gdb.trace/tsv.exp", "gdb.base/break.exp")
PROVENANCE = {"gdb": "GNU gdb (Debian 13.1-3) 13.1", "gdb-source": "13.1-3", "board": "native-gdbserver",
              "server": "kgtp-sim"}

#: what was recorded: `continue` three times in break.exp, one of them failing; a name with a tab in it
RECORDED = HEAD + (
    RUNNING.format("gdb.base/break.exp")
    + "PASS: gdb.base/break.exp: break main\n"
    + "PASS: gdb.base/break.exp: continue\n"
    + "FAIL: gdb.base/break.exp: continue\n"
    + "PASS: gdb.base/break.exp: continue\n"
    + "FAIL: gdb.base/break.exp: finish from marker (timeout)\n"
    + RUNNING.format("gdb.trace/tsv.exp")
    + "PASS: gdb.trace/tsv.exp: tvariable $tvar1\n"
    + "FAIL: gdb.trace/tsv.exp: tsave with\ta tab\n"
    + "UNSUPPORTED: gdb.trace/tsv.exp: no in-process agent\n"
) + TAIL


def recorded() -> Expected:
    return gate.parse_expected(gate.format_expected(gt.parse_sum(RECORDED), FILES, PROVENANCE))


def judge(text: str, files=FILES, expected: Expected | None = None):
    return gate.compare(expected or recorded(), files, gt.files_of(text), gt.parse_sum(text))


def changes(found: list[Change]) -> list[tuple[str, str, int, str | None, str | None]]:
    return [(c.file, c.name, c.occurrence, c.expected, c.now) for c in found]


def test_the_expected_file_keeps_every_outcome_by_occurrence_in_the_lists_order():
    text = gate.format_expected(gt.parse_sum(RECORDED), FILES, PROVENANCE)
    body = [line for line in text.splitlines() if not line.startswith("#")]
    assert body == [
        "PASS\tgdb.trace/tsv.exp\t1\ttvariable $tvar1",  # the list's order, not runtest's
        "FAIL\tgdb.trace/tsv.exp\t1\ttsave with\ta tab",
        "UNSUPPORTED\tgdb.trace/tsv.exp\t1\tno in-process agent",
        "PASS\tgdb.base/break.exp\t1\tbreak main",
        "PASS\tgdb.base/break.exp\t1\tcontinue",
        "FAIL\tgdb.base/break.exp\t2\tcontinue",
        "PASS\tgdb.base/break.exp\t3\tcontinue",
        "FAIL\tgdb.base/break.exp\t1\tfinish from marker",  # the reason is not part of the name
    ]
    assert "scripts/gdb-testsuite --gate --update" in text and "never edit it by hand" in text
    expected = gate.parse_expected(text)
    assert expected.provenance == PROVENANCE
    assert expected.files == list(FILES)
    assert expected.outcomes[("gdb.base/break.exp", "continue", 2)] == "FAIL"
    assert expected.outcomes[("gdb.trace/tsv.exp", "tsave with\ta tab", 1)] == "FAIL"
    assert len(expected.outcomes) == 8


def test_an_edited_expected_file_is_refused():
    text = gate.format_expected(gt.parse_sum(RECORDED), FILES, PROVENANCE)
    with pytest.raises(ValueError, match="recorded twice"):
        gate.parse_expected(text + "FAIL\tgdb.base/break.exp\t2\tcontinue\n")
    with pytest.raises(ValueError, match="not OUTCOME<TAB>FILE"):
        gate.parse_expected(text + "PASS gdb.base/break.exp: run\n")


def test_the_same_run_again_is_no_change():
    verdict = judge(RECORDED)
    assert (verdict.regressions, verdict.new_passes, verdict.changed, verdict.broken) == ([], [], [], [])
    assert verdict.status == 0
    assert verdict.counts == {"PASS": 4, "FAIL": 3, "UNSUPPORTED": 1}
    assert gate.format_verdict(verdict, 12.34) == ("gate ok: 0 regressions, 0 new passes, 0 other changes; this run: "
                                                   "4 PASS, 3 FAIL, 1 UNSUPPORTED; 12.3 s")


def test_a_pass_that_fails_or_is_not_run_is_a_regression_named_by_occurrence():
    now = (RECORDED.replace("PASS: gdb.trace/tsv.exp: tvariable $tvar1\n",
                            "FAIL: gdb.trace/tsv.exp: tvariable $tvar1 (timeout)\n")
           # the third `continue` not run
           .replace("FAIL: gdb.base/break.exp: continue\nPASS: gdb.base/break.exp: continue\n",
                    "FAIL: gdb.base/break.exp: continue\n"))
    verdict = judge(now)
    assert changes(verdict.regressions) == [("gdb.trace/tsv.exp", "tvariable $tvar1", 1, "PASS", "FAIL"),
                                            ("gdb.base/break.exp", "continue", 3, "PASS", None)]
    assert verdict.new_passes == [] and verdict.changed == [] and verdict.broken == []
    assert verdict.status == 1
    text = gate.format_verdict(verdict)
    assert "REGRESSIONS: recorded PASS, now not (2):" in text
    assert "  gdb.trace/tsv.exp: tvariable $tvar1  [PASS -> FAIL]" in text
    assert "  gdb.base/break.exp: continue (#3)  [PASS -> not run]" in text
    assert text.splitlines()[-1].startswith("gate FAILED: 2 regressions, 0 new passes")


def test_a_new_pass_is_reported_for_recording_and_does_not_fail():
    now = (RECORDED.replace("FAIL: gdb.base/break.exp: continue\n", "PASS: gdb.base/break.exp: continue\n")
           .replace("FAIL: gdb.base/break.exp: finish from marker (timeout)\n",
                    "PASS: gdb.base/break.exp: finish from marker\nPASS: gdb.base/break.exp: a test not recorded\n"))
    verdict = judge(now)
    assert changes(verdict.new_passes) == [("gdb.base/break.exp", "continue", 2, "FAIL", "PASS"),
                                           ("gdb.base/break.exp", "finish from marker", 1, "FAIL", "PASS"),
                                           ("gdb.base/break.exp", "a test not recorded", 1, None, "PASS")]
    assert verdict.regressions == [] and verdict.status == 0
    text = gate.format_verdict(verdict)
    assert "new passes: record them with `scripts/gdb-testsuite --gate --update` (3):" in text
    assert "  gdb.base/break.exp: continue (#2)  [FAIL -> PASS]" in text
    assert "  gdb.base/break.exp: a test not recorded  [not recorded -> PASS]" in text
    assert text.splitlines()[-1].startswith("gate ok: 0 regressions, 3 new passes, 0 other changes")


def test_other_changes_are_shown_and_do_not_fail():
    now = (RECORDED.replace("FAIL: gdb.trace/tsv.exp: tsave with\ta tab\n",
                            "UNRESOLVED: gdb.trace/tsv.exp: tsave with\ta tab\n")
           .replace("UNSUPPORTED: gdb.trace/tsv.exp: no in-process agent\n", "FAIL: gdb.trace/tsv.exp: new test\n"))
    verdict = judge(now)
    assert changes(verdict.changed) == [("gdb.trace/tsv.exp", "tsave with\ta tab", 1, "FAIL", "UNRESOLVED"),
                                        ("gdb.trace/tsv.exp", "new test", 1, None, "FAIL"),
                                        ("gdb.trace/tsv.exp", "no in-process agent", 1, "UNSUPPORTED", None)]
    assert verdict.status == 0
    assert "other changes (not failing the gate) (3):" in gate.format_verdict(verdict)


def test_a_file_not_run_breaks_the_run():
    start = RECORDED.index(RUNNING.format("gdb.trace/tsv.exp"))
    now = RECORDED[:start] + TAIL
    verdict = judge(now)
    assert verdict.broken == ["gdb.trace/tsv.exp: not run (no `Running` line in gdb.sum)"]
    assert verdict.status == 2  # broken, though its tests are regressions too
    assert ("gdb.trace/tsv.exp", "tvariable $tvar1", 1, "PASS", None) in changes(verdict.regressions)
    text = gate.format_verdict(verdict)
    assert text.startswith("the run is broken (1):\n  gdb.trace/tsv.exp: not run")
    assert text.splitlines()[-1].startswith("gate BROKEN:")


def test_a_tcl_error_breaks_the_run():
    now = RECORDED.replace("UNSUPPORTED: gdb.trace/tsv.exp: no in-process agent\n",
                           "ERROR: tcl error sourcing /c/src/gdb/gdb/testsuite/gdb.trace/tsv.exp.\n"
                           "UNRESOLVED: gdb.trace/tsv.exp: testcase aborted due to Tcl error\n")
    verdict = judge(now)
    assert verdict.broken == ["gdb.trace/tsv.exp: ERROR: tcl error sourcing "
                              "/c/src/gdb/gdb/testsuite/gdb.trace/tsv.exp."]
    assert verdict.status == 2


def test_a_list_changed_without_an_update_breaks_the_run():
    expected = recorded()
    verdict = judge(RECORDED, files=("gdb.trace/tsv.exp", "gdb.base/break.exp", "gdb.base/finish.exp"),
                    expected=expected)
    assert "gdb.base/finish.exp: no outcomes recorded (the gate's list changed: record with --update)" in verdict.broken
    verdict = judge(RECORDED, files=("gdb.base/break.exp",), expected=expected)
    assert verdict.broken == ["gdb.trace/tsv.exp: recorded but not in the gate's list (record with --update)"]
    assert verdict.regressions == []  # a file dropped from the list is not judged
    assert judge(RECORDED, expected=Expected()).status == 2  # nothing recorded yet


def test_an_update_takes_a_changed_list_and_counts_a_new_files_tests():
    now = RECORDED.replace(TAIL, RUNNING.format("gdb.base/finish.exp")
                           + "PASS: gdb.base/finish.exp: finish from int\nFAIL: gdb.base/finish.exp: finish from char\n"
                           + "PASS: gdb.base/finish.exp: finish from short\n" + TAIL)
    files = ("gdb.base/finish.exp", "gdb.base/break.exp")  # tsv.exp left out, finish.exp new
    verdict = gate.compare(recorded(), files, gt.files_of(now), gt.parse_sum(now), update=True)
    assert verdict.broken == [] and verdict.regressions == [] and verdict.new_passes == []
    assert verdict.first_recorded == {"gdb.base/finish.exp": {"PASS": 2, "FAIL": 1}}
    assert "gdb.base/finish.exp: first recorded: 2 PASS, 1 FAIL" in gate.format_verdict(verdict)
    assert gate.decide(verdict, update=True) == (0, None)
    checked = gate.compare(recorded(), files, gt.files_of(now), gt.parse_sum(now))
    assert checked.status == 2 and checked.first_recorded == {}


def test_an_update_records_new_passes_and_refuses_regressions_and_broken_runs():
    ok = judge(RECORDED.replace("FAIL: gdb.base/break.exp: continue\n", "PASS: gdb.base/break.exp: continue\n"))
    assert gate.decide(ok, update=False) == (0, None)
    assert gate.decide(ok, update=True) == (0, None)
    regressed = judge(RECORDED.replace("PASS: gdb.base/break.exp: break main\n", ""))
    assert gate.decide(regressed, update=False) == (1, None)
    status, refusal = gate.decide(regressed, update=True)
    assert status == 1 and "--accept-regressions" in refusal
    assert gate.decide(regressed, update=True, accept_regressions=True) == (0, None)
    broken = judge(RECORDED, expected=Expected())
    assert gate.decide(broken, update=False) == (2, None)
    assert gate.decide(broken, update=True, accept_regressions=True) == (2, "a broken run is not recorded")


def test_a_check_that_writes_no_gdb_sum_is_an_error(tmp_path):
    build = tmp_path / "build"
    build.mkdir()
    (build / "Makefile").write_text("check:\n\t@echo nothing run\n")
    with pytest.raises(RuntimeError, match="wrote no gdb.sum"):
        gt.run_check(build, "native-gdbserver", "kgtp-sim", "/bin/false", gate.GATE, tmp_path / "out", nice=0)


def test_the_gate_is_a_handful_of_trace_and_run_control_files_recorded_together():
    assert 4 <= len(gate.GATE) <= 8 and len(set(gate.GATE)) == len(gate.GATE)
    assert {name.split("/")[0] for name in gate.GATE} >= {"gdb.trace", "gdb.base"}
    expected = gate.read_expected(gate.EXPECTED)
    assert expected.files == list(gate.GATE)  # recorded after the list last changed
    assert {key[0] for key in expected.outcomes} == set(gate.GATE)
    assert set(expected.provenance) == {"gdb", "gdb-source", "board", "server"}
    assert (expected.provenance["board"], expected.provenance["server"]) == (gate.BOARD, gate.SERVER)


def test_scripts_test_installs_the_testsuites_packages_and_requires_them():
    """scripts/test installs what the runs need through gdb_testsuite (its NEEDS, with setup.sh's ensure_debian),
    then exports the variable that turns the gate's skip, when they are missing, into a failure."""
    script = (gt.ROOT / "scripts" / "test").read_text()
    install = script.index("python -m kgtp_sim.tools.gdb_testsuite --install-only")
    export = script.index(f"export {gate.REQUIRED}=required")
    assert install < export < script.index("python -m pytest")
