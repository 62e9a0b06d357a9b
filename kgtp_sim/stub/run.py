"""Run control for any target (stub/target.py): `?`, `c`, `s`, the Ctrl-C stop reply, breakpoints (`Z`/`z`), and
reverse execution (`bs`/`bc`).

The target answers in typed outcomes (`Signal`, `ReplayLog`, `Exited`, `Running`); this module writes them as
GDB's stop replies (remote.c: remote_target::remote_parse_stop_reply reads them). A stop that names a thread
makes it the selected one, as gdbserver makes the event thread its general thread after a stop; one that does
not (KGTP's never-stopped kernel) names the thread GDB selected. An extension the target lacks is answered as
gdbserver answers what it does not support: the empty reply. Runs on the server thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..rsp.dispatch import Deferred, Reply, handles
from ..rsp.packets import connect as c
from ..rsp.packets import replay as r
from .target import BreakpointType, Exited, ReplayLog, ResumeAction, Running, Stop, Target
from .threads import ThreadHandlers


def stop_reply(stop: Stop, threads: ThreadHandlers) -> bytes:
    """The stop reply packet for `stop`: `T<sig>[replaylog:<end>;]thread:<id>;` or `W<code>`."""
    if isinstance(stop, Exited):
        return b"W%02x" % stop.code
    if stop.thread is not None:
        threads.selection.general = stop.thread
    reason = b"replaylog:%s;" % (b"begin" if stop.begin else b"end") if isinstance(stop, ReplayLog) else b""
    return b"T%02x%sthread:%x;" % (stop.signal, reason, threads.general_thread)


@dataclass
class RunHandlers:
    target: Target
    threads: ThreadHandlers

    def report(self, outcome: Stop | Running) -> Reply:
        return Deferred() if isinstance(outcome, Running) else stop_reply(outcome, self.threads)

    def interrupted(self) -> bytes:
        """The reply to the user's Ctrl-C after a `c` the target answered Running (the session's stop reply)."""
        resume = self.target.support_resume()
        stop = resume.interrupt() if resume is not None else self.target.stop_reason()
        return stop_reply(stop, self.threads)

    @handles(c.HaltReason)
    def halt_reason(self, packet: c.HaltReason) -> Reply:
        return stop_reply(self.target.stop_reason(), self.threads)

    def _resume(self, *, step: bool) -> Reply:
        resume = self.target.support_resume()
        if resume is None:
            return b""
        return self.report(resume.resume([ResumeAction(self.threads.selection.continue_thread, step)]))

    @handles(c.Continue)
    def continue_(self, packet: c.Continue) -> Reply:
        return self._resume(step=False)

    @handles(r.Step)
    def step(self, packet: r.Step) -> Reply:
        return self._resume(step=True)

    @handles(r.InsertBreakpoint)
    def insert_breakpoint(self, packet: r.InsertBreakpoint) -> Reply:
        """gdbserver's server.cc (`Z`/`z` in process_serial_event): the empty reply for a type the target does
        not support (mem-break.cc: z_type_supported), OK when set, an error when the target refuses."""
        breakpoints = self.target.support_breakpoints()
        type = BreakpointType(packet.type)
        if breakpoints is None or not breakpoints.supports(type):
            return b""
        breakpoints.insert_breakpoint(type, packet.address, packet.kind)
        return b"OK"

    @handles(r.RemoveBreakpoint)
    def remove_breakpoint(self, packet: r.RemoveBreakpoint) -> Reply:
        breakpoints = self.target.support_breakpoints()
        type = BreakpointType(packet.type)
        if breakpoints is None or not breakpoints.supports(type):
            return b""
        breakpoints.remove_breakpoint(type, packet.address, packet.kind)
        return b"OK"


@dataclass
class ReverseHandlers:
    """`bs` and `bc`: only assembled for a target that has the reverse extension, so that qSupported announces
    ReverseStep+ and ReverseContinue+ only then (core.TargetHandlers)."""

    target: Target
    threads: ThreadHandlers

    def _reverse(self, *, step: bool) -> Reply:
        reverse = self.target.support_reverse()
        if reverse is None:
            return b""
        return stop_reply(reverse.reverse(step=step), self.threads)

    @handles(r.ReverseStep)
    def reverse_step(self, packet: r.ReverseStep) -> Reply:
        return self._reverse(step=True)

    @handles(r.ReverseContinue)
    def reverse_continue(self, packet: r.ReverseContinue) -> Reply:
        return self._reverse(step=False)
