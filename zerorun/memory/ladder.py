"""Autofit's ladder: every config it may choose from the user's (``candidates``: micro-batch, checkpointing,
buckets, the rule table's layouts, 8-bit states, QLoRA, the mmap threshold), each as the user's config with a few
settings changed (``apply``, with a reason per change), in the order of the smallest change first
(``ladder_rank``). The gate (gate.py) estimates them; the runtime OOM repair climbs it one rung at a time.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from ..allocators import concrete as allocator_of
from ..config import (AdapterName, OffloadDevice, OptimizerName, ParallelMode, Plan, RunConfig, World, bucket_sizes,
                      data_parallel_size, layouts, params_offloaded, small_bucket_sizes)
from ..config.rules import CPU_MMAP_THRESHOLD, fused_loss_on, fused_loss_runs, mmap_threshold_bytes
from ..config.choices import Allocator


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    why: str

    def override(self) -> str:
        return _override(self.key, self.new)


def _override(key: str, value: Any) -> str:
    if key == "zero.stage":
        return f"zero=stage{value}"
    if key in ("offload.device", "optimizer.name"):
        return f"{key.split('.')[0]}={getattr(value, 'value', value)}"
    if isinstance(value, Allocator):
        return f"{key}={value.value}"
    if isinstance(value, bool):
        return f"{key}={'true' if value else 'false'}"
    if value is None:
        return f"{key}=null"
    return f"{key}={value}"


@dataclass(frozen=True)
class Knobs:
    """One config autofit may choose, as the settings it may change from the user's."""

    micro: int
    ckpt: bool
    small_buckets: bool
    stage: int
    offload: OffloadDevice
    params: Optional[bool]
    opt8: bool = False
    """Switch adamw to adamw8bit (only with optimizer.autofit_8bit)."""
    low_mmap: bool = False
    """CPU ranks: launcher.mmap_threshold_mib=1 (freed activations go back to the OS; slower steps)."""
    qlora: bool = False
    """adapter=lora → qlora: the frozen base in 4-bit (only with adapter.autofit_qlora)."""
    fused: bool = False
    """trainer.fused_loss=true: a causal LM's loss a chunk of tokens at a time, without vocabulary-wide logits."""


def apply(cfg: RunConfig, world: World, k: Knobs, pinned_global: int) -> Tuple[RunConfig, List[Change]]:
    """``cfg`` with the knobs set (dataclasses.replace on the nested configs) and the list of changes."""
    tr, z, off = cfg.trainer, cfg.zero, cfg.offload
    changes: List[Change] = []
    new_tr, new_z, new_off = tr, z, off
    if k.micro != tr.micro_batch_size:
        accum = pinned_global // (k.micro * data_parallel_size(cfg, world))
        changes.append(Change("trainer.micro_batch_size", tr.micro_batch_size, k.micro,
                              f"activations and logits scale with the micro-batch; gradient accumulation "
                              f"{accum} keeps the global batch at {pinned_global}"))
        new_tr = dataclasses.replace(new_tr, micro_batch_size=k.micro)
        if tr.global_batch_size != pinned_global:
            changes.append(Change("trainer.global_batch_size", tr.global_batch_size, pinned_global,
                                  "pinned so the global batch stays the same with the smaller micro-batch"))
            new_tr = dataclasses.replace(new_tr, global_batch_size=pinned_global)
    if k.ckpt != tr.activation_checkpointing:
        changes.append(Change("trainer.activation_checkpointing", tr.activation_checkpointing, True,
                              "keeps one input per layer instead of all its activations (~1/3 more compute)"))
        new_tr = dataclasses.replace(new_tr, activation_checkpointing=True)
    if k.small_buckets:
        small = small_bucket_sizes(cfg)
        now = bucket_sizes(cfg).to_json()
        for key, size in small.items():
            if now[key] != size:
                changes.append(Change(f"zero.{key}", getattr(z, key), size,
                                      "hidden²-sized buckets (HF's auto size): less buffer, more collectives"))
        if z.overlap_comm:
            changes.append(Change("zero.overlap_comm", True, False, "overlap_comm doubles the reduce bucket"))
        new_z = dataclasses.replace(new_z, **small, overlap_comm=False)
    if k.stage != z.stage:
        changes.append(Change("zero.stage", z.stage, k.stage,
                              {1: "partitions optimizer states", 2: "partitions optimizer states and gradients",
                               3: "partitions parameters too"}[k.stage]
                              + f" over {data_parallel_size(cfg, world)} ranks"))
        new_z = dataclasses.replace(new_z, stage=k.stage)
    if k.offload != off.device:
        changes.append(Change("offload.device", off.device, k.offload,
                              "optimizer states and their step move to host RAM (CPU Adam)"))
        new_off = dataclasses.replace(new_off, device=k.offload)
    if k.params != off.params:
        why = ("parameters move to host RAM as well" if k.params
               else "offload the optimizer only; parameters stay on the GPU")
        changes.append(Change("offload.params", off.params, k.params, why))
        new_off = dataclasses.replace(new_off, params=k.params)
    new_opt = cfg.optimizer
    if k.opt8 and cfg.optimizer.name == OptimizerName.adamw:
        changes.append(Change("optimizer.name", OptimizerName.adamw, OptimizerName.adamw8bit,
                              "8-bit optimizer states: ~2 instead of 8 bytes per parameter (allowed by "
                              "optimizer.autofit_8bit; the numerics change slightly)"))
        new_opt = dataclasses.replace(new_opt, name=OptimizerName.adamw8bit)
    new_ad = cfg.adapter
    if k.qlora and cfg.adapter.name == AdapterName.lora:
        changes.append(Change("adapter.name", "lora", "qlora",
                              "the frozen base in 4-bit NF4: ~0.52 instead of 2-4 bytes per weight of its layers "
                              "(allowed by adapter.autofit_qlora; the base's numerics change)"))
        new_ad = dataclasses.replace(new_ad, name=AdapterName.qlora)
    new_la = cfg.launcher
    if k.low_mmap and _mmap_lowerable(cfg):
        if allocator_of(cfg.launcher) != Allocator.glibc:
            changes.append(Change("launcher.allocator", Allocator(cfg.launcher.allocator), Allocator.glibc,
                                  f"{Allocator(cfg.launcher.allocator).value} keeps freed blocks for reuse; glibc at "
                                  "a 1 MiB mmap threshold gives them back to the OS (CPU ranks: ~1.6x slower steps)"))
            new_la = dataclasses.replace(new_la, allocator=Allocator.glibc)
        if mmap_threshold_bytes(cfg.launcher.mmap_threshold_mib) > CPU_MMAP_THRESHOLD:
            changes.append(Change("launcher.mmap_threshold_mib", cfg.launcher.mmap_threshold_mib, 1,
                                  "freed activations go back to the OS instead of staying on the heap (CPU ranks; "
                                  "page faults make steps slower)"))
            new_la = dataclasses.replace(new_la, mmap_threshold_mib=1)
    if k.fused != fused_loss_on(cfg, world.accelerator, k.stage):  # (null on CPU ranks resolves by itself)
        if k.fused:
            changes.append(Change("trainer.fused_loss", tr.fused_loss, True, "the head and loss a chunk of tokens "
                                  "at a time: no vocabulary-wide fp32 logits (the same FLOPs)"))
        else:
            changes.append(Change("trainer.fused_loss", True, False, "ZeRO-3 keeps the head's weight partitioned "
                                  "outside its forward: the model's own loss"))
        new_tr = dataclasses.replace(new_tr, fused_loss=k.fused)
    new_par = cfg.parallel
    if k.micro != tr.micro_batch_size and cfg.parallel.mode == ParallelMode.pipeline and cfg.parallel.micro_batches:
        accum = pinned_global // (k.micro * data_parallel_size(cfg, world))
        changes.append(Change("parallel.micro_batches", cfg.parallel.micro_batches, accum,
                              "the pipeline streams that many smaller micro-batches per step"))
        new_par = dataclasses.replace(new_par, micro_batches=accum)
    new = dataclasses.replace(cfg, trainer=new_tr, zero=new_z, offload=new_off, parallel=new_par, optimizer=new_opt,
                              launcher=new_la, adapter=new_ad)
    return new, changes


def candidates(cfg: RunConfig, world: World, pinned_global: int) -> List[Knobs]:
    """Every config autofit may choose, in the ladder's order (``ladder_rank``): the smallest change first.

    Autofit ranks those that fit by predicted step time and uses this order only for ties; the runtime OOM
    repair walks it one rung at a time. Nothing the user chose is undone (stage, offload device,
    checkpointing only go up); autofit never picks NVMe by itself (it needs a disk path and libaio).
    """
    tr, z, off = cfg.trainer, cfg.zero, cfg.offload
    dp = data_parallel_size(cfg, world)
    per_rank = pinned_global // dp if pinned_global % dp == 0 else tr.micro_batch_size
    micros = sorted({d for d in range(1, tr.micro_batch_size + 1)
                     if per_rank % d == 0 and pinned_global % (d * dp) == 0} | {tr.micro_batch_size}, reverse=True)
    now = bucket_sizes(cfg).to_json()
    shrinkable = z.overlap_comm or any(now[key] > size for key, size in small_bucket_sizes(cfg).items())
    user_device = OffloadDevice(off.device)
    may_8bit = cfg.optimizer.autofit_8bit and cfg.optimizer.name == OptimizerName.adamw \
        and cfg.parallel.mode == ParallelMode.dp and has_bitsandbytes()
    may_qlora = cfg.adapter.autofit_qlora and cfg.adapter.name == AdapterName.lora and has_bitsandbytes() \
        and not cfg.adapter.merge
    may_lower_mmap = world.accelerator == "cpu" and _mmap_lowerable(cfg)
    out = []
    for layout in layouts(cfg.parallel.mode, cfg.adapter.name):
        if layout.stage < z.stage:
            continue
        if user_device == OffloadDevice.none and layout.device == OffloadDevice.nvme:
            continue
        if user_device != OffloadDevice.none and layout.device != user_device:
            continue
        # Keep the user's offload.params setting unless this layout resolves it differently.
        same = params_offloaded(layout.stage, layout.device, off.params) == layout.params
        params = off.params if same else layout.params
        either = (False, True)
        for opt8, small, ckpt, low, micro, q, fused in itertools.product(
                either if may_8bit and layout.device != OffloadDevice.nvme else (False,),
                either if shrinkable else (False,),
                either if not tr.activation_checkpointing else (True,),
                either if may_lower_mmap else (False,),
                micros,
                either if may_qlora else (False,),
                _fused_options(cfg, world.accelerator, layout.stage)):
            out.append(Knobs(micro, ckpt, small, layout.stage, layout.device, params, opt8, low, q, fused))
    return sorted(out, key=ladder_rank)


def _fused_options(cfg: RunConfig, accelerator: str, stage: int) -> Tuple[bool, ...]:
    """The fused loss at a layout: off where it cannot run (ZeRO-3); a choice where the user left it null and the
    ranks do not take it by themselves (GPUs); else what the config resolves to."""
    if not fused_loss_runs(cfg, stage):
        return (False,)
    if cfg.trainer.fused_loss is None and accelerator != "cpu":
        return (False, True)
    return (fused_loss_on(cfg, accelerator, stage),)


def ladder_rank(k: Knobs) -> Tuple:
    """The ladder's order, smallest change first: parameter offload, then optimizer offload, 8-bit optimizer
    states, stage, small buckets, checkpointing, a low mmap threshold (CPU ranks), a smaller micro-batch and the
    fused loss (which costs no speed) each weigh more than everything after them. The runtime OOM repair climbs it;
    autofit breaks ties with it."""
    tier = 0 if k.offload == OffloadDevice.none else (2 if params_offloaded(k.stage, k.offload, k.params) else 1)
    return (tier == 2, tier >= 1, k.qlora, k.opt8, k.stage, k.small_buckets, k.ckpt, k.low_mmap, -k.micro, k.fused)


def _mmap_lowerable(cfg: RunConfig) -> bool:
    """Whether glibc at the memory-saving 1 MiB threshold would hold less resident than the config's allocator
    (tcmalloc, jemalloc, mimalloc) or glibc mode (0, 32 or auto)."""
    return allocator_of(cfg.launcher) != Allocator.glibc or \
        mmap_threshold_bytes(cfg.launcher.mmap_threshold_mib) > CPU_MMAP_THRESHOLD


def runtime_oom_repair(cfg: RunConfig, plan: Plan) -> Optional[Tuple[RunConfig, List[Change]]]:
    """After an out-of-memory error at runtime, the next config to try (None: nothing left): the
    micro-batch halved (to the largest size that keeps the global batch, so the data order is the same),
    and at micro-batch 1 the next rung of autofit's ladder that keeps micro-batch 1 (checkpointing,
    smaller buckets, a higher ZeRO stage, CPU offload, parameter offload)."""
    pinned = plan.global_batch_size
    # Never a change of optimizer at runtime: the relaunch resumes the checkpoint, whose states are AdamW's.
    knobs = [k for k in candidates(cfg, plan.world, pinned) if not k.opt8]
    micro = cfg.trainer.micro_batch_size
    current = Knobs(micro, cfg.trainer.activation_checkpointing, False, cfg.zero.stage,
                    OffloadDevice(cfg.offload.device), cfg.offload.params, fused=plan.fused_loss)
    if micro > 1:
        smaller = sorted({k.micro for k in knobs if k.micro <= micro // 2}, reverse=True)
        if smaller:
            return apply(cfg, plan.world, dataclasses.replace(current, micro=smaller[0]), pinned)
    here = ladder_rank(dataclasses.replace(current, micro=1))
    for k in knobs:  # the next rung down the ladder at micro-batch 1 that changes something
        if k.micro == 1 and ladder_rank(k) > here:
            new, changes = apply(cfg, plan.world, k, pinned)
            if changes:
                return new, changes
    return None


def has_bitsandbytes() -> bool:
    import importlib.util

    return importlib.util.find_spec("bitsandbytes") is not None
