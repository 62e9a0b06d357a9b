"""The dispatch table: packet prefix -> parser -> handler, built from what is implemented.

Handlers are methods marked with `@handles(PacketClass)` on any number of handler objects (one per family).
The table, and therefore qSupported, is derived from those marks: nothing is advertised that has no handler,
and no handler exists that the table does not reach.

Thread: the table is built once, where the stub is assembled (app.py: the main thread of `kgtp-sim serve`, or a
tool's or test's); `dispatch`, and through it every handler, runs on the server thread (`RspServer`, inside
`Session.receive`), or on the thread of the fuzz harness or test that feeds a session in its place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .packets.base import Packet, PacketError
from .packets.connect import QSupported

log = logging.getLogger(__name__)

P = TypeVar("P", bound=Packet)
#: GDB may send packets up to this size; a QTDP with a long condition is the largest it builds.
PACKET_SIZE = 0x4000


class RspError(Exception):
    """A request that is well-formed but cannot be served: answered `E<code>` (or `E.<text>` when asked)."""

    def __init__(self, code: int, message: str, *, text: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.text = text  # reply `E.<message>`: GDB prints it ("Bogus reply from target: E.…") where it can


# Error numbers used across handlers; GDB only shows them, so they are stable and documented here.
E_BAD_PACKET = 0x01
E_MEMORY = 0x02
E_PERMISSION = 0x03
E_TRACE = 0x04
E_INTERNAL = 0x0F


@dataclass(frozen=True)
class Binary:
    """A reply whose payload is raw bytes, escaped on the wire (qXfer data; qTBuffer is hex, not this)."""

    data: bytes


@dataclass(frozen=True)
class WithOutput:
    """Console text (sent first as `O<hex>` packets) followed by the final reply: `monitor` output."""

    text: str
    final: bytes = b"OK"


@dataclass(frozen=True)
class Deferred:
    """No reply now: `c` waits for the user's Ctrl-C, which the session answers with a stop reply."""


@dataclass(frozen=True)
class NoReply:
    """Nothing is sent back (the packet is acknowledged, in ack mode): `R`, as gdbserver answers it."""


Reply = bytes | Binary | WithOutput | Deferred | NoReply
Handler = Callable[[Any], Reply]


def handles(packet_class: type[P]) -> Callable[[Callable[[Any, P], Reply]], Callable[[Any, P], Reply]]:
    """Mark a method as the handler of `packet_class`."""

    def mark(method: Callable[[Any, P], Reply]) -> Callable[[Any, P], Reply]:
        method._handles = packet_class  # type: ignore[attr-defined]
        return method

    return mark


@dataclass
class Dispatcher:
    """Routes decoded payloads to handlers; the one place where errors become `E..` replies."""

    handler_objects: tuple[object, ...]
    #: features announced in qSupported that no packet stands for (stop reply parts, such as `swbreak+`)
    extra_features: tuple[str, ...] = ()
    #: told GDB's own qSupported features at each qSupported (what the session may then use, e.g. multiprocess+)
    on_supported: Callable[[tuple[str, ...]], None] | None = None
    table: dict[type[Packet], Handler] = field(init=False)
    _prefixes: dict[int, list[type[Packet]]] = field(init=False)
    errors: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.table = {}
        for obj in (self, *self.handler_objects):
            for name in dir(type(obj)):
                packet_class = getattr(getattr(type(obj), name), "_handles", None)
                if packet_class is None:
                    continue
                if packet_class in self.table:
                    raise ValueError(f"two handlers for {packet_class.__name__}")
                self.table[packet_class] = getattr(obj, name)
        self._prefixes = {}
        for packet_class in sorted(self.table, key=lambda c: len(c.PREFIX), reverse=True):
            self._prefixes.setdefault(packet_class.PREFIX[0], []).append(packet_class)

    def supported_features(self) -> list[str]:
        features = [f"PacketSize={PACKET_SIZE:x}", *self.extra_features]
        for packet_class in self.table:
            for feature in packet_class.FEATURES:
                if feature not in features:
                    features.append(feature)
        return features

    @handles(QSupported)
    def _supported(self, packet: QSupported) -> Reply:
        if self.on_supported is not None:
            self.on_supported(packet.gdb_features)
        return ";".join(self.supported_features()).encode()

    def lookup(self, payload: bytes) -> tuple[type[Packet], bytes] | None:
        for packet_class in self._prefixes.get(payload[0], ()) if payload else ():
            prefix = packet_class.PREFIX
            if payload.startswith(prefix):
                body = payload[len(prefix) :]
                if packet_class.EXACT and body:
                    continue
                return packet_class, body
        return None

    def dispatch(self, payload: bytes) -> Reply:
        """Answer one packet. Never raises: unknown -> empty reply, malformed -> E01 (or the packet's own
        `MALFORMED`), failure -> E.."""
        found = self.lookup(payload)
        if found is None:
            return b""
        packet_class, body = found
        try:
            packet = packet_class.parse(body)
            return self.table[packet_class](packet)
        except PacketError as error:
            self.errors += 1
            log.info("malformed %s: %s", packet_class.__name__, error)
            return packet_class.MALFORMED or b"E%02x" % E_BAD_PACKET
        except RspError as error:
            log.info("%s refused: %s", packet_class.__name__, error.message)
            if error.text:  # '$' and '#' frame packets, '*' repeats the byte before it (GDB's read_frame expands
                # it in any packet) and GDB unescapes no `E.` text: they are left out
                text = error.message.encode("utf-8", "replace")
                return b"E." + text.replace(b"$", b"").replace(b"#", b"").replace(b"*", b"")
            return b"E%02x" % error.code
        except Exception:  # the single guard: a bug in one handler must not take the server or kernel down
            self.errors += 1
            log.exception("handler for %s failed", packet_class.__name__)
            return b"E%02x" % E_INTERNAL
