"""The initramfs archive (kgtp_sim/machine/initramfs.py): cpio newc as Linux reads it."""

from __future__ import annotations

import stat

from kgtp_sim.machine.initramfs import Archive, unpack


def test_files_come_back_with_their_directories_and_modes(tmp_path):
    program = tmp_path / "prog"
    program.write_bytes(b"\x7fELF" + bytes(range(256)) * 3)
    program.chmod(0o755)
    archive = Archive()
    inside = archive.add_host_file(program)
    archive.add_file("/etc/motd", b"odd length", 0o644)
    packed = archive.pack()
    assert len(packed) % 4 == 0 and packed.startswith(b"070701")
    entries = unpack(packed)
    assert entries[inside.lstrip("/")] == (stat.S_IFREG | 0o755, program.read_bytes())
    assert entries["etc/motd"] == (stat.S_IFREG | 0o644, b"odd length")
    assert stat.S_ISDIR(entries["etc"][0]) and stat.S_ISDIR(entries[str(tmp_path).lstrip("/")][0])
    names = list(entries)
    assert names.index("etc") < names.index("etc/motd")  # directories before what they hold
