"""Run control for any target (stub/target.py): `?`, `c`, `s`, `vCont?`/`vCont`, the stop replies (at once, at the
user's Ctrl-C, or when a Running target stopped by itself), breakpoints and watchpoints (`Z`/`z`: with conditions
and commands for a target that runs them, `ConditionalBreakpointHandlers`), and reverse execution (`bs`/`bc`).

The target answers in typed outcomes (`Signal`, `ReplayLog`, `Exited`, a process's fork, vfork and exec events,
`Running`); this module writes them as GDB's stop replies (remote.c: remote_target::remote_parse_stop_reply reads
them; gdbserver's remote-utils.cc: prepare_resume_reply writes the events' `fork:`, `vfork:`, `vforkdone:` and
`exec:`). A stop that names a thread makes it the selected one, as gdbserver makes the event thread its general
thread after a stop; one that does not (KGTP's never-stopped kernel) names the thread GDB selected. An extension the
target lacks is answered as gdbserver answers what it does not support: the empty reply. `c` and `s` become the
actions `vCont` would give (gdbserver's myresume): the thread `Hc` selected, or, for "any thread", `s` steps the
selected thread while the others continue.

Non-stop mode (a target lending `NonStop`, switched by `QNonStop`; gdbserver's server.cc): `vCont` (and `c`, `s`) is
answered `OK` at once, `t` stops threads, every stop is queued as a `%Stop` notification (rsp/notify.py; the session
sends it) without changing GDB's selected thread, `vStopped` drains the queue, `?` queues every stopped thread's
stop, `vCtrlC` and Ctrl-C interrupt the program. The family of those packets (`NonStopHandlers`) is assembled only
for a target that has the extension, so qSupported announces `QNonStop+` only then. Runs on the server thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..rsp.dispatch import E_BAD_PACKET, Deferred, Reply, RspError, handles
from ..rsp.notify import StopNotifications
from ..rsp.packets import connect as c
from ..rsp.packets import replay as r
from ..rsp.packets import run as v
from .target import (BreakpointConditions, BreakpointType, Execd, Exited, Forked, NonStop, ReplayLog, ResumeAction, Running, Signal, Stop,
                     Target, Terminated, VforkDone)
from .threads import ThreadHandlers

#: the stop reply's name of a watchpoint's kind (remote.c: remote_parse_stop_reply)
WATCH_REASONS = {BreakpointType.WRITE_WATCHPOINT: b"watch", BreakpointType.READ_WATCHPOINT: b"rwatch",
                 BreakpointType.ACCESS_WATCHPOINT: b"awatch"}


def stop_reply(stop: Stop, threads: ThreadHandlers, select: bool = True) -> bytes:
    """The stop reply packet for `stop`: `T<sig>[replaylog:<end>;|watch:<addr>;|swbreak:;|fork:<id>;|exec:<hex>;
    ...]thread:<id>;`, `W<code>` or `X<signal>` (with `;process:<pid>` in multiprocess). `select`: the thread it
    names becomes the selected one (not for a non-stop notification: GDB's selection is not changed behind its back,
    gdbserver's handle_target_event)."""
    if isinstance(stop, Exited):
        return b"W%02x" % stop.code + threads.process_suffix(stop.process)
    if isinstance(stop, Terminated):
        return b"X%02x" % stop.signal + threads.process_suffix(stop.process)
    if stop.thread is not None and select:
        threads.selection.general = stop.thread
    thread = stop.thread if stop.thread is not None else threads.general_thread
    return b"T%02x%sthread:%s;" % (stop.signal, _reason(stop, threads), threads.thread_id(thread))


def _reason(stop: Stop, threads: ThreadHandlers) -> bytes:
    """What stopped it, as the stop reply says it (`replaylog:`, `watch:`, `swbreak:`, `hwbreak:`; a process's
    events as gdbserver's prepare_resume_reply writes them: `fork:` and `vfork:` with the child's id,
    `vforkdone:`, `exec:` with the program's path in hex), or nothing."""
    reason = b""
    if isinstance(stop, Forked):
        reason = b"%s:%s;" % (b"vfork" if stop.vfork else b"fork", threads.thread_id(stop.child))
    elif isinstance(stop, VforkDone):
        reason = b"vforkdone:;"
    elif isinstance(stop, Execd):
        reason = b"exec:%s;" % stop.path.encode("utf-8", "surrogateescape").hex().encode()
    elif isinstance(stop, ReplayLog):
        reason = b"replaylog:%s;" % (b"begin" if stop.begin else b"end")
    elif isinstance(stop, Signal) and stop.watch is not None:
        reason = b"%s:%x;" % (WATCH_REASONS[stop.watch.type], stop.watch.address)
    elif isinstance(stop, Signal) and stop.swbreak:
        reason = b"swbreak:;"
    elif isinstance(stop, Signal) and stop.hwbreak:
        reason = b"hwbreak:;"
    return reason


@dataclass
class RunHandlers:
    target: Target
    threads: ThreadHandlers
    #: non-stop: the stop replies queued for GDB (the session sends the `%Stop` notification)
    notifications: StopNotifications = field(default_factory=StopNotifications)

    def non_stop(self) -> NonStop | None:
        """The target's non-stop run control, when non-stop mode is on."""
        extension = self.target.support_non_stop()
        return extension if extension is not None and extension.non_stop() else None

    def stop_events(self) -> list[tuple[bytes, int | None]]:
        """Non-stop: the stop replies of the stops since the last call, each with its thread (the session queues
        them); [] in all-stop."""
        extension = self.non_stop()
        if extension is None:
            return []
        return [self._queued(stop) for stop in extension.stop_events()]

    def _queued(self, stop: Stop) -> tuple[bytes, int | None]:
        """A non-stop stop as the queue behind `%Stop` holds it: its reply and its thread (None: a process's end)."""
        return stop_reply(stop, self.threads, select=False), getattr(stop, "thread", None)

    def interrupt_running(self) -> None:
        """Ctrl-C with no resumption waiting for its reply: in non-stop, gdbserver's request_interrupt (the stop
        comes as a notification); in all-stop there is nothing running to interrupt."""
        extension = self.non_stop()
        if extension is not None:
            extension.request_interrupt()

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
        """All-stop: why the target is stopped. Non-stop: every stopped thread's stop queued, the first the answer
        (OK: none is stopped), the rest for vStopped (gdbserver's handle_status)."""
        extension = self.non_stop()
        if extension is not None:
            return self.notifications.status(self._queued(stop) for stop in extension.stopped_threads())
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
        return self._resume_with(resume, actions)

    def _resume_with(self, resume: object, actions: list[ResumeAction]) -> Reply:
        """All-stop: the stop reply, now or when the target stops. Non-stop: OK at once (gdbserver's resume)."""
        extension = self.non_stop()
        if extension is not None:
            extension.resume_threads(actions, held=self.notifications.held())
            return b"OK"
        if any(action.stop for action in actions):
            raise RspError(E_BAD_PACKET, "vCont;t stops a thread in non-stop mode; this is all-stop")
        return self.report(resume.resume(actions))  # type: ignore[attr-defined]

    @handles(v.VContQuery)
    def vcont_query(self, packet: v.VContQuery) -> Reply:
        """The actions `vCont` takes: GDB uses vCont only when c, C, s and S are all there (remote.c:
        remote_vcont_probe), range stepping when r is."""
        resume = self.target.support_resume()
        if resume is None:
            return b""
        stop = b";t" if self.target.support_non_stop() is not None else b""
        return b"vCont;c;C" + stop + b";s;S" + (b";r" if resume.range_stepping() else b"")

    @handles(v.VCont)
    def vcont(self, packet: v.VCont) -> Reply:
        resume = self.target.support_resume()
        if resume is None:
            return b""
        actions = []
        for action in packet.actions:
            if action.kind == v.STOP and self.target.support_non_stop() is None:
                raise RspError(E_BAD_PACKET, "vCont;t stops a thread in non-stop mode, which this target has not")
            if action.kind == v.RANGE and not resume.range_stepping():
                raise RspError(E_BAD_PACKET, "this target has no range stepping")
            if action.thread > 0:
                self.threads.require(action.thread)
            span = (action.start, action.end) if action.kind == v.RANGE else None
            actions.append(ResumeAction(action.thread, action.kind in (v.STEP, v.RANGE), span, action.signal,
                                        stop=action.kind == v.STOP, process=action.process))
        return self._resume_with(resume, actions)

    @handles(c.Continue)
    def continue_(self, packet: c.Continue) -> Reply:
        return self._resume(step=False)

    @handles(r.Step)
    def step(self, packet: r.Step) -> Reply:
        return self._resume(step=True)



@dataclass
class BreakpointHandlers:
    """`Z` and `z`, for any target (its `Breakpoints` extension)."""

    target: Target
    threads: ThreadHandlers

    @handles(r.InsertBreakpoint)
    def insert_breakpoint(self, packet: r.InsertBreakpoint) -> Reply:
        """gdbserver's server.cc (`Z`/`z` in process_serial_event): the empty reply for a type the target does
        not support (mem-break.cc: z_type_supported), OK when set, an error when the target refuses."""
        return self._breakpoint(packet, insert=True)

    @handles(r.RemoveBreakpoint)
    def remove_breakpoint(self, packet: r.InsertBreakpoint | r.RemoveBreakpoint) -> Reply:
        return self._breakpoint(packet, insert=False)

    def _breakpoint(self, packet: r.InsertBreakpoint | r.RemoveBreakpoint, *, insert: bool,
                    then: Callable[[], None] | None = None) -> Reply:
        breakpoints = self.target.support_breakpoints()
        type = BreakpointType(packet.type)
        if breakpoints is None or not breakpoints.supports(type):
            return b""
        change = breakpoints.insert_breakpoint if insert else breakpoints.remove_breakpoint
        change(type, packet.address, packet.kind, self.threads.selection.general)  # in the process `Hg` selected
        if then is not None:
            then()
        return b"OK"


@dataclass
class ConditionalBreakpointHandlers(BreakpointHandlers):
    """`Z0`/`Z1` with the breakpoint's conditions and commands: only assembled for a target that lends
    `BreakpointConditions`, so that qSupported announces ConditionalBreakpoints+ and BreakpointCommands+ only then
    (core.TargetHandlers)."""

    conditions: BreakpointConditions | None = None

    @handles(r.ConditionalInsertBreakpoint)
    def insert_breakpoint(self, packet: r.ConditionalInsertBreakpoint) -> Reply:  # type: ignore[override]
        """As gdbserver's `Z` (server.cc: the point inserted, then clear_breakpoint_conditions_and_commands and
        process_point_options): the conditions and commands given replace the ones the breakpoint had (the packet
        verified them: a bad one never reaches here, and nothing is inserted)."""
        conditions, commands = packet.conditions, packet.commands
        extension = self.conditions
        assert extension is not None
        type = BreakpointType(packet.type)
        thread = self.threads.selection.general
        return self._breakpoint(packet, insert=True,
                                then=lambda: extension.set_conditions(type, packet.address, conditions, commands,
                                                                      thread))


@dataclass
class NonStopHandlers:
    """`QNonStop`, `vStopped` and `vCtrlC`: only assembled for a target that lends `NonStop`, so that qSupported
    announces QNonStop+ only then (core.TargetHandlers). `run` holds the notification queue."""

    target: Target
    run: RunHandlers

    def _extension(self) -> NonStop:
        extension = self.target.support_non_stop()
        if extension is None:
            raise RspError(E_BAD_PACKET, "this target has no non-stop mode")
        return extension

    @handles(v.NonStop)
    def set_mode(self, packet: v.NonStop) -> Reply:
        """gdbserver's handle_general_set: OK, or an error when the target cannot switch now."""
        self._extension().set_non_stop(packet.on)
        return b"OK"

    @handles(v.VStopped)
    def vstopped(self, packet: v.VStopped) -> Reply:
        return self.run.notifications.ack()

    @handles(v.VCtrlC)
    def vctrlc(self, packet: v.VCtrlC) -> Reply:
        """Answered OK whatever the mode (gdbserver's handle_v_requests); the stop is a notification in non-stop."""
        self._extension().request_interrupt()
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
