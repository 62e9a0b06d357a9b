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
from dataclasses import dataclass, field

from unicorn import Uc
from unicorn.x86_const import UC_X86_REG_RIP, UC_X86_REG_RSP

from ...agent.abi import CTX_ERROR, CTX_SIZE, CTX_TRACE_PTR, AgentCtx
from ...agent.errors import ErrorCode, EvalError
from ...agent.verify import verify
from ...arch import amd64
from ..core import model as t
from ..core.builtins import builtin_slots, native_slots, percpu_slots, runs_natively
from ..core.frames import StaticBlock, encode_block
from ..core.model import ProbeRow
from ..core.run import Run
from ..core.sdata import build_entry
from ..patching.detour import COUNTERS
from ..patching.placement import Installed, fails_that_way
from ..patching.probes import INT3, ProbeSite, jump, relocate, relocated_size_bound
from .hits import HitContext, interpreted_hit
from .userprobes import Compiled, ProgramProbes


#: Computed built-in variables the compiled engines can refresh at a hit (builtins.native_refresh_asm); a location
#: reading any other computed one runs on the Python hit path (builtins.runs_natively).
NATIVE_BUILTINS = ("gtp_version", "cpu_id", "cpu_number", "current_task", "current_task_pid", "current_thread_info",
                   "current_task_user", "task_pt_regs", "softirq_count", "inferior_pid", "rdtsc", "clock")


@dataclass
class Chain:
    """Compiled locations sharing one address: the site reaches `head`, a link to the first detour."""

    site: ProbeSite
    kind: str  # how the site reaches the head: "jump" or "int3"
    head: int
    tail: int
    members: list[tuple[Installed, int]] = field(default_factory=list)  # (location, its link), in order


class ProbeSet:
    def __init__(self, tracer: Run) -> None:
        self.tracer = tracer
        self.machine = tracer.machine
        self.installed: dict[tuple[int, int], Installed] = {}
        #: address -> the chain of compiled detours of the tracepoints sharing it
        self.chains: dict[int, Chain] = {}
        #: shared addresses whose tracepoints all run in Python (`plan`)
        self.python_at: set[int] = set()
        self.removed: dict[tuple[int, int], Installed] = {}
        #: address -> (out-of-line copy, its end, the tracepoints sharing the int3)
        self.int3_sites: dict[int, tuple[int, int, list[Installed]]] = {}
        #: the tracepoints in the run's program (Run.user_space): int3s in its own memory
        self.program = ProgramProbes(tracer)
        #: hypercall int3s of detours a hit removed (a slow path ending the run, `$disable`): that hit goes on
        #: through the rest of its chain, whose slow paths must still reach the tracer (they find the run over);
        #: dropped when the next run starts
        self.lingering: list[int] = []

    def reset(self) -> None:
        self.installed = {}
        self.removed = {}
        for address in self.lingering:
            self.machine.breakpoints.pop(address, None)
        self.lingering = []

    def code_regions(self) -> list[tuple[int, int]]:
        """The out-of-line copies a hit may be executing (a run waits for RIP to leave them)."""
        return [(copy, end) for copy, end, _ in self.int3_sites.values()]

    # ---- installing --------------------------------------------------------------------------------------

    def _needs_python(self, item: Installed) -> bool:
        """Interpreted engine, while-stepping (single-stepping lives in Python), a variable only Python
        computes, one whose action only Python performs (printk.attach), a return probe (its entry hijacks the
        return in Python: kret.py), or a program's static tracepoint (its SDT probe's `$_sdata`, sdt.py)."""
        return self.tracer.native is None or bool(item.tracepoint.step_count) or item.hit_context is not None \
            or item.kret is not None or not runs_natively(self.tracer, item.programs(), NATIVE_BUILTINS) \
            or (item.space is not None and item.marker is not None)

    def plan(self, items: list[Installed]) -> None:
        """tstart, before installing `items`: at an address shared with a location that needs Python, every
        location there runs in Python (one int3 for all); the others of a shared address form a chain."""
        self.python_at = {item.site.address for item in items if item.shared and self._needs_python(item)}
        # a program's tracepoints sharing an address share its int3 on the Python path (userprobes.py)
        program = [item.site.address for item in items if item.space is not None]
        self.python_at |= {address for address in program if program.count(address) > 1}

    def install(self, item: Installed) -> None:
        if item.space is not None:  # a program's: a pad and a call gate, else an int3 in its memory (userprobes.py)
            self._join_program(item)
            compiled = None
            native = self.tracer.native
            if native is not None and not item.shared and item.site.address not in self.python_at \
                    and not self._needs_python(item):
                condition = native.pad_condition(item.condition, self._slots(item))
                # a condition the pad decides is true in the detour: it records the frame at once (the short path)
                compiled = Compiled(native, lambda: self._build(item, from_user=True,
                                                                condition_in_pad=condition is not None), condition)
            self.program.install(item, compiled)
            self.installed[item.tracepoint.key] = item
            return
        address = item.site.address
        if item.shared:
            self._join_kernel(item)
        python = self._needs_python(item) or address in self.python_at
        if item.shared and (python or address in self.int3_sites):
            python = True
        if not python:
            if item.shared:
                self._install_chained(item)
            else:
                self._install_native(item)
            return
        site = item.site
        if item.kret is not None:
            self.tracer.kret.install(item)  # its trampolines, before the site can be hit
        group = self.int3_sites.get(site.address)
        if group is None:  # the first tracepoint here: one int3 and one out-of-line copy for all of them
            out_of_line = self.machine.alloc_code(relocated_size_bound(site.displaced) + 5)
            body = relocate(site.displaced, out_of_line)
            body += jump(out_of_line + len(body), site.resume_address)
            self.machine.write_memory(out_of_line, body)
            group = self.int3_sites[site.address] = (out_of_line, out_of_line + len(body), [])
            self.machine.breakpoints[site.address] = lambda uc, items=group[2]: self._hit_all(uc, items)
            self.machine.write_memory(site.address, INT3)
            # the int3 stands for the instructions the copy runs (the machine's performance counters)
            self.machine.run_on_cpu(lambda uc: self.machine.counters.stand_in(site.address, len(INT3),
                                                                              site.resume_address))
        item.out_of_line = group[0]
        group[2].append(item)
        self.installed[item.tracepoint.key] = item

    def _join_kernel(self, item: Installed) -> None:
        """A kernel tracepoint added during the run at an address whose tracepoints run compiled (resolve_overlaps
        gave it their site): when it needs Python they all leave their detours for the int3 they then share with
        it (counters kept); a location running compiled alone becomes the head of a chain, the site patched from
        its detour to the chain's over it (text_poke's way, no hit passing unprobed), its counters carried over."""
        address = item.site.address
        chain = self.chains.get(address)
        if chain is not None:
            compiled = [member for member, _ in chain.members]
        else:
            compiled = [i for i in self.installed.values() if i.space is None and i.site.address == address
                        and i.native is not None and i is not item]
        if not compiled:
            return
        native = self.tracer.native
        assert native is not None
        if self._needs_python(item):
            for joined in compiled:
                self._remove_probe(joined)
                joined.native, joined.shared = None, True
            self.python_at.add(address)
            for joined in compiled:
                self.install(joined)
            return
        if chain is not None:
            return  # the newcomer goes last in the chain (`_install_chained`)
        alone = compiled[0]
        old = alone.native
        alone.shared = True
        self._install_chained(alone)  # its new detour ends in the chain's link; the site sent to the chain
        native.release(old)
        self._drop_hypercalls(old)
        fired, hits, usage = native.counters(old)
        moved = native.counters(alone.native)
        self.machine.write_memory(alone.native.counters, COUNTERS.pack(fired + moved[0], hits + moved[1],
                                                                        usage + moved[2], 0))

    def _join_program(self, item: Installed) -> None:
        """A program's tracepoint added during the run where another runs compiled: that one leaves its pad for
        the Python path (its counters kept), where both then share the int3 or the fast tracepoint's pad, as
        tracepoints sharing an address from tstart do (`plan`)."""
        address = item.site.address
        joined = self.program.compiled_at(address)
        if joined is None:
            return
        self._remove_probe(joined)
        joined.native = None
        self.python_at.add(address)
        self.program.install(joined)

    def _hit_all(self, uc: Uc, items: list[Installed]) -> None:
        for item in list(items):
            if any(armed is item for armed in items):  # not switched off by an earlier one's $disable
                hit = interpreted_hit if item.kret is None else self.tracer.kret.enter  # a return probe: hijack
                self.tracer.kgtp.timed(lambda item=item, hit=hit: hit(self.tracer, uc, item))

    def _install_native(self, item: Installed) -> None:
        native = self.tracer.native
        assert native is not None
        probe = self._build(item)
        native.patch(item.site, probe, item.want_jump)
        self.installed[item.tracepoint.key] = item

    def _install_chained(self, item: Installed) -> None:
        """One detour more in the chain of the item's address, after the others (kprobes' aggregated probes):
        the site jumps to the chain's head link, each detour ends by jumping through its own link to the next
        detour, the last one to the shared tail (the displaced instructions and the jump back)."""
        native = self.tracer.native
        assert native is not None
        site = item.site
        chain = self.chains.get(site.address)
        new = chain is None
        if chain is None:
            tail = native.shared_tail(site)
            chain = self.chains[site.address] = Chain(site, "", native.chain_link(tail), tail)
        link = native.chain_link(chain.tail)
        probe = self._build(item, continue_to=link)
        native.relink(chain.members[-1][1] if chain.members else chain.head, probe.detour.base)
        chain.members.append((item, link))
        if new:  # the site last, once the chain is complete
            chain.kind = native.patch_to(site, chain.head, item.want_jump)
        probe.kind = chain.kind
        self.installed[item.tracepoint.key] = item

    def _slots(self, item: Installed) -> tuple[tuple[int, str], ...]:
        """The computed built-in and per-CPU variables the location's detour refreshes at a hit."""
        return native_slots(self.tracer, builtin_slots(item.programs())) + percpu_slots(self.tracer, item.programs())

    def _build(self, item: Installed, continue_to: int | None = None, from_user: bool = False,
               condition_in_pad: bool = False):
        """The location's detour and its hypercalls (not yet reachable from the site; `from_user`: a program's,
        entered from its pad through a call gate; `condition_in_pad`: only once the pad found its condition
        true)."""
        native = self.tracer.native
        assert native is not None
        tp = item.tracepoint
        probe = native.build(
            item.site, tp.number, None if condition_in_pad else item.condition, item.actions, tp.pass_count,
            self._slots(item),
            lambda code: verify(code), marker=item.marker,
            frame_room=self.tracer.frame_room(), continue_to=continue_to, from_user=from_user,
        )
        item.native = probe
        self._hypercalls(item)
        return probe

    def _hypercalls(self, item: Installed) -> None:
        assert item.native is not None
        detour = item.native.detour
        self.machine.breakpoints[detour.error_call] = lambda uc, item=item: self._hypercall_error(uc, item)
        self.machine.breakpoints[detour.full_call] = lambda uc, item=item: self._hypercall_full(uc, item)
        if detour.pass_call:
            self.machine.breakpoints[detour.pass_call] = lambda uc, item=item: self._hypercall_pass(uc, item)
        for address in detour.sdata_calls:
            self.machine.breakpoints[address] = lambda uc, item=item: self._hypercall_sdata(uc, item)

    def resume(self, item: Installed) -> bool:
        """A compiled location switched off and on again in one run (`$disable`/`$enable`, QTDisable/QTEnable):
        its detour is still in module space (code is retired when the run ends), so the site goes back to it,
        counters and all, with no compiling and no new allocation. False when that cannot be: it ran in Python
        or shared its address, or another location now has its address."""
        native = self.tracer.native
        address = item.site.address
        if native is None or item.native is None or item.shared or item.space is not None or address in self.chains or \
                address in self.int3_sites or any(i.site.address == address for i in self.installed.values()):
            return False
        self._hypercalls(item)
        native.resume(item.site, item.native, item.want_jump)
        self.installed[item.tracepoint.key] = item
        return True

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
        if item.space is not None:
            self.program.remove(item)  # a compiled one's counters kept in the item
            if item.native is not None:
                self._drop_hypercalls(item.native)
            return
        if item.kret is not None:
            self.tracer.kret.remove(item)  # pending returns go on natively
        native = self.tracer.native
        if item.native is not None:
            assert native is not None
            probe = item.native
            chain = self.chains.get(item.site.address)
            if chain is not None:
                self._unchain(chain, item)
                native.release(probe)
            else:
                native.unpatch(item.site, probe)
            self._drop_hypercalls(probe)
            item.fired, item.hits, item.usage = native.counters(probe)
            return
        group = self.int3_sites.get(item.site.address)
        if group is not None and item in group[2]:
            group[2].remove(item)
            if group[2]:
                return  # other tracepoints still use this int3
            del self.int3_sites[item.site.address]
        self.machine.write_memory(item.site.address, item.site.original)
        self.machine.run_on_cpu(lambda uc: self.machine.counters.stand_in_removed(item.site.address, len(INT3)))
        self.machine.breakpoints.pop(item.site.address, None)
        if group is not None:  # a preempted task may still be inside the copy
            self.tracer.retired.add([(group[0], group[1])])

    def _drop_hypercalls(self, probe) -> None:
        detour = probe.detour
        calls = (detour.error_call, detour.full_call, detour.pass_call, *detour.sdata_calls)
        if self.machine.cpu.in_emulation:  # asked by a hit, which may be in this detour or before it
            self.lingering += calls
        else:
            for address in calls:
                self.machine.breakpoints.pop(address, None)

    def _unchain(self, chain: Chain, item: Installed) -> None:
        """The link that led to this detour now leads where its own link led; an empty chain frees the site.
        A task preempted inside the detour finishes it and goes on through its link, still valid."""
        native = self.tracer.native
        assert native is not None
        index = next(i for i, (member, _) in enumerate(chain.members) if member is item)
        previous = chain.members[index - 1][1] if index else chain.head
        native.relink(previous, native.link_target(self.machine, chain.members[index][1]))
        del chain.members[index]
        if not chain.members:
            native.unpatch_site(chain.site, chain.kind)
            del self.chains[chain.site.address]

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
        if item.space is not None and item.tracepoint.key in self.installed:
            return self.program.counters(item)
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
            function = item.site.function if item.kret is None else self.tracer.kret.describe(item, item.site.function)
            rows.append(ProbeRow(item.tracepoint.number, item.site.address, kind,
                                 item.tracepoint.key in self.installed, fired, hits, usage, function))
        return rows
