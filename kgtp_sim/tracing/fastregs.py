"""Read the general registers in one native call: the interpreter engine does it at every hit.

Unicorn's Python `reg_read` costs several microseconds per register (24 per hit); `uc_reg_read_batch` with
arrays prepared once reads them all in one ctypes call.
"""

from __future__ import annotations

import ctypes

from unicorn import Uc
from unicorn.unicorn_py3.unicorn import uclib

from ..arch import amd64
from ..machine.cpu import REGISTER_IDS


class RegisterReader:
    def __init__(self, names: tuple[str, ...] = tuple(r.name for r in amd64.GENERAL_REGISTERS)) -> None:
        count = len(names)
        self._count = count
        self._ids = (ctypes.c_int * count)(*(REGISTER_IDS[name] for name in names))
        self._values = (ctypes.c_uint64 * count)()
        base = ctypes.addressof(self._values)
        self._pointers = (ctypes.c_void_p * count)(*(base + 8 * i for i in range(count)))

    def read(self, uc: Uc) -> list[int]:
        status = uclib.uc_reg_read_batch(uc._uch, self._ids, self._pointers, self._count)
        if status:
            raise RuntimeError(f"uc_reg_read_batch failed: {status}")
        return list(self._values)
