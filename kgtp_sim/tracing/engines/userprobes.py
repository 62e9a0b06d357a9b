"""Tracepoints in a program (the gdbserver role's process): an int3 in the program's own memory, its hit on the
Python path, and the probed instruction run in place; a fast tracepoint (`ftrace`): a 5-byte jump into a jump pad.

The int3 is written into the program's page (its private copy: another process running the same code at the
same address has no int3 there), so only the program hits it; the handler still checks the address space the
CPU has loaded, and an int3 of another space at that address (that program's own) goes to the kernel as the #BP
it is. At a hit the location's condition and actions run as any int3 location's (hits.interpreted_hit, reading
memory through the program's space); then the probed instruction runs where it is: the original byte goes back,
the CPU steps that one instruction with interrupts off (EFLAGS.TF set and IF cleared, as Linux's kprobes single-step:
the scheduler switches no CPU while TF is set and delivers no interrupt while IF is clear, so no other CPU runs
meanwhile, as the machine runs one CPU at a time, and no tick enters the kernel, which could switch to another
thread of the program that would run the lifted int3's place unseen), and the #DB after it puts the int3 back and
IF as it was. That is the interpreting engine's path, and the compiled engines' fallback (below).

Under the naive and optimizing engines a location runs compiled (`_install_compiled`) unless it needs Python
(installer.py: while-stepping, a computed variable the detour cannot refresh, a shared address), its instruction
enters the kernel or cannot be relocated, or no pad area is within reach; a tracepoint added during the run at
its address moves it to the Python path, beside the newcomer (installer.py). Its pad (patching/userpad.py), in the
process's jump pad area, is reached by the jump over the instruction (`ftrace`) or by the int3 (`trace`), which the
machine's native int3 table sends to the pad only in the program's own address space and never under a single
step (machine/dispatch.py; otherwise `_compiled_trap`, in Python). Under the optimizing engine a condition on
registers only is decided in the pad, in ring 3 (a false one counted there, on the area's last page); otherwise the
pad's `lcall` through the location's call gate (machine/gates.py) enters its detour in ring 0 (the condition, the
actions, the frame, the kernel's detour code built `from_user`), which goes back by `lretq`; the pad then runs the
instruction relocated and jumps back after it. No Python runs per hit. A debugger's single step never runs the pad's
own code from its start: a step of the jump, or of the int3, takes the hit in Python and goes on at the relocated
instruction. A task the debugger stopped inside a pad (its breakpoint there) steps out of it in one step, ending
after the probed instruction (`_debug_trap`: the pad's popfq keeps the step's TF, and a step of the `lcall` runs the
detour to its return, machine/gates.py's `step_through`). Once the run took the pad out, a step there is one
instruction, as anywhere in the program, the gate's bare return included (gates.py).

While-stepping (hits.Stepper) steps the program the same way: its steps run the instruction in place (the step in
place here stands aside), in ring 3, with the program's own byte lifted and the int3 put back in the program's
space when they end, and the #DB hook of before the steps back. A hit taken while a debugger single-steps the
program (TF already set) records its frame and no steps: the debugger's step keeps TF.

The int3 and the byte under it are recorded in the machine's one record of a process's int3s (machine/int3s.py),
shared with the debugger's breakpoints (`Z0`): a `trace` and a `break` at one address, set and removed in any
order, never write the real byte over the other's int3, nor leave a stray int3. When GDB has a breakpoint at the
tracepoint too, the hit collects, then the int3 goes to the kernel as the program's #BP (gdbserver reports a
breakpoint after running the tracepoints there): the program stops at its breakpoint, and the same task going on
from that stop (GDB steps it over the breakpoint, the tracepoint's int3 still there) collects nothing more.

A fast tracepoint replaces its instruction (GDB allows one of 5 bytes or more: qTMinFTPILen) with a `jmp rel32` to
a pad of its own in a jump pad area of the process (mapped by the process itself within the jump's reach:
UserSpace.prepare, fixtures/kernel/jumppad.c), as gdbserver's fast tracepoints do. The pad is: an int3, by which
the hit enters the tracer (the same Python hit path as an int3 tracepoint's: the condition, the actions, the frame
with the PC at the tracepoint), then the displaced instruction relocated to run there (patching/probes.py's
`relocate`: RIP-relative operands and branches fixed), then a jump back after it. So the program never runs an int3
at the tracepoint itself, and nothing is stepped. A pad is never reused for other code (a thread preempted inside
it may come back to it): the same instruction at the same address finds its old pad again. A debugger's single
step of the jump (ptrace's TF) would stop inside the pad: while jumps are in, the #DB of a step that lands in a pad
runs the hit there and lets the step go on through the pad, so it ends after the relocated instruction, where the
step of the original instruction would have ended. A jump in code the program has unmapped since (a library it
closed while the trace ran) is not written back over at removal: the pages went with the library.

A fork copies the program's memory, probes and pads included: the machine takes the int3s out of the child's copy
(machine/int3s.py), and the jumps go too (`forked`, told by the machine while sites are in), so a fork child never
gets the run's tracepoints: it runs its instructions and collects nothing, as gdbserver's fork child gets no fast
tracepoint jumps. An exec replaces the program's memory: its sites are forgotten (`gone`), never written again
(the space's tables may soon be another's); their locations stay in the run, hitting nothing.

Why this module is long: it is every way a program's tracepoint is hit (an int3 stepped in place, a fast
tracepoint's pad, a compiled pad and its gate), with the forks, execs and debugger steps each must survive, and
they share one record of a site, one #DB handler and the pads' areas.

Owns the program's int3 sites (address -> the byte they replace, the locations sharing them), which task last
stopped at its breakpoint over one, and the compiled pads. Runs on the CPU
thread: install and remove under the tracer's run changes, the handlers inside the int3 and #DB hooks, the fork and
exec notices inside the kernel's port write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from unicorn import Uc
from unicorn import x86_const as X

from ...machine import MachineError, MemoryFault, smp
from ...machine.int3s import DEBUGGER, TRACER
from ..core.model import TraceError
from ..core.run import Run
from ..patching.placement import Installed
from ..patching.probes import INT3, JUMP_SIZE, ProbePlacementError, ProbeSite, decode, enters_kernel, jump, relocate
from ..patching.probes import relocated_size_bound
from ..patching.detour import COUNTERS
from ..patching.userpad import PadCondition, build_pad, pad_size_bound
from .hits import EFLAGS_IF, EFLAGS_TF, interpreted_hit

PAGE = 0x1000
_POPFQ = b"\x9d"


@dataclass(frozen=True)
class Compiled:
    """What the installer hands a program's location that may run compiled: the run's compiled engine
    (native.CompiledRun), how to build the location's detour (entered from its pad: `from_user`), and its condition
    as the pad's ring-3 branch (or None)."""

    native: Any
    build: Any  #: () -> native.NativeProbe
    condition: PadCondition | None


@dataclass
class _Site:
    original: bytes  #: what the probe replaced: one byte under an int3, five under a fast tracepoint's jump
    items: list[Installed] = field(default_factory=list)
    pad: int = 0  #: a fast tracepoint's: its pad, whose first byte is the int3 the hit takes
    displaced_at: int = 0  #: a fast tracepoint's: its address (the instruction the pad runs)
    #: an int3 site's over an instruction that enters the kernel: where that instruction runs after a hit, out of
    #: line in a pad (its relocated copy and a jump back), instead of being stepped in place
    out_of_line: int = 0
    #: a compiled hit (`_install_compiled`): its pad's call gate (machine/gates.py), the pad's relocated
    #: instruction, the pad's count of false conditions, and how the program reaches the pad (a jump or the int3)
    compiled: bool = False
    gate: int = 0
    tail: int = 0
    fired_at: int = 0
    jump: bool = False


class ProgramProbes:
    """The int3s of the run's tracepoints in its program (`Run.user_space`)."""

    def __init__(self, tracer: Run) -> None:
        self.tracer = tracer
        self.machine = tracer.machine
        self.int3s = tracer.machine.int3s  #: the bytes under the int3s, the debugger's and ours (machine/int3s.py)
        self.sites: dict[int, _Site] = {}
        #: address -> the tasks whose hit there was delivered to the program as the debugger's breakpoint: the
        #: resumption of each from that stop runs the int3 again, and is not a new hit (several threads may stop
        #: there before any goes on: all-stop reports one and keeps the others' stops pending)
        self._reported: dict[int, set[int]] = {}
        self._stepping: tuple[int, Any] | None = None  # (the site being stepped over, the debug trap before ours)
        self._stepped_by_debugger = False  # TF was the debugger's when the int3 trapped
        self._interrupts_were_on = False  # IF when the int3 trapped (cleared for the step in place)
        #: fast tracepoints' pads: (space root, address, instruction) -> pad; and each area's next free byte
        self._pads: dict[tuple[int, int, bytes], int] = {}
        self._pad_ends: dict[int, int] = {}
        self._pad_used: dict[int, int] = {}
        #: pad -> (its end, its site) while the site's jump is in; `_debug_trap` sees them while any is
        self._live_pads: dict[int, tuple[int, _Site]] = {}
        self._previous_trap: Any = None
        #: compiled pads: (space root, address, instruction, condition) -> (pad, end, gate, fired counter, tail)
        self._compiled_pads: dict[tuple, tuple[int, int, int, int, int]] = {}
        self._counters_used: dict[int, int] = {}  #: pad area -> bytes of its last page given to pads' counters

    def install(self, item: Installed, compiled: Compiled | None = None) -> None:
        address = item.site.address
        site = self.sites.get(address)
        assert site is None or not site.compiled, "a compiled location leaves its pad first (installer)"
        if site is None and compiled is not None and not item.tracepoint.step_count and \
                self._install_compiled(item, compiled):
            return
        if site is None and item.want_jump:
            self._install_jump(item)
            return
        if site is None:
            first = not self.int3s.holders(item.space, address)
            under = self.int3s.hold(item.space, address, TRACER)
            if under is None:
                raise TraceError(f"tracepoint {item.tracepoint.number} at {address:#x}: no memory of the program there")
            if first:
                self._drop_code(self.machine.cpu.uc, item.space, address)
            site = self.sites[address] = _Site(bytes([under]))
            site.out_of_line = self._out_of_line(item, address)
            self.machine.breakpoints[address] = lambda uc, site=site, address=address: self._hit(uc, address, site)
        self._watch()
        if site.pad and item.tracepoint.step_count:
            raise TraceError(f"tracepoint {item.tracepoint.number} at {address:#x}: while-stepping needs "
                             "single-stepping, and the fast tracepoint here runs its instruction in a jump pad")
        item.out_of_line = site.pad + len(INT3) if site.pad else address  # the instruction runs in place
        if not site.pad:  # the byte under the int3, which while-stepping puts back for its steps
            item.site = ProbeSite(address, "(program)", "int3", (), site.original)
        site.items.append(item)

    def _install_jump(self, item: Installed) -> None:
        """A fast tracepoint: its pad written, then the jump to it over its instruction (another tracepoint at the
        address later shares the pad's hit)."""
        tp, space, address = item.tracepoint, item.space, item.site.address
        where = f"fast tracepoint {tp.number} at {address:#x}"
        length = tp.fast_insn_length or 0
        try:  # the longest instruction, unless the next page is not there (then what GDB says it has)
            code = self.machine.read_memory(address, 15, space=space)
        except MemoryFault:
            try:
                code = self.machine.read_memory(address, max(length, JUMP_SIZE), space=space)
            except MemoryFault:
                raise TraceError(f"{where}: no memory of the program there") from None
        code = self.int3s.hide(space, address, code)  # a breakpoint's int3 there hides the instruction
        instructions = decode(code, address)
        if not instructions:
            raise TraceError(f"{where}: no instruction there")
        insn = instructions[0]
        if insn.size < JUMP_SIZE:  # GDB refuses it first (qTMinFTPILen), unless asked not to check
            raise TraceError(f"{where}: the instruction is {insn.size} bytes long, the jump needs {JUMP_SIZE}")
        pad = self._pad_for(item, insn, where)
        original = code[:JUMP_SIZE]
        site = self.sites[address] = _Site(original, pad=pad, displaced_at=address)
        self.machine.breakpoints[pad] = lambda uc, site=site, address=address: self._hit(uc, address, site)
        cpu = self.machine.cpu
        if not self._live_pads and cpu.debug_trap != self._debug_trap:
            self._previous_trap, cpu.debug_trap = cpu.debug_trap, self._debug_trap
        self._live_pads[pad] = (self._pad_ends[pad], site)
        self._watch()
        self._write(space, address, jump(address, pad))
        item.site = ProbeSite(address, "(program)", "jump", (insn,), original)
        item.out_of_line = pad + len(INT3)
        site.items.append(item)

    # ---- compiled hits ----------------------------------------------------------------------------------

    def _install_compiled(self, item: Installed, compiled: Compiled) -> bool:
        """The location's hit compiled: a pad of its own (patching/userpad.py) that the jump over its instruction
        (`ftrace`) or its int3 (`trace`, sent on by the machine's native int3 table) leads to, whose call gate enters
        the detour. False when it cannot be (no pad area within reach, an instruction that cannot run elsewhere, no
        gate): then the Python path serves it."""
        tp, space, address = item.tracepoint, item.space, item.site.address
        where = f"tracepoint {tp.number} at {address:#x}"
        try:
            code = self.machine.read_memory(address, 15, space=space)
        except MemoryFault:
            return False  # the last bytes of the program's code: the Python path reads what is there
        code = self.int3s.hide(space, address, code)
        instructions = decode(code, address)
        if not instructions or (item.want_jump and instructions[0].size < JUMP_SIZE) or enters_kernel(code):
            return False
        insn = instructions[0]
        user = self.tracer.user_space
        area = user.pad_area(address) if user is not None else None
        if area is None:
            return False
        try:
            relocate((insn,), area[0])
        except ProbePlacementError:
            return False
        condition = compiled.condition
        key = (space.root, address, insn.code, item.condition.code if condition is not None else None)
        uc = self.machine.cpu.uc
        original = code[:JUMP_SIZE] if item.want_jump else code[:1]
        if not item.want_jump:
            first = not self.int3s.holders(space, address)
            if self.int3s.hold(space, address, TRACER) is None:
                return False
            if first:
                self._drop_code(uc, space, address)
        probe = compiled.build()
        probe.kind = "jump" if item.want_jump else "int3"
        try:
            cached = self._compiled_pads.get(key)
            if cached is not None:  # the same instruction again: its pad, its gate to the new detour
                pad, end, gate, fired_at, tail = cached
                self.machine.gates.retarget(uc, gate, probe.detour.base)
                self._write(space, fired_at, bytes(8))
            else:
                pad, end, gate, fired_at, tail = self._compiled_pad(item, insn, condition, probe.detour.base, where)
                self._compiled_pads[key] = (pad, end, gate, fired_at, tail)
        except (TraceError, MachineError):
            compiled.native.release(probe)
            item.native = None
            if not item.want_jump and self.int3s.release(space, address, TRACER):
                self._drop_code(uc, space, address)
            return False
        site = self.sites[address] = _Site(original, [item], pad=pad, displaced_at=address, compiled=True,
                                           gate=gate, tail=tail, fired_at=fired_at, jump=item.want_jump)
        cpu = self.machine.cpu
        if not self._live_pads and cpu.debug_trap != self._debug_trap:
            self._previous_trap, cpu.debug_trap = cpu.debug_trap, self._debug_trap
        self._live_pads[pad] = (end, site)
        # from the pad's first instruction to the probed instruction's end, no other CPU and no interrupt, as the
        # Python path's hit and step: a thread is never stopped half way, with its hit counted (in the pad's count,
        # or the detour's frame) and its call not yet made, nor switched out there while the run changes
        self.machine.cpu.process_stub_code.append((pad, end, space.root))
        self._watch()
        item.out_of_line = tail
        if item.want_jump:
            self._write(space, address, jump(address, pad))
            item.site = ProbeSite(address, "(program)", "jump", (insn,), original)
        else:
            self.machine.breakpoints[address] = lambda uc, site=site, address=address: \
                self._compiled_trap(uc, address, site)
            item.site = ProbeSite(address, "(program)", "int3", (insn,), original)
            self._sync_native(site)
        return True

    def _compiled_pad(self, item: Installed, insn: Any, condition: PadCondition | None, detour: int,
                      where: str) -> tuple[int, int, int, int, int]:
        """A new pad (its gate to `detour`, its counter on the area's last page): (pad, end, gate, counter,
        tail)."""
        start, size = self.tracer.user_space.pad_area(insn.address)
        used = self._pad_used.get(start, 0)
        room = (pad_size_bound(relocated_size_bound((insn,)), condition, start) + 15) & ~15
        counters = self._counters_used.get(start, 0)
        if used + room > size - PAGE or counters + 8 > PAGE:
            raise TraceError(f"{where}: the jump pad area at {start:#x} is full")
        pad, fired_at = start + used, start + size - PAGE + counters
        gate = self.machine.gates.add(self.machine.cpu.uc, detour)
        body = build_pad(pad, insn, gate, fired_at, condition)
        assert len(body.code) <= room
        self._write(item.space, pad, body.code)
        self._write(item.space, fired_at, bytes(8))
        self._pad_used[start] = used + room
        self._counters_used[start] = counters + 8
        return pad, pad + len(body.code), gate, fired_at, body.tail

    def _sync_native(self, site: _Site) -> None:
        """A compiled int3's entry in the machine's native table: there unless the debugger holds the int3 too
        (then its hit goes to `_compiled_trap`, which reports the breakpoint after collecting), nor while a task
        that stopped at that breakpoint has not gone past it yet."""
        space, address = site.items[0].space, site.displaced_at
        jumps = self.machine.cpu.jumps
        if DEBUGGER in self.int3s.holders(space, address) or self._reported.get(address):
            jumps.remove(address)  # (a task going on from the breakpoint's stop collects nothing: `_compiled_trap`)
        else:
            jumps.set(address, site.pad, space.root)

    def compiled_at(self, address: int) -> Installed | None:
        """The location running compiled at `address`, if one does."""
        site = self.sites.get(address)
        return site.items[0] if site is not None and site.compiled else None

    def holders_changed(self, space: Any, address: int) -> None:
        site = self.sites.get(address)
        if site is not None and site.compiled and not site.jump and self._in(site, space):
            self._sync_native(site)

    def counters(self, item: Installed) -> tuple[int, int, int]:
        """(fired, hits, bytes) of a program's compiled location: its detour's counters and its pad's count of false
        conditions."""
        site = self.sites.get(item.site.address)
        if site is None or not site.compiled or item not in site.items or item.native is None:
            return item.fired, item.hits, item.usage
        fired, hits, usage = self.tracer.native.counters(item.native)
        try:
            fired += int.from_bytes(self.machine.read_memory(site.fired_at, 8, space=item.space), "little")
        except MemoryFault:
            pass
        return fired, hits, usage

    def _python_hit(self, uc: Uc, site: _Site) -> None:
        """A compiled location's hit on the Python path (a debugger's step, its breakpoint at the same place, no
        native int3 table), counted in its detour's counters; RIP at the pad's relocated instruction."""
        item = site.items[0]
        probe = item.native
        fired, hits, usage, _ = COUNTERS.unpack(bytes(uc.mem_read(probe.counters, COUNTERS.size)))
        item.fired, item.hits, item.usage = fired, hits, usage
        interpreted_hit(self.tracer, uc, item, may_step=False)
        uc.mem_write(probe.counters, COUNTERS.pack(item.fired, item.hits, item.usage, 0))

    def _compiled_trap(self, uc: Uc, address: int, site: _Site) -> None:
        """The int3 of a compiled location that the native table did not send on: another space's int3 at this
        address (the kernel's #BP, as without us), a step of the program's (TF), the debugger's breakpoint there
        too (collected, then reported, as `_hit` does), or a machine without native hooks."""
        space = site.items[0].space if site.items else None
        if space is None or uc.reg_read(X.UC_X86_REG_CR3) & ~0xFFF != space.root:
            uc.reg_write(X.UC_X86_REG_RIP, address + len(INT3))
            self.machine.cpu.deliver(3)
            return
        task = smp.current_task(uc)
        breakpoint = DEBUGGER in self.int3s.holders(space, address)
        if task not in self._reported.get(address, ()):
            self._python_hit(uc, site)
        if breakpoint:
            self._reported.setdefault(address, set()).add(task)
            uc.reg_write(X.UC_X86_REG_RIP, address + len(INT3))
            self.machine.cpu.deliver(3)
            return
        reported = self._reported.get(address, set())
        if task in reported:
            reported.discard(task)
            self._sync_native(site)
        uc.reg_write(X.UC_X86_REG_RIP, site.tail)  # a step (TF) goes on through the pad: `_debug_trap`

    def _remove_compiled(self, item: Installed, site: _Site, gone: bool = False) -> None:
        """The location's way into its pad out (not when the space is `gone`), its gate back to its caller: a
        thread still in the pad runs its instruction and goes on; its counters kept in the item."""
        address, space = site.displaced_at, item.space
        item.fired, item.hits, item.usage = self.counters(item)
        self.sites.pop(address, None)
        end = self._live_pads.pop(site.pad, (0, None))[0]
        cpu = self.machine.cpu
        if not self._live_pads and cpu.debug_trap == self._debug_trap:
            cpu.debug_trap, self._previous_trap = self._previous_trap, None
        self.machine.gates.retarget(cpu.uc, site.gate, None)
        if (site.pad, end, space.root) in cpu.process_stub_code:
            cpu.process_stub_code.remove((site.pad, end, space.root))
        if self.tracer.native is not None and item.native is not None:
            self.tracer.native.release(item.native)
        if site.jump:
            if not gone and self._jump_there(space, address, site.pad):
                self._write(space, address, site.original)
        else:
            self.machine.cpu.jumps.remove(address)
            self.machine.breakpoints.pop(address, None)
            self._reported.pop(address, None)
            if not gone and self.int3s.release(space, address, TRACER):
                self._drop_code(cpu.uc, space, address)
        self._watch()

    def _out_of_line(self, item: Installed, address: int) -> int:
        """Where an instruction that enters the kernel (`syscall`...) runs after its int3's hit: its pad's copy
        (UserSpace.prepare mapped an area within reach for it), as Linux's uprobes run every probed instruction out
        of line; 0 for any other instruction, or with no pad area (then it is stepped in place)."""
        try:
            code = self.int3s.hide(item.space, address, self.machine.read_memory(address, 2, space=item.space))
        except MemoryFault:
            return 0
        if not enters_kernel(code):
            return 0
        instructions = decode(code + bytes(13), address)[:1]
        try:
            return self._pad_for(item, instructions[0], f"tracepoint {item.tracepoint.number} at {address:#x}") + \
                len(INT3) if instructions else 0
        except TraceError:
            return 0

    def _pad_for(self, item: Installed, insn: Any, where: str) -> int:
        """The pad of `insn` (its old one, else a new one in the area within reach): int3, the instruction
        relocated, the jump back."""
        key = (item.space.root, insn.address, insn.code)
        pad = self._pads.get(key)
        if pad is not None:
            return pad
        user = self.tracer.user_space
        area = user.pad_area(insn.address) if user is not None else None
        if area is None:
            raise TraceError(f"{where}: no jump pad area within reach")
        start, size = area
        used = self._pad_used.get(start, 0)
        room = (len(INT3) + relocated_size_bound((insn,)) + JUMP_SIZE + 15) & ~15
        if used + room > size - PAGE:  # (the last page: compiled pads' counters)
            raise TraceError(f"{where}: the jump pad area at {start:#x} is full")
        pad = start + used
        try:
            body = INT3 + relocate((insn,), pad + len(INT3))
            body += jump(pad + len(body), insn.end)
        except ProbePlacementError as error:
            raise TraceError(f"{where}: could not relocate the instruction to its jump pad: {error}") from None
        self._write(item.space, pad, body)
        self._pad_used[start] = used + room
        self._pads[key] = pad
        self._pad_ends[pad] = pad + len(body)
        return pad

    def remove(self, item: Installed) -> None:
        address = item.site.address
        site = self.sites.get(address)
        if site is None or item not in site.items:
            return
        if site.compiled:
            self._remove_compiled(item, site)
            return
        site.items.remove(item)
        if site.items:
            return
        del self.sites[address]
        self._watch()
        if site.pad:  # the jump out; the pad stays (a thread may still be in it)
            # a thread that took the jump and was switched out before the pad's int3 goes back to the
            # instruction's own place when it comes (as a uprobe's int3 removed under a thread): no probe there now
            root, pad = item.space.root, site.pad
            self.machine.breakpoints[pad] = lambda uc: self._dead_pad(uc, root, pad, address)
            self._live_pads.pop(site.pad, None)
            cpu = self.machine.cpu
            if not self._live_pads and cpu.debug_trap == self._debug_trap:
                cpu.debug_trap, self._previous_trap = self._previous_trap, None
            if self._jump_there(item.space, address, site.pad):
                self._write(item.space, address, site.original)
            return
        self.machine.breakpoints.pop(address, None)  # a breakpoint still there is the program's #BP again
        self._reported.pop(address, None)
        # the byte back unless the debugger's breakpoint holds the int3 too (a step in place under way: lifted)
        if self.int3s.release(item.space, address, TRACER) and (self._stepping is None or
                                                                self._stepping[0] != address):
            self._drop_code(self.machine.cpu.uc, item.space, address)

    def _dead_pad(self, uc: Uc, root: int, pad: int, address: int) -> None:
        """The int3 of a pad whose jump was taken out, reached by a thread that jumped there before: on at the
        probed instruction's own address (its original bytes, or whatever probe is there now). Another space's
        int3 at that address is the kernel's #BP, as without us."""
        if uc.reg_read(X.UC_X86_REG_CS) & 3 and uc.reg_read(X.UC_X86_REG_CR3) & ~0xFFF == root:
            uc.reg_write(X.UC_X86_REG_RIP, address)
            return
        uc.reg_write(X.UC_X86_REG_RIP, pad + len(INT3))
        self.machine.cpu.deliver(3)

    def _jump_there(self, space: Any, address: int, pad: int) -> bool:
        """Whether the program's memory at `address` still holds the jump to `pad` (a debugger's int3 over part of
        it seen through). Not when the code is gone: a library the program closed (dlclose) while the trace ran
        takes its pages, and the jump, with it, and what is mapped there later is not the tracer's to write over
        (the int3s' record drops such a site likewise: machine/int3s.py)."""
        try:
            code = self.machine.read_memory(address, JUMP_SIZE, space=space)
        except MemoryFault:
            return False
        return self.int3s.hide(space, address, code) == jump(address, pad)

    # ---- forks and execs of the program (machine/int3s.py's watchers) ----------------------------------

    def _watch(self) -> None:
        """Told of forks and execs while any site is in."""
        watching = self in self.int3s.watchers
        if self.sites and not watching:
            self.int3s.watchers.append(self)
        elif not self.sites and watching:
            self.int3s.watchers.remove(self)

    def _in(self, site: _Site, space: Any) -> bool:
        return bool(site.items) and site.items[0].space.root == space.root

    def forked(self, parent: Any, child: Any) -> None:
        """A fork copied the program's memory into `child` (not run yet): its fast tracepoints' jumps out of the copy
        (the int3s are the machine's to take out); the pads stay there, unused."""
        for address, site in self.sites.items():
            if site.pad and self._in(site, parent):
                self.int3s.write(child, address, site.original)

    def gone(self, space: Any) -> None:
        """The program's space is going (it exec'd): its sites forgotten, nothing of them written again."""
        for address, site in list(self.sites.items()):
            if not self._in(site, space):
                continue
            if site.compiled:
                self._remove_compiled(site.items[0], site, gone=True)
                self._pad_ends.pop(site.pad, None)
                continue
            del self.sites[address]
            self.machine.breakpoints.pop(site.pad or address, None)
            self._reported.pop(address, None)
            if site.pad:
                self._live_pads.pop(site.pad, None)
                self._pad_ends.pop(site.pad, None)
        cpu = self.machine.cpu
        if not self._live_pads and cpu.debug_trap == self._debug_trap:
            cpu.debug_trap, self._previous_trap = self._previous_trap, None
        for key, pad in self._pads.items():
            if key[0] == space.root:  # the pads went with the space: no handler of theirs stays
                self.machine.breakpoints.pop(pad, None)
        self._pads = {key: pad for key, pad in self._pads.items() if key[0] != space.root}
        self._compiled_pads = {key: pad for key, pad in self._compiled_pads.items() if key[0] != space.root}
        self._watch()

    # ---- the CPU thread, inside emulation ---------------------------------------------------------------

    def _write(self, space: Any, address: int, data: bytes) -> None:
        """`data` into the program's present pages (a debugger's int3 there stays over it: machine/int3s.py), and
        its translated code dropped."""
        if not self.int3s.write(space, address, data):
            raise TraceError(f"{address:#x}: no memory of the program there")
        self._drop_code(self.machine.cpu.uc, space, address, len(data))

    def _debug_trap(self, uc: Uc) -> None:
        """A #DB while fast tracepoints' jumps are in: a debugger's single step that landed in a pad goes on
        through it (its hit taken at the pad's int3), ending after the relocated instruction; anything else is
        what it was without us (the trap before ours, or the kernel's #DB)."""
        rip = uc.reg_read(X.UC_X86_REG_RIP)
        for pad, (end, site) in self._live_pads.items():
            if pad <= rip < end and uc.reg_read(X.UC_X86_REG_CS) & 3:
                space = site.items[0].space if site.items else None
                if space is not None and uc.reg_read(X.UC_X86_REG_CR3) & ~0xFFF == space.root:
                    if rip == pad and site.compiled:  # a step of the jump: the hit here, the gate skipped
                        self._python_hit(uc, site)
                    elif rip == pad:
                        self._hit(uc, site.displaced_at, site)
                    elif site.compiled and rip < site.tail and bytes(uc.mem_read(rip, 1)) == _POPFQ:
                        # a step that began inside the pad (the debugger stopped the task there): the pad's popfq
                        # would load the flags it saved before the step, TF clear, and the step would never end
                        rsp = uc.reg_read(X.UC_X86_REG_RSP)
                        flags = int.from_bytes(uc.mem_read(rsp, 8), "little")
                        uc.mem_write(rsp, (flags | EFLAGS_TF).to_bytes(8, "little"))
                    return  # TF still set: the next instruction of the pad traps again
        previous = self._previous_trap
        if previous is not None:
            previous(uc)
        else:
            self.machine.cpu.deliver(1)

    def _hit(self, uc: Uc, address: int, site: _Site) -> None:
        space = site.items[0].space if site.items else None
        trap = site.pad or address
        if space is None or uc.reg_read(X.UC_X86_REG_CR3) & ~0xFFF != space.root:
            # not the program's int3 (another space has its own byte here): the kernel's #BP, as without us
            uc.reg_write(X.UC_X86_REG_RIP, trap + len(INT3))
            self.machine.cpu.deliver(3)
            return
        if site.pad:  # the hit in the pad, then on through it: the relocated instruction, the jump back
            for item in list(site.items):
                interpreted_hit(self.tracer, uc, item, may_step=False)
            uc.reg_write(X.UC_X86_REG_RIP, site.pad + len(INT3))
            return
        task = smp.current_task(uc)
        breakpoint = DEBUGGER in self.int3s.holders(space, address)  # GDB's Z0 at the tracepoint too
        resumed = task in self._reported.get(address, ())  # from the stop of that breakpoint: collected already
        stepper = self.tracer.stepper
        stepped_before = stepper.active or bool(uc.reg_read(X.UC_X86_REG_EFLAGS) & EFLAGS_TF)
        if not resumed:
            write = lambda uc, data, space=space: self._put(uc, space, address, lifted=data != INT3)  # noqa: E731
            for item in list(site.items):
                interpreted_hit(self.tracer, uc, item, write_site=write,
                                may_step=not stepped_before and not breakpoint)
        if breakpoint:
            # the debugger's breakpoint: the program's #BP after the collection (gdbserver reports the stop after
            # running the tracepoint's actions), and the same task going on from that stop is no new hit
            self._reported.setdefault(address, set()).add(task)
            uc.reg_write(X.UC_X86_REG_RIP, address + len(INT3))
            self.machine.cpu.deliver(3)
            return
        self._reported.get(address, set()).discard(task)
        uc.reg_write(X.UC_X86_REG_RIP, address)
        if stepper.active and not stepped_before:
            return  # while-stepping: its steps run the instruction in place, and put the int3 back (hits.Stepper)
        if site.out_of_line and not stepped_before:  # into the kernel from its pad, back after the instruction
            uc.reg_write(X.UC_X86_REG_RIP, site.out_of_line)
            return
        # the probed instruction, in place: the original byte for one step, the int3 again at its #DB
        self._put(uc, space, address, lifted=True)
        cpu = self.machine.cpu
        # TF already set: a ptrace single step of the program, or while-stepping's steps that reached this int3
        eflags = uc.reg_read(X.UC_X86_REG_EFLAGS)
        self._stepped_by_debugger = bool(eflags & EFLAGS_TF)
        self._interrupts_were_on = bool(eflags & EFLAGS_IF)
        self._stepping = (address, cpu.debug_trap)
        cpu.debug_trap = lambda uc, space=space: self._stepped(uc, space)
        uc.reg_write(X.UC_X86_REG_EFLAGS, (eflags | EFLAGS_TF) & ~EFLAGS_IF)

    def _put(self, uc: Uc, space: Any, address: int, lifted: bool) -> None:
        """The byte under a site's int3 into the program's memory for a step in place (`lifted`), or the int3
        back if anyone still holds it (machine/int3s.py), on the CPU thread inside emulation, whatever space the
        CPU has loaded (the step in place or while-stepping may end in another task); translated code dropped."""
        changed = self.int3s.lift(space, address) if lifted else self.int3s.lower(space, address)
        if changed:
            self._drop_code(uc, space, address)

    def _drop_code(self, uc: Uc, space: Any, address: int, length: int = len(INT3)) -> None:
        """The translated code over a site's int3 (or a fast tracepoint's jump) dropped, from a hit (inside
        emulation, the program's space loaded in ring 3 or not: a hit of the program that ends the run takes its
        jumps out there) or between runs."""
        if uc.reg_read(X.UC_X86_REG_CS) & 3 and uc.reg_read(X.UC_X86_REG_CR3) & ~0xFFF == space.root:
            uc.ctl_remove_cache(address, address + length)  # the program's space is loaded: its code is found
        else:
            self.machine.cpu.remove_cache(address, length, space)

    def _stepped(self, uc: Uc, space: Any) -> None:
        assert self._stepping is not None
        address, previous = self._stepping
        self._stepping = None
        self.machine.cpu.debug_trap = previous
        eflags = uc.reg_read(X.UC_X86_REG_EFLAGS) & ~EFLAGS_TF
        uc.reg_write(X.UC_X86_REG_EFLAGS, eflags | (EFLAGS_IF if self._interrupts_were_on else 0))
        self._put(uc, space, address, lifted=False)
        if self._stepped_by_debugger:  # the step was someone else's too: this #DB ends it as theirs
            uc.reg_write(X.UC_X86_REG_EFLAGS, uc.reg_read(X.UC_X86_REG_EFLAGS) | EFLAGS_TF)
            if self.tracer.stepper.active and previous is not None:  # while-stepping's steps: its trap
                previous(uc)
            else:
                self.machine.cpu.deliver(1)
