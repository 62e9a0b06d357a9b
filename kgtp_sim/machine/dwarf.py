"""The kernel's DWARF for reading trace frames: types, variables in scope at a PC, locations, and the CFI unwinder.

A frame holds raw registers and memory; what a person wants to see is `counter1 = 5` or `mod->taints = 4096`.
This module answers, from `fixtures/vmlinux`'s DWARF (pyelftools): where a variable lives at a given PC (a
register, memory, a computed value, or nowhere), what its C type is, and how to unwind a stack from a PC and
registers with the `.eh_frame` call-frame information. It evaluates nothing by itself; `cexpr.py` builds C
expressions on top of it. Pure functions of the ELF file: used by whichever thread reads frames (the follow
client's main thread, the exporters, the plotters).

Why this module is long: types, scopes, location lists and the CFI unwinder all read the same parsed DWARF and
ELF sections (one cached parse per kernel); apart, each would parse them again or pass the parser around.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path

from elftools.dwarf.dwarf_expr import DWARFExprParser
from elftools.dwarf.locationlists import BaseAddressEntry, LocationEntry, LocationParser
from elftools.elf.constants import SH_FLAGS
from elftools.elf.elffile import ELFFile

#: DWARF register numbers of x86_64 -> GDB's register names (the names of a frame's register block).
DWARF_REGISTERS = ("rax", "rdx", "rcx", "rbx", "rsi", "rdi", "rbp", "rsp",
                   "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15", "rip")

MASK64 = (1 << 64) - 1


class Unavailable(Exception):
    """A value that the frame does not hold (not collected, optimized out, or not describable here)."""


@dataclass(eq=False)
class CType:
    """A C type as far as reading values needs it."""

    kind: str  # base, enum, pointer, struct, union, array, void, function
    name: str
    size: int
    signed: bool = False
    char: bool = False
    boolean: bool = False
    floating: bool = False
    target: CType | None = None  # pointee or element
    count: int | None = None  # array length
    members: list[tuple[str, int, CType]] = field(default_factory=list)  # struct/union: name, offset, type
    enumerators: dict[int, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"CType({self.spelling})"

    @property
    def spelling(self) -> str:
        """The type as C writes it, for CTF and for messages: `int`, `char[16]`, `struct module *`."""
        if self.kind == "pointer":
            return (self.target.spelling if self.target else "void") + " *"
        if self.kind == "array":
            return f"{self.target.spelling if self.target else '?'}[{self.count or 0}]"
        if self.kind in ("struct", "union", "enum"):
            return f"{self.kind} {self.name}" if self.name else self.kind
        return self.name or self.kind

    @property
    def scalar(self) -> bool:
        return self.kind in ("base", "enum", "pointer")

    def member(self, name: str) -> tuple[int, CType]:
        for member_name, offset, member_type in self.members:
            if member_name == name:
                return offset, member_type
        for member_name, offset, member_type in self.members:  # anonymous struct/union members
            if not member_name and member_type.kind in ("struct", "union"):
                try:
                    inner, found = member_type.member(name)
                except KeyError:
                    continue
                return offset + inner, found
        raise KeyError(name)


INT = CType("base", "int", 4, signed=True)
UINT = CType("base", "unsigned int", 4)
LONG = CType("base", "long", 8, signed=True)
ULONG = CType("base", "unsigned long", 8)
VOID = CType("void", "void", 1)


@dataclass(frozen=True)
class Location:
    """Where a variable is: `reg` (DWARF register number), `mem` (address), `value` (computed), or nowhere."""

    kind: str
    value: int = 0


@dataclass
class Variable:
    name: str
    type: CType
    die: object = field(repr=False)
    parameter: bool = False


@dataclass(frozen=True)
class Function:
    name: str
    low: int
    high: int
    die: object = field(compare=False, repr=False)


_SHARED: dict[str, KernelDwarf] = {}  #: KernelDwarf.reading's instances, by the kernel file's resolved path
_SHARED_LOCK = threading.Lock()


class KernelDwarf:
    """One kernel ELF's DWARF and symbols."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._file = open(self.path, "rb")  # noqa: SIM115 (kept open: pyelftools reads sections lazily)
        self.elf = ELFFile(self._file)
        self.info = self.elf.get_dwarf_info()
        self._locations = LocationParser(self.info.location_lists())
        self._expr = DWARFExprParser(self.info.structs)
        self._types: dict[int, CType] = {}
        self._globals: dict[str, tuple[int, object]] = {}
        self._functions: list[Function] = []
        self._cu_of: dict[int, object] = {}
        for cu in self.info.iter_CUs():
            top = cu.get_top_DIE()
            for die in top.iter_children():
                self._cu_of[die.offset] = cu
                if die.tag == "DW_TAG_variable":
                    self._add_global(die)
                elif die.tag == "DW_TAG_subprogram":
                    low_high = _pc_range(die)
                    if low_high is not None and "DW_AT_name" in die.attributes:
                        self._functions.append(Function(_name(die), low_high[0], low_high[1], die))
                        for child in die.iter_children():  # function-static variables
                            if child.tag == "DW_TAG_variable":
                                self._add_global(child, keep=False)
        self._functions.sort(key=lambda f: f.low)
        self._function_starts = [f.low for f in self._functions]
        self._readonly = [(s["sh_addr"], s.data()) for s in self.elf.iter_sections()
                          if s["sh_flags"] & SH_FLAGS.SHF_ALLOC and not s["sh_flags"] & SH_FLAGS.SHF_WRITE
                          and s["sh_type"] == "SHT_PROGBITS" and s["sh_addr"]]
        self._symbols = sorted(
            (sym["st_value"], sym["st_size"], sym.name) for sym in self.elf.get_section_by_name(".symtab").iter_symbols()
            if sym["st_info"]["type"] in ("STT_FUNC", "STT_NOTYPE") and sym["st_value"] and sym.name
            and not sym.name.startswith(".")
        )
        self._symbol_starts = [s[0] for s in self._symbols]

    def close(self) -> None:
        self._file.close()

    @classmethod
    @contextmanager
    def reading(cls, path: Path | str) -> Iterator[KernelDwarf]:
        """One parsed instance per kernel file in this process, lent to one reader at a time (it reads its file
        lazily), for readers that only look things up (building its tables takes 0.2 s: a server that parsed
        the DWARF for each layout it read paid that several times in a session); any thread."""
        key = str(Path(path).resolve())
        with _SHARED_LOCK:
            found = _SHARED.get(key)
            if found is None:
                found = _SHARED[key] = cls(key)
            yield found

    # ---- symbols, lines ------------------------------------------------------------------------------------

    def _add_global(self, die, keep: bool = True) -> None:
        name = die.attributes.get("DW_AT_name")
        location = die.attributes.get("DW_AT_location")
        if name is None and "DW_AT_specification" in die.attributes:  # the definition of a declared variable
            declaration = die.get_DIE_from_attribute("DW_AT_specification")
            name = declaration.attributes.get("DW_AT_name")
            if "DW_AT_type" not in die.attributes:
                die = _Declared(die, declaration)
        if name is None or location is None or location.form != "DW_FORM_exprloc":
            return
        ops = self._expr.parse_expr(location.value)
        if len(ops) == 1 and ops[0].op_name == "DW_OP_addr":
            text = name.value.decode()
            if keep or text not in self._globals:
                self._globals.setdefault(text, (ops[0].args[0], die))

    def global_variable(self, name: str) -> tuple[int, CType] | None:
        found = self._globals.get(name)
        if found is None:
            return None
        address, die = found
        return address, self.type_of(die)

    def task_comm_offset(self) -> int | None:
        """Offset of `comm` in the kernel's `struct task_struct`: through the per-CPU area's `current_task`, the
        `tasks` array or the `current` pointer, whichever the kernel has (None: none of them)."""
        for name, steps in (("cpu_data", ("target", "current_task", "target")), ("tasks", ("target",)),
                            ("current", ("target",))):
            found = self.global_variable(name)
            ctype = found[1] if found is not None else None
            try:
                for step in steps:
                    ctype = ctype.target if step == "target" else ctype.member(step)[1]
                return ctype.member("comm")[0]
            except (AttributeError, KeyError):
                continue
        return None

    def address_of(self, name: str) -> int | None:
        for start, _size, symbol in self._symbols:
            if symbol == name:
                return start
        found = self._globals.get(name)
        return found[0] if found else None

    def function_at(self, pc: int) -> Function | None:
        index = bisect.bisect_right(self._function_starts, pc) - 1
        if index >= 0 and self._functions[index].low <= pc < self._functions[index].high:
            return self._functions[index]
        return None

    def symbolize(self, pc: int) -> tuple[str, int] | None:
        """(symbol, offset) for a code address: DWARF functions first, then the symbol table (assembly)."""
        function = self.function_at(pc)
        if function is not None:
            return function.name, pc - function.low
        index = bisect.bisect_right(self._symbol_starts, pc) - 1
        if index < 0:
            return None
        start, size, name = self._symbols[index]
        if size and pc >= start + size:
            return None
        return name, pc - start

    @cached_property
    def _line_table(self) -> list[tuple[int, str, int]]:
        rows = []
        for cu in self.info.iter_CUs():
            program = self.info.line_program_for_CU(cu)
            if program is None:
                continue
            header = program.header
            names = header["file_entry"]
            version = header["version"]
            sequence = len(rows)  # where the current sequence's rows begin
            for entry in program.get_entries():
                state = entry.state
                if state is None:
                    continue
                if state.end_sequence:  # past the sequence's code: no line (another file's code may follow)
                    while len(rows) > sequence and rows[-1][0] >= state.address:
                        rows.pop()  # a row that covers no code (at the sequence's end address)
                    rows.append((state.address, "", 0))
                    sequence = len(rows)
                    continue
                index = state.file if version >= 5 else state.file - 1
                if 0 <= index < len(names):
                    file_name = names[index].name.decode()
                    directory_index = names[index].dir_index
                    directories = header["include_directory"]
                    if 0 <= directory_index < len(directories) and not file_name.startswith("/"):
                        directory = directories[directory_index].decode()
                        if directory not in (".", ""):
                            file_name = f"{directory}/{file_name}"
                else:
                    file_name = "?"
                rows.append((state.address, file_name, state.line))
        rows.sort()
        return rows

    def line_at(self, pc: int) -> tuple[str, int] | None:
        """Source file and line of a code address (the last line-table row at or before it, in its sequence); None
        where no sequence covers it (code assembled without line information, such as the late part of boot.S: the
        row before it is another file's, whose sequence ended)."""
        rows = self._line_table
        index = bisect.bisect_right(rows, (pc, "\uffff", 1 << 30)) - 1
        if index < 0:
            return None
        _, file_name, line = rows[index]
        if not file_name:  # an end of sequence
            return None
        return (file_name.removeprefix("./"), line)

    def read_only(self, address: int, length: int) -> bytes | None:
        """Bytes of the image's read-only sections (code, rodata): the same in every frame."""
        for start, data in self._readonly:
            if start <= address and address + length <= start + len(data):
                return data[address - start : address - start + length]
        return None

    # ---- types ---------------------------------------------------------------------------------------------

    def type_of(self, die) -> CType:
        attribute = die.attributes.get("DW_AT_type")
        if attribute is None:
            return VOID
        return self._type(die.get_DIE_from_attribute("DW_AT_type"))

    def _type(self, die) -> CType:
        cached = self._types.get(die.offset)
        if cached is not None:
            return cached
        tag = die.tag
        name = _name(die)
        size = die.attributes["DW_AT_byte_size"].value if "DW_AT_byte_size" in die.attributes else 0
        if tag == "DW_TAG_base_type":
            encoding = die.attributes["DW_AT_encoding"].value
            # DW_ATE_boolean 2, float 4, signed 5, signed_char 6, unsigned 7, unsigned_char 8
            made = CType("base", name, size, signed=encoding in (5, 6), char=encoding in (6, 8) or name == "char",
                         boolean=encoding == 2, floating=encoding == 4)
        elif tag in ("DW_TAG_typedef", "DW_TAG_const_type", "DW_TAG_volatile_type", "DW_TAG_restrict_type",
                     "DW_TAG_atomic_type"):
            made = self.type_of(die)
            if tag == "DW_TAG_typedef" and made.kind == "base":
                # keep the typedef's name for spelling (u32, pid_t) but the base type's nature
                made = CType("base", name, made.size, made.signed, made.char, made.boolean, made.floating)
        elif tag == "DW_TAG_pointer_type":
            made = CType("pointer", "", size or 8)
            self._types[die.offset] = made
            made.target = self.type_of(die)
            return made
        elif tag in ("DW_TAG_structure_type", "DW_TAG_union_type"):
            made = CType("struct" if tag == "DW_TAG_structure_type" else "union", name, size)
            self._types[die.offset] = made
            for child in die.iter_children():
                if child.tag != "DW_TAG_member":
                    continue
                offset = child.attributes.get("DW_AT_data_member_location")
                made.members.append((_name(child), offset.value if offset is not None else 0, self.type_of(child)))
            return made
        elif tag == "DW_TAG_array_type":
            element = self.type_of(die)
            counts = []
            for child in die.iter_children():
                if child.tag == "DW_TAG_subrange_type":
                    if "DW_AT_count" in child.attributes:
                        counts.append(child.attributes["DW_AT_count"].value)
                    elif "DW_AT_upper_bound" in child.attributes:
                        counts.append(child.attributes["DW_AT_upper_bound"].value + 1)
                    else:
                        counts.append(0)
            for count in reversed(counts or [0]):
                element = CType("array", "", element.size * count, target=element, count=count)
            made = element
        elif tag == "DW_TAG_enumeration_type":
            base = self.type_of(die) if "DW_AT_type" in die.attributes else UINT
            made = CType("enum", name, size or base.size, signed=base.signed)
            for child in die.iter_children():
                if child.tag == "DW_TAG_enumerator":
                    made.enumerators[child.attributes["DW_AT_const_value"].value] = _name(child)
        elif tag == "DW_TAG_subroutine_type":
            made = CType("function", "", 1)
        else:
            made = VOID
        self._types[die.offset] = made
        return made

    # ---- variables in scope --------------------------------------------------------------------------------

    def scope(self, pc: int) -> tuple[list[Variable], list[Variable]]:
        """(parameters, locals) visible at `pc`, innermost block last."""
        function = self.function_at(pc)
        if function is None:
            return [], []
        parameters: list[Variable] = []
        local: list[Variable] = []

        def walk(die) -> None:
            for child in die.iter_children():
                if child.tag == "DW_TAG_formal_parameter" and "DW_AT_name" in child.attributes:
                    parameters.append(Variable(_name(child), self.type_of(child), child, True))
                elif child.tag == "DW_TAG_variable" and "DW_AT_name" in child.attributes:
                    local.append(Variable(_name(child), self.type_of(child), child, False))
                elif child.tag == "DW_TAG_lexical_block" and _in_ranges(self, child, pc):
                    walk(child)

        walk(function.die)
        return parameters, local

    def location(self, die, pc: int, registers: dict[str, int] | None, cfa: int | None) -> Location:
        """Where the variable `die` is at `pc`, or Location('none') when the DWARF says it is not anywhere."""
        attribute = die.attributes.get("DW_AT_location")
        if attribute is None:
            if "DW_AT_const_value" in die.attributes:
                return Location("value", die.attributes["DW_AT_const_value"].value)
            return Location("none")
        cu = self._cu_for(die)
        if attribute.form == "DW_FORM_exprloc":
            expression = attribute.value
        else:
            entries = self._locations.parse_from_attribute(attribute, cu["version"], die)
            base = _cu_base(cu)
            expression = None
            for entry in entries:
                if isinstance(entry, BaseAddressEntry):
                    base = entry.base_address
                elif isinstance(entry, LocationEntry):
                    absolute = getattr(entry, "is_absolute", False)
                    begin = entry.begin_offset + (0 if absolute else base)
                    end = entry.end_offset + (0 if absolute else base)
                    if begin <= pc < end:
                        expression = entry.loc_expr
                        break
            if expression is None:
                return Location("none")
        function = self.function_at(pc)
        return self._evaluate(expression, pc, registers, cfa, function)

    def _cu_for(self, die):
        return die.cu

    def _evaluate(self, expression, pc, registers, cfa, function) -> Location:
        stack: list[int] = []
        result: Location | None = None
        for op in self._expr.parse_expr(expression):
            name, args = op.op_name, op.args
            if name == "DW_OP_addr":
                stack.append(args[0])
            elif name.startswith("DW_OP_reg") and name != "DW_OP_regx" and name != "DW_OP_regval_type":
                result = Location("reg", int(name[len("DW_OP_reg"):]))
            elif name == "DW_OP_regx":
                result = Location("reg", args[0])
            elif name.startswith("DW_OP_breg") and name != "DW_OP_bregx":
                stack.append((_register(registers, int(name[len("DW_OP_breg"):])) + args[0]) & MASK64)
            elif name == "DW_OP_bregx":
                stack.append((_register(registers, args[0]) + args[1]) & MASK64)
            elif name == "DW_OP_fbreg":
                if cfa is None:
                    raise Unavailable("frame base unknown")
                stack.append((cfa + args[0]) & MASK64)
            elif name == "DW_OP_call_frame_cfa":
                if cfa is None:
                    raise Unavailable("frame base unknown")
                stack.append(cfa)
            elif name.startswith("DW_OP_lit"):
                stack.append(int(name[len("DW_OP_lit"):]))
            elif name.startswith("DW_OP_const") and name not in ("DW_OP_const_type",):
                stack.append(args[0] & MASK64)
            elif name == "DW_OP_plus_uconst":
                stack.append((stack.pop() + args[0]) & MASK64)
            elif name == "DW_OP_plus":
                b, a = stack.pop(), stack.pop()
                stack.append((a + b) & MASK64)
            elif name == "DW_OP_minus":
                b, a = stack.pop(), stack.pop()
                stack.append((a - b) & MASK64)
            elif name == "DW_OP_neg":
                stack.append(-stack.pop() & MASK64)
            elif name == "DW_OP_and":
                b, a = stack.pop(), stack.pop()
                stack.append(a & b)
            elif name == "DW_OP_stack_value":
                return Location("value", stack[-1])
            elif name in ("DW_OP_entry_value", "DW_OP_GNU_entry_value"):
                # the value a register had on entry: known only at the function's first instruction
                inner = self._expr.parse_expr(args[1] if len(args) > 1 else args[0])
                if function is None or pc != function.low or len(inner) != 1 or not inner[0].op_name.startswith("DW_OP_reg"):
                    raise Unavailable("entry value")
                stack.append(_register(registers, int(inner[0].op_name[len("DW_OP_reg"):])))
            elif name == "DW_OP_implicit_value":
                return Location("value", int.from_bytes(bytes(args[1]), "little"))
            else:
                raise Unavailable(f"location {name} not described")
        if result is not None:
            return result
        if not stack:
            return Location("none")
        return Location("mem", stack[-1])

    # ---- unwinding -----------------------------------------------------------------------------------------

    @cached_property
    def _cfi(self) -> tuple[list[int], list[tuple[int, int, list]]]:
        rows = []
        if self.info.has_EH_CFI():
            for entry in self.info.EH_CFI_entries():
                if "initial_location" not in entry.header:
                    continue
                low = entry.header["initial_location"]
                high = low + entry.header["address_range"]
                rows.append((low, high, entry.get_decoded().table))
        rows.sort(key=lambda r: r[0])
        return [r[0] for r in rows], rows

    @lru_cache(maxsize=4096)  # noqa: B019 (one instance per kernel, kept for the program's life)
    def cfi_row(self, pc: int) -> dict | None:
        starts, rows = self._cfi
        index = bisect.bisect_right(starts, pc) - 1
        if index < 0:
            return None
        low, high, table = rows[index]
        if not low <= pc < high:
            return None
        found = None
        for row in table:
            if row["pc"] <= pc:
                found = row
            else:
                break
        return found

    def cfa(self, pc: int, registers: dict[str, int]) -> int | None:
        row = self.cfi_row(pc)
        if row is None or row["cfa"].expr is not None or row["cfa"].reg is None:
            return None
        return (_register(registers, row["cfa"].reg) + row["cfa"].offset) & MASK64

    def unwind(self, registers: dict[str, int], read, limit: int = 64) -> list[int]:
        """PCs of the call stack, innermost first: the frame's PC, then each return address found with the
        CFI and the stack bytes `read(address, 8)` returns (None ends the walk)."""
        regs = dict(registers)
        pcs = [regs["rip"]]
        for _ in range(limit):
            pc = regs["rip"]
            row = self.cfi_row(pc if len(pcs) == 1 else pc - 1)
            if row is None or row["cfa"].reg is None:
                break
            cfa = (_register(regs, row["cfa"].reg) + row["cfa"].offset) & MASK64
            new = dict(regs)
            for number, rule in row.items():
                if not isinstance(number, int) or number >= len(DWARF_REGISTERS):
                    continue
                if rule.type == "OFFSET":
                    data = read((cfa + rule.arg) & MASK64, 8)
                    if data is None:
                        if number == 16:
                            return pcs
                        continue
                    new[DWARF_REGISTERS[number]] = int.from_bytes(data, "little")
                elif rule.type == "UNDEFINED" and number == 16:
                    return pcs
            if 16 not in row:
                break
            new["rsp"] = cfa
            if new["rip"] == 0 or new["rip"] == pc and cfa == regs["rsp"]:
                break
            regs = new
            pcs.append(regs["rip"])
            if self.symbolize(regs["rip"]) is None:
                break
        return pcs


class _Declared:
    """A variable's definition DIE seen with its declaration's type."""

    def __init__(self, definition, declaration) -> None:
        self.offset = definition.offset
        self.cu = definition.cu
        self.attributes = {**declaration.attributes, **definition.attributes}
        self._declaration = declaration

    def get_DIE_from_attribute(self, name):  # noqa: N802 (pyelftools' name)
        return self._declaration.get_DIE_from_attribute(name)


def _register(registers: dict[str, int] | None, number: int) -> int:
    if registers is None or number >= len(DWARF_REGISTERS) or DWARF_REGISTERS[number] not in registers:
        raise Unavailable("registers were not collected")
    return registers[DWARF_REGISTERS[number]]


def _name(die) -> str:
    attribute = die.attributes.get("DW_AT_name")
    return attribute.value.decode() if attribute is not None else ""


def _pc_range(die) -> tuple[int, int] | None:
    low = die.attributes.get("DW_AT_low_pc")
    high = die.attributes.get("DW_AT_high_pc")
    if low is None or high is None:
        return None
    end = high.value if high.form == "DW_FORM_addr" else low.value + high.value
    return low.value, end


def _cu_base(cu) -> int:
    top = cu.get_top_DIE()
    low = top.attributes.get("DW_AT_low_pc")
    return low.value if low is not None else 0


def _in_ranges(dwarf: KernelDwarf, die, pc: int) -> bool:
    span = _pc_range(die)
    if span is not None:
        return span[0] <= pc < span[1]
    if "DW_AT_ranges" in die.attributes:
        ranges = dwarf.info.range_lists()
        if ranges is None:
            return True
        try:
            entries = ranges.get_range_list_at_offset(die.attributes["DW_AT_ranges"].value, cu=die.cu)
        except Exception:  # a form this pyelftools cannot follow: count the block as in scope
            return True
        base = _cu_base(die.cu)
        for entry in entries:
            begin, end = getattr(entry, "begin_offset", None), getattr(entry, "end_offset", None)
            if begin is None:
                continue
            if not getattr(entry, "is_absolute", False):
                begin, end = begin + base, end + base
            if begin <= pc < end:
                return True
        return False
    return True
