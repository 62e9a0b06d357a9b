"""Security defaults, proven against the stub process with real GDB (raw RSP where GDB cannot say it).

The stub speaks for a kernel, so whoever reaches its port is root on the emulated machine. The defaults must
therefore be the safe ones: listen on loopback only, refuse every write to kernel memory or registers unless the
user enabled it, keep `monitor` a fixed table that can neither run host code nor read host files, write trace
files only under the directory chosen at start-up, and offer no packet that reads or writes host files.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kgtp_sim.client import (
    ROOT,
    VMLINUX,
    GdbClient,
    RspClient,
    StubProcess,
    gdb_each,
    serve_until_exit,
    start_stub,
)
from kgtp_sim.machine import KernelImage

from ..conftest import assert_kernel_ticks

pytestmark = pytest.mark.gdb

#: The first line of the host's account database: if it ever shows up in a reply, a host file leaked.
PASSWD_MARK = "root:x:0:0:"


# ---- helpers ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelSymbols:
    """Addresses the tests read and write: a counter the kernel bumps, a constant string and a function's code."""

    jiffies: int
    banner: int  # `hello` of syscall_test_thread: read-only data the kernel prints now and then
    banner_size: int
    text: int  # kgtp_test_function: kernel code that runs all the time


@pytest.fixture(scope="module")
def symbols() -> KernelSymbols:
    table = KernelImage.load(VMLINUX).symbols
    return KernelSymbols(table["jiffies"].address, table["hello.0"].address, table["hello.0"].size,
                         table["kgtp_test_function"].address)


def listeners(port: int) -> list[tuple[str, str]]:
    """(table, local address in hex) of every listening TCP socket on `port`, from the kernel's own tables."""
    found = []
    for table in ("tcp", "tcp6"):
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for row in path.read_text().splitlines()[1:]:
            fields = row.split()
            address, _, port_hex = fields[1].rpartition(":")
            if int(port_hex, 16) == port and fields[3] == "0A":  # 0A: TCP_LISTEN
                found.append((table, address))
    return found


def non_loopback_ipv4_addresses() -> list[str]:
    """This host's own IPv4 addresses other than loopback (the LOCAL host routes of the routing table)."""
    addresses: set[str] = set()
    trie = Path("/proc/net/fib_trie")
    if trie.exists():
        last = None
        for line in trie.read_text().splitlines():
            match = re.match(r"^\s*\|--\s+([\d.]+)$", line)
            if match:
                last = match.group(1)
            elif last and "/32 host LOCAL" in line:
                addresses.add(last)
    else:
        try:
            addresses.update(info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET))
        except OSError:
            pass
    return sorted(a for a in addresses if not ipaddress.ip_address(a).is_loopback)


# ---- loopback ----------------------------------------------------------------------------------------------------


def test_listening_socket_is_bound_to_loopback_only(stub: StubProcess) -> None:
    """Not just what the stub prints: the kernel's socket table shows one listener, on 127.0.0.1, and a connection
    through any other address of this host is refused."""
    assert listeners(stub.port) == [("tcp", "0100007F")]  # 127.0.0.1 in /proc/net/tcp's little-endian hex
    others = non_loopback_ipv4_addresses()
    if not others:
        pytest.skip("this host has no non-loopback IPv4 address to try")
    for address in others:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((address, stub.port), timeout=5).close()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "0", "", "::ffff:0.0.0.0", "localhost.localdomain.invalid"])
def test_wildcard_and_unusual_hosts_are_refused_without_allow_remote(host: str) -> None:
    """Anything that is not a loopback address (wildcards, the empty string and "0" that mean "any" to the
    socket layer, names that could resolve anywhere) is refused with a message that names the way out."""
    result = serve_until_exit("--host", host)
    assert result.returncode == 2, result
    assert result.stderr.startswith("kgtp-sim: refusing to listen on non-loopback address"), result.stderr
    assert "--allow-remote" in result.stderr and "Traceback" not in result.stderr


def test_this_hosts_own_addresses_are_refused_without_allow_remote() -> None:
    """A real interface address of this host is as exposed as the wildcard."""
    others = non_loopback_ipv4_addresses()
    if not others:
        pytest.skip("this host has no non-loopback IPv4 address to try")
    for address in others:
        result = serve_until_exit("--host", address)
        assert result.returncode == 2 and "--allow-remote" in result.stderr, result.stderr


def test_allow_remote_is_the_explicit_and_loudly_warned_way_out() -> None:
    """With --allow-remote the stub does listen on a real interface, and says on start-up that it is a risk."""
    others = non_loopback_ipv4_addresses()
    if not others:
        pytest.skip("this host has no non-loopback IPv4 address to listen on")
    server = start_stub("--host", others[0], "--allow-remote")
    try:
        assert re.search(r"WARNING: listening on .*controls the kernel", "".join(server.output)), server.output
        with RspClient.connect(server.port, host=others[0], timeout=5) as client:
            assert b"PacketSize=" in client.request(b"qSupported")
    finally:
        server.stop()


# ---- writes to kernel memory and registers -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def writable_stub() -> Iterator[StubProcess]:
    server = start_stub("--allow-writes")
    yield server
    server.stop()


def test_raw_memory_register_and_breakpoint_packets_change_nothing_by_default(
        stub: StubProcess, symbols: KernelSymbols) -> None:
    """M and X (hex and binary writes, including bytes that need escaping on the wire), G and P (registers) are
    all answered E03 and the bytes read back are the ones before. Z0 to Z4 (software and hardware breakpoints,
    watchpoints) never patch memory: they live in the machine's translator and debug registers (run control, the
    read watchpoint x86 lacks unsupported), so the kernel's code reads back as it was, and a GDB that falls back
    on writing an int3 with M/X meets the same write guard."""
    with RspClient.connect_when_free(stub) as client:
        banner = client.read_memory(symbols.banner, symbols.banner_size)
        code = client.read_memory(symbols.text, 16)
        registers = client.request(b"g").replace(b"x", b"0")  # unavailable registers read as "xx"
        attempts = [
            (b"M%x,5:50574e4544" % symbols.banner, False),
            (b"M%x,1:cc" % symbols.text, False),
            (b"M%x,0:" % symbols.banner, False),
            (b"M%x,8:0000000000000000" % symbols.jiffies, False),
            (b"X%x,6:}#$*\xcc\x00" % symbols.banner, True),
            (b"X%x,1:\xcc" % symbols.text, True),
            (b"G" + registers, False),  # what GDB sends back after editing one register
            (b"P10=0000000000000000", False),  # rip
            (b"P0=4141414141414141", False),  # rax
        ]
        for payload, binary in attempts:
            assert client.request(payload, binary=binary) == b"E03", payload[:40]
        for kind in (b"0", b"1", b"2", b"4"):
            assert client.request(b"Z%s,%x,1" % (kind, symbols.text)) == b"OK", kind
            assert client.read_memory(symbols.text, 16) == code, kind  # not patched
            assert client.request(b"z%s,%x,1" % (kind, symbols.text)) == b"OK", kind
        assert client.request(b"Z3,%x,1" % symbols.text) == b""  # x86 has no read watchpoint
        client.monitor("go")  # kgtp_test_function runs all the time: a breakpoint on it may have stopped the kernel
        assert client.read_memory(symbols.banner, symbols.banner_size) == banner
        assert client.read_memory(symbols.text, 16) == code
        assert_kernel_ticks(client, symbols.jiffies)


def test_gdb_cannot_write_memory_registers_or_plant_breakpoints_by_default(
        gdb: GdbClient, stub: StubProcess, symbols: KernelSymbols, tmp_path: Path) -> None:
    """Every way GDB writes refuses with a message: assignment to a variable, a raw `set {char}`, `restore` of a
    file, register assignment. A breakpoint is no write: the machine stops at it (run control), the kernel's code
    as it was."""
    payload = tmp_path / "payload.bin"
    payload.write_bytes(b"PWNED-BY-RESTORE")
    with RspClient.connect_when_free(stub) as client:
        banner = client.read_memory(symbols.banner, symbols.banner_size)
        code = client.read_memory(symbols.text, 16)
    out = gdb_each(gdb, stub, "set var jiffies = 0", f"set {{char}}{symbols.banner:#x} = 65",
                   f"restore {payload} binary {symbols.banner:#x}", "print $rax = 1", "set var $pc = 0",
                   "break kgtp_test_function", "continue", "print 6*7", timeout=30)
    assert f"Cannot access memory at address {symbols.jiffies:#x}" in out, out
    assert f"Cannot access memory at address {symbols.banner:#x}" in out, out
    assert "restore: memory write failed" in out, out
    assert re.search(r'Could not write register "rax"', out) and re.search(r'Could not write register "rip"', out)
    assert re.search(r"^Thread \d+ hit Breakpoint 1, kgtp_test_function", out, re.M), out
    assert re.search(r"^\$\d+ = 42$", out, re.M), out  # GDB stayed attached and usable after every refusal
    with RspClient.connect_when_free(stub) as client:
        assert client.read_memory(symbols.banner, symbols.banner_size) == banner
        assert client.read_memory(symbols.text, 16) == code  # no int3 left behind
        assert client.read_u64(symbols.jiffies) > 0
        assert_kernel_ticks(client, symbols.jiffies)


def test_allow_writes_makes_gdb_writes_land_but_never_registers(
        gdb: GdbClient, writable_stub: StubProcess, symbols: KernelSymbols, tmp_path: Path) -> None:
    """--allow-writes is the one switch: with it, assignment, `set {char}` and `restore` reach kernel memory (the
    kernel keeps counting from the jiffies GDB wrote). Registers of the running kernel stay read-only, and a
    write to unmapped memory is a clean error."""
    payload = tmp_path / "payload.bin"
    payload.write_bytes(b"RESTORED")
    with RspClient.connect_when_free(writable_stub) as client:
        banner = client.read_memory(symbols.banner, symbols.banner_size)
        before = client.read_u64(symbols.jiffies)
    leap = 1_000_000_000  # forwards, so no sleeping kernel thread ever waits for time to come back
    out = gdb_each(gdb, writable_stub, f"set var jiffies = jiffies + {leap}", "print jiffies",
                   f"set {{char}}{symbols.banner:#x} = 83", f"restore {payload} binary {symbols.banner + 1:#x}",
                   f"x/s {symbols.banner:#x}", "print $rax = 1", "set {char}0 = 1", "print 6*7", timeout=30)
    try:
        jiffies = int(re.search(r"^\$1 = (\d+)$", out, re.M).group(1))  # type: ignore[union-attr]
        assert before + leap <= jiffies < before + leap + 10_000, out
        assert re.search(r'<hello\.0>:\s+"SRESTOREDest: hello from int', out), out
        assert 'Could not write register "rax"' in out and "Cannot access memory at address 0x0" in out, out
        assert re.search(r"^\$\d+ = 42$", out, re.M), out
        with RspClient.connect_when_free(writable_stub) as client:
            assert client.read_memory(symbols.banner, 9) == b"SRESTORED"
            assert client.request(b"M%x,%x:%s" % (symbols.banner, len(banner), banner.hex().encode())) == b"OK"
            assert client.read_memory(symbols.banner, symbols.banner_size) == banner
            assert client.read_u64(symbols.jiffies) >= before + leap
            assert_kernel_ticks(client, symbols.jiffies)
    finally:
        with RspClient.connect_when_free(writable_stub) as client:  # leave the module's stub as it started
            client.request(b"M%x,%x:%s" % (symbols.banner, len(banner), banner.hex().encode()))


def test_allow_writes_still_never_patches_memory_for_a_breakpoint(writable_stub: StubProcess,
                                                                  symbols: KernelSymbols) -> None:
    """Even with writes enabled the stub's breakpoints (Z0, Z1) are the machine's, never an int3 in memory, and
    register writes are refused: the only way memory changes is an explicit M/X from the debugger."""
    with RspClient.connect_when_free(writable_stub) as client:
        code = client.read_memory(symbols.text, 16)
        for kind in (b"0", b"1"):
            assert client.request(b"Z%s,%x,1" % (kind, symbols.text)) == b"OK"
            assert client.read_memory(symbols.text, 16) == code
            assert client.request(b"z%s,%x,1" % (kind, symbols.text)) == b"OK"
        assert client.request(b"P10=0000000000000000") == b"E03"
        assert client.request(b"G" + client.request(b"g").replace(b"x", b"0")) == b"E03"
        assert client.read_memory(symbols.text, 16) == code


# ---- monitor -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostSecrets:
    """A canary path that must never be created and a secret that must never be printed."""

    canary: Path
    secret_file: Path
    secret: str

    def assert_untouched(self, text: str) -> None:
        assert not self.canary.exists(), "a monitor command ran host code"
        assert self.secret not in text, "a monitor command printed a host file"
        assert PASSWD_MARK not in text and "uid=" not in text, "a monitor command read a host file or ran `id`"


@pytest.fixture
def secrets(tmp_path: Path) -> HostSecrets:
    secret = f"kgtp-sec-{uuid.uuid4().hex}"
    secret_file = tmp_path / "private.txt"
    secret_file.write_text(secret + "\n")
    return HostSecrets(tmp_path / "canary", secret_file, secret)


def hostile_arguments(secrets: HostSecrets) -> list[str]:
    """Shell, Python and format-string injection, host paths, quoting errors, and one very long word."""
    canary = secrets.canary
    return [
        f"; touch {canary}", f"&& touch {canary}", f"| touch {canary}", f"$(touch {canary})", f"`touch {canary}`",
        f"1; touch {canary}", f"__import__('os').system('touch {canary}')",
        f"exec(\"open('{canary}', 'w')\")", "{0.__class__.__init__.__globals__}", "%s%s%n%x",
        str(secrets.secret_file), f"@{secrets.secret_file}", f"<{secrets.secret_file}", f"$(cat {secrets.secret_file})",
        "/etc/passwd", "../../../../../../../../etc/passwd", "file:///etc/passwd", "~root/.ssh/id_rsa",
        "'unterminated", '"also unterminated', "\\", "1e3 0b2 0o9", "-1", "99999999999999999999999999",
        "A" * 6000,
    ]


def monitor_command_names(client: RspClient) -> list[str]:
    text = client.monitor("help")
    names = re.findall(r"^  (\w+)", text, re.M)
    assert "help" in names and len(names) >= 5, text
    return names


def test_every_monitor_command_survives_hostile_arguments(stub: StubProcess, secrets: HostSecrets,
                                                          symbols: KernelSymbols) -> None:
    """Each command listed by `monitor help`, with each hostile argument, answers (an error or its normal output)
    without running host code or printing host files, changes no setting, and leaves the stub serving."""
    with RspClient.connect_when_free(stub) as client:
        names = monitor_command_names(client)
        settings = [client.monitor(name) for name in ("hz", "pace", "engine")]
        for name in names:
            for argument in hostile_arguments(secrets):
                text = client.monitor(f"{name} {argument}")
                secrets.assert_untouched(text)
                assert text.strip(), (name, argument)
        assert [client.monitor(name) for name in ("hz", "pace", "engine")] == settings
        assert_kernel_ticks(client, symbols.jiffies)
    assert stub.proc.poll() is None


def test_monitor_refuses_arguments_beyond_the_usage(stub: StubProcess, secrets: HostSecrets) -> None:
    """`monitor hz 100 $(touch FILE)` runs nothing, but it is answered as if it were `monitor hz 100`: a line the
    command does not understand should be refused with its usage, as `stats` already does, not half-obeyed."""
    trailer = f"$(touch {secrets.canary})"
    with RspClient.connect_when_free(stub) as client:
        current = {name: client.monitor(name).split()[1] for name in ("hz", "pace", "engine")}
        lines = [f"hz {current['hz']} {trailer}", f"pace {current['pace']} {trailer}",
                 f"engine {current['engine']} {trailer}", f"frames 0 1 {trailer}", f"sdata 0 1 {trailer}",
                 f"console {trailer}", f"probes {trailer}", f"stats {trailer}"]
        answers = {line: client.monitor(line) for line in lines}
    for text in answers.values():
        secrets.assert_untouched(text)
    half_obeyed = [line for line, text in answers.items() if "usage: monitor" not in text]
    assert not half_obeyed, answers


@pytest.mark.parametrize("line", [
    "shell id", "python print(1)", "python import os; os.system('id')", "!id", "|id", "pipe id", "exec id",
    "system id", "eval 1+1", "source /etc/passwd", "cat /etc/passwd", "load /etc/passwd", "set hz 1",
    "import os", "py print(open('/etc/passwd').read())", "HZ 100", "hz\x00id", " help; id",
])
def test_commands_outside_the_table_are_unknown(stub: StubProcess, secrets: HostSecrets, line: str) -> None:
    """Command names are looked up exactly: nothing that looks like a shell, an interpreter or a file loader runs."""
    with RspClient.connect_when_free(stub) as client:
        text = client.monitor(line)
    secrets.assert_untouched(text)
    assert "unknown command" in text, (line, text)


@pytest.mark.parametrize("raw", [
    b"\xff\xfe\xfd", b"hz \xff", b"\xc0\xafetc\xc0\xafpasswd", b"pace \x80\x81", b"\xed\xa0\x80 id",
    b"\x00", b"help\x00shell id", b"\x1b]0;title\x07hz", b"x" * 30000,
])
def test_monitor_lines_that_are_not_utf8_or_oversized_are_answered(stub: StubProcess, secrets: HostSecrets,
                                                                   symbols: KernelSymbols, raw: bytes) -> None:
    """qRcmd carries raw bytes: invalid UTF-8, NUL, escape sequences and a line longer than PacketSize all get an
    answer (GDB would print it) and the stub keeps serving."""
    with RspClient.connect_when_free(stub) as client:
        text = client.monitor(raw)
        secrets.assert_untouched(text)
        assert text.strip()
        assert_kernel_ticks(client, symbols.jiffies)


def test_gdb_monitor_with_hostile_lines(gdb: GdbClient, stub: StubProcess, secrets: HostSecrets) -> None:
    """The same through GDB's own `monitor` command: every hostile line gets a `monitor ...` answer and GDB stays
    attached."""
    canary = secrets.canary
    lines = [f"shell touch {canary}", f"hz $(touch {canary})", f"pace `touch {canary}`",
             f"engine __import__('os').system('touch {canary}')", f"console ; cat {secrets.secret_file}",
             f"frames {secrets.secret_file}", "sdata ../../../../etc/passwd", f"stats && touch {canary}",
             f"probes | cat {secrets.secret_file}", "python print(open('/etc/passwd').read())", "!id"]
    out = gdb_each(gdb, stub, *(f"monitor {line}" for line in lines), "monitor hz", timeout=30)
    secrets.assert_untouched(out)
    assert len(re.findall(r"^monitor[ :]", out, re.M)) == len(lines), out  # every line refused with a reason
    assert re.search(r"^hz \d+$", out, re.M), out


# ---- QTSave (`tsave -r`) -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SaveArea:
    """`saves` is the --save-dir; `outside` is next to it and must stay exactly as the tests left it."""

    root: Path
    saves: Path
    outside: Path
    stub: StubProcess

    def outside_snapshot(self) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(self.outside.iterdir())}

    def root_entries(self) -> set[str]:
        return {p.name for p in self.root.iterdir()}


@pytest.fixture(scope="module")
def save_area(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SaveArea]:
    root = tmp_path_factory.mktemp("save-area")
    saves, outside = root / "saves", root / "outside"
    saves.mkdir()
    outside.mkdir()
    (saves / "nested").mkdir()
    (saves / "link").symlink_to(outside, target_is_directory=True)
    server = start_stub("--save-dir", str(saves))
    yield SaveArea(root, saves, outside, server)
    server.stop()


TFILE_MAGIC = b"\x7fTRACE0\n"


def test_tsave_r_writes_only_under_the_save_dir(gdb: GdbClient, save_area: SaveArea) -> None:
    """Inside the directory (relative, absolute, nested, with a `..` that stays inside) saving works; every path
    that escapes it, lexically or through a symlink, is refused with a message GDB shows, and nothing appears
    or changes outside it."""
    saves, outside, tag = save_area.saves, save_area.outside, f"gdb{gdb.version}"
    (saves / f"{tag}-evil.tf").symlink_to(outside / f"{tag}-evil-target.tf")
    absolute_elsewhere = Path("/tmp") / f"kgtp-sec-{uuid.uuid4().hex}.tf"
    before = save_area.outside_snapshot()
    root_before = save_area.root_entries()
    inside = [f"{tag}-plain.tf", f"{saves}/{tag}-absolute.tf", f"nested/{tag}-nested.tf",
              f"nested/../{tag}-dotdot.tf"]
    escaping = [f"../{tag}-escape.tf", str(absolute_elsewhere), f"sub/../../{tag}-x.tf", f"link/{tag}-via-link.tf",
                f"{tag}-evil.tf", f"{outside}/{tag}-direct.tf", f"{saves}/../outside/{tag}-abs-dotdot.tf",
                ".", str(saves), "nested/.."]
    out = gdb_each(gdb, save_area.stub, *(f"tsave -r {name}" for name in inside + escaping), "print 6*7",
                   timeout=30)
    try:
        for name in (f"{tag}-plain.tf", f"{tag}-absolute.tf", f"nested/{tag}-nested.tf", f"{tag}-dotdot.tf"):
            assert (saves / name).read_bytes().startswith(TFILE_MAGIC), (name, out)
        assert out.count("is outside the save directory") == len(escaping), out
        assert re.search(r"^\$\d+ = 42$", out, re.M), out
        assert save_area.outside_snapshot() == before
        assert save_area.root_entries() == root_before
        assert not absolute_elsewhere.exists()
        assert not (saves / "sub").exists()
    finally:
        absolute_elsewhere.unlink(missing_ok=True)


def test_tsave_r_replaces_existing_files_without_writing_through_links(gdb: GdbClient, save_area: SaveArea) -> None:
    """Saving over an existing file inside the directory is allowed (as a local `tsave` overwrites): the new file
    replaces the old one, so a hard link to a file outside is broken rather than written through; links planted
    at `NAME.part` are never used (the temporary gets a fresh name of its own)."""
    saves, outside, tag = save_area.saves, save_area.outside, f"gdb{gdb.version}"
    (saves / f"{tag}-existing.tf").write_bytes(b"old contents")
    hard_victim = outside / f"{tag}-hard-victim"
    hard_victim.write_bytes(b"hard link victim")
    os.link(hard_victim, saves / f"{tag}-hard.tf")
    part_victim = outside / f"{tag}-part-victim"
    part_victim.write_bytes(b"part victim")
    (saves / f"{tag}-planted.tf.part").symlink_to(part_victim)
    (saves / f"{tag}-dangling.tf.part").symlink_to(outside / f"{tag}-created-by-dangling")
    out = gdb_each(gdb, save_area.stub, f"tsave -r {tag}-existing.tf", f"tsave -r {tag}-hard.tf",
                   f"tsave -r {tag}-planted.tf", f"tsave -r {tag}-dangling.tf", "print 6*7", timeout=30)
    assert (saves / f"{tag}-existing.tf").read_bytes().startswith(TFILE_MAGIC), out
    assert (saves / f"{tag}-hard.tf").read_bytes().startswith(TFILE_MAGIC), out
    assert hard_victim.read_bytes() == b"hard link victim"
    assert part_victim.read_bytes() == b"part victim"
    assert not (outside / f"{tag}-created-by-dangling").exists()
    for name in (f"{tag}-planted.tf", f"{tag}-dangling.tf"):
        assert (saves / name).read_bytes().startswith(TFILE_MAGIC), out
    assert "cannot write" not in out, out
    assert re.search(r"^\$\d+ = 42$", out, re.M), out


def qtsave(client: RspClient, name: bytes) -> bytes:
    return client.request(b"QTSave:" + name.hex().encode())


def test_qtsave_never_writes_through_a_hard_link_planted_at_the_temporary_name(save_area: SaveArea) -> None:
    """The temporary file is opened without following symlinks, but a hard link at `NAME.part` is another name of
    an outside file: opening it for writing (instead of creating a new file) rewrites that outside file."""
    victim = save_area.outside / "part-hard-victim"
    victim.write_bytes(b"outside, not to be written")
    os.link(victim, save_area.saves / "linked.tf.part")
    with RspClient.connect_when_free(save_area.stub) as client:
        qtsave(client, b"linked.tf")
    assert victim.read_bytes() == b"outside, not to be written"


def test_a_failed_save_leaves_no_temporary_file(save_area: SaveArea) -> None:
    """Saving onto an existing directory fails with a message; the half-done temporary should not stay behind."""
    (save_area.saves / "a-directory").mkdir()
    before = {p.name for p in save_area.saves.iterdir()}  # other tests planted .part links of their own
    with RspClient.connect_when_free(save_area.stub) as client:
        assert qtsave(client, b"a-directory").startswith(b"E.cannot write")
    assert {p.name for p in save_area.saves.iterdir()} == before


def test_raw_qtsave_refuses_nul_and_escapes_and_never_writes_outside(save_area: SaveArea,
                                                                     symbols: KernelSymbols) -> None:
    """Names GDB would never send: NUL anywhere, escapes hidden after a NUL, non-UTF-8 bytes, names too long for
    the file system, and a missing or odd-length hex name. Each is answered (an error where refused), nothing
    lands outside the directory, and the stub keeps serving."""
    before = save_area.outside_snapshot()
    root_before = save_area.root_entries()
    elsewhere = b"/tmp/kgtp-sec-%s-\xff.tf" % uuid.uuid4().hex.encode()
    refused = [b"a\x00b.tf", b"\x00", b"ok.tf\x00/../../escape.tf", b"../\x00", b"../escape\xff.tf", elsewhere,
               b"link/\xfe.tf"]
    with RspClient.connect_when_free(save_area.stub) as client:
        for name in refused:
            reply = qtsave(client, name)
            assert reply.startswith(b"E."), (name, reply)
        assert qtsave(client, b"x" * 300).startswith(b"E.cannot write")  # longer than a file name may be
        assert qtsave(client, b"nested/" * 700 + b"x.tf").startswith(b"E.")
        assert client.request(b"QTSave:") == b"E01"
        assert client.request(b"QTSave:6") == b"E01"
        assert client.request(b"QTSave:zz") == b"E01"
        assert qtsave(client, b"raw-\xff\xfe.tf") == b"OK"  # any byte a file name may hold, inside the directory
        assert_kernel_ticks(client, symbols.jiffies)
    assert (save_area.saves / os.fsdecode(b"raw-\xff\xfe.tf")).read_bytes().startswith(TFILE_MAGIC)
    assert save_area.outside_snapshot() == before
    assert save_area.root_entries() == root_before
    assert not Path(os.fsdecode(elsewhere)).exists()


def test_raw_qtsave_newline_names_stay_inside_the_save_dir(save_area: SaveArea) -> None:
    """Whatever is decided about control characters, a name holding them never leaves the directory."""
    root_before = save_area.root_entries()
    with RspClient.connect_when_free(save_area.stub) as client:
        for name in (b"../nl\n.tf", b"\n/../../nl.tf", b"nested/\n/../../../nl.tf"):
            assert qtsave(client, name).startswith(b"E."), name
    assert save_area.root_entries() == root_before


def test_raw_qtsave_refuses_control_characters_in_names(save_area: SaveArea) -> None:
    """A name with a newline or a terminal escape is never one a user meant; it garbles listings and logs, so
    like NUL it should be refused with an error rather than created."""
    with RspClient.connect_when_free(save_area.stub) as client:
        replies = {name: qtsave(client, name) for name in (b"nl\nname.tf", b"cr\rname.tf", b"esc\x1b[2Jname.tf")}
    created = sorted(p.name for p in save_area.saves.iterdir() if any(c in p.name for c in "\n\r\x1b"))
    assert all(reply.startswith(b"E.") for reply in replies.values()) and not created, (replies, created)


def test_qtsave_without_save_dir_is_refused_for_every_name(stub: StubProcess, tmp_path: Path) -> None:
    """Without --save-dir there is no place to write at all: relative names (which would land in the stub's
    working directory), absolute ones and escapes are all refused, and none is created."""
    probe = f"kgtp-sec-{uuid.uuid4().hex}.tf"
    names = [probe.encode(), str(tmp_path / probe).encode(), f"../{probe}".encode(), f"fixtures/{probe}".encode()]
    with RspClient.connect_when_free(stub) as client:
        for name in names:
            assert qtsave(client, name) == (
                b"E.target-side saving is disabled (start the stub with --save-dir DIR)"), name
    assert not (ROOT / probe).exists() and not (ROOT.parent / probe).exists()
    assert not (tmp_path / probe).exists() and not (ROOT / "fixtures" / probe).exists()


# ---- packets that could reach host files -------------------------------------------------------------------------


def test_no_packet_reads_or_writes_host_files(stub: StubProcess, symbols: KernelSymbols, tmp_path: Path) -> None:
    """Host I/O (vFile), the executable's path, running programs, the working directory and environment are not
    implemented (empty reply), qSupported announces none of them, and the one document served by name
    (qXfer:features) answers only for target.xml, whatever path the annex tries. `info os processes` and KGTP's
    `attach` are the machine's processes only: the host's (this test's own pid) are neither listed nor attached.
    Requests that would write or delete aim at a file of the test's own, never at a host file."""
    passwd = b"/etc/passwd".hex().encode()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"must survive")
    victim_hex = str(victim).encode().hex().encode()
    unsupported = [
        b"vFile:setfs:0", b"vFile:open:" + passwd + b",0,0", b"vFile:open:" + victim_hex + b",241,1ff",
        b"vFile:pread:0,1000,0", b"vFile:pwrite:0,0:x", b"vFile:readlink:" + passwd, b"vFile:fstat:0",
        b"vFile:unlink:" + victim_hex, b"vFile:close:0",
        b"qXfer:exec-file:read::0,fff", b"qXfer:exec-file:read:1:0,fff", b"qXfer:auxv:read::0,fff",
        b"qXfer:libraries:read::0,fff", b"qXfer:libraries-svr4:read::0,fff", b"qXfer:threads:read::0,fff",
        b"vRun;" + b"/bin/sh".hex().encode(), b"QSetWorkingDir:" + b"/".hex().encode(),
        b"QEnvironmentHexEncoded:" + b"LD_PRELOAD=/tmp/x.so".hex().encode(), b"QStartupWithShell:1",
        b"qGetTLSAddr:1,0,0", b"vKill;1",
    ]
    traversals = [b"../../etc/passwd", b"/etc/passwd", b"target.xml/../../../../etc/passwd",
                  b"..%2f..%2fetc%2fpasswd", b"../../../../proc/self/environ", b"i386-64bit.xml", b""]
    with RspClient.connect_when_free(stub) as client:
        features = client.request(b"qSupported:multiprocess+;xmlRegisters=i386")
        for feature in (b"vFile", b"exec-file", b"multiprocess", b"auxv", b"libraries"):
            assert feature not in features, feature
        for payload in unsupported:
            assert client.request(payload) == b"", payload
        processes = client.request(b"qXfer:osdata:read:processes:0,fff")
        assert processes.startswith(b"l<osdata") and b"[swapper/0]" in processes, processes
        assert b">%d<" % os.getpid() not in processes and b"python" not in processes and b"pytest" not in processes
        assert client.request(b"vAttach;%x" % os.getpid()).startswith(b"E")  # not a process of the machine
        assert client.request(b"vAttach;1").startswith(b"E")  # a kernel thread
        for annex in traversals:
            reply = client.request(b"qXfer:features:read:" + annex + b":0,fff")
            assert reply.startswith(b"E") and PASSWD_MARK.encode() not in reply, (annex, reply)
        document = client.request(b"qXfer:features:read:target.xml:0,3fff")
        assert document.startswith(b"l<?xml") and PASSWD_MARK.encode() not in document
        assert_kernel_ticks(client, symbols.jiffies)
    assert victim.read_bytes() == b"must survive"


def test_gdb_remote_file_commands_fail(gdb: GdbClient, stub: StubProcess, tmp_path: Path) -> None:
    """GDB's `remote get/put/delete` need vFile: they fail, no host file is fetched, created or removed."""
    local = tmp_path / "local.bin"
    local.write_bytes(b"keep me")
    fetched, pushed = tmp_path / "fetched", tmp_path / "pushed"
    out = gdb_each(gdb, stub, f"remote get /etc/passwd {fetched}", f"remote put {local} {pushed}",
                   f"remote delete {local}", "print 6*7", timeout=30)
    assert out.count("Remote I/O error: Function not implemented") == 3, out
    assert not fetched.exists() and not pushed.exists() and local.read_bytes() == b"keep me"
    assert PASSWD_MARK not in out
    assert re.search(r"^\$\d+ = 42$", out, re.M), out
