"""A system call's round trip on the simulated kernel, in the machine's exact instruction count (round_trip.py):
the issue's budget for getpid, and where the instructions go."""

from __future__ import annotations

from ..programs import compile_program
from .round_trip import USER, measure

#: the issue's budget: a getpid round trip, user wrapper and loop included
BUDGET = 150


def test_a_getpid_round_trip_is_within_the_budget_and_the_same_every_time(tmp_path):
    result = measure(compile_program("getpids", "glibc-static", tmp_path), rounds=50, by_function=True)
    assert len(set(result.rounds)) == 1, sorted(set(result.rounds))  # exact: no round differs from another
    assert result.instructions <= BUDGET, result.by_function
    # every call still goes through the dispatcher (its sys_enter/sys_exit markers) and back by sysretq; the
    # CPU-time timers are the tick's, not each call's
    functions = set(result.by_function)
    assert {"entry_SYSCALL_64", "do_syscall_64", "do_syscall", "exit_to_user_mode", USER} <= functions, functions
    assert not functions & {"itimers_account", "sched_clock", "exit_to_user_mode_loop"}, functions
