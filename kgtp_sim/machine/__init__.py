"""The simulated machine: the kernel ELF, a unicorn x86_64 CPU, its interrupts, devices and run loop.

See docs/DESIGN.md (address space, devices, interrupts, marker table) for the contracts with the other layers.
"""

from ..uc_paging import AddressSpace
from .cpu import FaultFixups, Stop
from .errors import KernelImageError, MachineError, MemoryFault
from .image import KernelImage, Segment, Symbol
from .layout import DEMAND_BASE, DEMAND_SIZE, MODULE_BASE, MODULE_SIZE, VMALLOC_BASE, VMALLOC_SIZE
from .machine import Machine, MachineStats
from .markers import SITE_NOP, FieldKind, Marker, MarkerField

__all__ = [
    "AddressSpace",
    "DEMAND_BASE",
    "DEMAND_SIZE",
    "FaultFixups",
    "FieldKind",
    "KernelImage",
    "KernelImageError",
    "MODULE_BASE",
    "MODULE_SIZE",
    "Machine",
    "MachineError",
    "MachineStats",
    "Marker",
    "MarkerField",
    "MemoryFault",
    "SITE_NOP",
    "Segment",
    "Stop",
    "Symbol",
    "VMALLOC_BASE",
    "VMALLOC_SIZE",
]
