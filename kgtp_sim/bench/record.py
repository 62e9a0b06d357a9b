"""Record the bytecode GDB generates for the thesis expressions (issue 6) into fixtures/bench/thesis_bytecode.json.

    python -m kgtp_sim.bench.record [--gdb /usr/bin/gdb] [--out fixtures/bench/thesis_bytecode.json]

GDB's `maint agent-eval -at LOC, EXPR` prints the bytecode of a condition, `maint agent -at LOC, EXPR` the
bytecode of `collect EXPR` (its trace ops) and the register mask GDB merges into the action's register block:
a register-only expression such as `(2*counter1+3*counter2)` is downloaded as `R30` (rdi, rsi) plus `X...`.
The listing is reassembled with `kgtp_sim.agent.opcodes.assemble`.

Runs on the main thread of this command; GDB is a child process, waited for. `load` reads the fixture on the
benchmark's thread (runner.py) or a test's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
from pathlib import Path

from kgtp_sim.agent.opcodes import assemble
from kgtp_sim.client.paths import FIXTURES, VMLINUX

FIXTURE = FIXTURES / "bench" / "thesis_bytecode.json"

#: site name -> GDB location: the dynamic probe goes at kgtp_test_function's first instruction, the static one at
#: the kgtp_module_event marker (module.c line 14, kgtp_test_function+7)
SITES = {"dynamic": "kgtp_test_function", "static": "module.c:14"}
EXPR = "2*counter1+3*counter2"
#: name -> (maint command, expression), as the thesis' three test cases need them
COMMANDS = {
    "false_condition": ("agent-eval", f"{EXPR}<0"),
    "true_condition": ("agent-eval", f"{EXPR}>0"),
    "collect": ("agent", f"({EXPR})"),
}

_LINE = re.compile(r"^\s*(\d+)\s+(.*\S)\s*$")


def parse_listing(text: str) -> list[dict]:
    """Split GDB's output into one {scope, reg_mask, ops} dict per `maint agent` command."""
    out: list[dict] = []
    for line in text.splitlines():
        if line.startswith("Scope:"):
            out.append({"scope": int(line.split()[1], 16), "reg_mask": None, "ops": []})
        elif line.startswith("Reg mask:"):
            out[-1]["reg_mask"] = line.split(":", 1)[1].strip()
        else:
            m = _LINE.match(line)
            if m and out:
                out[-1]["ops"].append(m.group(2))
    return out


def gdb_commands() -> list[tuple[str, str, str]]:
    """(site, name, gdb command) in the order they are run."""
    return [(site, name, f"maint {kind} -at {loc}, {expr}")
            for site, loc in SITES.items() for name, (kind, expr) in COMMANDS.items()]


def record(gdb: str = "/usr/bin/gdb", vmlinux: Path = VMLINUX) -> dict:
    commands = gdb_commands()
    argv = [gdb, "-batch", "-nx", str(vmlinux)]
    for _, _, command in commands:
        argv += ["-ex", command]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    listings = parse_listing(done.stdout)
    if len(listings) != len(commands):
        raise RuntimeError(f"expected {len(commands)} listings from GDB, got {len(listings)}:\n{done.stderr}")
    version = subprocess.run([gdb, "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    sites: dict = {}
    for (site, name, command), listing in zip(commands, listings):
        code = assemble("; ".join(listing["ops"]))
        entry = sites.setdefault(site, {"location": SITES[site], "address": f"{listing['scope']:#x}"})
        entry[name] = {
            "command": command,
            "reg_mask": listing["reg_mask"],
            "listing": listing["ops"],
            "bytecode": code.hex(),
        }
    return {
        "gdb": version,
        "image": "fixtures/vmlinux",
        "recorded": datetime.date.today().isoformat(),
        "note": "re-record with: python -m kgtp_sim.bench.record",
        "argv": ["gdb", "-batch", "-nx", "fixtures/vmlinux"] + [a for _, _, c in commands for a in ("-ex", c)],
        "sites": sites,
    }


def load(path: Path = FIXTURE) -> dict:
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gdb", default="/usr/bin/gdb")
    parser.add_argument("--out", type=Path, default=FIXTURE)
    args = parser.parse_args(argv)
    data = record(args.gdb)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
