"""KGTP mode's second inferior: a process of the machine read while everything runs, as KGTP's howto shows ("the
memory of the user space program": `target extended-remote`, `add-inferior`, `inferior 2`, `file PROG`, `attach
PID`, then `print` of the program's variables while it runs on).

KGTP's packets (gtp.c: gtp_gdbrsp_vAttach, gtp_gdbrsp_D): `!` is accepted (extended mode changes nothing for a
target that never stops), `vAttach;PID` names the process whose memory user addresses read from now on
(`KernelTarget.attached_pid`, KGTP's gtp_current_pid) and answers `S05` without stopping it or anything else, a detach
forgets it. `info os processes` lists what can be attached (stub/extended.py: OsdataHandlers).

Runs on the server thread, as every handler.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..rsp.dispatch import Reply, handles
from ..rsp.packets import connect as c
from ..rsp.packets import run as v
from .kernel import KernelTarget


@dataclass
class KernelInferiorHandlers:
    """`!` and `vAttach` of KGTP mode."""

    target: KernelTarget

    @handles(c.ExtendedMode)
    def extended_mode(self, packet: c.ExtendedMode) -> Reply:
        return b"OK"

    @handles(v.VAttach)
    def vattach(self, packet: v.VAttach) -> Reply:
        """KGTP's answer: a SIGTRAP stop of nothing, the process reads from now on, it and the kernel run on."""
        self.target.attach_process(packet.pid)
        return b"S05"
