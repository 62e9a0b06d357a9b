"""Run control for any target (stub/target.py): `?`, `c`, `s`, `vCont?`/`vCont`, the stop replies (at once, at the
user's Ctrl-C, or when a Running target stopped by itself), breakpoints and watchpoints (`Z`/`z`), and reverse
execution (`bs`/`bc`).

The target answers in typed outcomes (`Signal`, `ReplayLog`, `Exited`, `Running`); this module writes them as
GDB's stop replies (remote.c: remote_target::remote_parse_stop_reply reads them). A stop that names a thread
makes it the selected one, as gdbserver makes the event thread its general thread after a stop; one that does
not (KGTP's never-stopped kernel) names the thread GDB selected. An extension the target lacks is answered as
gdbserver answers what it does not support: the empty reply. `c` and `s` become the actions `vCont` would give
(gdbserver's myresume): the thread `Hc` selected, or, for "any thread", `s` steps the selected thread while the
others continue. Runs on the server thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..rsp.dispatch import E_BAD_PACKET, Deferred, Reply, RspError, handles
from ..rsp.packets import connect as c
from ..rsp.packets import replay as r
from ..rsp.packets import run as v
from .target import BreakpointType, Exited, ReplayLog, ResumeAction, Running, Signal, Stop, Target, Terminated
from .threads import ThreadHandlers

#: the stop reply's name of a watchpoint's kind (remote.c: remote_parse_stop_reply)
WATCH_REASONS = {BreakpointType.WRITE_WATCHPOINT: b"watch", BreakpointType.READ_WATCHPOINT: b"rwatch",
                 BreakpointType.ACCESS_WATCHPOINT: b"awatch"}


def stop_reply(stop: Stop, threads: ThreadHandlers) -> bytes:
    """The stop reply packet for `stop`: `T<sig>[replaylog:<end>;|watch:<addr>;|swbreak:;]thread:<id>;`, `W<code>`
    or `X<signal>`."""
    if isinstance(stop, Exited):
        return b"W%02x" % stop.code + threads.process_suffix()
    if isinstance(stop, Terminated):
        return b"X%02x" % stop.signal + threads.process_suffix()
    if stop.thread is not None:
        threads.selection.general = stop.thread
    reason = b""
    if isinstance(stop, ReplayLog):
        reason = b"replaylog:%s;" % (b"begin" if stop.begin else b"end")
    elif isinstance(stop, Signal) and stop.watch is not None:
        reason = b"%s:%x;" % (WATCH_REASONS[stop.watch.type], stop.watch.address)
    elif isinstance(stop, Signal) and stop.swbreak:
        reason = b"swbreak:;"
    elif isinstance(stop, Signal) and stop.hwbreak:
        reason = b"hwbreak:;"
    return b"T%02x%sthread:%s;" % (stop.signal, reason, threads.thread_id(threads.general_thread))


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

    def pending_stop(self) -> bytes | None:
        """The stop reply of a Running target that stopped by itself since (the session's asynchronous stop), or
        None while it runs on."""
        resume = self.target.support_resume()
        stop = resume.poll_stop() if resume is not None else None
        return None if stop is None else stop_reply(stop, self.threads)

    @handles(c.HaltReason)
    def halt_reason(self, packet: c.HaltReason) -> Reply:
        return stop_reply(self.target.stop_reason(), self.threads)

    def _resume(self, *, step: bool) -> Reply:
        resume = self.target.support_resume()
        if resume is None:
            return b""
        chosen = self.threads.selection.continue_thread
        if chosen not in (c.ANY_THREAD, c.ALL_THREADS):
            actions = [ResumeAction(chosen, step)]
        elif step:
            actions = [ResumeAction(self.threads.general_thread, True), ResumeAction(c.ALL_THREADS)]
        else:
            actions = [ResumeAction(c.ALL_THREADS)]
        return self.report(resume.resume(actions))

    @handles(v.VContQuery)
    def vcont_query(self, packet: v.VContQuery) -> Reply:
        """The actions `vCont` takes: GDB uses vCont only when c, C, s and S are all there (remote.c:
        remote_vcont_probe), range stepping when r is."""
        resume = self.target.support_resume()
        if resume is None:
            return b""
        return b"vCont;c;C;s;S" + (b";r" if resume.range_stepping() else b"")

    @handles(v.VCont)
    def vcont(self, packet: v.VCont) -> Reply:
        resume = self.target.support_resume()
        if resume is None:
            return b""
        actions = []
        for action in packet.actions:
            if action.kind == v.STOP:
                raise RspError(E_BAD_PACKET, "vCont;t stops a thread in non-stop mode, which this stub has not")
            if action.kind == v.RANGE and not resume.range_stepping():
                raise RspError(E_BAD_PACKET, "this target has no range stepping")
            if action.thread > 0:
                self.threads.require(action.thread)
            span = (action.start, action.end) if action.kind == v.RANGE else None
            actions.append(ResumeAction(action.thread, action.kind != v.CONTINUE, span, action.signal))
        return self.report(resume.resume(actions))

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
        return self._breakpoint(packet, insert=True)

    @handles(r.RemoveBreakpoint)
    def remove_breakpoint(self, packet: r.RemoveBreakpoint) -> Reply:
        return self._breakpoint(packet, insert=False)

    def _breakpoint(self, packet: r.InsertBreakpoint | r.RemoveBreakpoint, *, insert: bool) -> Reply:
        breakpoints = self.target.support_breakpoints()
        type = BreakpointType(packet.type)
        if breakpoints is None or not breakpoints.supports(type):
            return b""
        change = breakpoints.insert_breakpoint if insert else breakpoints.remove_breakpoint
        change(type, packet.address, packet.kind)
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
