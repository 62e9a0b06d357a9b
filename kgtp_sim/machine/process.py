"""The machine's side of processes: RAM and its direct map, the initramfs, starting programs, their streams and
their ends.

The kernel does everything a Linux kernel does for a process in its own C code (fixtures/kernel/process.c, mm.c,
initramfs.c, entry_64.S). The machine provides what hardware and a bootloader would:

- RAM: physical [PHYS_RAM, PHYS_RAM + RAM_SIZE), mapped for the kernel at PAGE_OFFSET + physical (Linux's
  direct map), before boot, like the rest of the machine's tables (`prepare_memory`, called by the Cpu);
- the initramfs: a cpio archive (initramfs.py) placed at the top of RAM before boot, its physical address and
  size written to the kernel's `initrd_start`/`initrd_size` (a bootloader's boot_params);
- a request to start a program: the kernel's `spawn_request` (process.c) filled in and its `seq` bumped; CPU 0's
  next tick makes the process and writes its pid back (`Processes.spawn`);
- the machine's other requests, through `machine_request` the same way (`Processes.request`): files added to the
  initramfs while the kernel runs (`add_files`: room reserved by the kernel, the archive written there, its files
  listed), the debugger's attach (tracee.py);
- the console of processes: PORT_TTY_WRITE carries a process's write() on fd 1 or 2 to `Processes.output`
  (the host's own streams for `kgtp-sim run`), apart from the kernel's printk console (port 0xe9);
- PORT_PROC_EXIT: a process ended, with Linux's wait status (`Processes.wait`);
- the console's input: the machine's standard input put in the kernel's ring (`feed_input`, `end_input`), and
  which of fds 0-2 are terminals on its side (`set_terminals`, before boot).

| port | access | meaning |
|------|--------|---------|
| 0xe6 | outl | fd (1 or 2) in %eax, %rdi = the bytes (kernel address), %rsi = count: a process's output |
| 0xe7 | outl | pid in %eax, %rdi = its wait status (exit code << 8, or the signal that ended it) |

Threads: port handlers run on the CPU thread inside emulation; `spawn` and `wait` on any other thread.
"""

from __future__ import annotations

import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from unicorn import UC_PROT_ALL, Uc
from unicorn import x86_const as X

from .. import uc_paging as paging
from .errors import MachineError
from .initramfs import Archive, unpack
from .layout import PAGE_OFFSET, PAGE_SIZE, PHYS_RAM, RAM_SIZE, VMALLOC_BASE, page_ceil


PORT_TTY_WRITE = 0xE6
PORT_PROC_EXIT = 0xE7
PORTS = (PORT_TTY_WRITE, PORT_PROC_EXIT)

#: struct spawn_request (fixtures/kernel/process.c): seq, done, result, cpu, flags, then struct spawn_args
SPAWN_SEQ, SPAWN_DONE, SPAWN_RESULT, SPAWN_CPU, SPAWN_FLAGS, SPAWN_ARGC = 0, 8, 16, 24, 28, 32
SPAWN_TRACED = 0x1  #: the machine's debugger traces it from its first instruction (tracee.py)
#: struct console_input (fixtures/kernel/tty.c): head, tail, eof, tty_fds, then the ring
CONSOLE_EOF, CONSOLE_TTY_FDS, CONSOLE_DATA, CONSOLE_IN_SIZE = 16, 24, 32, 4096
SPAWN_STRINGS = 44
SPAWN_ARGS_SIZE = 4096
SPAWN_TIMEOUT = 10.0  #: seconds for CPU 0's tick to take a request (many ticks)
#: struct machine_request (process.c): seq, done, result, op, arg[2]; its ops
REQUEST_OP = 24
#: the vector that makes CPU 0 serve the requests at once (process.c: serve_host_requests), where its kernel has it
HOST_REQUEST_VECTOR = 0xF3
HOST_REQUEST_ENTRY = "asm_host_request_interrupt"
REQUEST_RAMFS_RESERVE, REQUEST_RAMFS_ADD, REQUEST_PTRACE_ATTACH = 1, 2, 3
#: task states (fixtures/kernel/include/kernel.h): an ended task whose stack is still in use, a free slot
EXIT_ZOMBIE, TASK_DEAD = 0x20, 0x80

OutputSink = Callable[[int, bytes], None]


def prepare_memory(uc: Uc, tables: paging.PageTables) -> None:
    """RAM and its direct map, before the CPU's first instruction (and before the machine hooks the physical
    addresses no memory backs). Also the kernel half's top-level entry of vmalloc space, which the stub maps
    pages under only later: each process's table copies the kernel half's top level when it is made."""
    uc.mem_map(PHYS_RAM, RAM_SIZE, UC_PROT_ALL)
    tables.map(PAGE_OFFSET + PHYS_RAM, PHYS_RAM, RAM_SIZE, paging.DATA)
    tables.table_for(VMALLOC_BASE)


@dataclass(frozen=True)
class ProcessExit:
    """How a process ended: Linux's wait status."""

    pid: int
    status: int

    @property
    def signal(self) -> int:
        """The signal that ended it, 0 if it exited."""
        return self.status & 0x7F

    @property
    def code(self) -> int:
        """exit()'s code, when it exited."""
        return self.status >> 8 & 0xFF

    @property
    def shell_status(self) -> int:
        """What a shell reports: the exit code, or 128 + the signal."""
        return 128 + self.signal if self.signal else self.code


class _Machine(Protocol):
    """What processes use of the machine (machine.Machine, which owns a `Processes`)."""

    started: bool
    cpu: Any  # cpu.Cpu: its unicorn instance
    image: Any  # image.KernelImage: where the kernel keeps the spawn request
    ptrace: Any  # tracee.Ptrace: the layout of a task
    cpu_count: int

    def read_memory(self, address: int, length: int) -> bytes: ...

    def write_memory(self, address: int, data: bytes) -> None: ...

    def run_on_cpu(self, fn: Callable[[Uc], Any]) -> Any: ...


@dataclass(frozen=True)
class ProcessEntry:
    """A process of the machine as `ps` shows it: its pid, its command line (a kernel thread's `[comm]`, as
    /proc/PID/cmdline's reader shows one) and the CPUs its threads are on."""

    pid: int
    command: str
    cores: tuple[int, ...]


class SpawnError(MachineError):
    """The kernel refused to start a program (no free slot, arguments too long) or never answered."""


class Processes:
    """Programs on the machine's kernel: the initramfs, starting them, their output and their ends."""

    def __init__(self, machine: _Machine) -> None:
        self._machine = machine
        self._lock = threading.Condition()
        self._exits: dict[int, int] = {}
        self._spawn_lock = threading.Lock()
        self._request_lock = threading.Lock()
        self.archive_size = 0
        #: the initramfs's files: path inside -> their bytes (what `add_files` need not add again; kept by reference,
        #: never copied or hashed: hashing a program's libraries took some 10 ms of each vRun)
        self.files: dict[str, bytes | memoryview] = {}
        #: where a process's output goes: fn(fd, data), on the CPU thread; by default kept in `output`
        self.sink: OutputSink | None = None
        #: called on the CPU thread with the pid of each process that ended
        self.exit_listeners: list[Callable[[int], None]] = []
        #: then, once every exit listener has run: the debugger's (tracee.Ptrace), which wakes whoever tells GDB of
        #: the end, so that what the listeners say of it comes first (gdbserver prints `Child exited with status N`
        #: before it sends the `W` reply)
        self.exit_reporters: list[Callable[[int], None]] = []
        self.output: dict[int, bytearray] = {1: bytearray(), 2: bytearray()}

    # ---- before boot ---------------------------------------------------------------------------------------

    def load_archive(self, archive: bytes) -> None:
        """Place the initramfs at the top of RAM and tell the kernel where (before Machine.start)."""
        if self._machine.started:
            raise MachineError("the initramfs is loaded before the machine starts")
        size = page_ceil(len(archive))
        if size > RAM_SIZE // 2:
            raise MachineError(f"initramfs of {len(archive)} bytes: more than half of the machine's RAM")
        start = PHYS_RAM + RAM_SIZE - size
        uc = self._machine.cpu.uc
        uc.phys_write(start, archive)
        image = self._machine.image
        uc.mem_write(image.address_of("initrd_start"), struct.pack("<Q", start))
        uc.mem_write(image.address_of("initrd_size"), struct.pack("<Q", len(archive)))
        self.archive_size = len(archive)
        self.files.update((path, data) for path, (_mode, data) in unpack(memoryview(archive)).items())

    def set_terminals(self, fds: Sequence[int]) -> None:
        """Which of fds 0-2 are terminals on the machine's side (before boot): TCGETS answers there, as for a
        program sharing gdbserver's terminal (fixtures/kernel/tty.c)."""
        if self._machine.started:
            raise MachineError("the console's terminals are set before the machine starts")
        mask = sum(1 << fd for fd in fds if 0 <= fd <= 2)
        address = self._machine.image.address_of("console_input") + CONSOLE_TTY_FDS
        self._machine.cpu.uc.mem_write(address, struct.pack("<Q", mask))

    # ---- the console's input (any thread) ------------------------------------------------------------------

    def feed_input(self, data: bytes) -> int:
        """Put bytes of the machine's standard input where a process's read() on fd 0 takes them; returns how
        many fit now (the ring holds CONSOLE_IN_SIZE: the rest waits for readers)."""
        base = self._machine.image.address_of("console_input")

        def put(uc: Any) -> int:
            head, tail = struct.unpack("<QQ", bytes(uc.mem_read(base, 16)))
            room = CONSOLE_IN_SIZE - (head - tail)
            chunk = data[:room]
            for i, byte in enumerate(chunk):
                uc.mem_write(base + CONSOLE_DATA + (head + i) % CONSOLE_IN_SIZE, bytes([byte]))
            uc.mem_write(base, struct.pack("<Q", head + len(chunk)))  # the data first, then head
            return len(chunk)

        return self._machine.run_on_cpu(put) if data else 0

    def end_input(self) -> None:
        """The machine's standard input ended: read() on fd 0 returns end of file once the ring is read."""
        address = self._machine.image.address_of("console_input") + CONSOLE_EOF
        self._machine.write_memory(address, struct.pack("<Q", 1))

    # ---- ports (CPU thread) --------------------------------------------------------------------------------

    def port_out(self, port: int, value: int, rdi: int) -> None:
        uc = self._machine.cpu.uc
        if port == PORT_TTY_WRITE:
            count = uc.reg_read(X.UC_X86_REG_RSI)
            data = bytes(uc.mem_read(rdi, count)) if count else b""
            fd = value & 0xFFFF_FFFF
            if self.sink is not None:
                self.sink(fd, data)
            else:
                kept = self.output.setdefault(fd, bytearray())
                kept += data
                del kept[: max(0, len(kept) - (1 << 20))]
        elif port == PORT_PROC_EXIT:
            pid = value & 0xFFFF_FFFF
            with self._lock:
                self._exits[pid] = rdi & 0xFFFF
                self._lock.notify_all()
            for listener in (*self.exit_listeners, *self.exit_reporters):
                listener(pid)

    # ---- any thread ----------------------------------------------------------------------------------------

    def spawn(self, path: str, argv: Sequence[str], envp: Sequence[str] = (), cpu: int = -1,
              timeout: float = SPAWN_TIMEOUT, traced: bool = False) -> int:
        """Ask the kernel to run the program at `path` (a file of the initramfs) with argv and envp, on `cpu` (-1:
        the kernel chooses); returns its pid once the kernel has made the process (the program is loaded by
        the process itself: a program it cannot run ends at once, with status 126 or 127 and a message on its
        stderr). `traced`: it stops for the machine's debugger before its first instruction (tracee.Ptrace)."""
        strings = b"".join(s.encode() + b"\0" for s in (path, *argv, *envp))
        if any("\0" in s for s in (path, *argv, *envp)):
            raise SpawnError("an argument holds a NUL byte")
        if len(strings) > SPAWN_ARGS_SIZE:
            raise SpawnError(f"arguments and environment of {len(strings)} bytes: the kernel takes "
                             f"{SPAWN_ARGS_SIZE}")
        flags = SPAWN_TRACED if traced else 0
        request = struct.pack("<iIIII", cpu, flags, len(argv), len(envp), len(strings)) + strings
        with self._spawn_lock:
            result = self._served("spawn_request", SPAWN_CPU, request, timeout)
        if result < 0:
            raise SpawnError(f"the kernel refused to start {path}: errno {-result}")
        return result

    def _served(self, name: str, at: int, request: bytes, timeout: float) -> int:
        """A request to the kernel's `name` (spawn_request, machine_request: seq, done, result, then the request at
        offset `at`): written, its seq bumped, CPU 0 rung (HOST_REQUEST_VECTOR; a kernel without it serves the
        request at CPU 0's next tick), then waited for until it is served; its result."""
        symbol = self._machine.image.address_of(name)
        read = self._machine.read_memory
        seq, done = struct.unpack("<QQ", read(symbol, 16))
        if seq != done:
            raise SpawnError("the kernel has not taken the previous request")
        self._machine.write_memory(symbol + at, request)
        self._machine.write_memory(symbol + SPAWN_SEQ, struct.pack("<Q", seq + 1))
        if HOST_REQUEST_ENTRY in self._machine.image.symbols:  # rung: served now, not at the next tick
            self._machine.send_interrupt(0, HOST_REQUEST_VECTOR)
        deadline = time.monotonic() + timeout
        while True:
            done, result = struct.unpack("<Qq", read(symbol + SPAWN_DONE, 16))
            if done == seq + 1:
                return result
            if time.monotonic() > deadline:
                raise SpawnError(f"the kernel did not take the request in {timeout:g} s")
            time.sleep(0.0005)

    def request(self, op: int, *args: int, timeout: float = SPAWN_TIMEOUT) -> int:
        """One of the kernel's machine requests (process.c: serve_request): its result, -errno when refused."""
        words = (op, *args, *(0,) * (2 - len(args)))
        with self._request_lock:
            return self._served("machine_request", REQUEST_OP, struct.pack("<3Q", *words), timeout)

    def add_files(self, archive: Archive) -> list[str]:
        """Add the files of `archive` to the running machine's initramfs (those it has already, same path and same
        bytes, are left out); returns the paths added. A file added under a path the machine has shadows the older
        one from then on (initramfs.c: ramfs_add)."""
        new = Archive({path: entry for path, entry in archive.files.items()
                       if path not in self.files or self.files[path] != entry[1]})
        if not new.files:
            return []
        data = new.pack()
        phys = self.request(REQUEST_RAMFS_RESERVE, len(data))
        if phys < 0:
            raise SpawnError(f"the kernel has no room for {len(data)} bytes of files: errno {-phys}")
        self._machine.run_on_cpu(lambda uc: uc.phys_write(phys, data))
        listed = self.request(REQUEST_RAMFS_ADD, phys, len(data))
        if listed != len(new.files):
            raise SpawnError(f"the kernel listed {listed} of {len(new.files)} files added (its table is full?)")
        self.files.update((path, entry[1]) for path, entry in new.files.items())
        return sorted(new.files)

    def listing(self) -> list[ProcessEntry]:
        """Every process of the machine, kernel threads included, by pid (/proc's listing): from the kernel's
        tasks[], and each process's command line from the arguments it was started with (process.c's exec_args,
        one per process slot: path, argv, envp)."""
        layout = self._machine.ptrace.layout
        image = self._machine.image
        tasks = image.symbols["tasks"]
        args = image.symbols["exec_args"]
        first = struct.unpack("<Q", self._machine.read_memory(image.address_of("signal_abi") + 24, 8))[0]
        count = tasks.size // layout.size
        slot_size = args.size // (count - first)

        def scan(uc: Any) -> tuple[bytes, bytes]:
            return bytes(uc.mem_read(tasks.address, tasks.size)), bytes(uc.mem_read(args.address, args.size))

        raw, arguments = self._machine.run_on_cpu(scan)
        groups: dict[int, tuple[str, set[int]]] = {}
        for index in range(count):
            base = index * layout.size
            pid, tgid, cpu = (struct.unpack_from("<i", raw, base + offset)[0]
                              for offset in (layout.pid, layout.tgid, layout.cpu))
            state, = struct.unpack_from("<q", raw, base + layout.state)
            mm, = struct.unpack_from("<Q", raw, base + layout.mm)
            if state in (TASK_DEAD, EXIT_ZOMBIE) or (index >= first and not mm):
                continue  # a free slot, an ended task, or one not set up yet (or a CPU the machine lacks)
            if index < first and cpu >= self._machine.cpu_count:
                continue
            if index < first:
                comm = raw[base + layout.comm: base + layout.comm + 16].split(b"\0", 1)[0].decode("latin-1")
                groups[pid] = (f"[{comm}]", {cpu})
                continue
            if tgid not in groups:
                slot = arguments[(index - first) * slot_size: (index - first + 1) * slot_size]
                argc, _envc, size = struct.unpack_from("<3I", slot)
                words = slot[12: 12 + size].split(b"\0")[1: 1 + argc]  # past the path
                groups[tgid] = (" ".join(w.decode("utf-8", "replace") for w in words), set())
            groups[tgid][1].add(cpu)
        return [ProcessEntry(pid, command, tuple(sorted(cores))) for pid, (command, cores) in sorted(groups.items())]

    def wait(self, pid: int, timeout: float | None = None) -> ProcessExit | None:
        """How process `pid` ended, waiting for it up to `timeout` seconds (None: as long as it takes); None if it
        has not ended by then."""
        with self._lock:
            if not self._lock.wait_for(lambda: pid in self._exits, timeout):
                return None
            return ProcessExit(pid, self._exits[pid])

    def exited(self) -> dict[int, int]:
        """Every process that ended so far: pid -> wait status."""
        with self._lock:
            return dict(self._exits)
