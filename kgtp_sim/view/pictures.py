"""The README's pictures, made from one real run: `python -m kgtp_sim.view.pictures OUTDIR` (scripts/trace-pictures).

Starts a stub with the bundled kernel, lets real GDB define and run a trace (dynamic tracepoints with `$bt`,
static tracepoints on sched_stat_runtime and sys_enter), waits for the run to end by its own pass count, then
draws it with `kgtp-sim plot` and samples the busy kernel with `kgtp-sim hotcode`. Everything runs in the main
thread of this process; the stub and GDB are child processes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
VMLINUX = ROOT / "fixtures" / "vmlinux"


def _start_stub() -> tuple[subprocess.Popen, int, int]:
    proc = subprocess.Popen([sys.executable, "-m", "kgtp_sim", "serve", "--port", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    follow = None
    for line in proc.stdout:
        found = re.search(r"follow channel \(read-only\) on [\d.]+:(\d+)", line)
        if found:
            follow = int(found.group(1))
        found = re.search(r"listening on [\d.]+:(\d+)", line)
        if found and follow is not None:
            return proc, int(found.group(1)), follow
    raise RuntimeError("the stub did not start")


def _gdb(port: int, commands: list[str]) -> str:
    gdb = shutil.which("gdb", path="/usr/bin:/bin:/usr/local/bin") or shutil.which("gdb")
    if gdb is None:
        raise RuntimeError("gdb is needed (scripts/lib/setup.sh ensure_gdb)")
    lines = ["set pagination off", "set confirm off", f"target remote 127.0.0.1:{port}", *commands]
    with tempfile.NamedTemporaryFile("w", suffix=".gdb", delete=False) as script:
        script.write("\n".join(lines) + "\n")
    try:
        result = subprocess.run([gdb, "-nx", "-batch", str(VMLINUX), "-x", script.name], capture_output=True,
                                text=True, timeout=300, env=dict(os.environ, TERM="dumb"))
    finally:
        os.unlink(script.name)
    return result.stdout + result.stderr


def _kgtp(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "kgtp_sim", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"kgtp-sim {' '.join(args)} failed:\n{result.stdout}{result.stderr}")
    return result.stdout


def make(outdir: Path) -> list[Path]:
    from ..machine import KernelImage

    outdir.mkdir(parents=True, exist_ok=True)
    sites = {m.id: m.site for m in KernelImage.load(VMLINUX).markers}
    proc, port, follow = _start_stub()
    try:
        out = _gdb(port, [
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
        ])
        if "Trace stopped by tracepoint 5" not in out:
            raise RuntimeError("the picture run did not end by its pass count:\n" + out)
        made = [Path(p) for p in re.findall(r"wrote (\S+\.png)", _kgtp(
            "plot", "--port", str(follow), "-o", str(outdir), "--value", "$_sdata.runtime"))]
        # hotcode: a busy kernel (more workload calls per tick than fit between two ticks), 600 timer ticks
        _gdb(port, ["monitor pace 20000", "tstatus"])
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
        proc.terminate()
        proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    outdir = Path(args[0]) if args else ROOT / "docs" / "pictures"
    for path in make(outdir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
