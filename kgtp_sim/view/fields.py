"""Named, typed fields of a frame: what each `collect` of its tracepoint shows, as tdump would show it.

For every argument of every `collect` line (from QTDPsrc): `$regs` gives the registers, `$args` / `$locals`
the variables in scope at the tracepoint's PC, `$_sdata` the marker's TP_STRUCT fields decoded from the entry
the frame recorded, a trace state variable its value, and any other text is a C expression evaluated on the
frame (`cexpr.py`). Each field has a type spec the exporters use:

    ("int", bits, signed, base)   ("string",)   ("array", count, spec)   ("struct", ((name, spec), ...))

Values are Python (int, str, list, dict) or None when the frame does not hold them (tdump's `<unavailable>`).
Pure: any thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..machine import KernelImage, Marker
from ..machine.dwarf import CType, KernelDwarf, Unavailable
from ..tracing.core.sdata import split_top_level
from .cexpr import ExpressionError, FrameContext, Value, evaluate, to_python
from .model import Frame, Run, TracepointInfo

#: The registers tdump prints for `collect $regs` (the x87 state in the block is not shown).
GENERAL_REGISTERS = ("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10", "r11", "r12", "r13",
                     "r14", "r15", "rip", "eflags", "cs", "ss", "ds", "es", "fs", "gs")
_SMALL = {"eflags", "cs", "ss", "ds", "es", "fs", "gs"}


def _register_specs(registers: dict[str, int]) -> tuple:
    return tuple((name, ("int", 32 if name in _SMALL else 64, False, 16)) for name in GENERAL_REGISTERS
                 if name in registers)


def spec_of(kind: CType, depth: int = 0) -> tuple:
    if kind.kind == "pointer":
        return ("int", 64, False, 16)
    if kind.kind in ("base", "enum"):
        return ("int", max(8 * kind.size, 8), kind.signed, 10)
    if kind.kind == "array" and kind.target is not None:
        if kind.target.char:
            return ("string",)
        return ("array", min(kind.count or 0, 64), spec_of(kind.target, depth + 1))
    if kind.kind in ("struct", "union") and depth <= 4:
        members = []
        for name, _, member in kind.members:
            inner = spec_of(member, depth + 1)
            if not name and inner[0] == "struct":
                members.extend(inner[1])
            elif name:
                members.append((name, inner))
        return ("struct", tuple(members))
    return ("int", 64, False, 16)


def marker_spec(marker: Marker) -> tuple:
    members = []
    for f in marker.fields:
        if "[" in f.type:
            element_type = f.type.split("[", 1)[0].strip()
            count = int(f.type.split("[", 1)[1].rstrip("]") or 0)
            if element_type == "char":
                members.append((f.name, ("string",)))
            else:
                size = f.size // max(count, 1)
                members.append((f.name, ("array", count, ("int", 8 * size, f.signed, 10))))
        else:
            members.append((f.name, ("int", 8 * f.size, f.signed, 16 if "*" in f.type else 10)))
    return ("struct", tuple(members))


def decode_marker(marker: Marker, entry: bytes) -> dict:
    values = {}
    for f in marker.fields:
        raw = entry[f.offset : f.offset + f.size]
        if "[" in f.type:
            element_type = f.type.split("[", 1)[0].strip()
            count = int(f.type.split("[", 1)[1].rstrip("]") or 0)
            if element_type == "char":
                values[f.name] = raw.split(b"\0", 1)[0].decode("latin-1")
            else:
                size = f.size // max(count, 1)
                values[f.name] = [int.from_bytes(raw[i * size : (i + 1) * size], "little", signed=f.signed)
                                  for i in range(count)]
        else:
            values[f.name] = int.from_bytes(raw, "little", signed=f.signed)
    return values


def split_arguments(text: str) -> list[str]:
    """`collect a, b[1], f(x, y)` -> ["a", "b[1]", "f(x, y)"], with the `/s` modifier kept on each."""
    text = text.strip()
    modifier = ""
    if text.startswith("collect"):
        text = text[len("collect"):]
        if text.startswith("/"):
            modifier, _, text = text.partition(" ")
    return [modifier + " " + p if modifier else p for p in split_top_level(text) if p]


@dataclass
class Field:
    name: str  # the collected text, e.g. "(2*counter1+3*counter2)", "$regs", "$_sdata"
    value: object
    spec: tuple
    error: str | None = None  # why the value is None


@dataclass
class FrameReader:
    """Turns frames of one run into fields, with one kernel's DWARF and marker table."""

    run: Run
    dwarf: KernelDwarf
    markers: dict[str, Marker] = field(default_factory=dict)
    _specs: dict[tuple[int, str], tuple] = field(default_factory=dict)

    @classmethod
    def open(cls, run: Run, kernel: Path | str) -> FrameReader:
        image = KernelImage.load(Path(kernel))
        return cls(run, KernelDwarf(kernel), {m.id: m for m in image.markers})

    def tracepoint(self, frame: Frame) -> TracepointInfo:
        info = self.run.tracepoints.get(frame.tracepoint)
        return info if info is not None else TracepointInfo(frame.tracepoint, 0)

    def marker(self, info: TracepointInfo) -> Marker | None:
        if info.marker is not None:
            return self.markers.get(info.marker)
        if info.static:
            return next((m for m in self.markers.values() if m.site == info.address), None)
        return None

    def event_name(self, info: TracepointInfo) -> str:
        """The tracepoint's name as the exporters use it: the marker's event name, else its location text."""
        marker = self.marker(info)
        if marker is not None:
            return marker.name
        location = info.location.lstrip("*")
        symbol = self.dwarf.symbolize(info.address) if info.address else None
        if symbol is not None and (location.startswith("0x") or not location):
            return symbol[0] if symbol[1] == 0 else f"{symbol[0]}+{symbol[1]:#x}"
        return location

    def fields(self, frame: Frame) -> list[Field]:
        info = self.tracepoint(frame)
        blocks = frame.blocks
        pc = info.address or (blocks.registers or {}).get("rip", 0)
        variables = {name: blocks.variables.get(number) for number, name in self.run.variables.items()}
        context = FrameContext(self.dwarf, pc, blocks.registers, blocks.read, variables)
        out: list[Field] = []
        for line in info.collect_lines():
            for argument in split_arguments(line):
                out.append(self._field(info, frame, context, argument))
        return out

    def _remember(self, info: TracepointInfo, name: str, spec: tuple | None) -> tuple:
        key = (info.number, name)
        if spec is not None:
            self._specs.setdefault(key, spec)
        return self._specs.get(key, ("int", 64, True, 10))

    def spec(self, tracepoint: int, name: str) -> tuple | None:
        return self._specs.get((tracepoint, name))

    def _field(self, info: TracepointInfo, frame: Frame, context: FrameContext, argument: str) -> Field:
        modifier, text = "", argument
        if argument.startswith("/"):
            modifier, _, text = argument.partition(" ")
        registers = frame.blocks.registers
        if text == "$regs":
            if registers is None:
                return Field(text, None, self._remember(info, text, None), "registers not collected")
            shown = {name: registers[name] for name in GENERAL_REGISTERS if name in registers}
            return Field(text, shown, self._remember(info, text, ("struct", _register_specs(registers))))
        if text in ("$args", "$locals"):
            parameters, local = self.dwarf.scope(context.pc)
            chosen = parameters if text == "$args" else local
            values, members = {}, []
            for variable in chosen:
                try:
                    values[variable.name] = to_python(evaluate(variable.name, context))
                except (Unavailable, ExpressionError):
                    values[variable.name] = None
                members.append((variable.name, spec_of(variable.type)))
            return Field(text, values, self._remember(info, text, ("struct", tuple(members))))
        if text == "$_sdata":
            marker = self.marker(info)
            if marker is None:
                return Field(text, None, ("struct", ()), "not a static tracepoint")
            spec = self._remember(info, text, marker_spec(marker))
            entry = frame.blocks.static
            if entry is None:
                return Field(text, None, spec, "no $_sdata block (a tsave'd file omits them)")
            return Field(text, decode_marker(marker, entry), spec)
        if text.startswith("$") and text[1:] in self.run.variables.values():
            value = context.variables.get(text[1:])
            return Field(text, value, self._remember(info, text, ("int", 64, True, 10)),
                         None if value is not None else "not collected")
        try:
            value = evaluate(text, context)
        except Unavailable as error:
            return Field(argument, None, self._remember(info, argument, None), str(error) or "unavailable")
        except (ExpressionError, KeyError, IndexError) as error:
            return Field(argument, None, self._remember(info, argument, None), f"not evaluated: {error}")
        if modifier == "/s" and value.type.kind == "pointer" and value.data is not None:
            string = _read_string(context, value.integer())
            return Field(text, string, self._remember(info, text, ("string",)))
        return Field(argument, to_python(value), self._remember(info, argument, spec_of(value.type)))


def _read_string(context: FrameContext, address: int, limit: int = 4096) -> str | None:
    out = bytearray()
    while len(out) < limit:
        byte = context.memory(address + len(out), 1)
        if byte is None:
            return None if not out else out.decode("latin-1")
        if byte == b"\0":
            break
        out += byte
    return out.decode("latin-1")


def flatten(name: str, value, spec: tuple) -> list[tuple[str, object, tuple]]:
    """Scalar leaves of a field: ("$regs.rax", 5, spec) ...; strings and integer arrays of scalars stay leaves."""
    if spec[0] == "struct":
        out = []
        for member, member_spec in spec[1]:
            inner = value.get(member) if isinstance(value, dict) else None
            out.extend(flatten(f"{name}.{member}", inner, member_spec))
        return out
    return [(name, value, spec)]


__all__ = ["Field", "FrameReader", "Value", "decode_marker", "flatten", "marker_spec", "spec_of", "split_arguments"]
