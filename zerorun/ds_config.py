"""RunConfig + Plan → one complete DeepSpeed JSON (pure: no files, no processes, no "auto")."""
from __future__ import annotations

import copy
from typing import Any, Dict

from .config import Dtype, OffloadDevice, OptimizerImpl, Plan, RunConfig, Schedule


def _zero_section(cfg: RunConfig, plan: Plan) -> Dict[str, Any]:
    z, off = cfg.zero, cfg.offload
    buckets = plan.buckets.to_json()
    section: Dict[str, Any] = {"stage": z.stage}
    if z.stage == 0:
        return section
    section.update(
        overlap_comm=z.overlap_comm,
        contiguous_gradients=z.contiguous_gradients,
        reduce_scatter=True,
        reduce_bucket_size=buckets["reduce_bucket_size"],
    )
    if z.stage in (1, 2):
        section["allgather_bucket_size"] = buckets["allgather_bucket_size"]
    if z.stage == 3:
        section.update(
            stage3_prefetch_bucket_size=buckets["stage3_prefetch_bucket_size"],
            stage3_param_persistence_threshold=buckets["stage3_param_persistence_threshold"],
            stage3_max_live_parameters=z.stage3_max_live_parameters,
            stage3_max_reuse_distance=z.stage3_max_reuse_distance,
            # Export needs the whole 16-bit model gathered on rank 0 at the end.
            stage3_gather_16bit_weights_on_model_save=True,
        )
    if off.device != OffloadDevice.none:
        target: Dict[str, Any] = {"device": off.device.value, "pin_memory": off.pin_memory}
        if off.device == OffloadDevice.nvme:
            target["nvme_path"] = plan.nvme_path
        section["offload_optimizer"] = dict(target)
        if plan.offload_params:
            section["offload_param"] = dict(target)
    return section


def _scheduler(cfg: RunConfig) -> Dict[str, Any]:
    """DeepSpeed's schedulers with linear warmup. Warmup starts at lr/(warmup+1), not 0, so the
    first optimizer step is not wasted (the trainer primes the scheduler to iteration 0)."""
    tr = cfg.trainer
    start_ratio = 1.0 / (min(tr.warmup_steps, tr.max_steps) + 1)  # 1.0 (full lr at once) without warmup
    warmup = max(1, min(tr.warmup_steps, tr.max_steps))  # DeepSpeed rejects 0 warmup steps
    if tr.lr_schedule == Schedule.constant:
        return {"type": "WarmupLR", "params": {"warmup_min_lr": tr.lr * start_ratio, "warmup_max_lr": tr.lr,
                                               "warmup_num_steps": warmup, "warmup_type": "linear"}}
    if tr.lr_schedule == Schedule.linear:
        return {"type": "WarmupDecayLR", "params": {"warmup_min_lr": tr.lr * start_ratio, "warmup_max_lr": tr.lr,
                                                    "warmup_num_steps": warmup, "total_num_steps": tr.max_steps,
                                                    "warmup_type": "linear"}}
    return {"type": "WarmupCosineLR", "params": {"total_num_steps": tr.max_steps, "warmup_num_steps": warmup,
                                                 "warmup_min_ratio": start_ratio, "cos_min_ratio": tr.min_lr_ratio,
                                                 "warmup_type": "linear"}}


def render(cfg: RunConfig, plan: Plan) -> Dict[str, Any]:
    """The DeepSpeed JSON for this run: every value explicit, so what is launched is what was checked."""
    tr, prec = cfg.trainer, cfg.precision
    optimizer_params: Dict[str, Any] = {
        "lr": tr.lr,
        "betas": list(tr.adam_betas),
        "eps": 1e-8,
        "weight_decay": tr.weight_decay,
    }
    if plan.optimizer == OptimizerImpl.torch_adamw:
        optimizer_params["torch_adam"] = True
    ds: Dict[str, Any] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        "gradient_clipping": tr.grad_clip,
        "steps_per_print": 10**9,  # zerorun logs its own metrics; keep DeepSpeed's console quiet
        "wall_clock_breakdown": False,
        "seed": cfg.seed,
        "optimizer": {"type": "AdamW", "params": optimizer_params},
        "scheduler": _scheduler(cfg),
        "zero_optimization": _zero_section(cfg, plan),
        "fp16": {"enabled": prec.dtype == Dtype.fp16},
        "bf16": {"enabled": prec.dtype == Dtype.bf16},
    }
    if plan.optimizer.client:
        # zerorun builds it (zerorun.train.optimizers) and hands it to deepspeed.initialize.
        del ds["optimizer"]
        ds["zero_allow_untested_optimizer"] = True
        if plan.offload_optimizer:  # it steps on the host's fp32 partitions itself (it has a CPU implementation)
            ds["zero_force_ds_cpu_optimizer"] = False
    if prec.dtype == Dtype.fp16:
        ds["fp16"].update(
            loss_scale=prec.loss_scale,
            initial_scale_power=prec.initial_scale_power,
            loss_scale_window=prec.loss_scale_window,
            hysteresis=prec.hysteresis,
            min_loss_scale=prec.min_loss_scale,
        )
    if plan.pipeline:
        # Read by zerorun.train to build the PipelineModule; DeepSpeed keeps it as its pipeline section.
        ds["pipeline"] = {"stages": plan.pipeline_stages, "partition": cfg.parallel.partition.value,
                          "activation_checkpoint_interval": 1 if tr.activation_checkpointing else 0}
    if plan.tensor_parallel > 1:
        # DeepSpeed AutoTP: deepspeed.initialize shards the HF model's projections over groups of this many ranks.
        ds["tensor_parallel"] = {"autotp_size": plan.tensor_parallel}
        # DeepSpeed checks train_batch_size against micro × accumulation × the world (every rank of a TP group
        # counted) when the engine starts, and against the data-parallel ranks alone when ZeRO-3's zero.Init
        # reads the config again: no one value passes both, so it derives it from the two given here.
        del ds["train_batch_size"]
    if cfg.launcher.node_local_run_dirs:
        # Each node saves to its own disk: local rank 0 writes the model states there, every rank its shard.
        ds["checkpoint"] = {"use_node_local_storage": True}
    if cfg.offload.device == OffloadDevice.nvme:
        ds["aio"] = {"block_size": 1048576, "queue_depth": 8, "single_submit": False,
                     "overlap_events": True, "thread_count": 1}
    return deep_merge(ds, cfg.deepspeed)


def deep_merge(base: Dict[str, Any], extra: Dict[str, Any]) -> Dict[str, Any]:
    """``base`` with ``extra`` merged in (dicts recursively, everything else replaced)."""
    out = copy.deepcopy(base)
    for k, v in (extra or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out
