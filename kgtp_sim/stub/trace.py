"""Tracepoint packets: definitions, run control, status, frame selection and the trace buffer upload.

Translation between the wire (`kgtp_sim/rsp/packets/trace/`) and the tracer (`kgtp_sim/tracing`): each handler
turns a packet into calls on `TracerApi` and the answer into a reply. The frame cursor (`tfind`), the gating of
`qTSTMat` and the upload sequences (`qTfP`/`qTsP`, `qTfV`/`qTsV`, `qTfSTM`/`qTsSTM`) are this module's own
state, one debugger's worth. Runs on the server thread.
"""

from __future__ import annotations

import logging
from pathlib import Path
from dataclasses import dataclass, field, replace

from ..rsp.dispatch import E_TRACE, Binary, Reply, RspError, handles
from ..rsp.packets import trace as t
from ..tracing import TraceError
from ..tracing.api import TracerApi
from ..tracing.core.builtins import CPU_ID
from ..arch import amd64
from ..tracing.core.frames import FrameView, TraceFrame
from ..tracing.core.tfile import SavePathError, resolve_save_path, write_tfile
from ..agent.opcodes import renumber_variables
from ..tracing.core.model import Definitions, EvalExpression, VariableSpec
from .overlay import FrameOverlay
from .variables import VariableNumbers

log = logging.getLogger(__name__)

#: qTMinFTPILen: the shortest instruction a fast tracepoint may replace (a 5-byte jump, as gdbserver on amd64).
MIN_FAST_TRACEPOINT_LENGTH = 5


@dataclass
class TraceHandlers:
    tracer: TracerApi
    views: FrameOverlay
    save_dir: Path | None = None
    name_markers_always: bool = False  # diagnostic only: reproduces the GDB client crash (see marker_at)
    #: the register file GDB reads when it is not KGTP's (the gdbserver role's process: arch/amd64.LINUX): trace
    #: frames' `R` blocks, in qTBuffer and tsave -r files, are one `g` packet's bytes of it, and a tsave -r file
    #: carries its description
    layout: amd64.RegisterLayout | None = None
    #: GDB's variable numbers where they are not the tracer's (the gdbserver role: stub/variables.py); None: the
    #: same numbers (KGTP mode, and the role with --kgtp-variables)
    numbers: VariableNumbers | None = None
    _upload: list[bytes] = field(default_factory=list)
    _variables: list[bytes] = field(default_factory=list)
    _frames: list[TraceFrame] | None = None
    _selected: int | None = None
    _downloading: bool = False  # between QTinit and QTStart: qTSTMat names markers only then (see below)
    _markers: list[bytes] = field(default_factory=list)
    _renumbered: set[tuple[int, int]] = field(default_factory=set)  # tracepoints whose bytecode has the tracer's

    def forget_session(self) -> None:
        """A debugger came or went: what one GDB selected or was downloading is not the next one's. A new GDB
        believes no frame is selected (tfind searches start after the selected one) and no download is under
        way (qTSTMat must not name markers at strace time, see marker_at)."""
        self._select(None)
        self.views.end_replay()
        self._downloading = False

    # ---- definitions ----------------------------------------------------------------------------------------

    @handles(t.TraceInit)
    def trace_init(self, packet: t.TraceInit) -> Reply:
        if self.tracer.running:
            self.tracer.stop(t.StopReason.STOP_COMMAND)
        self.tracer.definitions.clear_tracepoints()
        self._renumbered.clear()
        self._select(None)
        self.views.end_replay()
        self._downloading = True
        return b"OK"

    @handles(t.DefineTracepoint)
    def define_tracepoint(self, packet: t.DefineTracepoint) -> Reply:
        tracepoint = self.tracer.definitions.define(packet)
        if not packet.more:
            self._arm_if_running(tracepoint)
        return b"OK"

    @handles(t.TracepointActions)
    def tracepoint_actions(self, packet: t.TracepointActions) -> Reply:
        try:
            tracepoint = self.tracer.definitions.add_actions(packet)
        except KeyError as error:
            raise RspError(E_TRACE, str(error)) from None
        if not packet.more:
            self._arm_if_running(tracepoint)
        return b"OK"

    def _arm_if_running(self, tracepoint) -> None:
        """InstallInTrace: a tracepoint GDB downloads during a run goes live once its last piece arrived."""
        if self.tracer.running:
            self._renumber(tracepoint)
        try:
            self.tracer.arm(tracepoint)
        except TraceError as error:
            raise RspError(E_TRACE, str(error), text=True) from None

    @handles(t.EnableTracepoint)
    def enable_tracepoint(self, packet: t.EnableTracepoint) -> Reply:
        tracepoint = self._location(packet.number, packet.address)
        tracepoint.enabled = True
        self._arm_if_running(tracepoint)
        return b"OK"

    @handles(t.DisableTracepoint)
    def disable_tracepoint(self, packet: t.DisableTracepoint) -> Reply:
        tracepoint = self._location(packet.number, packet.address)
        tracepoint.enabled = False
        self.tracer.disarm(tracepoint.key)
        return b"OK"

    def _location(self, number: int, address: int):
        tracepoint = self.tracer.definitions.tracepoints.get((number, address))
        if tracepoint is None:
            raise RspError(E_TRACE, f"no tracepoint {number} at {address:#x}")
        return tracepoint

    @handles(t.TracepointSource)
    def tracepoint_source(self, packet: t.TracepointSource) -> Reply:
        try:
            self.tracer.definitions.add_source(packet)
        except KeyError as error:
            raise RspError(E_TRACE, str(error)) from None
        return b"OK"

    @handles(t.DefineTraceVariable)
    def define_variable(self, packet: t.DefineTraceVariable) -> Reply:
        try:
            self.tracer.check_variable(packet.name)  # KGTP's per-CPU forms: no copy of a missing CPU
        except ValueError as error:
            raise RspError(E_TRACE, str(error)) from None
        spec: VariableSpec = packet
        if self.numbers is not None:
            spec = VariableSpec(self.numbers.declare(packet.number, packet.name), packet.value, packet.builtin,
                                packet.name)
        self.tracer.definitions.define_variable(spec)
        return b"OK"

    # ---- GDB's variable numbers and the tracer's (self.numbers) ------------------------------------------------

    def _renumber(self, tracepoint) -> None:
        """A tracepoint's bytecode in the tracer's numbers (once: GDB's at download, the tracer's from now on)."""
        if self.numbers is None or tracepoint.key in self._renumbered:
            return
        self._renumbered.add(tracepoint.key)
        tracepoint.condition, tracepoint.actions, tracepoint.stepping_actions = _renumbered(
            tracepoint, self.numbers.tracer)

    def _wire_pieces(self) -> list[bytes]:
        """qTfP's pieces in GDB's numbers."""
        definitions = self.tracer.definitions
        if self.numbers is None or not self._renumbered:
            return upload_pieces(definitions)
        numbers = self.numbers

        def back(number: int) -> int:
            wire = numbers.wire(number)
            return number if wire is None else wire

        shown = Definitions(read_only=definitions.read_only)
        for key, tracepoint in definitions.tracepoints.items():
            if key in self._renumbered:
                condition, actions, stepping = _renumbered(tracepoint, back)
                tracepoint = replace(tracepoint, condition=condition, actions=actions, stepping_actions=stepping)
            shown.tracepoints[key] = tracepoint
        return upload_pieces(shown)

    def _wire_variables(self) -> list[bytes]:
        """qTfV's replies in GDB's numbers: only the variables GDB has a number for, where they differ."""
        definitions = self.tracer.definitions
        if self.numbers is None:
            return upload_variables(definitions, newest_first=self.tracer.gdbserver)
        shown = Definitions()
        for number, wire in self.numbers.uploaded(definitions.variables):
            variable = definitions.variables[number]
            shown.variables[wire] = replace(variable, number=wire)
        return upload_variables(shown, newest_first=self.tracer.gdbserver)

    def _wire_frame(self, frame: TraceFrame, size: int) -> bytes:
        """A frame as qTBuffer and tsave -r give it, its variables in GDB's numbers."""
        return self.tracer.saved_frame(frame, size, renumber=None if self.numbers is None else self.numbers.wire)

    @handles(t.ReadOnlyRegions)
    def read_only_regions(self, packet: t.ReadOnlyRegions) -> Reply:
        self.tracer.definitions.read_only = list(packet.regions)
        return b"OK"

    @handles(t.SetDisconnectedTracing)
    def disconnected_tracing(self, packet: t.SetDisconnectedTracing) -> Reply:
        self.tracer.definitions.disconnected_tracing = packet.keep_tracing
        return b"OK"

    @handles(t.SetCircularBuffer)
    def circular_buffer(self, packet: t.SetCircularBuffer) -> Reply:
        self.tracer.set_circular(packet.circular)
        return b"OK"

    @handles(t.SetTraceBufferSize)
    def buffer_size(self, packet: t.SetTraceBufferSize) -> Reply:
        """The tracer's rules (KGTP's per-CPU rings, or gdbserver's one buffer: `Tracer.set_buffer_size`); a
        buffer made anew has no frame for GDB to be looking at."""
        try:
            emptied = self.tracer.set_buffer_size(packet.size)
        except TraceError as error:
            raise RspError(E_TRACE, str(error)) from None
        if emptied:
            self._select(None)
        return b"OK"

    @handles(t.SetTraceNotes)
    def trace_notes(self, packet: t.SetTraceNotes) -> Reply:
        definitions = self.tracer.definitions
        if packet.user is not None:
            definitions.user = packet.user
        if packet.notes is not None:
            definitions.notes = packet.notes
        if packet.stop_note is not None:
            self.tracer.set_stop_note(packet.stop_note)
        return b"OK"

    # ---- run control ----------------------------------------------------------------------------------------

    @handles(t.TraceStart)
    def trace_start(self, packet: t.TraceStart) -> Reply:
        self._select(None)
        self.views.end_replay()
        self._downloading = False
        for tracepoint in self.tracer.definitions.tracepoints.values():  # GDB has sent every variable by now
            self._renumber(tracepoint)
        try:
            self.tracer.start()
        except TraceError as error:
            raise RspError(E_TRACE, str(error), text=True) from None
        return b"OK"

    @handles(t.TraceStop)
    def trace_stop(self, packet: t.TraceStop) -> Reply:
        # Never the short `tstop:0` form: GDB's tfile writer (tsave) then strlen()s a NULL note and crashes.
        self.tracer.stop(t.StopReason.STOP_COMMAND, note=self.tracer.definitions.stop_note or "")
        return b"OK"

    @handles(t.QueryTraceStatus)
    def trace_status(self, packet: t.QueryTraceStatus) -> Reply:
        return t.encode_trace_status(self.tracer.status())

    @handles(t.QueryTracepointStatus)
    def tracepoint_status(self, packet: t.QueryTracepointStatus) -> Reply:
        found = self.tracer.location_status(packet.number, packet.address)
        if found is None:
            return b""
        return t.encode_tracepoint_status(*found)

    @handles(t.QueryMinFastTracepointLength)
    def min_fast_tracepoint_length(self, packet: t.QueryMinFastTracepointLength) -> Reply:
        return t.encode_min_fast_tracepoint_length(MIN_FAST_TRACEPOINT_LENGTH)

    # ---- upload (a reconnecting GDB learns what is defined) --------------------------------------------------

    @handles(t.FirstTracepointPiece)
    def first_tracepoint_piece(self, packet: t.FirstTracepointPiece) -> Reply:
        self._upload = self._wire_pieces()
        return self._next_piece(self._upload)

    @handles(t.NextTracepointPiece)
    def next_tracepoint_piece(self, packet: t.NextTracepointPiece) -> Reply:
        return self._next_piece(self._upload)

    @handles(t.FirstTraceVariable)
    def first_variable(self, packet: t.FirstTraceVariable) -> Reply:
        self._variables = self._wire_variables()
        return self._next_piece(self._variables)

    @handles(t.NextTraceVariable)
    def next_variable(self, packet: t.NextTraceVariable) -> Reply:
        return self._next_piece(self._variables)

    @staticmethod
    def _next_piece(pieces: list[bytes]) -> Reply:
        return pieces.pop(0) if pieces else b"l"

    @handles(t.QueryTraceVariable)
    def variable_value(self, packet: t.QueryTraceVariable) -> Reply:
        number = packet.number
        if self.numbers is not None:
            number = self.numbers.known(packet.number)
            if number is None:  # a variable GDB never declared: unknown, as gdbserver answers one it lacks
                return t.encode_trace_variable_value(None)
        replay = self.views.replay
        if replay is not None or (self._selected is not None and self._frames is not None):
            frame = replay.frame if replay is not None else self._frames[self._selected]  # type: ignore[index]
            # a frame may hold a variable twice (`collect $v += 1` traces it when read and when set): KGTP
            # answers the first (gtp_rb_traceframe_get_tv), gdbserver the last (traceframe_read_tsv)
            values = [value for tracer, value in frame.tsv_values() if tracer == number]
            if values:
                return t.encode_trace_variable_value(values[-1] if self.tracer.gdbserver else values[0])
            if number == CPU_ID:  # KGTP answers $cpu_id from the frame itself (gtp_rb_traceframe_get_tv)
                return t.encode_trace_variable_value(frame.cpu)
            return t.encode_trace_variable_value(None)
        return t.encode_trace_variable_value(self.tracer.variable_value(number))

    # ---- frames ----------------------------------------------------------------------------------------------

    def _frame_list(self) -> list[TraceFrame]:
        if self._frames is None:
            self._frames = self.tracer.frames()
        return self._frames

    def _select(self, index: int | None) -> Reply:
        if index is None:
            self._selected = None
            self._frames = None
            self.views.current = None
            return b"OK"
        frames = self._frame_list()
        frame = frames[index]
        self._selected = index
        address = next(
            (a for (n, a) in self.tracer.definitions.tracepoints if n == frame.tracepoint),
            frame.registers["rip"] if frame.registers else 0,
        )
        self.views.current = FrameView(frame, address, self.views.live, list(self.tracer.definitions.read_only))
        return t.encode_frame_reply(index, frame.tracepoint)

    def _find(self, predicate) -> Reply:
        frames = self._frame_list()
        start = 0 if self._selected is None else self._selected + 1
        for index in range(start, len(frames)):
            if predicate(frames[index], self._frame_pc(frames[index])):
                return self._select(index)
        return t.encode_frame_reply(None)

    def _frame_pc(self, frame: TraceFrame) -> int:
        regs = frame.registers
        if regs is not None:
            return regs["rip"]
        return next((a for (n, a) in self.tracer.definitions.tracepoints if n == frame.tracepoint), 0)

    @handles(t.SelectTraceFrame)
    def select_frame(self, packet: t.SelectTraceFrame) -> Reply:
        if packet.frame is None:
            return self._select(None)
        frames = self._frame_list()
        if packet.frame >= len(frames):
            return t.encode_frame_reply(None)
        return self._select(packet.frame)

    @handles(t.FindFrameByPc)
    def find_by_pc(self, packet: t.FindFrameByPc) -> Reply:
        return self._find(lambda frame, pc: pc == packet.address)

    @handles(t.FindFrameByTracepoint)
    def find_by_tracepoint(self, packet: t.FindFrameByTracepoint) -> Reply:
        return self._find(lambda frame, pc: frame.tracepoint == packet.number)

    @handles(t.FindFrameInRange)
    def find_in_range(self, packet: t.FindFrameInRange) -> Reply:
        return self._find(lambda frame, pc: packet.start <= pc <= packet.end)

    @handles(t.FindFrameOutsideRange)
    def find_outside_range(self, packet: t.FindFrameOutsideRange) -> Reply:
        return self._find(lambda frame, pc: not packet.start <= pc <= packet.end)

    @handles(t.ReadTraceFrameInfo)
    def traceframe_info(self, packet: t.ReadTraceFrameInfo) -> Reply:
        if self._selected is None or self._frames is None:
            raise RspError(E_TRACE, "no trace frame selected")
        frame = self._frames[self._selected]
        numbers = frame.tsv_numbers()
        if self.numbers is not None:
            numbers = [wire for _tracer, wire in self.numbers.uploaded(numbers)]
        document = t.encode_traceframe_info(frame.memory_ranges(), numbers)
        return Binary(t.encode_qxfer_chunk(document, packet.offset, packet.length))

    @handles(t.ReadTraceBuffer)
    def trace_buffer(self, packet: t.ReadTraceBuffer) -> Reply:
        data = self._saved_frames() if packet.offset == 0 else self._raw
        self._raw = data
        return t.encode_trace_buffer(data[packet.offset : packet.offset + packet.length])

    _raw: bytes = b""

    def _saved_frames(self) -> bytes:
        size = amd64.G_PACKET_SIZE if self.layout is None else self.layout.size
        return b"".join(self._wire_frame(frame, size) for frame in self.tracer.frames())

    # ---- static tracepoint markers -------------------------------------------------------------------------

    def _static_marker(self, marker) -> t.StaticMarker:
        return t.StaticMarker(marker.site, marker.id, marker.format)

    @handles(t.FirstStaticMarkers)
    def first_markers(self, packet: t.FirstStaticMarkers) -> Reply:
        """One marker per reply: every marker record of the kernel image, nothing hard-coded."""
        self._markers = [t.encode_static_markers([self._static_marker(m)]) for m in self.tracer.markers()]
        return self._next_piece(self._markers)

    @handles(t.NextStaticMarkers)
    def next_markers(self, packet: t.NextStaticMarkers) -> Reply:
        return self._next_piece(self._markers)

    @handles(t.StaticMarkerAt)
    def marker_at(self, packet: t.StaticMarkerAt) -> Reply:
        """Name the marker only while GDB downloads tracepoints (between QTinit and QTStart).

        GDB 13 to 18 have undefined behaviour when this reply names a marker while `strace` creates the
        tracepoint (they write a std::string member before it is constructed: segfault or abort depending on
        the heap). Answering `l` then makes GDB warn and still create the static tracepoint at that address;
        at download time GDB needs the `m` reply or refuses to send it as static.
        """
        marker = self.tracer.marker_at(packet.address)
        if marker is None or not (self._downloading or self.name_markers_always):
            return t.END_OF_LIST
        return t.encode_static_markers([self._static_marker(marker)])

    @handles(t.ReadStaticTraceData)
    def static_trace_data(self, packet: t.ReadStaticTraceData) -> Reply:
        """`$_sdata` of the selected frame: the recorded entry rendered by its TP_printk format."""
        if self._selected is None or self._frames is None:
            raise RspError(E_TRACE, "no trace frame selected")
        text = self.tracer.rendered_sdata(self._frames[self._selected])
        if text is None:
            raise RspError(E_TRACE, "no static tracepoint data in this frame")
        return Binary(t.encode_qxfer_chunk(text.encode(), packet.offset, packet.length))

    @handles(t.SaveTrace)
    def save_trace(self, packet: t.SaveTrace) -> Reply:
        """`tsave -r FILE`: the target writes the trace file, only under the directory chosen at start-up."""
        try:
            path = resolve_save_path(self.save_dir, packet.filename)
        except SavePathError as error:
            raise RspError(E_TRACE, str(error), text=True) from None
        tracer = self.tracer
        usage = []
        for (number, address) in tracer.definitions.tracepoints:
            found = tracer.location_status(number, address) or (0, 0)
            usage.append((number, address, *found))
        try:
            write_tfile(
                path,
                regblock_size=amd64.G_PACKET_SIZE if self.layout is None else self.layout.size,
                status_reply=t.encode_trace_status(tracer.status()),
                variables=self._wire_variables(),
                tracepoints=self._wire_pieces(),
                usage=usage,
                tdesc=amd64.target_xml() if self.layout is None else self.layout.target_xml(),
                frames=self._saved_frames(),
            )
        except OSError as error:
            raise RspError(E_TRACE, f"cannot write {path}: {error.strerror}", text=True) from None
        return b"OK"


def _renumbered(tracepoint, number) -> tuple[bytes | None, list, list]:
    """A tracepoint's condition, actions and while-stepping actions, its bytecode's variables renumbered."""
    def actions(listed: list) -> list:
        return [EvalExpression(renumber_variables(a.bytecode, number)) if isinstance(a, EvalExpression) else a
                for a in listed]

    condition = tracepoint.condition
    return (None if condition is None else renumber_variables(condition, number), actions(tracepoint.actions),
            actions(tracepoint.stepping_actions))


def upload_pieces(definitions: Definitions) -> list[bytes]:
    """qTfP/qTsP replies: each tracepoint, its actions, stepping actions and source strings."""
    pieces: list[bytes] = []
    for tp in definitions.tracepoints.values():
        pieces.append(t.encode_tracepoint_definition(tp))
        for action in tp.actions:
            pieces.append(t.encode_tracepoint_actions(tp.number, tp.address, [action]))
        for action in tp.stepping_actions:
            pieces.append(t.encode_tracepoint_actions(tp.number, tp.address, [action], stepping=True))
        for source in tp.sources:
            pieces.append(t.encode_tracepoint_source(source))
    return pieces


def upload_variables(definitions: Definitions, newest_first: bool = False) -> list[bytes]:
    """qTfV/qTsV replies, by variable number; `newest_first` (the gdbserver role): the last defined first, as
    gdbserver's list keeps them (tracepoint.cc: add_trace_state_variable puts each new one at its head), which GDB
    turns back into the order they were defined in (its `=tsv-created` notifications, mi-tsv-changed.exp)."""
    return [
        t.encode_trace_variable(VariableSpec(v.number, v.initial, v.builtin, v.name))
        for v in sorted(definitions.variables.values(), key=lambda v: v.number, reverse=newest_first)
    ]


def register_trace_commands(monitor, tracer: TracerApi) -> None:
    """`monitor engine`, `frames`, `sdata`, `fbt` and `probes`."""
    from .monitor import MonitorUsageError

    @monitor.register("engine", "engine [interp|naive|opt]", "show or set how conditions and actions run (next tstart)")
    def engine(args: list[str]) -> str:
        if args:
            try:
                tracer.set_engine(args[0])
            except ValueError as error:
                raise MonitorUsageError(str(error)) from None
        return f"engine {tracer.engine}" + (" (takes effect at the next tstart)" if tracer.running else "")

    @monitor.register("frames", "frames [FIRST [COUNT]]",
                      "trace frames with what GDB's format has no room for: time since tstart, CPU, sequence")
    def frames(args: list[str]) -> str:
        from .monitor import parse_int

        first = parse_int(args[0], "FIRST", low=0, high=1 << 32) if args else 0
        count = parse_int(args[1], "COUNT", low=1, high=10000) if len(args) > 1 else 20
        listed = tracer.frames()
        if not listed:
            return "no trace frames"
        origin = listed[0].timestamp
        rows = [f"{len(listed)} frames; times are from the first listed frame, converted from the TSC; "
                "seq counts each CPU's frames"]
        for frame in listed[first : first + count]:
            microseconds = tracer.tsc.to_ns(frame.timestamp - origin) / 1000
            kinds = "".join(type(b).__name__[0] for b in frame.blocks)
            rows.append(f"frame {frame.number:>5}  tp {frame.tracepoint:>3}  +{microseconds:12.3f} us  "
                        f"cpu {frame.cpu}  seq {frame.sequence}  blocks {kinds or '-'}")
        return "\n".join(rows)

    @monitor.register("sdata", "sdata [FIRST [COUNT]]", "$_sdata of trace frames, rendered by their TP_printk format")
    def sdata(args: list[str]) -> str:
        from .monitor import parse_int

        first = parse_int(args[0], "FIRST", low=0, high=1 << 32) if args else 0
        count = parse_int(args[1], "COUNT", low=1, high=10000) if len(args) > 1 else 20
        rows = []
        for frame in tracer.frames()[first : first + count]:
            text = tracer.rendered_sdata(frame)
            if text is not None:
                rows.append(f"frame {frame.number:>5}  tp {frame.tracepoint:>3}  {text}")
        return "\n".join(rows) if rows else "no static tracepoint data in those frames"

    @monitor.register("fbt", "fbt", "every kernel function: its entry's probe, whether its return takes one, why not")
    def fbt(args: list[str]) -> str:
        rows = []
        for row in tracer.function_probes():
            notes = [f"{where}: {note}" for where, note in (("entry", row.entry_note), ("return", row.return_note))
                     if note]
            rows.append(f"{row.address:#x}  entry {row.entry or 'none':4}  return {'yes' if row.returns else 'no':3}"
                        f"  {row.name}" + (f"  -- {'; '.join(notes)}" if notes else ""))
        return "\n".join(rows)

    @monitor.register("probes", "probes", "armed tracepoint locations: probe kind, engine, fired/hit counts")
    def probes(args: list[str]) -> str:
        rows = [
            f"{row.number:>3}  {row.address:#x}  {row.kind:5} {'armed' if row.armed else 'removed':8} "
            f"fired {row.fired}  hits {row.hits}  bytes {row.usage}  ({row.function})"
            for row in tracer.probe_rows()
        ]
        return "\n".join(rows) if rows else "no probes"
