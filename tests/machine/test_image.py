"""KernelImage and the marker table: read from the ELF, nothing assumed; bad files fail with one clear line."""

from __future__ import annotations

import re
import struct

import pytest
from capstone import CS_ARCH_X86, CS_MODE_64, Cs

from kgtp_sim.machine import SITE_NOP, FieldKind, KernelImage, KernelImageError

from ..conftest import VMLINUX

REGISTER = re.compile(r"^%(r[a-z0-9]+|e[a-z]{2}|[a-z]{2}l|r\d+[dwb]?)$")

EXPECTED = {
    # id: (TP_ARGS, fields, TP_printk format) -- formats from Linux and seed 003 (fault/trap)
    "module::kgtp_module_event": (("counter1", "counter2"), ("counter1", "counter2"), "counter1=%d counter2=%d"),
    "module::module_load": (("mod",), ("taints", "name"), "%s taints=%u"),
    "sched::sched_switch": (
        ("prev", "next"),
        ("prev_comm", "prev_pid", "prev_prio", "prev_state", "next_comm", "next_pid", "next_prio"),
        "prev_comm=%s prev_pid=%d prev_prio=%d prev_state=%ld ==> next_comm=%s next_pid=%d next_prio=%d",
    ),
    "sched::sched_stat_runtime": (
        ("tsk", "runtime", "vruntime"),
        ("comm", "pid", "runtime", "vruntime"),
        "comm=%s pid=%d runtime=%llu [ns] vruntime=%llu [ns]",
    ),
    "syscalls::sys_enter": (("regs", "id"), ("id", "args"), "NR %ld (%lx, %lx, %lx, %lx, %lx, %lx)"),
    "syscalls::sys_exit": (("regs", "ret"), ("id", "ret"), "NR %ld = %ld"),
    "fault::page_fault_entry": (
        ("regs", "address", "write_access"),
        ("ip", "addr", "write"),
        "ip=%lu addr=%lu write_access=%d",
    ),
    "fault::page_fault_exit": (("result",), ("res",), "result=%d"),
    "trap::trap_entry": (("regs", "trap"), ("trap", "ip"), "number=%ld ip=%lu"),
    "trap::trap_exit": (("trap",), ("trap",), "number=%ld"),
}


@pytest.fixture(scope="module")
def image() -> KernelImage:
    return KernelImage.load(VMLINUX)


def test_segments_symbols_and_text(image):
    assert image.entry == image.address_of("_start")
    lo, hi = image.text_range
    assert lo <= image.address_of("kgtp_test_function") < hi
    assert {s.executable for s in image.segments} == {True, False}
    tasks = image.symbols["tasks"]
    assert tasks.type == "OBJECT" and tasks.size > 0
    assert image.symbol_at(tasks.address + 20).name == "tasks"
    name, start, end = image.function_bounds(image.address_of("kgtp_test_function") + 7)
    assert (name, start) == ("kgtp_test_function", image.address_of("kgtp_test_function")) and end > start
    assert image.function_bounds(0x1234) is None
    # tasks[1].comm (offset 4: after int pid) is in the image's initialised data; the kernel has 41 threads (6 of
    # CPU 0, 5 of each other CPU) and 24 process slots: NR_TASKS = 65 (include/kernel.h)
    task_size = tasks.size // 65
    assert image.read(tasks.address + task_size + 4, 11) == b"kgtp_bench\0"


def test_symbols_are_the_symbol_tables_as_pyelftools_reads_it(image):
    """The table is unpacked with struct (image._symbols): the same names, addresses, sizes and types, in the same
    order, as pyelftools' own symbol parsing gives, files and sections left out and a global winning over a local
    of the same name."""
    from elftools.elf.elffile import ELFFile

    from kgtp_sim.machine.image import Symbol

    expected: dict[str, Symbol] = {}
    with open(VMLINUX, "rb") as f:
        for sym in ELFFile(f).get_section_by_name(".symtab").iter_symbols():
            kind = sym["st_info"]["type"]
            if not sym.name or kind in ("STT_FILE", "STT_SECTION"):
                continue
            if sym.name in expected and sym["st_info"]["bind"] == "STB_LOCAL":
                continue
            expected[sym.name] = Symbol(sym.name, sym["st_value"], sym["st_size"], kind.removeprefix("STT_"))
    assert list(image.symbols.items()) == list(expected.items())
    assert {s.type for s in image.symbols.values()} >= {"FUNC", "OBJECT", "NOTYPE"}


def test_every_marker_is_listed_with_fields_and_register_locations(image):
    markers = {m.id: m for m in image.markers}
    assert set(markers) == set(EXPECTED)
    for marker_id, (args, fields, fmt) in EXPECTED.items():
        m = markers[marker_id]
        assert m.args == args
        assert tuple(f.name for f in m.fields) == fields
        assert m.format == fmt
        assert len(m.arg_locations) == len(m.args)
        assert all(REGISTER.match(loc) for loc in m.arg_locations), m.arg_locations
        assert image.read_code(m.site, 5) == SITE_NOP
        assert image.function_at(m.site) is not None
        ends = [f.offset + f.size for f in m.fields]
        assert max(ends) <= m.entry_size
        assert m.print_args.count("__entry->") + m.print_args.count("__get_str(") >= len(m.fields) - 1


def test_thesis_marker_is_in_kgtp_test_function_with_args_in_edi_esi(image):
    (m,) = [m for m in image.markers if m.name == "kgtp_module_event"]
    assert image.function_at(m.site).name == "kgtp_test_function"
    assert m.arg_locations == ("%edi", "%esi")
    assert m.entry_size == 8
    c1, c2 = m.fields
    assert (c1.kind, c1.arg, c1.offset, c1.size, c1.signed, c1.type) == (FieldKind.VALUE, 0, 0, 4, True, "int")
    assert (c2.kind, c2.arg, c2.offset) == (FieldKind.VALUE, 1, 4)


def test_field_assignments_follow_the_event_definitions(image):
    markers = {m.id: m for m in image.markers}
    switch = {f.name: f for f in markers["sched::sched_switch"].fields}
    assert switch["prev_comm"].kind is FieldKind.ARRAY and switch["prev_comm"].type == "char[16]"
    assert switch["next_pid"].kind is FieldKind.LOAD and switch["next_pid"].arg_name == "next"
    assert switch["prev_state"].size == 8
    load = {f.name: f for f in markers["module::module_load"].fields}
    assert load["name"].kind is FieldKind.STRING and load["name"].size == 56
    assert load["taints"].signed is False
    enter = {f.name: f for f in markers["syscalls::sys_enter"].fields}
    assert enter["args"].type == "unsigned long[6]" and enter["args"].size == 48
    fault = {f.name: f for f in markers["fault::page_fault_entry"].fields}
    assert fault["ip"].kind is FieldKind.LOAD and fault["addr"].kind is FieldKind.VALUE
    assert markers["fault::page_fault_entry"].location_of("write_access").startswith("%e")


def test_disabled_site_costs_exactly_the_nop(image):
    """kgtp_test_function is `kgtp_counter++`, the marker NOP and ret: the marker added no moves."""
    start = image.address_of("kgtp_test_function")
    size = image.symbols["kgtp_test_function"].size
    insns = list(Cs(CS_ARCH_X86, CS_MODE_64).disasm(image.read_code(start, size), start))
    code = [i for i in insns if i.address < next(i.address for i in insns if i.mnemonic == "ret") + 1]
    assert [i.mnemonic for i in code] == ["add", "nop", "ret"]
    assert bytes(code[1].bytes) == SITE_NOP


def _corrupt(tmp_path, offset: int, data: bytes):
    raw = bytearray(VMLINUX.read_bytes())
    raw[offset : offset + len(data)] = data
    path = tmp_path / "vmlinux"
    path.write_bytes(bytes(raw))
    return path


def test_bad_images_raise_one_line_errors(tmp_path):
    cases = {
        tmp_path / "missing": "cannot read kernel image",
        (tmp_path / "text").with_suffix(".txt"): "not a usable ELF",
        _corrupt(tmp_path, 18, struct.pack("<H", 183)): "not an x86_64 ELF",  # e_machine = EM_AARCH64
    }
    (tmp_path / "text.txt").write_text("hello\n")
    for path, message in cases.items():
        with pytest.raises(KernelImageError) as error:
            KernelImage.load(path)
        assert message in str(error.value)
        assert "\n" not in str(error.value)


def test_marker_site_without_nop_is_rejected(tmp_path, image):
    (m,) = [m for m in image.markers if m.name == "kgtp_module_event"]
    seg = next(s for s in image.segments if s.vaddr <= m.site < s.end)
    # file offset of the site: the text segment is mapped from its p_offset (read it from the program headers)
    from elftools.elf.elffile import ELFFile

    with VMLINUX.open("rb") as f:
        (ph,) = [p for p in ELFFile(f).iter_segments() if p["p_type"] == "PT_LOAD" and p["p_vaddr"] == seg.vaddr]
        offset = ph["p_offset"] + m.site - seg.vaddr
    with pytest.raises(KernelImageError, match="no 5-byte NOP"):
        KernelImage.load(_corrupt(tmp_path, offset, b"\xcc"))


def test_each_code_address_has_its_own_files_line_or_none():
    """The line table read sequence by sequence: the kernel's assembly entry points (boot.S, entry_64.S) map to
    their own file, never to the C function that happens to end where they begin (a row that covers no code, at a
    sequence's end), so function-boundary tracing never takes an entry the CPU jumps to for a C function and hijacks
    a return address that is not there (a #DB entry probed so corrupted every pt_regs.vector)."""
    from kgtp_sim.machine.dwarf import KernelDwarf

    image = KernelImage.load(VMLINUX)
    dwarf = KernelDwarf(VMLINUX)
    try:
        entries = [s for s in image.symbols.values() if s.type == "FUNC" and
                   (s.name.startswith("asm_") or s.name in ("common_entry", "entry_SYSCALL_64"))]
        assert len(entries) >= 10
        for symbol in entries:
            found = dwarf.line_at(symbol.address)
            assert found is None or found[0].endswith(".S"), (symbol.name, found)
        for symbol in image.symbols.values():  # no C function's start is another file's line
            found = dwarf.line_at(symbol.address) if symbol.type == "FUNC" and symbol.size else None
            if found is not None and found[0].endswith(".c"):
                last = dwarf.line_at(symbol.end - 1)
                assert last is None or last[0] == found[0] or not last[0].endswith(".c"), (symbol.name, found, last)
    finally:
        dwarf.close()
