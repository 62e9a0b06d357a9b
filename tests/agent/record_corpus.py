#!/usr/bin/env python3
"""Record the agent-bytecode corpus from real GDB 13: `maint agent` (collection bytecode, what `collect EXPR`
downloads) and `maint agent-eval` (evaluation bytecode, what a tracepoint condition downloads) for the expressions
below, against `corpus_src/agent_corpus.c` compiled with gcc -g.

    .venv/bin/python tests/agent/record_corpus.py [--gdb /usr/bin/gdb] [--out tests/agent/data/gdb13_corpus.json]

GDB prints a listing (`  7  trace_quick 4`); it is turned back into bytes with the opcode table, and every
instruction's length is checked against the offsets GDB printed, so the bytes are GDB's. The ELF's writable
segment is saved with the corpus so the tests can map the globals the bytecode reads. The script also records
two limits as GDB applies them to `collect` actions (depth 20 accepted, 21 refused; 184 bytes accepted, 185
refused).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

from elftools.elf.elffile import ELFFile  # noqa: E402

from kgtp_sim.agent.opcodes import BY_NAME, encode  # noqa: E402
from kgtp_sim.agent.verify import verify  # noqa: E402

SOURCE = HERE / "corpus_src" / "agent_corpus.c"
BUILD = ["gcc", "-g", "-O2", "-no-pie", "-o"]

# (name, kind, location, expression). kind: eval = `maint agent-eval`, collect = `maint agent`,
# printf = `maint agent-printf` (needs a live process: run to main first).
ENTRIES: list[tuple[str, str, str, str]] = [
    ("thesis_condition", "eval", "main", "2*counter1+3*counter2>0"),
    ("thesis_collect", "collect", "main", "(2*counter1+3*counter2)"),
    ("thesis_condition_params", "eval", "kgtp_test_function", "2*counter1+3*counter2>0"),
    ("thesis_collect_params", "collect", "kgtp_test_function", "(2*counter1+3*counter2)"),
    ("false_condition", "eval", "main", "2*counter1+3*counter2<0"),
    ("unsigned_vs_minus1", "eval", "main", "ucount < -1"),
    ("unsigned_gt", "eval", "main", "ucount > 5u"),
    ("unsigned_long_vs_long", "eval", "main", "ulvar < lvar"),
    ("char_plus_uchar", "eval", "main", "cvar + ucvar"),
    ("short_times_ushort", "eval", "main", "svar * usvar"),
    ("char_negative", "eval", "main", "cvar < 0"),
    ("uchar_compare", "eval", "main", "ucvar > 100"),
    ("shift_left", "eval", "main", "counter1 << 3"),
    ("shift_right_63", "eval", "main", "lvar >> 63"),
    ("shift_right_64", "eval", "main", "counter1 >> 64"),
    ("shift_by_var", "eval", "main", "lvar << counter2"),
    ("shift_unsigned", "eval", "main", "ulvar >> counter1"),
    ("div_signed", "eval", "main", "lvar / counter2"),
    ("rem_unsigned", "eval", "main", "ulvar % 7"),
    ("div_by_zero", "eval", "main", "counter1 / zero"),
    ("int64_min_div_minus1", "eval", "main", "minval / neg1"),
    ("int64_min_rem_minus1", "eval", "main", "minval % neg1"),
    ("mixed_div_rem_shift", "eval", "main", "cvar / svar % 7 >> 3 << 2"),
    ("struct_collect", "collect", "main", "pt"),
    ("struct_member", "eval", "main", "pt.tag == 112"),
    ("pointer_member_collect", "collect", "main", "ppt->z"),
    ("pointer_deref_collect", "collect", "main", "*ppt"),
    ("array_index_collect", "collect", "main", "arr[counter1]"),
    ("array_collect", "collect", "main", "arr"),
    ("string_collect", "collect", "main", "name"),
    ("pointer_arith", "eval", "main", "ppt->y + arr[2]"),
    ("logical_and_or", "eval", "main", "counter1 && counter2 || ucount"),
    ("ternary", "eval", "main", "counter1 ? counter2 : ucount"),
    ("not_and_complement", "eval", "main", "!counter1 + ~counter2"),
    ("negate", "eval", "main", "-counter1"),
    ("long_mul_negative", "eval", "main", "(long)counter1 * -1"),
    ("big_constant", "eval", "main", "0x823456789abcdef0 + counter1 + 1000"),
    ("register_rsp", "eval", "main", "$rsp"),
    ("register_eflags", "eval", "main", "$eflags"),
    ("segment_plus_rip", "eval", "main", "$cs + $rip"),
    ("tsv_collect", "collect", "main", "$hits"),
    ("tsv_increment", "collect", "main", "$hits = $hits + 1"),
    ("tsv_condition", "eval", "main", "$hits < 10"),
    ("printf_two_ints", "printf", "main", '"%d %d\\n", counter1, counter2'),
    ("printf_mixed", "printf", "main", '"%lu %c %x\\n", ulvar, cvar, counter2'),
    ("printf_string", "printf", "main", '"name=%s\\n", nameptr'),
]
PRELUDE = ["tvariable $hits = 0"]


def run_gdb(gdb: str, elf: Path, commands: list[str], live: bool = False) -> subprocess.CompletedProcess:
    argv = [gdb, "-nx", "-batch", "-ex", "set pagination off", "-ex", "set confirm off", str(elf)]
    for c in PRELUDE + (["break main", "run"] if live else []) + commands:
        argv += ["-ex", c]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


_LINE = re.compile(r"^\s*(\d+)\s+(\S+)(?:\s+(.*))?$")


def parse_listing(text: str) -> tuple[bytes, list[str]]:
    """GDB's `maint agent` listing -> bytes, checking each instruction's length against GDB's offsets."""
    out = b""
    lines: list[str] = []
    started = False
    for raw in text.splitlines():
        if raw.startswith("Reg mask:"):
            started = True
            continue
        m = _LINE.match(raw)
        if not started or not m or m.group(2) not in BY_NAME:
            continue
        offset, name, rest = int(m.group(1)), m.group(2), (m.group(3) or "").strip()
        if offset != len(out):
            raise ValueError(f"listing offset {offset} but {len(out)} bytes assembled before {raw!r}")
        if name == "printf":
            fmt_text, nargs = re.fullmatch(r'"(.*)", (\d+) args', rest).groups()  # type: ignore[union-attr]
            fmt = fmt_text.encode().decode("unicode_escape").encode("latin-1")
            out += encode("printf", int(nargs), fmt=fmt)
        else:
            values = [int(v) for v in rest.split()] if rest else []
            out += encode(name, *values)
        lines.append(f"{offset:>3}  {name}{(' ' + rest) if rest else ''}")
    return out, lines


def listing_end(text: str) -> int | None:
    """GDB prints the `end` offset last; used to check the length of the final instruction (end = 1 byte)."""
    offsets = [int(m.group(1)) for m in map(_LINE.match, text.splitlines()) if m and m.group(2) in BY_NAME]
    return offsets[-1] + 1 if offsets else None


def command_for(kind: str, location: str, expr: str) -> str:
    if kind == "eval":
        return f"maint agent-eval -at {location}, {expr}"
    if kind == "collect":
        return f"maint agent -at {location}, {expr}"
    return f"maint agent-printf {expr}"


def record_one(gdb: str, elf: Path, name: str, kind: str, location: str, expr: str) -> dict:
    command = command_for(kind, location, expr)
    result = run_gdb(gdb, elf, [command], live=kind == "printf")
    code, lines = parse_listing(result.stdout)
    if not code or listing_end(result.stdout) != len(code):
        raise SystemExit(f"{name}: could not read GDB's listing:\n{result.stdout}\n{result.stderr}")
    program = verify(code)
    return {
        "name": name,
        "kind": kind,
        "command": command,
        "expression": expr,
        "bytecode": code.hex(),
        "length": len(code),
        "max_depth": program.max_depth,
        "listing": lines,
    }


def action_accepted(gdb: str, elf: Path, expr: str) -> tuple[bool, str]:
    """Whether GDB accepts `collect EXPR` as a tracepoint action (it checks length and depth there)."""
    with tempfile.NamedTemporaryFile("w", suffix=".gdb", delete=False) as f:
        f.write(f"trace main\nactions\ncollect {expr}\nend\n")
    result = subprocess.run([gdb, "-nx", "-batch", str(elf), "-x", f.name], capture_output=True, text=True, timeout=60)
    Path(f.name).unlink()
    message = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
    return "too complicated" not in result.stderr, message


def nested(levels: int) -> str:
    expr = "counter1"
    for i in range(levels):
        expr = f"{i % 7 + 1}+({expr})"
    return expr


def summed(terms: int, constant: str | None) -> str:
    names = ["counter1", "counter2", "ucount", "lvar"]
    expr = "+".join(names[i % len(names)] for i in range(terms))
    return f"{expr}+{constant}" if constant else expr


def limits(gdb: str, elf: Path) -> tuple[list[dict], dict]:
    """Entries at GDB's limits (depth 20, 184 bytes) and what GDB says one step beyond them."""
    entries: list[dict] = []
    facts: dict = {}
    for levels in range(10, 40):
        rec = record_one(gdb, elf, "depth_20", "collect", "main", nested(levels))
        if rec["max_depth"] == 20:
            ok, _ = action_accepted(gdb, elf, nested(levels))
            ok_next, message = action_accepted(gdb, elf, nested(levels + 1))
            assert ok and not ok_next, "GDB's depth limit is not where the verifier puts depth 20"
            facts["depth_20_collect_accepted"] = f"collect {nested(levels)}"
            facts["depth_21_collect_refused"] = message
            entries.append(rec)
            break
    found = {}
    for terms in range(8, 16):
        for constant in (None, "1", "300", "70000"):
            rec = record_one(gdb, elf, "length_184", "collect", "main", summed(terms, constant))
            if rec["length"] in (184, 185) and rec["length"] not in found:
                found[rec["length"]] = rec
        if len(found) == 2:
            break
    rec184, rec185 = found[184], found[185]
    ok, _ = action_accepted(gdb, elf, rec184["expression"])
    ok185, message = action_accepted(gdb, elf, rec185["expression"])
    assert ok and not ok185, "GDB's length limit is not 184 bytes"
    facts["length_184_collect_accepted"] = f"collect {rec184['expression']}"
    facts["length_185_collect_refused"] = message
    entries.append(rec184)
    return entries, facts


def writable_segments(elf_path: Path) -> list[dict]:
    with elf_path.open("rb") as f:
        elf = ELFFile(f)
        out = []
        for seg in elf.iter_segments():
            if seg["p_type"] == "PT_LOAD" and seg["p_flags"] & 2:
                data = seg.data() + b"\0" * (seg["p_memsz"] - seg["p_filesz"])
                out.append({"address": seg["p_vaddr"], "hex": data.hex()})
        symbols = {}
        for sym in elf.get_section_by_name(".symtab").iter_symbols():
            if sym["st_info"]["type"] == "STT_OBJECT" and sym.name:
                symbols[sym.name] = [sym["st_value"], sym["st_size"]]
    return out, symbols


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gdb", default=shutil.which("gdb", path="/usr/bin:/bin") or "gdb")
    parser.add_argument("--out", default=str(HERE / "data" / "gdb13_corpus.json"))
    args = parser.parse_args()
    version = subprocess.run([args.gdb, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    if " 13." not in version:
        print(f"warning: {version} is not GDB 13", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        elf = Path(tmp) / "agent_corpus"
        subprocess.run(BUILD + [str(elf), str(SOURCE)], check=True)
        gcc = subprocess.run(["gcc", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
        entries = [record_one(args.gdb, elf, *e) for e in ENTRIES]
        extra, facts = limits(args.gdb, elf)
        segments, symbols = writable_segments(elf)
    corpus = {
        "gdb": version,
        "compiler": gcc,
        "source": str(SOURCE.relative_to(ROOT)),
        "build": " ".join(BUILD + ["agent_corpus", SOURCE.name]),
        "recorder": str(Path(__file__).resolve().relative_to(ROOT)),
        "prelude": PRELUDE,
        "limits": facts,
        "symbols": symbols,
        "segments": segments,
        "entries": entries + extra,
    }
    Path(args.out).write_text(json.dumps(corpus, indent=1) + "\n")
    print(f"{len(corpus['entries'])} expressions -> {args.out}")


if __name__ == "__main__":
    main()
