"""The machine's files as its kernel lists them (machine/ramfs.py): paths resolved as the kernel's fs.c resolves them,
each file found by its path inside the machine with its bytes the archive's, a file added later under a path
shadowing the older, and nothing else: no directory, no host file."""

from __future__ import annotations

import stat
import time

import pytest

from kgtp_sim.client import VMLINUX
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.initramfs import Archive
from kgtp_sim.machine.ramfs import PATH_MAX, PathTooLong, Ramfs, normalize


@pytest.fixture(scope="module")
def machine():
    machine = Machine(KernelImage.load(VMLINUX), cpus=1)
    archive = Archive()
    archive.add_file("/bin/first", b"first file", 0o755)
    archive.add_file("/lib/data.txt", b"x" * 10000, 0o644)
    machine.processes.load_archive(archive.pack())
    machine.start()
    # the kernel lists the archive's files early in its boot, which start() does not wait for: wait for its word
    deadline = time.monotonic() + 60
    while "initramfs: " not in machine.console_text():
        assert time.monotonic() < deadline, machine.console_text()
        time.sleep(0.01)
    yield machine
    machine.shutdown()


@pytest.mark.parametrize("path, normal", [
    (b"/lib/x86_64-linux-gnu/libc.so.6", b"/lib/x86_64-linux-gnu/libc.so.6"),
    (b"lib//./x.so", b"/lib/x.so"),  # relative to "/", the working directory of every process
    (b"/lib/../../etc/passwd", b"/etc/passwd"), (b"/../../..", b"/"), (b"", b"/"), (b"/a/b/..", b"/a"),
])
def test_paths_are_resolved_as_the_kernel_resolves_them(path, normal):
    assert normalize(path) == normal


def test_a_path_the_kernel_would_find_too_long():
    assert normalize(b"/" + b"a" * (PATH_MAX - 2)) == b"/" + b"a" * (PATH_MAX - 2)
    with pytest.raises(PathTooLong):
        normalize(b"/" + b"a" * (PATH_MAX - 1))


def test_a_file_is_found_by_its_path_inside_and_read_from_the_archive(machine):
    files = Ramfs(machine)
    found = files.lookup(b"/lib/data.txt")
    assert found is not None and found.path == b"/lib/data.txt" and found.size == 10000
    assert stat.S_ISREG(found.mode) and stat.S_IMODE(found.mode) == 0o644
    assert files.read(found, 0, 20000) == b"x" * 10000
    assert files.read(found, 9998, 100) == b"xx" and files.read(found, 10000, 10) == b""
    assert files.read(found, 20000, 10) == b""
    assert files.read(files.lookup(b"/bin/first"), 0, 100) == b"first file"


def test_no_directory_and_nothing_the_archive_lacks(machine, tmp_path):
    files = Ramfs(machine)
    host_file = tmp_path / "on-the-host"
    host_file.write_bytes(b"host")
    for path in (b"/", b"/lib", b"/bin/", b"/etc/passwd", str(host_file).encode(), b"/lib/data.tx",
                 b"/lib/data.txt2", b"/bin/first/x"):
        assert files.lookup(normalize(path)) is None, path


def test_a_file_added_later_under_the_same_path_shadows_the_older(machine):
    files = Ramfs(machine)
    archive = Archive()
    archive.add_file("/bin/first", b"second bytes", 0o700)
    archive.add_file("/opt/new", b"new")
    assert machine.processes.add_files(archive) == ["/bin/first", "/opt/new"]
    found = files.lookup(b"/bin/first")
    assert files.read(found, 0, 100) == b"second bytes" and stat.S_IMODE(found.mode) == 0o700
    assert files.read(files.lookup(b"/opt/new"), 0, 10) == b"new"
