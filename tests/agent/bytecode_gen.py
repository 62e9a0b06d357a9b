"""Hypothesis strategies for well-formed agent bytecode, built by construction so that it always verifies:
the generator tracks the stack depth, branches rejoin at equal depths, loops are counted (or hit the budget)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import strategies as st

from kgtp_sim.agent.opcodes import BY_NAME, encode

from .harness import DATA_ADDR, DATA_SIZE, STRING_ADDR, UNMAPPED

INTERESTING = [
    0, 1, 2, 3, 7, 8, 31, 32, 33, 63, 64, 65, 127, 128, 200, 255, 256, 0x7FFF, 0x8000, 0xFFFF,
    0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0x100000000, 2**63 - 1, 2**63, 2**64 - 1, 2**64 - 2, 2**64 - 64,
]
WIDTHS = [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 200, 255]
BINARY = [
    "add", "sub", "mul", "div_signed", "div_unsigned", "rem_signed", "rem_unsigned", "lsh", "rsh_signed",
    "rsh_unsigned", "bit_and", "bit_or", "bit_xor", "equal", "less_signed", "less_unsigned",
]
TSVS = [0, 1, 2, 5]
FORMATS = [(b"%d\\n", ("int",)), (b"x=%lu y=%lx %c|", ("int", "int", "int")), (b"%s!", ("str",)), (b"plain", ())]


@dataclass
class Builder:
    """Bytecode with symbolic jump targets, assembled once the layout is known."""

    items: list = field(default_factory=list)
    labels: int = 0

    def op(self, name: str, *operands: int) -> None:
        self.items.append(("op", name, operands))

    def raw(self, data: bytes) -> None:
        self.items.append(("raw", data))

    def new_label(self) -> str:
        self.labels += 1
        return f"L{self.labels}"

    def label(self, name: str) -> None:
        self.items.append(("label", name))

    def jump(self, name: str, label: str) -> None:
        self.items.append(("jump", name, label))

    def assemble(self) -> bytes:
        where: dict[str, int] = {}
        pos = 0
        for item in self.items:
            if item[0] == "label":
                where[item[1]] = pos
            elif item[0] == "op":
                pos += BY_NAME[item[1]].fixed_size
            elif item[0] == "raw":
                pos += len(item[1])
            else:
                pos += 3
        out = b""
        for item in self.items:
            if item[0] == "op":
                out += encode(item[1], *item[2])
            elif item[0] == "raw":
                out += item[1]
            elif item[0] == "jump":
                out += encode(item[1], where[item[2]])
        return out


def _const(b: Builder, value: int) -> None:
    value &= 2**64 - 1
    for name, bits in (("const8", 8), ("const16", 16), ("const32", 32), ("const64", 64)):
        if value < 1 << bits:
            b.op(name, value)
            return


class Gen:
    def __init__(self, draw, max_depth: int = 28) -> None:
        self.draw = draw
        self.max_depth = max_depth
        self.b = Builder()

    def choice(self, options):
        return self.draw(st.sampled_from(options))

    def number(self) -> int:
        return self.draw(st.one_of(st.sampled_from(INTERESTING), st.integers(0, 2**64 - 1), st.integers(0, 300)))

    def address(self, size: int = 8) -> int:
        if self.draw(st.integers(0, 11)) == 0:  # now and then an address that faults (or half-faults)
            return self.draw(st.sampled_from([UNMAPPED, 0x10, DATA_ADDR + DATA_SIZE - size // 2 if size > 1 else DATA_ADDR]))
        return self.draw(st.integers(DATA_ADDR, DATA_ADDR + DATA_SIZE - size))

    # an expression pushing exactly one value -----------------------------------------------------------
    def expr(self, depth: int, size: int) -> None:
        b = self.b
        kind = self.choice(["leaf", "leaf", "unary", "binary", "binary", "ref", "cmpbranch"] if size > 0 else ["leaf", "ref"])
        if kind == "leaf" or depth + 2 > self.max_depth:
            leaf = self.choice(["const", "const", "reg", "getv"] + (["dup", "pick"] if depth else []))
            if leaf == "const":
                _const(b, self.number())
            elif leaf == "reg":
                b.op("reg", self.draw(st.integers(0, 23)))
            elif leaf == "getv":
                b.op("getv", self.choice(TSVS))
            elif leaf == "dup":
                b.op("dup")
            else:
                b.op("pick", self.draw(st.integers(0, depth - 1)))
        elif kind == "ref":
            width = self.choice([8, 16, 32, 64])
            if self.draw(st.booleans()):
                _const(b, self.address(width // 8))
            else:
                _const(b, DATA_ADDR)
                _const(b, self.draw(st.integers(0, 64)))
                b.op("add")
            b.op(f"ref{width}")
            if self.draw(st.booleans()):
                b.op("ext", self.choice([width, 8, 16, 32, 64]))
        elif kind == "unary":
            self.expr(depth, size - 1)
            name = self.choice(["ext", "ext", "zero_ext", "log_not", "bit_not"])
            b.op(name, self.choice(WIDTHS)) if name in ("ext", "zero_ext") else b.op(name)
        elif kind == "binary":
            self.expr(depth, size // 2)
            self.expr(depth + 1, size // 2)
            if self.draw(st.integers(0, 4)) == 0:
                b.op("swap")
            b.op(self.choice(BINARY))
        else:  # a conditional value: cond ? x : y
            self.expr(depth, size // 3)
            then, end = b.new_label(), b.new_label()
            b.jump("if_goto", then)
            self.expr(depth, size // 3)
            b.jump("goto", end)
            b.label(then)
            self.expr(depth, size // 3)
            b.label(end)

    # statements: sequences with a known net effect ----------------------------------------------------------
    def statements(self, depth: int, count: int) -> int:
        b = self.b
        for _ in range(count):
            kind = self.choice(
                ["push", "push", "push", "pop", "stack", "binary", "unary", "setv", "tracev", "trace", "trace_quick",
                 "tracenz", "printf", "loop", "branch_end", "deep"]
            )
            if kind == "push" or (depth == 0 and kind in ("pop", "unary", "setv")):
                if depth + 1 <= self.max_depth:
                    self.expr(depth, self.draw(st.integers(0, 6)))
                    depth += 1
            elif kind == "deep" and depth + 12 <= self.max_depth:
                for _ in range(self.draw(st.integers(6, 12))):
                    self.expr(depth, 0)
                    depth += 1
            elif kind == "pop" and depth:
                b.op("pop")
                depth -= 1
            elif kind == "stack" and depth >= 2:
                if depth >= 3 and self.draw(st.booleans()):
                    b.op("rot")
                else:
                    b.op("swap")
            elif kind == "binary" and depth >= 2:
                b.op(self.choice(BINARY))
                depth -= 1
            elif kind == "unary" and depth:
                name = self.choice(["ext", "zero_ext", "log_not", "bit_not"])
                b.op(name, self.choice(WIDTHS)) if name in ("ext", "zero_ext") else b.op(name)
            elif kind == "setv" and depth:
                b.op("setv", self.choice(TSVS))
            elif kind == "tracev":
                b.op("tracev", self.choice(TSVS))
            elif kind == "trace":
                size = self.choice([0, 1, 3, 4, 8, 13, 64, 65, 200, 0x10000 + 5])
                _const(b, self.address(min(size, 16)))
                _const(b, size)
                b.op("trace")
            elif kind == "trace_quick" and depth + 1 <= self.max_depth:
                _const(b, self.address(8))
                if self.draw(st.booleans()):
                    b.op("trace_quick", self.choice([0, 1, 2, 4, 7, 8, 16, 64, 65, 255]))
                else:
                    b.op("trace16", self.choice([0, 3, 64, 300, 0x1000]))
                depth += 1
            elif kind == "tracenz":
                _const(b, self.draw(st.sampled_from([STRING_ADDR, STRING_ADDR + 5, STRING_ADDR + 16, DATA_ADDR + DATA_SIZE - 8, UNMAPPED])))
                _const(b, self.choice([0, 1, 3, 5, 100, 0x10005]))
                b.op("tracenz")
            elif kind == "printf" and depth + 5 <= self.max_depth:
                fmt, args = self.choice(FORMATS)
                for arg in reversed(args):
                    _const(b, STRING_ADDR if arg == "str" else self.number())
                _const(b, 0)
                _const(b, 0)
                b.raw(encode("printf", len(args), fmt=fmt.replace(b"\\n", b"\n")))
            elif kind == "loop" and depth + 3 <= self.max_depth:
                b.op("const8", self.draw(st.integers(0, 4)))
                head, body, end = b.new_label(), b.new_label(), b.new_label()
                b.label(head)
                b.op("dup")
                b.jump("if_goto", body)
                b.jump("goto", end)
                b.label(body)
                self.expr(depth + 1, 2)
                b.op("setv", self.choice(TSVS))
                b.op("pop")
                b.op("const8", 1)
                b.op("sub")
                b.jump("goto", head)
                b.label(end)
                b.op("pop")
            elif kind == "branch_end" and depth + 1 <= self.max_depth:
                self.expr(depth, 2)
                skip = b.new_label()
                b.op("log_not")
                b.jump("if_goto", skip)
                self.expr(depth, 2)
                b.op("end")
                b.label(skip)
        return depth


@st.composite
def bytecode(draw, max_statements: int = 10, max_depth: int = 28) -> bytes:
    g = Gen(draw, max_depth)
    g.statements(0, draw(st.integers(1, max_statements)))
    if draw(st.integers(0, 15)) == 0:
        spin = g.b.new_label()
        g.b.label(spin)
        g.b.jump("goto", spin)  # runs until the loop budget is exhausted
    g.b.op("end")
    return g.b.assemble()


registers = st.lists(st.one_of(st.sampled_from(INTERESTING), st.integers(0, 2**64 - 1)), min_size=24, max_size=24)
tsv_values = st.dictionaries(st.sampled_from(TSVS), st.one_of(st.sampled_from(INTERESTING), st.integers(0, 2**64 - 1)))
trace_limits = st.one_of(st.just(1 << 20), st.integers(0, 200))
