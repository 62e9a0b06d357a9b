"""The combination suite: seeded random combinations of what the tracer offers, each run against a live kernel, or a
program on it, and checked against what the kernel or the program counted itself (`scripts/combinations [--seconds
N] [--seed S] [--only SPEC]`).

A combination picks one value on every dimension (`DIMENSIONS`): the space (the kernel's addresses, or a process's
under the gdbserver role: process.py), the engine, the probe path (a jump, an int3, two
tracepoints at one address, the static marker, while-stepping, a `$kret` return probe, a watch tracepoint), the
CPUs, the buffer (large linear, small circular, small linear that fills), the condition (none, true, false,
faulting), what the tracepoint does (registers, `$regs`, `$args`, a global, a stack range, `$_sdata`, `$bt`, a
`teval` of a plain or a per-CPU variable, KGTP's `$cpu_id`/`$current_task`, `$disable`), a pass count, a change
during the run (none, QTDisable then QTEnable, a tracepoint added with InstallInTrace), what stands beside it (a
while-stepping tracepoint elsewhere, four watches) and how the run ends (tstop, or GDB leaving). Some choices
make others moot (a pass count ends the run; `$_sdata` exists only at a marker); `normalize` settles them, so
the spec a failure prints is the combination that ran. Pairs KGTP refuses (`refusal`: a `$kret` run with
while-stepping, a fifth watch, watches beside while-stepping) must be refused at tstart with KGTP's reason.

Every tracepoint is at kgtp_test_function, whose first instruction is `addl $1, kgtp_counter(%rip)`, or at
something that fires with it (its `kgtp_module_event` marker, its return, the write of kgtp_counter). So
kgtp_counter is the kernel's own count of the calls. The runner (`Runner`) drives an in-process stub through RSP
packets, exactly as the TCP server feeds it (the fuzzer's `Harness`): with every CPU stopped (`monitor stop`, at
an instruction boundary, never in the stub's code) it reads kgtp_counter and each CPU's pc, starts the run, lets
the kernel go until the counter has moved enough (events, never a time window), stops every CPU again, reads the
counter and pcs, stops the run, and reads every frame back (QTFrame, `g`, `m`, qTV, `monitor frames`). The
oracle (`check`) expects the calls between the two stops (a call between the function's entry and the probed
place when every CPU stopped is counted from where it is: its CPU's pc, or the interrupted pc on its thread's stack
when the tick preempted it there, `Halt`): that many fired hits (`monitor probes`), that many hits (qTP) unless the
condition, pass count, `$disable` or a full buffer says less, frames whose collected kgtp_counter are exactly
those calls' values, registers that agree with them (the soak's `check_frame_values`), each CPU's sequence
numbers consecutive (the soak's `check_sequence`), `$hits` and `$p_hits` counting 1, 2, 3... The stub and the
kernel must then be healthy for the next combination (the harness' health check; no error logged); one machine
per CPU count is booted once and reused.

In a process the program (fixtures/combinations/callers.c) stands in for the kernel's benchmark: a thread per CPU
calls counted_function, whose first instruction counts the call in `counter`, and the same packets run through an
in-process gdbserver role (process.py says what each path means there, and how the program is stopped and let go).

The package: `space` (the dimensions, a combination, `normalize`, `refusal`, the walk, the packets of a combination),
`runner` (what both runners do over RSP, the kernel's runner, what a run saw), `process` (the process space's runner
and its program), `oracle` (`check`), `campaign` (`run_one`, the command); `python -m kgtp_sim.tools.combinations`
is `scripts/combinations`.

Runs on the caller's thread (the command's main thread, or a test's), which feeds the session in place of the
server thread while each machine's CPU and tick threads run its kernel.
"""

from __future__ import annotations

from .campaign import Outcome, Runners, campaign, main, run_one
from .oracle import check, expected_fired, in_flight
from .process import ProcessRunner
from .runner import CombinationFailure, Frame, Halt, Observed, Runner, Stacks, Window, interrupt_frames, interrupted
from .space import DIMENSIONS, MAIN, Combination, Sites, generate, normalize, refusal, walk

__all__ = [
    "DIMENSIONS", "MAIN", "Combination", "CombinationFailure", "Frame", "Halt", "Observed", "Outcome",
    "ProcessRunner", "Runner", "Runners",
    "Sites", "Stacks", "Window", "campaign", "check", "expected_fired", "generate", "in_flight", "interrupt_frames",
    "interrupted", "main", "normalize", "refusal", "run_one", "walk",
]
