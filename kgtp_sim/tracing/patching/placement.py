"""Placement: from a defined location to a planned probe, before anything is written into the kernel.

At tstart (and for a location armed during a run) each enabled tracepoint's bytecode is verified, its probe is
planned (a 5-byte jump where it is safe and wanted, else an int3), and the plans are checked against each other
so that no probe patches over another. Nothing here touches the machine's memory; the result, `Installed`, is
what `installer.py` then puts into the kernel. Runs on the CPU thread (inside `Tracer.start`/`arm`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...agent.errors import BytecodeError, ErrorCode
from ...agent.verify import Program, verify
from ...machine import KernelImage, Marker
from ..core import model as t
from ..core.builtins import BUILTIN_VARIABLES, check_access, expand_bt
from ..core.model import TraceError, Tracepoint
from .probes import ProbePlacementError, ProbeSite, plan_probe


@dataclass
class Installed:
    """A tracepoint location armed in the kernel (or planned to be), with its run's counters."""

    tracepoint: Tracepoint
    site: ProbeSite
    condition: Program | None
    actions: list[tuple[t.Action, Program | None]]
    out_of_line: int = 0  # int3 path: the relocated copy of the probed instruction
    native: Any = None  # compiled engines: the detour and its counters (engines.native.NativeProbe)
    want_jump: bool = False
    stepping: list[tuple[t.Action, Program | None]] = field(default_factory=list)
    marker: Marker | None = None  # static tracepoints: the TRACE_EVENT site they enable
    shared: bool = False  # another tracepoint has the same address: they share one probe (resolve_overlaps)
    hit_context: Any = None  # kgtp.printk.attach: the hit context of direct output, $enable/$disable, $current
    kret: Any = None  # a return probe (`$kret`): its return side (kgtp.kret.KretProbe)
    #: a tracepoint in a program: the program's address space (uc_paging.AddressSpace), whose int3 it is; None:
    #: the kernel's
    space: Any = None
    fired: int = 0
    hits: int = 0
    usage: int = 0

    def programs(self) -> list[Program]:
        """The condition and every action's program, in the order a hit runs them."""
        return [p for p in (self.condition, *(p for _, p in self.actions)) if p is not None]


def prepare(
    tp: Tracepoint, image: KernelImage, tsv_slots: int, *, compiled: bool, probe: str, marker: Marker | None,
    space: Any = None,
) -> Installed:
    """Verify a location's bytecode and plan its probe. `compiled`: a native engine runs it (and so wants a jump
    where `probe` is "auto"); `marker`: the static marker at its address, if any; `space`: the program's address
    space when the address is a program's (an int3 there, hit on the Python path)."""
    where = f"tracepoint {tp.number} at {tp.address:#x}"
    try:
        condition = verify(tp.condition, tsv_slots=tsv_slots, require_value=True) if tp.condition else None
    except BytecodeError as error:
        raise TraceError(f"{where}: condition rejected: {error}") from None
    actions = verified_actions(tp.actions, tsv_slots, f"{where}: action")
    stepping = verified_actions(tp.stepping_actions, tsv_slots, f"{where}: while-stepping action")
    check_access([p for p in (condition, *(p for _, p in actions + stepping)) if p is not None], where)
    # KGTP's `collect $bt`: also the registers and $bt bytes of stack from rsp, so GDB can unwind the frame
    actions, stepping = expand_bt(actions, tsv_slots, verify), expand_bt(stepping, tsv_slots, verify)
    if tp.step_count and tp.fast_insn_length is not None:
        raise TraceError(f"{where}: while-stepping needs single-stepping; use trace, not ftrace")
    if tp.static:
        if marker is None:
            raise TraceError(f"{where}: no static tracepoint marker at this address")
    else:
        marker = None
        if any(isinstance(a, t.CollectStaticData) for a in tp.actions):
            raise TraceError(f"{where}: $_sdata exists only at static tracepoints (strace)")
    if space is not None:  # its instruction is read from the program's memory when installed (userprobes.py)
        fast = tp.fast_insn_length is not None
        site = ProbeSite(tp.address, "(program)", "jump" if fast else "int3", (), b"")
        return Installed(tp, site, condition, actions, want_jump=fast, stepping=stepping, marker=marker,
                         space=space)
    want_jump = ((compiled and probe == "auto") or tp.fast_insn_length is not None) and not tp.step_count
    try:
        site = plan_probe(image, tp.address, "jump" if want_jump else "int3")
    except ProbePlacementError as error:
        if tp.fast_insn_length is not None:  # ftrace: a jump or nothing, as gdbserver's fast tracepoints
            raise TraceError(f"{where}: fast tracepoint impossible: {error}") from None
        try:
            site = plan_probe(image, tp.address, "int3")
        except ProbePlacementError as error2:
            raise TraceError(f"{where}: {error2}") from None
        want_jump = False
    return Installed(tp, site, condition, actions, want_jump=want_jump, stepping=stepping, marker=marker)


def resolve_overlaps(image: KernelImage, new: list[Installed], armed: list[Installed]) -> None:
    """Probes must not patch over each other (as kprobes refuses to optimize over another probe).

    Several tracepoints at one address (GDB allows it) share one probe, as kprobes aggregates probes: they are
    marked `shared` and get the same site, a jump when every one of them wants it, and run in definition order
    (compiled: a chain of detours; else one int3 in Python). A tracepoint added during a run joins the probe
    already at its address (ProbeSet.install: a lone compiled probe becomes a chain's head).
    A jump whose window covers another probe's address becomes an int3 (re-planned: its detour then runs only
    the one instruction); a probe inside an armed jump's window is refused with a message. A program's
    tracepoints are not the kernel's concern here: they share their int3 in the program (engines/userprobes.py).
    """
    new = [item for item in new if item.space is None]
    armed = [item for item in armed if item.space is None]
    armed_at: dict[int, list[Installed]] = {}
    for item in armed:
        armed_at.setdefault(item.site.address, []).append(item)
    new_at: dict[int, list[Installed]] = {}
    for item in new:
        new_at.setdefault(item.site.address, []).append(item)
    addresses = set(new_at) | set(armed_at)
    for address, items in new_at.items():
        others = armed_at.get(address, [])
        if len(items) + len(others) < 2:
            continue
        if others:  # join the armed probe: its site, its kind (installer.py turns a lone compiled one into a chain)
            first = others[0]
            site, jumps = first.site, first.want_jump
        else:
            site, jumps = None, all(item.want_jump for item in items)
            if jumps:
                try:
                    site = plan_probe(image, address, "jump")
                except ProbePlacementError:
                    jumps = False
            if site is None:
                site = plan_probe(image, address, "int3")
        for item in items:
            if item.tracepoint.fast_insn_length is not None and not jumps:
                raise TraceError(f"tracepoint {item.tracepoint.number} at {address:#x}: fast tracepoint "
                                 "impossible: the probe shared at this address cannot be a jump")
            item.shared, item.site, item.want_jump = True, site, jumps
        for other in others:
            other.shared = True
    for item in new:
        where = f"tracepoint {item.tracepoint.number} at {item.site.address:#x}"
        for other in armed:
            if other.native is not None and other.native.kind == "jump" and \
                    other.site.address < item.site.address < other.site.address + other.site.length:
                raise TraceError(f"{where}: inside the 5-byte jump of tracepoint {other.tracepoint.number}")
        if item.site.kind == "jump" and item.site.address not in armed_at:
            window = range(item.site.address + 1, item.site.address + item.site.length)
            if any(address in window for address in addresses):
                if item.tracepoint.fast_insn_length is not None:
                    raise TraceError(f"{where}: fast tracepoint impossible: another probe inside its window")
                item.site = plan_probe(image, item.site.address, "int3")
                item.want_jump = False


def verified_actions(actions: list[t.Action], tsv_slots: int, what: str) -> list[tuple[t.Action, Program | None]]:
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


_FAILING_OPS = {
    ErrorCode.DIVIDE_BY_ZERO: {"div_signed", "div_unsigned", "rem_signed", "rem_unsigned"},
    ErrorCode.DIVIDE_OVERFLOW: {"div_signed", "rem_signed"},
    ErrorCode.MEMORY_FAULT: {"ref8", "ref16", "ref32", "ref64", "trace", "trace_quick", "trace16", "tracenz"},
}


def fails_that_way(program: Program, offset: int, code: ErrorCode) -> bool:
    """Could `program`'s op at `offset` raise `code`? (Tells which of a location's programs a native error
    came from, so the message names the op like the interpreter's does.)"""
    if offset not in program.index:
        return False
    names = _FAILING_OPS.get(code)
    return names is None or program.at(offset).name in names
