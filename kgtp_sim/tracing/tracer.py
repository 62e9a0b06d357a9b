"""The tracer: one trace run's state and its control, and the answers to what GDB asks about it.

Owns the run (running, stop reason, start and stop times), the trace state variables' values, the ring buffer
and the compiled engine's per-run state; delegates planning to `placement.py`, putting probes into the kernel
to `installer.py` and the Python hit path to `hits.py`. The stub's packet handlers speak to it through the
methods of `api.TracerApi` only.

Why this module is long: it is the one place a run's state lives and changes (start, stop, arming and disarming
with no hit in flight, the buffer's settings) and the one GDB's questions reach (variables, frames, markers of the
kernel and of the program, status), for both roles; what can stand apart already does (planning, installing, the
hit paths, the ring, the variables' tables).

Threads: the server thread calls `start`, `stop`, `arm`, `disarm` (each runs its change on the CPU thread with
no hit in flight, `_between_hits`) and the read-only queries; the CPU thread runs hits (`hits.py`) and
hypercalls (`installer.py`), which read and write the variables and the ring.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

from unicorn import Uc
from unicorn.x86_const import UC_X86_REG_CR3, UC_X86_REG_RIP

from ..agent.errors import ErrorCode, EvalError
from ..arch import amd64
from ..agent.verify import Program
from ..machine import MODULE_BASE, MODULE_SIZE, Machine, Marker, smp
from .core.builtins import (BUILTIN_VARIABLES, CLOCK, CPU_ID, EINVAL, IGNORE_ERROR, LAST_ERRNO, BuiltinContext, KgtpState,
                            gdb_value, setting, tsc_to_clock)
from .core.clock import Tsc
from .core.frames import CompactRegisters, StaticBlock, TraceFrame, TsvBlock, encode_frame, whole_register_blocks
from .core.sdt import SdtMarker
from .core.model import Definitions, ProbeRow, StopReason, TraceError, Tracepoint, TraceStatus, requested_buffer_size
from .core.percpu import PerCpuVariables
from .core.perf import PerfEvents
from .core.predefined import PredefinedVariables, gdbserver_variables, steady_clock_us
from .core.ring import BLOCKS_AT, MIN_SIZE, RawEntries, Rings
from .core.run import prepare_program
from .core.sdata import render
from .engines.fastregs import RegisterReader
from .engines.hits import MAX_COLLECT, HitContext, Stepper
from .engines.installer import ProbeSet
from .engines.native import ENGINES, CompiledRun, faults_lose_a_block
from .kgtp.fbt import FunctionProbes, function_probes
from .kgtp.kret import KretRun
from .kgtp.printk import attach, dump_stack
from .kgtp.watch import Watches
from .patching.placement import prepare, resolve_overlaps
from .patching.retire import RetiredCode

if TYPE_CHECKING:
    from ..machine.dwarf import KernelDwarf

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Bound on the runs that let a hit leave the tracer's code before a run changes (each ends at a block boundary;
#: only requests of other threads can end one early, so a few suffice).
MAX_RUNS_TO_FINISH_A_HIT = 10_000


class MachineMemory:
    """Ring memory access through the machine (coherent, from any thread)."""

    def __init__(self, machine: Machine) -> None:
        self.machine = machine

    def read(self, address: int, length: int) -> bytes:
        return self.machine.read_memory(address, length)

    def write(self, address: int, data: bytes) -> None:
        # ring memory is data: no translated code to drop, unlike machine.write_memory
        self.machine.run_on_cpu(lambda uc: uc.mem_write(address, data))

    def read_many(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Several ranges read between the same two instructions (one trip to the CPU thread)."""
        return self.machine.run_on_cpu(lambda uc: [bytes(uc.mem_read(a, n)) for a, n in ranges])

    def atomically(self, reads: Callable[[Callable[[int, int], bytes]], T]) -> T:
        """`reads(read)` between the same two instructions (one trip to the CPU thread): what it reads first may
        decide what it reads next (the rings' control fields, then their new bytes)."""
        return self.machine.run_on_cpu(lambda uc: reads(lambda address, length: bytes(uc.mem_read(address, length))))


class Tracer:
    """One kernel's tracer: definitions from GDB, the current (or last) run, its frames. `gdbserver`: the
    gdbserver role's, with gdbserver's buffer (gdbserver/tracepoint.cc: one for every CPU, of the size GDB asks
    for, fixed during a run, emptied by a new size; KGTP gives each CPU a ring of that size), `$trace_timestamp`
    (predefined.py) and tstatus times on the clock it reads."""

    def __init__(self, machine: Machine, engine: str = "opt", probe: str = "auto", gdbserver: bool = False) -> None:
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}")
        if probe not in ("auto", "int3"):
            raise ValueError("probe must be 'auto' (a jump where safe) or 'int3'")
        self.machine = machine
        self.engine = engine
        #: "auto": compiled engines jump to their detour where it is safe (optimized kprobes); "int3": always
        #: trap into it (plain kprobes), e.g. to measure the difference. ftrace always needs the jump.
        self.probe = probe
        #: the program tracepoints may also be put in (the gdbserver role's process); None: the kernel only
        self.user_space = None
        #: KGTP's $inferior_pid: the process GDB debugs (the gdbserver role's program); 0: none
        self.inferior_pid = 0
        self.native: CompiledRun | None = None
        self.retired = RetiredCode(machine)
        self.definitions = Definitions()
        self.running = False
        self.stop_reason = StopReason.NOT_RUN
        self.stop_note: str | None = None
        self.stopping_tracepoint = 0
        self.start_time: int | None = None
        #: the TSC at tstart: where a run's frame times count from (the follow channel, exports)
        self.start_tsc: int | None = None
        self.stop_time: int | None = None
        self.values: dict[int, int] = {}
        self.probes = ProbeSet(self)
        self.stepper = Stepper(self)
        #: bytes of blocks one frame may hold in this run (`frame_room`, fixed at tstart)
        self.room = 4 * MAX_COLLECT
        self._frames_cache: tuple[tuple[int, int, int, int], list[TraceFrame]] | None = None
        #: every CPU's ring (ring.py), one buffer to GDB
        self.ring: Rings | None = None
        self._ring_memory: tuple[int, int] | None = None  # (base, per-CPU size) of the rings' bytes
        self._ring_control: int | None = None  # the control area, in module space (ring.py)
        self.printed: list[str] = []
        self.tsc = Tsc(machine.clock)  # the machine's TSC: it does not run while a debugger stops the machine
        self.registers = RegisterReader()
        self.kgtp = KgtpState()  # what KGTP's special variables keep across hits (builtins.py)
        self.kret = KretRun(self)  # return probes (`$kret`, kret.py)
        self.watches = Watches(self)  # watch tracepoints and the hardware breakpoints they hold (watch.py)
        self.per_cpu = PerCpuVariables(machine.cpu_count)  # KGTP's `$p_*` / `$per_cpu_*` (percpu.py)
        self.perf = PerfEvents(machine)  # KGTP's `$pe_*` / `$p_pe_*` on the machine's counters (perf.py)
        self._dwarf: KernelDwarf | None = None  # the kernel's DWARF, read on the first `$dump_stack` or `fbt`
        self._functions: list[FunctionProbes] | None = None  # `function_probes`, once per image
        #: recorders attached now (`attach_recorder`), whether this run's ring is a flight recorder because one
        #: was, and what tstatus says about them (set by the follow channel's drain, stub/stream.py)
        self.recorders = 0
        self.flight_recorder = False
        self.recorder_note: str | None = None
        for variable in BUILTIN_VARIABLES:
            self.definitions.variables[variable.number] = variable.definition()
        cpu_number = BUILTIN_VARIABLES.by_name("cpu_number")  # KGTP's gtp_cpu_number, uploaded as its value
        self.definitions.variables[cpu_number.number] = replace(cpu_number.definition(), initial=machine.cpu_count)
        #: the gdbserver role's tracer (gdbserver's rules where they differ from KGTP's): gdbserver's one trace
        #: buffer for every CPU (see the class), not KGTP's ring per CPU
        self.gdbserver = self.one_buffer = gdbserver
        #: the target's own variables besides KGTP's: gdbserver's `$trace_timestamp`, numbered after KGTP's table
        self.predefined = (gdbserver_variables(max(self.definitions.variables) + 1) if gdbserver
                           else PredefinedVariables())
        for variable in self.predefined.definitions():
            self.definitions.variables[variable.number] = variable
        #: the clock of tstatus's start and stop times: gdbserver's steady clock in its role, else the epoch's
        self._now_us = steady_clock_us if gdbserver else _now_us

    # ---- trace state variables --------------------------------------------------------------------------

    def variable_value(self, number: int, hit: HitContext | None = None) -> int | None:
        if number in self.predefined:  # its getter, at a hit or for GDB; GDB's qTV before the first run: unknown
            return self.predefined.value(number) if hit is not None or self._has_run else None
        if number in self.perf:  # the machine's counter (GDB: read on the CPU thread, the loaded CPU's)
            if hit is not None:
                return self.perf.get(number, self._cpu_of(hit), hit.site)
            return self.machine.run_on_cpu(lambda uc: self.perf.get(number, self.machine.current_cpu))
        builtin = BUILTIN_VARIABLES.by_number(number)
        if builtin is not None and builtin.computed and hit is not None:
            return builtin.compute(BuiltinContext(hit.uc, self.machine, self.tsc, hit, self))
        if builtin is not None and hit is None:  # GDB asks (qTv): live, a setting, or unknown, as KGTP answers
            return gdb_value(self, builtin, lambda: self._stored_value(number))
        if number in self.per_cpu and self._has_run:
            return self.per_cpu.get(number, self._cpu_of(hit))
        return self._stored_value(number)

    def _cpu_of(self, hit: HitContext | None) -> int:
        """The CPU a per-CPU variable's local copy is taken from: the hit's, or for GDB the loaded one."""
        return smp.cpu_number(hit.uc) if hit is not None else self.machine.current_cpu

    def check_variable(self, name: str) -> None:
        """QTDV: a per-CPU variable may not name a CPU the machine lacks, nor a perf-event variable a field KGTP
        does not know (ValueError), as KGTP refuses them."""
        self.per_cpu.check(name)
        if not any(builtin.name == name for builtin in BUILTIN_VARIABLES):  # GDB re-sends them ($p_pe_en ...)
            self.perf.check(name)

    def _stored_value(self, number: int) -> int | None:
        if self.native is not None and number < self.native.tsv_slots and self._has_run:
            return self.native.read_tsv(number)
        if number in self.values:
            return self.values[number]
        variable = self.definitions.variables.get(number)
        if variable is None:
            return None
        return variable.initial if self._has_run else None

    @property
    def _has_run(self) -> bool:
        return self.running or self.stop_reason is not StopReason.NOT_RUN

    def set_variable(self, number: int, value: int, hit: HitContext | None = None) -> None:
        """Write a variable where every path of this run reads it: the compiled engines' array in emulated
        memory when the run has one (so Python hits and detours share it), else the tracer's own table. A hit's
        write of a variable Python carries out ($watch_start ...) goes to it instead."""
        if number in self.predefined:  # gdbserver's getter replaces whatever was set at the next read
            return
        builtin = BUILTIN_VARIABLES.by_number(number) if hit is not None else None
        if builtin is not None and builtin.assign is not None:
            builtin.assign(BuiltinContext(hit.uc, self.machine, self.tsc, hit, self), value)
            return
        if number in self.perf and hit is not None:
            self.perf.set(number, value, self._cpu_of(hit), hit.site)
            return
        value = value - (1 << 64) if value >> 63 else value
        if number in self.per_cpu and self._has_run:
            self.per_cpu.set(number, self._cpu_of(hit), value)
            return
        if self.native is not None and number < self.native.tsv_slots and self._has_run:
            self.native.write_tsv(number, value)
        else:
            self.values[number] = value


    # ---- settings the handlers change ---------------------------------------------------------------------

    def set_engine(self, engine: str) -> None:
        """Which engine the next tstart uses."""
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}")
        self.engine = engine

    def set_buffer_size(self, size: int | None) -> bool:
        """QTBuffer:size (None: the default), or TraceError. KGTP mode: each CPU's ring, from the next tstart.
        gdbserver's buffer (cmd_bigqtbuffer_size): refused during a run, else made anew, empty (True: the last
        run's frames are gone)."""
        if self.one_buffer and self.running:
            raise TraceError("the trace buffer's size cannot change while a trace is running")
        self.definitions.buffer_size = requested_buffer_size(size, one_buffer=self.one_buffer)
        if not self.one_buffer or self.ring is None:
            return False
        self.ring = None
        self._frames_cache = None
        return True

    def set_circular(self, circular: bool) -> None:
        """QTBuffer:circular: also applies to a running buffer (which stays circular while it is a recorder's
        flight recorder)."""
        self.definitions.circular = circular
        if self.ring is not None and self.running:
            self.ring.set_circular(circular or self.flight_recorder)

    # ---- recorders ----------------------------------------------------------------------------------------

    def attach_recorder(self) -> None:
        """A recorder (`kgtp-sim record`) drains every CPU's committed frames through the follow channel as they
        are written, as LTTng's consumer daemon drains its per-CPU buffers. From now until the run ends, even if
        the recorder leaves, the ring is GDB's flight recorder: circular, so tfind and tsave see the latest
        frames and a full buffer never stops the run; a recorder that falls behind loses what the ring
        overwrites before it read it, and counts it. The next tstart without a recorder is as GDB set it."""
        self.recorders += 1
        if self.ring is not None and self.running:
            self.flight_recorder = True
            self.ring.set_circular(True)

    def detach_recorder(self) -> None:
        """A recorder left (the ring stays a flight recorder until the run ends)."""
        self.recorders = max(0, self.recorders - 1)

    def report_recorder(self, note: str) -> None:
        """What tstatus says about this run's recorder, in its notes (the drain updates it as it goes)."""
        self.recorder_note = note

    def read_entries(self, positions: dict[int, int]) -> list[RawEntries]:
        """Each CPU's entries committed since `positions` (cpu -> logical position), unparsed, read at one instant
        (`Rings.read_since`): the recorder's drain."""
        return self.ring.read_since(positions) if self.ring is not None else []

    def set_stop_note(self, note: str) -> None:
        """QTNotes' tstop note: also the note of a run already stopped by tstop."""
        self.definitions.stop_note = note
        if not self.running and self.stop_reason is StopReason.STOP_COMMAND:
            self.stop_note = note

    # ---- run control --------------------------------------------------------------------------------------

    def start(self) -> None:
        if self.user_space is not None:  # the program's pages present before the run changes anything
            prepare_program(self.user_space, [tp for tp in self.definitions.tracepoints.values() if tp.enabled],
                            compiled=self.engine != "interp")
        self._between_hits(self._start_now)

    def _start_now(self) -> None:
        if self.running:
            self._stop_now(StopReason.STOP_COMMAND)
        self.retired.release()
        # KGTP's $ignore_error: a tracepoint that cannot be installed is left out, its error in $last_errno
        ignore_error, last_errno = bool(setting(self, IGNORE_ERROR)), 0
        self.perf.define(self.definitions.variables)
        prepared = []
        enabled = [tp for tp in self.definitions.tracepoints.values() if tp.enabled]
        self.watches.reset()
        for tp in enabled:
            try:
                if self.watches.admit(tp, self._tsv_slots()):
                    continue  # a watch tracepoint: a hardware breakpoint, no probe
                prepared.append(self._prepare(tp))
            except TraceError as error:
                if not ignore_error:
                    raise
                log.warning("tstart left out %s", error)
                last_errno = -EINVAL
        self.watches.check_run(enabled)
        resolve_overlaps(self.machine.image, prepared, [])
        self.kret.start(prepared)
        self.kgtp.start([item.tracepoint for item in prepared] + self.watches.tracepoints(), self.tsc)
        try:
            self._allocate_ring()
        except MemoryError as error:
            raise TraceError(f"cannot allocate a {self.definitions.buffer_size:#x}-byte trace buffer: {error}") from None
        self.values = {n: v.initial for n, v in self.definitions.variables.items()}
        self.values[LAST_ERRNO] = last_errno
        self.per_cpu.define({n: v for n, v in self.definitions.variables.items() if n not in self.perf})
        self.probes.reset()
        self.room = self.frame_room()
        self._start_native()
        self.probes.plan(prepared)
        try:
            for item in prepared:
                try:
                    self.probes.install(item)
                except TraceError as error:
                    if not ignore_error:
                        raise
                    log.warning("tstart left out %s", error)
                    last_errno = -EINVAL
            last_errno = self.watches.start(ignore_error) or last_errno
            self.perf.start()  # the perf events' counters, some enabled from now (KGTP creates them last too)
        except Exception:
            self.probes.remove_all()
            self.watches.stop()
            self.perf.stop()
            raise
        self.running = True
        self.set_variable(LAST_ERRNO, last_errno & (2**64 - 1))
        self.stop_reason = StopReason.NOT_RUN  # what gdbserver reports while running, too
        self.stop_note = None
        self.stopping_tracepoint = 0
        self.start_time = self._now_us()
        self.start_tsc = self.tsc.read()  # on the CPU thread, before the first hit of the run
        self.stop_time = None
        log.info("tracing started with %d probes", len(self.probes.installed))

    def _tsv_slots(self) -> int:
        return max(self.definitions.variables, default=0) + 1

    def _prepare(self, tp: Tracepoint):
        user = self.user_space
        space = user.space() if user is not None and user.holds(tp.address) else None
        item = self.kret.prepare(prepare(tp, self.machine.image, self._tsv_slots(),
                                         compiled=self.engine != "interp", probe=self.probe,
                                         marker=self.marker_at(tp.address),
                                         space=space))
        self.perf.check_access(item.programs(), f"tracepoint {tp.number} at {tp.address:#x}")
        if self.gdbserver:  # gdbserver's `R`: every register
            item.actions, item.stepping = whole_register_blocks(item.actions), whole_register_blocks(item.stepping)
        attach(item, self)  # direct output, $enable/$disable, $current
        return item

    def _start_native(self) -> None:
        if self.engine == "interp":
            self.native = None
            return
        assert self.ring is not None
        slots = max(self.definitions.variables, default=0) + 1
        self.native = CompiledRun(self.machine, self.engine, self.ring.ctl, slots, self.machine.cpu_count,
                                  shared_ring=self.one_buffer)
        self.native.reset(self.values)
        if self.per_cpu.copies:  # per-CPU copies where the detours reach them (percpu.py)
            self.per_cpu.attach(MachineMemory(self.machine), self.machine.alloc_data(self.per_cpu.size()))

    def stop(self, reason: StopReason, note: str | None = None, tracepoint: int = 0) -> None:
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
        """Run the loaded CPU until it is in none of the tracer's code: a detour or an out-of-line copy (module
        space), or a program's pad (`Cpu.process_stub_code`, in that process's space: a false condition decided
        there counts the hit on its way out, and a removal reading the counts first would miss it). No other CPU
        can be in any of it: a CPU is never switched out there."""
        regions = self.retired.regions + (self.native.code_regions if self.native is not None else [])
        regions += self.probes.code_regions()
        cpu = self.machine.cpu
        for _ in range(MAX_RUNS_TO_FINISH_A_HIT):
            rip = uc.reg_read(UC_X86_REG_RIP)
            if any(low <= rip < high for low, high in regions):
                # Every piece of the tracer's code lives in module space: run until a block starts outside it. (Not
                # one instruction at a time: a run limited by a count drops a #PF raised by its instruction, so a
                # collection that faults would be retried forever instead of reaching its fault fixup.)
                cpu.stopper.stop_outside(MODULE_BASE, MODULE_BASE + MODULE_SIZE)
            else:
                root = uc.reg_read(UC_X86_REG_CR3) & ~0xFFF
                pad = next(((start, end) for start, end, space in cpu.process_stub_code
                            if start <= rip < end and space == root), None)
                if pad is None:
                    return
                cpu.stopper.stop_outside(*pad)  # (its gate's call into the detour ends the run: module space next)
            cpu.run(keep_stop_request=True)
        raise TraceError(f"a hit did not leave the tracer's code within {MAX_RUNS_TO_FINISH_A_HIT} runs")

    def _stop_now(self, reason: StopReason, note: str | None = None, tracepoint: int = 0) -> None:
        if not self.running:
            return
        self.probes.remove_all()
        self.watches.stop()
        self.perf.stop()
        self.running = False
        self.stop_reason = reason
        self.stop_note = note
        self.stopping_tracepoint = tracepoint
        self.stop_time = self._now_us()
        log.info("tracing stopped: %s", reason.name)

    def frame_room(self) -> int:
        """Bytes of blocks one frame may hold, in every engine: four full-size collections, at most half a
        CPU's ring (the most one entry may take). A gdbserver buffer under a page does not bound a hit: a frame
        that does not fit stops the run full, as gdbserver's."""
        size = self.ring[0].state().size if self.ring is not None else self.definitions.buffer_size
        if self.one_buffer and size < MIN_SIZE:
            return 4 * MAX_COLLECT
        return min(4 * MAX_COLLECT, size // 2 - BLOCKS_AT - 8)

    def _allocate_ring(self) -> None:
        """One ring of `buffer_size` bytes per CPU (KGTP's per-CPU gtp_rb), or gdbserver's one buffer (the size
        rounded down to whole 8-byte units, 8 at least: qTStatus still reports the size GDB asked for), the
        control area in module space."""
        size, count = self.definitions.buffer_size, self.machine.cpu_count
        if self.one_buffer:
            size, count = max(8, size & ~7), 1
        if self._ring_memory is not None and self._ring_memory[1] != size:
            self.machine.free_data(self._ring_memory[0])
            self._ring_memory = None
        if self._ring_memory is None:
            base = self.machine.alloc_data(size * count)
            self._ring_memory = (base, size)
        if self._ring_control is None:  # no-execute, as a detour's counters (Machine.alloc_code)
            self._ring_control = self.machine.alloc_code(0x10, data_pages=1)
        base, size = self._ring_memory
        self.ring = Rings(MachineMemory(self.machine), self._ring_control, self.machine.cpu_count,
                          shared=self.one_buffer)
        self.flight_recorder = self.recorders > 0
        self.recorder_note = None
        self.ring.initialize(base, size, self.definitions.circular or self.flight_recorder)

    def arm(self, tp: Tracepoint) -> None:
        """Install one location during a run (InstallInTrace, QTEnable): verified, placed, compiled and patched on
        the CPU thread with no hit in flight, as every change to the run's probes (`_between_hits`); hits read the
        probe set and the machine's int3 table there."""
        if self.user_space is not None and self.running and tp.enabled:
            prepare_program(self.user_space, [tp], compiled=self.engine != "interp")
        self._between_hits(lambda: self._arm_now(tp))

    def _arm_now(self, tp: Tracepoint) -> None:
        if self.running and tp.enabled and tp.key not in self.probes.installed:
            self.kgtp.admit(tp)
            if self.watches.arm(tp, self._tsv_slots()):
                return
            earlier = self.probes.removed.get(tp.key)
            if earlier is not None and earlier.tracepoint is tp and self.probes.resume(earlier):
                del self.probes.removed[tp.key]  # the same definition, its detour still there: no compiling
                return
            item = self._prepare(tp)
            self.kret.admit(item, list(self.probes.installed.values()))
            resolve_overlaps(self.machine.image, [item], list(self.probes.installed.values()))
            earlier = self.probes.removed.pop(tp.key, None)
            self.probes.install(item)
            if earlier is not None:  # re-enabled in the same run: its counters go on
                self.probes.restore_counters(item, earlier)

    def disarm(self, key: tuple[int, int]) -> None:
        """Remove one location's probe during a run (QTDisable); its hits and frames stay."""
        self._between_hits(lambda: self.watches.disarm(key) or self.probes.remove(key))

    def is_armed(self, key: tuple[int, int]) -> bool:
        return key in self.probes.installed

    # ---- errors at a hit (CPU thread) ---------------------------------------------------------------------

    @staticmethod
    def lost_block(error: EvalError | None, program: Program) -> bool:
        return error is not None and error.code is ErrorCode.MEMORY_FAULT and faults_lose_a_block(program)

    def check(self, error: EvalError | None, tp: Tracepoint) -> bool:
        """True when there is no error; else records `terror` and says the hit ends (as KGTP, whose
        `$ignore_error` is about tstart only)."""
        if error is None:
            return True
        self.stop(StopReason.ERROR, note=f"tracepoint {tp.number}: {error}", tracepoint=tp.number)
        return False

    def function_probes(self) -> list[FunctionProbes]:
        """Every function of the kernel and the probes it takes at its entry and return (`monitor fbt`)."""
        if self._functions is None:
            dwarf = self._kernel_dwarf()
            self._functions = function_probes(self.machine.image, lambda address: (dwarf.line_at(address)
                                                                                 or (None,))[0])
        return self._functions

    def _kernel_dwarf(self) -> KernelDwarf:
        if self._dwarf is None:
            from ..machine.dwarf import KernelDwarf  # here: parsing it and importing pyelftools cost a start

            self._dwarf = KernelDwarf(self.machine.image.path)
        return self._dwarf

    def dump_stack(self, ctx: BuiltinContext) -> None:
        """`$dump_stack` (core.run.Run): the hit's backtrace on the kernel's console, unwound with its DWARF."""
        dump_stack(ctx, self._kernel_dwarf())

    # ---- what GDB asks about the run ----------------------------------------------------------------------

    def status(self) -> TraceStatus:
        """KGTP's gtp_get_status over per-CPU rings: frames, created and free summed over CPUs, the size each
        CPU's ring times the CPUs (`Rings`). gdbserver's one buffer (cmd_qtstatus): its size as GDB asked for
        it, and what its frames leave of it free."""
        state = self.ring.state() if self.ring is not None else None
        if self.one_buffer:
            size = self.definitions.buffer_size
            free = max(0, size - state.used) if state else size
        else:
            size = state.size if state else self.definitions.buffer_size * self.machine.cpu_count
            free = state.free if state else size
        return TraceStatus(
            running=self.running,
            stop_reason=self.stop_reason,
            stop_note=self.stop_note,
            stopping_tracepoint=self.stopping_tracepoint,
            frames=state.frames if state else 0,
            created=state.created if state else 0,
            buffer_free=free,
            buffer_size=size,
            circular=self.definitions.circular or self.flight_recorder,
            disconnected=self.definitions.disconnected_tracing,
            start_time=self.start_time,
            stop_time=self.stop_time,
            user=self.definitions.user,
            notes=self._notes(),
        )

    def _notes(self) -> str | None:
        """GDB's trace notes, then what a recorder of this run did (tstatus prints both as `Trace notes:`)."""
        parts = [text for text in (self.definitions.notes, self.recorder_note) if text]
        return "; ".join(parts) if parts else self.definitions.notes

    def location_status(self, number: int, address: int) -> tuple[int, int] | None:
        """(hits, bytes) of a location for qTP; None for a location GDB never defined."""
        item = self.probes.find((number, address))
        watch = self.watches.find((number, address)) if item is None else None
        if watch is not None:
            return watch.hits, watch.usage
        if item is None:
            return None if (number, address) not in self.definitions.tracepoints else (0, 0)
        _, hits, usage = self.probes.counters(item)
        return hits, usage

    def probe_rows(self) -> list[ProbeRow]:
        return self.probes.rows() + self.watches.rows()

    def refuses_breakpoint(self, address: int, *, data: bool = False) -> str | None:
        """Why a debugger's breakpoint at `address` (a watchpoint on it with `data`) cannot work with this run, or
        None. An instruction inside the bytes a jump probe replaced (after the first; also when the site went back
        to an int3 into the same detour) never runs in place: it runs displaced, in the probe's detour. A data
        watchpoint's trap and while-stepping take the CPU's one single-step trap (as KGTP keeps watch tracepoints
        and while-stepping apart). A snapshot: called from the server thread while probes come and go on the CPU
        thread."""
        installed = list(self.probes.installed.values())
        if data:
            stepping = sorted({item.tracepoint.number for item in installed if item.tracepoint.step_count})
            if self.running and stepping:
                return (f"tracepoint {stepping[0]} single-steps (while-stepping), and a watchpoint's trap takes the "
                        "same single-step trap: not in one run")
            return None
        for item in installed:
            site = item.site
            if site.address < address < site.address + site.length:
                return (f"{address:#x} is inside the {site.length} bytes tracepoint {item.tracepoint.number}'s jump "
                        f"probe at {site.address:#x} replaced: the instructions there run displaced, in a detour")
        return None

    def frames(self) -> list[TraceFrame]:
        """The ring's frames, parsed once per change of the ring (tfind asks again and again)."""
        if self.ring is None:
            return []
        key = (self.start_tsc,) + tuple((state.base, state.head, state.tail, state.created)  # a new run may
                                        for state in self.ring.states())  # fill a new ring to the same place
        if self._frames_cache is None or self._frames_cache[0] != key:
            self._frames_cache = (key, self.kret.visible(self.ring.entries()))
        return self._frames_cache[1]

    def consume_frames(self, through: dict[int, int]) -> int:
        """A consuming read: each CPU's frames created up to its sequence in `through` (cpu -> sequence) leave
        the buffer (GDB no longer finds them; a linear buffer has their room again). Returns how many left."""
        if self.ring is None:
            return 0
        ring = self.ring
        dropped: list[int] = []
        self._between_hits(lambda: dropped.append(ring.consume(through)))
        return dropped[0]

    def saved_frame(self, frame: TraceFrame, regblock_size: int = amd64.G_PACKET_SIZE,
                    renumber: Callable[[int], int | None] | None = None) -> bytes:
        """The frame as `tsave` gets it (qTBuffer, tsave -r): in GDB's blocks, with when and where it was committed,
        without its static-data block.

        GDB's trace-file format has no field for a frame's time or CPU, so a saved frame carries them as the values
        of KGTP's `$clock` (nanoseconds: the TSC at commit, as `$clock` converts it) and `$cpu_id`: `V` blocks GDB's
        trace-file reader takes like any collected variable (after `target tfile`, `print $cpu_id` is that frame's
        CPU), and which `kgtp-sim export` and `plot` read back. A frame that collected either keeps its own value.

        GDB's trace-file reader knows no `S` block (traceframe_walk_blocks errors on it, in 13.1 and 18.1 alike),
        and one such block makes every register and memory read of that frame fail after `target tfile`. So
        saved files carry the frame's registers, memory and variables; `$_sdata` is read live (qXfer) or through
        `monitor sdata`, rendered the same way.

        `renumber`: each variable's number as the reader knows it (stub/variables.py), None to leave it out.
        """
        blocks = tuple(b.expanded() if isinstance(b, CompactRegisters) else b
                       for b in frame.blocks if not isinstance(b, StaticBlock))
        collected = {b.number for b in blocks if isinstance(b, TsvBlock)}  # gdbserver's files: what was collected
        stamps = () if self.gdbserver else ((CPU_ID, frame.cpu), (CLOCK, tsc_to_clock(self.tsc, frame.timestamp)))
        blocks += tuple(TsvBlock(number, value) for number, value in stamps if number not in collected)
        if renumber is not None:
            kept = []
            for block in blocks:
                if isinstance(block, TsvBlock):
                    number = renumber(block.number)
                    if number is None:
                        continue
                    block = TsvBlock(number, block.value)
                kept.append(block)
            blocks = tuple(kept)
        return encode_frame(frame.tracepoint, blocks, regblock_size)

    def markers(self) -> list[Marker | SdtMarker]:
        """The kernel's markers, then the program's SDT probes (the gdbserver role's process, `user_space`)."""
        return [*self.machine.image.markers, *self._program_markers()]

    def _program_markers(self) -> tuple[SdtMarker, ...]:
        user = self.user_space
        return user.markers() if user is not None else ()

    def marker_at(self, address: int) -> Marker | SdtMarker | None:
        return next((m for m in self.markers() if m.site == address), None)

    def marker_of_frame(self, frame: TraceFrame) -> Marker | None:
        """The marker a frame's tracepoint enabled (None for dynamic tracepoints)."""
        for (number, address), tp in self.definitions.tracepoints.items():
            if number == frame.tracepoint and tp.static:
                return self.marker_at(address)
        return None

    def rendered_sdata(self, frame: TraceFrame) -> str | None:
        marker = self.marker_of_frame(frame)
        data = frame.static_data()
        return None if marker is None or data is None else render(marker, data)


def _now_us() -> int:
    return time.time_ns() // 1000
