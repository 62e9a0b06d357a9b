"""Real GDB attaches to the live kernel: symbols, registers, memory, disassembly, re-attach, and the guards."""

from __future__ import annotations

import re

import pytest
from elftools.elf.elffile import ELFFile

from kgtp_sim.rsp.codec import encode_packet

from ..conftest import VMLINUX, connect_when_free, run_gdb

pytestmark = pytest.mark.gdb


def _text_range() -> tuple[int, int]:
    with VMLINUX.open("rb") as f:
        text = ELFFile(f).get_section_by_name(".text")
        return text["sh_addr"], text["sh_addr"] + text["sh_size"]


def _values(output: str, name: str) -> list[int]:
    return [int(v) for v in re.findall(r"^\$\d+ = (\d+)$", output, re.M)]


def test_rip_lies_in_kernel_text(gdb, stub):
    out = run_gdb(gdb, stub, "info registers rip")
    match = re.search(r"^rip\s+0x([0-9a-f]+)", out, re.M)
    assert match, out
    low, high = _text_range()
    assert low <= int(match.group(1), 16) < high


def test_jiffies_grows_while_attached(gdb, stub):
    out = run_gdb(gdb, stub, "print jiffies", "shell sleep 0.3", "print jiffies")
    first, second = _values(out, "jiffies")
    assert second > first, out


def test_task_comm_and_struct_members(gdb, stub):
    out = run_gdb(gdb, stub, "print tasks[1].comm", "print tasks[1].pid", "print cpu_data[0].current_task->pid")  # `current` of CPU 0
    comm = re.search(r'^\$1 = "([^"\\]+)', out, re.M)
    assert comm and comm.group(1).isprintable(), out
    assert re.search(r"^\$2 = 1$", out, re.M), out
    assert re.search(r"^\$3 = \d+$", out, re.M), out


def test_disassembly_and_line_info_at_pc(gdb, stub):
    out = run_gdb(gdb, stub, "x/5i $pc", "info line *$pc")
    instructions = re.findall(r"^(?:=>)?\s*0x[0-9a-f]+(?: <[\w.]+(?:\+\d+)?>)?:\t\S+", out, re.M)
    assert len(instructions) == 5, out
    assert re.search(r'Line \d+ of "[^"]+\.[chS]"', out), out


def test_detach_and_attach_again(gdb, stub):
    out = run_gdb(gdb, stub, "print jiffies", "detach", f"target remote {stub.address}", "print jiffies")
    first, second = _values(out, "jiffies")
    assert second >= first
    assert out.count("Remote target) detached") == 2, out


def test_memory_writes_are_refused_by_default(gdb, stub):
    out = run_gdb(gdb, stub, "print kgtp_counter = 5")
    assert re.search(r"Cannot access memory|Could not write|cannot|E03", out, re.I), out


def test_second_debugger_is_refused_while_first_keeps_working(gdb, stub):
    with connect_when_free(stub) as first:
        out = run_gdb(gdb, stub, "print jiffies", timeout=30)
        assert "another debugger is attached" in out, out
        first.sendall(b"+" + encode_packet(b"m0,1"))  # the first client is still served
        assert first.recv(4096).startswith(b"+$E")  # address 0 is unmapped: a clean error, not a hang
