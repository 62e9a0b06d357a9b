"""A plain in-memory `AgentContext`: sparse memory regions, a register list, TSVs, a bounded trace buffer.

Tests use it directly; the tracing layer can use it as a model of what one hit sees (it mirrors what compiled
code gets through `agent_ctx`, so both can be compared byte for byte).

Thread: the caller's (tests and `agent.measure`); the tracer's hits bring their own context
(kgtp_sim/tracing/engines/hits.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import UnreadableMemory


@dataclass
class SimpleContext:
    regions: list[tuple[int, bytearray]] = field(default_factory=list)
    registers: list[int] = field(default_factory=lambda: [0] * 24)
    tsvs: dict[int, int] = field(default_factory=dict)
    trace_limit: int | None = None
    trace: bytearray = field(default_factory=bytearray)
    output: list[str] = field(default_factory=list)

    def map(self, address: int, data: bytes) -> None:
        self.regions.append((address, bytearray(data)))

    def read_memory(self, addr: int, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            cur = addr + len(out)
            for start, buf in self.regions:
                if start <= cur < start + len(buf):
                    take = min(n - len(out), start + len(buf) - cur)
                    out += buf[cur - start : cur - start + take]
                    break
            else:
                raise UnreadableMemory(cur, n - len(out))
        return bytes(out)

    def register(self, n: int) -> int:
        return self.registers[n]

    def tsv_get(self, n: int) -> int:
        return self.tsvs.get(n, 0) & (2**64 - 1)

    def tsv_set(self, n: int, value: int) -> None:
        self.tsvs[n] = value & (2**64 - 1)

    def trace_room(self) -> int | None:
        return None if self.trace_limit is None else self.trace_limit - len(self.trace)

    def trace_block(self, block: bytes) -> None:
        self.trace += block

    def printf(self, text: str) -> None:
        self.output.append(text)
