"""GDB trace-frame format and the frame view (what `g`/`m` answer when a frame is selected)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kgtp_sim.arch import amd64
from kgtp_sim.tracing.core.frames import ViewError
from kgtp_sim.tracing.core.frames import (
    FrameFormatError,
    FrameView,
    MemoryBlock,
    RegisterBlock,
    StaticBlock,
    TraceFrame,
    TsvBlock,
    encode_frame,
    parse_blocks,
)


class Live:
    def __init__(self, memory):
        self.memory = memory

    def registers(self):
        return {}

    def read_memory(self, address, length):
        data = bytes(self.memory.get(address + i, 0) for i in range(length))
        if address not in self.memory:
            raise ViewError("unmapped")
        return data


blocks = st.one_of(
    st.builds(RegisterBlock, st.binary(min_size=amd64.G_PACKET_SIZE, max_size=amd64.G_PACKET_SIZE)),
    st.builds(MemoryBlock, st.integers(0, 2**64 - 1), st.binary(max_size=64)),
    st.builds(TsvBlock, st.integers(-(2**31), 2**31 - 1), st.integers(-(2**63), 2**63 - 1)),
    st.builds(StaticBlock, st.binary(max_size=64)),
)


@given(st.integers(0, 0xFFFF), st.lists(blocks, max_size=6))
def test_frame_roundtrip(tp, frame_blocks):
    raw = encode_frame(tp, frame_blocks)
    assert int.from_bytes(raw[:2], "little") == tp
    assert int.from_bytes(raw[2:6], "little") == len(raw) - 6
    assert list(parse_blocks(raw[6:])) == frame_blocks


def test_known_bytes():
    raw = encode_frame(1, [MemoryBlock(0x1000, b"\xaa\xbb"), TsvBlock(3, -1)])
    assert raw == (
        b"\x01\x00" + (13 + 13).to_bytes(4, "little")
        + b"M" + (0x1000).to_bytes(8, "little") + b"\x02\x00\xaa\xbb"
        + b"V" + (3).to_bytes(4, "little") + b"\xff" * 8
    )


@pytest.mark.parametrize("body", [b"Q", b"M\x00\x10", b"M" + bytes(8) + b"\x05\x00ab", b"R" + bytes(10), b"V\x01"])
def test_malformed_frames_are_rejected(body):
    with pytest.raises(FrameFormatError):
        parse_blocks(body)


def test_wrong_register_block_size_is_refused():
    with pytest.raises(FrameFormatError):
        encode_frame(1, [RegisterBlock(b"\x00" * 8)])


def test_view_serves_collected_memory_read_only_live_and_refuses_the_rest():
    frame = TraceFrame(0, 1, (MemoryBlock(0x100, b"abcd"),))
    live = Live({0x200 + i: 0x41 + i for i in range(8)})
    view = FrameView(frame, pc=0xFFFF, live=live, read_only=[(0x200, 0x208)])
    assert view.read_memory(0x101, 2) == b"bc"
    assert view.read_memory(0x102, 10) == b"cd"  # only the collected prefix
    assert view.read_memory(0x202, 3) == b"CDE"
    with pytest.raises(ViewError):
        view.read_memory(0x300, 4)


def test_view_without_register_block_reports_tracepoint_pc_only():
    view = FrameView(TraceFrame(0, 1, ()), pc=0xFFFFFFFF81000010, live=Live({}))
    text = amd64.hex_registers(view.registers())
    rip = amd64.OFFSETS[amd64.PC_REGNUM] * 2
    assert text[rip : rip + 16] == (0xFFFFFFFF81000010).to_bytes(8, "little").hex()
    assert text[:16] == "x" * 16  # rax unavailable


def test_view_with_register_block():
    regs = {r.name: i for i, r in enumerate(amd64.GENERAL_REGISTERS)}
    frame = TraceFrame(0, 1, (RegisterBlock(amd64.encode_registers(regs)),))
    view = FrameView(frame, pc=0, live=Live({}))
    assert view.registers()["rdi"] == 5 and view.registers()["rip"] == 16
