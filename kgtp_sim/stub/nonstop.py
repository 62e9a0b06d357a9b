"""Non-stop run control of the gdbserver role's process (GDB's `set non-stop on`), as gdbserver's linux-low.cc runs
a process when GDB asked for `QNonStop:1`: each thread runs and stops on its own.

`NonStopControl` is a part of `ProcessTarget` (stub/process.py), over the same threads (their `after`, `pending`,
`report_stop`; the stops the machine heard of are taken in by the target's `_collect_stops`), beside its all-stop
run control; it lends the target interface's `NonStop` extension (stub/target.py):

- `resume_threads` (non-stop `vCont`): each stopped thread an action names goes (continue, step, range step, with
  its signal), a running one named goes on as it is; a `t` action asks a running thread to stop quietly, and that
  stop is its event, with signal 0 (linux-low's resume_stop: a SIGSTOP reported as GDB_SIGNAL_0); a thread that is
  stopped already is left as it is (gdbserver reports nothing for it). A thread with an event GDB has not heard of
  yet (met under all-stop) is not resumed: its event is reported. Nor is one whose stop was told but is still in
  the queue behind `%Stop` (`held`): GDB, not knowing yet that it stopped, resumes "every thread" with it
  (gdbserver's in_queued_stop_replies); resumed, it would run on while GDB is told it stopped.
- `stop_events`: the events of the threads GDB has resumed, each once, as they come, without stopping any other
  thread (no stop_all_lwps); the process's end (`W`/`X`) once, when every thread is gone with it. A thread the
  process makes goes at once (GDB takes a thread it finds as running until a stop says otherwise).
- `stopped_threads` (`?`): every stopped thread with the stop it last reported (signal 0 for one stopped without
  GDB being told why, as gdbserver's gdb_wants_thread_stopped leaves it).
- `announce_stopped` (a non-stop `vAttach`, answered `OK`): each attached thread's stop comes as an event.
- `request_interrupt` (`vCtrlC`, Ctrl-C): SIGINT to a running thread of the process, the leader first (gdbserver
  sends SIGINT to the process's group), without waiting.
- Switching modes (`QNonStop`): to all-stop, running threads are stopped quietly, their events kept pending for the
  next resumption (gdbserver's `?` in all-stop pauses every thread); to non-stop, refused while an all-stop
  resumption waits for its stop.

Breakpoints go into memory at once while threads run (GDB keeps them inserted in non-stop), memory is read and
written while threads run, a running thread's registers are unavailable: those are the target's (process.py).

Runs on the server thread, as every handler; the machine's stop listener only wakes the server.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Collection, Sequence
from typing import Any

from ..machine import MachineError
from ..machine.tracee import TraceeGone
from ..rsp.dispatch import E_BAD_PACKET, RspError
from .target import NonStop, ResumeAction, Signal, Stop

log = logging.getLogger(__name__)


class NonStopControl(NonStop):
    """The non-stop half of `ProcessTarget`'s run control (a base class of it: what it uses of the target, declared
    below, is stub/process.py's)."""

    pid: int
    threads_by_tid: dict[int, Any]  #: process.py's _Thread by tid
    _resumed: set[int]  #: the threads GDB resumed that have not reported a stop since
    _last: Stop  #: the last stop reported

    @abstractmethod
    def ended(self) -> Stop | None: ...
    @abstractmethod
    def _running(self) -> list[Any]: ...
    @abstractmethod
    def _collect_stops(self) -> None: ...
    @abstractmethod
    def _stop_all(self) -> None: ...
    @abstractmethod
    def _chosen(self, actions: Sequence[ResumeAction]) -> dict[int, ResumeAction | None]: ...
    @abstractmethod
    def _still_pending(self, thread: Any) -> bool: ...
    @abstractmethod
    def _start(self, thread: Any, action: ResumeAction) -> None: ...
    @abstractmethod
    def _put_in_breakpoints(self) -> None: ...

    def __init__(self) -> None:
        self._non_stop = False
        #: each thread's last stop GDB heard of in non-stop (`?` repeats it)
        self._last_of: dict[int, Stop] = {}

    def non_stop(self) -> bool:
        return self._non_stop

    def set_non_stop(self, on: bool) -> None:
        if on == self._non_stop:
            return
        if self._running():
            if on:
                raise RspError(E_BAD_PACKET, "an all-stop resumption waits for its stop: non-stop can wait")
            self._stop_all()
        self._non_stop = on
        self._resumed = set()
        self._last_of.clear()

    def resume_threads(self, actions: Sequence[ResumeAction], held: Collection[int] = ()) -> None:
        if self.ended() is not None:
            return  # its end is told by stop_events
        chosen = self._chosen(actions)
        try:
            if any(a is not None and not a.stop for a in chosen.values()):
                self._put_in_breakpoints()
            for tid, action in chosen.items():
                thread = self.threads_by_tid[tid]
                if action is None or tid in held:
                    continue
                if action.stop:
                    if thread.after is not None and not thread.report_stop:
                        thread.report_stop = True
                        thread.tracee.interrupt(quiet=True)
                    continue
                if thread.after is not None:
                    continue  # running already
                self._resumed.add(tid)
                if thread.pending is not None and self._still_pending(thread):
                    continue  # its event is reported first (gdbserver leaves a thread with a pending status stopped)
                self._start(thread, action)
        except TraceeGone:
            pass  # the process ended: stop_events tells
        except MachineError as error:
            raise RspError(E_BAD_PACKET, str(error)) from None

    def stop_events(self) -> list[Stop]:
        if not (self._running() or self._resumed):
            return []
        self._collect_stops()
        ended = self.ended()
        if ended is not None:
            for thread in self.threads_by_tid.values():
                thread.after = None
            self._resumed.clear()
            return [ended]
        events: list[Stop] = []
        for tid, thread in self.threads_by_tid.items():
            if tid in self._resumed and thread.after is None and thread.pending is not None:
                events.append(self._told(tid, thread))
        self._resumed &= set(self.threads_by_tid)
        return events

    def _told(self, tid: int, thread: Any) -> Stop:
        """Thread `tid`'s pending event, as GDB hears of it now."""
        stop, thread.pending = thread.pending, None
        self._resumed.discard(tid)
        self._last_of[tid] = self._last = stop
        return stop

    def stopped_threads(self) -> list[Stop]:
        if self.ended() is not None:
            return []
        stops: list[Stop] = []
        for tid, thread in self.threads_by_tid.items():
            if thread.after is not None:
                continue
            if thread.pending is not None:
                stops.append(self._told(tid, thread))
                continue
            last = self._last_of.get(tid)
            if last is None:
                last = self._last if getattr(self._last, "thread", None) == tid else Signal(0, tid)
            stops.append(last)
        return stops

    def announce_stopped(self) -> None:
        """Every stopped thread's stop to be told as an event (signal 0, or the one it has pending): what a non-stop
        attach answers with, after its `OK` (gdbserver's attach reports each thread's SIGSTOP as GDB_SIGNAL_0)."""
        for tid, thread in self.threads_by_tid.items():
            if thread.after is None:
                thread.pending = thread.pending or Signal(0, tid)
                self._resumed.add(tid)

    def request_interrupt(self) -> None:
        running = self._running()
        if not running:
            log.info("interrupt with no thread of process %d running: nothing to do", self.pid)
            return
        thread = next((t for t in running if t.tracee.pid == self.pid), running[0])
        try:
            thread.tracee.interrupt()
        except MachineError as error:
            log.info("interrupt: %s", error)
