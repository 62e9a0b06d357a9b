"""Replay transcripts recorded from real GDB sessions against a fresh in-process stub; replies must match.

Only what legitimately changes between runs is masked: live register values, live writable memory, counters in
`monitor` output and trace-status times. Code and read-only data must come back byte for byte.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from elftools.elf.constants import SH_FLAGS
from elftools.elf.elffile import ELFFile

from kgtp_sim.app import Stub
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.rsp.codec import Decoder, EventKind, encode_packet
from kgtp_sim.tools.transcript import load

from ..conftest import ROOT, VMLINUX

TRANSCRIPTS = sorted((ROOT / "fixtures" / "transcripts").glob("*.rsp"))


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
    return reply


@pytest.fixture(scope="module")
def stub():
    machine = Machine(KernelImage.load(VMLINUX))
    machine.start()
    yield Stub(machine)
    machine.shutdown()


@pytest.mark.skipif(not TRANSCRIPTS, reason="no transcripts recorded")
@pytest.mark.parametrize("path", TRANSCRIPTS, ids=lambda p: p.stem)
def test_replay(stub, path: Path):
    session = stub.make_session()
    exchanges = load(path)
    assert exchanges, f"{path} is empty"
    for exchange in exchanges:
        out = session.receive(b"+" + encode_packet(exchange.request))
        replies = [e.payload for e in Decoder().feed(out) if e.kind is EventKind.PACKET]
        got = [_masked(exchange.request, r) for r in replies]
        want = [_masked(exchange.request, r) for r in exchange.replies]
        assert got == want, f"{path.name}: reply to {exchange.request[:60]!r} differs"
