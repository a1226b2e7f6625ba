"""§5.6 The bound: the point estimate plus what each of its terms may be off by, so the gate decides on "at
most" rather than on a point and a flat margin.

Every component of the peak is one of four kinds, and its uncertainty is how well that kind was established
(docs/memory.md §5.6; the widths are the spreads measured there, not fitted to a set):

    counted   tensors zerorun counts byte by byte (states, activations, buffers): tensor level within 4%
    measured  measured on this machine (the process baseline, a calibration's correction): run-to-run spread
    prior     a constant from other machines or the literature (CUDA context, NCCL, allocator margin): wide
    heap      what glibc keeps resident beyond live tensors on CPU ranks: wide, and wider when the mmap
              threshold keeps every activation on the heap (0 or 32 MiB), where fragmentation follows the
              allocation order (measured -37% to +80% of the whole figure on shapes never fitted)

Counted terms err together (one model of the step), so they add linearly; the other terms are independent of
it and of each other and add in quadrature. The bound is one-sided: what can run out is the high side.
"""
from __future__ import annotations

import math
from typing import Dict, Mapping

from ..config.rules import CPU_MMAP_THRESHOLD
from ..config.schema import Allocator
from .priors import counted_bytes

COUNTED = 0.04
"""Tensor level: the allocator peak within median 0.04%, worst 4.0% (tests/integration/test_memory_validation.py)."""
MEASURED_PROCESS = 0.05
"""The process baseline measured here: 423-425 MiB on every rank of one machine, tens of MiB between machines."""
PRIOR_PROCESS = 0.20
"""The 430 MiB prior where nothing was measured: another machine sat 63-72 MiB (15-17%) higher."""
CORRECTION_SPREAD = 0.03
"""A calibrated config: identical runs differ by up to ~3% of the whole figure with the heap untrimmed."""
HEAP_VALIDATED = 0.5
"""heap retention at the 1 MiB threshold: measured 1.4-2.5 bytes per heap byte against the 2.0 counted."""
HEAP_UNTRIMMED = 1.0
"""mmap off / 32 MiB, and allocators no held-out set has validated (jemalloc, mimalloc): the resident heap beyond
live tensors depends on the order blocks are freed and reused. Measured on shapes never fitted: up to 0.87 of
the bytes counted at the peak above the point estimate (GPT-2 small, ZeRO-3, fp32, checkpointing, mmap off:
4,605 MiB against 2,692; 0.75 let that rank through, issue 33): the heap may hold a second copy of them."""
HEAP_TCMALLOC = 0.05
"""tcmalloc at release rate 0 (allocators.TCMALLOC_ENV), beside two misplaced large blocks (page_heap.placement_bytes):
what its size classes and page heap keep of the smaller blocks beyond the point, per counted byte. On the 81
ranks of dev sets 1795866645 and 1795869163 (the first drawn at rate 0) the point's misses were within two large
blocks and this; at the default release rate, whose returned spans never coalesce with free ones, 0.33 of the
counted bytes was needed (docs/memory.md §5.4)."""
PRIORS = {  # (relative width, where nothing measured the term)
    "CUDA context": 0.3,        # 1,723 MiB measured on an H100 (CUDA 13); 287-1,343 MB on older stacks (§5.2)
    "NCCL buffers": 1.0,        # 1 GiB prior; 0.2-2 GiB (§5.2)
    "allocator margin": 1.0,    # 5-15% of the allocator peak (§5.2)
    "allocator and runtime overhead": 0.5,  # 35-80 MiB measured against 32-64 MiB counted (§5.4)
}


def term_widths(components: Mapping[str, int], *, accelerator: str, process_measured: bool,
                mmap_threshold: int = CPU_MMAP_THRESHOLD, calibrated: bool = False,
                allocator: Allocator = Allocator.glibc, placement: int = 0) -> Dict[str, int]:
    """Each uncertain part of the figure, in bytes on the high side: the counted tensors together, then every
    other term on its own. ``placement``: what a preloaded allocator's heap may hold beyond its term for where
    blocks land (page_heap.placement_bytes)."""
    counted = counted_bytes(components)
    widths: Dict[str, int] = {"counted tensors": int(COUNTED * counted)}
    for name, width in PRIORS.items():
        if components.get(name):
            widths[name] = int(width * components[name])
    if "process runtime" in components:
        widths["process runtime"] = int((MEASURED_PROCESS if process_measured else PRIOR_PROCESS)
                                        * components["process runtime"])
    if accelerator == "cpu":
        widths.update(heap_width(Allocator(allocator), mmap_threshold, counted, components.get("heap retention", 0)))
        if placement and Allocator(allocator) == Allocator.tcmalloc:
            widths["misplaced large blocks (tcmalloc)"] = placement
    if calibrated:  # the correction measured this config here: what is left is run-to-run spread
        widths = {"run to run (calibrated)": int(CORRECTION_SPREAD * sum(components.values()))}
    return {k: v for k, v in widths.items() if v > 0}


def heap_width(allocator: Allocator, mmap_threshold: int, counted: int, heap: int) -> Dict[str, int]:
    """What a CPU rank's allocator may keep resident beyond the heap term, by allocator: validated ones by their
    measured spread, the others (jemalloc, mimalloc, glibc with mmap off or at 32 MiB) by a whole second copy
    of the tensors."""
    if allocator == Allocator.tcmalloc:
        return {"heap retention (tcmalloc)": int(HEAP_TCMALLOC * counted)}
    if allocator == Allocator.glibc and mmap_threshold <= CPU_MMAP_THRESHOLD:
        return {"heap retention": int(HEAP_VALIDATED * heap)}
    what = "mmap off or 32 MiB" if allocator == Allocator.glibc else allocator.value
    return {f"heap ({what}, not validated)": int(HEAP_UNTRIMMED * counted)}


def upper_bound(point: int, widths: Mapping[str, int]) -> int:
    """The point estimate plus the counted tensors' width and the others' in quadrature."""
    counted = widths.get("counted tensors", 0)
    others = [v for k, v in widths.items() if k != "counted tensors"]
    return int(point + counted + math.sqrt(sum(v * v for v in others)))

