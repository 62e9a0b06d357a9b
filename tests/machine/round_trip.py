"""A system call's round trip in the machine's own exact instruction count: tests/programs/getpids.c (getpid()
without end, statically linked) runs on a one-CPU machine, and a hook on `entry_SYSCALL_64` reads the machine's
instruction counter (a native hook on every instruction) at each entry. One round is what the CPU ran from one
getpid's entry to the next one's: the kernel's way in and back, the user wrapper and the loop. A round during
which the machine delivered anything through the IDT (a tick, a fault) is left out, so what is left is the
common path, the same number of instructions every time.

`python -m tests.machine.round_trip` also prints where a round's instructions go, per function (a Python hook on
every instruction for a few rounds, checked against the machine's count).

Runs the machine on its own CPU thread; the hooks run there, the caller reads what they gathered once enough
rounds are in.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from unicorn import UC_HOOK_CODE
from unicorn import x86_const as X

from kgtp_sim.client import VMLINUX
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.initramfs import Archive

NR_GETPID = 39
USER = "(user)"


@dataclass
class RoundTrips:
    """The clean rounds' instruction counts, and (by_function) one clean round's instructions per function."""

    rounds: list[int]
    by_function: Counter[str] = field(default_factory=Counter)

    @property
    def instructions(self) -> int:
        """The round trip: every clean round's count (they are all the same; `rounds` shows them)."""
        return min(self.rounds)


def measure(program: Path, rounds: int = 50, by_function: bool = False, timeout: float = 120) -> RoundTrips:
    """`rounds` clean getpid round trips of `program` (getpids.c as built), counted exactly."""
    image = KernelImage.load(VMLINUX)
    machine = Machine(image, cpus=1)
    archive = Archive()
    inside = archive.add_program(program)
    machine.processes.load_archive(archive.pack())
    entry = image.address_of("entry_SYSCALL_64")
    entries: list[tuple[int, int, int]] = []  # (instruction count, deliveries so far, the call's number)

    def on_entry(uc, _address, _size, _data) -> None:
        entries.append((machine.cpu.counter.value, sum(machine.cpu.delivered.values()), uc.reg_read(X.UC_X86_REG_RAX)))

    machine.uc.hook_add(UC_HOOK_CODE, on_entry, None, entry, entry)
    machine.set_counting(True)
    machine.start()
    per_round: list[Counter[str]] = []
    try:
        machine.processes.spawn(inside, [program.name])
        deadline = time.monotonic() + timeout
        while len(_clean(entries)) < rounds:
            assert time.monotonic() < deadline, f"too few clean rounds: {len(_clean(entries))} of {rounds}"
            assert not machine.processes.exited(), machine.console_text()[-2000:]
            time.sleep(0.05)
        if by_function:
            per_round = _by_function(machine, image, entry, deadline)
    finally:
        machine.shutdown()
    result = RoundTrips(_clean(entries))
    if per_round:
        result.by_function = min(per_round, key=lambda counts: sum(counts.values()))
        assert sum(result.by_function.values()) == result.instructions, (result.by_function, result.rounds)
    return result


def _clean(entries: list[tuple[int, int, int]]) -> list[int]:
    """The instructions from one getpid's entry to the next one's, where nothing was delivered in between."""
    return [b[0] - a[0] for a, b in zip(entries, entries[1:])
            if a[2] == b[2] == NR_GETPID and a[1] == b[1]]


def _by_function(machine: Machine, image: KernelImage, entry: int, deadline: float) -> list[Counter[str]]:
    """A few rounds' instructions per function (user code as one), each round from one entry to the next, a round
    with a delivery left out: a Python hook on every instruction, for as long as it takes."""
    names: dict[int, str] = {}
    rounds: list[Counter[str]] = []
    state = {"round": None, "delivered": 0}

    def on_instruction(_uc, address, _size, _data) -> None:
        delivered = sum(machine.cpu.delivered.values())
        if address == entry:
            if state["round"] is not None and state["delivered"] == delivered:
                rounds.append(state["round"])
            state["round"], state["delivered"] = Counter(), delivered
        if state["round"] is None:
            return
        name = names.get(address)
        if name is None:
            function = image.function_at(address) if address >= 1 << 63 else None
            name = names[address] = function.name if function else (USER if address < 1 << 47 else hex(address))
        state["round"][name] += 1

    def install(uc) -> object:
        hook = uc.hook_add(UC_HOOK_CODE, on_instruction, None, 1, 0)
        uc.ctl_flush_tb()
        return hook

    hook = machine.run_on_cpu(install)
    try:
        while len(rounds) < 5:
            assert time.monotonic() < deadline, "too few clean rounds under the per-instruction hook"
            time.sleep(0.05)
    finally:
        machine.run_on_cpu(lambda uc: uc.hook_del(hook))
    return rounds


def main() -> None:
    import sys
    import tempfile

    from ..programs import compile_program

    with tempfile.TemporaryDirectory() as out:
        program = compile_program("getpids", "glibc-static", Path(out))
        result = measure(program, by_function="--quiet" not in sys.argv)
    print(f"getpid round trip: {result.instructions} instructions ({len(result.rounds)} clean rounds, "
          f"{len(set(result.rounds))} distinct count(s))")
    for name, count in result.by_function.most_common():
        print(f"  {count:5d}  {name}")


if __name__ == "__main__":
    main()
