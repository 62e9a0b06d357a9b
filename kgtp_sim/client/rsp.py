"""A debugger's side of the Remote Serial Protocol over a socket, built on the sans-IO codec (kgtp_sim/rsp/codec.py).

For what GDB never sends (hostile packets, raw framing), and for clients that need no GDB (the soak's sampler).
Request and reply, one at a time, on the caller's thread; every wait is for bytes from the stub, bounded by the
socket's timeout.

Acknowledgements follow GDB: in ack mode each packet received is acknowledged with `+`, sent in front of the next
packet (GDB's first byte on a new connection is a `+` too); `no_ack_mode` negotiates QStartNoAckMode.
"""

from __future__ import annotations

import socket
import time
from collections import deque

from ..rsp.codec import Decoder, EventKind, encode_packet
from .stub import StubProcess


class RspError(RuntimeError):
    """The stub answered with an error, or with something the protocol does not allow there."""


def console_text(payload: bytes) -> str | None:
    """The text of a console output packet (`O` + hex, as `monitor` commands answer), None for any other packet."""
    if not payload.startswith(b"O") or payload == b"OK":
        return None
    try:
        return bytes.fromhex(payload[1:].decode()).decode("utf-8", "replace")
    except ValueError:
        return None


class RspClient:
    """One debugger connection to the stub. Use as a context manager; `sock` is there for raw reads and writes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.decoder = Decoder()
        self.ack_mode = True
        self._packets: deque[bytes] = deque()
        self._acks: deque[bool] = deque()  # `+` (True) and `-` (False) from the stub since the last packet sent
        self._owed_acks = 0

    @classmethod
    def connect(cls, port: int, *, host: str = "127.0.0.1", timeout: float = 10) -> RspClient:
        """A plain connection: nothing is sent, so the caller sees whatever the stub does first."""
        return cls(socket.create_connection((host, port), timeout=timeout))

    @classmethod
    def connect_when_free(cls, stub: StubProcess, timeout: float = 10) -> RspClient:
        """A connection that got past qSupported, retrying while the stub's one debugger slot is still held (often
        by the GDB of the previous test or step, which has quit but not yet been let go)."""
        deadline = time.monotonic() + timeout
        while True:
            client = cls.connect(stub.port, timeout=timeout)
            try:
                reply = client.request(b"qSupported")
            except (ConnectionError, OSError) as error:  # refused: the stub hung up
                reply = repr(error).encode()
            if b"PacketSize=" in reply:
                return client
            client.close()
            if time.monotonic() >= deadline:
                raise RspError(f"the stub kept refusing a debugger: {reply[:200]!r}")
            time.sleep(0.05)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> RspClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- bytes out -----------------------------------------------------------------------------------------------

    def send(self, payload: bytes, *, binary: bool = False) -> None:
        """Frame and send one packet (escaped when `binary`), after the acks owed for packets received."""
        self._acks.clear()
        self.sock.sendall(b"+" * self._owed_acks + encode_packet(payload, binary=binary))
        self._owed_acks = 0

    def send_raw(self, data: bytes) -> None:
        """Bytes exactly as given: damaged framing, a Ctrl-C (0x03), half a packet."""
        self._acks.clear()
        self.sock.sendall(data)

    # ---- bytes in ------------------------------------------------------------------------------------------------

    def _receive(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the stub closed the connection")
        for event in self.decoder.feed(data):
            if event.kind is EventKind.PACKET:
                self._packets.append(event.payload)
            elif event.kind in (EventKind.ACK, EventKind.NACK):
                self._acks.append(event.kind is EventKind.ACK)

    def packet(self) -> bytes:
        """The next packet from the stub (owed an ack in ack mode). ConnectionError if the stub hangs up first."""
        while not self._packets:
            self._receive()
        if self.ack_mode:
            self._owed_acks += 1
        return self._packets.popleft()

    def acknowledged(self) -> bool:
        """Wait for the stub's ack of what was sent last: True for `+`, False for `-` (send it again). Only in ack
        mode; the `+` comes once the stub has acted on a packet that has no immediate answer, such as `c`."""
        while not self._acks:
            self._receive()
        return self._acks.popleft()

    def answer(self) -> list[bytes]:
        """Every packet of one answer: the console output packets (`O` + hex), then the final reply."""
        packets = [self.packet()]
        while console_text(packets[-1]) is not None:
            packets.append(self.packet())
        return packets

    # ---- requests ------------------------------------------------------------------------------------------------

    def exchange(self, payload: bytes, *, binary: bool = False) -> list[bytes]:
        """Send one packet, return every packet of the answer: console output packets, then the final reply."""
        self.send(payload, binary=binary)
        return self.answer()

    def request(self, payload: bytes, *, binary: bool = False) -> bytes:
        """Send one packet, return the final reply (console output before it is dropped)."""
        return self.exchange(payload, binary=binary)[-1]

    def monitor(self, line: bytes | str) -> str:
        """`monitor LINE` as GDB sends it (qRcmd with the line in hex); returns the console text. RspError unless
        the stub ends the answer with OK."""
        raw = line.encode() if isinstance(line, str) else line
        packets = self.exchange(b"qRcmd," + raw.hex().encode())
        if packets[-1] != b"OK":
            raise RspError(f"monitor {raw[:60]!r}: {packets[-1][:200]!r}")
        return "".join(console_text(p) or "" for p in packets[:-1])

    def read_memory(self, address: int, length: int) -> bytes:
        """`m` of `length` bytes at `address`; RspError if the stub answers with an error."""
        reply = self.request(b"m%x,%x" % (address, length))
        try:
            if reply.startswith(b"E"):
                raise ValueError
            return bytes.fromhex(reply.decode())
        except ValueError:
            raise RspError(f"m{address:x},{length:x}: {reply[:200]!r}") from None

    def read_u64(self, address: int) -> int:
        """A little-endian 64-bit value of kernel memory (`jiffies`, a counter)."""
        data = self.read_memory(address, 8)
        if len(data) != 8:
            raise RspError(f"m{address:x},8 answered {len(data)} bytes")
        return int.from_bytes(data, "little")

    def no_ack_mode(self) -> None:
        """QStartNoAckMode, as GDB negotiates it: the stub's OK is still acknowledged, then neither side acks."""
        reply = self.request(b"QStartNoAckMode")
        if reply != b"OK":
            raise RspError(f"QStartNoAckMode: {reply[:200]!r}")
        self.sock.sendall(b"+" * self._owed_acks)
        self._owed_acks = 0
        self.ack_mode = False
