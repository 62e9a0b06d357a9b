"""Replay transcripts recorded from real GDB sessions against a fresh in-process stub; replies must match.

Only what legitimately changes between runs is masked: live register values, live writable memory, counters in
`monitor` output and trace-status times. Code and read-only data must come back byte for byte.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from elftools.elf.constants import SH_FLAGS
from elftools.elf.elffile import ELFFile

from kgtp_sim.app import Stub
from kgtp_sim.client import TRANSCRIPTS as TRANSCRIPT_DIR
from kgtp_sim.client import VMLINUX
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.rsp.codec import Decoder, EventKind, encode_packet
from kgtp_sim.tools.transcript import load

TRANSCRIPTS = sorted(TRANSCRIPT_DIR.glob("*.rsp"))


def _read_only_ranges() -> list[tuple[int, int]]:
    with VMLINUX.open("rb") as f:
        return [
            (s["sh_addr"], s["sh_addr"] + s["sh_size"])
            for s in ELFFile(f).iter_sections()
            if s["sh_flags"] & SH_FLAGS.SHF_ALLOC and not s["sh_flags"] & SH_FLAGS.SHF_WRITE
        ]


READ_ONLY = _read_only_ranges()


def _masked(request: bytes, reply: bytes) -> bytes:
    """The part of a reply that must not change between two runs of the same session."""
    if request in (b"g",) or request.startswith(b"p"):
        return re.sub(rb"[0-9a-f]", b"h", reply)  # values change; length and unavailable 'x' do not
    if request.startswith(b"m") and not reply.startswith(b"E"):
        address, length = (int(v, 16) for v in request[1:].split(b","))
        if any(lo <= address and address + length <= hi for lo, hi in READ_ONLY):
            return reply
        return re.sub(rb"[0-9a-f]", b"h", reply)
    if request.startswith(b"qRcmd") and reply.startswith(b"O") and reply != b"OK":
        text = bytes.fromhex(reply[1:].decode())
        return re.sub(rb"\d+(\.\d+)?", b"N", text)
    if request == b"qTStatus":
        return re.sub(rb"(starttime|stoptime|tframes|tcreated|tfree):[0-9a-f]+", rb"\1:N", reply)
    if request.startswith(b"qTP:"):
        return re.sub(rb"[0-9a-f]+", b"N", reply)  # hits and bytes depend on how far the kernel ran
    if request.startswith((b"QTFrame:pc:", b"QTFrame:tdp:", b"QTFrame:range:", b"QTFrame:outside:")):
        return re.sub(rb"^F[0-9a-f]+T", b"FNT", reply)  # which frame matched depends on the run
    if request.startswith(b"qXfer:statictrace:read:"):
        return re.sub(rb"-?\d+", b"N", reply)  # $_sdata renders live counters
    if request.startswith(b"qTV:"):
        return re.sub(rb"[0-9a-f]+", b"N", reply)
    return reply


def _replies(session, request: bytes) -> list[bytes]:
    out = session.receive(b"+" + encode_packet(request))
    return [e.payload for e in Decoder().feed(out) if e.kind is EventKind.PACKET]


def _same_tracepoint_frame(session, replies: list[bytes], recorded: bytes) -> list[bytes]:
    """Select the replay's first frame of the recorded frame's tracepoint when frame N is another tracepoint's.

    Which tracepoint fires first after QTStart depends on where the kernel's tasks were when tracing began (on a
    loaded machine, load_module may run before the benchmark task's first true condition). The frame that follows
    must still be one of the same tracepoint, so its collected blocks can be compared.
    """
    want = re.fullmatch(rb"F[0-9a-f]+T([0-9a-f]+)", recorded)
    got = re.fullmatch(rb"F[0-9a-f]+T([0-9a-f]+)", replies[0])
    if not want or not got or want.group(1) == got.group(1):
        return replies
    assert _replies(session, b"QTFrame:ffffffff") == [b"OK"]
    return _replies(session, b"QTFrame:tdp:" + want.group(1))


def _let_recorded_tracepoints_hit(session, exchanges) -> None:
    """Let the kernel run until each tracepoint the recording saw hit has hit here too.

    The recorded session let the kernel run (`shell sleep`) before tstop; a fixed sleep can end before a rarely
    called function (load_module) ran once on a loaded machine, so the replay waits for the hits themselves.
    """
    time.sleep(0.3)
    hit = [e.request for e in exchanges if e.request.startswith(b"qTP:") and e.replies
           and re.fullmatch(rb"V([0-9a-f]+):[0-9a-f]+", e.replies[0]) and not e.replies[0].startswith(b"V0:")]
    deadline = time.monotonic() + 10
    for request in hit:
        while _replies(session, request)[0].startswith(b"V0:"):
            assert time.monotonic() < deadline, f"{request!r} never hit"
            time.sleep(0.05)


@pytest.fixture
def stub():
    """A fresh stub per transcript: each recording started from a freshly booted kernel of one CPU, as
    tools/record_transcript.py records them (qfThreadInfo, qThreadExtraInfo name every CPU)."""
    machine = Machine(KernelImage.load(VMLINUX), cpus=1)
    machine.start()
    yield Stub(machine)
    machine.shutdown()


@pytest.mark.skipif(not TRANSCRIPTS, reason="no transcripts recorded")
@pytest.mark.parametrize("path", TRANSCRIPTS, ids=lambda p: p.stem)
def test_replay(stub, path: Path):
    session = stub.make_session()
    exchanges = load(path)
    assert exchanges, f"{path} is empty"
    frame_numbers: dict[int, int] = {}  # recorded frame number -> the replay's, learned from searches
    for exchange in exchanges:
        request = exchange.request
        selected = re.fullmatch(rb"QTFrame:([0-9a-f]+)", request)
        if selected and int(selected.group(1), 16) in frame_numbers:
            request = b"QTFrame:%x" % frame_numbers[int(selected.group(1), 16)]
        out = session.receive(b"+" + encode_packet(request))
        if request == b"QTStart":
            _let_recorded_tracepoints_hit(session, exchanges)
        replies = [e.payload for e in Decoder().feed(out) if e.kind is EventKind.PACKET]
        if selected and replies and exchange.replies:
            replies = _same_tracepoint_frame(session, replies, exchange.replies[0])
        if request.startswith(b"QTFrame:") and replies and exchange.replies:
            found = re.match(rb"F([0-9a-f]+)T", replies[0]), re.match(rb"F([0-9a-f]+)T", exchange.replies[0])
            if found[0] and found[1]:
                frame_numbers[int(found[1].group(1), 16)] = int(found[0].group(1), 16)
                replies = [re.sub(rb"^F[0-9a-f]+T", b"F%xT" % int(found[1].group(1), 16), replies[0])]
        got = [_masked(exchange.request, r) for r in replies]
        want = [_masked(exchange.request, r) for r in exchange.replies]
        assert got == want, f"{path.name}: reply to {exchange.request[:60]!r} differs"
