"""`kgtp-sim` as a new user meets it, without a running stub: the help of every command, the trace file as an
argument of export and plot, and a missing optional package said in one line. Each runs `python -m kgtp_sim`
in a subprocess, as the installed command runs."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys

import pytest

from kgtp_sim.arch import amd64
from kgtp_sim.tracing.core.tfile import write_tfile
from kgtp_sim.machine.dwarf import KernelDwarf

from .conftest import ROOT, VMLINUX

#: argparse wraps help to the terminal's width; the tests read it at the width of a standard terminal
COLUMNS = 80


def kgtp(*args: str, prelude: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
    """`kgtp-sim ARGS`; `prelude` is Python run first in the same interpreter (to hide a package)."""
    code = f"{prelude}\nimport sys\nfrom kgtp_sim.cli import main\nsys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "COLUMNS": str(COLUMNS)}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=timeout)


def subcommands() -> dict[str, str]:
    """Every subcommand the parser has, with its one-line help (the parser is the list, not this test)."""
    from kgtp_sim.cli import _parser

    parser = _parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return {choice.dest: choice.help for choice in action._choices_actions}


def test_help_lists_every_subcommand_with_one_line():
    commands = subcommands()
    assert {"serve", "follow", "export", "plot", "hotcode", "bench"} <= set(commands)
    result = kgtp("--help")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for name, text in commands.items():
        assert text, f"{name} has no help line"
        rows = [index for index, line in enumerate(lines) if re.match(rf"^\s+{name}\s", line)]
        assert len(rows) == 1, (name, result.stdout)
        line = lines[rows[0]]
        assert re.fullmatch(rf"\s+{name}\s+{re.escape(text)}", line), f"{name}'s help is not on one line:\n{line}"
    assert all(len(line) <= COLUMNS for line in lines), result.stdout


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_each_subcommand_help_ends_with_an_example(name):
    result = kgtp(name, "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    examples = text[text.rindex("\nexample"):] if "\nexample" in text else ""
    assert re.search(rf"^  kgtp-sim {name}\b", examples, re.M), f"no example of `kgtp-sim {name}`:\n{text}"
    assert all(len(line) <= COLUMNS for line in text.splitlines()), text


# ---- the trace file as an argument ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_trace(tmp_path_factory):
    """A trace file as GDB's tsave writes it (the stub's own writer): tracepoint 1 at kgtp_test_function,
    collecting counter1 and counter2 (in rdi and rsi there), 30 frames."""
    pc = KernelDwarf(VMLINUX).address_of("kgtp_test_function")
    frames = b""
    for index in range(30):
        body = b"R" + amd64.encode_registers({"rdi": index + 1, "rsi": index, "rip": pc})  # the rest 0
        frames += struct.pack("<HI", 1, len(body)) + body
    path = tmp_path_factory.mktemp("trace") / "run.tf"
    source = b"collect counter1, counter2".hex().encode()
    write_tfile(path, regblock_size=amd64.G_PACKET_SIZE, status_reply=b"T0;tstop::0;tframes:1e;tcreated:1e",
                variables=[], tracepoints=[b"T1:%x:E:0:0" % pc, b"Z1:%x:cmd:0:%x:%s" % (pc, len(source) // 2, source)],
                usage=[], tdesc="", frames=frames)
    return path


def test_export_and_plot_take_the_trace_file_as_an_argument(saved_trace, tmp_path):
    given = kgtp("export", str(saved_trace), "--format", "jsonl", "-o", str(tmp_path / "given.jsonl"))
    assert given.returncode == 0, given.stderr
    flagged = kgtp("export", "--file", str(saved_trace), "--format", "jsonl", "-o", str(tmp_path / "flagged.jsonl"))
    assert flagged.returncode == 0, flagged.stderr  # --file keeps working
    records = [json.loads(line) for line in (tmp_path / "given.jsonl").read_text().splitlines()]
    assert [r["fields"]["counter1"] for r in records] == list(range(1, 31))
    assert (tmp_path / "given.jsonl").read_text() == (tmp_path / "flagged.jsonl").read_text()

    result = kgtp("plot", str(saved_trace), "-o", str(tmp_path / "pics"), "--value", "counter1")
    assert result.returncode == 0, result.stderr
    for name in ("timeline.png", "distribution.png"):
        assert (tmp_path / "pics" / name).read_bytes().startswith(b"\x89PNG"), name


@pytest.mark.parametrize("command", [("export", "--format", "jsonl", "-o", "out.jsonl"), ("plot", "-o", "pics")])
def test_the_trace_file_given_twice_is_an_error(command, tmp_path):
    first, second = tmp_path / "a.tf", tmp_path / "b.tf"
    result = kgtp(command[0], str(first), "--file", str(second), *command[1:])
    assert result.returncode == 2
    assert "give the trace file once" in result.stderr and str(first) in result.stderr and str(second) in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "pics").exists()


# ---- optional packages ----------------------------------------------------------------------------------

#: matplotlib made unimportable in the CLI's interpreter, as in an environment installed without the extra
NO_MATPLOTLIB = "import sys\nsys.modules['matplotlib'] = None"


@pytest.mark.parametrize("command", [
    ("plot", "{trace}", "-o", "{tmp}/pics"),
    ("hotcode", "--port", "9", "--seconds", "1", "--png", "{tmp}/hot.png"),  # port 9 (discard): never reached
    ("bench", "--calls", "10", "--no-peer", "--chart", "{tmp}/chart.png"),
])
def test_a_missing_optional_package_is_one_line_saying_what_to_install(command, saved_trace, tmp_path):
    args = [part.format(trace=saved_trace, tmp=tmp_path) for part in command]
    result = kgtp(*args, prelude=NO_MATPLOTLIB, timeout=60)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "matplotlib" in lines[0] and f"{sys.executable} -m pip install matplotlib" in lines[0], lines[0]
    assert result.stdout == ""  # said before any work: no trace read, no sample taken, no benchmark row
    assert not any(tmp_path.iterdir())


def test_a_trace_file_without_cpus_and_times_says_so(saved_trace, tmp_path):
    """A file whose frames carry neither $cpu_id nor $clock (a target that did not save them): export and plot say
    what is unknown instead of passing it off as measured."""
    result = kgtp("export", str(saved_trace), "--format", "jsonl", "-o", str(tmp_path / "run.jsonl"))
    assert result.returncode == 0, result.stderr
    assert "its frames carry no CPU ($cpu_id)" in result.stderr and "no time ($clock)" in result.stderr
    records = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert len(records) == 30 and all(record["cpu"] is None for record in records)


# ---- what `kgtp-sim run` loads ----------------------------------------------------------------------------


def test_run_loads_only_what_running_a_program_needs(tmp_path):
    """`kgtp-sim run` starts a program on a new machine (its time is the benchmark's, end to end): no stub server,
    tracer, viewer or GDB driver, and none of keystone, capstone or pyelftools (the machine reads ELF files itself
    and its native hooks are committed bytes), while the program runs as before."""
    from .programs import compile_program

    program = compile_program("hello", "glibc-dynamic", tmp_path)
    unwanted = ("keystone", "capstone", "elftools", "kgtp_sim.rsp", "kgtp_sim.stub", "kgtp_sim.tracing",
                "kgtp_sim.view", "kgtp_sim.bench", "kgtp_sim.client.gdb", "kgtp_sim.client.mi")
    report = ("import atexit, os, sys\n"  # what was imported, said on stderr as the interpreter ends
              f"unwanted = {unwanted!r}\n"
              "atexit.register(lambda: os.write(2, repr(sorted(m for m in sys.modules\n"
              "    if any(m == u or m.startswith(u + '.') for u in unwanted))).encode()))")
    result = kgtp("run", "--cpus", "1", str(program), prelude=report)
    assert (result.returncode, result.stdout) == (3, "hello, world\n"), result.stderr
    assert result.stderr.endswith("[]"), result.stderr
