"""Run control: turn the definitions into probes at tstart, collect frames at each hit, stop for a reason.

This module owns the trace run's state (running, stop reason, trace state variables, the ring buffer, the
installed probes) and answers the questions the packet handlers ask about it. A hit never raises: a failing
condition or action records `terror` on its tracepoint (or is ignored under `$ignore_error`), exactly once,
and the kernel continues as if the probe were not there.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from unicorn import UC_HOOK_CODE, Uc
from unicorn.x86_const import UC_X86_REG_RIP, UC_X86_REG_RSP

from ..agent.abi import CTX_ERROR, CTX_SIZE, CTX_TRACE_PTR, AgentCtx
from ..agent.errors import BytecodeError, ErrorCode, EvalError, UnreadableMemory
from ..agent.interp import evaluate
from ..agent.verify import Program, verify
from ..arch import amd64
from ..machine import Machine, Marker
from ..machine import MemoryFault
from ..rsp.packets import trace as t
from .builtins import BUILTIN_VARIABLES, BuiltinContext
from .clock import Tsc
from .fastregs import RegisterReader
from .detour import COUNTERS
from .native import ENGINES, NativeProbe, CompiledRun, faults_lose_a_block
from .frames import MemoryBlock, StaticBlock, TraceFrame, encode_block, encode_frame
from .sdata import build_entry, render
from .model import Definitions, Tracepoint
from .probes import INT3, ProbePlacementError, ProbeSite, jump, plan_probe, relocate, relocated_size_bound
from .retire import RetiredCode
from .ring import BLOCKS_AT, CTL_BYTES, Ring

log = logging.getLogger(__name__)

#: Bound on the instructions run to let a hit leave the tracer's code before a run changes (a detour with a
#: looping expression under its loop budget stays far below it).
MAX_STEPS_TO_FINISH_A_HIT = 2_000_000
#: Largest memory range one `collect` may record in a frame (GDB never asks for more than 64 KiB at once).
MAX_COLLECT = 0xFFFF


class TraceError(Exception):
    """tstart (or a definition) cannot be honoured; the text reaches the user through GDB."""


@dataclass
class Installed:
    """A tracepoint location armed in the kernel."""

    tracepoint: Tracepoint
    site: ProbeSite
    condition: Program | None
    actions: list[tuple[t.Action, Program | None]]
    out_of_line: int = 0  # interp engine: the relocated copy of the probed instruction
    native: NativeProbe | None = None  # compiled engines: the detour and its counters
    want_jump: bool = False
    stepping: list[tuple[t.Action, Program | None]] = field(default_factory=list)
    marker: Marker | None = None  # static tracepoints: the TRACE_EVENT site they enable
    shared: bool = False  # another tracepoint has the same address: both run from one int3, in Python
    fired: int = 0
    hits: int = 0
    usage: int = 0


class MachineMemory:
    """Ring memory access through the machine (coherent, from any thread)."""

    def __init__(self, machine: Machine) -> None:
        self.machine = machine

    def read(self, address: int, length: int) -> bytes:
        return self.machine.read_memory(address, length)

    def write(self, address: int, data: bytes) -> None:
        # ring memory is data: no translated code to drop, unlike machine.write_memory
        self.machine.run_on_cpu(lambda uc: uc.mem_write(address, data))


@dataclass
class HitContext:
    """What one evaluation of agent bytecode sees at a hit: live memory, the hit's registers, trace variables."""

    uc: Uc
    regs: list[int]
    tracer: Tracer
    blocks: list[bytes] = field(default_factory=list)
    room: int = MAX_COLLECT * 4
    marker: Marker | None = None

    def try_read(self, addr: int, n: int) -> bytes | None:
        try:
            return self.read_memory(addr, n)
        except UnreadableMemory:
            return None

    def read_memory(self, addr: int, n: int) -> bytes:
        # Through the machine, not uc.mem_read: absent demand pages read as zeros from unicorn but must fault.
        try:
            return self.tracer.machine.read_memory(addr, n)
        except MemoryFault:
            raise UnreadableMemory(addr, n) from None

    def register(self, n: int) -> int:
        return self.regs[n] if n < len(self.regs) else 0

    def tsv_get(self, n: int) -> int:
        return self.tracer.variable_value(n, self) or 0

    def tsv_set(self, n: int, value: int) -> None:
        self.tracer.set_variable(n, value)

    def trace_room(self) -> int | None:
        return self.room - sum(len(b) for b in self.blocks)

    def trace_block(self, block: bytes) -> None:
        self.blocks.append(block)

    def printf(self, text: str) -> None:
        self.tracer.printed.append(text)
        log.info("tracepoint printf: %s", text.rstrip("\n"))


class Tracer:
    def __init__(self, machine: Machine, engine: str = "opt", probe: str = "auto") -> None:
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}")
        if probe not in ("auto", "int3"):
            raise ValueError("probe must be 'auto' (a jump where safe) or 'int3'")
        self.machine = machine
        self.engine = engine
        #: "auto": compiled engines jump to their detour where it is safe (optimized kprobes); "int3": always
        #: trap into it (plain kprobes), e.g. to measure the difference. ftrace always needs the jump.
        self.probe = probe
        self.native: CompiledRun | None = None
        self._retired = RetiredCode(machine)
        self.definitions = Definitions()
        self.running = False
        self.stop_reason = t.StopReason.NOT_RUN
        self.stop_note: str | None = None
        self.stopping_tracepoint = 0
        self.start_time: int | None = None
        self.stop_time: int | None = None
        self.values: dict[int, int] = {}
        self.installed: dict[tuple[int, int], Installed] = {}
        self._stopped_installed: dict[tuple[int, int], Installed] = {}
        self._stepper: int | None = None  # code hook while a hit is being single-stepped
        self._room = 4 * MAX_COLLECT
        #: address -> (out-of-line copy, its end, the tracepoints sharing the int3)
        self._int3_sites: dict[int, tuple[int, int, list[Installed]]] = {}
        self._frames_cache: tuple[tuple[int, int, int, int], list[TraceFrame]] | None = None
        self.ring: Ring | None = None
        self._ring_memory: tuple[int, int] | None = None
        self.printed: list[str] = []
        self.tsc = Tsc()
        self._registers = RegisterReader()
        for variable in BUILTIN_VARIABLES:
            self.definitions.variables[variable.number] = variable.definition()

    # ---- trace state variables --------------------------------------------------------------------------

    def variable_value(self, number: int, hit: HitContext | None = None) -> int | None:
        builtin = BUILTIN_VARIABLES.by_number(number)
        if builtin is not None and builtin.computed and hit is not None:
            return builtin.compute(BuiltinContext(hit.uc, self.machine, self.tsc))
        if self.native is not None and number < self.native.tsv_slots and self._has_run:
            return self.native.read_tsv(number)
        if number in self.values:
            return self.values[number]
        variable = self.definitions.variables.get(number)
        if variable is None:
            return None
        return variable.initial if (self.running or self.stop_reason is not t.StopReason.NOT_RUN) else None

    @property
    def _has_run(self) -> bool:
        return self.running or self.stop_reason is not t.StopReason.NOT_RUN

    def set_variable(self, number: int, value: int) -> None:
        self.values[number] = value - (1 << 64) if value >> 63 else value

    @property
    def ignore_errors(self) -> bool:
        return bool(self.variable_value(BUILTIN_VARIABLES.by_name("ignore_error").number))

    # ---- run control --------------------------------------------------------------------------------------

    def start(self) -> None:
        self._between_hits(self._start_now)

    def _start_now(self) -> None:
        if self.running:
            self._stop_now(t.StopReason.STOP_COMMAND)
        self._retired.release()
        prepared = [self._prepare(tp) for tp in self.definitions.tracepoints.values() if tp.enabled]
        self._resolve_overlaps(prepared, [])
        try:
            self._allocate_ring()
        except MemoryError as error:
            raise TraceError(f"cannot allocate a {self.definitions.buffer_size:#x}-byte trace buffer: {error}") from None
        self.values = {n: v.initial for n, v in self.definitions.variables.items()}
        self.installed = {}
        self._stopped_installed = {}
        self._room = self.frame_room()
        self._start_native()
        try:
            for item in prepared:
                self._install(item)
        except Exception:
            self._uninstall_all()
            raise
        self.running = True
        self.stop_reason = t.StopReason.NOT_RUN  # what gdbserver reports while running, too
        self.stop_note = None
        self.stopping_tracepoint = 0
        self.start_time = _now_us()
        self.stop_time = None
        log.info("tracing started with %d probes", len(self.installed))

    def _start_native(self) -> None:
        if self.engine == "interp":
            self.native = None
            return
        assert self.ring is not None
        slots = max(self.definitions.variables, default=0) + 1
        self.native = CompiledRun(self.machine, self.engine, self.ring.ctl, slots)
        self.native.reset(self.values)

    def stop(self, reason: t.StopReason, note: str | None = None, tracepoint: int = 0) -> None:
        """End the run (tstop, passcount, error, full buffer, disconnect). Probes go; frames stay."""
        self._between_hits(lambda: self._stop_now(reason, note, tracepoint))

    def _between_hits(self, change: Callable[[], None]) -> None:
        """Apply a change to the run's probes or buffer on the CPU thread, with no hit in flight.

        A hit inside a detour (interrupts off) may sit between ring reserve and commit, or before a hypercall
        int3: removing its breakpoints or re-initializing the ring under it would panic the kernel or corrupt
        the new run's first entry. So the CPU first runs on, one instruction at a time, until RIP leaves the
        tracer's code. A change asked for by a hit itself (a hypercall stopping the run) needs no wait: that
        hit is past its ring work, and the CPU cannot be stepped from inside emulation anyway.
        """

        def apply(uc: Uc) -> None:
            if not self.machine.cpu.in_emulation:
                self._finish_hit_in_flight(uc)
            change()

        self.machine.run_on_cpu(apply)

    def _finish_hit_in_flight(self, uc: Uc) -> None:
        regions = self._retired.regions + (self.native.code_regions if self.native is not None else [])
        regions += [(copy, end) for copy, end, _ in self._int3_sites.values()]
        cpu = self.machine.cpu
        for step in range(MAX_STEPS_TO_FINISH_A_HIT):
            rip = uc.reg_read(UC_X86_REG_RIP)
            if not any(low <= rip < high for low, high in regions):
                return
            if step == 0:
                uc.ctl_flush_tb()  # blocks translated without a count would run past `count=1`
            cpu.run(count=1)
        raise TraceError(f"a hit did not leave the tracer's code within {MAX_STEPS_TO_FINISH_A_HIT} instructions")

    def _stop_now(self, reason: t.StopReason, note: str | None = None, tracepoint: int = 0) -> None:
        if not self.running:
            return
        self._uninstall_all()
        self.running = False
        self.stop_reason = reason
        self.stop_note = note
        self.stopping_tracepoint = tracepoint
        self.stop_time = _now_us()
        log.info("tracing stopped: %s", reason.name)

    def frame_room(self) -> int:
        """Bytes of blocks one frame may hold, in every engine: four full-size collections, at most half the
        ring (the most one entry may take)."""
        size = self.ring.state().size if self.ring is not None else self.definitions.buffer_size
        return min(4 * MAX_COLLECT, size // 2 - BLOCKS_AT - 8)

    def marker_at(self, address: int) -> Marker | None:
        return next((m for m in self.machine.image.markers if m.site == address), None)

    def marker_of_frame(self, frame: TraceFrame) -> Marker | None:
        """The marker a frame's tracepoint enabled (None for dynamic tracepoints)."""
        for (number, address), tp in self.definitions.tracepoints.items():
            if number == frame.tracepoint and tp.static:
                return self.marker_at(address)
        return None

    def saved_frame(self, frame: TraceFrame) -> bytes:
        """The frame as `tsave` gets it (qTBuffer, tsave -r): without its static-data block.

        GDB's trace-file reader knows no `S` block (traceframe_walk_blocks errors on it, in 13.1 and 18.1 alike),
        and one such block makes every register and memory read of that frame fail after `target tfile`. So
        saved files carry the frame's registers, memory and variables; `$_sdata` is read live (qXfer) or through
        `monitor sdata`, rendered the same way.
        """
        if frame.static_data() is None:
            return frame.to_gdb()
        return encode_frame(frame.tracepoint, tuple(b for b in frame.blocks if not isinstance(b, StaticBlock)))

    def rendered_sdata(self, frame: TraceFrame) -> str | None:
        marker = self.marker_of_frame(frame)
        data = frame.static_data()
        return None if marker is None or data is None else render(marker, data)

    def arm(self, tp: Tracepoint) -> None:  # noqa: D401
        """Install one location during a run (InstallInTrace, QTEnable)."""
        if self.running and tp.enabled and tp.key not in self.installed:
            item = self._prepare(tp)
            self._resolve_overlaps([item], list(self.installed.values()))
            earlier = self._stopped_installed.pop(tp.key, None)
            if earlier is not None:  # re-enabled in the same run: its counters go on
                item.fired, item.hits, item.usage = earlier.fired, earlier.hits, earlier.usage
            self._install(item)
            if earlier is not None and item.native is not None:
                self.machine.write_memory(item.native.counters, COUNTERS.pack(item.fired, item.hits, item.usage, 0))

    def disarm(self, key: tuple[int, int]) -> None:
        """Remove one location's probe during a run (QTDisable); its hits and frames stay."""

        def remove() -> None:
            item = self.installed.pop(key, None)
            if item is not None:
                self._remove_probe(item)
                self._stopped_installed[key] = item

        self._between_hits(remove)

    def _resolve_overlaps(self, new: list[Installed], armed: list[Installed]) -> None:
        """Probes must not patch over each other (as kprobes refuses to optimize over another probe).

        A jump whose window covers another probe's address becomes an int3 (re-planned: its detour then runs
        only the one instruction); a probe inside an armed jump's window, or a second tracepoint at an address
        that already has one, is refused with a message.
        """
        armed_at = {item.site.address: item for item in armed}
        addresses = [item.site.address for item in new] + list(armed_at)
        for item in new:
            where = f"tracepoint {item.tracepoint.number} at {item.site.address:#x}"
            if addresses.count(item.site.address) > 1:
                # several tracepoints at one address (GDB allows it): one int3 runs them all, in Python
                other = armed_at.get(item.site.address)
                if other is not None and other.native is not None:
                    raise TraceError(f"{where}: tracepoint {other.tracepoint.number} already has a compiled "
                                     "probe here; define both before tstart")
                if item.tracepoint.fast_insn_length is not None:
                    raise TraceError(f"{where}: fast tracepoint impossible: another tracepoint at this address")
                item.shared = True
                item.site = plan_probe(self.machine.image, item.site.address, "int3")
                item.want_jump = False
                continue
            for other in armed:
                if other.native is not None and other.native.kind == "jump" and \
                        other.site.address < item.site.address < other.site.address + other.site.length:
                    raise TraceError(f"{where}: inside the 5-byte jump of tracepoint {other.tracepoint.number}")
            if item.site.kind == "jump":
                window = range(item.site.address + 1, item.site.address + item.site.length)
                if any(address in window for address in addresses):
                    if item.tracepoint.fast_insn_length is not None:
                        raise TraceError(f"{where}: fast tracepoint impossible: another probe inside its window")
                    item.site = plan_probe(self.machine.image, item.site.address, "int3")
                    item.want_jump = False

    def _prepare(self, tp: Tracepoint) -> Installed:
        where = f"tracepoint {tp.number} at {tp.address:#x}"
        tsv_slots = max(self.definitions.variables, default=0) + 1
        try:
            condition = verify(tp.condition, tsv_slots=tsv_slots, require_value=True) if tp.condition else None
        except BytecodeError as error:
            raise TraceError(f"{where}: condition rejected: {error}") from None
        actions = _verified(tp.actions, tsv_slots, f"{where}: action")
        bt = BUILTIN_VARIABLES.by_name("bt").number
        if any(p is not None and any(i.name == "tracev" and i.operands[0] == bt for i in p.insns) for _, p in actions):
            # KGTP's `collect $bt`: also record $bt bytes of stack from rsp, so GDB can unwind the frame
            stack = bytes((0x26, 0x00, 0x07, 0x2C)) + bt.to_bytes(2, "big") + bytes((0x0C, 0x27))
            actions.append((t.EvalExpression(stack), verify(stack, tsv_slots=tsv_slots)))
        stepping = _verified(tp.stepping_actions, tsv_slots, f"{where}: while-stepping action")
        if tp.step_count and tp.fast_insn_length is not None:
            raise TraceError(f"{where}: while-stepping needs single-stepping; use trace, not ftrace")
        marker = None
        if tp.static:
            marker = self.marker_at(tp.address)
            if marker is None:
                raise TraceError(f"{where}: no static tracepoint marker at this address")
        elif any(isinstance(a, t.CollectStaticData) for a in tp.actions):
            raise TraceError(f"{where}: $_sdata exists only at static tracepoints (strace)")
        want_jump = (
            (self.engine != "interp" and self.probe == "auto") or tp.fast_insn_length is not None
        ) and not tp.step_count
        try:
            site = plan_probe(self.machine.image, tp.address, "jump" if want_jump else "int3")
        except ProbePlacementError as error:
            if tp.fast_insn_length is not None:  # ftrace: a jump or nothing, as gdbserver's fast tracepoints
                raise TraceError(f"{where}: fast tracepoint impossible: {error}") from None
            try:
                site = plan_probe(self.machine.image, tp.address, "int3")
            except ProbePlacementError as error2:
                raise TraceError(f"{where}: {error2}") from None
            want_jump = False
        return Installed(tp, site, condition, actions, want_jump=want_jump, stepping=stepping, marker=marker)

    def _allocate_ring(self) -> None:
        size = self.definitions.buffer_size
        if self._ring_memory is not None and self._ring_memory[1] != size:
            self.machine.free_data(self._ring_memory[0])
            self._ring_memory = None
        if self._ring_memory is None:
            base = self.machine.alloc_data(size + CTL_BYTES)
            self._ring_memory = (base, size)
        base, size = self._ring_memory
        self.ring = Ring(MachineMemory(self.machine), base + size)
        self.ring.initialize(base, size, self.definitions.circular)

    def _install(self, item: Installed) -> None:
        if self.native is not None and not item.tracepoint.step_count and not item.shared:
            self._install_native(item)
            return
        site = item.site
        group = self._int3_sites.get(site.address)
        if group is None:  # the first tracepoint here: one int3 and one out-of-line copy for all of them
            out_of_line = self.machine.alloc_code(relocated_size_bound(site.displaced) + 5)
            body = relocate(site.displaced, out_of_line)
            body += jump(out_of_line + len(body), site.resume_address)
            self.machine.write_memory(out_of_line, body)
            group = self._int3_sites[site.address] = (out_of_line, out_of_line + len(body), [])
            self.machine.breakpoints[site.address] = lambda uc, items=group[2]: self._hit_all(uc, items)
            self.machine.write_memory(site.address, INT3)
        item.out_of_line = group[0]
        group[2].append(item)
        self.installed[item.tracepoint.key] = item

    def _hit_all(self, uc: Uc, items: list[Installed]) -> None:
        for item in list(items):
            self._hit(uc, item)

    def _install_native(self, item: Installed) -> None:
        native = self.native
        assert native is not None
        tp = item.tracepoint
        programs = [p for p in (item.condition, *(p for _, p in item.actions)) if p is not None]
        slots = builtin_slots(programs)
        if any(kind not in ("cpu_id", "current_task", "current_task_pid", "rdtsc", "clock") for _, kind in slots):
            raise TraceError(f"tracepoint {tp.number}: unsupported built-in variable")
        probe = native.build(
            item.site, tp.number, item.condition, item.actions, tp.pass_count, slots,
            self.machine.image.address_of("current"), lambda code: verify(code), marker=item.marker,
            frame_room=self.frame_room(),
        )
        item.native = probe
        detour = probe.detour
        self.machine.breakpoints[detour.error_call] = lambda uc, item=item: self._hypercall_error(uc, item)
        self.machine.breakpoints[detour.full_call] = lambda uc, item=item: self._hypercall_full(uc, item)
        if detour.pass_call:
            self.machine.breakpoints[detour.pass_call] = lambda uc, item=item: self._hypercall_pass(uc, item)
        for address in detour.sdata_calls:
            self.machine.breakpoints[address] = lambda uc, item=item: self._hypercall_sdata(uc, item)
        native.patch(item.site, probe, item.want_jump)
        self.installed[tp.key] = item

    # hypercalls: int3s inside a detour, reached only on the slow paths

    def _resume_after(self, uc: Uc) -> None:
        uc.reg_write(UC_X86_REG_RIP, uc.reg_read(UC_X86_REG_RIP) + 1)

    def _hypercall_error(self, uc: Uc, item: Installed) -> None:
        self._resume_after(uc)
        native = self.native
        assert native is not None
        ctx = AgentCtx.unpack(bytes(uc.mem_read(native.ctx, CTX_SIZE)))
        uc.mem_write(native.ctx + CTX_ERROR, bytes(16))
        code = ErrorCode(ctx.error)
        programs = [p for p in (item.condition, *(p for _, p in item.actions)) if p is not None]
        program = next((p for p in programs if _fails_that_way(p, ctx.error_pc, code)), None)
        error = EvalError.make(code, ctx.error_pc, program.code if program else b"", ctx.fault_addr or None)
        self._check(error, item.tracepoint)

    def _hypercall_sdata(self, uc: Uc, item: Installed) -> None:
        """`collect $_sdata` in a native detour: build the entry from the saved block (at %rsp) into the frame."""
        self._resume_after(uc)
        native = self.native
        assert native is not None and item.marker is not None
        block = amd64.decode_registers(bytes(uc.mem_read(uc.reg_read(UC_X86_REG_RSP), amd64.G_PACKET_SIZE)))
        regs = [block[r.name] for r in amd64.GENERAL_REGISTERS]
        hit = HitContext(uc, regs, self, marker=item.marker)
        data = encode_block(StaticBlock(build_entry(item.marker, regs, hit.try_read)))
        ptr, limit = struct.unpack("<QQ", bytes(uc.mem_read(native.ctx + CTX_TRACE_PTR, 16)))
        if ptr + len(data) <= limit:
            uc.mem_write(ptr, data)
            uc.mem_write(native.ctx + CTX_TRACE_PTR, struct.pack("<Q", ptr + len(data)))

    def _hypercall_full(self, uc: Uc, item: Installed) -> None:
        self._resume_after(uc)
        if self.ring is not None and self.ring.state().full:
            self.stop(t.StopReason.BUFFER_FULL)

    def _hypercall_pass(self, uc: Uc, item: Installed) -> None:
        self._resume_after(uc)
        self.stop(t.StopReason.PASSCOUNT, tracepoint=item.tracepoint.number)

    def _remove_probe(self, item: Installed) -> None:
        if item.native is not None:
            assert self.native is not None
            probe = item.native
            self.native.unpatch(item.site, probe)
            for address in (probe.detour.error_call, probe.detour.full_call, probe.detour.pass_call,
                            *probe.detour.sdata_calls):
                self.machine.breakpoints.pop(address, None)
            item.fired, item.hits, item.usage = self.native.counters(probe)
            return
        group = self._int3_sites.get(item.site.address)
        if group is not None and item in group[2]:
            group[2].remove(item)
            if group[2]:
                return  # other tracepoints still use this int3
            del self._int3_sites[item.site.address]
        self.machine.write_memory(item.site.address, item.site.original)
        self.machine.breakpoints.pop(item.site.address, None)
        if group is not None:  # a preempted task may still be inside the copy
            self._retired.add([(group[0], group[1])])

    def _uninstall_all(self) -> None:
        for item in self.installed.values():
            self._remove_probe(item)
        if self.native is not None:
            self._retired.add(self.native.code_regions)
            self.native.code_regions = []
        # the usage counters stay readable for qTP after the run: keep the records, drop the probes
        self._stopped_installed.update(self.installed)
        self.installed = {}

    # ---- a hit (CPU thread, inside the int3 hook) -------------------------------------------------------

    def _hit(self, uc: Uc, item: Installed) -> None:
        uc.reg_write(UC_X86_REG_RIP, item.out_of_line)  # whatever happens, the kernel goes on
        if not self.running:
            return
        item.fired += 1
        regs = self._registers.read(uc)
        regs[amd64.PC_REGNUM] = item.site.address
        regs[amd64.REGISTER_INDEX["eflags"]] &= 0xFFFFFFFF
        hit = HitContext(uc, regs, self, room=self._room, marker=item.marker)
        tp = item.tracepoint
        if item.condition is not None:
            result = evaluate(item.condition, hit)
            if not self._check(result.error, tp):
                return
            if not result.value:
                return
        item.hits += 1
        for action, program in item.actions:
            if program is not None:
                result = evaluate(program, hit)
                if self._lost_block(result.error, program):
                    continue
                if not self._check(result.error, tp):
                    return
            else:
                self._collect(action, hit)
        blocks = b"".join(hit.blocks)
        assert self.ring is not None
        if not self.ring.append(tp.number, blocks, self.tsc.now()):
            if not self.definitions.circular:
                self.stop(t.StopReason.BUFFER_FULL)
            return
        item.usage += len(blocks) + 6
        if tp.pass_count and item.hits >= tp.pass_count:
            self.stop(t.StopReason.PASSCOUNT, tracepoint=tp.number)
        elif tp.step_count and self.running and self._stepper is None:
            self._start_stepping(uc, item)

    # ---- while-stepping (CPU thread) ------------------------------------------------------------------------

    def _start_stepping(self, uc: Uc, item: Installed) -> None:
        """Run the probed instruction in place and collect before each of the next `step_count` instructions.

        The int3 is lifted so the original instruction executes where it is; a code hook over kernel text (in
        Python, only while stepping) sees every next instruction; the int3 returns when the steps are done.
        """
        site = item.site
        uc.mem_write(site.address, site.original)
        low, high = self.machine.image.text_range
        uc.ctl_remove_cache(low, high)  # blocks translated before the hook existed would not call it
        state = {"remaining": item.tracepoint.step_count, "started": False}
        interrupted: list[tuple[int, int]] = []  # where the stepped task resumes after its interrupt handlers
        current = self.machine.image.address_of("current")
        task = uc.mem_read(current, 8)  # stepping follows this task, as TF lives in its saved flags

        def on_interrupt(vector: int, rip: int, rsp: int) -> None:
            # A CPU clears TF on interrupt entry and iretq restores it: handlers are never single-stepped.
            if uc.mem_read(current, 8) == task:
                interrupted.append((rip, rsp))

        def step(uc: Uc, address: int, size: int, _data: object) -> None:
            if uc.mem_read(current, 8) != task:
                return  # another task runs (the stepped one was preempted)
            if interrupted:
                rip, rsp = interrupted[-1]
                if address != rip or uc.reg_read(UC_X86_REG_RSP) != rsp:
                    return
                interrupted.pop()
            if not state["started"]:
                state["started"] = True  # the instruction at the tracepoint itself is about to run
                return
            self._collect_step(uc, item, address)
            state["remaining"] -= 1
            if state["remaining"] <= 0 or not self.running:
                self._end_stepping(uc, item)

        self._step_listener = on_interrupt
        self.machine.cpu.delivery_listeners.append(on_interrupt)
        self._stepper = uc.hook_add(UC_HOOK_CODE, step, begin=low, end=high - 1)
        uc.reg_write(UC_X86_REG_RIP, site.address)

    def _end_stepping(self, uc: Uc, item: Installed) -> None:
        if self._stepper is not None:
            uc.hook_del(self._stepper)
            self._stepper = None
            self.machine.cpu.delivery_listeners.remove(self._step_listener)
        if self.running and item.tracepoint.key in self.installed:
            uc.mem_write(item.site.address, INT3)
        low, high = self.machine.image.text_range
        uc.ctl_remove_cache(low, high)
        uc.reg_write(UC_X86_REG_RIP, uc.reg_read(UC_X86_REG_RIP))  # re-translate the current block too

    def _collect_step(self, uc: Uc, item: Installed, address: int) -> None:
        regs = self._registers.read(uc)
        regs[amd64.PC_REGNUM] = address
        regs[amd64.REGISTER_INDEX["eflags"]] &= 0xFFFFFFFF
        hit = HitContext(uc, regs, self, room=self._room)
        has_registers = False
        for action, program in item.stepping:
            if program is not None:
                result = evaluate(program, hit)
                if not self._check(result.error, item.tracepoint):
                    return
            else:
                has_registers |= isinstance(action, t.CollectRegisters)
                self._collect(action, hit)
        if not has_registers:  # GDB tells a stepping frame from the hit by its PC: always record it
            hit.blocks.insert(0, b"R" + amd64.encode_general(regs))
        blocks = b"".join(hit.blocks)
        assert self.ring is not None
        if self.ring.append(item.tracepoint.number, blocks, self.tsc.now()):
            item.usage += len(blocks) + 6
        elif not self.definitions.circular:
            self.stop(t.StopReason.BUFFER_FULL)

    @staticmethod
    def _lost_block(error: EvalError | None, program: Program) -> bool:
        return error is not None and error.code is ErrorCode.MEMORY_FAULT and faults_lose_a_block(program)

    def _check(self, error: EvalError | None, tp: Tracepoint) -> bool:
        if error is None:
            return True
        if not self.ignore_errors:
            self.stop(t.StopReason.ERROR, note=f"tracepoint {tp.number}: {error}", tracepoint=tp.number)
        return False

    def counters(self, item: Installed) -> tuple[int, int, int]:
        """(fired, hits, bytes) of a location, live from native memory while it is armed."""
        if item.native is not None and self.native is not None and item.tracepoint.key in self.installed:
            return self.native.counters(item.native)
        return item.fired, item.hits, item.usage

    def _collect(self, action: t.Action, hit: HitContext) -> None:
        if isinstance(action, t.CollectRegisters):
            hit.blocks.append(b"R" + amd64.encode_general(hit.regs))
        elif isinstance(action, t.CollectMemory):
            base = 0 if action.basereg < 0 else hit.register(action.basereg)
            address = (base + action.offset) & ((1 << 64) - 1)
            length = min(action.length, MAX_COLLECT)
            try:
                data = hit.read_memory(address, length)
            except UnreadableMemory:
                return  # not collected: GDB shows <unavailable>, like a DProbes fault token
            hit.blocks.append(encode_block(MemoryBlock(address, data)))
        elif isinstance(action, t.CollectStaticData) and hit.marker is not None:
            entry = build_entry(hit.marker, hit.regs, hit.try_read)
            hit.blocks.append(encode_block(StaticBlock(entry)))

    # ---- what GDB asks about the run ----------------------------------------------------------------------

    def status(self) -> t.TraceStatus:
        state = self.ring.state() if self.ring is not None else None
        return t.TraceStatus(
            running=self.running,
            stop_reason=self.stop_reason,
            stop_note=self.stop_note,
            stopping_tracepoint=self.stopping_tracepoint,
            frames=state.frames if state else 0,
            created=state.created if state else 0,
            buffer_free=state.free if state else self.definitions.buffer_size,
            buffer_size=state.size if state else self.definitions.buffer_size,
            circular=self.definitions.circular,
            disconnected=self.definitions.disconnected_tracing,
            start_time=self.start_time,
            stop_time=self.stop_time,
            user=self.definitions.user,
            notes=self.definitions.notes,
        )

    def location_status(self, number: int, address: int) -> tuple[int, int] | None:
        item = self.installed.get((number, address)) or self._stopped_installed.get((number, address))
        if item is None:
            return None if (number, address) not in self.definitions.tracepoints else (0, 0)
        _, hits, usage = self.counters(item)
        return hits, usage

    def frames(self) -> list[TraceFrame]:
        """The ring's frames, parsed once per change of the ring (tfind asks again and again)."""
        if self.ring is None:
            return []
        state = self.ring.state()
        key = (state.base, state.head, state.tail, state.created)
        if self._frames_cache is None or self._frames_cache[0] != key:
            self._frames_cache = (key, self.ring.entries())
        return self._frames_cache[1]




def _now_us() -> int:
    return time.time_ns() // 1000


__all__ = ["Tracer", "TraceError", "struct"]


_COMPUTED = {b.number: b.name for b in BUILTIN_VARIABLES if b.computed}


def _verified(actions: list[t.Action], tsv_slots: int, what: str) -> list[tuple[t.Action, Program | None]]:
    """Each action with its verified program (expressions only); bad bytecode fails tstart with a message."""
    out: list[tuple[t.Action, Program | None]] = []
    for action in actions:
        program = None
        if isinstance(action, t.EvalExpression):
            try:
                program = verify(action.bytecode, tsv_slots=tsv_slots)
            except BytecodeError as error:
                raise TraceError(f"{what} rejected: {error}") from None
        out.append((action, program))
    return out


def builtin_slots(programs: list[Program]) -> tuple[tuple[int, str], ...]:
    """Computed built-in variables the bytecode reads: the detour refreshes their slots at each hit."""
    found: dict[int, str] = {}
    for program in programs:
        for insn in program.insns:
            if insn.name in ("getv", "tracev") and insn.operands[0] in _COMPUTED:
                found[insn.operands[0]] = _COMPUTED[insn.operands[0]]
    return tuple(sorted(found.items()))


_FAILING_OPS = {
    ErrorCode.DIVIDE_BY_ZERO: {"div_signed", "div_unsigned", "rem_signed", "rem_unsigned"},
    ErrorCode.DIVIDE_OVERFLOW: {"div_signed", "rem_signed"},
    ErrorCode.MEMORY_FAULT: {"ref8", "ref16", "ref32", "ref64", "trace", "trace_quick", "trace16", "tracenz"},
}


def _fails_that_way(program: Program, offset: int, code: ErrorCode) -> bool:
    """Could `program`'s op at `offset` raise `code`? (Tells which of a location's programs a native error
    came from, so the message names the op like the interpreter's does.)"""
    if offset not in program.index:
        return False
    names = _FAILING_OPS.get(code)
    return names is None or program.at(offset).name in names
