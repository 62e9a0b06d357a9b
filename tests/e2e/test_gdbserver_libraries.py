"""Shared libraries and the target's files under `kgtp-sim gdbserver`, with real GDB 13.1 and 18.1, beside Debian's
gdbserver on the same program: GDB takes the list of loaded objects from `qXfer:libraries-svr4:read` instead of
walking the process's memory, and reads the program and its libraries through vFile (its default sysroot
`target:`), the machine's files only.

- `info sharedlibrary` at main lists ld.so and libc as gdbserver's does (ld.so at the same addresses; libc with the
  same extent: see `test_info_sharedlibrary_as_under_gdbserver` for where the machine places it), the same as GDB's
  own walk of the link_map chain gives (`set remote library-info-svr4-packet off`), and GDB's packet log shows the
  list and the files coming from the server;
- a breakpoint in a library function, set before the library is loaded, is hit, the same stop as under gdbserver;
- a library the program dlopen()s appears when it is loaded (tests/programs/dlopens.c opens libgcc_s.so.1, which
  the machine's archive carries with every glibc program);
- GDB started without the program reads it, and the libraries, from the target;
- `remote get` fetches a file of the machine, byte for byte the host file the user named; the host's own files
  (/etc/passwd, directly or through `..`) are refused, as are `remote put` and `remote delete`.

Every wait is for an event (a line a server prints, GDB's end); each test stops the servers it started.
"""

from __future__ import annotations

import difflib
import re
import subprocess
from pathlib import Path

import pytest

from kgtp_sim.client import GDB_CLIENTS, ROOT, GdbClient
from kgtp_sim.client.gdb import gdb_environment, gdb_path

from ..programs import MODES, SOURCES, compile_program
from .test_gdbserver_role import (KINDS, LINE, MAIN_MODE, QUIET, WAIT_S, _gdb, build, normalized,  # noqa: F401
                                  servers)

pytestmark = pytest.mark.gdb

LIBC = "/lib/x86_64-linux-gnu/libc.so.6"
LDSO = "/lib64/ld-linux-x86-64.so.2"
#: a row of `info sharedlibrary`: From, To, Syms Read, the object's name
ROW = re.compile(r"^(0x[0-9a-f]+)\s+(0x[0-9a-f]+)\s+(Yes|No)( \(\*\))?\s+(\S+)$", re.M)


def gdb_session(gdb: GdbClient, port: int, commands: list[str], *, before: tuple[str, ...] = (),
                program: Path | None = None) -> str:
    """GDB in batch mode, attached to the server on `port` after the settings `before`, running `commands` (each
    an `-ex`: one that fails does not end the session); everything it printed (stderr too: its packet log).
    `program` None: GDB starts without the program's file and takes it from the target."""
    lines = ["set pagination off", "set confirm off", "set width 0", *QUIET, *before, f"target remote 127.0.0.1:{port}",
             *commands]
    argv = [gdb_path(gdb), "-nx", "-batch", *([str(program)] if program else []),
            *(argument for line in lines for argument in ("-ex", line))]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                               env=gdb_environment(), cwd=ROOT)
    try:
        return process.communicate(timeout=WAIT_S)[0]
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError("GDB did not end its session; it printed:\n" + process.communicate()[0]) from None


def served(servers, kind: str, gdb: GdbClient, program: Path, commands: list[str], *, args: tuple[str, ...] = ("exit",),
           before: tuple[str, ...] = (), with_file: bool = True) -> str:
    """One server of `kind` for `program ARGS`, one GDB session on it; GDB's output once the server has ended."""
    server = servers(kind, program, *args)
    try:
        out = gdb_session(gdb, server.listening(), commands, before=before, program=program if with_file else None)
    except AssertionError as error:
        raise AssertionError(f"{error}\n---- the server printed:\n{server.text()}") from None
    assert server.wait() == 0, server.text()
    return out


def rows(out: str) -> list[tuple[int, int, str]]:
    """The objects `info sharedlibrary` listed: (From, To, name), `target:` dropped from the name."""
    return [(int(m.group(1), 16), int(m.group(2), 16), m.group(5).removeprefix("target:")) for m in ROW.finditer(out)]


def assert_same(ours: str, theirs: str, moved: bool = False) -> None:
    ours_lines, theirs_lines = normalized(ours, moved), normalized(theirs, moved)
    assert ours_lines == theirs_lines, "\n".join(difflib.unified_diff(theirs_lines, ours_lines, "gdbserver",
                                                                      "kgtp-sim gdbserver", lineterm=""))


# ---- the list of loaded objects -------------------------------------------------------------------------------------


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_info_sharedlibrary_as_under_gdbserver(build, servers, gdb):
    """ld.so's From and To are gdbserver's; libc's have the same extent and page offsets, and are where GDB's own
    walk of the process's link_map chain puts them. (Linux maps libc lower by the pages its vDSO and vvar take and
    by the hole /etc/ld.so.cache left, which ld.so mapped while it loaded libc: the machine has neither, so its
    libc sits that much higher.) GDB took the list from the packet, and read both objects through vFile."""
    program = build(MAIN_MODE)
    commands = ["break main", "continue", "info sharedlibrary", "kill"]
    theirs = rows(served(servers, "gdbserver", gdb, program, commands))
    logged = served(servers, "kgtp-sim", gdb, program, commands, before=("set debug remote 1",))
    ours = rows(logged)
    walked = rows(served(servers, "kgtp-sim", gdb, program, commands,
                         before=("set remote library-info-svr4-packet off",)))
    assert [name for *_, name in ours] == [name for *_, name in theirs] == [LDSO, LIBC], (ours, theirs)
    assert ours == walked, (ours, walked)
    assert ours[0] == theirs[0], (ours, theirs)
    (our_from, our_to, _), (their_from, their_to, _) = ours[1], theirs[1]
    assert our_to - our_from == their_to - their_from and (our_from - their_from) % 0x1000 == 0, (ours, theirs)
    # the packet GDB read the list from, and the files it read through vFile
    assert re.search(r"Sending packet: \$qXfer:libraries-svr4:read::0,", logged), logged[-3000:]
    listed = re.findall(r'Packet received: l<library-list-svr4 version="1\.0" main-lm="0x[0-9a-f]+">(.*)', logged)
    assert any(f'<library name="{LIBC}" lm="0x' in document for document in listed), logged[-3000:]
    for path in (LDSO, LIBC):
        assert re.search(rf"Sending packet: \$vFile:open:{path.encode().hex()},0,0#..\n.*Packet received: F[0-9a-f]+\n",
                         logged), path


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_a_breakpoint_in_a_library_function_set_before_it_loaded_is_hit(build, servers, gdb):
    """`break fflush` at the first instruction (libc not loaded yet: pending), then continue: the stop in libc
    and the frames back to main, as under gdbserver."""
    program = build(MAIN_MODE)
    commands = ["set breakpoint pending on", "break fflush", "continue", "bt", "continue"]
    outs = {kind: served(servers, kind, gdb, program, commands) for kind in KINDS}
    assert re.search(r"^Breakpoint 1, (0x[0-9a-f]+ in )?\S*fflush\S* \(", outs["kgtp-sim"], re.M), outs["kgtp-sim"]
    assert re.search(rf"^#1  0x[0-9a-f]+ in main \(.*debugme\.c:{LINE['print'] + 1}$", outs["kgtp-sim"], re.M), \
        outs["kgtp-sim"]
    assert re.search(r"^\[Inferior 1 \(.*\) exited with code 012\]$", outs["kgtp-sim"], re.M), outs["kgtp-sim"]
    assert_same(outs["kgtp-sim"], outs["gdbserver"])


@pytest.fixture(scope="module")
def dlopens(tmp_path_factory) -> Path:
    """tests/programs/dlopens.c, a glibc PIE with its debugging information."""
    out_dir = tmp_path_factory.mktemp("dlopens")
    compile_program("hello", MAIN_MODE, out_dir)  # skips as that does if the mode cannot be built here
    if not any(Path(d, "libgcc_s.so.1").exists() for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu")):
        pytest.skip("no libgcc_s.so.1 on this host: the program has nothing to dlopen that the machine carries")
    out = out_dir / "dlopens"
    subprocess.run([*MODES[MAIN_MODE], "-g", "-O0", str(SOURCES / "dlopens.c"), "-o", str(out)], check=True,
                   capture_output=True)
    return out


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_a_library_loaded_by_dlopen_appears_when_it_is_loaded(dlopens, servers, gdb):
    commands = ["break loaded", "continue", "info sharedlibrary", "continue", "info sharedlibrary",
                "info symbol _Unwind_Find_FDE", "continue"]
    outs = {kind: served(servers, kind, gdb, dlopens, commands, args=()) for kind in KINDS}
    ours = outs["kgtp-sim"]
    before, after = ours.split('Breakpoint 1, loaded (what=')[1:3]
    assert [name for *_, name in rows(before)] == [LDSO, LIBC], before
    names = [name for *_, name in rows(after)]
    assert names[:2] == [LDSO, LIBC] and names[2].endswith("/libgcc_s.so.1") and len(names) == 3, after
    assert re.search(r"^_Unwind_Find_FDE in section \.text of \S*libgcc_s\.so\.1$", after, re.M), after
    assert re.search(r"^\[Inferior 1 \(.*\) exited normally\]$", ours, re.M), ours
    assert_same(ours, outs["gdbserver"])


# ---- the target's files --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_gdb_without_the_program_reads_it_and_its_libraries_from_the_target(build, servers, gdb):
    """`set sysroot target:` (GDB's default, said here) and no program file given to GDB: GDB takes the program's
    path from the target (qXfer:exec-file) and reads it, ld.so and libc through vFile; its symbols and the
    libraries' work as under gdbserver."""
    program = build(MAIN_MODE)
    commands = ["break add", "continue", "bt", "info sharedlibrary", "info symbol fflush", "delete", "continue"]
    outs = {kind: served(servers, kind, gdb, program, commands, before=("set sysroot target:",), with_file=False)
            for kind in KINDS}
    ours = outs["kgtp-sim"]
    assert re.search(rf"^Reading symbols from target:{re.escape(str(program))}\.\.\.$", ours, re.M), ours
    assert re.search(rf"^Breakpoint 1, add \(step=1\) at \S*debugme\.c:{LINE['add']}$", ours, re.M), ours
    assert [name for *_, name in rows(ours)] == [LDSO, LIBC], ours
    assert re.search(r"^fflush in section \.text of target:/lib/x86_64-linux-gnu/libc\.so\.6$", ours, re.M), ours
    assert re.search(r"^\[Inferior 1 \(.*\) exited with code 012\]$", ours, re.M), ours
    assert_same(ours, outs["gdbserver"])


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_remote_get_fetches_the_machines_files_and_refuses_the_hosts(build, servers, gdb, tmp_path):
    """The program and libc come back byte for byte; /etc/passwd, straight or through `..`, is no file of the
    machine; `remote put` and `remote delete` are refused and change nothing."""
    program = build(MAIN_MODE)
    got = {name: tmp_path / name for name in ("program", "libc", "passwd", "traversal")}
    local = tmp_path / "local.txt"
    local.write_bytes(b"stays here")
    out = served(servers, "kgtp-sim", gdb, program, [
        f"remote get {program} {got['program']}", f"remote get {LIBC} {got['libc']}",
        f"remote get /etc/passwd {got['passwd']}", f"remote get /lib/../../etc/passwd {got['traversal']}",
        f"remote put {local} /tmp/kgtp-sim-put", f"remote delete {program}", "print 6*7", "kill"])
    assert got["program"].read_bytes() == program.read_bytes()
    assert got["libc"].read_bytes() == Path(LIBC).read_bytes()
    assert not got["passwd"].exists() and not got["traversal"].exists()
    assert out.count("Remote I/O error: No such file or directory") == 2, out
    assert "Remote I/O error: Permission denied" in out and "Remote I/O error: Operation not permitted" in out, out
    assert re.search(r"^\$1 = 42$", out, re.M), out
    assert program.exists() and local.read_bytes() == b"stays here"
    assert "root:" not in out


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_a_separate_debug_file_on_the_target_is_found_by_its_build_id(servers, gdb, tmp_path):
    """The program stripped, its debugging information in a separate file the machine holds (`--with`) under a
    build-id debug directory the host does not have (removed once the server packed it): GDB finds it on the
    target, GDB 18 asking first whether the build-id link exists there (`vFile:lstat`, which the server answers),
    and reads the program's lines and locals from it."""
    from elftools.elf.elffile import ELFFile

    program = tmp_path / "debugme-stripped"
    subprocess.run([*MODES[MAIN_MODE], "-g", "-O0", "-Wl,--build-id", str(SOURCES / "debugme.c"), "-o", str(program)],
                   check=True, capture_output=True)
    with program.open("rb") as f:
        note = next(n for section in ELFFile(f).iter_sections() if section.name == ".note.gnu.build-id"
                    for n in section.iter_notes())
    build_id = note["n_desc"]
    debug_dir = tmp_path / "debug"
    debug_file = debug_dir / ".build-id" / build_id[:2] / f"{build_id[2:]}.debug"
    debug_file.parent.mkdir(parents=True)
    subprocess.run(["objcopy", "--only-keep-debug", str(program), str(debug_file)], check=True, capture_output=True)
    subprocess.run(["strip", "--strip-debug", str(program)], check=True, capture_output=True)
    server = servers("kgtp-sim", program, "exit", options=("--once", "--with", str(debug_file)))
    port = server.listening()
    debug_file.unlink()  # the host has it no more: only the machine's copy can be found
    lstat = ["show remote hostio-lstat-packet"] if gdb.version != "13" else []
    out = gdb_session(gdb, port, ["break add", "continue", "info locals", *lstat, "kill"], program=None,
                      before=(f"set debug-file-directory {debug_dir}",))
    assert re.search(rf"^Breakpoint 1, add \(step=1\) at \S*debugme\.c:{LINE['add']}", out, re.M), out
    assert re.search(rf"^Reading symbols from target:{re.escape(str(debug_file))}\.\.\.$", out, re.M), out
    assert re.search(r"^before = -?\d+$", out, re.M), out  # add's local, from the debug file
    if lstat:  # GDB 16 and later ask first
        assert re.search(r"vFile:lstat.* is \"auto\", currently enabled", out), out
    server.stop()


#: a row of `info proc mappings`: start, end, size, offset, perms and the object (none for an anonymous area)
MAPPING = re.compile(r"^\s*(0x[0-9a-f]+)\s+(0x[0-9a-f]+)\s+(0x[0-9a-f]+)\s+(0x[0-9a-f]+)\s+([r-][w-][x-][ps])[ \t]*(\S*)[ \t]*$",
                     re.M)


@pytest.mark.parametrize("gdb", GDB_CLIENTS, ids=lambda c: f"gdb{c.version}")
def test_info_proc_and_gcore_read_the_processes_proc_files_as_under_gdbserver(build, servers, gdb, tmp_path):
    """`info proc` (cmdline, exe, cwd), `info proc mappings` and `gcore` read /proc/PID through vFile: the
    program's command line and path as under gdbserver, its areas the same (the program's at the same addresses,
    each library's the same sizes, offsets and permissions), and the core file `gcore` wrote shows the stop it
    was taken at. The differences are the host's: its working directory (the machine's processes run in "/"), the
    libraries' real paths (/usr/lib behind /lib's link), the areas only Linux maps (vDSO, vvar, vsyscall) and the
    anonymous areas each C library's start leaves."""
    program = build(MAIN_MODE)
    outs = {}
    for kind in KINDS:
        core = tmp_path / f"core-{kind}"
        outs[kind] = served(servers, kind, gdb, program, [
            "break add", "continue", "info proc", "info proc mappings", f"gcore {core}", "kill"], args=("exit",))
        assert re.search(rf"^Saved corefile {re.escape(str(core))}$", outs[kind], re.M), outs[kind]
        loaded = subprocess.run([gdb_path(gdb), "-nx", "-batch", str(program), str(core), "-ex", "bt",
                                 "-ex", "print step"], capture_output=True, text=True, env=gdb_environment(),
                                timeout=WAIT_S)
        assert re.search(rf"^#0  add \(step=1\) at \S*debugme\.c:{LINE['add']}$", loaded.stdout, re.M), loaded
        assert re.search(r"^#1 .* in main \(", loaded.stdout, re.M) and "$1 = 1" in loaded.stdout, loaded
    ours, theirs = outs["kgtp-sim"], outs["gdbserver"]
    for line in (rf"cmdline = '{re.escape(str(program))} exit'", rf"exe = '{re.escape(str(program))}'"):
        assert re.search("^" + line + "$", ours, re.M) and re.search("^" + line + "$", theirs, re.M), (ours, theirs)
    assert re.search(r"^cwd = '/'$", ours, re.M), ours

    def areas(out: str) -> dict[str, list[tuple[int, ...]]]:
        """Each object's areas: the program's (start, size, offset, perms), a library's (size, offset, perms)."""
        found: dict[str, list[tuple]] = {}
        for start, _end, size, offset, perms, name in MAPPING.findall(out):
            if name.startswith("/"):
                base = Path(name).name
                key = (int(start, 16),) if name == str(program) else ()
                found.setdefault(base, []).append((*key, int(size, 16), int(offset, 16), perms))
        return found

    assert areas(ours) == areas(theirs), (ours, theirs)
    assert set(areas(ours)) == {program.name, "libc.so.6", "ld-linux-x86-64.so.2"}, ours
    assert re.search(r"^\s*0x0*7ff[0-9a-f]+\s+0x0*7ff[0-9a-f]+\s+.*rw-p\s+\[stack\]\s*$", ours, re.M), ours
