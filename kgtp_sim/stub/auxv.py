"""A traced process's auxiliary vector and program path, read from its stack (what Linux keeps for
/proc/PID/auxv and the exe link; the kernel here keeps no copy): at its first instruction, or later, under its
stack's top, where the kernel's exec put them. The gdbserver role's process target (stub/process.py) reads them
once, for `qXfer:auxv:read` and `qXfer:exec-file:read`.

Runs on the server thread, where the process target is made.
"""

from __future__ import annotations

import struct

from ..machine.tracee import TASK_SIZE_MAX, Tracee

#: auxv entries are (type, value) pairs of 64-bit words, ended by AT_NULL
_AT_NULL, _AT_EXECFN = 0, 31
#: the top of a process's stack (fixtures/kernel/include/process.h: STACK_TOP, Linux's without randomization)
_STACK_TOP = TASK_SIZE_MAX


def initial_auxv(tracee: Tracee) -> bytes:
    """The auxiliary vector the kernel gave the program, read at its first instruction (the stack is then as
    exec left it: argc, argv, NULL, envp, NULL, auxv), as Linux keeps a copy for /proc/PID/auxv."""
    rsp = tracee.registers()["rsp"]
    words = 4096 // 8
    stack = tracee.read_memory(rsp, 8 * words)
    values = struct.unpack(f"<{len(stack) // 8}Q", stack[: len(stack) // 8 * 8])
    at = 1 + values[0] + 1  # past argc, argv, argv's NULL
    while at < len(values) and values[at]:
        at += 1
    at += 1  # envp's NULL
    start = at
    while at + 1 < len(values) and values[at] != _AT_NULL:
        at += 2
    return struct.pack(f"<{at + 2 - start}Q", *values[start: at + 2]) if at + 1 < len(values) else b""


def auxv_below_stack_top(tracee: Tracee) -> tuple[str, bytes]:
    """The program's path and auxiliary vector of a process that has run since its exec: the kernel's exec
    (process.c: do_execve) put the path's string right under the stack's top, and the vector, whose AT_EXECFN
    entry points at that string, below the other strings; the vector begins after envp's NULL (the first pair
    whose type is no AT_ number). Linux keeps a copy (mm->saved_auxv); the kernel here keeps none."""
    top = _STACK_TOP - 8
    window = 4 * 4096  # the strings (at most the spawn request's 4096 bytes) and the words below them
    stack = tracee.read_memory(top - window, window)
    if len(stack) < window:
        return "", b""
    end = window - 1  # the path's NUL
    start = stack.rfind(b"\0", 0, end) + 1
    path = stack[start:end].decode("utf-8", "surrogateescape")
    execfn = top - window + start
    entry = struct.pack("<QQ", _AT_EXECFN, execfn)
    at = next((i for i in range((start - 16) // 8 * 8, -1, -8) if stack[i: i + 16] == entry), None)
    if at is None:
        return path, b""
    first = at
    while first >= 16 and 0 < int.from_bytes(stack[first - 16: first - 8], "little") < 64:
        first -= 16
    last = at
    while last + 16 <= len(stack) and int.from_bytes(stack[last: last + 8], "little") != _AT_NULL:
        last += 16
    return path, stack[first: last + 16]
