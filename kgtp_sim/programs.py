"""Programs on the simulated kernel, from the command line: `kgtp-sim run PROG [ARGS...]` and `serve --run`.

Wiring, like app.py: the programs named on the command line go into the machine's initramfs before it boots,
with what a dynamically linked one needs (its interpreter and libraries, found as its dynamic linker will look
for them inside: initramfs.Archive.add_program; nothing else of the host is reachable from inside); a library
that cannot be found is an error before boot. Each is started as a process once the machine runs
(`Processes.spawn`), and what the processes write to fds 1 and 2 comes out on the host's own streams. `run`
exits with the program's status as a shell reports it (128 + the signal when a signal ended it).

`install_program` does the same for a machine already running (the gdbserver role's vRun): the files go into its
initramfs through the kernel (Processes.add_files).

`named_files`: files the user names besides the programs (`kgtp-sim gdbserver --with FILE`: a library a program only
dlopen()s, which its DT_NEEDED does not name, or a file it opens), each only as named, under the paths a program
inside would open it by; `$ORIGIN/NAME` is NAME beside each program packed (where a RUNPATH of `$ORIGIN` makes its
dynamic linker look), NAME possibly a pattern. Both `load_programs` and `install_program` pack them with the programs.

Threads: the main thread starts the machine, the programs, and waits; process output is written from the CPU
thread (the port handler) straight to the host's file descriptors; a daemon thread relays the host's standard
input into the kernel's console ring (`relay_input`).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import posixpath
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: how often `run` looks at the machine while its program runs (a kernel that panicked ends the wait)
POLL_S = 0.2


@dataclass(frozen=True)
class Program:
    """A program to run: its host file, and argv as the user typed it (argv[0] included)."""

    path: Path
    argv: tuple[str, ...]

    @classmethod
    def parse(cls, command: str) -> Program:
        """`serve --run 'PROG ARGS'`: one argument split as a shell would."""
        words = shlex.split(command)
        if not words:
            raise ValueError("--run needs a program")
        return cls(Path(words[0]), tuple(words))


_RUN_EXAMPLES = """\
examples:
  gcc -O2 -o hello hello.c
  kgtp-sim run ./hello              # its output, then its exit status
  kgtp-sim run --cpus 1 ./args one two
  kgtp-sim serve --run './loop forever'   # trace it from GDB meanwhile
"""


def add_run_parser(commands, vmlinux: Path, default_cpus: int) -> None:
    run = commands.add_parser(
        "run", help="run an x86_64 Linux program as a process on the kernel",
        description="Boot the simulated machine, run PROG with ARGS as a process (its stdout and\n"
                    "stderr are this command's), and exit with its status (128 + the signal if one\n"
                    "ended it). Static or dynamically linked (glibc, musl): a dynamic program's\n"
                    "interpreter and libraries go into the machine with it, nothing else of the host.",
        epilog=_RUN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("--kernel", type=Path, default=vmlinux, help="static x86_64 kernel ELF (default: bundled)")
    run.add_argument("--cpus", type=int, default=default_cpus, help=f"CPUs of the machine (default: {default_cpus})")
    run.add_argument("--hz", type=int, default=100, help="timer tick rate of the kernel (default: 100)")
    run.add_argument("program", type=Path, help="the program (a host file, copied into the machine's initramfs)")
    run.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")


#: `--with $ORIGIN/NAME`: NAME in the directory of the program packed, as the dynamic linker expands `$ORIGIN` in a
#: RUNPATH (its DT_RUNPATH of `$ORIGIN` is how GDB's testsuite, and many builds, find libraries beside a program)
ORIGIN = "$ORIGIN/"
#: what makes a NAME a shell pattern (fnmatch's)
_PATTERN = frozenset("*?[")


class NamedFileError(ValueError):
    """A file the user named (`--with FILE`) that is not a regular file on this host."""


def _inside_paths(named: str) -> list[str]:
    """The paths inside the machine the host file `named` (as typed) goes under, so that a program finds it by the
    name it would use on the host: its absolute path (the host's working directory taken), the path its symbolic
    links resolve to (where the directory of a program packed under its own resolved path leads), and, for a
    relative name that stays below the working directory, that name from "/", every process's working directory
    inside (fixtures/kernel/fs.c: get_path), so that `open("lib/x.so")` finds it as it does here."""
    paths = [os.path.abspath(named), os.path.realpath(named)]
    relative = posixpath.normpath(named)
    if not named.startswith("/") and not relative.startswith(".."):
        paths.append("/" + relative)
    return list(dict.fromkeys(paths))


def named_files(names: Sequence[str], program: Path | None = None) -> dict[str, Path]:
    """The files the user named to pack (`--with FILE`, repeatable): path inside -> host file (its links resolved),
    each found inside by its path (`_inside_paths`). A name beginning `$ORIGIN/` is looked for in the directory of
    `program` (its links resolved, as the program is packed: `Archive.add_host_file`), and only when a program is
    given; its last part may be a shell pattern (`$ORIGIN/*.so`): the regular files it matches there, none being no
    error. Nothing else is packed: a named library's own DT_NEEDED are named too, or are not there. Raises
    NamedFileError for a name (not a pattern) that is no regular file on this host."""
    files: dict[str, Path] = {}
    for name in names:
        found = [(name, name)]  # (the host path as typed, as an error names it)
        if name.startswith(ORIGIN):
            if program is None:
                continue
            directory, rest = os.path.dirname(os.path.realpath(program)), name[len(ORIGIN):]
            found = [(os.path.join(directory, rest), f"{name} ({os.path.join(directory, rest)})")]
            if "/" not in rest and _PATTERN & set(rest):
                entries = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
                found = [(host, host) for host in (os.path.join(directory, entry) for entry in entries
                                                   if fnmatch.fnmatchcase(entry, rest)) if os.path.isfile(host)]
        for host, shown in found:
            if not os.path.isfile(host):
                raise NamedFileError(f"--with {shown}: "
                                     f"{'not a regular file' if os.path.exists(host) else 'no such file on this host'}")
            files.update(dict.fromkeys(_inside_paths(host), Path(os.path.realpath(host))))
    return files


def _pack_named(archive, names: Sequence[str], program: Path | None) -> None:
    for inside, host in named_files(names, program).items():
        archive.add_host_file(host, inside)


def load_programs(machine, programs: list[Program], named: Sequence[str] = ()) -> dict[Path, str]:
    """Pack the programs and what they need to run into the machine's initramfs (before boot), and the files the
    user `named` (`named_files`: `$ORIGIN/` ones beside each program); host path -> path inside. Raises OSError or
    ValueError (initramfs.MissingFile: a library not found; NamedFileError) naming what is wrong."""
    from .machine.initramfs import Archive

    archive = Archive()
    library_path = os.environ.get("LD_LIBRARY_PATH", "")  # the programs get this environment
    inside = {program.path: archive.add_program(program.path, library_path) for program in programs}
    for program in programs or [None]:
        _pack_named(archive, named, program and program.path)
    machine.processes.load_archive(archive.pack())
    return inside


def install_program(machine, path: Path, named: Sequence[str] = ()) -> str:
    """A host program and what its dynamic linker will open, with the files the user `named` (`named_files`), added
    to the running machine's initramfs (files it has already, with the same bytes, are not added again:
    Processes.add_files); its path inside. Raises OSError or ValueError (not an x86_64 program, a library not found,
    a named file not there) naming what is wrong, before anything goes in."""
    from .machine.initramfs import Archive, check_program

    check_program(path)
    archive = Archive()
    inside = archive.add_program(path, os.environ.get("LD_LIBRARY_PATH", ""))
    _pack_named(archive, named, path)
    machine.processes.add_files(archive)
    return inside


def relay_output(machine, stdout_fd: int = 1, stderr_fd: int = 2) -> None:
    """Processes' fds 1 and 2 go to these host file descriptors."""
    targets = {1: stdout_fd, 2: stderr_fd}

    def sink(fd: int, data: bytes) -> None:
        target = targets.get(fd)
        while target is not None and data:
            try:
                data = data[os.write(target, data):]
            except OSError:
                return

    machine.processes.sink = sink


def relay_input(machine, fd: int = 0) -> None:
    """The host's file descriptor `fd` becomes the processes' standard input (gdbserver's inferior reads its
    terminal): a daemon thread feeds what it reads into the kernel's console ring, and says when it ended. Before
    boot, fds 0-2 that are terminals here are terminals inside too."""
    import threading

    machine.processes.set_terminals([n for n in (0, 1, 2) if os.isatty(n)])

    def pump() -> None:
        while True:
            try:
                data = os.read(fd, 4096)
            except OSError:
                data = b""
            if not data:
                machine.processes.end_input()
                return
            while data:
                taken = machine.processes.feed_input(data)
                data = data[taken:]
                if data:  # the ring is full: readers take a tick to come round
                    time.sleep(0.01)

    threading.Thread(target=pump, name="stdin-relay", daemon=True).start()


def environment() -> list[str]:
    return [f"{key}={value}" for key, value in os.environ.items()]


def describe_exit(name: str, ended) -> str | None:
    """A shell's kind of message for a program a signal ended (None if it exited)."""
    if not ended.signal:
        return None
    try:
        signame = signal.Signals(ended.signal).name
    except ValueError:
        signame = f"signal {ended.signal}"
    return f"kgtp-sim: {name}: killed by {signame}"


def run(args: argparse.Namespace) -> int:
    from .machine import KernelImage, KernelImageError, Machine
    from .machine.process import SpawnError

    if not 1 <= args.cpus <= 8:
        print("kgtp-sim: --cpus must be between 1 and 8", file=sys.stderr)
        return 2
    program = Program(args.program, (str(args.program), *args.args))
    try:
        image = KernelImage.load(args.kernel)
    except KernelImageError as error:
        print(f"kgtp-sim: {error}", file=sys.stderr)
        return 1
    machine = Machine(image, hz=args.hz, cpus=args.cpus)
    try:
        inside = load_programs(machine, [program])
    except (OSError, ValueError) as error:
        print(f"kgtp-sim: {program.path}: {getattr(error, 'strerror', None) or error}", file=sys.stderr)
        return 127
    relay_output(machine)
    relay_input(machine)
    interrupted = []
    signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum))
    signal.signal(signal.SIGTERM, lambda signum, frame: interrupted.append(signum))
    machine.start()
    try:
        pid = machine.processes.spawn(inside[program.path], program.argv, environment())
        while not interrupted:
            ended = machine.processes.wait(pid, POLL_S)
            if ended is not None:
                message = describe_exit(str(program.path), ended)
                if message:
                    print(message, file=sys.stderr, flush=True)
                return ended.shell_status
            if machine.devices.power_off_code is not None or machine.stats(count=False).state.startswith("crashed"):
                print(f"kgtp-sim: the kernel stopped while {program.path} ran:\n{machine.console_text()[-2000:]}",
                      file=sys.stderr)
                return 1
        return 128 + interrupted[0]
    except SpawnError as error:
        print(f"kgtp-sim: {error}", file=sys.stderr)
        return 1
    finally:
        machine.shutdown()


def start_program(machine, program: Program, inside: str) -> int:
    """Start a program packed in the machine (`inside`: its path there) once the machine runs; its pid. A thread
    reports its end on stderr. Raises SpawnError if the kernel refuses it."""
    import threading

    def watch(pid: int, name: str) -> None:
        ended = machine.processes.wait(pid)
        print(describe_exit(name, ended) or f"kgtp-sim: {name} (pid {pid}) exited with status {ended.code}",
              file=sys.stderr, flush=True)

    pid = machine.processes.spawn(inside, program.argv, environment())
    print(f"kgtp-sim: started {' '.join(program.argv)} as pid {pid}", file=sys.stderr, flush=True)
    threading.Thread(target=watch, args=(pid, str(program.path)), name=f"kgtp-wait-{pid}", daemon=True).start()
    return pid


def start_programs(machine, programs: list[Program], inside: dict[Path, str]) -> None:
    """`serve --run`: start each program once the machine runs."""
    for program in programs:
        start_program(machine, program, inside[program.path])


@dataclass
class Launcher:
    """`monitor run PROG ARGS` (stub/ps.py): starts a program packed before boot (`serve --run`, `--with`), named
    as on the command line that packed it, by its path inside the machine, or by its file name when that is one
    program's only. Nothing else: no host file is read after boot."""

    machine: object
    inside: dict[Path, str]

    def resolve(self, name: str) -> str:
        for host, path in self.inside.items():
            if name in (str(host), path):
                return path
        matches = {path for host, path in self.inside.items() if host.name == name}
        if len(matches) == 1:
            return matches.pop()
        packed = ", ".join(str(host) for host in self.inside) or "none"
        raise LookupError(f"{name} is not a program of this machine (packed at boot: {packed}; serve --with PROG "
                          "packs one without starting it)")

    def __call__(self, name: str, args: list[str]) -> int:
        return start_program(self.machine, Program(Path(name), (name, *args)), self.resolve(name))
