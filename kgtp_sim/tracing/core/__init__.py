"""Tracing's bottom layer: the vocabulary every other layer speaks.

Tracepoints, actions and status (`model`), frames and their blocks (`frames`), the per-CPU ring buffer (`ring`),
the clock (`clock`), KGTP's special and per-CPU variables (`builtins`, `percpu`), static-marker data (`sdata`),
GDB's trace files (`tfile`), and the run as the layers above see it (`run.Run`). Imports only agent/, machine/
and arch/ below tracing.
"""
