"""What a dynamically linked program takes into the machine (kgtp_sim/machine/initramfs.py: runtime_files,
Archive.add_program): its interpreter and the libraries its dynamic linker will open, under the paths it will open
them by, and nothing else; checked against what the host's own dynamic linker loads (`ld.so --list`). And the
kernel's side: a program whose interpreter is not in the initramfs is refused."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from kgtp_sim.client import VMLINUX
from kgtp_sim.machine import KernelImage, Machine
from kgtp_sim.machine.initramfs import GLIBC_UNWINDER, Archive, MissingFile, runtime_files, unpack

from ..programs import DYNAMIC_MODES, LIBRARY, compile_program, compile_with_library


def _interpreter(program: Path) -> str:
    with program.open("rb") as f:
        return next(s.get_interp_name() for s in ELFFile(f).iter_segments() if s["p_type"] == "PT_INTERP")


def _host_linker_loads(program: Path) -> set[str]:
    """The real files of the libraries the host's dynamic linker maps for the program (its --list)."""
    interpreter = _interpreter(program)
    listed = subprocess.run([interpreter, "--list", str(program)], capture_output=True, text=True, check=True)
    libraries = {os.path.realpath(m) for m in re.findall(r"=> (/\S+)", listed.stdout)}
    return libraries - {os.path.realpath(interpreter)}  # musl: libc.so is its ld.so


def _files(archive: Archive) -> dict[str, bytes]:
    return {"/" + name: data for name, (mode, data) in unpack(archive.pack()).items() if stat.S_ISREG(mode)}


@pytest.mark.parametrize("dtags", ["runpath", "rpath"])
@pytest.mark.parametrize("mode", DYNAMIC_MODES)
def test_the_interpreter_and_the_libraries_go_in_and_nothing_else(tmp_path, mode, dtags):
    program = compile_with_library(mode, tmp_path, dtags)
    archive = Archive()
    inside = archive.add_program(program)
    files = _files(archive)
    interpreter = _interpreter(program)
    library = str(program.parent / "lib" / LIBRARY)  # the link's name, which the linker opens, not its target's
    assert inside == str(program.resolve())
    assert {inside, interpreter, library} <= set(files)
    libraries = set(files) - {inside, interpreter}
    unwinder = {path for path in libraries if Path(path).name == GLIBC_UNWINDER}  # glibc's libc dlopens it
    assert len(unwinder) == (mode == "glibc-dynamic")
    libraries -= unwinder
    assert {os.path.realpath(path) for path in libraries} == _host_linker_loads(program)
    for path, data in files.items():  # each with the bytes of the host file it resolves to
        assert data == Path(path).resolve().read_bytes(), path
    if mode == "musl-dynamic":
        assert libraries == {library}  # libc.so is the interpreter itself: no second copy
    else:
        assert {Path(path).name for path in libraries} == {LIBRARY, "libc.so.6"}


def _dynamic_as_pyelftools_reads_it(path: Path) -> tuple | None:
    """PT_INTERP and the dynamic tags runtime_files uses, read by pyelftools: (interp, needed, rpath, runpath,
    soname), None unless an x86_64 ELF file."""
    with path.open("rb") as f:
        elf = ELFFile(f)
        if elf.elfclass != 64 or elf["e_machine"] != "EM_X86_64":
            return None
        interp, needed, rpath, runpath, soname = None, [], [], [], None
        for segment in elf.iter_segments():
            if segment["p_type"] == "PT_INTERP":
                interp = segment.get_interp_name()
            elif segment["p_type"] == "PT_DYNAMIC":
                for tag in segment.iter_tags():
                    kind = tag.entry.d_tag
                    if kind == "DT_NEEDED":
                        needed.append(tag.needed)
                    elif kind == "DT_RPATH":
                        rpath += tag.rpath.split(":")
                    elif kind == "DT_RUNPATH":
                        runpath += tag.runpath.split(":")
                    elif kind == "DT_SONAME":
                        soname = tag.soname
        return interp, tuple(needed), tuple(rpath), tuple(runpath), soname


@pytest.mark.parametrize("dtags", ["runpath", "rpath"])
@pytest.mark.parametrize("mode", DYNAMIC_MODES)
def test_the_dynamic_tags_are_read_as_pyelftools_reads_them(tmp_path, mode, dtags):
    """initramfs._read_dynamic unpacks the program headers and the dynamic segment itself: for the program, its
    library (RUNPATH or RPATH with $ORIGIN, a SONAME), its interpreter and what they need, and files that are no
    x86_64 program, the same as pyelftools gives."""
    from kgtp_sim.machine.initramfs import _read_dynamic

    program = compile_with_library(mode, tmp_path, dtags)
    files = [program, *(Path(path) for path in runtime_files(program)), program.parent / "lib" / LIBRARY]
    for path in files:
        got = _read_dynamic(path)
        assert got is not None and (got.interp, got.needed, got.rpath, got.runpath, got.soname) == \
            _dynamic_as_pyelftools_reads_it(path), path
    assert _read_dynamic(program).needed and (_read_dynamic(program).runpath or _read_dynamic(program).rpath)
    text = tmp_path / "not-elf"
    text.write_bytes(b"#!/bin/sh\n" * 20)
    truncated = tmp_path / "truncated"
    truncated.write_bytes(program.read_bytes()[:40])
    assert _read_dynamic(text) is None and _read_dynamic(truncated) is None
    assert _read_dynamic(tmp_path / "missing") is None


@pytest.mark.parametrize("mode", ["glibc-static", "musl-static", "glibc-static-pie"])
def test_a_static_program_goes_in_alone(tmp_path, mode):
    program = compile_program("hello", mode, tmp_path)
    archive = Archive()
    inside = archive.add_program(program)
    assert runtime_files(program) == {}
    assert set(_files(archive)) == {inside}


@pytest.mark.parametrize("mode", DYNAMIC_MODES)
def test_a_library_that_is_not_found_is_named_and_nothing_goes_in(tmp_path, mode):
    program = compile_with_library(mode, tmp_path)
    (program.parent / "lib" / LIBRARY).unlink()
    archive = Archive()
    with pytest.raises(MissingFile, match=re.escape(f"needs the library {LIBRARY} ({program.resolve()} asks")):
        archive.add_program(program)
    assert archive.files == {}


def test_an_interpreter_that_is_not_on_the_host_is_named(tmp_path):
    program = compile_program("hello", "glibc-dynamic", tmp_path)
    interpreter = _interpreter(program).encode()
    elsewhere = b"/nonexistent/" + interpreter[len(b"/nonexistent/"):]  # the same length, no such directory
    program.write_bytes(program.read_bytes().replace(interpreter + b"\0", elsewhere + b"\0"))
    with pytest.raises(MissingFile, match=re.escape(f"needs its interpreter {elsewhere.decode()}, which is not on")):
        Archive().add_program(program)


def test_ld_library_path_is_searched_as_the_program_will_have_it(tmp_path):
    program = compile_with_library("glibc-dynamic", tmp_path)
    moved = tmp_path / "elsewhere"
    (program.parent / "lib").rename(moved)
    with pytest.raises(MissingFile):
        runtime_files(program)
    files = runtime_files(program, f"/nonexistent:{moved}")
    assert files[str(moved / LIBRARY)] == (moved / f"{LIBRARY}.0").resolve()


def test_a_program_whose_interpreter_is_not_in_the_initramfs_is_refused(tmp_path):
    program = compile_program("hello", "glibc-dynamic", tmp_path)
    archive = Archive()
    inside = archive.add_host_file(program)  # alone: no interpreter, no libc
    machine = Machine(KernelImage.load(VMLINUX), cpus=1)
    machine.processes.load_archive(archive.pack())
    output = []
    machine.processes.sink = lambda fd, data: output.append((fd, data))
    machine.start()
    try:
        ended = machine.processes.wait(machine.processes.spawn(inside, [str(program)]), 60)
    finally:
        machine.shutdown()
    assert ended is not None and ended.shell_status == 127, ended
    assert output == [(2, f"{inside}: cannot execute: its interpreter (PT_INTERP) is not in the initramfs\n"
                          .encode())]
