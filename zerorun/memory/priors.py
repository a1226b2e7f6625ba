"""§5.2-§5.5 The terms no tensor count gives: what lives outside PyTorch's allocator, what the allocator keeps
beyond live tensors, and the corrections measured on this machine (zerorun-calibrate), with the key they are
stored under. Priors until something measures them; the bound (bound.py) gives each its width."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

from ..config import Dtype, OffloadDevice, ParallelMode, Plan, RunConfig
from ..allocators import memory_mode
from ..config.rules import fused_loss_on, mmap_threshold_bytes
from ..hardware import GIB, Hardware


@dataclass(frozen=True)
class Calibration:
    """The terms no tensor count gives: what lives outside PyTorch's allocator, what the allocator keeps
    beyond live tensors, and measured corrections for this machine (§5.2-§5.5). GPU terms are priors until
    a calibration on the GPU replaces them (§5.5)."""

    cuda_context_bytes: int = 1723 * 2**20
    """Device memory a GPU rank holds outside PyTorch's allocator: the CUDA context, the kernel images it loads,
    cuBLAS/cuDNN handles, its NCCL group's own state. Measured 1,721-1,725 MiB at all 20 points of `make
    gpu-validate` on an H100 (CUDA 13.0, torch 2.11, driver 580; one rank): the same whatever the model or layout.
    The literature's 287 MB (lazy loading) to 1,343 MB (older CUDA) was the prior before (§5.2); 0.5 GiB
    under-estimated every GPU point by 20-54% (docs/memory.md, GPU validation)."""
    cublas_workspace_bytes: int = 64 * 2**20
    """cuBLAS's and cuBLASLt's workspaces, which PyTorch takes from its caching allocator at the first matmul
    and keeps: 32 MiB each on Hopper and later (less before: counted high). Every GPU point read 64-65 MiB more
    allocated than the tensors counted, at every phase."""
    nccl_bytes: int = 1 * GIB
    """NCCL communicator buffers when more than one rank: ~0.2–2 GiB, more with more communicators (§5.2)."""
    allocator_margin: float = 0.10
    """Caching-allocator fragmentation, reserved − allocated: 5–15% prior (§5.2), with fixed-size segments."""
    allocator_margin_expandable: float = 0.075
    """The same with expandable segments (launcher.expandable_segments, the default): reserved over allocated
    at the peak, 1.3-34.5%, median 7.5%, at the 20 points of `make gpu-validate` on an H100 (ZeRO-0 1-8%; ZeRO-2
    and 3, whose side streams keep their own blocks, 3-17%; CPU offload's small peaks up to 35%). The bound
    widens it by as much again, and the context's width covers the small peaks' absolute excess (≤ 462 MiB)."""
    cpu_process_bytes: int = 430 * 2**20
    """Resident memory of a CPU rank with everything imported (torch, transformers' model code, DeepSpeed and
    its CPU ops, the gloo group) before any tensor: 423-425 MiB measured on every rank of every run of
    benchmarks/rss_validation.py here (torch 2.13, DeepSpeed 0.19.8, transformers 4.57; §5.4)."""
    cuda_process_host_bytes: int = 2 * GIB
    """Host resident memory of a GPU rank beside its host tensors: the CPU figure plus the CUDA runtime and the
    kernel libraries it maps (cuBLAS, cuDNN, NCCL). One rank of zerorun on an H200 (torch 2.11+cu130, GPT-2 small
    ZeRO-2 bf16, summary.json's VmHWM) peaked at 2,533 MiB, 475 MiB of it the fp32 model built on the host: ~2.0
    GiB of process. The 1 GiB prior before it under-estimated that rank's host memory by 40% (§8.5)."""
    cpu_overhead_bytes: int = 32 * 2**20
    """CPU ranks: what a rank's resident set grows by beyond its tensors in training: code paged in by the
    backward and optimizer kernels, small Python and allocator bookkeeping (35-41 MiB measured at ZeRO-0 where
    the activations live in their own mappings; §5.4)."""
    cpu_zero_overhead_bytes: int = 32 * 2**20
    """CPU ranks at ZeRO ≥ 1: the ZeRO optimizer's start-up adds resident memory with no tensor behind it
    (+48 MiB at "built" on tiny GPT-2; 74-80 MiB overhead in all measured at ZeRO-1/2; §5.4)."""
    heap_retention: float = 2.0
    """CPU ranks: resident bytes per byte of saved activations smaller than the mmap threshold, which live on
    the heap and leave it fragmented when freed (measured 1.4-2.5 on GPT-2 small; §5.4)."""
    tcmalloc_thread_caches: int = 32 * 2**20
    """CPU ranks on tcmalloc: the most its thread caches hold of freed small blocks (gperftools'
    ``tcmalloc.max_total_thread_cache_bytes``: 32 MiB in Debian's 2.10 as MallocExtension reports it; a
    ``TCMALLOC_MAX_TOTAL_THREAD_CACHE_BYTES`` you set is not followed here). Beyond it freed objects go back to
    the central lists and their spans to the page heap, so the heap-retention term stops there: glibc's arena
    keeps ``heap_retention`` × the churn, tcmalloc at most this. On the 21 rate-0 ranks whose 2 × churn was above 5%
    of the figure every one read over (+2.4..+25.6%; a Qwen3-MoE ZeRO-1 pair +25% on 198 MiB of the term), §5.4."""
    allocator_caches: Tuple[Tuple[str, int], ...] = ()
    """CPU ranks on tcmalloc: what its small-object caches (thread caches, transfer and central free lists) hold
    free at the end of a micro rank of each kind of run, measured on this machine (process_probe.py, MallocExtension),
    by runtime_overhead_key; replaces the cap above as the heap-retention term of that kind. A Qwen3 ZeRO-0 kind held
    9.7 MiB in its micro rank and 9.5-10 MiB in a real rank of the kind at its loss (AMD EPYC), where the cap said 32.
    """
    runtime_overheads: Tuple[Tuple[str, int], ...] = ()
    """CPU ranks: the overhead above (and the ZeRO one) measured on this machine by a micro rank of each kind of
    run (zerorun/process_probe.py), by runtime_overhead_key; replaces both priors for that kind. It moved by
    25-48 MiB between machines with the same software (§5.4)."""
    process_measured: bool = False
    """``cpu_process_bytes`` was measured on this machine (zerorun/process_probe.py), not the prior."""
    environment: str = ""
    """What corrections are only valid for: versions of torch, DeepSpeed, transformers and zerorun."""
    corrections: Tuple[Tuple[str, int], ...] = ()
    """Measured on this machine (zerorun-calibrate): (correction_key, measured − estimated bytes)."""

    def correction(self, key: str) -> Optional[int]:
        return next((c for k, c in self.corrections if k == key), None)

    def runtime_overhead(self, key: str) -> Optional[int]:
        return next((c for k, c in self.runtime_overheads if k == key), None)

    def allocator_cache(self, key: str) -> Optional[int]:
        return next((c for k, c in self.allocator_caches if k == key), None)


DEFAULT_CALIBRATION = Calibration()
RUNTIME_TERM = "allocator and runtime overhead"
"""The CPU-rank term a micro rank measures (process_probe.py), or the two priors above."""
PAGE_HEAP_TERM = "page heap (preloaded allocator)"
"""The CPU-rank term of tcmalloc, jemalloc or mimalloc: free spans kept resident (memory/page_heap.py)."""
OVERHEADS = ("allocator margin", "CUDA context", "NCCL buffers", "process runtime", RUNTIME_TERM,
             "heap retention", PAGE_HEAP_TERM, "measured correction (this machine)")


def counted_bytes(components: Mapping[str, int]) -> int:
    """The tensors a figure counts byte by byte (states, activations, buffers): its components less OVERHEADS."""
    return sum(v for k, v in components.items() if k not in OVERHEADS)


RUNTIME_OVERHEAD = "runtime-overhead"  # calibration.json keys of measured runtime overheads


def runtime_overhead_key(cfg: RunConfig, hw: Hardware, nproc_per_node: int) -> str:
    """What a CPU rank's runtime overhead depends on: the code paths it runs and how, not the model's size (the
    model code, precision, ZeRO stage, offload (NVMe measured as CPU), optimizer, adapter, checkpointing, the
    loss (fused or the model's), allocator mode, threads per rank) on this device."""
    from ..arch import model_code

    off = OffloadDevice(cfg.offload.device)
    off = OffloadDevice.cpu if off == OffloadDevice.nvme else off
    return "|".join([RUNTIME_OVERHEAD, hw.device_name or hw.accelerator, model_code(cfg.model),
                     Dtype(cfg.precision.dtype).value, f"zero{cfg.zero.stage}",
                     f"offload-{off.value}{'+params' if cfg.offload.params else ''}", cfg.optimizer.name.value,
                     cfg.adapter.name.value, f"ckpt{int(cfg.trainer.activation_checkpointing)}",
                     "fused-loss" if fused_loss_on(cfg, hw.accelerator) else "model-loss",
                     ParallelMode(cfg.parallel.mode).value,
                     memory_mode(cfg.launcher, mmap_threshold_bytes(cfg.launcher.mmap_threshold_mib)),
                     f"threads{hw.threads_per_rank(nproc_per_node)}"])


def correction_key(cfg: RunConfig, plan: Plan, hw: Hardware, environment: str) -> str:
    """What a measured correction depends on (§5.5): the architecture, the batch shape, precision, ZeRO stage
    and offload, the ranks and layout on a node, the device model and the software versions. Not the number of
    nodes: the probe runs one node."""
    import hashlib
    import json

    from ..arch import lora_targets
    from .params import ARCH_FIELDS

    m, a = cfg.model, cfg.adapter
    arch = [getattr(getattr(m, f), "value", getattr(m, f)) for f in ARCH_FIELDS]  # every field that builds the model
    adapter = [a.name.value, a.r, a.alpha, a.dropout, list(lora_targets(m, a))] if a.name.adapts else "none"
    parts = {"arch": [*arch, m.dropout], "adapter": adapter, "task": plan.task.value,
             "labels": cfg.task.num_labels, "seq": cfg.data.seq_len, "micro": plan.micro_batch_size,
             "precision": Dtype(cfg.precision.dtype).value, "stage": cfg.zero.stage,
             "offload": [OffloadDevice(cfg.offload.device).value, plan.offload_params],
             "checkpointing": cfg.trainer.activation_checkpointing, "fused_loss": plan.fused_loss,
             "device": [hw.accelerator, hw.device_name],
             "node": [plan.world.nproc_per_node, plan.pipeline_stages],
             "optimizer": plan.optimizer.value, "mmap_threshold": memory_mode(cfg.launcher, mmap_threshold_bytes(cfg.launcher.mmap_threshold_mib)),
             "environment": environment}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]
