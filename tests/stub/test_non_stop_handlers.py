"""The non-stop handlers (stub/run.py: QNonStop, vCont answered OK, vStopped, `?`, vCtrlC, `t`) and the session
around them, against a toy whose threads run and stop when the test says (no machine): what GDB sees of a target
with the NonStop extension, as gdbserver's server.cc answers it; and that a target without one (KGTP's kernel, the
toy of tests/stub/toy_target.py) neither announces QNonStop+ nor stops a thread with vCont;t."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from kgtp_sim.rsp.codec import Decoder, EventKind, encode_packet
from kgtp_sim.rsp.dispatch import Dispatcher
from kgtp_sim.rsp.session import Session
from kgtp_sim.stub.core import TargetHandlers
from kgtp_sim.stub.target import SIGTRAP, Exited, NonStop, ResumeAction, Signal, Stop

from .toy_target import ToyTarget


@dataclass
class NonStopToy(ToyTarget, NonStop):
    """The toy's two threads, each running or stopped on its own in non-stop mode: `running` are the threads that
    run, `stop(thread)` is a thread's own stop (an event for `stop_events`), the resumptions are recorded."""

    mode: bool = False
    running: set[int] = field(default_factory=set)
    events: list[Stop] = field(default_factory=list)
    last: dict[int, Stop] = field(default_factory=lambda: {1: Signal(SIGTRAP, 1)})
    resumptions: list[list[ResumeAction]] = field(default_factory=list)
    held: list[frozenset[int]] = field(default_factory=list)  #: each resumption's threads to leave stopped
    interrupts: int = 0

    def support_non_stop(self) -> NonStop:
        return self

    def non_stop(self) -> bool:
        return self.mode

    def set_non_stop(self, on: bool) -> None:
        self.mode = on

    def resume_threads(self, actions: Sequence[ResumeAction], held: Collection[int] = ()) -> None:
        self.resumptions.append(list(actions))
        self.held.append(frozenset(held))
        for action in actions:
            threads = self.threads() if action.thread <= 0 else [action.thread]
            for thread in threads:
                if thread in held:
                    continue
                if action.stop and thread in self.running:
                    self.stop(thread, Signal(0, thread))
                elif not action.stop:
                    self.running.add(thread)

    def stop(self, thread: int, stop: Stop) -> None:
        self.running.discard(thread)
        self.events.append(stop)
        self.last[thread] = stop

    def stop_events(self) -> list[Stop]:
        events, self.events = self.events, []
        return events

    def stopped_threads(self) -> list[Stop]:
        return [self.last.get(t, Signal(0, t)) for t in self.threads() if t not in self.running]

    def request_interrupt(self) -> None:
        self.interrupts += 1


def _stub(target):
    handlers = TargetHandlers(target)
    dispatcher = Dispatcher(handlers.families)
    return dispatcher, handlers, Session(dispatcher, **handlers.session_hooks())


def _frames(data: bytes) -> list[tuple[str, bytes]]:
    return [("%" if e.kind is EventKind.NOTIFICATION else "$", e.payload) for e in Decoder(notifications=True).feed(data)
            if e.kind in (EventKind.PACKET, EventKind.NOTIFICATION)]


def _send(session: Session, payload: bytes) -> list[tuple[str, bytes]]:
    """A packet and what the transport sends back after it (the reply, then any notification `poll` adds)."""
    return _frames(session.receive(encode_packet(payload)) + session.poll())


def test_qnonstop_is_announced_only_by_a_target_with_non_stop():
    plain, _, _ = _stub(ToyTarget())
    assert b"QNonStop+" not in plain.dispatch(b"qSupported").split(b";")
    assert plain.dispatch(b"QNonStop:1") == b""  # not in the table: GDB's `set non-stop on` is refused
    assert plain.dispatch(b"vCont?") == b"vCont;c;C;s;S"
    dispatcher, _, _ = _stub(NonStopToy())
    assert b"QNonStop+" in dispatcher.dispatch(b"qSupported").split(b";")
    assert dispatcher.dispatch(b"vCont?") == b"vCont;c;C;t;s;S"  # gdbserver's list, t among them


def test_modes_switch_and_an_unknown_mode_is_refused():
    target = NonStopToy()
    dispatcher, _, _ = _stub(target)
    assert dispatcher.dispatch(b"QNonStop:1") == b"OK" and target.mode
    assert dispatcher.dispatch(b"QNonStop:2") == b"E01" and target.mode
    assert dispatcher.dispatch(b"QNonStop:0") == b"OK" and not target.mode
    assert dispatcher.dispatch(b"vCont;t:1").startswith(b"E")  # all-stop has no t


def test_each_stop_is_a_notification_drained_with_vstopped_and_the_selection_stays():
    target = NonStopToy()
    _, handlers, session = _stub(target)
    assert _send(session, b"QNonStop:1") == [("$", b"OK")]
    assert _send(session, b"?") == [("$", b"T05thread:1;")]  # both stopped: thread 1's last stop, then 2's
    assert _send(session, b"vStopped") == [("$", b"T00thread:2;")]
    assert _send(session, b"vStopped") == [("$", b"OK")]
    assert _send(session, b"Hg1") == [("$", b"OK")]
    assert _send(session, b"vCont;c") == [("$", b"OK")]  # at once: no stop reply
    assert target.running == {1, 2} and target.resumptions == [[ResumeAction(-1)]]
    target.stop(2, Signal(SIGTRAP, 2, swbreak=True))
    target.stop(1, Signal(SIGTRAP, 1))
    assert _frames(session.poll()) == [("%", b"Stop:T05swbreak:;thread:2;")]  # the first opens the queue
    assert _send(session, b"qC") == [("$", b"QC1")]  # a notification does not change GDB's thread
    assert _send(session, b"vStopped") == [("$", b"T05thread:1;")]
    assert _send(session, b"vStopped") == [("$", b"OK")]
    assert _send(session, b"vCont;c:2") == [("$", b"OK")] and target.running == {2}
    target.stop(2, Signal(SIGTRAP, 2))
    assert _frames(session.poll()) == [("%", b"Stop:T05thread:2;")]  # the queue was empty: announced again


def test_a_thread_whose_stop_gdb_has_not_taken_is_not_resumed():
    """GDB resumes "every thread" (`vCont;c`) before it has taken a thread's stop with vStopped (the notification
    crossed the packet): that thread is left stopped, as gdbserver leaves one with a queued stop reply; GDB then
    takes the stop, and the next resumption resumes it."""
    target = NonStopToy()
    _, _, session = _stub(target)
    _send(session, b"QNonStop:1")
    assert _send(session, b"vCont;c") == [("$", b"OK")] and target.running == {1, 2}
    target.stop(2, Signal(SIGTRAP, 2, swbreak=True))
    assert _frames(session.poll()) == [("%", b"Stop:T05swbreak:;thread:2;")]
    assert _send(session, b"vCont;c") == [("$", b"OK")]
    assert target.held[-1] == {2} and target.running == {1}
    assert _send(session, b"vStopped") == [("$", b"OK")]
    assert _send(session, b"vCont;c:2") == [("$", b"OK")]
    assert target.held[-1] == frozenset() and target.running == {1, 2}


def test_t_stops_named_threads_and_halt_reason_lists_every_stopped_one():
    target = NonStopToy(mode=True)
    _, _, session = _stub(target)
    _send(session, b"vCont;c")
    assert _send(session, b"?") == [("$", b"OK")]  # no thread stopped
    assert _send(session, b"vCont;t:2") == [("$", b"OK"), ("%", b"Stop:T00thread:2;")]
    assert target.resumptions[-1] == [ResumeAction(2, stop=True)]
    assert _send(session, b"vStopped") == [("$", b"OK")]
    _send(session, b"vCont;t")
    assert _send(session, b"vStopped") == [("$", b"OK")]
    assert _send(session, b"?") == [("$", b"T00thread:1;")]  # every stopped thread, the rest for vStopped
    assert _send(session, b"vStopped") == [("$", b"T00thread:2;")]
    assert _send(session, b"vStopped") == [("$", b"OK")]


def test_the_process_end_is_a_notification_and_ctrl_c_interrupts():
    target = NonStopToy(mode=True)
    dispatcher, handlers, session = _stub(target)
    handlers.supported(("multiprocess+",))
    _send(session, b"vCont;c")
    assert _send(session, b"vCtrlC") == [("$", b"OK")] and target.interrupts == 1
    assert _frames(session.receive(b"\x03")) == [] and target.interrupts == 2  # no reply: the stop will say it
    target.running.clear()
    target.events.append(Exited(3))
    assert _frames(session.poll()) == [("%", b"Stop:W03")]


def test_a_new_debugger_finds_the_queue_empty():
    target = NonStopToy(mode=True)
    _, handlers, session = _stub(target)
    _send(session, b"vCont;c")
    target.stop(1, Signal(SIGTRAP, 1))
    target.stop(2, Signal(SIGTRAP, 2))
    session.poll()
    handlers.forget_session()
    assert _send(session, b"vStopped") == [("$", b"OK")]
