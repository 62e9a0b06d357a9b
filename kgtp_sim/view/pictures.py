"""The README's pictures, made from one real run: `python -m kgtp_sim.view.pictures OUTDIR` (scripts/trace-pictures).

Starts a stub with the bundled kernel, lets real GDB define and run a trace (dynamic tracepoints with `$bt`,
static tracepoints on sched_stat_runtime and sys_enter), waits for the run to end by its own pass count, then
draws it with `kgtp-sim plot` and samples the busy kernel with `kgtp-sim hotcode`. The stub is started and GDB
run by kgtp_sim.client. Everything runs in the main thread of this process (beside the client's daemon thread
that drains the stub's output); the stub and GDB are child processes.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ..client import ROOT, VMLINUX, StubProcess, kgtp_command, run_gdb, start_stub, system_gdb


def _gdb_binary() -> str:
    gdb = system_gdb() or shutil.which("gdb")
    if gdb is None:
        raise RuntimeError("gdb is needed (scripts/lib/setup.sh ensure_gdb)")
    return gdb


def _follow_port(stub: StubProcess) -> int:
    if stub.follow_port is None:
        raise RuntimeError("the stub did not start its follow channel:\n" + "".join(stub.output))
    return stub.follow_port


def _kgtp(*args: str) -> str:
    result = subprocess.run(kgtp_command(*args), cwd=ROOT, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"kgtp-sim {' '.join(args)} failed:\n{result.stdout}{result.stderr}")
    return result.stdout


def make(outdir: Path) -> list[Path]:
    from ..machine import KernelImage

    outdir.mkdir(parents=True, exist_ok=True)
    sites = {m.id: m.site for m in KernelImage.load(VMLINUX).markers}
    gdb = _gdb_binary()
    stub = start_stub()
    try:
        port, follow = stub.port, _follow_port(stub)
        out = run_gdb(gdb, stub,
            "monitor pace 20",
            "trace schedule", "actions", "collect $regs, $bt", "end",
            f"strace *{sites['sched::sched_stat_runtime']:#x}", "actions", "collect $_sdata", "end",
            f"strace *{sites['syscalls::sys_enter']:#x}", "actions", "collect $_sdata", "end",
            "trace kgtp_test_function if (counter1 % 50) == 0", "actions", "collect counter1, kgtp_counter", "end",
            "trace load_module", "passcount 4", "actions", "collect $args", "collect/s name", "end",
            "tstart",
            # the run ends by itself: load_module's fourth call (every 20 ticks) reaches its pass count
            "python",
            "import time",
            "while 'Trace is running' in gdb.execute('tstatus', to_string=True):",
            "    time.sleep(0.1)",
            "end",
            "tstatus",
            timeout=300)
        if "Trace stopped by tracepoint 5" not in out:
            raise RuntimeError("the picture run did not end by its pass count:\n" + out)
        made = [Path(p) for p in re.findall(r"wrote (\S+\.png)", _kgtp(
            "plot", "--port", str(follow), "-o", str(outdir), "--value", "$_sdata.runtime"))]
        # hotcode: a busy kernel (more workload calls per tick than fit between two ticks), 600 timer ticks
        run_gdb(gdb, stub, "monitor pace 20000", "tstatus", timeout=300)
        deadline = time.monotonic() + 30
        while True:
            try:
                text = _kgtp("hotcode", "--port", str(port), "--follow-port", str(follow), "--samples", "600",
                             "--top", "12", "--png", str(outdir / "hotcode.png"))
                break
            except RuntimeError as error:
                if "another debugger" not in str(error) or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        (outdir / "hotcode.txt").write_text(text.replace(str(outdir / "hotcode.png"), "hotcode.png"))
        made.append(outdir / "hotcode.png")
        return made
    finally:
        stub.stop()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    outdir = Path(args[0]) if args else ROOT / "docs" / "pictures"
    for path in make(outdir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
