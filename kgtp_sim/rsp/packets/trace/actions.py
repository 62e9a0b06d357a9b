"""The wire form of tracepoint actions (the `action...` part of `QTDP:-` and of the `A`/`S` upload pieces) and
of an agent expression `X<len>,<bytecode>` (also a QTDP condition).

The actions themselves (CollectRegisters, CollectMemory, EvalExpression, CollectStaticData) are the tracer's
words (kgtp_sim/tracing/core/model.py); this module reads and writes their wire form as collection_list::stringify
prints it. `R` masks arrive most significant byte first, two digits a byte, leading zero bytes dropped; `M`
offsets are printed with phex_nz, so a negative frame offset arrives as its 64-bit two's complement.

Thread: the server thread (`RspServer`), where the dispatcher parses the action packets and the upload handlers
(kgtp_sim/stub/trace.py) encode their pieces.
"""

from __future__ import annotations

from collections.abc import Iterable

from ....tracing.core.model import Action, CollectMemory, CollectRegisters, CollectStaticData, EvalExpression
from ..base import U64_MASK, PacketError, parse_hex, parse_signed_hex
from .wire import _INT_BITS, _hex_run_end, _unhex

#: A register mask wider than this is not a mask GDB could build (it has a few hundred registers at most).
MAX_REGISTER_MASK_BYTES = 128


def _parse_agent_expr(text: bytes, start: int, what: str) -> tuple[bytes, int]:
    """`X<hex len>,<2*len hex digits>` starting at text[start] == 'X'; returns the bytecode and the end."""
    comma = text.find(b",", start + 1)
    if comma < 0:
        raise PacketError(f"{what}: expected X<length>,<bytecode>")
    length = parse_hex(text[start + 1 : comma], f"{what} length", bits=_INT_BITS)
    if length == 0:
        raise PacketError(f"{what}: empty agent expression")
    end = comma + 1 + 2 * length
    if end > len(text):
        raise PacketError(f"{what}: truncated bytecode ({length:#x} bytes announced)")
    return _unhex(text[comma + 1 : end], f"{what} bytecode"), end


def parse_actions(text: bytes) -> tuple[Action, ...]:
    """Split a run of concatenated actions (GDB packs several `M` and `X` into one packet)."""
    actions: list[Action] = []
    i = 0
    while i < len(text):
        letter = text[i : i + 1]
        if letter == b"R":
            end = _hex_run_end(text, i + 1)
            digits = text[i + 1 : end]
            if not digits or len(digits) % 2 or len(digits) > 2 * MAX_REGISTER_MASK_BYTES:
                raise PacketError("R: register mask must be whole hex bytes")
            actions.append(CollectRegisters(int(digits, 16)))
            i = end
        elif letter == b"M":
            comma1 = text.find(b",", i + 1)
            comma2 = text.find(b",", comma1 + 1) if comma1 >= 0 else -1
            if comma2 < 0:
                raise PacketError("M: expected M<basereg>,<offset>,<length>")
            basereg = parse_signed_hex(text[i + 1 : comma1], "M base register", bits=_INT_BITS)
            if basereg < -1:
                raise PacketError("M: base register must be a register number or -1")
            end = _hex_run_end(text, comma2 + 1)
            offset = parse_hex(text[comma1 + 1 : comma2], "M offset")
            actions.append(CollectMemory(basereg, offset, parse_hex(text[comma2 + 1 : end], "M length")))
            i = end
        elif letter == b"X":
            bytecode, i = _parse_agent_expr(text, i, "X")
            actions.append(EvalExpression(bytecode))
        elif letter == b"L":
            actions.append(CollectStaticData())
            i += 1
        else:
            raise PacketError(f"unknown tracepoint action {letter!r}")
    return tuple(actions)


def encode_action(action: Action) -> bytes:
    """One action exactly as collection_list::stringify prints it."""
    match action:
        case CollectRegisters(mask):
            return b"R" + mask.to_bytes(max(1, (mask.bit_length() + 7) // 8), "big").hex().encode()
        case CollectMemory(basereg, offset, length):
            base = b"-1" if basereg == -1 else b"%X" % basereg
            return b"M%s,%x,%X" % (base, offset & U64_MASK, length)
        case EvalExpression(bytecode):
            return b"X%08X," % len(bytecode) + bytecode.hex().encode()
        case CollectStaticData():
            return b"L"
    raise TypeError(f"not a tracepoint action: {action!r}")


def encode_actions(actions: Iterable[Action]) -> bytes:
    return b"".join(encode_action(a) for a in actions)
