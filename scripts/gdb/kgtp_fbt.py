"""kgtp-fbt: function-boundary tracing for GDB on kgtp-sim, after DTrace's FBT provider (`dtrace -n 'fbt:::entry'`).

Load it in GDB with `source scripts/gdb/kgtp_fbt.py` (kept beside the project's other scripts, as Linux keeps its
GDB scripts under scripts/gdb). Commands:

    kgtp-fbt PATTERN [entry|return|both] [collect EXPR[, EXPR...]]
        One tracepoint at the entry (`trace *FUNCTION`) and one at the return (`trace *FUNCTION` with
        `teval $kret=0`, KGTP's return probe) of every kernel function whose name matches the glob PATTERN
        (`*`, `do_*`, `kgtp_test_function`), both by default; `collect ...` is added to their actions. Functions
        that cannot take a probe are left out and said why: the stub decides (`monitor fbt`), by the rules its
        probes follow (optprobes' placement, return probes only on functions entered by a call that return).
    info kgtp-fbt [PATTERN]
        The tracepoints kgtp-fbt created (number, entry or return, function, the probe the stub will use) and
        the functions it left out, with the reason.
    delete kgtp-fbt [PATTERN]
        Delete the tracepoints kgtp-fbt created (for the functions matching PATTERN).

The tracepoints are ordinary GDB tracepoints: `tstart`, `tstop`, `tfind`, `info tracepoints` see them as any
other. Runs inside GDB (13.1 and later), on GDB's own Python.
"""

import fnmatch
import os
import re
import tempfile

import gdb

ROW = re.compile(r"^(0x[0-9a-f]+)\s+entry (\S+)\s+return (\S+)\s+(\S+)(?:\s+--\s+(.*))?$")
KINDS = ("entry", "return", "both")


class Function:
    """One function as the stub's `monitor fbt` lists it."""

    def __init__(self, match):
        address, entry, returns, name, notes = match.groups()
        self.address = int(address, 16)
        self.name = name
        self.entry = "" if entry == "none" else entry
        self.returns = returns == "yes"
        self.notes = dict(note.split(": ", 1) for note in (notes or "").split("; ") if ": " in note)


def functions():
    """Every kernel function and its probes, from the stub."""
    try:
        text = gdb.execute("monitor fbt", to_string=True)
    except gdb.error as error:
        raise gdb.GdbError(f"kgtp-fbt: the target does not list its functions ({error}); connect to kgtp-sim "
                           "(target remote) first")
    found = [Function(m) for m in map(ROW.match, text.splitlines()) if m]
    if not found:
        raise gdb.GdbError("kgtp-fbt: the target does not list its functions (monitor fbt); is it kgtp-sim?")
    return found


class Registry:
    """What kgtp-fbt created in this GDB session, and what it left out."""

    def __init__(self):
        self.created = {}  # tracepoint number -> (function, "entry" or "return", probe)
        self.left_out = {}  # (function, "entry" or "return") -> why

    def alive(self):
        """The tracepoints kgtp-fbt created that still exist (the user may have deleted some)."""
        numbers = set(map(int, re.findall(r"^(\d+)\s+tracepoint", gdb.execute("info tracepoints", to_string=True),
                                          re.M)))
        self.created = {n: row for n, row in self.created.items() if n in numbers}
        return self.created


REGISTRY = Registry()
#: the numbers of the tracepoints the script being sourced created (`$tpnum` after each; the script's `python`
#: lines may run in another namespace than this file's, so the list hangs on the gdb module)
MADE = gdb.kgtp_fbt_made = []


def _parse(arg):
    words = arg.split()
    if not words:
        raise gdb.GdbError("usage: kgtp-fbt PATTERN [entry|return|both] [collect EXPR[, EXPR...]]")
    pattern, rest = words[0], arg.split(None, 1)[1] if len(words) > 1 else ""
    kind = "both"
    first = rest.split(None, 1)
    if first and first[0] in KINDS:
        kind, rest = first[0], first[1] if len(first) > 1 else ""
    collect = ""
    if rest:
        if not rest.startswith("collect"):
            raise gdb.GdbError(f"kgtp-fbt: expected entry, return, both or collect, not {rest.split()[0]!r}")
        collect = rest[len("collect"):].strip()
        if not collect:
            raise gdb.GdbError("kgtp-fbt: collect what?")
    return pattern, kind, collect


class FbtCommand(gdb.Command):
    """Trace the entry and return of every kernel function matching a glob: kgtp-fbt PATTERN [entry|return|both]
[collect EXPR[, EXPR...]]. Functions that cannot take a probe are left out (info kgtp-fbt says why)."""

    def __init__(self):
        super().__init__("kgtp-fbt", gdb.COMMAND_TRACEPOINTS)

    def invoke(self, arg, from_tty):
        pattern, kind, collect = _parse(arg)
        chosen = [f for f in functions() if fnmatch.fnmatchcase(f.name, pattern)]
        if not chosen:
            raise gdb.GdbError(f"kgtp-fbt: no kernel function matches {pattern!r}")
        lines, planned = [], []
        for function in chosen:
            for side in ("entry", "return"):
                if kind not in (side, "both"):
                    continue
                why = (function.notes.get("entry", "cannot take a probe") if not function.entry else
                       function.notes.get("return", "") if side == "return" and not function.returns else "")
                if why:
                    REGISTRY.left_out[(function.name, side)] = why
                    continue
                REGISTRY.left_out.pop((function.name, side), None)
                lines.append(f"trace *{function.address:#x}")
                actions = (["teval $kret=0"] if side == "return" else []) + ([f"collect {collect}"] if collect else [])
                if actions:
                    lines += ["actions", *actions, "end"]
                lines.append("python gdb.kgtp_fbt_made.append(int(gdb.parse_and_eval('$tpnum')))")
                shared = side == "return" or (function.returns and kind == "both")  # kret.py: one int3 for both
                planned.append((function.name, side, "int3" if shared else function.entry))
        MADE.clear()
        try:
            _source(lines)
        finally:  # what GDB created before an error is still kgtp-fbt's
            REGISTRY.created.update(zip(MADE, planned))
        made = list(MADE)
        left = sum(1 for (name, side) in REGISTRY.left_out if any(f.name == name for f in chosen)
                   and kind in (side, "both"))
        entries = sum(1 for _, side, _ in planned if side == "entry")
        print(f"kgtp-fbt: {entries} entry and {len(planned) - entries} return tracepoints on "
              f"{len({name for name, _, _ in planned})} functions"
              + (f" (tracepoints {made[0]}-{made[-1]})" if made else "")
              + (f"; {left} probes left out (info kgtp-fbt says why)" if left else ""))


def _source(lines):
    """Run GDB commands (with `actions` blocks) from a script, as a user's file would."""
    handle, path = tempfile.mkstemp(prefix="kgtp-fbt-", suffix=".gdb")
    try:
        with os.fdopen(handle, "w") as script:
            script.write("\n".join(lines) + "\n")
        gdb.execute(f"source {path}", to_string=True)
    finally:
        os.unlink(path)


class InfoFbtCommand(gdb.Command):
    """The tracepoints kgtp-fbt created, and the probes it left out with the reason: info kgtp-fbt [PATTERN]."""

    def __init__(self):
        super().__init__("info kgtp-fbt", gdb.COMMAND_STATUS)

    def invoke(self, arg, from_tty):
        pattern = arg.strip() or "*"
        created = [(n, row) for n, row in sorted(REGISTRY.alive().items()) if fnmatch.fnmatchcase(row[0], pattern)]
        left = [(key, why) for key, why in sorted(REGISTRY.left_out.items()) if fnmatch.fnmatchcase(key[0], pattern)]
        if not created and not left:
            print("kgtp-fbt: nothing created" + ("" if pattern == "*" else f" for {pattern!r}"))
            return
        print(f"kgtp-fbt: {len(created)} tracepoints")
        if created:
            print(f"{'Num':<6}{'Side':<8}{'Probe':<7}Function")
            for number, (name, side, probe) in created:
                print(f"{number:<6}{side:<8}{probe:<7}{name}")
        if left:
            print(f"left out: {len(left)}")
            for (name, side), why in left:
                print(f"  {name} {side}: {why}")


class DeleteFbtCommand(gdb.Command):
    """Delete the tracepoints kgtp-fbt created: delete kgtp-fbt [PATTERN]."""

    def __init__(self):
        super().__init__("delete kgtp-fbt", gdb.COMMAND_TRACEPOINTS)

    def invoke(self, arg, from_tty):
        pattern = arg.strip() or "*"
        numbers = [n for n, row in sorted(REGISTRY.alive().items()) if fnmatch.fnmatchcase(row[0], pattern)]
        for start in range(0, len(numbers), 200):
            gdb.execute("delete " + " ".join(map(str, numbers[start:start + 200])), to_string=True)
        for number in numbers:
            del REGISTRY.created[number]
        REGISTRY.left_out = {key: why for key, why in REGISTRY.left_out.items()
                             if not fnmatch.fnmatchcase(key[0], pattern)}
        print(f"kgtp-fbt: {len(numbers)} tracepoints deleted")


FbtCommand()
InfoFbtCommand()
DeleteFbtCommand()
