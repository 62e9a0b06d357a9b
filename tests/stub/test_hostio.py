"""The gdbserver role's host I/O (stub/hostio.py) at the packet level, on a machine whose archive holds a dynamically
linked program with its interpreter and libraries: the machine's files read whole, byte for byte the host files
the user named, stat as the machine's kernel tells it; every other path refused as ENOENT, the host's own files
(one this test made, /etc/passwd) and path traversal included; writing, creating and removing refused; descriptors
GDB did not open refused as gdbserver refuses them (EINVAL); replies that fit in one packet."""

from __future__ import annotations

import re
import stat
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kgtp_sim.client import VMLINUX
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.procfs import ProcFiles
from kgtp_sim.machine.ramfs import Ramfs
from kgtp_sim.programs import install_program
from kgtp_sim.rsp import codec
from kgtp_sim.rsp.dispatch import PACKET_SIZE, Binary, Dispatcher
from kgtp_sim.rsp.packets import hostio as h
from kgtp_sim.stub.hostio import MAX_FDS, HostIOHandlers, _fitting

from ..conftest import wait_until
from ..programs import compile_program

LIBC = "/lib/x86_64-linux-gnu/libc.so.6"
EINVAL, ENOENT = h.error(h.FILEIO_EINVAL), h.error(h.FILEIO_ENOENT)


@pytest.fixture(scope="module")
def machine(tmp_path_factory):
    """A running machine, and the program the user named: a glibc PIE, packed with ld.so and libc."""
    program = compile_program("hello", "glibc-dynamic", tmp_path_factory.mktemp("hostio"))
    machine = Machine(KernelImage.load(VMLINUX), cpus=1)
    machine.start()
    inside = install_program(machine, program)
    yield machine, program, inside
    machine.shutdown()


@pytest.fixture
def server(machine):
    """What GDB speaks to: the handlers of a new connection, through the dispatcher."""
    handlers = HostIOHandlers(Ramfs(machine[0]))
    return handlers, Dispatcher((handlers,)).dispatch


def _hex(path: str | bytes) -> bytes:
    return (path.encode() if isinstance(path, str) else path).hex().encode()


def open_file(dispatch, path: str | bytes, flags: int = 0, mode: int = 0) -> bytes:
    return dispatch(b"vFile:open:%s,%x,%x" % (_hex(path), flags, mode))


def _result(reply: Binary | bytes) -> tuple[int, bytes]:
    """(result, attachment) of a reply with data."""
    assert isinstance(reply, Binary), reply
    head, _, data = reply.data.partition(b";")
    assert head.startswith(b"F"), reply
    return int(head[1:], 16), data


def read_whole(dispatch, fd: int, count: int = 0x4000) -> bytes:
    out = b""
    while True:
        length, data = _result(dispatch(b"vFile:pread:%x,%x,%x" % (fd, count, len(out))))
        assert length == len(data)
        if not data:
            return out
        out += data


def test_the_program_and_its_libraries_are_read_whole_as_the_host_files_they_came_from(machine, server):
    _machine, program, inside = machine
    _handlers, dispatch = server
    assert dispatch(b"vFile:setfs:0") == b"F0"
    for path, host in ((inside, program), (LIBC, Path(LIBC).resolve()),
                       ("/lib64/ld-linux-x86-64.so.2", Path("/lib64/ld-linux-x86-64.so.2").resolve())):
        reply = open_file(dispatch, path, 0, 0o700)
        assert reply == b"F3", (path, reply)  # the first descriptor after a process's standard three
        assert read_whole(dispatch, 3) == host.read_bytes(), path
        size, raw = _result(dispatch(b"vFile:fstat:3"))
        assert size == h.STAT_SIZE == len(raw)
        dev, _ino, mode, nlink, uid, gid, rdev, st_size, blksize, blocks, *times = struct.unpack(">7I3Q3I", raw)
        host_stat = host.stat()
        assert (dev, nlink, uid, gid, rdev, blksize, times) == (1, 1, 0, 0, 0, 4096, [0, 0, 0])
        assert (mode, st_size) == (stat.S_IFREG | stat.S_IMODE(host_stat.st_mode), host_stat.st_size)
        assert blocks == (host_stat.st_size + 511) // 512
        assert dispatch(b"vFile:close:3") == b"F0"
        assert dispatch(b"vFile:close:3") == EINVAL  # closed: no longer GDB's


def test_the_setfs_of_a_process_is_the_same_one_file_system(machine, server):
    _handlers, dispatch = server
    assert dispatch(b"vFile:setfs:64") == b"F0"
    assert open_file(dispatch, LIBC) == b"F3"
    assert dispatch(b"vFile:setfs:0") == b"F0"


def test_a_read_past_the_end_is_empty_and_a_large_one_fits_in_a_packet(machine, server):
    _handlers, dispatch = server
    assert open_file(dispatch, LIBC) == b"F3"
    size = Path(LIBC).stat().st_size
    assert _result(dispatch(b"vFile:pread:3,100,%x" % size)) == (0, b"")
    assert _result(dispatch(b"vFile:pread:3,100,%x" % (size + 0x10000))) == (0, b"")
    length, data = _result(dispatch(b"vFile:pread:3,7fffffff,0"))
    assert 0 < length == len(data) and len(codec.escape(b"F%x;" % length + data)) <= PACKET_SIZE
    assert data == Path(LIBC).read_bytes()[:length]


def test_only_what_fits_escaped_is_sent():
    header = b"F%x;" % PACKET_SIZE
    plain = bytes(range(0x30, 0x40)) * 0x1000
    assert _fitting(header, plain) == plain[:PACKET_SIZE - len(header)]
    special = b"}" * PACKET_SIZE  # each byte two on the wire
    assert _fitting(header, special) == special[:(PACKET_SIZE - len(header)) // 2]
    assert _fitting(header, b"$#") == b"$#"


@given(st.lists(st.sampled_from(b"a}$#*\x00"), max_size=300).map(bytes), st.integers(0, 300),
       st.sampled_from([b"F%x;" % PACKET_SIZE, b"F1;"]))
def test_the_longest_start_that_fits_escaped_is_sent(body, length, header):
    """Whatever the data and wherever its escaped bytes are: the longest start whose escaped length fits."""
    data = (b"x" * (PACKET_SIZE - len(header) - 150) + body)[:PACKET_SIZE - len(header) - 150 + length]
    budget = PACKET_SIZE - len(header)
    wire = [0]  # the escaped length of each start of the data, byte by byte
    for byte in data:
        wire.append(wire[-1] + len(codec.escape(bytes([byte]))))
    longest = max(count for count, size in enumerate(wire) if size <= budget)
    assert _fitting(header, data) == data[:longest]


@pytest.mark.parametrize("path", [
    "/etc/passwd", "/lib/../../etc/passwd", "/lib/x86_64-linux-gnu/../../../etc/passwd", "just probing",
    "/proc/self/exe", "/proc/1/maps", "/usr/lib/debug/.build-id/00/00.debug",
])
def test_a_path_the_machine_has_no_file_at_is_enoent(server, path):
    _handlers, dispatch = server
    assert open_file(dispatch, path) == ENOENT
    assert dispatch(b"vFile:readlink:" + _hex(path)) == ENOENT


@pytest.mark.parametrize("path", ["/", "/lib", "/lib/x86_64-linux-gnu/"])
def test_a_directory_cannot_be_opened_and_is_no_link(server, path):
    """As the machine's kernel answers a process (fs.c: no directory can be opened), and readlink(2) of one."""
    _handlers, dispatch = server
    assert open_file(dispatch, path) == ENOENT
    assert dispatch(b"vFile:readlink:" + _hex(path)) == EINVAL


def test_a_host_file_next_to_the_program_is_not_served(machine, server):
    """The host has it, under a path the program's own directory shares; the machine has not."""
    _machine, program, _inside = machine
    _handlers, dispatch = server
    secret = program.parent / "secret.txt"
    secret.write_bytes(b"the host's")
    assert open_file(dispatch, str(secret)) == ENOENT
    assert open_file(dispatch, str(program.parent / ".." / program.parent.name / "secret.txt")) == ENOENT


def test_a_path_through_dot_dot_to_a_file_of_the_machine_is_that_file(machine, server):
    _handlers, dispatch = server
    assert open_file(dispatch, "/lib/x86_64-linux-gnu/../x86_64-linux-gnu/./libc.so.6") == b"F3"
    assert read_whole(dispatch, 3)[:4] == b"\x7fELF"


def test_writing_creating_and_removing_are_refused(machine, server):
    _machine, program, inside = machine
    _handlers, dispatch = server
    for flags in (h.O_WRONLY, h.O_RDWR, h.O_WRONLY | h.O_CREAT | h.O_TRUNC, h.O_APPEND, h.O_CREAT | h.O_EXCL):
        assert open_file(dispatch, inside, flags, 0o700) == h.error(h.FILEIO_EACCES), flags
        assert open_file(dispatch, "/tmp/new-file", flags, 0o700) == h.error(h.FILEIO_EACCES), flags
    assert open_file(dispatch, inside) == b"F3"
    assert dispatch(b"vFile:pwrite:3,0,XXXX") == h.error(h.FILEIO_EACCES)
    assert dispatch(b"vFile:pwrite:9,0,XXXX") == EINVAL
    assert dispatch(b"vFile:unlink:" + _hex(inside)) == h.error(h.FILEIO_EPERM)
    assert dispatch(b"vFile:unlink:" + _hex(str(program))) == h.error(h.FILEIO_EPERM)
    assert read_whole(dispatch, 3) == program.read_bytes()  # unchanged, here and on the host
    assert program.exists()


def test_descriptors_gdb_did_not_open_are_einval_as_gdbservers_require_valid_fd(server):
    _handlers, dispatch = server
    for packet in (b"vFile:pread:3,10,0", b"vFile:pread:0,10,0", b"vFile:fstat:1", b"vFile:close:2",
                   b"vFile:close:7fffffff", b"vFile:pwrite:3,0,x"):
        assert dispatch(packet) == EINVAL, packet


def test_malformed_requests_are_einval(server):
    _handlers, dispatch = server
    for packet in (b"vFile:open:2f6,0,0", b"vFile:open:" + _hex(LIBC) + b",0", b"vFile:pread:3,zz,0",
                   b"vFile:open:" + _hex(LIBC) + b",4,0", b"vFile:setfs:-1", b"vFile:readlink:2f00",
                   b"vFile:open:2f0065,0,0"):
        assert dispatch(packet) == EINVAL, packet


def test_a_path_too_long_for_the_kernel(server):
    _handlers, dispatch = server
    assert open_file(dispatch, "/" + "a" * 5000) == h.error(h.FILEIO_ENAMETOOLONG)
    assert dispatch(b"vFile:readlink:" + _hex("/" + "a" * 5000)) == h.error(h.FILEIO_ENAMETOOLONG)


def test_a_file_of_the_machine_is_no_link(server):
    _handlers, dispatch = server
    assert dispatch(b"vFile:readlink:" + _hex(LIBC)) == EINVAL


def test_descriptors_are_bounded_and_a_new_connection_starts_with_none(server):
    handlers, dispatch = server
    fds = [open_file(dispatch, LIBC) for _ in range(MAX_FDS)]
    assert fds == [b"F%x" % n for n in range(3, 3 + MAX_FDS)]
    assert open_file(dispatch, LIBC) == h.error(h.FILEIO_EMFILE)
    assert dispatch(b"vFile:close:5") == b"F0"
    assert open_file(dispatch, LIBC) == b"F5"  # the lowest free
    handlers.forget_session()
    assert dispatch(b"vFile:fstat:3") == EINVAL
    assert open_file(dispatch, LIBC) == b"F3"


def test_stat_and_lstat_say_what_the_machines_kernel_tells_a_process(machine, server, tmp_path):
    """vFile:stat and vFile:lstat (GDB 16 and later) of files, directories and missing paths: the fields a program
    inside the machine reads from stat() and lstat() of the same paths (tests/programs/statpaths.c), as the
    protocol carries them (32-bit fields truncated), or its errno."""
    booted, _program, inside = machine
    _handlers, dispatch = server
    statpaths = install_program(booted, compile_program("statpaths", "glibc-dynamic", tmp_path))
    paths = [inside, LIBC, "/lib/../lib64/ld-linux-x86-64.so.2", "/", "/lib", "/lib/x86_64-linux-gnu/", "/etc/passwd",
             "/lib/x86_64-linux-gnu/libc.so"]
    before = len(booted.processes.output[1])
    pid = booted.processes.spawn(statpaths, ["statpaths", *paths])
    ended = booted.processes.wait(pid, timeout=120)
    assert ended is not None and ended.code == 0
    lines = bytes(booted.processes.output[1][before:]).decode().splitlines()
    assert len(lines) == 2 * len(paths), lines
    for line in lines:
        call, path, *fields = line.split(" ")
        reply = dispatch(b"vFile:%s:%s" % (call.encode(), _hex(path)))
        if fields[0] == "errno":
            assert reply == h.error(int(fields[1])), (line, reply)
            continue
        seen = dict(zip(fields[::2], fields[1::2]))
        size, raw = _result(reply)
        assert size == h.STAT_SIZE == len(raw)
        dev, ino, mode, nlink, uid, gid, rdev, st_size, blksize, blocks, *times = struct.unpack(">7I3Q3I", raw)
        assert (dev, ino, mode, nlink, st_size, blksize, blocks) == (
            int(seen["dev"]), int(seen["ino"]) & 0xFFFF_FFFF, int(seen["mode"], 8), int(seen["nlink"]),
            int(seen["size"]), int(seen["blksize"]), int(seen["blocks"])), (line, reply)
        assert (uid, gid, rdev, times) == (0, 0, 0, [0, 0, 0])
    kinds = [int(dict(zip(f[::2], f[1::2]))["mode"], 8) & 0o170000 for f in (l.split(" ")[2:] for l in lines)
             if f[0] != "errno"]
    assert kinds.count(stat.S_IFDIR) == 6 and kinds.count(stat.S_IFREG) == 6, lines  # both kinds were compared


def test_stat_of_a_path_too_long_for_the_kernel(server):
    _handlers, dispatch = server
    for call in (b"stat", b"lstat"):
        assert dispatch(b"vFile:%s:%s" % (call, _hex("/" + "a" * 5000))) == h.error(h.FILEIO_ENAMETOOLONG)


# ---- /proc: the machine's processes as a debugger on the host reads them (machine/procfs.py) -------------------


@pytest.fixture(scope="module")
def running(machine, tmp_path_factory):
    """tests/programs/counted.c (static, not PIE: its segments where its program headers say) running with
    arguments and an environment of its own."""
    booted = machine[0]
    program = compile_program("counted", "glibc-static", tmp_path_factory.mktemp("proc"))
    inside = install_program(booted, program)
    pid = booted.processes.spawn(inside, [inside, "one", "two words"], ["HOME=/", "KGTP=yes"])
    files = ProcFiles(booted)  # the kernel made the process; it has an address space once its exec loaded it
    wait_until(lambda: files.lookup(f"/proc/{pid}/maps".encode()) is not None, f"process {pid}'s exec")
    return program, inside, pid


@pytest.fixture
def proc(machine):
    handlers = HostIOHandlers(Ramfs(machine[0]), ProcFiles(machine[0]))
    return Dispatcher((handlers,)).dispatch


def _read(dispatch, path: str) -> bytes:
    reply = open_file(dispatch, path)
    assert reply.startswith(b"F") and b"," not in reply, (path, reply)
    fd = int(reply[1:], 16)
    try:
        return read_whole(dispatch, fd, 0x100)  # small reads: a file longer than one
    finally:
        assert dispatch(b"vFile:close:%x" % fd) == b"F0"


def test_proc_maps_lists_the_programs_segments_and_its_stack(running, proc):
    """Each PT_LOAD segment of the program is an area with its permissions and its file offset, named by its path
    inside the machine, device 00:01 and the file's inode, in address order; the stack's area is `[stack]`."""
    from elftools.elf.elffile import ELFFile

    program, inside, pid = running
    lines = _read(proc, f"/proc/{pid}/maps").decode().splitlines()
    areas = [re.match(r"^([0-9a-f]+)-([0-9a-f]+) ([r-][w-][x-]p) ([0-9a-f]{8}) (\d\d:\d\d) (\d+) +(\S*)$", line)
             for line in lines]
    assert all(areas), lines
    rows = [(int(a[1], 16), int(a[2], 16), a[3], int(a[4], 16), a[5], int(a[6]), a[7]) for a in areas]
    assert [r[0] for r in rows] == sorted(r[0] for r in rows)
    ours = [(start, perms, offset) for start, _end, perms, offset, device, _inode, path in rows if path == inside]
    assert {device for *_, device, _inode, path in rows if path == inside} == {"00:01"}
    with program.open("rb") as f:
        segments = list(ELFFile(f).iter_segments())
    relro = next(s for s in segments if s["p_type"] == "PT_GNU_RELRO")
    relro_pages = range(relro["p_vaddr"] & ~0xFFF, relro["p_vaddr"] + relro["p_memsz"] & ~0xFFF)

    def perms(segment) -> set[str]:  # the segment's; where RELRO covers it, read-only once the C library's start
        flags = segment["p_flags"]  # protected it (the program may not have got that far yet)
        own = ("r" if flags & 4 else "-") + ("w" if flags & 2 else "-") + ("x" if flags & 1 else "-") + "p"
        return {own, "r--p"} if segment["p_vaddr"] & ~0xFFF in relro_pages else {own}

    loads = [s for s in segments if s["p_type"] == "PT_LOAD"]
    at = {start: (area_perms, offset) for start, area_perms, offset in ours}
    for segment in loads:  # an area at each segment's start, its offset in the file, its permissions
        start = segment["p_vaddr"] & ~0xFFF
        assert start in at and at[start][1] == segment["p_offset"] & ~0xFFF, (ours, start)
        assert at[start][0] in perms(segment), (ours, start)
    assert rows[-1][6] == "[stack]" and rows[-1][2] == "rw-p", lines
    stat = _result(proc(b"vFile:stat:" + _hex(inside)))[1]
    assert {inode & 0xFFFF_FFFF for *_, inode, path in rows if path == inside} == {int.from_bytes(stat[4:8], "big")}


def test_proc_cmdline_environ_comm_and_the_links(running, proc):
    _program, inside, pid = running
    assert _read(proc, f"/proc/{pid}/cmdline") == inside.encode() + b"\0one\0two words\0"
    assert _read(proc, f"/proc/{pid}/environ") == b"HOME=/\0KGTP=yes\0"
    assert _read(proc, f"/proc/{pid}/comm") == Path(inside).name[:15].encode() + b"\n"
    assert proc(b"vFile:readlink:" + _hex(f"/proc/{pid}/exe")) == Binary(b"F%x;%s" % (len(inside), inside.encode()))
    assert proc(b"vFile:readlink:" + _hex(f"/proc/{pid}/cwd")) == Binary(b"F1;/")
    # the link itself (lstat), what it leads to (stat, open): the program's file, the root directory
    lstat = _result(proc(b"vFile:lstat:" + _hex(f"/proc/{pid}/exe")))[1]
    fields = struct.unpack(">7I3Q3I", lstat)
    assert (fields[2], fields[7]) == (0o777, len(inside))  # (the protocol's mode names no link: its bits only)
    assert proc(b"vFile:stat:" + _hex(f"/proc/{pid}/exe")) == proc(b"vFile:stat:" + _hex(inside))
    assert proc(b"vFile:stat:" + _hex(f"/proc/{pid}/cwd")) == proc(b"vFile:stat:" + _hex("/"))
    assert _read(proc, f"/proc/{pid}/exe")[:4] == b"\x7fELF"
    for directory in ("/proc", f"/proc/{pid}", f"/proc/{pid}/"):
        mode = struct.unpack(">7I3Q3I", _result(proc(b"vFile:stat:" + _hex(directory)))[1])[2]
        assert stat.S_ISDIR(mode), directory
        assert open_file(proc, directory) == ENOENT  # no directory can be opened here
    assert proc(b"vFile:readlink:" + _hex(f"/proc/{pid}/maps")) == EINVAL


@pytest.mark.parametrize("path", ["/proc/self/maps", "/proc/999999/maps", "/proc/0/maps", "/proc/{pid}/mem",
                                  "/proc/{pid}/maps/x", "/proc/-1/maps", "/proc/{pid}x/maps", "/proc/1/maps"])
def test_proc_paths_that_name_nothing_are_enoent(running, proc, path):
    """`self` (the host's own process is no process of the machine's), no such pid, a kernel thread's (no address
    space), files this /proc does not have."""
    path = path.format(pid=running[2])
    assert open_file(proc, path) == ENOENT
    assert proc(b"vFile:stat:" + _hex(path)) == ENOENT


def test_without_procfs_there_is_no_proc(running, server):
    _handlers, dispatch = server
    assert open_file(dispatch, f"/proc/{running[2]}/maps") == ENOENT
