"""Linux's signal numbers (x86_64) and GDB's own, which the Remote Serial Protocol carries: a stop reply's
`T<sig>`/`X<sig>`, a resumption's `C<sig>`/`S<sig>`, QPassSignals' list (gdb/include/gdb/signals.def; gdbserver
converts with gdb_signal_from_host and gdb_signal_to_host).

Pure tables: used on the server thread by the gdbserver role's target (stub/process.py).
"""

from __future__ import annotations

#: Linux signal number -> GDB's (gdb_signal_from_host); SIGSTKFLT has no name in GDB: GDB_SIGNAL_UNKNOWN
_LINUX_TO_GDB = {
    1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6, 7: 10, 8: 8, 9: 9, 10: 30, 11: 11, 12: 31, 13: 13, 14: 14, 15: 15,
    16: 143, 17: 20, 18: 19, 19: 17, 20: 18, 21: 21, 22: 22, 23: 16, 24: 24, 25: 25, 26: 26, 27: 27, 28: 28,
    29: 23, 30: 32, 31: 12, 32: 77, 64: 78,
}
_LINUX_TO_GDB.update({n: 45 + n - 33 for n in range(33, 64)})  # SIGRTMIN+1..: GDB_SIGNAL_REALTIME_33...
_GDB_TO_LINUX = {gdb: linux for linux, gdb in _LINUX_TO_GDB.items() if gdb != 143}

GDB_SIGNAL_UNKNOWN = 143


def to_gdb(signal: int) -> int:
    """A Linux signal as GDB numbers it (0 stays 0: no signal)."""
    return _LINUX_TO_GDB.get(signal, GDB_SIGNAL_UNKNOWN) if signal else 0


def to_linux(signal: int) -> int | None:
    """GDB's signal as Linux numbers it; 0 stays 0; None for one Linux has not (GDB's SIGEMT, SIGLOST...)."""
    return _GDB_TO_LINUX.get(signal) if signal else 0
