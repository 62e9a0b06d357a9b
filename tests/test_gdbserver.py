"""`kgtp-sim gdbserver`: its command line and the environment it gives its program (without a machine), and how it
ends at `monitor exit` (a server subprocess)."""

from __future__ import annotations

import contextlib
import re
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from kgtp_sim.client.rsp import RspClient
from kgtp_sim.gdbserver import UsageError, fit_environment, parse, parse_comm
from kgtp_sim.machine.process import SPAWN_ARGS_SIZE
from kgtp_sim.programs import NamedFileError, named_files

from .conftest import ROOT
from .programs import compile_program

#: where the kernel loads a PIE (fixtures/kernel/include/process.h: ELF_ET_DYN_BASE, as Linux without ASLR)
PIE_BASE = 0x5555_5555_4000


def request_size(path: str, argv: list[str], envp: list[str]) -> int:
    """The bytes of the kernel's spawn request: every string with its NUL (machine/process.py: spawn)."""
    return sum(len(s.encode()) + 1 for s in (path, *argv, *envp))


def test_an_environment_that_fits_is_passed_whole_in_order():
    envp = ["HOME=/root", "PATH=/usr/bin:/bin", "TERM=dumb"]
    assert fit_environment("/bin/prog", ["/bin/prog", "arg"], envp, SPAWN_ARGS_SIZE) == (envp, [])


def test_the_largest_variables_are_left_out_until_the_rest_fits():
    """A make's environment (RUNTESTFLAGS and MAKEFLAGS naming every test file) outgrows the kernel's page: those
    are left out, the small ones stay, in their order."""
    files = " ".join(f"gdb.base/file{i}.exp" for i in range(200))
    envp = ["HOME=/root", f"MAKEFLAGS=w -- RUNTESTFLAGS={files}", "TERM=dumb", f"RUNTESTFLAGS={files}",
            "LANG=C"]
    argv = ["/prog", "one"]
    assert request_size("/prog", argv, envp) > SPAWN_ARGS_SIZE
    kept, left_out = fit_environment("/prog", argv, envp, SPAWN_ARGS_SIZE)
    assert left_out == ["MAKEFLAGS", "RUNTESTFLAGS"]
    assert kept == ["HOME=/root", "TERM=dumb", "LANG=C"]


def test_only_as_much_is_left_out_as_the_budget_needs():
    envp = [f"V{i}={'x' * (10 * i)}" for i in range(1, 8)]
    budget = request_size("/p", ["/p"], envp) - 1  # one byte too many: the largest goes, nothing else
    kept, left_out = fit_environment("/p", ["/p"], envp, budget)
    assert left_out == ["V7"]
    assert kept == envp[:-1]
    assert request_size("/p", ["/p"], kept) <= budget


def test_arguments_too_long_for_the_kernel_leave_no_environment():
    """The arguments are the program's own and are never cut: the kernel's refusal of them is the error."""
    kept, left_out = fit_environment("/p", ["/p", "y" * SPAWN_ARGS_SIZE], ["A=1", "B=2"], SPAWN_ARGS_SIZE)
    assert (kept, left_out) == ([], ["A", "B"])


def test_gdbservers_command_line():
    options = parse(["--once", "--wrapper", "env", "--", "localhost:2345", "/bin/prog", "a", "b"])
    assert (options.once, options.wrapper, options.comm, options.program) == (
        True, ["env"], "localhost:2345", ["/bin/prog", "a", "b"])
    assert parse_comm("localhost:2345") == ("localhost", 2345)
    assert parse_comm(":2345") == ("127.0.0.1", 2345)
    assert parse_comm("stdio") is None
    with pytest.raises(UsageError):
        parse(["--once", "localhost:2345"])


@contextlib.contextmanager
def served(program: Path, *args: str) -> Iterator[tuple[subprocess.Popen, int]]:
    """`kgtp-sim gdbserver --once` on a free port with PROGRAM ARGS, as GDB's testsuite starts gdbserver: the server
    and the port its `Listening on port` line names; killed at the end if still there."""
    server = subprocess.Popen([sys.executable, "-m", "kgtp_sim", "gdbserver", "--once", "127.0.0.1:0",
                               str(program), *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        port = None
        for line in server.stderr:
            listening = re.match(r"Listening on port (\d+)", line)
            if listening:
                port = int(listening.group(1))
                break
        assert port is not None, "the server never listened"
        yield server, port
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_fork_vfork_and_exec_events_are_announced(tmp_path):
    """Announcing the events, as gdbserver does, lets GDB insert `catch fork`/`vfork`/`exec` (gdb.base/break.exp:
    test_no_break_on_catchpoint); they are reported (below)."""
    with served(compile_program("hello", "glibc-static", tmp_path)) as (_server, port):
        with RspClient.connect(port) as client:
            features = client.request(b"qSupported:multiprocess+;fork-events+;vfork-events+;exec-events+").split(b";")
            assert {b"fork-events+", b"vfork-events+", b"exec-events+"} <= set(features)


def test_monitor_exit_ends_the_server_without_waiting_for_gdb_to_leave(tmp_path):
    """gdbserver hangs up once `monitor exit` is answered; GDB's testsuite (gdbserver_exit) waits for the
    server's end of file while GDB stays connected. The client here keeps its socket open and sees the server
    close it and exit."""
    with served(compile_program("hello", "glibc-static", tmp_path)) as (server, port):
        with RspClient.connect(port) as client:
            assert client.monitor("exit") == ""
            assert server.wait(timeout=20) == 0
            client.sock.settimeout(5)
            with pytest.raises(ConnectionError):
                client.packet()


def test_the_library_list_and_host_io_are_the_roles_at_the_packet_level(tmp_path):
    """qSupported announces the library list with its augmented form (gdbserver's pair; KGTP mode announces
    neither: tests/e2e/test_security.py); at the first instruction, before ld.so has set r_debug, the list is
    empty and valid; host I/O answers for the machine's files only."""
    program = compile_program("hello", "glibc-dynamic", tmp_path)
    with served(program) as (_server, port):
        with RspClient.connect(port) as client:
            features = client.request(b"qSupported:multiprocess+").split(b";")
            assert {b"qXfer:libraries-svr4:read+", b"augmented-libraries-svr4-read+"} <= set(features)
            assert client.request(b"qXfer:libraries-svr4:read::0,1000") == (
                b'l<library-list-svr4 version="1.0"></library-list-svr4>')
            assert client.request(b"qXfer:libraries-svr4:read::21,1000") == b"l</library-list-svr4>"  # windows
            assert client.request(b"qXfer:libraries-svr4:read::0,10") == b'm<library-list-sv'
            assert client.request(b"vFile:open:%s,0,0" % b"/etc/passwd".hex().encode()) == b"F-1,2"
            assert client.request(b"vFile:open:%s,0,0" % str(program.resolve()).encode().hex().encode()) == b"F3"
            assert client.request(b"vFile:pread:3,4,0") == b"F4;\x7fELF"
            # at main, once ld.so has loaded libc: the program as main-lm, then libc and ld.so, ld.so's l_addr the
            # auxiliary vector's AT_BASE; the augmented form from libc's successor gives the rest of the list
            assert client.request(b"Z0,%x,1" % (PIE_BASE + _symbol(program, "main"))) == b"OK"
            assert client.request(b"vCont;c").startswith(b"T05")
            document = client.request(b"qXfer:libraries-svr4:read::0,1000")
            head = re.fullmatch(rb'l<library-list-svr4 version="1\.0" main-lm="0x[0-9a-f]+">(.*)</library-list-svr4>',
                                document)
            assert head, document
            libraries = re.findall(rb'<library name="([^"]+)" lm="0x([0-9a-f]+)" l_addr="0x([0-9a-f]+)" '
                                   rb'l_ld="0x[0-9a-f]+" lmid="0x([0-9a-f]+)"/>', head.group(1))
            names = [name for name, *_ in libraries]
            assert names == [b"/lib/x86_64-linux-gnu/libc.so.6", b"/lib64/ld-linux-x86-64.so.2"], document
            auxv = client.request(b"qXfer:auxv:read::0,1000")[1:]
            at_base = dict(struct.unpack_from("<QQ", auxv, at) for at in range(0, len(auxv), 16))[7]
            assert int(libraries[1][2], 16) == at_base
            (_, libc_lm, _, lmid), (_, ldso_lm, _, _) = libraries
            tail = client.request(b"qXfer:libraries-svr4:read:lmid=%s;start=%s;prev=%s:0,1000" % (lmid, ldso_lm,
                                                                                                  libc_lm))
            assert tail == b'l<library-list-svr4 version="1.0">' + head.group(1)[head.group(1).index(
                b'<library name="/lib64'):] + b"</library-list-svr4>", tail


def _symbol(program: Path, name: str) -> int:
    with program.open("rb") as f:
        return ELFFile(f).get_section_by_name(".symtab").get_symbol_by_name(name)[0]["st_value"]


def test_a_static_program_has_no_library_list_as_under_gdbserver(tmp_path):
    """No PT_DYNAMIC, no DT_DEBUG: E01, gdbserver's answer, and GDB reads the memory itself (finding nothing)."""
    with served(compile_program("hello", "glibc-static", tmp_path)) as (_server, port):
        with RspClient.connect(port) as client:
            assert client.request(b"qXfer:libraries-svr4:read::0,1000") == b"E01"


def test_multi_needs_no_program_and_attach_takes_a_pid():
    """gdbserver's three forms: PROG, `--multi COMM`, `--attach COMM PID` (and --attach after COMM)."""
    options = parse(["--multi", ":2345"])
    assert (options.multi, options.program, options.attach) == (True, [], None)
    assert parse(["--attach", ":2345", "123"]).attach == 123
    assert parse([":2345", "--attach", "77"]).attach == 77
    for bad in (["--attach", ":2345"], ["--attach", ":2345", "x"], ["--attach", ":2345", "1", "2"]):
        with pytest.raises(UsageError):
            parse(bad)


def _fields(status: bytes) -> dict[bytes, bytes]:
    """qTStatus's `name:value` fields (the running flag and the stop reason left out)."""
    return dict(field.split(b":", 1) for field in status.split(b";")[2:] if b":" in field)


def test_trace_buffer_size_and_trace_timestamp_are_gdbservers_at_the_packet_level(tmp_path):
    """What GDB's `set trace-buffer-size` and connection ask, answered as gdbserver answers them
    (gdbserver/tracepoint.cc: cmd_bigqtbuffer_size, cmd_qtstatus, cmd_qtfv/cmd_qtsv's response_tsv, cmd_qtv):
    the size as asked, in tsize and tfree, the default for `-1`; `$trace_timestamp` among the uploaded variables
    as a built-in, unknown before any run."""
    with served(compile_program("hello", "glibc-static", tmp_path)) as (_server, port):
        with RspClient.connect(port) as client:
            assert b"QTBuffer:size+" in client.request(b"qSupported:multiprocess+").split(b";")
            status = _fields(client.request(b"qTStatus"))
            assert (status[b"tsize"], status[b"tfree"]) == (b"500000", b"500000")  # 5 MiB, not one per CPU
            assert client.request(b"QTBuffer:size:4") == b"OK"
            status = _fields(client.request(b"qTStatus"))
            assert (status[b"tsize"], status[b"tfree"]) == (b"4", b"4")
            assert client.request(b"QTBuffer:size:-1") == b"OK"
            assert _fields(client.request(b"qTStatus"))[b"tsize"] == b"500000"
            uploaded = [client.request(b"qTfV")]
            while uploaded[-1] != b"l":
                uploaded.append(client.request(b"qTsV"))
            name = b"trace_timestamp".hex().encode()
            timestamp = [line for line in uploaded if line.endswith(b":" + name)]
            assert len(timestamp) == 1 and timestamp[0].split(b":")[1:3] == [b"0", b"1"], uploaded
            number = timestamp[0].split(b":")[0]
            assert client.request(b"qTV:" + number) == b"U"


# ---- --with FILE ---------------------------------------------------------------------------------------------------


def test_with_names_files_in_order_and_needs_one():
    options = parse(["--with", "a.so", "--once", "--with=/x/b.sl", ":2345", "/bin/prog"])
    assert (options.with_files, options.once, options.program) == (["a.so", "/x/b.sl"], True, ["/bin/prog"])
    assert parse(["--multi", "--with", "$ORIGIN/*.so", ":2345"]).with_files == ["$ORIGIN/*.so"]
    for bad in (["--with"], ["--with=", ":2345", "/bin/prog"]):
        with pytest.raises(UsageError, match="--with needs"):
            parse(bad)


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A program's directory as a build leaves it: the program, two shared objects, a link to one of them, a
    source file, a subdirectory; and a directory elsewhere reached through a link. The working directory is
    tmp_path."""
    build = tmp_path / "build"
    (build / "sub").mkdir(parents=True)
    for name in ("prog", "liba.so", "libb.sl", "prog.c", "sub/libc.so"):
        (build / name).write_bytes(name.encode())
    (build / "liba.so.1").symlink_to("liba.so")
    (tmp_path / "elsewhere").symlink_to(build)
    monkeypatch.chdir(tmp_path)
    return build


def test_a_named_file_is_found_inside_by_its_path_its_target_and_its_name_from_the_root(tree):
    """Named relative, through a link: under its absolute path, the path its links resolve to, and the relative
    name from "/" (every process's working directory inside); each with the host file's bytes."""
    files = named_files(["elsewhere/liba.so.1"])
    assert files == dict.fromkeys([str(tree.parent / "elsewhere" / "liba.so.1"), str(tree / "liba.so"),
                                   "/elsewhere/liba.so.1"], tree / "liba.so")
    assert named_files([str(tree / "libb.sl")]) == {str(tree / "libb.sl"): tree / "libb.sl"}
    assert "/liba.so" not in named_files(["build/../build/liba.so"])  # normalized: /build/liba.so
    assert set(named_files(["../" + tree.parent.name + "/build/liba.so"])) == {str(tree / "liba.so")}  # not below


def test_origin_names_files_beside_the_program_and_patterns_take_the_regular_files_that_match(tree):
    program = tree.parent / "elsewhere" / "prog"  # its directory is where the link leads, as the program is packed
    assert set(named_files(["$ORIGIN/*.so"], program)) == {str(tree / "liba.so")}
    assert set(named_files(["$ORIGIN/*.so.*", "$ORIGIN/*.sl"], program)) == {
        str(tree / "liba.so.1"), str(tree / "liba.so"), str(tree / "libb.sl")}
    assert named_files(["$ORIGIN/sub/libc.so"], program) == {str(tree / "sub" / "libc.so"): tree / "sub" / "libc.so"}
    assert named_files(["$ORIGIN/*.dll", "$ORIGIN/*"], None) == {}  # no program: nothing beside it yet
    assert named_files(["$ORIGIN/*.dll"], program) == {}  # a pattern matching nothing is no error
    assert set(named_files(["$ORIGIN/*"], program)) == {str(tree / n) for n in ("prog", "liba.so", "libb.sl",
                                                                              "prog.c", "liba.so.1")}


def test_a_named_file_that_is_not_there_is_an_error_naming_it(tree):
    with pytest.raises(NamedFileError, match=r"^--with nothing\.so: no such file on this host$"):
        named_files(["build/liba.so", "nothing.so"])
    with pytest.raises(NamedFileError, match=r"^--with build/sub: not a regular file$"):
        named_files(["build/sub"])
    with pytest.raises(NamedFileError, match=rf"^--with \$ORIGIN/libz\.so \({tree}/libz\.so\): no such file"):
        named_files(["$ORIGIN/libz.so"], tree / "prog")


def test_a_missing_with_file_ends_the_server_before_boot(tmp_path):
    """gdbserver's way with a program it cannot start: a line saying why, exit status 1."""
    program = compile_program("hello", "glibc-static", tmp_path)
    for options, said in ((["--with", str(tmp_path / "absent.so")], f"--with {tmp_path}/absent.so: no such file"),
                          (["--with", "$ORIGIN/absent.so"], f"--with $ORIGIN/absent.so ({tmp_path}/absent.so): no")):
        server = subprocess.run([sys.executable, "-m", "kgtp_sim", "gdbserver", "--once", *options, "127.0.0.1:0",
                                 str(program)], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert server.returncode == 1, server.stderr
        assert f"kgtp-sim gdbserver: {said}" in server.stderr, server.stderr
        assert "Process" not in server.stderr


# ---- fork, vfork and exec events (stub/process.py, stub/extended.py), as GDB's remote.c reads them -------------------

EVENTS = b"qSupported:multiprocess+;swbreak+;fork-events+;vfork-events+;exec-events+"
GDB_SIGCHLD = 0x14  #: GDB_SIGNAL_CHLD (GDB numbers signals its own way: gdb/signals.def)


def _ptid(client: RspClient) -> tuple[int, int]:
    pid, tid = re.fullmatch(rb"QCp([0-9a-f]+)\.([0-9a-f]+)", client.request(b"qC")).groups()
    return int(pid, 16), int(tid, 16)


def _register(client: RspClient, thread: bytes, name: str) -> int:
    """A register of `thread` (`Hg` then `g`): rax and rip, the first and the 17th of x86-64's `g` block."""
    assert client.request(b"Hg" + thread) == b"OK"
    block = client.request(b"g")
    index = {"rax": 0, "rip": 16}[name]
    return int.from_bytes(bytes.fromhex(block[16 * index: 16 * index + 16].decode()), "little")


def test_a_fork_is_reported_with_its_child_which_gdb_may_look_at_and_detach(tmp_path):
    """gdbserver's fork event: `T05fork:pCHILD.CHILD;` naming the parent's thread; the child, stopped before its
    first instruction, is a process of the server's (listed, its registers those of the fork's return: rax 0, the
    parent's rip; its program the parent's); `D;CHILD` lets it go and leaves the parent debugged (the connection
    stays: gdbserver's handle_detach while a process is left), and the parent ends as the program does."""
    program = compile_program("forks", "glibc-static", tmp_path)
    with served(program, "work") as (server, port):
        with RspClient.connect(port) as client:
            assert b"fork-events+" in client.request(EVENTS).split(b";")
            pid, _ = _ptid(client)
            assert client.request(b"QPassSignals:%x;" % GDB_SIGCHLD) == b"OK"
            stop = client.request(b"vCont;c:p%x.-1" % pid)
            found = re.fullmatch(rb"T05fork:p([0-9a-f]+)\.([0-9a-f]+);thread:p%x\.%x;" % (pid, pid), stop)
            assert found and found.group(1) == found.group(2), stop
            child = int(found.group(1), 16)
            assert child != pid
            threads = client.request(b"qfThreadInfo")
            assert threads == b"mp%x.%x,p%x.%x" % (pid, pid, child, child), threads
            parent_rip = _register(client, b"p%x.%x" % (pid, pid), "rip")
            assert _register(client, b"p%x.%x" % (child, child), "rax") == 0
            assert _register(client, b"p%x.%x" % (child, child), "rip") == parent_rip
            assert client.request(b"qXfer:exec-file:read:%x:0,fff" % child) == (
                client.request(b"qXfer:exec-file:read:%x:0,fff" % pid))
            assert client.request(b"D;%x" % (child + 1000)) == b"E01"  # no such process
            assert client.request(b"D;%x" % child) == b"OK"
            assert client.request(b"qfThreadInfo") == b"mp%x.%x" % (pid, pid)
            assert client.request(b"vCont;c:p%x.-1" % pid) == b"W00;process:%x" % pid
    assert "Detaching from process %d" % child in server.stderr.read()


def test_a_kept_fork_child_is_selected_by_its_pid_and_killed_alone(tmp_path):
    """GDB's `kill inferiors 2` of a fork child it kept: `Hgp<pid>.0` selects that process's thread, `vKill;PID`
    kills it and the server goes on with the parent (a process left: gdbserver's handle_v_kill), whose wait4 sees
    its child killed; a pid the server has not is E01."""
    program = compile_program("forks", "glibc-static", tmp_path)
    with served(program, "work") as (_server, port):
        with RspClient.connect(port) as client:
            client.request(EVENTS)
            pid, _ = _ptid(client)
            assert client.request(b"QPassSignals:%x;" % GDB_SIGCHLD) == b"OK"
            stop = client.request(b"vCont;c:p%x.-1" % pid)
            child = int(re.fullmatch(rb"T05fork:p([0-9a-f]+)\.[0-9a-f]+;thread:.*", stop).group(1), 16)
            assert client.request(b"Hgp%x.0" % child) == b"OK"
            assert client.request(b"qC") == b"QCp%x.%x" % (child, child)
            assert client.request(b"Hgp%x.0" % (child + 1000)) == b"E05"
            assert client.request(b"vKill;%x" % (child + 1000)) == b"E01"
            assert client.request(b"vKill;%x" % child) == b"OK"
            assert client.request(b"qfThreadInfo") == b"mp%x.%x" % (pid, pid)
            assert client.request(b"vCont;c:p%x.-1" % pid) == b"W01;process:%x" % pid  # "killed by signal 9"


def test_without_fork_events_the_fork_child_runs_untraced_as_before(tmp_path):
    """A GDB that does not ask for fork events hears of none: the child is not traced (the machine takes the
    parent's int3s out of its copy) and the program runs to its end."""
    program = compile_program("forks", "glibc-static", tmp_path)
    with served(program, "work") as (_server, port):
        with RspClient.connect(port) as client:
            client.request(b"qSupported:multiprocess+")
            pid, _ = _ptid(client)
            assert client.request(b"QPassSignals:%x;" % GDB_SIGCHLD) == b"OK"
            assert client.request(b"vCont;c") == b"W00;process:%x" % pid


def test_a_vfork_is_reported_and_its_end_too(tmp_path):
    """`T05vfork:` with the child, then, once the detached child exec'd, `T05vforkdone:;` of the parent (GDB puts
    back the breakpoints it took out of the memory the two shared), then the program's end."""
    program = compile_program("execs", "glibc-static", tmp_path)
    with served(program, "vfork") as (_server, port):
        with RspClient.connect(port) as client:
            client.request(EVENTS)
            pid, _ = _ptid(client)
            assert client.request(b"QPassSignals:%x;" % GDB_SIGCHLD) == b"OK"
            stop = client.request(b"vCont;c:p%x.-1" % pid)
            found = re.fullmatch(rb"T05vfork:p([0-9a-f]+)\.[0-9a-f]+;thread:p%x\.%x;" % (pid, pid), stop)
            assert found, stop
            assert client.request(b"D;" + found.group(1)) == b"OK"
            assert client.request(b"vCont;c:p%x.-1" % pid) == b"T05vforkdone:;thread:p%x.%x;" % (pid, pid)
            assert client.request(b"vCont;c:p%x.-1" % pid) == b"W00;process:%x" % pid


def test_an_exec_is_reported_with_the_new_program_whose_image_has_no_old_breakpoint(tmp_path):
    """`T05exec:HEXPATH;` at the new program's first instruction (the ELF entry of a static program); the old
    image's breakpoint went with it, the process's breakpoints begin anew as gdbserver's mourned and re-added
    process's (the new image runs image() without stopping: GDB inserts its breakpoints again when it resumes);
    the program's path is the exec'd one."""
    program = compile_program("execs", "glibc-static", tmp_path)
    image = _symbol(program, "image")
    with program.open("rb") as f:
        entry = ELFFile(f).header["e_entry"]
    with served(program, "1") as (_server, port):
        with RspClient.connect(port) as client:
            client.request(EVENTS)
            pid, _ = _ptid(client)
            thread = b"p%x.%x" % (pid, pid)
            path = client.request(b"qXfer:exec-file:read:%x:0,fff" % pid)[1:]
            assert client.request(b"Z0,%x,1" % image) == b"OK"
            assert client.request(b"vCont;c:p%x.-1" % pid) == b"T05swbreak:;thread:%s;" % thread
            assert client.request(b"z0,%x,1" % image) == b"OK"  # over the breakpoint as GDB steps over it
            assert client.request(b"vCont;s:%s" % thread).startswith(b"T05thread:")
            assert client.request(b"Z0,%x,1" % image) == b"OK"
            exec_stop = b"T05exec:%s;thread:%s;" % (path.hex().encode(), thread)
            assert client.request(b"vCont;c:p%x.-1" % pid) == exec_stop
            assert _register(client, thread, "rip") == entry
            assert client.request(b"qXfer:exec-file:read:%x:0,fff" % pid) == b"l" + path
            assert client.request(b"vCont;c:p%x.-1" % pid) == b"W00;process:%x" % pid
