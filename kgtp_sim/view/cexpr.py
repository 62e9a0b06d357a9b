"""C expressions of `collect` actions, evaluated on one trace frame with the kernel's DWARF.

GDB's tdump shows each collected expression by re-evaluating its text in the selected frame: registers from the
frame's register block, memory from its memory blocks (and the image's read-only sections), variables where the
DWARF says they are at the tracepoint's PC. This module does the same for the exporters and the follow client,
for the C a `collect` line holds: identifiers (parameters, locals, globals), `$registers`, trace state
variables, integer literals, `. -> [] * &`, unary `- ~ !`, and the binary operators with C's integer
promotions. Anything else raises `ExpressionError`; a value the frame lacks raises `Unavailable`. Pure: any
thread.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ..machine.dwarf import INT, LONG, MASK64, UINT, ULONG, CType, KernelDwarf, Unavailable

_TOKEN = re.compile(r"\s*(?:(0[xX][0-9a-fA-F]+|\d+)[uUlL]*|(\$?[A-Za-z_]\w*)|(->|<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%&|^~!<>()\[\].,?:]))")


class ExpressionError(ValueError):
    """An expression this reader does not understand."""


@dataclass
class Value:
    type: CType
    data: bytes | None  # None: not in the frame
    address: int | None = None

    def integer(self) -> int:
        if self.data is None:
            raise Unavailable("value not collected")
        if not self.type.scalar:
            raise ExpressionError(f"{self.type.spelling} is not a number")
        raw = int.from_bytes(self.data[: self.type.size], "little")
        if self.type.signed and raw >> (8 * self.type.size - 1):
            raw -= 1 << (8 * self.type.size)
        return raw


@dataclass
class FrameContext:
    """What an expression can read: the frame's registers and memory at the tracepoint's PC."""

    dwarf: KernelDwarf
    pc: int
    registers: dict[str, int] | None
    read: Callable[[int, int], bytes | None]
    variables: dict[str, int | None]  # trace state variables by name (without `$`), as the frame holds them

    def memory(self, address: int, length: int) -> bytes | None:
        data = self.read(address, length)
        if data is None:
            data = self.dwarf.read_only(address, length)
        return data

    def cfa(self) -> int | None:
        if self.registers is None:
            return None
        return self.dwarf.cfa(self.pc, self.registers)


_REGISTER_ALIASES = {"pc": "rip", "sp": "rsp", "fp": "rbp", "ps": "eflags"}
_REGISTER_NAMES = ("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10", "r11", "r12", "r13",
                   "r14", "r15", "rip", "eflags", "cs", "ss", "ds", "es", "fs", "gs")


def tokenize(text: str) -> list[str]:
    tokens, position = [], 0
    text = text.rstrip()
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None or match.end() == position:
            raise ExpressionError(f"cannot read {text[position:]!r}")
        tokens.append(next(g for g in match.groups() if g is not None))
        position = match.end()
    return tokens


_BINARY = [("||",), ("&&",), ("|",), ("^",), ("&",), ("==", "!="), ("<", ">", "<=", ">="), ("<<", ">>"), ("+", "-"),
           ("*", "/", "%")]


class _Parser:
    def __init__(self, tokens: list[str], context: FrameContext) -> None:
        self.tokens = tokens
        self.position = 0
        self.context = context

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or expected is not None and token != expected:
            raise ExpressionError(f"expected {expected or 'more'} at {token!r}")
        self.position += 1
        return token

    def parse(self) -> Value:
        value = self.binary(0)
        if self.peek() is not None:
            raise ExpressionError(f"unexpected {self.peek()!r}")
        return value

    def binary(self, level: int) -> Value:
        if level == len(_BINARY):
            return self.unary()
        left = self.binary(level + 1)
        while self.peek() in _BINARY[level]:
            operator = self.take()
            right = self.binary(level + 1)
            left = _arithmetic(operator, left, right)
        return left

    def unary(self) -> Value:
        token = self.peek()
        if token in ("-", "+", "~", "!"):
            self.take()
            operand = self.unary()
            kind = _promote(operand.type)
            value = operand.integer()
            result = {"-": -value, "+": value, "~": ~value, "!": int(not value)}[token]
            return _make(INT if token == "!" else kind, result)
        if token == "*":
            self.take()
            return self.dereference(self.unary())
        if token == "&":
            self.take()
            operand = self.unary()
            if operand.address is None:
                raise ExpressionError("cannot take the address of a value not in memory")
            pointer = CType("pointer", "", 8, target=operand.type)
            return _make(pointer, operand.address)
        return self.postfix(self.primary())

    def dereference(self, pointer: Value) -> Value:
        if pointer.type.kind == "array":
            return self.at(pointer.address, pointer.type.target) if pointer.address is not None else \
                Value(pointer.type.target, pointer.data[: pointer.type.target.size] if pointer.data else None)
        if pointer.type.kind != "pointer" or pointer.type.target is None:
            raise ExpressionError("dereferencing a non-pointer")
        return self.at(pointer.integer(), pointer.type.target)

    def at(self, address: int, kind: CType) -> Value:
        return Value(kind, self.context.memory(address, kind.size) if kind.size else b"", address)

    def postfix(self, value: Value) -> Value:
        while True:
            token = self.peek()
            if token in (".", "->"):
                self.take()
                name = self.take()
                if token == "->":
                    value = self.dereference(value)
                try:
                    offset, member = value.type.member(name)
                except KeyError:
                    raise ExpressionError(f"no member {name!r} in {value.type.spelling}") from None
                if value.address is not None:
                    value = self.at(value.address + offset, member)
                else:
                    value = Value(member, value.data[offset : offset + member.size] if value.data else None)
            elif token == "[":
                self.take()
                index = self.binary(0).integer()
                self.take("]")
                if value.type.kind == "array":
                    element = value.type.target
                    if value.address is not None:
                        value = self.at(value.address + index * element.size, element)
                    else:
                        start = index * element.size
                        value = Value(element, value.data[start : start + element.size] if value.data else None)
                elif value.type.kind == "pointer":
                    element = value.type.target
                    value = self.at((value.integer() + index * element.size) & MASK64, element)
                else:
                    raise ExpressionError("subscript of a non-array")
            else:
                return value

    def primary(self) -> Value:
        token = self.take()
        if token == "(":
            value = self.binary(0)
            self.take(")")
            return value
        if token[0].isdigit():
            number = int(token, 0)
            return _make(INT if number < 1 << 31 else LONG if number < 1 << 63 else ULONG, number)
        if token.startswith("$"):
            return self.dollar(token[1:])
        if token[0].isalpha() or token[0] == "_":
            return self.variable(token)
        raise ExpressionError(f"unexpected {token!r}")

    def dollar(self, name: str) -> Value:
        registers = self.context.registers
        register = _REGISTER_ALIASES.get(name, name)
        if register in _REGISTER_NAMES:
            if registers is None or register not in registers:
                raise Unavailable(f"${name} was not collected")
            kind = CType("pointer", "", 8, target=VOID_FN) if register == "rip" else LONG
            if register in ("eflags", "cs", "ss", "ds", "es", "fs", "gs"):
                kind = INT
            return _make(kind, registers[register])
        if name in self.context.variables:
            value = self.context.variables[name]
            if value is None:
                raise Unavailable(f"${name} was not collected")
            return _make(LONG, value)
        raise ExpressionError(f"unknown ${name}")

    def variable(self, name: str) -> Value:
        dwarf = self.context.dwarf
        parameters, local = dwarf.scope(self.context.pc)
        for variable in [*reversed(local), *parameters]:
            if variable.name == name:
                location = dwarf.location(variable.die, self.context.pc, self.context.registers,
                                          self.context.cfa())
                return self._located(variable.type, location)
        found = dwarf.global_variable(name)
        if found is not None:
            address, kind = found
            return self.at(address, kind)
        raise ExpressionError(f"no symbol {name!r} in scope")

    def _located(self, kind: CType, location) -> Value:
        if location.kind == "reg":
            from ..machine.dwarf import DWARF_REGISTERS

            registers = self.context.registers
            if registers is None or location.value >= len(DWARF_REGISTERS):
                raise Unavailable("registers were not collected")
            raw = registers[DWARF_REGISTERS[location.value]] & MASK64
            return Value(kind, raw.to_bytes(8, "little")[: kind.size].ljust(kind.size, b"\0"))
        if location.kind == "mem":
            return self.at(location.value, kind)
        if location.kind == "value":
            return Value(kind, (location.value & MASK64).to_bytes(8, "little")[: kind.size].ljust(kind.size, b"\0"))
        raise Unavailable("optimized out")


VOID_FN = CType("function", "", 1)


def _promote(kind: CType) -> CType:
    if kind.kind == "pointer":
        return ULONG
    if kind.size < 4:
        return INT
    if kind.size == 4:
        return INT if kind.signed else UINT
    return LONG if kind.signed else ULONG


def _common(a: CType, b: CType) -> CType:
    a, b = _promote(a), _promote(b)
    size = max(a.size, b.size)
    if size == 8:
        if a.size == 8 and not a.signed or b.size == 8 and not b.signed:
            return ULONG
        return LONG
    return UINT if not a.signed or not b.signed else INT


def _make(kind: CType, value: int) -> Value:
    size = kind.size
    return Value(kind, (value & ((1 << (8 * size)) - 1)).to_bytes(size, "little"))


def _arithmetic(operator: str, left: Value, right: Value) -> Value:
    if operator in ("&&", "||"):
        a, b = left.integer(), right.integer()
        return _make(INT, int(bool(a) and bool(b)) if operator == "&&" else int(bool(a) or bool(b)))
    if operator in ("+", "-") and left.type.kind in ("pointer", "array") and right.type.kind not in ("pointer", "array"):
        element = left.type.target.size if left.type.target else 1
        base = left.integer() if left.type.kind == "pointer" else left.address or 0
        step = right.integer() * element
        pointer = left.type if left.type.kind == "pointer" else CType("pointer", "", 8, target=left.type.target)
        return _make(pointer, base + step if operator == "+" else base - step)
    kind = LONG if operator in ("<<", ">>") and _promote(left.type).size == 8 else _common(left.type, right.type)
    if operator in ("<<", ">>"):
        kind = _promote(left.type)
    a, b = left.integer(), right.integer()
    if not kind.signed:
        bits = 8 * kind.size
        a &= (1 << bits) - 1
        b &= (1 << bits) - 1
    if operator in ("/", "%"):
        if b == 0:
            raise Unavailable("division by zero")
        quotient = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)
        result = quotient if operator == "/" else a - quotient * b
    else:
        result = {
            "+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "&": lambda: a & b, "|": lambda: a | b,
            "^": lambda: a ^ b, "<<": lambda: a << (b & 63), ">>": lambda: a >> (b & 63),
            "==": lambda: int(a == b), "!=": lambda: int(a != b), "<": lambda: int(a < b), ">": lambda: int(a > b),
            "<=": lambda: int(a <= b), ">=": lambda: int(a >= b),
        }[operator]()
    if operator in ("==", "!=", "<", ">", "<=", ">="):
        kind = INT
    return _make(kind, result)


def evaluate(text: str, context: FrameContext) -> Value:
    return _Parser(tokenize(text), context).parse()


def to_python(value: Value, depth: int = 0):
    """The value as JSON-friendly Python: int, str (char arrays), list, dict (structs), None (unavailable)."""
    kind = value.type
    if value.data is None and kind.kind not in ("struct", "union", "array"):
        return None
    if kind.scalar:
        return value.integer()
    if kind.kind == "array" and kind.target is not None:
        if kind.target.char:
            if value.data is None:
                return None
            return value.data.split(b"\0", 1)[0].decode("latin-1")
        element = kind.target
        out = []
        for index in range(min(kind.count or 0, 64)):
            piece = value.data[index * element.size : (index + 1) * element.size] if value.data else None
            out.append(to_python(Value(element, piece), depth + 1))
        return out
    if kind.kind in ("struct", "union"):
        if depth > 4:
            return None
        out = {}
        for name, offset, member in kind.members:
            piece = value.data[offset : offset + member.size] if value.data else None
            found = to_python(Value(member, piece), depth + 1)
            if not name and isinstance(found, dict):
                out.update(found)
            else:
                out[name] = found
        return out
    return None


def text_of(value) -> str:
    """A Python value as a person reads it in one line (the follow client's format)."""
    if value is None:
        return "<unavailable>"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {text_of(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "{" + ", ".join(text_of(v) for v in value) + "}"
    return str(value)
