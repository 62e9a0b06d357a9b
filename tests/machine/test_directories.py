"""Directories in the machine's file system (fixtures/kernel/fs.c, initramfs.c: ramfs_is_dir): the archive lists
regular files, and the directories they lie in exist for stat, statx and access, as an unpacked initramfs's do.

glibc's dynamic linker tells a missing directory of its search path from a missing file by stat(), and never
searches a directory it found missing again: when the first library it looked for was not in the multiarch
directory (a library in /lib, as Debian's libinproctrace.so, which GDB's fast tracepoint tests link), that
directory was marked missing, and libm.so.6, which is there, was then not found ("error while loading shared
libraries: libm.so.6": gdb.trace/tspeed.exp)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kgtp_sim.client import ROOT

from ..programs import LIBRARY, MODES, SOURCES, compile_program



def _run(program, *args: str) -> subprocess.CompletedProcess:
    """`kgtp-sim run --cpus 1 PROG ARGS`, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "kgtp_sim", "run", "--cpus", "1", str(program), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize("mode", ["glibc-dynamic", "musl-static"])
def test_stat_and_access_of_directories_say_what_they_say_natively(tmp_path, mode):
    program = compile_program("dirs", mode, tmp_path)
    native = subprocess.run([str(program)], capture_output=True, text=True, timeout=60)
    inside = _run(program)
    assert inside.returncode == 0, inside.stderr
    assert inside.stdout == native.stdout, (inside.stdout, native.stdout)
    assert "/: a directory, search allowed" in inside.stdout
    assert "its own directory: a directory, search allowed" in inside.stdout
    assert "/no/such/directory: No such file or directory" in inside.stdout


def test_a_library_found_after_a_directory_that_lacks_it_leaves_that_directory_searched(tmp_path):
    """The program needs libkgtpgreet (in lib2/) first, then libkgtpone (in lib1/), through RUNPATH
    $ORIGIN/lib1:$ORIGIN/lib2: looking for the first, ld.so misses it in lib1/ and stats lib1/ to learn whether it
    exists; the second must still be found there."""
    gcc = MODES["glibc-dynamic"]
    for directory, soname in (("lib2", LIBRARY), ("lib1", "libkgtpone.so")):
        (tmp_path / directory).mkdir()
        subprocess.run([*gcc, "-shared", "-fPIC", f"-Wl,-soname,{soname}", str(SOURCES / "greet.c"), "-o",
                        str(tmp_path / directory / soname)], check=True, capture_output=True)
    (tmp_path / "lib2" / "libkgtpgreet.so").symlink_to(LIBRARY)
    program = tmp_path / "uselib"
    subprocess.run([*gcc, str(SOURCES / "uselib.c"), "-o", str(program), "-Wl,--no-as-needed",
                    f"-L{tmp_path / 'lib2'}", "-lkgtpgreet", str(tmp_path / "lib1" / "libkgtpone.so"),
                    "-Wl,-rpath,$ORIGIN/lib1:$ORIGIN/lib2", "-Wl,--enable-new-dtags"], check=True, capture_output=True)
    native = subprocess.run([str(program)], capture_output=True, text=True, timeout=60)
    inside = _run(program)
    assert (inside.returncode, inside.stdout) == (native.returncode, native.stdout) == (5, native.stdout), \
        (inside.stderr, native.stderr)
