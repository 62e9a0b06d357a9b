"""The `%Stop` notification queue (rsp/notify.py) and the session's non-stop side (rsp/session.py), on byte strings:
the first stop of an empty queue announced at once, the others kept for `vStopped`, `?` answered from the queue,
nothing resent, a stub's decoder skipping a notification and a debugger's reading it (gdbserver's notif.cc)."""

from __future__ import annotations

from kgtp_sim.rsp.codec import Decoder, EventKind, checksum, encode_notification, encode_packet
from kgtp_sim.rsp.dispatch import Dispatcher, handles
from kgtp_sim.rsp.notify import StopNotifications
from kgtp_sim.rsp.packets import connect as c
from kgtp_sim.rsp.packets import run as v
from kgtp_sim.rsp.session import Session


def test_the_first_stop_of_an_empty_queue_is_announced_and_the_rest_wait_for_vstopped():
    queue = StopNotifications()
    assert queue.push(b"T05thread:1;") == b"%Stop:T05thread:1;#" + b"%02x" % checksum(b"Stop:T05thread:1;")
    assert queue.push(b"T05thread:2;") == b""  # GDB has not drained the queue: no second notification
    assert queue.ack() == b"T05thread:2;"  # the first is GDB's; the next one
    assert queue.push(b"W00;process:1") == b""
    assert queue.ack() == b"W00;process:1"
    assert queue.ack() == b"OK"
    assert queue.ack() == b"OK"  # an empty queue answers OK however often it is asked
    assert queue.push(b"T02thread:1;").startswith(b"%Stop:T02thread:1;#")  # empty again: announced again


def test_halt_reason_queues_behind_what_is_there_and_answers_the_first():
    queue = StopNotifications()
    assert queue.status([]) == b"OK"
    queue.push(b"T05thread:1;", 1)
    assert queue.status([(b"T00thread:2;", 2), (b"T00thread:3;", 3)]) == b"T05thread:1;"
    assert [queue.ack(), queue.ack(), queue.ack()] == [b"T00thread:2;", b"T00thread:3;", b"OK"]
    queue.status([(b"T00thread:2;", 2)])
    queue.clear()
    assert queue.first() == b"OK"


def test_a_thread_is_held_until_gdb_has_taken_its_stop():
    """Until vStopped takes a thread's reply GDB does not know it stopped (gdbserver's in_queued_stop_replies)."""
    queue = StopNotifications()
    assert queue.held() == frozenset()
    queue.push(b"T05thread:2;", 2)
    queue.push(b"W00;process:1")  # a process's end is of no thread
    queue.status([(b"T00thread:3;", 3)])
    assert queue.held() == {2, 3}
    queue.ack()  # GDB has 2's (the notification's); it is given the end
    assert queue.held() == {3}
    queue.ack()  # GDB has the end; it is given 3's
    assert queue.held() == {3}
    queue.ack()
    assert queue.held() == frozenset()


def test_a_stub_skips_a_notification_and_a_debugger_reads_it():
    data = encode_notification(b"Stop:T05thread:1;") + encode_packet(b"OK")
    assert [(e.kind, e.payload) for e in Decoder().feed(data)] == [(EventKind.PACKET, b"OK")]
    events = Decoder(notifications=True).feed(data[:7]) + Decoder(notifications=True).feed(b"")
    assert events == []
    decoder = Decoder(notifications=True)
    assert decoder.feed(data[:7]) == []
    assert [(e.kind, e.payload) for e in decoder.feed(data[7:])] == [
        (EventKind.NOTIFICATION, b"Stop:T05thread:1;"), (EventKind.PACKET, b"OK")]


class _Handlers:
    """vStopped and ? over a queue, as stub/run.py serves them in non-stop."""

    def __init__(self, queue: StopNotifications) -> None:
        self.queue = queue

    @handles(v.VStopped)
    def vstopped(self, packet):
        return self.queue.ack()

    @handles(c.HaltReason)
    def halt(self, packet):
        return self.queue.status([(b"T00thread:9;", 9)])


def _frames(data: bytes) -> list[tuple[str, bytes]]:
    return [(e.kind.name, e.payload) for e in Decoder(notifications=True).feed(data)
            if e.kind in (EventKind.PACKET, EventKind.NOTIFICATION)]


def test_the_session_sends_each_new_stop_through_the_queue():
    queue = StopNotifications()
    stops: list[bytes] = []
    interrupts = []
    session = Session(Dispatcher((_Handlers(queue),)), notifications=queue,
                      stop_events=lambda: [(stops.pop(0), None) for _ in list(stops)], interrupt=lambda: interrupts.append(1))
    assert session.poll() == b""
    stops += [b"T05thread:1;", b"T05thread:2;"]
    assert _frames(session.poll()) == [("NOTIFICATION", b"Stop:T05thread:1;")]
    assert session.poll() == b""  # nothing new; nothing resent
    assert _frames(session.receive(encode_packet(b"vStopped"))) == [("PACKET", b"T05thread:2;")]
    assert _frames(session.receive(b"-")) == [("PACKET", b"T05thread:2;")]  # a nack resends the reply, not the %
    stops.append(b"T05thread:3;")
    assert session.poll() == b""  # queue not drained: the stop waits for vStopped
    assert _frames(session.receive(encode_packet(b"vStopped"))) == [("PACKET", b"T05thread:3;")]
    assert _frames(session.receive(encode_packet(b"vStopped"))) == [("PACKET", b"OK")]
    assert _frames(session.receive(encode_packet(b"?"))) == [("PACKET", b"T00thread:9;")]
    session.receive(b"\x03")  # Ctrl-C with no resumption waiting: the target's interrupt (non-stop)
    assert interrupts == [1]
