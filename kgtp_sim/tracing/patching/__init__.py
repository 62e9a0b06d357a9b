"""Tracing's second layer: probes, from a planned location to code patched into the kernel.

Instruction decoding, probe sites and relocation (`probes`), the plan of a location before anything is written
(`placement.Installed`), the native detours a compiled location jumps into (`detour`, `fastpath`), and code
retired once no CPU can be in it (`retire`). Imports only `core` and the packages below tracing.
"""
