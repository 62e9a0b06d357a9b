"""The test programs (tests/programs/*.c), compiled by the suite in each linking mode the kernel runs."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SOURCES = Path(__file__).resolve().parent / "programs"

#: linking mode -> compiler command line (before the source and -o)
MODES = {
    "musl-static": ("musl-gcc", "-static", "-O2"),
    "glibc-static": ("gcc", "-static", "-O2"),
    "glibc-static-pie": ("gcc", "-static-pie", "-O2"),
    "glibc-dynamic": ("gcc", "-O2"),  # PIE, ld-linux-x86-64.so.2 and libc.so.6 from the host
    "musl-dynamic": ("musl-gcc", "-O2"),  # PIE, musl's ld.so (its libc.so)
}

#: options a program needs beyond its mode's
PROGRAM_FLAGS = {"threads": ("-pthread",), "pipes": ("-pthread",), "forks": ("-pthread",), "conditions": ("-pthread",),
                 "passed": ("-pthread",),
                 "handoff": ("-pthread",)}

#: the dynamic linker a mode's programs name (PT_INTERP): the suite skips the mode on a host without it
INTERPRETERS = {"musl-dynamic": "/lib/ld-musl-x86_64.so.1"}


def compile_program(name: str, mode: str, out_dir: Path) -> Path:
    """tests/programs/NAME.c built in `mode` into out_dir (skips the test if the compiler is missing)."""
    command = MODES[mode]
    if shutil.which(command[0]) is None:
        pytest.skip(f"{command[0]} is not installed (scripts/test installs it)")
    interpreter = INTERPRETERS.get(mode)
    if interpreter and not os.path.exists(interpreter):
        pytest.skip(f"{mode}: no {interpreter} on this host (musl's dynamic linker; Debian's musl package has it)")
    out = out_dir / f"{name}-{mode}"
    if not out.exists():
        subprocess.run([*command, *PROGRAM_FLAGS.get(name, ()), str(SOURCES / f"{name}.c"), "-o", str(out), "-lm"],
                       check=True, capture_output=True)
    return out


#: the modes whose programs have a dynamic linker (PT_INTERP)
DYNAMIC_MODES = ("glibc-dynamic", "musl-dynamic")
LIBRARY = "libkgtpgreet.so.1"


def compile_with_library(mode: str, out_dir: Path, dtags: str = "runpath") -> Path:
    """tests/programs/uselib.c built in a dynamic `mode` against greet.c's library, which goes in the program's
    lib/ directory as LIBRARY (a symbolic link to libkgtpgreet.so.1.0, the file), found through $ORIGIN/lib in the
    program's DT_RUNPATH (`dtags` "runpath") or DT_RPATH ("rpath"). Each call builds anew in its own directory."""
    command = MODES[mode]
    compile_program("hello", mode, out_dir)  # skips as that does if the mode cannot be built here
    directory = out_dir / f"uselib-{mode}-{dtags}"
    (directory / "lib").mkdir(parents=True)
    real = directory / "lib" / f"{LIBRARY}.0"
    subprocess.run([*command, "-shared", "-fPIC", f"-Wl,-soname,{LIBRARY}", str(SOURCES / "greet.c"), "-o",
                    str(real)], check=True, capture_output=True)
    (directory / "lib" / LIBRARY).symlink_to(real.name)
    (directory / "lib" / "libkgtpgreet.so").symlink_to(real.name)  # for the link editor's -l
    out = directory / "uselib"
    new_dtags = "--enable-new-dtags" if dtags == "runpath" else "--disable-new-dtags"
    subprocess.run([*command, str(SOURCES / "uselib.c"), "-o", str(out), f"-L{directory / 'lib'}", "-lkgtpgreet",
                    "-Wl,-rpath,$ORIGIN/lib", f"-Wl,{new_dtags}"], check=True, capture_output=True)
    return out
