"""Seeing a trace: frames followed live, recorded to disk, exported with names (CTF, Chrome trace events, JSON
lines), and drawn.

`channel` talks to the stub's read-only follow channel; `sources` reads a run a piece at a time from it (its
drain), from a tsave'd file or from a recorded trace, into `model`'s run and `batch`'s columns of frames;
`layout` sorts frames by the shape of their blocks, `cexpr` and `fields` turn one frame's registers and memory
into the named values tdump shows, `decode` does it for a run of frames of one shape at once; `ctf` writes and
reads CTF streams; `follow`, `record`, `export`, `plot` and `hotcode` are the `kgtp-sim` commands built on them.
"""
