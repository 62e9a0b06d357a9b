"""What the gdbserver role adds around its process target (stub/process.py): the packets only a process has, and
the program as the tracer's user space.

- `ProcessHandlers`: `qXfer:auxv:read`, `qXfer:exec-file:read`, `qXfer:siginfo:read`, `qXfer:threads:read`,
  `qXfer:libraries-svr4:read` (gdbserver's qXfer objects), `vKill`, `QPassSignals`, `QProgramSignals`;
- `libraries_svr4`: the dynamic linker's list of loaded objects read from the process's memory, as gdbserver's
  linux-low.cc reads it (its DT_DEBUG, r_debug and link_map chain), the document GDB's solib-svr4.c takes instead of
  walking that memory itself;
- `ProgramSpace`: the process as tracing/core/run.py's `UserSpace`, so that tracepoints at its addresses go into
  its own memory (tracing/engines/userprobes.py).

Runs on the server thread, as every handler.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..machine import MachineError
from ..machine.layout import PAGE_SIZE
from ..machine.ramfs import normalize
from ..machine.tracee import TASK_SIZE_MAX, Tracee
from ..rsp.dispatch import E_BAD_PACKET, Binary, Reply, RspError, handles
from ..rsp.packets import connect as c
from ..rsp.packets.base import xml_text
from ..rsp.packets import run as v
from ..tracing.core.model import TraceError
from ..tracing.core.sdt import SdtMarker, program_markers
from ..tracing.patching.probes import enters_kernel
from .extended import Inferior
from .process import ProcessTarget
from .target import ViewError
from .threads import ThreadHandlers

log = logging.getLogger(__name__)


#: a jump pad area's size in pages (room for hundreds of pads) and a rel32 jump's reach either way
PAD_PAGES = 16
JUMP_REACH = 1 << 31
#: pages of collected globals made present before a run, at most (a `collect` of a huge array stops there)
DATA_PAGES = 1024


#: reads a process's memory: the bytes from an address that can be read (a prefix; empty when none can)
MemoryReader = Callable[[int, int], bytes]

#: auxiliary vector entries, program header types and dynamic tags (elf.h) that lead to r_debug
AT_PHDR, AT_PHNUM = 3, 5
PT_DYNAMIC, PT_PHDR = 2, 6
DT_NULL, DT_DEBUG = 0, 21
PHDR_SIZE, DYN_SIZE = 56, 16  #: Elf64_Phdr, Elf64_Dyn
#: fields of glibc's struct r_debug(_extended) and struct link_map for a 64-bit program (link.h; gdbserver's
#: lmo_64bit_offsets); musl's struct debug and struct dso begin the same way
R_VERSION, R_MAP, R_NEXT = 0, 8, 40
L_NEXT, LINK_MAP_SIZE = 24, 40  #: a link_map's l_addr, l_name, l_ld, l_next, l_prev
#: what is read of a library's name at most (gdbserver: PATH_MAX - 1 bytes)
NAME_LIMIT = 4095
#: more program headers than gdbserver's sanity check allows (it asserts), more dynamic entries or objects in one
#: list than any program has: a process whose memory says so is not followed further
MAX_PHNUM, MAX_DYNAMIC, MAX_OBJECTS = 100, 4096, 65536


def _pointer(read: MemoryReader, address: int) -> int | None:
    data = read(address, 8)
    return struct.unpack("<Q", data)[0] if len(data) == 8 else None


def _name(read: MemoryReader, address: int) -> bytes:
    """The NUL-terminated string at `address`, read a page at most at a time (what can be read of it)."""
    out = bytearray()
    while len(out) < NAME_LIMIT:
        at = address + len(out)
        chunk = read(at, min(NAME_LIMIT - len(out), 0x1000 - (at & 0xFFF)))
        end = chunk.find(b"\0")
        if end >= 0:
            return bytes(out + chunk[:end])
        if not chunk:
            break
        out += chunk
    return bytes(out)


def find_r_debug(auxv: bytes, read: MemoryReader) -> int | None:
    """The address of the program's r_debug, as gdbserver finds it (linux-low.cc: get_r_debug, get_dynamic): its
    program headers where the auxiliary vector's AT_PHDR and AT_PHNUM say, the load bias AT_PHDR minus PT_PHDR's
    address (0 unless it is a PIE), then DT_DEBUG's value in its PT_DYNAMIC, which the dynamic linker sets. 0 while
    it has not (at the first instruction); None for a program with no PT_PHDR, PT_DYNAMIC or DT_DEBUG (a static
    one), which has no such list."""
    entries: dict[int, int] = {}
    for at in range(0, len(auxv) - 15, 16):
        kind, value = struct.unpack_from("<QQ", auxv, at)
        entries.setdefault(kind, value)
    phdr, phnum = entries.get(AT_PHDR, 0), entries.get(AT_PHNUM, 0)
    if not phdr or not 0 < phnum < MAX_PHNUM:
        return None
    headers = read(phdr, phnum * PHDR_SIZE)
    if len(headers) < phnum * PHDR_SIZE:
        return None
    segments = [struct.unpack_from("<IIQQ", headers, i * PHDR_SIZE) for i in range(phnum)]  # type, flags, offset, vaddr
    bias = next(((phdr - vaddr) % (1 << 64) for kind, _flags, _offset, vaddr in segments if kind == PT_PHDR), None)
    dynamic = next((vaddr for kind, _flags, _offset, vaddr in segments if kind == PT_DYNAMIC), None)
    if bias is None or dynamic is None:
        return None
    at = (dynamic + bias) % (1 << 64)
    for _ in range(MAX_DYNAMIC):
        entry = read(at, DYN_SIZE)
        if len(entry) < DYN_SIZE:
            break
        tag, value = struct.unpack("<qQ", entry)
        if tag == DT_DEBUG:
            return value
        if tag == DT_NULL:
            break
        at += DYN_SIZE
    return None


def _escape(name: bytes) -> bytes:
    """A name as gdbserver writes it into XML (xml_escape_text_append): its bytes, with ' " & < > as entities."""
    return xml_text(name.decode("latin-1")).encode("latin-1")


def _link_map(read: MemoryReader, lmid: int, lm: int, prev: int) -> list[bytes]:
    """`<library .../>` for each object of one namespace's list from `lm` on, `prev` the one before it (gdbserver:
    read_link_map): the walk stops where the list ends, cannot be read, or where an object's l_prev is not the one
    it came from (a corrupted list; a cycle among them). An object with no name (the program's own entry, read
    from a namespace's start) is not listed."""
    out: list[bytes] = []
    seen: set[int] = set()
    while lm and lm not in seen and len(seen) < MAX_OBJECTS:
        seen.add(lm)
        fields = read(lm, LINK_MAP_SIZE)
        if len(fields) < LINK_MAP_SIZE:
            break
        l_addr, l_name, l_ld, l_next, l_prev = struct.unpack("<5Q", fields)
        if l_prev != prev:
            log.info("corrupted shared library list: %#x != %#x", prev, l_prev)
            break
        name = _name(read, l_name) if l_name else b""
        if name:
            out.append(b'<library name="%s" lm="0x%x" l_addr="0x%x" l_ld="0x%x" lmid="0x%x"/>'
                       % (_escape(name), lm, l_addr, l_ld, lmid))
        prev, lm = lm, l_next
    return out


def libraries_svr4(auxv: bytes, read: MemoryReader, lmid: int = 0, start: int = 0, prev: int = 0) -> bytes | None:
    """GDB's `<library-list-svr4>` document of the process whose auxiliary vector is `auxv` and whose memory
    `read` reads (gdbserver: linux_process_target::qxfer_libraries_svr4; GDB's docs, "Library List Format for SVR4
    Targets"). Without `start`: every namespace from the program's r_debug on (r_next, in r_debug_extended version 2),
    each object with its namespace's r_debug as lmid; the first namespace's first object is the program, named by
    `main-lm` and not listed. With `start` (the augmented form GDB sends after a library loads): the objects of
    namespace `lmid` from the link_map `start` on, `prev` the one before it. An empty list (no `main-lm`) while the
    dynamic linker has not set r_debug; None for a program that has no r_debug (static: GDB then looks for itself,
    and finds none), which gdbserver answers E01."""
    head = b'<library-list-svr4 version="1.0"'
    body: list[bytes] = []
    if start:
        head += b">"
        body = _link_map(read, lmid, start, prev)
    else:
        first = find_r_debug(auxv, read)
        if first is None:
            return None
        r_debug, seen = first, set()
        while r_debug and r_debug not in seen and len(seen) < MAX_OBJECTS:
            seen.add(r_debug)
            version = read(r_debug + R_VERSION, 4)
            if len(version) < 4 or struct.unpack("<i", version)[0] < 1:
                log.info("r_debug at %#x: no version to read, or not one GDB knows", r_debug)
                break
            lm = _pointer(read, r_debug + R_MAP)
            if lm is None:
                break
            lm_prev = 0
            if r_debug == first:  # the program's own object first (unless a static program loaded the linker late)
                if lm:
                    head += b' main-lm="0x%x"' % lm
                lm_prev, lm = lm, _pointer(read, lm + L_NEXT)
                if lm is None:
                    break
            body += _link_map(read, r_debug, lm, lm_prev)
            if struct.unpack("<i", version)[0] < 2:
                break
            r_debug = _pointer(read, r_debug + R_NEXT)
            if r_debug is None:
                break
        head += b">"
    return head + b"".join(body) + b"</library-list-svr4>"


class ProgramSpace:
    """The process as the tracer's `UserSpace` (tracing/core/run.py): tracepoints at its addresses go into its
    memory."""

    def __init__(self, tracee: Tracee, markers: Callable[[], tuple[SdtMarker, ...]] = lambda: ()) -> None:
        self.tracee = tracee
        self._space = tracee.space()
        self.root = self._space.root
        self._pads: list[int] = []  #: the jump pad areas it mapped (Tracee.map_jump_pad)
        self._load_markers = markers
        self._markers: tuple[SdtMarker, ...] | None = None

    def markers(self) -> tuple[SdtMarker, ...]:
        """The program's SDT probes, read from its file once (`program_sdt_markers`)."""
        if self._markers is None:
            self._markers = self._load_markers()
        return self._markers

    def holds(self, address: int) -> bool:
        return 0 <= address < TASK_SIZE_MAX

    def space(self) -> Any:
        return self._space

    def prepare(self, addresses: list[int], fast: list[int] = (), data: list[tuple[int, int]] = (),
                pads: list[int] = ()) -> None:
        """Their pages present: the process faults them in itself (it must be stopped, as GDB has it at
        tstart). A fast tracepoint's address gets a jump pad area within its jump's reach, mapped by the process
        (Tracee.map_jump_pad) the first time one is needed there and kept for the process's life. The pages of
        collected globals (`data`) too, as gdbserver's reads of them through ptrace would fault them in: a
        global the program has not touched yet (its .bss page never written) is still its memory, zeros."""
        for address in addresses:
            if self._space.translate(address) is None and not self.tracee.fault_in(address):
                raise TraceError(f"{address:#x}: no memory of the process there")
        pages = sorted({page for start, length in data
                        for page in range(start & -PAGE_SIZE, min(start + length, TASK_SIZE_MAX), PAGE_SIZE)})
        for page in pages[:DATA_PAGES]:
            if self._space.translate(page) is None:
                try:
                    self.tracee.fault_in(page)  # False where nothing maps it: collected as unavailable
                except MachineError:
                    break  # the process runs (non-stop) or ended: hits read what is present
        for address in fast:
            if self.pad_area(address) is None:
                try:
                    self._pads.append(self.tracee.map_jump_pad(address, PAD_PAGES))
                except MachineError as error:
                    raise TraceError(f"fast tracepoint at {address:#x}: {error}") from None
        for address in addresses:  # an instruction entering the kernel runs out of line, in a pad (userprobes.py)
            # and so does a compiled hit's instruction (`pads`)
            if self.pad_area(address) is None and (address in pads or
                                                   enters_kernel(self.tracee.read_memory(address, 2,
                                                                                         hide_int3s=True))):
                try:
                    self._pads.append(self.tracee.map_jump_pad(address, PAD_PAGES))
                except MachineError:
                    pass  # no room: it is stepped in place

    def pad_area(self, address: int) -> tuple[int, int] | None:
        size = PAD_PAGES * PAGE_SIZE
        for start in self._pads:
            if start - address + size < JUMP_REACH and address - start < JUMP_REACH - size:
                return start, size
        return None


AT_ENTRY, ET_DYN = 9, 3


def program_sdt_markers(process: ProcessTarget, files: Any) -> tuple[SdtMarker, ...]:
    """The SDT probes of `process`'s program (tracing/core/sdt.py), read from its file as the machine holds it
    (`files`: machine/ramfs.Ramfs), at their addresses in the process: a PIE's moved by where the kernel loaded it
    (its AT_ENTRY less the file's entry point). None for a program the machine has no file of."""
    try:
        path = normalize(process.exec_path.encode())
    except ValueError:
        return ()
    file = files.lookup(path)
    if file is None:
        return ()
    elf = files.read(file, 0, file.size)
    bias = 0
    if elf[16:18] == struct.pack("<H", ET_DYN):
        auxv = process.auxv
        entries = dict(struct.iter_unpack("<QQ", auxv[:len(auxv) // 16 * 16]))
        bias = entries.get(AT_ENTRY, 0) - struct.unpack_from("<Q", elf, 24)[0] if AT_ENTRY in entries else 0
    return program_markers(elf, bias)


@dataclass
class ProcessHandlers:
    """The packets only a process has: its auxiliary vector, its program's path and the siginfo of its stop
    (gdbserver's qXfer objects); those of the process of the thread GDB selected, as gdbserver's current process
    (E01 with none)."""

    target: Inferior
    threads: ThreadHandlers
    _threads_document: bytes | None = None  #: read in windows: made at the first, kept for the next

    def _process(self) -> ProcessTarget:
        return self.target.process_for(self.threads.selection.general)

    @staticmethod
    def _window(document: bytes, packet: c.ReadFeatures) -> Reply:
        chunk = document[packet.offset: packet.offset + packet.length]
        return Binary((b"m" if packet.offset + len(chunk) < len(document) else b"l") + chunk)

    @handles(c.ReadAuxv)
    def read_auxv(self, packet: c.ReadAuxv) -> Reply:
        if packet.annex:
            raise RspError(E_BAD_PACKET, "qXfer:auxv:read takes no annex")
        return self._window(self._process().auxv, packet)

    @handles(v.VKill)
    def vkill(self, packet: v.VKill) -> Reply:
        """gdbserver's handle_v_kill: E for a process it does not have, else the process killed and OK."""
        self.target.kill_process(packet.pid)
        return b"OK"

    @handles(v.PassSignals)
    def pass_signals(self, packet: v.PassSignals) -> Reply:
        self.target.set_signals(passed=packet.signals)
        return b"OK"

    @handles(v.ProgramSignals)
    def program_signals(self, packet: v.ProgramSignals) -> Reply:
        self.target.set_signals(program=packet.signals)
        return b"OK"

    @handles(c.ReadSiginfo)
    def read_siginfo(self, packet: c.ReadSiginfo) -> Reply:
        if packet.annex:
            raise RspError(E_BAD_PACKET, "qXfer:siginfo:read takes no annex")
        try:
            siginfo = self._process().tracee.siginfo()
        except MachineError as error:
            raise RspError(E_BAD_PACKET, str(error)) from None
        return self._window(siginfo, packet)

    @handles(c.ReadThreads)
    def read_threads(self, packet: c.ReadThreads) -> Reply:
        """Each thread, its name (the task's comm) and the CPU it is bound to, as gdbserver's document."""
        if packet.annex:
            raise RspError(E_BAD_PACKET, "qXfer:threads:read takes no annex")
        if packet.offset == 0 or self._threads_document is None:
            self._threads_document = self._document()
        return self._window(self._threads_document, packet)

    def _document(self) -> bytes:
        machine = self.target.machine
        layout = machine.ptrace.layout
        lines = ["<?xml version=\"1.0\"?>", "<threads>"]
        for tid in self.target.threads():
            process = self.target.holding(tid)
            thread = process.threads_by_tid.get(tid) if process is not None else None
            name, core = "", -1
            if thread is not None:
                try:
                    raw = machine.read_memory(thread.tracee.task + layout.comm, 16)
                    name = xml_text(raw.split(b"\0", 1)[0].decode("latin-1"))
                    core = int.from_bytes(machine.read_memory(thread.tracee.task + layout.cpu, 4), "little",
                                          signed=True)
                except MachineError:
                    pass
            attributes = f' id="{self.threads.thread_id(tid).decode()}"'
            if core >= 0:
                attributes += f' core="{core}"'
            if name:
                attributes += f' name="{name}"'
            lines.append(f"<thread{attributes}/>")
        lines.append("</threads>")
        return ("\n".join(lines) + "\n").encode()

    @handles(c.ReadLibrariesSvr4)
    def read_libraries_svr4(self, packet: c.ReadLibrariesSvr4) -> Reply:
        """The document built anew for each window, as gdbserver builds it; E01 without a process, or for a program
        without r_debug (static), as gdbserver's answer (GDB then reads the memory itself)."""
        process = self._process()

        def read(address: int, length: int) -> bytes:
            try:
                return process.live_memory(address, length)
            except ViewError:
                return b""

        document = libraries_svr4(process.auxv, read, packet.lmid, packet.start, packet.prev)
        if document is None:
            raise RspError(E_BAD_PACKET, "the program has no DT_DEBUG (static?): no list of shared libraries")
        return self._window(document, packet)

    @handles(c.ReadExecFile)
    def read_exec_file(self, packet: c.ReadExecFile) -> Reply:
        """The program's path inside the machine, never a host file's contents (gdbserver answers the path of
        /proc/PID/exe): of the process the annex names, or the selected thread's."""
        process = self._process()
        try:
            pid = int(packet.annex, 16) if packet.annex else process.pid
        except ValueError:
            raise RspError(E_BAD_PACKET, f"qXfer:exec-file:read: {packet.annex!r} is no pid") from None
        process = self.target.processes.get(pid)  # type: ignore[assignment]
        if process is None:
            raise RspError(E_BAD_PACKET, f"no process {packet.annex}")
        return self._window(process.exec_path.encode(), packet)
