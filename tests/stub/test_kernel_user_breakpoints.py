"""KGTP mode's run control at a process's user addresses, on the wire (stub/kernel.py over machine/runcontrol.py),
against a stub in this process running the same program twice: a breakpoint at the program's address
belongs to one process (the one `monitor process` names, else the only one that maps it), stops the machine only
when a CPU runs that process's code there, never patches its memory, and leaves the thread's registers and memory
the process's; addresses no process maps, and one that several do with none named, are refused with the reason."""

from __future__ import annotations

import pytest
from elftools.elf.elffile import ELFFile

from kgtp_sim.app import Stub
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.programs import Program, load_programs

from ..conftest import wait_until
from ..programs import compile_program
from .test_kernel_run_control import IMAGE, Wire, _thread

USER_CS = 0x33


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    path = compile_program("syscalls", "glibc-static", tmp_path_factory.mktemp("user-breakpoints"))
    with path.open("rb") as f:
        elf = ELFFile(f)
        symbol, = elf.get_section_by_name(".symtab").get_symbol_by_name("getppid")
        address = symbol["st_value"]
        text = next(s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD" and
                    s["p_vaddr"] <= address < s["p_vaddr"] + s["p_filesz"])
        code = text.data()[address - text["p_vaddr"]:][:8]
    return path, address, code


@pytest.fixture(scope="module")
def stub(program):
    path, address, _ = program
    # one CPU: two processes at once on two CPUs do not run reliably on this kernel yet (one of them faults)
    machine = Machine(IMAGE, hz=100, cpus=1)
    inside = load_programs(machine, [Program(path, (str(path),))])
    machine.processes.sink = lambda fd, data: None
    machine.start()
    pids = [machine.processes.spawn(inside[path], [str(path)]) for _ in range(2)]
    stub = Stub(machine)
    wait_until(lambda: stub.target.processes.mapping(address, code=True) == pids, "both programs loaded")
    stub.pids = pids
    yield stub
    machine.shutdown()


@pytest.fixture
def wire(stub):
    wire = Wire(stub)
    yield wire
    stub.on_disconnect()
    assert not stub.machine.control.stopped and not stub.machine.control.breakpoints


def _pid_on(stub: Stub, thread: int) -> int:
    task = stub.machine.current_task(thread - 1)
    return int.from_bytes(stub.machine.read_memory(task, 4), "little", signed=True)


def _registers(wire: Wire) -> dict[str, int]:
    from kgtp_sim.arch import amd64

    return amd64.decode_registers(bytes.fromhex(wire.request(b"g").replace(b"x", b"0").decode()))


@pytest.mark.parametrize("kind", [0, 1])
def test_a_breakpoint_stops_only_in_its_process(wire, stub, program, kind):
    _, address, code = program
    both = wire.request(b"Z%d,%x,1" % (kind, address))
    assert both.startswith(b"E.cannot insert a breakpoint") and b"processes %d, %d map" % tuple(stub.pids) in both
    for pid in stub.pids:
        assert f"in process {pid}" in wire.monitor(f"process {pid}")
        assert wire.request(b"Z%d,%x,1" % (kind, address)) == b"OK"
        for _ in range(3):  # GDB's continue: over the breakpoint (lifted), then on with it in
            thread = _thread(wire.resume(b"vCont;c"))
            assert _pid_on(stub, thread) == pid  # the other process runs the same code unhindered
            regs = _registers(wire)
            assert regs["rip"] == address and regs["cs"] == USER_CS  # the process's own registers
            assert wire.request(b"m%x,8" % address) == code.hex().encode()  # its memory, never patched
            assert len(wire.request(b"m%x,8" % regs["rsp"])) == 16  # its stack, through its page tables
            assert wire.request(b"z%d,%x,1" % (kind, address)) == b"OK"
            assert wire.resume(b"vCont;s:%x" % thread) == b"T05thread:%x;" % thread
            assert _registers(wire)["rip"] != address and _pid_on(stub, thread) == pid
            assert wire.request(b"Z%d,%x,1" % (kind, address)) == b"OK"
        assert wire.request(b"z%d,%x,1" % (kind, address)) == b"OK"
    assert "the one process that maps" in wire.monitor("process auto")


def test_user_addresses_no_process_maps_are_refused(wire, stub, program):
    _, address, _ = program
    for kind in (0, 1):
        reply = wire.request(b"Z%d,%x,1" % (kind, 0x7F0000000000))
        assert reply.startswith(b"E.cannot insert a breakpoint at 0x7f0000000000") and b"no process maps it" in reply
    wire.monitor(f"process {stub.pids[0]}")
    for address in (0x7F0000000000, 0x7FFFFFFFE000):  # nothing there; its stack, which may not run
        reply = wire.request(b"Z0,%x,1" % address)
        assert b"is not in a memory area of process %d that may run" % stub.pids[0] in reply, reply
    assert "no process 99999 runs" in wire.monitor("process 99999")
    assert not stub.machine.control.breakpoints and not stub.machine.control.hardware
    calls = stub.machine.read_symbol("nr_syscalls")
    wait_until(lambda: stub.machine.read_symbol("nr_syscalls") > calls + 5, "system calls")  # nothing stopped
