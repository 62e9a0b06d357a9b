"""The soak's final walk: real GDB attaches through MI once the sampler has gone, finds the run still going,
stops it and walks the whole buffer with `tfind` (or, past a limit, first, last and evenly spaced frames),
checking each frame's pc and values, the frame count, each CPU's sequence numbers (`monitor frames`) and `tdump`
on a sample. Through MI one unavailable value does not end the walk, as it would end a batch command file.

Runs on the soak's thread (soak.py); the MI driver's own daemon thread only reads GDB's output.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..client import VMLINUX, GdbMi, StubProcess
from .soak_checks import Check, FrameRecord, TracepointSpec, _first, _int, check_frame_values, check_sequence

_MONITOR_FRAME = re.compile(r"^frame\s+(\d+)\s+tp\s+(\d+)\s+\+\s*(-?[\d.]+) us\s+cpu (\d+)\s+seq (\d+)", re.M)


@dataclass
class FinalFigures:
    status_before_stop: dict[str, str] = field(default_factory=dict)
    status_after_stop: dict[str, str] = field(default_factory=dict)
    tstatus_text: str = ""
    frames_walked: int = 0
    frames_by_tracepoint: dict[int, int] = field(default_factory=dict)
    tdumps: int = 0
    final_jiffies: int | None = None


def _tracepoints_by_local_number(mi: GdbMi) -> dict[int, int]:
    """GDB's own number of each tracepoint it learned from the target -> its address.

    A reconnecting GDB numbers uploaded tracepoints itself (in the order of its upload list, not the target's),
    so frames are matched to the tracepoints defined at set-up by address, never by number.
    """
    table = mi.command("-break-list").get("BreakpointTable", {})
    body = table.get("body", []) if isinstance(table, dict) else []
    out: dict[int, int] = {}
    for row in body if isinstance(body, list) else []:
        point = row.get("bkpt") if isinstance(row, dict) else None
        if isinstance(point, dict) and isinstance(point.get("addr"), str) and point["addr"].startswith("0x"):
            out[int(str(point["number"]))] = int(point["addr"], 16)
    return out


def _status(mi: GdbMi) -> dict[str, str]:
    result = mi.command("-trace-status")
    return {k: v for k, v in result.results.items() if isinstance(v, str)}


def final_walk(gdb: str, stub: StubProcess, specs: Sequence[TracepointSpec], addresses: dict[int, int],
               jiffies_address: int, walk_limit: int) -> tuple[FinalFigures, list[Check]]:
    """Attach real GDB, stop the run and check the whole buffer (or, past `walk_limit` frames, first, last and
    evenly spaced frames): pcs, values, frame count, sequence numbers, and `tdump` on a sample."""
    figures = FinalFigures()
    checks: list[Check] = []
    with GdbMi(gdb, VMLINUX, timeout=120) as mi:
        result = mi.attach(stub.address, patience=30)
        if result.klass != "connected":
            return figures, [Check("GDB attaches at the end", False, str(result.get("msg")))]
        local = _tracepoints_by_local_number(mi)
        figures.status_before_stop = _status(mi)
        figures.tstatus_text = mi.console("tstatus").console.strip()
        running = figures.status_before_stop.get("running") == "1"
        checks.append(Check("run still going when GDB attaches at the end", running,
                            figures.tstatus_text.splitlines()[0] if figures.tstatus_text else "no tstatus"))
        jiffies = mi.evaluate(f"*(unsigned long *){jiffies_address:#x}")
        mi.command("-trace-stop", check=False)
        figures.status_after_stop = after = _status(mi)
        figures.final_jiffies = _int(mi.evaluate(f"*(unsigned long *){jiffies_address:#x}")) or _int(jiffies)
        checks.append(Check("tstop stops the run", after.get("running") == "0", f"running={after.get('running')}"))
        frames = int(after.get("frames", "0"))
        created = int(after.get("frames-created", "0"))

        rows: list[tuple[int, int, float, int]] = []
        cpu_of: dict[int, int] = {}
        monitor_error = ""
        for first in range(0, max(frames, 1), 10000):
            text = mi.console(f"monitor frames {first} 10000")
            if text.klass != "done":
                monitor_error = str(text.get("msg"))
                break
            found_rows = _MONITOR_FRAME.findall(text.console)
            rows += [(int(n), int(tp), float(us), int(seq)) for n, tp, us, _, seq in found_rows]
            cpu_of.update((int(n), int(cpu)) for n, _, _, cpu, _ in found_rows)
        problems = [f"monitor frames failed: {monitor_error}"] if monitor_error else check_sequence(rows, frames,
                                                                                                      created, cpu_of)
        checks.append(Check("each CPU's frame sequence consecutive, newest ones add up to tcreated", not problems,
                            _first(problems) if problems else f"{len(rows)} frames, seq {rows[0][3] if rows else '-'}"
                            f"..{rows[-1][3] if rows else '-'}"))

        start = mi.console("tfind start")
        found_start = re.search(r"Found trace frame 0, tracepoint (\d+)", start.console)
        checks.append(Check("tfind start finds frame 0", found_start is not None or frames == 0,
                            start.console.strip().splitlines()[0] if start.console.strip() else str(start.get("msg"))))

        on_target = {address: number for number, address in addresses.items()}
        wanted = list(range(max(frames, 0))) if frames <= walk_limit else sorted(
            {0, frames - 1, *range(0, frames, max(1, frames // walk_limit))})
        walked: list[FrameRecord] = []
        pc_problems: list[str] = []
        for number in wanted:
            found = mi.command(f"-trace-find frame-number {number}", check=False)
            if found.get("found") != "1":
                pc_problems.append(f"tfind {number} found nothing")
                continue
            address = local.get(int(str(found.get("tracepoint"))))
            tracepoint = on_target.get(address, 0) if address is not None else 0
            frame = found.get("frame", {})
            pc = int(frame["addr"], 16) if isinstance(frame, dict) and isinstance(frame.get("addr"), str) else None
            if tracepoint == 0:
                pc_problems.append(f"frame {number}: GDB's tracepoint {found.get('tracepoint')} is not one defined")
            elif pc != address:
                pc_problems.append(f"frame {number}: pc {pc if pc is None else hex(pc)} is not tracepoint "
                                   f"{tracepoint}'s address {address:#x}")
            if number < len(rows) and rows[number][1] != tracepoint:
                pc_problems.append(f"frame {number}: tfind says tracepoint {tracepoint}, monitor frames "
                                   f"{rows[number][1]}")
            spec = specs[tracepoint - 1] if 0 < tracepoint <= len(specs) else None
            values = {expr: mi.evaluate(expr) for expr in (spec.readback if spec else ())}
            walked.append(FrameRecord(number, tracepoint, pc, values, cpu_of.get(number, 0)))
        beyond = mi.command(f"-trace-find frame-number {frames}", check=False)
        figures.frames_walked = len(walked)
        figures.frames_by_tracepoint = dict(collections.Counter(f.tracepoint for f in walked))
        count_ok = len(walked) == len(wanted) and beyond.get("found") != "1"
        checks.append(Check("tfind walks exactly tframes frames", count_ok and frames > 0,
                            f"walked {len(walked)} of tframes {frames}" + (" (sampled)" if frames > walk_limit else "")
                            + ("; a frame past the end was found" if beyond.get("found") == "1" else "")))
        checks.append(Check("every frame's pc is its tracepoint's address", not pc_problems and bool(walked),
                            _first(pc_problems) if pc_problems else f"{len(walked)} frames"))
        value_problems = check_frame_values(walked, specs, figures.final_jiffies)
        checks.append(Check("collected values sane and consecutive", not value_problems and bool(walked),
                            _first(value_problems) if value_problems else
                            (", ".join(f"tp{tp}: {n}" for tp, n in sorted(figures.frames_by_tracepoint.items()))
                             + "; by CPU " + ", ".join(f"{cpu}: {n}" for cpu, n in sorted(
                                 collections.Counter(f.cpu for f in walked).items())))
                            if walked else "no frames to check"))

        dump_problems: list[str] = []
        samples = sorted({0, frames - 1, *range(0, frames, max(1, frames // 20))}) if frames > 0 else []
        for number in samples:
            found = mi.command(f"-trace-find frame-number {number}", check=False)
            dump = mi.console("tdump")
            head = re.match(r"Data collected at tracepoint (\d+), trace frame (\d+):", dump.console)
            if dump.klass != "done" or head is None or int(head.group(2)) != number:
                dump_problems.append(f"frame {number}: {dump.get('msg') or dump.console[:80]!r}")
            elif str(found.get("tracepoint")) != head.group(1) or head.group(1) not in map(str, local):
                dump_problems.append(f"frame {number}: tdump names tracepoint {head.group(1)}")
        figures.tdumps = len(samples)
        checks.append(Check("tdump works on first, last and every k-th frame", not dump_problems and bool(samples),
                            _first(dump_problems) if dump_problems else f"{len(samples)} frames dumped"))
        mi.command("-trace-find none", check=False)
        mi.command("-target-detach", check=False)
    return figures, checks
