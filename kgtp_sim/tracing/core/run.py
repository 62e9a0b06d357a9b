"""The run as the layers above the vocabulary see it: what a hit path, the installer and KGTP's features may use
of the trace run they serve.

`tracer.Tracer` is the one implementation; it composes the layers that speak to this protocol, so none of them
imports it (tracing/ is layered: core, patching, engines, kgtp, then the tracer; docs/DESIGN.md). The parts of
the run that belong to a higher layer (the compiled engine's state, the return probes, the watches, the
stepper) and KGTP's variable state, whose module is built on this protocol, are typed `Any` here with their
owner named: a lower layer may hand them on but never relies on their
type. Everything is used on the CPU thread, inside a hit or a run change (`Tracer._between_hits`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ...agent.errors import EvalError
from ...agent.verify import Program
from ...machine import Machine
from .clock import Tsc
from .model import Definitions, StopReason, Tracepoint
from .percpu import PerCpuVariables
from .perf import PerfEvents
from .predefined import PredefinedVariables
from .ring import Rings

if TYPE_CHECKING:
    from .sdt import SdtMarker


class UserSpace(Protocol):
    """A program's address space the run may probe (the gdbserver role's process): tracepoints at its addresses
    live in it only. Used on the CPU thread (`prepare` on the server thread, before tstart)."""

    #: the space's CR3 root: a hit is the program's when the CPU that took it has this space loaded
    root: int

    def holds(self, address: int) -> bool:
        """Is `address` one of the program's (its user half)?"""
        ...

    def prepare(self, addresses: list[int], fast: list[int] = (), data: list[tuple[int, int]] = (),
                pads: list[int] = ()) -> None:
        """Before tstart, on the server thread: make the pages of `addresses` present (the program stopped), and
        map a jump pad area within reach of each address in `fast` (its fast tracepoints) that has none yet, and
        where there is room of each address in `pads` (a compiled hit's pad: without one it takes the Python path); the
        pages of the `data` ranges (address, length) the actions collect at fixed addresses present where the
        program maps them (a hit reads memory as it is and cannot fault a page in; a range nothing maps is left
        alone: collected as unavailable)."""
        ...

    def pad_area(self, address: int) -> tuple[int, int] | None:
        """(start, size) of a jump pad area within a rel32 jump of `address` (mapped by `prepare`), or None."""
        ...

    def space(self) -> Any:
        """The uc_paging.AddressSpace of the program's page tables."""
        ...

    def markers(self) -> tuple[SdtMarker, ...]:
        """The program's static tracepoint markers (its SDT probes, sdt.py), where the process has them."""
        ...


def prepare_program(user: UserSpace, tracepoints: list[Tracepoint], compiled: bool = False) -> None:
    """`UserSpace.prepare` for these tracepoints: their code's pages in the program, jump pad areas for its fast
    tracepoints (for every one of them when the run's engine is `compiled`: their hits' pads), the pages of the
    program's globals any of them collects."""
    mine = [tp for tp in tracepoints if user.holds(tp.address)]
    user.prepare([tp.address for tp in mine], fast=[tp.address for tp in mine if tp.fast_insn_length is not None],
                 data=[r for tp in tracepoints for r in tp.absolute_ranges() if user.holds(r[0])],
                 pads=[tp.address for tp in mine] if compiled else [])


class Run(Protocol):
    """One trace run: its definitions, buffer, clock and variables, and the few decisions only the run makes."""

    machine: Machine
    definitions: Definitions
    #: True between tstart and the stop; a hit of a stopped run records nothing
    running: bool
    ring: Rings | None
    tsc: Tsc
    #: bytes of blocks one frame may hold in this run (fixed at tstart)
    room: int
    #: what direct output printed on the kernel's console (kgtp.printk)
    printed: list[str]
    kgtp: Any  # core.builtins.KgtpState: what KGTP's special variables keep across hits
    per_cpu: PerCpuVariables
    perf: PerfEvents  #: KGTP's perf-event variables on the machine's counters
    predefined: PredefinedVariables  #: the target's own variables besides KGTP's (gdbserver's $trace_timestamp)
    native: Any  # engines.native.CompiledRun, or None under the interpreting engine
    retired: Any  # patching.retire.RetiredCode: code freed once no CPU can be in it
    registers: Any  # engines.fastregs.RegisterReader: the registers of a hit
    stepper: Any  # engines.hits.Stepper: while-stepping
    kret: Any  # kgtp.kret.KretRun: return probes
    watches: Any  # kgtp.watch.Watches: watch tracepoints
    #: the program whose addresses tracepoints may name besides the kernel's (None: the kernel's only)
    user_space: UserSpace | None
    #: KGTP's $inferior_pid: the process GDB debugs (the gdbserver role's program), 0 for none
    inferior_pid: int

    def stop(self, reason: StopReason, note: str | None = None, tracepoint: int = 0) -> None: ...

    def check(self, error: EvalError | None, tp: Tracepoint) -> bool:
        """True when there is no error; else the run stops with `terror` and the hit ends."""
        ...

    def lost_block(self, error: EvalError | None, program: Program) -> bool: ...

    def variable_value(self, number: int, hit: Any = None) -> int | None: ...

    def set_variable(self, number: int, value: int, hit: Any = None) -> None: ...

    def frame_room(self) -> int: ...

    def is_armed(self, key: tuple[int, int]) -> bool: ...

    def arm(self, tp: Tracepoint) -> None: ...

    def disarm(self, key: tuple[int, int]) -> None: ...

    def dump_stack(self, ctx: Any) -> None:
        """`$dump_stack`: print the hit's backtrace on the kernel's console (`ctx`: a builtins.BuiltinContext)."""
        ...
