"""Where the repository keeps what the stub, the tests, the tools and the benchmark use: the one place these paths
are spelled.

Constants only: read on any thread, by the stub (`kgtp-sim serve`'s default kernel), the tools, the benchmark and
the tests.
"""

from __future__ import annotations

from pathlib import Path

#: The checkout: the stub is started from here, and the tools' default outputs are relative to it.
ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures"
#: The bundled kernel: symbols and DWARF for GDB, the image the stub runs.
VMLINUX = FIXTURES / "vmlinux"
#: The kernel's C and assembly sources (fixtures/kernel/README.md).
KERNEL_SOURCES = FIXTURES / "kernel"
#: Recorded GDB sessions (`*.rsp`, kgtp_sim/tools/transcript.py).
TRANSCRIPTS = FIXTURES / "transcripts"
#: The user-facing entry points (scripts/serve, scripts/test, scripts/soak, ...).
SCRIPTS = ROOT / "scripts"
