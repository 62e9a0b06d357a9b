"""The viewers' pieces without a running stub: C expressions on synthetic frames with the kernel's DWARF, the
CTF writer read back by babeltrace2, the tfile reader, and the follow channel's missed-frame accounting."""

from __future__ import annotations

import json
import shutil
import socket
import struct
import subprocess
from dataclasses import dataclass

import pytest

from kgtp_sim.arch import amd64
from kgtp_sim.view.cexpr import ExpressionError, FrameContext, evaluate, to_python
from kgtp_sim.machine.dwarf import KernelDwarf, Unavailable
from kgtp_sim.view.export import identifier, write_chrome, write_ctf, write_jsonl
from kgtp_sim.view.fields import FrameReader, split_arguments
from kgtp_sim.view.model import Frame, Run, Source, TracepointInfo
from kgtp_sim.view.sources import load_tfile

from ..conftest import VMLINUX


@pytest.fixture(scope="module")
def dwarf() -> KernelDwarf:
    return KernelDwarf(VMLINUX)


def registers(**values: int) -> dict[str, int]:
    names = ("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10", "r11", "r12", "r13", "r14",
             "r15", "rip", "eflags", "cs", "ss", "ds", "es", "fs", "gs")
    return {name: values.get(name, 0) for name in names}


def frame_body(regs: dict[str, int] | None = None, memory: tuple[tuple[int, bytes], ...] = ()) -> bytes:
    body = b""
    if regs is not None:
        body += b"R" + amd64.encode_registers(regs)
    for address, data in memory:
        body += b"M" + struct.pack("<QH", address, len(data)) + data
    return body


def test_parameters_in_registers_and_c_arithmetic(dwarf):
    pc = dwarf.address_of("kgtp_test_function")
    context = FrameContext(dwarf, pc, registers(rdi=0xFFFFFFFF, rsi=7), lambda a, n: None, {})
    assert to_python(evaluate("counter1", context)) == -1  # int in %edi: the low 32 bits, signed
    assert to_python(evaluate("(2*counter1+3*counter2)", context)) == 19
    assert to_python(evaluate("counter2 << 31", context)) == -(1 << 31)  # int arithmetic wraps at 32 bits
    assert to_python(evaluate("$rsi * 2 - 1", context)) == 13


def test_globals_members_and_unavailable_memory(dwarf):
    modules, kind = dwarf.global_variable("modules")
    offset, _ = kind.target.member("taints")
    entry = kind.target.size
    memory = {modules + entry + offset: (4096).to_bytes(4, "little")}

    def read(address, length):
        return memory.get(address) if length == 4 else None

    pc = dwarf.address_of("load_module")
    context = FrameContext(dwarf, pc, registers(), read, {})
    assert to_python(evaluate("modules[1].taints", context)) == 4096
    assert to_python(evaluate("(&modules[1])->taints", context)) == 4096
    with pytest.raises(Unavailable):
        evaluate("modules[0].taints + 1", context)
    with pytest.raises(ExpressionError):
        evaluate("no_such_symbol", context)


def test_collect_lines_are_split_like_gdb():
    assert split_arguments("collect a, b[1], f(x, y)") == ["a", "b[1]", "f(x, y)"]
    assert split_arguments("collect/s name") == ["/s name"]
    info = TracepointInfo(1, 0, sources=[Source("at", "f"), Source("cmd", "collect a"),
                                         Source("cmd", "while-stepping 3"), Source("cmd", "collect b"),
                                         Source("cmd", "end"), Source("cmd", "collect c")])
    assert info.collect_lines() == ["collect a", "collect c"]


def test_identifiers_are_tsdl_names():
    assert identifier("(2*counter1+3*counter2)") == "x2_counter1_3_counter2"
    assert identifier("mod->name") == "mod_name"
    assert identifier("string") == "string_"


def synthetic_run(dwarf) -> Run:
    pc = dwarf.address_of("kgtp_test_function")
    counter, _ = dwarf.global_variable("kgtp_counter")
    run = Run(start_us=1_700_000_000_000_000)
    run.tracepoints[1] = TracepointInfo(1, pc, sources=[
        Source("at", "kgtp_test_function"), Source("cmd", "collect (2*counter1+3*counter2), kgtp_counter"),
        Source("cmd", "collect $regs")])
    for index in range(40):
        regs = registers(rdi=index + 1, rsi=index, rip=pc)
        body = frame_body(regs, ((counter, (100 + index).to_bytes(4, "little")),) if index % 10 else ())
        run.frames.append(Frame(index, index, 1, index % 3, 1000 * index, body))
    return run


def test_exports_of_a_synthetic_run(dwarf, tmp_path):
    run = synthetic_run(dwarf)
    reader = FrameReader(run, dwarf)
    write_jsonl(run, reader, tmp_path / "f.jsonl")
    records = [json.loads(line) for line in (tmp_path / "f.jsonl").read_text().splitlines()]
    assert records[3]["fields"]["(2*counter1+3*counter2)"] == 2 * 4 + 3 * 3
    assert records[3]["fields"]["kgtp_counter"] == 103
    assert records[10]["fields"]["kgtp_counter"] is None and "kgtp_counter" in records[10]["unavailable"]
    write_chrome(run, reader, tmp_path / "c.json")
    document = json.loads((tmp_path / "c.json").read_text())
    assert {e["tid"] for e in document["traceEvents"] if e["ph"] == "i"} == {0, 1, 2}
    summary = write_ctf(run, reader, tmp_path / "ctf")
    assert summary["cpus"] == [0, 1, 2]
    babeltrace = shutil.which("babeltrace2")
    if babeltrace is None:
        pytest.skip("babeltrace2 not installed (scripts/test installs Debian's package)")
    out = subprocess.run([babeltrace, str(tmp_path / "ctf")], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert len(lines) == 40
    assert all("kgtp_test_function: { cpu_id = " in line for line in lines)
    frame_10 = next(line for line in lines if "frame = 10," in line)
    assert "kgtp_counter = 0" in frame_10 and 'unavailable = "kgtp_counter"' in frame_10
    frame_3 = next(line for line in lines if "frame = 3," in line)
    assert "cpu_id = 0" in frame_3 and "x2_counter1_3_counter2 = 17" in frame_3 and "kgtp_counter = 103" in frame_3


def test_tfile_reader(tmp_path, dwarf):
    pc = dwarf.address_of("kgtp_test_function")
    body = frame_body(registers(rdi=5, rsi=4, rip=pc)) + b"V" + struct.pack("<iq", 1, 3)
    header = (b"\x7fTRACE0\nR %x\nstatus 0;tframes:1\ntsv 1:0:1:%s\n" % (amd64.G_PACKET_SIZE, b"cpu_id".hex().encode())
              + b"tp T1:%x:E:0:0\n" % pc
              + b"tp Z1:%x:cmd:0:f:%s\n" % (pc, b"collect counter1".hex().encode()) + b"\n")
    path = tmp_path / "t.tf"
    path.write_bytes(header + struct.pack("<HI", 1, len(body)) + body + b"\0\0\0\0")
    run = load_tfile(path)
    assert run.cpu_source == "$cpu_id" and run.frames[0].cpu == 3 and run.time_source == "frame-order"
    fields = FrameReader(run, dwarf).fields(run.frames[0])
    assert [(f.name, f.value) for f in fields] == [("counter1", 5)]


@dataclass
class FakeFrame:
    number: int
    tracepoint: int
    sequence: int
    timestamp: int = 0
    cpu: int = 0

    def to_gdb(self) -> bytes:
        return struct.pack("<HI", self.tracepoint, 0)

    def static_data(self):
        return None


class FakeTracer:
    """What the follow channel reads of a tracer: a buffer that keeps only the newest frames."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.definitions = SimpleNamespace(tracepoints={}, variables={})
        self.running = True
        self.start_time = 1
        self.created = 0
        self.kept: list[FakeFrame] = []

        class Tsc:
            ticks_per_ns = 1.0

            @staticmethod
            def now():
                return 0

            @staticmethod
            def to_ns(ticks):
                return ticks

        self.tsc = Tsc()

    def commit(self, count: int, keep: int) -> None:
        for _ in range(count):
            self.kept.append(FakeFrame(self.created, 1, self.created))
            self.created += 1
        self.kept = self.kept[-keep:]
        self.kept = [FakeFrame(i, f.tracepoint, f.sequence) for i, f in enumerate(self.kept)]

    def frames(self):
        return list(self.kept)

    def status(self):
        class Status:
            created = self.created
            stop_reason = type("R", (), {"name": "STOP_COMMAND"})

        return Status()

    def marker_at(self, address):
        return None

    def rendered_sdata(self, frame):
        return None


def test_follow_channel_reports_overwritten_frames():
    from kgtp_sim.stub.follow import FollowServer

    tracer = FakeTracer()
    server = FollowServer(tracer, port=0)
    server.bind()
    server.start()
    try:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(b'{"op": "follow", "from": "start"}\n')
        reader = sock.makefile("rb")
        assert json.loads(reader.readline())["t"] == "run"
        tracer.commit(5, keep=100)
        seen = [json.loads(reader.readline())["seq"] for _ in range(5)]
        assert seen == [0, 1, 2, 3, 4]
        tracer.commit(50, keep=10)  # 40 frames overwritten before the channel could read them
        message = json.loads(reader.readline())
        assert message == {"t": "missed", "count": 40}
        seen = [json.loads(reader.readline())["seq"] for _ in range(10)]
        assert seen == list(range(45, 55))
        tracer.running = False
        assert json.loads(reader.readline())["t"] == "stopped"
        sock.close()
    finally:
        server.shutdown()
