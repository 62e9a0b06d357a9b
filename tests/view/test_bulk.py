"""Frames decoded in bulk (decode.py) against the per-frame decoder (fields.FrameReader) on the same frames: the
exports, follow's lines and every field come out the same. Synthetic frames, named with the kernel's DWARF;
the runs mix what a frame can hold (a `g` register block and the ring's compact one, globals, a struct's member
and a char array, parameters in registers, a trace state variable, `$_sdata`, a stack block whose address
moves, a memory block some frames lack) so that both the bulk path and its fallbacks are taken."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess

import numpy as np
import pytest

from kgtp_sim.arch import amd64
from kgtp_sim.machine import KernelImage
from kgtp_sim.machine.dwarf import KernelDwarf
from kgtp_sim.view.batch import FrameRows, Merger, chain, concat, from_frames, merged
from kgtp_sim.view.decode import BulkReader
from kgtp_sim.view.export import write_chrome, write_ctf, write_jsonl
from kgtp_sim.view.fields import FrameReader
from kgtp_sim.view.follow import batch_lines, format_line
from kgtp_sim.view.model import Frame, Run, Source, TracepointInfo
from kgtp_sim.view.sources import batches

from ..conftest import VMLINUX
from .test_view_units import frame_body, registers


@pytest.fixture(scope="module")
def dwarf() -> KernelDwarf:
    return KernelDwarf(VMLINUX)


def compact(values: dict[str, int]) -> bytes:
    """The ring's compact register block of these registers (tracing/core/frames.py)."""
    names = [reg.name for reg in amd64.GENERAL_REGISTERS]
    mask = sum(1 << names.index(n) for n in values)
    ordered = [values[n] for n in names if n in values]
    return b"r" + struct.pack(f"<I{len(ordered)}Q", mask, *ordered)


def memory(address: int, data: bytes) -> bytes:
    return b"M" + struct.pack("<QH", address, len(data)) + data


def variable(number: int, value: int) -> bytes:
    return b"V" + struct.pack("<iq", number, value)


def mixed_run(dwarf: KernelDwarf) -> Run:
    image = KernelImage.load(VMLINUX)
    test_function = dwarf.address_of("kgtp_test_function")
    load_module = dwarf.address_of("load_module")
    counter, _ = dwarf.global_variable("kgtp_counter")
    modules, kind = dwarf.global_variable("modules")
    marker = next(m for m in image.markers if m.id == "module::kgtp_module_event")
    run = Run(start_us=1_700_000_000_000_000)
    run.variables = {1: "cpu_id", 7: "hits"}
    run.tracepoints = {
        1: TracepointInfo(1, test_function, sources=[Source("at", "kgtp_test_function"),
                                                     Source("cmd", "collect $regs, kgtp_counter, $args")]),
        2: TracepointInfo(2, test_function, sources=[Source("at", "kgtp_test_function"),
                                                     Source("cmd", "collect $rsi, counter1, $hits"),
                                                     Source("cmd", "collect (2*counter1+3*counter2)")]),
        3: TracepointInfo(3, load_module, sources=[Source("at", "load_module"),
                                                   Source("cmd", "collect $regs, $bt, modules[0].taints"),
                                                   Source("cmd", "collect modules[1].name, $hits")]),
        4: TracepointInfo(4, marker.site, static=True, marker=marker.id,
                          sources=[Source("at", f"*{marker.site:#x}"), Source("cmd", "collect $_sdata")]),
    }
    taints = modules + kind.target.member("taints")[0]
    name = modules + kind.target.size
    frames = []
    for index in range(240):
        tracepoint = 1 + index % 4
        if tracepoint == 1:
            body = frame_body(registers(rdi=index + 1, rsi=index, rip=test_function, rax=(1 << 64) - index))
            if index % 9:  # some frames lack the global: unavailable there
                body += memory(counter, (7000 + index).to_bytes(4, "little", signed=True))
        elif tracepoint == 2:
            body = compact({"rsi": 2 * index, "rdi": (1 << 32) - index, "rip": test_function})
            body += variable(7, -index)
        elif tracepoint == 3:
            stack = 0xFFFFFFFF81010000 + 8 * index  # $bt: the stack, a new address each time
            if index % 23 == 2:
                stack = taints - 8  # this once, the stack block holds modules[0].taints first
            body = frame_body(registers(rsp=stack, rip=load_module, rdi=name))
            body += memory(stack, bytes(range(index % 200, index % 200 + 32)))
            body += memory(taints, (index * 3).to_bytes(4, "little"))
            body += memory(name, f"mod{index}".encode().ljust(56, b"\0")) + variable(7, index)
        else:
            entry = bytearray(marker.entry_size)
            for field, value in zip(marker.fields, (index, -index)):
                entry[field.offset : field.offset + field.size] = value.to_bytes(field.size, "little", signed=True)
            body = b"S" + struct.pack("<H", len(entry)) + bytes(entry)
        frames.append(Frame(index, index, tracepoint, index // 4 % 2, 1000 * index, body))
    run.frames = frames
    return run


def exact_tracepoints(run: Run, reader: FrameReader) -> set[int]:
    decoder = BulkReader(reader)
    return {part.plan.tracepoint for batch in batches(run) for part in decoder.decode(batch) if part.plan.exact}


def test_bulk_fields_are_the_per_frame_fields(dwarf):
    run = mixed_run(dwarf)
    reader = FrameReader.open(run, VMLINUX)
    decoder = BulkReader(reader)
    checked = 0
    for batch in batches(run):
        for part in decoder.decode(batch):
            for index, row in enumerate(part.rows.tolist()):
                frame = batch.frame(row)
                expected = [(f.name, f.value, f.spec, f.error if f.value is None else None)
                            for f in reader.fields(frame)]
                got = [(f.name, f.value, f.spec, f.error) for f in part.fields(index)]
                assert got == expected, (frame.number, part.plan.tracepoint)
                checked += 1
    assert checked == len(run.frames)
    # the bulk path is taken: every tracepoint whose values all lie at fixed places (2 computes an expression)
    assert exact_tracepoints(run, reader) == {1, 3, 4}


@pytest.mark.parametrize("writer", [write_jsonl, write_chrome])
def test_json_exports_in_bulk_equal_the_per_frame_ones(dwarf, tmp_path, writer):
    run = mixed_run(dwarf)
    reader = FrameReader.open(run, VMLINUX)
    writer(run, reader, tmp_path / "bulk", bulk=True)
    writer(run, reader, tmp_path / "frame", bulk=False)
    bulk, frame = (tmp_path / "bulk").read_text(), (tmp_path / "frame").read_text()
    assert bulk == frame
    if writer is write_jsonl:
        records = [json.loads(line) for line in bulk.splitlines()]
        assert len(records) == 240 and list(records[36]["unavailable"]) == ["kgtp_counter"]
        assert records[4]["fields"]["kgtp_counter"] == 7004 and "unavailable" not in records[4]
        assert records[3]["sdata"] == "counter1=3 counter2=-3"
        assert records[6]["fields"]["modules[1].name"] == "mod6"
        assert records[2]["fields"]["modules[1].name"] != "mod2"  # its stack block holds the first bytes


def test_ctf_export_in_bulk_equals_the_per_frame_one(dwarf, tmp_path):
    babeltrace = shutil.which("babeltrace2")
    if babeltrace is None:
        pytest.skip("babeltrace2 not installed (scripts/test installs Debian's package)")
    run = mixed_run(dwarf)
    reader = FrameReader.open(run, VMLINUX)
    write_ctf(run, reader, tmp_path / "bulk", bulk=True)
    write_ctf(run, reader, tmp_path / "frame", bulk=False)
    texts = [subprocess.run([babeltrace, "--clock-gmt", str(tmp_path / name)], capture_output=True, text=True,
                            check=True).stdout for name in ("bulk", "frame")]
    assert texts[0] == texts[1]
    lines = texts[0].splitlines()
    assert len(lines) == 240
    assert any("kgtp_test_function: { cpu_id = 1 }, { frame = 4, regs_rax = 0xFFFFFFFFFFFFFFFC" in line
               for line in lines)


def test_follow_lines_in_bulk_equal_the_per_frame_ones(dwarf):
    run = mixed_run(dwarf)
    reader = FrameReader.open(run, VMLINUX)
    decoder = BulkReader(reader)
    for batch in batches(run):
        frames = [decoder.frame(batch, row) for row in range(len(batch))]
        for part in decoder.decode(batch):  # the rendered $_sdata the follow channel would have sent
            for index, row in enumerate(part.rows.tolist()):
                frames[row].sdata = part.sdata[index] if part.sdata else None
        assert batch_lines(decoder, batch) == [format_line(reader, frame) for frame in frames]


def test_batches_of_merged_cpus_decode_as_their_frames(dwarf):
    """Frames of two CPUs merged by time (as the drain and a recorded trace's streams give them) interleave in
    their buffer: reading a field of one class takes a run of frames per CPU, and comes out in frame order."""
    run = mixed_run(dwarf)
    reader = FrameReader.open(run, VMLINUX)
    cpu0 = from_frames([f for f in run.frames if f.cpu == 0 and f.tracepoint == 1])
    cpu1 = from_frames([f for f in run.frames if f.cpu == 1 and f.tracepoint == 1])
    both = merged([cpu0, cpu1])
    assert both.cpu.tolist()[:4] == [0, 1, 0, 1]
    (part, *_) = [p for p in BulkReader(reader).decode(both) if p.plan.exact]
    for index, row in enumerate(part.rows.tolist()):
        assert part.fields(index)[0].value == reader.fields(both.frame(row))[0].value


def test_frame_rows_read_runs_and_scattered_frames_alike():
    data = np.arange(4096, dtype=np.uint64).view(np.uint8)
    for body in (np.arange(0, 800, 40), np.array([800, 0, 400, 40, 1600, 1640, 3000]), np.array([8])):
        rows = FrameRows(data, body, 16)
        expected = np.array([int.from_bytes(data[b + 8 : b + 16].tobytes(), "little") for b in body.tolist()])
        assert rows.uint(8, 8).tolist() == expected.tolist()
        assert rows.field(0, 3).tolist() == [data[b : b + 3].tolist() for b in body.tolist()]


def test_chain_finds_records_of_any_lengths():
    lengths = [24] * 50 + [8, 16] * 20 + [40] * 3 + [24] * 10
    data = np.zeros(sum(lengths) + 64, dtype=np.uint8)
    at = 0
    for length in lengths:
        data[at : at + 4] = np.frombuffer(struct.pack("<I", length), dtype=np.uint8)
        at += length

    def length_at(offsets):
        return np.array([struct.unpack_from("<I", data, o)[0] for o in offsets.tolist()], dtype=np.int64)

    starts, stopped = chain(data, 0, at, length_at)
    assert starts.tolist() == np.cumsum([0] + lengths[:-1]).tolist() and stopped == at
    starts, stopped = chain(data, 0, at - 5, length_at)  # the last record cut: left for the next read
    assert len(starts) == len(lengths) - 1 and stopped == at - lengths[-1]


def test_merger_orders_streams_read_a_piece_at_a_time(dwarf):
    run = mixed_run(dwarf)
    streams = {cpu: from_frames([f for f in run.frames if f.cpu == cpu]) for cpu in (0, 1)}
    merger = Merger(streams)
    out = []
    for start in range(0, 120, 7):  # the streams arrive in pieces of different sizes
        for cpu, batch in streams.items():
            piece = batch.take(slice(start * (cpu + 1) // 2, (start + 7) * (cpu + 1) // 2))
            merger.add(cpu, piece.compact())
        out.append(merger.ready())
    for cpu in streams:
        merger.add(cpu, streams[cpu].take(slice(min(127 * (cpu + 1) // 2, 120), None)).compact())
        merger.close(cpu)
    out.append(merger.ready())
    result = concat(out)
    assert result.ns.tolist() == sorted(f.ns for f in run.frames)
    assert [result.blocks(i) for i in range(len(result))] == [f.raw for f in run.frames]
