"""Read the general registers in one native call: the interpreter engine does it at every hit.

Unicorn's Python `reg_read` costs several microseconds per register (24 per hit); `uc_reg_read_batch` with
arrays prepared once reads them all in one ctypes call.

Runs on the CPU thread, at a hit.
"""

from __future__ import annotations

from unicorn import Uc

from ...arch import amd64
from ...machine.cpu import REGISTER_IDS
from ...uc_native import RegisterBatch


class RegisterReader:
    def __init__(self, names: tuple[str, ...] = tuple(r.name for r in amd64.GENERAL_REGISTERS)) -> None:
        self._batch = RegisterBatch(tuple(REGISTER_IDS[name] for name in names))

    def read(self, uc: Uc) -> list[int]:
        return self._batch.read(uc)
