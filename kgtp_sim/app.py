"""Assembles the stub: machine + its target + handler families + dispatcher + server. The CLI and the tests both
use it.

Thread: a `Stub` is assembled on the thread that starts it (the main thread of `kgtp-sim serve`, a tool's or a
test's); `make_session`, `on_connect` and `on_disconnect` run on the server thread (`RspServer`), and the stop
`on_disconnect` may ask for runs on the CPU thread (`Tracer._between_hits`). The follow server it builds runs
threads of its own (stub/follow.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from dataclasses import dataclass, field

from .machine import Machine
from .rsp.dispatch import Dispatcher
from .rsp.server import RspServer
from .rsp.session import Session, ends_with_the_process
from .stub.core import TargetHandlers
from .stub.extended import OsdataHandlers
from .stub.inferiors import KernelInferiorHandlers
from .stub.kernel import KernelTarget
from .stub.machine_monitor import register_machine_commands, register_process_command
from .stub.monitor import Monitor
from .stub.ps import Launch, register_process_commands
from .stub.replay import register_replay_commands
from .stub.trace import TraceHandlers, register_trace_commands
from .tracing import Tracer

log = logging.getLogger(__name__)


@dataclass
class StubConfig:
    allow_writes: bool = False
    engine: str = "opt"
    save_dir: Path | None = None  # where `tsave -r` may write; None refuses it
    name_markers_always: bool = False  # diagnostic: answer qTSTMat at strace time too (crashes GDB 13-18)
    launch: Launch | None = None  # `monitor run`: starts a program packed before boot (programs.Launcher)


@dataclass
class Stub:
    """Everything one running stub owns; sessions come and go, the stub and its kernel stay."""

    machine: Machine
    config: StubConfig = field(default_factory=StubConfig)
    started: float = field(init=False, default_factory=time.monotonic)

    def __post_init__(self) -> None:
        # KGTP mode's target: the kernel, with the trace frame or replay GDB selects laid over it.
        self.target = KernelTarget(self.machine, self.config.allow_writes)
        self.handlers = TargetHandlers(self.target)
        self.monitor = Monitor()
        register_machine_commands(self.monitor, self.machine, self.started)
        register_process_command(self.monitor, self.target)
        register_process_commands(self.monitor, self.machine, self.config.launch)
        self.tracer = Tracer(self.machine, self.config.engine)
        self.target.refuses_breakpoint = self.tracer.refuses_breakpoint  # breakpoints the trace run lets work
        register_trace_commands(self.monitor, self.tracer)
        overlay = self.target.overlay
        self.trace = TraceHandlers(self.tracer, overlay, self.config.save_dir, self.config.name_markers_always)
        register_replay_commands(self.monitor, self.trace, overlay, self.machine.image)
        self.dispatcher = Dispatcher((*self.handlers.families, KernelInferiorHandlers(self.target),
                                      OsdataHandlers(self.machine), self.trace, self.monitor))

    def make_session(self) -> Session:
        return Session(self.dispatcher, stop_reply=self.handlers.stop_reply, async_stop=self.handlers.pending_stop,
                       ends_session=self._ends_session)

    def _ends_session(self, payload: bytes, reply) -> bool:
        """As a one-process target's, except the detach of an attached process (GDB's second inferior): the
        kernel's session goes on."""
        if payload[:1] == b"D" and self.target.detached_process:
            self.target.detached_process = False
            return False
        return ends_with_the_process(payload, reply)

    def on_connect(self) -> None:
        self.trace.forget_session()
        self.handlers.forget_session()

    def on_disconnect(self) -> None:
        """GDB sends nothing when it leaves: its breakpoints go and the kernel runs (a GDB that left while the
        machine was stopped must not leave it stopped); tracing stops unless disconnected tracing was asked for."""
        self.target.release()
        self.trace.forget_session()
        self.handlers.forget_session()
        if self.tracer.running and not self.tracer.definitions.disconnected_tracing:
            from .rsp.packets.trace import StopReason

            self.tracer.stop(StopReason.DISCONNECTED)

    def server(self, host: str, port: int) -> RspServer:
        """The transport (TCP, or `serve_pipe`); a breakpoint that stops the machine wakes it to send the stop."""
        server = RspServer(self.make_session, host, port, on_connect=self.on_connect,
                           on_disconnect=self.on_disconnect)
        self.target.notify_stops(server.wake)
        return server

    def follow_server(self, host: str, port: int):
        """The read-only follow channel beside the RSP port (kgtp_sim/stub/follow.py)."""
        from .stub.follow import FollowServer

        return FollowServer(self.tracer, host, port)
