"""The machine's breakpoints at a process's user addresses (machine/runcontrol.py, machine/tasks.py): with the same
program running twice, a breakpoint (code hook or debug register) in one process's space stops the machine only
with that process's page tables loaded (CR3), before the instruction, its memory untouched; the process table finds
each process's space and the processes whose executable areas hold an address."""

from __future__ import annotations

import pytest
from elftools.elf.elffile import ELFFile

from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.runcontrol import Reason
from kgtp_sim.machine.tasks import ProcessTable
from kgtp_sim.machine.watchpoints import EXECUTE
from kgtp_sim.programs import Program, load_programs

from ..conftest import VMLINUX, wait_until
from ..programs import compile_program

WAIT_S = 60


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    path = compile_program("syscalls", "glibc-static", tmp_path_factory.mktemp("machine-user-breakpoints"))
    with path.open("rb") as f:
        symbol, = ELFFile(f).get_section_by_name(".symtab").get_symbol_by_name("getppid")
    return path, symbol["st_value"]


@pytest.fixture
def machine(program):
    """One CPU (two processes on two CPUs do not run reliably on this kernel yet), the program twice."""
    path, address = program
    machine = Machine(KernelImage.load(VMLINUX), hz=100, cpus=1)
    inside = load_programs(machine, [Program(path, (str(path),))])
    machine.processes.sink = lambda fd, data: None
    machine.start()
    machine.pids = [machine.processes.spawn(inside[path], [str(path)]) for _ in range(2)]
    wait_until(lambda: ProcessTable(machine).mapping(address, code=True) == machine.pids, "both programs loaded")
    # and both have run getppid: its page is present in each space (the test reads the code there)
    wait_until(lambda: all(space.translate(address) is not None for space in ProcessTable(machine).spaces().values())
               and len(ProcessTable(machine).spaces()) == 2, "both programs in getppid")
    yield machine
    machine.shutdown()


def _pid(machine: Machine) -> int:
    return int.from_bytes(machine.read_memory(machine.current_task(0), 4), "little", signed=True)


@pytest.mark.parametrize("hardware", [False, True], ids=["code hook", "debug register"])
def test_a_breakpoint_in_a_process_space_stops_only_that_process(machine, program, hardware):
    _, address = program
    control = machine.control
    table = ProcessTable(machine)
    spaces = table.spaces()
    assert sorted(spaces) == machine.pids and len({space.root for space in spaces.values()}) == 2
    assert table.mapping(0x7F0000000000, code=False) == [] and table.mapping(address, code=False) == machine.pids
    code = machine.read_memory(address, 8, spaces[machine.pids[0]])
    for pid in machine.pids:
        space = spaces[pid]
        insert = (lambda: control.insert_hardware(EXECUTE, address, 1, space)) if hardware else \
            (lambda: control.insert_breakpoint(address, space))
        remove = (lambda: control.remove_hardware(EXECUTE, address, 1, space)) if hardware else \
            (lambda: control.remove_breakpoint(address, space))
        insert()
        serial = control.resume() if control.stopped else control.serial
        for _ in range(4):
            event = control.wait(serial, WAIT_S)
            reason = Reason.HARDWARE_BREAKPOINT if hardware else Reason.BREAKPOINT
            assert event is not None and event.reason is reason and event.address == address, event
            assert machine.registers(0)["rip"] == address and machine.cpu_space(0).root == space.root
            assert _pid(machine) == pid
            assert machine.read_memory(address, 8, space) == code  # never patched
            remove()
            serial = control.resume(step=0)  # over it, as GDB steps over a breakpoint
            assert control.wait(serial, WAIT_S).reason is Reason.STEP
            insert()
            serial = control.resume()
        event = control.wait(serial, WAIT_S)
        remove()
    assert not control.breakpoints and not control.hardware
    control.resume()
