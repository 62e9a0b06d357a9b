"""Installation: planned locations written into the kernel as probes, their hypercalls, and their removal.

A location runs compiled (a detour reached by a jump or an int3, `native.py`) when the run has a native engine
and nothing needs Python at the hit (no while-stepping, no other tracepoint at the same address); otherwise it
gets an int3 whose handler is `hits.interpreted_hit`, one int3 and one out-of-line copy shared by every
tracepoint at that address. The compiled detours call back into Python only on slow paths, through int3
"hypercalls": an error, a full buffer, a reached passcount, `$_sdata`.

Owns the armed locations (`installed`) and the ones removed during or after the run (kept so that `qTP` can
still report their counters). Runs on the CPU thread (`Tracer` calls it under `run_on_cpu`).
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from unicorn import Uc
from unicorn.x86_const import UC_X86_REG_RIP, UC_X86_REG_RSP

from ..agent.abi import CTX_ERROR, CTX_SIZE, CTX_TRACE_PTR, AgentCtx
from ..agent.errors import ErrorCode, EvalError
from ..agent.verify import verify
from ..arch import amd64
from . import model as t
from .detour import COUNTERS
from .frames import StaticBlock, encode_block
from .hits import HitContext, interpreted_hit
from .model import ProbeRow, TraceError
from .placement import Installed, builtin_slots, fails_that_way
from .probes import INT3, jump, relocate, relocated_size_bound
from .sdata import build_entry

if TYPE_CHECKING:
    from .tracer import Tracer

#: Computed built-in variables the compiled engines can refresh at a hit.
NATIVE_BUILTINS = ("cpu_id", "current_task", "current_task_pid", "rdtsc", "clock")


class ProbeSet:
    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.machine = tracer.machine
        self.installed: dict[tuple[int, int], Installed] = {}
        self.removed: dict[tuple[int, int], Installed] = {}
        #: address -> (out-of-line copy, its end, the tracepoints sharing the int3)
        self.int3_sites: dict[int, tuple[int, int, list[Installed]]] = {}

    def reset(self) -> None:
        self.installed = {}
        self.removed = {}

    def code_regions(self) -> list[tuple[int, int]]:
        """The out-of-line copies a hit may be executing (a run waits for RIP to leave them)."""
        return [(copy, end) for copy, end, _ in self.int3_sites.values()]

    # ---- installing --------------------------------------------------------------------------------------

    def install(self, item: Installed) -> None:
        if self.tracer.native is not None and not item.tracepoint.step_count and not item.shared:
            self._install_native(item)
            return
        site = item.site
        group = self.int3_sites.get(site.address)
        if group is None:  # the first tracepoint here: one int3 and one out-of-line copy for all of them
            out_of_line = self.machine.alloc_code(relocated_size_bound(site.displaced) + 5)
            body = relocate(site.displaced, out_of_line)
            body += jump(out_of_line + len(body), site.resume_address)
            self.machine.write_memory(out_of_line, body)
            group = self.int3_sites[site.address] = (out_of_line, out_of_line + len(body), [])
            self.machine.breakpoints[site.address] = lambda uc, items=group[2]: self._hit_all(uc, items)
            self.machine.write_memory(site.address, INT3)
        item.out_of_line = group[0]
        group[2].append(item)
        self.installed[item.tracepoint.key] = item

    def _hit_all(self, uc: Uc, items: list[Installed]) -> None:
        for item in list(items):
            interpreted_hit(self.tracer, uc, item)

    def _install_native(self, item: Installed) -> None:
        native = self.tracer.native
        assert native is not None
        tp = item.tracepoint
        slots = builtin_slots(item.programs())
        if any(kind not in NATIVE_BUILTINS for _, kind in slots):
            raise TraceError(f"tracepoint {tp.number}: unsupported built-in variable")
        probe = native.build(
            item.site, tp.number, item.condition, item.actions, tp.pass_count, slots,
            self.machine.image.address_of("current"), lambda code: verify(code), marker=item.marker,
            frame_room=self.tracer.frame_room(),
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

    def restore_counters(self, item: Installed, earlier: Installed) -> None:
        """A location re-enabled in the same run goes on counting from where it was."""
        item.fired, item.hits, item.usage = earlier.fired, earlier.hits, earlier.usage
        if item.native is not None:
            self.machine.write_memory(item.native.counters, COUNTERS.pack(item.fired, item.hits, item.usage, 0))

    # ---- hypercalls: int3s inside a detour, reached only on the slow paths --------------------------------

    @staticmethod
    def _resume_after(uc: Uc) -> None:
        uc.reg_write(UC_X86_REG_RIP, uc.reg_read(UC_X86_REG_RIP) + 1)

    def _hypercall_error(self, uc: Uc, item: Installed) -> None:
        self._resume_after(uc)
        native = self.tracer.native
        assert native is not None
        ctx = AgentCtx.unpack(bytes(uc.mem_read(native.ctx, CTX_SIZE)))
        uc.mem_write(native.ctx + CTX_ERROR, bytes(16))
        code = ErrorCode(ctx.error)
        program = next((p for p in item.programs() if fails_that_way(p, ctx.error_pc, code)), None)
        error = EvalError.make(code, ctx.error_pc, program.code if program else b"", ctx.fault_addr or None)
        self.tracer.check(error, item.tracepoint)

    def _hypercall_sdata(self, uc: Uc, item: Installed) -> None:
        """`collect $_sdata` in a native detour: build the entry from the saved block (at %rsp) into the frame."""
        self._resume_after(uc)
        native = self.tracer.native
        assert native is not None and item.marker is not None
        block = amd64.decode_registers(bytes(uc.mem_read(uc.reg_read(UC_X86_REG_RSP), amd64.G_PACKET_SIZE)))
        regs = [block[r.name] for r in amd64.GENERAL_REGISTERS]
        hit = HitContext(uc, regs, self.tracer, marker=item.marker)
        data = encode_block(StaticBlock(build_entry(item.marker, regs, hit.try_read)))
        ptr, limit = struct.unpack("<QQ", bytes(uc.mem_read(native.ctx + CTX_TRACE_PTR, 16)))
        if ptr + len(data) <= limit:
            uc.mem_write(ptr, data)
            uc.mem_write(native.ctx + CTX_TRACE_PTR, struct.pack("<Q", ptr + len(data)))

    def _hypercall_full(self, uc: Uc, item: Installed) -> None:
        self._resume_after(uc)
        ring = self.tracer.ring
        if ring is not None and ring.state().full:
            self.tracer.stop(t.StopReason.BUFFER_FULL)

    def _hypercall_pass(self, uc: Uc, item: Installed) -> None:
        self._resume_after(uc)
        self.tracer.stop(t.StopReason.PASSCOUNT, tracepoint=item.tracepoint.number)

    # ---- removing ------------------------------------------------------------------------------------------

    def remove(self, key: tuple[int, int]) -> None:
        """Take one location's probe out during a run; its counters stay readable."""
        item = self.installed.pop(key, None)
        if item is not None:
            self._remove_probe(item)
            self.removed[key] = item

    def _remove_probe(self, item: Installed) -> None:
        native = self.tracer.native
        if item.native is not None:
            assert native is not None
            probe = item.native
            native.unpatch(item.site, probe)
            for address in (probe.detour.error_call, probe.detour.full_call, probe.detour.pass_call,
                            *probe.detour.sdata_calls):
                self.machine.breakpoints.pop(address, None)
            item.fired, item.hits, item.usage = native.counters(probe)
            return
        group = self.int3_sites.get(item.site.address)
        if group is not None and item in group[2]:
            group[2].remove(item)
            if group[2]:
                return  # other tracepoints still use this int3
            del self.int3_sites[item.site.address]
        self.machine.write_memory(item.site.address, item.site.original)
        self.machine.breakpoints.pop(item.site.address, None)
        if group is not None:  # a preempted task may still be inside the copy
            self.tracer.retired.add([(group[0], group[1])])

    def remove_all(self) -> None:
        for item in self.installed.values():
            self._remove_probe(item)
        native = self.tracer.native
        if native is not None:
            self.tracer.retired.add(native.code_regions)
            native.code_regions = []
        # the usage counters stay readable for qTP after the run: keep the records, drop the probes
        self.removed.update(self.installed)
        self.installed = {}

    # ---- counters ------------------------------------------------------------------------------------------

    def counters(self, item: Installed) -> tuple[int, int, int]:
        """(fired, hits, bytes) of a location, live from native memory while it is armed."""
        native = self.tracer.native
        if item.native is not None and native is not None and item.tracepoint.key in self.installed:
            return native.counters(item.native)
        return item.fired, item.hits, item.usage

    def find(self, key: tuple[int, int]) -> Installed | None:
        return self.installed.get(key) or self.removed.get(key)

    def rows(self) -> list[ProbeRow]:
        rows = []
        for item in list(self.installed.values()) + list(self.removed.values()):
            fired, hits, usage = self.counters(item)
            kind = item.native.kind if item.native is not None else "int3"
            rows.append(ProbeRow(item.tracepoint.number, item.site.address, kind,
                                 item.tracepoint.key in self.installed, fired, hits, usage, item.site.function))
        return rows
