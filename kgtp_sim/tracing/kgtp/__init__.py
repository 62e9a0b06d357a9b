"""Tracing's fourth layer: KGTP's features built on the hit paths.

Return probes (`kret`, `$kret`), direct output and the variables that act at a hit (`printk`: `$printk_level`,
`$dump_stack`, `$enable`/`$disable`, `$current`), and watch tracepoints on the debug registers (`watch`). Imports
`engines`, `patching` and `core`; `tracer.Tracer`, above it, composes them into a run.
"""
