"""``check``: every cross-key problem of a composed config at once, each with key, value and fix.

Pure, except two looks at the machine (libaio present, NVMe dir writable), which come from
zerorun.hardware and which callers (tests) can pass in.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional

from .errors import UserError
from .fields import field_problems, with_defaults_for
from .paths import path_problems
from .plan import World, data_parallel_size, grad_accum_steps
from .rules import (adapter_problems, fused_loss_problems, lora_target_problems, offload_problems, optimizer_problems,
                    pipeline_problems, qlora_problems, resolve_task, shape_problems, task_problems, tp_problems)
from .schema import AdapterName, Dtype, LauncherName, OffloadDevice, ParallelMode, Rendezvous, RunConfig


def check(cfg: RunConfig, world: World, *, libaio: Optional[bool] = None,
          writable: Optional[Callable[[str], Optional[str]]] = None) -> List[UserError]:
    """Every cross-key problem in the config; an empty list means it can be launched.

    ``libaio``: whether DeepSpeed's async I/O can build (None: look). ``writable(path)``: None when a
    directory can be created and written there, else the reason (None: try it for real).
    """
    from .. import hardware

    P = UserError
    declared = field_problems(cfg)  # each field's own range (schema.py), then the rules between fields
    sane = with_defaults_for(cfg, declared)  # so those rules never meet an out-of-range value
    if sane is None:
        return declared
    cfg = sane
    world = dataclasses.replace(world, nproc_per_node=max(1, world.nproc_per_node), nnodes=max(1, world.nnodes))
    problems: List[UserError] = []
    z, off, prec, tr, m = cfg.zero, cfg.offload, cfg.precision, cfg.trainer, cfg.model

    problems += offload_problems(z.stage, off.device, off.params)
    problems += adapter_problems(cfg.adapter.name, z.stage, cfg.parallel.mode)
    problems += qlora_problems(cfg.adapter)
    problems += optimizer_problems(cfg.optimizer.name, off.device, cfg.parallel.mode == ParallelMode.pipeline)
    problems += _monitor_problems(cfg.monitor.value)
    if cfg.optimizer.name.value != "adamw" and "optimizer" in (cfg.deepspeed or {}):
        problems.append(UserError(f"deepspeed.optimizer with optimizer={cfg.optimizer.name.value}: zerorun builds "
                                  "that optimizer itself, and DeepSpeed refuses both.",
                                  "drop deepspeed.optimizer (lr, betas, weight decay are trainer.* keys).",
                                  key="deepspeed.optimizer"))
    if off.device == OffloadDevice.nvme:
        if not (hardware.libaio_available() if libaio is None else libaio):
            problems.append(P("offload=nvme: libaio is not installed, DeepSpeed's async I/O op cannot build.",
                              "apt-get install libaio-dev (Debian/Ubuntu), or offload=cpu.", key="offload.device",
                              value="nvme"))
    problems += path_problems(cfg, writable or hardware.writable_dir_problem)
    if tr.overwrite and (tr.resume or tr.resume_from):
        how = f"trainer.resume_from={tr.resume_from}" if tr.resume_from else "trainer.resume=true"
        problems.append(P(f"trainer.overwrite=true with {how}: overwrite deletes the earlier run's checkpoints, "
                          "resume continues from them.", f"drop one: {how} to continue that run, or "
                          "trainer.overwrite=true to start over.", key="trainer.overwrite", value=True))
    problems += _precision_problems(cfg, world)

    dp = data_parallel_size(cfg, world)
    if tr.global_batch_size is not None:
        per_step = tr.micro_batch_size * dp
        if tr.global_batch_size < per_step or tr.global_batch_size % per_step:
            fit = max(1, tr.global_batch_size // per_step) * per_step
            problems.append(P(
                f"trainer.global_batch_size={tr.global_batch_size} is not a multiple of micro_batch_size × "
                f"data-parallel ranks = {tr.micro_batch_size} × {dp} = {per_step}.",
                f"trainer.global_batch_size={fit}, or a micro_batch_size that divides it.",
                key="trainer.global_batch_size", value=tr.global_batch_size))

    problems += shape_problems(m, cfg.parallel.mode == ParallelMode.pipeline)
    if AdapterName(cfg.adapter.name).adapts and not any((p.key or "").startswith("model.")
                                                                      for p in problems):
        problems += lora_target_problems(m, cfg.adapter)
    if cfg.data.seq_len > m.max_positions:
        problems.append(P(f"data.seq_len={cfg.data.seq_len} exceeds model.max_positions={m.max_positions} of "
                          f"{m.name}.", f"data.seq_len={m.max_positions} or less.", key="data.seq_len",
                          value=cfg.data.seq_len))

    problems += task_problems(resolve_task(cfg.task.name, m.family), m.family, m.name, cfg.task.num_labels)
    if tr.fused_loss:
        problems += fused_loss_problems(cfg)
    problems += _launcher_problems(cfg, world)
    if cfg.parallel.mode == ParallelMode.pipeline:
        problems += pipeline_problems(z.stage) + _pipeline_problems(cfg, world)
    if cfg.parallel.mode == ParallelMode.tp:
        problems += tp_problems(m, cfg.parallel.tp_size, world.size, off.device)
    elif cfg.parallel.tp_size > 1:
        problems.append(P(f"parallel.tp_size={cfg.parallel.tp_size} with parallel={cfg.parallel.mode.value}: only "
                          "parallel=tp splits layers over ranks; it would be ignored.",
                          f"parallel=tp parallel.tp_size={cfg.parallel.tp_size}, or drop parallel.tp_size.",
                          key="parallel.tp_size", value=cfg.parallel.tp_size))
    problems += _deepspeed_override_problems(cfg.deepspeed, prec.dtype)
    return problems + declared


def _precision_problems(cfg: RunConfig, world: World) -> List[UserError]:
    P, prec, out = UserError, cfg.precision, []
    if prec.dtype == Dtype.fp16 and not world.fp16_ok:
        out.append(P(f"precision=fp16 on {world.accelerator} ranks: this device has no fp16 training support "
                     "(DeepSpeed's CPU accelerator needs AVX512-FP16 or AMX).", "precision=bf16, or run on GPUs.",
                     key="precision.dtype", value="fp16"))
    if prec.dtype != Dtype.fp16 and prec.loss_scale != 0:
        out.append(P(f"precision.loss_scale={prec.loss_scale} with precision={prec.dtype.value}: loss scaling is "
                     "for fp16 only.", "precision=fp16, or drop precision.loss_scale.", key="precision.loss_scale",
                     value=prec.loss_scale))
    return out


def _launcher_problems(cfg: RunConfig, world: World) -> List[UserError]:
    P, la, out = UserError, cfg.launcher, []
    if not la.node_rank < la.nnodes:
        out.append(P(f"launcher.node_rank={la.node_rank}: must be in [0, launcher.nnodes={la.nnodes}).",
                     key="launcher.node_rank", value=la.node_rank))
    if la.rdzv == Rendezvous.c10d and (la.name != LauncherName.torchrun or la.nnodes < 2):
        out.append(P(f"launcher.rdzv=c10d is torchrun's rendezvous for several nodes (launcher={la.name.value}, "
                     f"launcher.nnodes={la.nnodes}).", "launcher=torchrun launcher.nnodes=<nodes>, or "
                     "launcher.rdzv=static.", key="launcher.rdzv", value=la.rdzv.value))
    if la.min_nnodes is not None and la.min_nnodes > la.nnodes:
        out.append(P(f"launcher.min_nnodes={la.min_nnodes}: must be in [1, launcher.nnodes={la.nnodes}].",
                     f"launcher.min_nnodes={max(1, la.nnodes - 1)}", key="launcher.min_nnodes", value=la.min_nnodes))
    if la.hostfile:
        from ..hostfile import problems as hostfile_problems  # (zerorun.hostfile imports config.errors)

        out += hostfile_problems(la.hostfile, la.nnodes)
    if la.nnodes > 1 and la.master_port is None:
        out.append(P(f"launcher.nnodes={la.nnodes} without launcher.master_port: each node would pick its own free "
                     "port and never meet.", "launcher.master_port=<a free port on node 0, the same on every node>.",
                     key="launcher.master_port"))
    if la.nnodes > 1 and la.master_addr in ("127.0.0.1", "localhost") and not la.hostfile:
        out.append(P(f"launcher.nnodes={la.nnodes} with launcher.master_addr={la.master_addr}: other nodes cannot "
                     "reach this loopback address.", "launcher.master_addr=<node 0's hostname or IP>.",
                     key="launcher.master_addr", value=la.master_addr))
    return out


def _pipeline_problems(cfg: RunConfig, world: World) -> List[UserError]:
    P, par, out = UserError, cfg.parallel, []
    if world.size % par.stages:
        best = max(d for d in range(1, world.size + 1) if world.size % d == 0 and d <= max(1, par.stages))
        out.append(P(f"parallel.stages={par.stages} does not divide the world size {world.size} ({world.nnodes} "
                     f"node(s) × {world.nproc_per_node} rank(s)).", f"parallel.stages={best}, or a rank count "
                     "that is a multiple of it.", key="parallel.stages", value=par.stages))
    if par.stages > cfg.model.num_layers:
        out.append(P(f"parallel.stages={par.stages} exceeds the {cfg.model.num_layers} transformer layers of "
                     f"{cfg.model.name}: some stage would hold no layer.",
                     f"parallel.stages={cfg.model.num_layers} or fewer.", key="parallel.stages", value=par.stages))
    if world.size % par.stages == 0:
        accum = grad_accum_steps(cfg, world)
        if par.micro_batches and cfg.trainer.global_batch_size and accum != par.micro_batches:
            out.append(P(f"parallel.micro_batches={par.micro_batches} disagrees with trainer.global_batch_size="
                         f"{cfg.trainer.global_batch_size} (which gives {accum} micro-batches per step).",
                         "set one of them.", key="parallel.micro_batches", value=par.micro_batches))
        elif accum < par.stages:
            out.append(P(f"{accum} micro-batch(es) per step for {par.stages} pipeline stages: most stages would sit "
                         "idle (the pipeline bubble).", f"parallel.micro_batches={par.stages} or more (or a larger "
                         "trainer.global_batch_size).", key="parallel.micro_batches", value=par.micro_batches))
    return out


# Top-level DeepSpeed keys zerorun renders itself; an override of these goes through the typed
# groups instead, so the check and the estimator see the real value.
OWNED_DS_KEYS = {
    "train_batch_size": "trainer.global_batch_size",
    "train_micro_batch_size_per_gpu": "trainer.micro_batch_size",
    "gradient_accumulation_steps": "trainer.global_batch_size",
    "zero_optimization": "zero=... / offload=...",
    "fp16": "precision=fp16",
    "bf16": "precision=bf16",
}


def _deepspeed_override_problems(overrides: Dict[str, Any], dtype: Dtype) -> List[UserError]:
    P, out = UserError, []
    for key in overrides:
        enabled = isinstance(overrides[key], dict) and overrides[key].get("enabled")
        if key in ("fp16", "bf16") and enabled and dtype not in (Dtype.fp32, Dtype(key)):
            out.append(P(f"deepspeed.{key}.enabled=true with precision={dtype.value}: fp16 and bf16 cannot both be "
                         "enabled.", f"choose one, precision={key} or precision={dtype.value}, and drop "
                         f"deepspeed.{key}.", key=f"deepspeed.{key}.enabled", value=True))
        elif key in OWNED_DS_KEYS:
            out.append(P(f"deepspeed.{key}: zerorun renders this key from its config groups.",
                         f"set {OWNED_DS_KEYS[key]} instead.", key=f"deepspeed.{key}"))

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}.{k}")
        elif node == "auto":
            out.append(P(f'{path}="auto": zerorun renders complete values.', "give a number or drop the key.",
                         key=path, value="auto"))

    walk(overrides, "deepspeed")
    return out


def _monitor_problems(monitor: str) -> List[UserError]:
    """DeepSpeed's TensorBoard and W&B monitors need their packages on every rank."""
    import importlib.util

    needs = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(monitor)
    if needs and importlib.util.find_spec(needs) is None:
        return [UserError(f"monitor={monitor} needs the {needs} package, which is not installed.",
                          f"pip install {needs}, or monitor=csv (no package needed).", key="monitor", value=monitor)]
    return []
