"""The combination suite's space: its dimensions (`DIMENSIONS`), one combination (`Combination`, its one-line spec
and back), the choices another choice makes moot (`normalize`), the pairs KGTP refuses at tstart with its reason
(`refusal`), the seeded walk (`generate`, `walk`), and the packets GDB would send for a combination: its
tracepoint's definition and actions (`definitions`), and the tracepoint added during a run (`added_definition`).

The first dimension is the space: the kernel's (kgtp_test_function, KGTP mode) or a process's (the program
fixtures/combinations/callers.c under the gdbserver role: its counted_function, whose first instruction counts the
call in `counter` as the kernel's counts kgtp_counter; process.py). A program's tracepoints run on the Python hit
path in every engine, so there the dimensions mean: `jump` a fast tracepoint (`ftrace`: a jump into a pad the
process maps), `int3` a trap tracepoint, `shared` a fast one and a trap one at one address (the pad's hit runs
both), `marker` a trap tracepoint at the first instruction after the count (a program has no static markers: the
place the kernel's marker has, after the add), `stepping` while-stepping (a trap tracepoint: steps need one);
`$kret` and watch tracepoints are the kernel's and refused there with their reason; the stepper beside goes to the
program's round_end (called after each round), the four watches beside stay on the kernel's variables (tracepoints
in the kernel and the program share one run), and `$_sdata` is a global.

Pure data and functions, on the caller's thread.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace

from ...agent.opcodes import assemble
from ...client import VMLINUX
from ...machine import KernelImage
from ...tracing.core.builtins import BUILTIN_VARIABLES

# ---- the space -----------------------------------------------------------------------------------------------

DIMENSIONS: dict[str, tuple] = {
    "space": ("kernel", "process"),
    "engine": ("interp", "naive", "opt"),
    "path": ("jump", "int3", "shared", "marker", "stepping", "kret", "watch"),
    "cpus": (1, 2, 4),
    "buffer": ("linear", "circular", "fill"),
    "condition": ("none", "true", "false", "fault"),
    "action": ("registers", "$regs", "$args", "global", "memory", "sdata", "bt", "teval", "percpu", "kgtp",
               "disable"),
    "passcount": (0, 3),
    "change": ("none", "toggle", "add"),
    "beside": ("none", "stepping", "watches"),
    "ending": ("tstop", "disconnect"),
}


@dataclass(frozen=True)
class Combination:
    space: str = "kernel"
    engine: str = "opt"
    path: str = "jump"
    cpus: int = 2
    buffer: str = "linear"
    condition: str = "none"
    action: str = "global"
    passcount: int = 0
    change: str = "none"
    beside: str = "none"
    ending: str = "tstop"

    def spec(self) -> str:
        """One line: `space=kernel engine=opt path=jump ...`, what `--only` takes back."""
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    @classmethod
    def parse(cls, spec: str) -> Combination:
        values: dict[str, object] = {}
        for word in spec.replace(",", " ").split():
            name, _, value = word.partition("=")
            if name not in DIMENSIONS:
                raise ValueError(f"no dimension {name!r} (dimensions: {', '.join(DIMENSIONS)})")
            choice = int(value) if isinstance(DIMENSIONS[name][0], int) else value
            if choice not in DIMENSIONS[name]:
                raise ValueError(f"{name}={value}: not one of {DIMENSIONS[name]}")
            values[name] = choice
        return cls(**values)  # type: ignore[arg-type]


def normalize(c: Combination) -> Combination:
    """Settle the choices another choice makes moot, so a spec says what ran.

    A run that ends itself (a pass count, a faulting condition, a buffer that fills, `$disable`) has no change
    during it and ends with tstop; `$_sdata` exists only at a marker (elsewhere the action is a global); a watch
    tracepoint collects `$watch_val`, so the action kinds that need the hit's own registers at the function
    (`$args`, `memory`, `bt`) become a global there, as for a return probe (whose registers are the return's). A
    program has no static markers: `$_sdata` is a global there too."""
    if c.action == "sdata" and (c.path != "marker" or c.space == "process"):
        c = replace(c, action="global")
    if c.path in ("watch", "kret") and c.action in ("$args", "memory", "bt", "disable"):
        c = replace(c, action="global")
    if c.condition == "fault" or c.buffer == "fill" or c.passcount or c.action == "disable":
        c = replace(c, change="none")
    if c.condition in ("false", "fault") and c.buffer == "fill":  # a buffer that never fills
        c = replace(c, buffer="linear")
    if c.condition in ("false", "fault") or c.action == "disable" or c.buffer == "fill":
        c = replace(c, passcount=0)
    if c.condition == "fault" or c.action == "disable":
        c = replace(c, buffer="linear" if c.buffer == "fill" else c.buffer)
    return c


def refusal(c: Combination) -> str | None:
    """KGTP's reason for refusing this combination at tstart (a regular expression), or None. In a process, a
    return probe and a watch tracepoint are the kernel's (refused before anything else is looked at)."""
    if c.space == "process" and c.path == "kret":
        return r"\$?kret is a return probe of a kernel function .*: a tracepoint in the program cannot set it"
    if c.space == "process" and c.path == "watch":
        return r"a watch tracepoint is a hardware breakpoint of the kernel's .*: 0x[0-9a-f]+ is the program's"
    if c.path == "kret" and c.beside == "stepping":
        return r"\$?kret cannot be used in a run with while-stepping"
    if c.path == "watch" and c.beside == "watches":
        return r"no free hardware breakpoint .* x86 has 4 debug registers"
    if (c.path, c.beside) in (("watch", "stepping"), ("stepping", "watches")):
        return r"cannot work together with while-stepping"
    return None


def generate(rng: random.Random) -> Combination:
    """One combination, every dimension drawn uniformly, then normalized."""
    return normalize(Combination(**{name: rng.choice(values) for name, values in DIMENSIONS.items()}))


def walk(seed: int) -> Iterable[Combination]:
    """The combinations of a seed, in order, without end."""
    rng = random.Random(seed)
    while True:
        yield generate(rng)


# ---- what the tracepoints are -----------------------------------------------------------------------------------

IMAGE_PATH = VMLINUX
N = {b.name: b.number for b in BUILTIN_VARIABLES}
#: the first number GDB gives a user variable (`$hits`; `$p_hits`, KGTP's per-CPU variable, the next, then its
#: per-CPU copies): after KGTP's table, and in a process after gdbserver's `$trace_timestamp` too
#: (tracing/core/predefined.py: the role's tracer numbers it after KGTP's table)
FIRST_USER_VARIABLE = {"kernel": max(N.values()) + 1, "process": max(N.values()) + 2}
MAIN, SHARED, ADDED, STEPPER = 1, 2, 3, 4  # tracepoint numbers; the four watches beside are 5..8
WATCHED = ("jiffies", "kgtp_test_pace", "nr_modules_loaded", "nr_context_switches")
STEPS = 2
ALL_REGS = 0xFFFFFF
SMALL_BUFFER = 0x1000
#: calls to let happen in each window of a run (more for a circular buffer, which must wrap)
WINDOW_CALLS = 24
#: calls a new machine makes before its first combination, per CPU (two ticks of each benchmark thread)
WARM_CALLS = 200
#: calls after which a small linear buffer must have filled (a frame takes at least 32 bytes of a 4 KiB ring)
FILL_CALLS = 20000
WAIT_S = 60.0  # a kernel that makes no progress for this long is a failure
#: the length of the first instruction of the program's counted_function (`addl $1, counter(%rip)`): its fast
#: tracepoint replaces it (QTDP's `F`)
FAST_LENGTH = 7


def hits_variable(c: Combination) -> int:
    """`$hits`'s number in the combination's space."""
    return FIRST_USER_VARIABLE[c.space]


def p_hits_variable(c: Combination) -> int:
    """`$p_hits`'s number in the combination's space (its per-CPU copies follow it)."""
    return FIRST_USER_VARIABLE[c.space] + 1


def watched(image: KernelImage) -> tuple[int, ...]:
    """The kernel's variables the watches beside watch (in either space)."""
    return tuple(image.address_of(name) for name in WATCHED)


def _mask(registers: int) -> bytes:
    """A register-collection action as GDB writes it: the mask's bytes in hex."""
    text = b"%x" % registers
    return b"R" + b"0" * (len(text) % 2) + text


def _x(code: str) -> bytes:
    program = assemble(code)
    return b"X%x,%s" % (len(program), program.hex().encode())


@dataclass(frozen=True)
class Sites:
    """Where a space's tracepoints go: the counted function (kgtp_test_function, or the program's
    counted_function), its count (kgtp_counter, `counter`), the place after the count (the kernel's marker, the
    program's second instruction), where the while-stepping tracepoint beside goes (load_module, round_end), the
    kernel's variables the watches beside watch, and the code the counted function returns into (the benchmark's
    loops, the program's caller). `relocated`: in a process, every pad the stub made for the counted function's
    first instruction (a fast tracepoint's, a compiled hit's: one per condition it decides), each's relocated
    `addl` (a pc there: a call probed and not yet counted); none before any."""

    function: int
    counter: int
    marker: int
    stepper: int
    watched: tuple[int, ...]
    bench: tuple[range, ...]
    relocated: tuple[int, ...] = ()

    @classmethod
    def of(cls, image: KernelImage) -> Sites:
        marker = next(m.site for m in image.markers if m.name == "kgtp_module_event")
        callers = [image.function_at(image.address_of(name)) for name in ("kgtp_bench_thread", "kgtp_bench_loop")]
        return cls(image.address_of("kgtp_test_function"), image.address_of("kgtp_counter"), marker,
                   image.address_of("load_module"), watched(image),
                   tuple(range(f.address, f.address + f.size) for f in callers))




def main_actions(c: Combination, s: Sites) -> list[bytes]:
    """The QTDP action pieces of the combination's tracepoint (each one packet, as GDB sends them)."""
    counter = b"M-1,%x,4" % s.counter
    hits, p_hits = hits_variable(c), p_hits_variable(c)
    if c.path == "watch":
        setup = [_x(f"const8 1; setv {N['watch_static']:#x}; end"), _x(f"const8 1; setv {N['watch_type']:#x}; end"),
                 _x(f"const8 4; setv {N['watch_size']:#x}; end")]
        collect = [_x(f"tracev {N['watch_val']:#x}; end")]
    elif c.path == "kret":
        setup, collect = [_x(f"const8 0; setv {N['kret']:#x}; end")], [counter]
    else:
        setup, collect = [], [counter]
    kind = {
        "registers": [_mask(1 << 4 | 1 << 5 | 1 << 16)],
        "$regs": [_mask(ALL_REGS)],
        "$args": [_mask(1 << 4 | 1 << 5)],
        "global": [],
        "memory": [_mask(1 << 7), b"M7,0,10"],
        "sdata": [b"L", _mask(1 << 4 | 1 << 5)],
        "bt": [_x(f"tracev {N['bt']:#x}; end")],
        "teval": [_x(f"getv {hits}; const8 1; add; ext 64; setv {hits}; pop; end"), _x(f"tracev {hits}; end")],
        "percpu": [_x(f"getv {p_hits}; const8 1; add; ext 64; setv {p_hits}; pop; end"), _x(f"tracev {p_hits}; end")],
        "kgtp": [_x(f"tracev {N['cpu_id']:#x}; tracev {N['current_task']:#x}; end")],
        "disable": [_x(f"const8 {MAIN}; setv {N['disable']:#x}; end")],
    }[c.action]
    return setup + collect + kind


CONDITIONS = {
    "none": None,
    "true": "const8 0; reg 5; ext 32; less_signed; end",  # counter1 > 0: the callers count from 1
    "false": "reg 5; ext 32; const8 0; less_signed; end",
    "fault": "const8 8; ref32; end",  # a read of address 8: never mapped
}


def address_of(c: Combination, s: Sites) -> int:
    """Where the combination's own tracepoint is: the marker (the place after the count), the watched count, or the
    function."""
    return {"marker": s.marker, "watch": s.counter}.get(c.path, s.function)


def definitions(c: Combination, s: Sites) -> list[bytes]:
    """Every packet GDB would send between QTinit and QTStart for this combination."""
    address = address_of(c, s)
    condition = CONDITIONS[c.condition]
    step = STEPS if c.path == "stepping" else 0
    hits, p_hits = hits_variable(c), p_hits_variable(c)
    packets = [b"QTBuffer:size:%x" % (SMALL_BUFFER if c.buffer in ("circular", "fill") else 0x100000),
               b"QTBuffer:circular:%x" % (c.buffer == "circular"), b"QTDisconnected:0",
               b"QTDV:%x:0:0:%s" % (hits, b"hits".hex().encode()), b"QTDV:%x:0:0:%s" % (p_hits, b"p_hits".hex().encode())]
    packets += [b"QTDV:%x:0:0:%s" % (p_hits + 1 + cpu, (b"p_hits%d" % cpu).hex().encode()) for cpu in range(c.cpus)]  # each copy
    if c.space == "process":  # a fast tracepoint (`ftrace`) for the jump and its shared address
        kind = b":F%x" % FAST_LENGTH if c.path in ("jump", "shared") else b""
    else:  # the kernel's jump is the probe's own choice; a static tracepoint at the marker
        kind = b":S" if c.path == "marker" else b""
    packets.append(b"QTDP:%x:%x:E:%x:%x%s%s-" % (MAIN, address, step, c.passcount, kind,
                                                b":" + _x(condition) if condition else b""))
    pieces = main_actions(c, s)
    for index, piece in enumerate(pieces):
        more = index < len(pieces) - 1 or step
        packets.append(b"QTDP:-%x:%x:%s%s" % (MAIN, address, piece, b"-" if more else b""))
    if step:
        packets.append(b"QTDP:-%x:%x:S%sM-1,%x,4" % (MAIN, address, _mask(1 << 16 | 1 << 5), s.counter))
    if c.path == "shared":  # a second tracepoint at the same address, on its own: every call
        packets += [b"QTDP:%x:%x:E:0:0-" % (SHARED, s.function), b"QTDP:-%x:%x:M-1,%x,4" % (SHARED, s.function, s.counter)]
    if c.beside == "stepping":  # while-stepping elsewhere (a module load now and then; a round's end)
        packets += [b"QTDP:%x:%x:E:%x:0-" % (STEPPER, s.stepper, STEPS),
                    b"QTDP:-%x:%x:S%s" % (STEPPER, s.stepper, _mask(1 << 16))]
    if c.beside == "watches":
        for number, watched in enumerate(s.watched, start=5):
            packets += [b"QTDP:%x:%x:E:0:0-" % (number, watched),
                        b"QTDP:-%x:%x:%s-" % (number, watched, _x(f"const8 1; setv {N['watch_static']:#x}; end")),
                        b"QTDP:-%x:%x:%s" % (number, watched, _x(f"const8 4; setv {N['watch_size']:#x}; end"))]
    return packets


def added_address(c: Combination, s: Sites) -> int:
    """Where the tracepoint added during the run goes: the marker (the place after the count), or the function when
    the combination's own is at the marker: never the combination's own address, whose location would change path
    when joined (a lone compiled probe becomes a chain's head, a program's leaves its pad for the Python path);
    that join is tested apart (tests/tracing/test_shared_address.py, test_program_compiled_hits.py)."""
    return s.function if c.path == "marker" else s.marker


def added_definition(c: Combination, s: Sites) -> list[bytes]:
    """The tracepoint GDB downloads during the run (InstallInTrace): every call, its counter."""
    at = added_address(c, s)
    static = at == s.marker and c.space == "kernel"
    return [b"QTDP:%x:%x:E:0:0:S-" % (ADDED, at) if static else b"QTDP:%x:%x:E:0:0-" % (ADDED, at),
            b"QTDP:-%x:%x:M-1,%x,4" % (ADDED, at, s.counter)]
