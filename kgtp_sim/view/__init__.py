"""Seeing a trace: frames followed live, exported with names (CTF, Chrome trace events, JSON lines), and drawn.

`channel` talks to the stub's read-only follow channel; `model` holds a run (definitions and frames) loaded
from it or from a tsave'd file; `dwarf`, `cexpr` and `fields` turn a frame's raw registers and memory into the
named values tdump shows; `follow`, `export`, `plot` and `hotcode` are the `kgtp-sim` commands built on them.
"""
