"""Starting the stub and speaking to it from outside, as the tests, the tools (smoke, soak, fuzz, transcript
recorder, crash-rate measurement) and the benchmark do. Each of these jobs is done here once:

- `paths`: where the repository keeps the kernel, its sources, the transcripts and the scripts (ROOT, VMLINUX...).
- `stub`: `kgtp-sim serve --port 0` as a child process on a free loopback port, ready once it prints its listening
  line (`start_stub`), stopped with `StubProcess.stop`; `serve_until_exit` for command lines that must be refused.
- `rsp`: a raw RSP client over a socket on the sans-IO codec (`RspClient`): packets, replies, acks or no-ack mode,
  and a connection that waits while the stub's one debugger slot is still held (`RspClient.connect_when_free`).
- `gdb`: the host's GDB binaries (`GDB_CLIENTS`) and GDB in batch mode against a stub (`run_gdb`, `gdb_each`).
- `mi`: one GDB driven through its machine interface (`GdbMi`).

The package offers each module's names as its own, each module imported when one of its names is first asked for.

Threads: everything runs on the caller's thread. Two kinds of daemon thread only read pipes: one per started stub
drains its output (so the stub never blocks on a full pipe, and its listening line is an event to wait on), and
one per MI-driven GDB queues its output lines.
"""

import importlib

#: each name the package offers -> its module, imported when the name is first asked for (PEP 562): `kgtp-sim run`
#: needs only `paths`, and GDB's drivers and the RSP client would add their imports to every program's start
_MODULE_OF = {name: module for module, names in (
    ("gdb", ("GDB_CLIENTS", "Gdb", "GdbClient", "batch_argv", "command_file", "gdb_batch", "gdb_each", "gdb_version",
             "run_gdb", "session_lines", "start_gdb", "system_gdb")),
    ("mi", ("GdbMi", "MiError", "MiResult", "parse_cstring", "parse_results")),
    ("paths", ("FIXTURES", "KERNEL_SOURCES", "ROOT", "SCRIPTS", "TRANSCRIPTS", "VMLINUX")),
    ("rsp", ("RspClient", "RspError", "console_text")),
    ("stub", ("StubProcess", "kgtp_command", "serve_until_exit", "start_stub")),
) for name in names}
_MODULES = frozenset(_MODULE_OF.values())


def __getattr__(name: str) -> object:
    if name in _MODULES:  # a submodule not imported yet
        return importlib.import_module(f"{__name__}.{name}")
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF, *_MODULES})


__all__ = [
    "FIXTURES", "GDB_CLIENTS", "KERNEL_SOURCES", "ROOT", "SCRIPTS", "TRANSCRIPTS", "VMLINUX", "Gdb", "GdbClient",
    "GdbMi", "MiError", "MiResult", "RspClient", "RspError", "StubProcess", "batch_argv", "command_file",
    "console_text", "gdb_batch", "gdb_each", "gdb_version", "kgtp_command", "parse_cstring", "parse_results",
    "run_gdb", "serve_until_exit", "session_lines", "start_gdb", "start_stub", "system_gdb",
]
