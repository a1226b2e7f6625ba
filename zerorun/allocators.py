"""Which malloc a CPU rank runs, and how it is started (LD_PRELOAD and its settings).

PyTorch's CPU launcher (``python -m torch.backends.xeon.run_cpu``) and Intel's preload tcmalloc, else jemalloc,
for CPU training: glibc's malloc either returns every large freed block to the OS (the 1 MiB threshold: each
activation is page-faulted anew every step) or keeps a heap whose size follows the allocation order (mmap
off). tcmalloc reuses freed spans page by page: on the paired GPT-2 benchmark it ran ~1.6x faster than glibc
at 1 MiB for ~7% more resident memory (README "CPU ranks' allocator"). ``resolve`` is pure given where the
libraries are (``find_library``, the one look at the machine); the gate plans for what it returns.
"""
from __future__ import annotations

import glob
import os
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Sequence

from .config.schema import Allocator

PRELOADED = (Allocator.tcmalloc, Allocator.jemalloc, Allocator.mimalloc)
AUTO_ORDER = (Allocator.tcmalloc, Allocator.jemalloc)
"""auto's preference, PyTorch's CPU launcher's: tcmalloc, else jemalloc, else glibc. mimalloc ran the paired
benchmark slower than both (issue 33's table), so auto does not pick it; launcher.allocator=mimalloc does."""

LIBRARY_NAMES = {
    Allocator.tcmalloc: ("libtcmalloc.so", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc_minimal.so.4"),
    Allocator.jemalloc: ("libjemalloc.so", "libjemalloc.so.2"),
    Allocator.mimalloc: ("libmimalloc.so", "libmimalloc.so.2"),
}
INSTALL_HINT = {
    Allocator.tcmalloc: "apt-get install libtcmalloc-minimal4 (Debian/Ubuntu), or conda install -c conda-forge gperftools",
    Allocator.jemalloc: "apt-get install libjemalloc2 (Debian/Ubuntu), or conda install -c conda-forge jemalloc",
    Allocator.mimalloc: "apt-get install libmimalloc2.0 (Debian/Ubuntu), or pip install cmeel-mimalloc",
}

JEMALLOC_CONF = "oversize_threshold:1,background_thread:true,metadata_thp:auto,dirty_decay_ms:-1,muzzy_decay_ms:-1"
"""run_cpu's MALLOC_CONF with purging off: freed pages stay mapped for the next step (jemalloc's defaults purge
them within seconds and ran no faster than glibc at 1 MiB)."""
TCMALLOC_ENV = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40), "TCMALLOC_RELEASE_RATE": "0"}
"""tcmalloc prints a line with a stack for every allocation above 1 GiB (a GPT-2 XL weight, a logits tensor): the
threshold quiets it. Release rate 0: tcmalloc keeps freed spans instead of returning one to the OS every ~1,000
freed pages, because a returned span never coalesces with a free neighbour that was not returned (gperftools
page_heap.cc ``CheckAndHandlePreMerge``): the returned pieces cut the logits' and the step's freed spans, and the
next large block grows the heap. GPT-2 small, ZeRO-1, CPU offload, bf16, micro 14 x 288, one rank: 4,064 MiB peak
RSS at the default rate, 3,567 at 0; ZeRO-3 fp32 on 2 ranks: 4,276/4,273 against 3,953/3,953 (docs/memory.md §5.4)."""


SEARCH_ENV = "ZERORUN_ALLOCATOR_DIRS"
"""Colon-separated directories to look for the allocators' libraries in instead of the usual ones (a library
installed somewhere unusual; the tests use it to hide one)."""


def search_dirs(environ: Mapping[str, str] = os.environ) -> list:
    """Where run_cpu looks (conda, the venv, ~/.local, /usr/local, /usr), the multiarch dirs Debian installs into,
    and a ``cmeel.prefix`` (PyPI's cmeel-mimalloc) under this interpreter's prefix; ZERORUN_ALLOCATOR_DIRS
    replaces them all."""
    if environ.get(SEARCH_ENV) is not None:
        return [d for d in environ[SEARCH_ENV].split(":") if d]
    dirs = [f"{environ[v]}/lib" for v in ("CONDA_PREFIX", "VIRTUAL_ENV") if environ.get(v)]
    dirs += [f"{sys.prefix}/lib", *glob.glob(f"{sys.prefix}/lib/python3*/site-packages/cmeel.prefix/lib"),
             os.path.expanduser("~/.local/lib") if environ.get("HOME") else "",
             "/usr/local/lib", "/usr/local/lib64", "/usr/lib", "/usr/lib64", "/lib",
             *glob.glob("/usr/lib/*-linux-gnu"), *glob.glob("/lib/*-linux-gnu")]
    return [d for d in dict.fromkeys(dirs) if d]


def find_library(name: Allocator, dirs: Optional[Sequence[str]] = None) -> str:
    """The path of ``name``'s shared library on this machine, or ''."""
    for d in search_dirs() if dirs is None else dirs:
        for lib in LIBRARY_NAMES.get(name, ()):
            path = os.path.join(d, lib)
            if os.path.isfile(path):
                return path
    return ""


@dataclass(frozen=True)
class Resolved:
    """The allocator CPU ranks will run: its name (never auto), the library to preload ('' for glibc or a
    user's own LD_PRELOAD), the one line the launch prints, and whether the user's environment decided."""
    name: Allocator
    library: str = ""
    why: str = ""
    users_own: bool = False


def preloaded_by(ld_preload: str) -> Optional[Allocator]:
    """The allocator a user's LD_PRELOAD loads, if any."""
    for part in ld_preload.replace(" ", ":").split(":"):
        base = os.path.basename(part)
        for name in PRELOADED:
            if base.startswith(f"lib{name.value}"):
                return name
    return None


def resolve(choice: Allocator, environ: Mapping[str, str], find: Callable[[Allocator], str] = find_library,
            gpu_ranks: bool = False) -> Resolved:
    """``launcher.allocator`` made concrete for this node. A user's LD_PRELOAD wins; auto takes the first of
    AUTO_ORDER installed (GPU ranks: glibc); an explicit choice that is not installed falls back the same way,
    and the line says how to install it."""
    choice = Allocator(choice)
    own = environ.get("LD_PRELOAD", "").strip()
    if own:
        name = preloaded_by(own) or Allocator.glibc
        return Resolved(name, "", f"{name.value} (your LD_PRELOAD={own} wins over launcher.allocator)", users_own=True)
    if choice == Allocator.glibc or (choice == Allocator.auto and gpu_ranks):
        return Resolved(Allocator.glibc, "", "glibc" + (" (GPU ranks keep glibc unless launcher.allocator is set)"
                                                         if gpu_ranks and choice == Allocator.auto else ""))
    wanted = [choice] if choice != Allocator.auto else []
    missing = []
    for name in [*wanted, *(n for n in AUTO_ORDER if n not in wanted)]:
        path = find(name)
        if path:
            if name == choice:
                return Resolved(name, path, f"{name.value} ({path}; launcher.allocator={choice.value})")
            if missing:
                return Resolved(name, path, f"{name.value} ({path}): {missing[0].value} is not installed "
                                            f"({INSTALL_HINT[missing[0]]}; it runs faster)")
            return Resolved(name, path, f"{name.value} ({path}; the fastest installed, as PyTorch's CPU launcher picks)")
        missing.append(name)
    first = missing[0]
    return Resolved(Allocator.glibc, "", f"glibc: {first.value} is not installed ({INSTALL_HINT[first]}; "
                                         "~1.6x faster steps on CPU ranks)")


def env_for(resolved: Resolved, environ: Mapping[str, str] = os.environ) -> Dict[str, str]:
    """What a rank's environment gets for a preloaded allocator (glibc's settings are launcher.rank_env's)."""
    env: Dict[str, str] = {}
    if resolved.name not in PRELOADED:
        return env
    if resolved.library and not resolved.users_own:
        env["LD_PRELOAD"] = resolved.library
    if resolved.name == Allocator.tcmalloc:
        env.update({k: v for k, v in TCMALLOC_ENV.items() if k not in environ})  # yours win
    if resolved.name == Allocator.jemalloc and "MALLOC_CONF" not in environ:  # a MALLOC_CONF you set wins
        env["MALLOC_CONF"] = JEMALLOC_CONF
    return env


def running() -> str:
    """The allocator this process runs, from its own mappings (what summary.json reports: the truth, whatever
    was asked for)."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "unknown"
    for name in PRELOADED:
        if f"/lib{name.value}" in maps:
            return name.value
    return Allocator.glibc.value


def with_allocator(cfg, accelerator: str, environ: Mapping[str, str] = os.environ, find=find_library):
    """(``cfg`` with launcher.allocator concrete, the resolution): what the gate plans for and the ranks run."""
    import dataclasses

    resolved = resolve(cfg.launcher.allocator, environ, find, gpu_ranks=accelerator != "cpu")
    return dataclasses.replace(cfg, launcher=dataclasses.replace(cfg.launcher, allocator=resolved.name)), resolved


def library_for(name: Allocator, environ: Mapping[str, str] = os.environ) -> str:
    """The library to preload for an allocator already resolved ('' for glibc, or when LD_PRELOAD is the user's)."""
    if Allocator(name) not in PRELOADED or environ.get("LD_PRELOAD", "").strip():
        return ""
    return find_library(Allocator(name))


def concrete(launcher_cfg, accelerator: str = "cpu") -> Allocator:
    """launcher.allocator as the estimates see it (pure): the launch and zerorun-estimate resolve auto on the node
    first (with_allocator); an unresolved auto plans as glibc, what runs where no other allocator is installed."""
    name = Allocator(launcher_cfg.allocator)
    return Allocator.glibc if name == Allocator.auto else name


def rank_env_args(launcher_cfg, accelerator: str = "cpu") -> Dict[str, object]:
    """launcher.rank_env's allocator arguments for a config (the probes run what the ranks will): auto resolved
    on this node."""
    name = Allocator(launcher_cfg.allocator)
    if name == Allocator.auto:
        name = resolve(name, os.environ, gpu_ranks=accelerator != "cpu").name
    return {"allocator": name.value, "allocator_library": library_for(name), "mkl_fast_mm": launcher_cfg.mkl_fast_mm}


MKL_FAST_MM_OFF = "MKL_DISABLE_FAST_MM"
"""Any value turns MKL's buffer cache off (launcher.mkl_fast_mm): each GEMM frees its packing buffers."""


def mkl_env(name: Allocator, mkl_fast_mm: bool, environ: Mapping[str, str] = os.environ) -> Dict[str, str]:
    """What a CPU rank's environment gets for MKL's GEMM buffers. On tcmalloc MKL's cached buffers cut the
    activations' freed spans, and freed per call they cost a page heap lookup: off unless launcher.mkl_fast_mm
    (an MKL_DISABLE_FAST_MM you set wins). glibc at 1 MiB would page-fault them anew each call: there MKL keeps
    them."""
    if Allocator(name) == Allocator.tcmalloc and not mkl_fast_mm and MKL_FAST_MM_OFF not in environ:
        return {MKL_FAST_MM_OFF: "1"}
    return {}


def mkl_buffers_kept(launcher_cfg, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether MKL keeps its GEMM buffers on a tcmalloc rank: the variable is in neither your environment nor
    what mkl_env adds."""
    return MKL_FAST_MM_OFF not in environ and not mkl_env(Allocator.tcmalloc, launcher_cfg.mkl_fast_mm, environ)


def memory_mode(launcher_cfg, mmap_threshold: int) -> str:
    """What a CPU rank's allocator does with freed memory, for the keys measurements are stored under."""
    name = concrete(launcher_cfg)
    if name == Allocator.tcmalloc:  # what it returns to the OS decides its heap: yours, else TCMALLOC_ENV's
        rate = os.environ.get('TCMALLOC_RELEASE_RATE', TCMALLOC_ENV['TCMALLOC_RELEASE_RATE'])
        return f"tcmalloc-release{rate}-mklmm{int(mkl_buffers_kept(launcher_cfg))}"
    return f"mmap{mmap_threshold}" if name == Allocator.glibc else name.value


def small_block_threshold(launcher_cfg, accelerator: str = "cpu") -> int:
    """The size below which the RSS estimate counts freed activations as heap retention: glibc's mmap threshold;
    a preloaded allocator's size classes keep small blocks as glibc's heap does below 1 MiB, and what it keeps of
    larger ones is its page heap, a term of its own (memory/page_heap.py)."""
    from .config.rules import CPU_MMAP_THRESHOLD, mmap_threshold_bytes

    if concrete(launcher_cfg, accelerator) in PRELOADED:
        return CPU_MMAP_THRESHOLD
    return mmap_threshold_bytes(launcher_cfg.mmap_threshold_mib)


def heap_threshold_bytes(launcher_cfg, accelerator: str = "cpu") -> int:
    """From what size a freed block goes back to the OS on a rank, as the estimates and the speed model see it:
    glibc's mmap threshold; none for a preloaded allocator (tcmalloc keeps freed spans for reuse, jemalloc with
    purging off and mimalloc too), so every activation counts as heap (MMAP_OFF_BYTES)."""
    from .config.rules import MMAP_OFF_BYTES, mmap_threshold_bytes

    if concrete(launcher_cfg, accelerator) in PRELOADED:
        return MMAP_OFF_BYTES
    return mmap_threshold_bytes(launcher_cfg.mmap_threshold_mib)
