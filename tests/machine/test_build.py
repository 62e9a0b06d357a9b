"""The committed fixtures/vmlinux is what scripts/build-kernel makes from fixtures/kernel (same toolchain)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from elftools.elf.elffile import ELFFile

from ..conftest import ROOT, VMLINUX


def _comment(path) -> str:
    with open(path, "rb") as f:
        section = ELFFile(f).get_section_by_name(".comment")
        return section.data().rstrip(b"\0").decode() if section else ""


def _gcc_version() -> str | None:
    if shutil.which("gcc") is None or shutil.which("ld") is None:
        return None
    out = subprocess.run(["gcc", "--version"], capture_output=True, text=True).stdout.splitlines()
    return out[0] if out else None


def test_committed_kernel_matches_its_sources(tmp_path):
    version = _gcc_version()
    built_with = _comment(VMLINUX)  # e.g. "GCC: (Debian 12.2.0-14+deb12u1) 12.2.0"
    if version is None:
        pytest.skip("no gcc/ld here to rebuild the kernel")
    if built_with.removeprefix("GCC: ") not in version:
        pytest.skip(f"fixtures/vmlinux was built with {built_with!r}, this host has {version!r}")
    out = tmp_path / "vmlinux"
    subprocess.run([str(ROOT / "scripts" / "build-kernel"), str(out)], check=True, capture_output=True, cwd=tmp_path)
    assert out.read_bytes() == VMLINUX.read_bytes(), "fixtures/vmlinux is stale: run scripts/build-kernel"


def test_debug_info_has_no_host_paths():
    raw = VMLINUX.read_bytes()
    assert str(ROOT).encode() not in raw
    assert b"fixtures/kernel/module.c" in raw
