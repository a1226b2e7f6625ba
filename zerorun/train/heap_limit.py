"""A ceiling on a CPU rank's tcmalloc page heap (launcher.heap_limit_mib): its share of the host's RAM, never
below the gate's bound.

tcmalloc keeps freed spans for reuse and grows its heap when no free span fits the next block, so over a step's
allocation order the heap can hold far more than the live tensors, and it grows for several steps: a GPT-2
small rank (ZeRO-0, fp32, micro 5 x 144) peaked at 2,094 MiB live but 3,110 MiB resident at step 3 and 3,230 at
step 5 (docs/memory.md §5.7). gperftools' heap limit (``tcmalloc.heap_limit_mb``, settable at run time) makes
the page heap return free spans to the OS before it grows past the ceiling, and fails an allocation only when
live memory alone needs more: an out-of-memory error the supervisor answers with a smaller micro-batch. Holding a
rank costs the churn of returning and re-faulting spans (10-21% slower steps measured), so the ceiling sits where
the rank would otherwise take RAM the node does not have (its capacity in estimate.json: available RAM, capped by
the cgroup, per rank), or at its bound where that is higher (gate=warn or off let it past the capacity).
"""
from __future__ import annotations

import ctypes
import os
from typing import Any, Dict, Mapping, Optional

from ..allocators import running
from ..config.schema import Allocator
from ..telemetry import rss_status
from .memory_report import rank_figures

MIB = 2**20
PROPERTY = b"tcmalloc.heap_limit_mb"
USERS_ENV = "TCMALLOC_HEAP_LIMIT_MB"
"""gperftools reads this at start-up: a limit the user set wins, as their LD_PRELOAD does."""


def ceiling_bytes(setting_mib: int, bound: Optional[int], capacity: Optional[int], resident: int,
                  heap_resident: int) -> int:
    """The heap limit for ``launcher.heap_limit_mib`` in bytes, 0 for none. 0: none; N: N MiB; -1: the larger of
    the rank's ``bound`` and its ``capacity`` (its share of the host's RAM), less what is resident outside the heap
    now (the interpreter, libraries, mapped files), so the rank's resident set stays under it. Pure."""
    if setting_mib > 0:
        return setting_mib * MIB
    target = max(bound or 0, capacity or 0)
    if setting_mib == 0 or not target:
        return 0
    return max(MIB, target - max(0, resident - heap_resident))


class Tcmalloc:
    """gperftools' MallocExtension C API in this process (``here()``: None where tcmalloc is not what runs)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(None)
        self._get, self._set = lib.MallocExtension_GetNumericProperty, lib.MallocExtension_SetNumericProperty
        self._get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)]
        self._set.argtypes = [ctypes.c_char_p, ctypes.c_size_t]

    @classmethod
    def here(cls) -> Optional["Tcmalloc"]:
        try:
            return cls() if running() == Allocator.tcmalloc.value else None
        except (OSError, AttributeError):  # a tcmalloc without the C API: nothing to control
            return None

    def get(self, name: str) -> int:
        value = ctypes.c_size_t(0)
        return value.value if self._get(name.encode(), ctypes.byref(value)) else 0

    def heap_resident(self) -> int:
        """Pages the heap holds from the OS: its size less what it has returned (unmapped)."""
        return self.get("generic.heap_size") - self.get("tcmalloc.pageheap_unmapped_bytes")

    def set_limit(self, limit: int) -> bool:
        return bool(self._set(PROPERTY, -(-limit // MIB)))


def small_object_cache_bytes() -> int:
    """What this rank's tcmalloc holds free in its small-object caches now (thread caches, the transfer and central
    free lists; not the page heap's free spans), 0 where tcmalloc is not what runs: the allocator's own retention,
    which the estimate's "heap retention" term predicts. Measured on a Qwen3 ZeRO-0 rank (AMD EPYC, 1 and 2
    threads) at ~10 MiB (thread caches 4.5-5.5, central 2.9, transfer 1.3-1.7), well under the 32 MiB
    ``tcmalloc.max_total_thread_cache_bytes`` the term is capped at (docs/memory.md §5.4)."""
    tc = Tcmalloc.here()
    return sum(tc.get(f"tcmalloc.{n}_free_bytes") for n in ("thread_cache", "central_cache", "transfer_cache")) \
        if tc else 0


def outside_heap_bytes() -> int:
    """What this rank holds resident outside its tcmalloc heap now (interpreter arenas, thread stacks, library pages
    the run has touched since the ceiling was set), 0 where tcmalloc is not what runs: the ceiling holds the heap,
    so a rank's resident set stays under the ceiling plus this."""
    tc = Tcmalloc.here()
    return max(0, rss_status().get("VmRSS", 0) - tc.heap_resident()) if tc else 0


def applies(setting_mib: int, accelerator: str, allocator, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether CPU ranks on ``allocator`` will set a ceiling: tcmalloc, a setting other than 0, and no
    TCMALLOC_HEAP_LIMIT_MB of the user's (the launch line and zerorun-estimate say so where it does). Pure."""
    return (accelerator == "cpu" and Allocator(allocator) == Allocator.tcmalloc and setting_mib != 0
            and not environ.get(USERS_ENV))


def apply(setting_mib: int, estimate: Mapping[str, Any], rank: int, stage: Optional[int] = None,
          environ: Mapping[str, str] = os.environ) -> Dict[str, Any]:
    """Set this rank's ceiling (after the build and any resume: what is resident outside the heap has settled) and
    say what was done, for summary.json: {"limit_bytes": 0} where nothing was set, with the reason."""
    if setting_mib == 0:
        return {"limit_bytes": 0, "why": "launcher.heap_limit_mib=0"}
    if environ.get(USERS_ENV):
        return {"limit_bytes": 0, "why": f"your {USERS_ENV}={environ[USERS_ENV]} is in effect"}
    tc = Tcmalloc.here()
    if tc is None:
        return {"limit_bytes": 0, "why": "tcmalloc is not this rank's allocator"}
    resident, heap = rss_status().get("VmRSS", 0), tc.heap_resident()
    bound = rank_figures(estimate, rank, stage)[1]
    capacity = estimate.get("device_capacity_bytes", 0) if str(estimate.get("device", "")).startswith("cpu") else 0
    limit = ceiling_bytes(setting_mib, bound, capacity, resident, heap)
    live = tc.get("generic.current_allocated_bytes")
    if not limit:
        return {"limit_bytes": 0, "why": "no bound or capacity in estimate.json"}
    if limit <= live:  # live memory already passes it: a ceiling would only fail the first step
        return {"limit_bytes": 0, "why": f"{live / MIB:.0f} MiB already live, above the ceiling of {limit / MIB:.0f}"}
    if not tc.set_limit(limit):
        return {"limit_bytes": 0, "why": "tcmalloc refused tcmalloc.heap_limit_mb"}
    why = (f"launcher.heap_limit_mib={setting_mib}" if setting_mib > 0 else
           "the rank's share of host RAM" if (capacity or 0) >= (bound or 0) else "the gate's bound")
    return {"limit_bytes": limit, "outside_heap_bytes": max(0, resident - heap), "why": why}
