"""§7 The gate and autofit: refuse what will not fit, or apply the fastest config that does.

docs/memory.md §7. Autofit estimates every config it may choose (ladder.py: micro-batch, checkpointing, buckets,
the layouts of the rule table, 8-bit states, QLoRA, the mmap threshold) and of those that fit applies the one with
the lowest predicted step time (zerorun.speed); the estimate table shows the layouts side by side. The runtime
OOM repair (ladder.py) instead walks the ladder one rung at a time.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from ..config import (Dtype, GateMode, OffloadDevice, OptimizerName, ParallelMode, Plan, RunConfig, UserError, World,
                      layouts, make_plan)
from ..hardware import Hardware
from .. import speed  # a module reference: zerorun.speed imports this package's activations and params
from .estimate import Estimate, estimate, gib
from ..config.rules import fused_loss_on, fused_loss_runs
from .ladder import Change, apply, candidates, has_bitsandbytes
from .priors import DEFAULT_CALIBRATION, Calibration, counted_bytes


@dataclass
class GateDecision:
    """What the memory gate decided. ``cfg`` is what to launch (changed only by autofit)."""

    ok: bool
    mode: GateMode
    cfg: RunConfig
    estimate: Estimate
    """The estimate of ``cfg`` (the original config when nothing changed)."""
    original: Estimate
    changes: List[Change] = field(default_factory=list)
    message: str = ""
    warning: Optional[str] = None
    suggestion: Optional[List[str]] = None
    """Hydra overrides of a config that fits (strict/warn refusals), if one exists."""
    step: Optional["speed.StepTime"] = None
    """Autofit: the predicted step time of the config it chose (zerorun.speed)."""

    @property
    def overrides(self) -> List[str]:
        return [c.override() for c in self.changes]

    def refusal(self) -> UserError:
        """The refusal as the one user-error type (key "gate")."""
        return UserError(f"memory: {self.message}", key="gate", value=self.mode.value)


SPEED_TIE = 0.03
"""Predicted step times within 3% of the fastest count as a tie (the model resolves no finer), and the tie
goes to the earlier rung of the ladder: the smaller change (no offload, the user's stage, no recomputation)."""


def fitting_configs(cfg: RunConfig, plan: Plan, hw: Hardware, *, cal: Calibration = DEFAULT_CALIBRATION,
                    profile: Optional["speed.SpeedProfile"] = None) -> List["Fit"]:
    """Every config autofit may choose (``ladder.candidates``) that fits, in the ladder's order, each with its
    estimate and predicted step time. ``global_batch_size`` stays fixed (pinned to micro × ranks when it was
    unset), so step times compare the same work."""
    pinned = plan.global_batch_size
    fits: List[Fit] = []
    for knobs in candidates(cfg, plan.world, pinned):
        new, changes = apply(cfg, plan.world, knobs, pinned)
        new_plan = make_plan(new, plan.world, plan.seq_len)  # autofit never changes the data
        est = estimate(new, new_plan, hw, cal=cal)
        if est.fits:
            fits.append(Fit(new, est, changes, speed.predict_step_time(new, new_plan, profile)))
    return fits


def fastest(fits: List["Fit"]) -> Optional["Fit"]:
    """Of ``fits`` (in the ladder's order), the one with the lowest predicted step time, ties (SPEED_TIE) to the
    earlier rung; ``fitting`` says how many there were. None when the list is empty."""
    if not fits:
        return None
    best = min(f.step.seconds for f in fits)
    chosen = next(f for f in fits if f.step.seconds <= best * (1 + SPEED_TIE))
    return dataclasses.replace(chosen, fitting=len(fits))


def autofit(cfg: RunConfig, plan: Plan, hw: Hardware, *, cal: Calibration = DEFAULT_CALIBRATION,
            profile: Optional["speed.SpeedProfile"] = None) -> Optional["Fit"]:
    """The fastest config that fits (``fastest`` of ``fitting_configs``); None if nothing zerorun can change
    fits."""
    return fastest(fitting_configs(cfg, plan, hw, cal=cal, profile=profile))


@dataclass(frozen=True)
class Fit:
    """Autofit's choice: the config, its estimate, the changes from the user's, its predicted step time and
    how many candidate configs fit."""

    cfg: RunConfig
    estimate: Estimate
    changes: List[Change]
    step: "speed.StepTime"
    fitting: int = 1


def _with_8bit(cfg: RunConfig, plan: Plan, hw: Hardware, cal: Calibration) -> Optional[List[str]]:
    """The overrides of the fastest fit once adamw8bit is allowed, when the user did not allow it."""
    if cfg.optimizer.autofit_8bit or cfg.optimizer.name != OptimizerName.adamw or not has_bitsandbytes():
        return None
    found = autofit(dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, autofit_8bit=True)),
                    plan, hw, cal=cal)
    return [c.override() for c in found.changes] if found else None


def resolve_mmap_threshold(cfg: RunConfig, plan: Plan, hw: Hardware, cal: Calibration = DEFAULT_CALIBRATION
                           ) -> RunConfig:
    """``launcher.mmap_threshold_mib`` auto (None) made concrete: 1 MiB, the one setting whose figure is validated
    on random held-out shapes (docs/memory.md §8.3). With mmap off (0) or at 32 MiB the untrimmed heap follows the
    allocation order (measured -31% to +116% of the figure on shapes never fitted, and 1-51% more resident memory
    than at 1 MiB on every one of them), so the fast settings are the user's explicit choice, gated on their wide
    bound. GPU ranks: 1 too (the setting applies to CPU ranks' activations; a GPU rank's host allocations are few).
    ``plan``, ``hw`` and ``cal`` stay in the signature: a validated fast mode would be chosen here by its own fit."""
    if cfg.launcher.mmap_threshold_mib is not None:
        return cfg
    return dataclasses.replace(cfg, launcher=dataclasses.replace(cfg.launcher, mmap_threshold_mib=1))


def _describe(cfg: RunConfig, plan: Plan, est: Estimate) -> str:
    tr = cfg.trainer
    off = "offload " + OffloadDevice(cfg.offload.device).value + (" (+params)" if plan.offload_params else "")
    return (f"{cfg.model.name} ZeRO-{cfg.zero.stage} {off} {Dtype(cfg.precision.dtype).value} "
            f"micro {tr.micro_batch_size} × seq {plan.seq_len}"
            + (f" (the longest example; data.seq_len={cfg.data.seq_len})" if plan.seq_len < cfg.data.seq_len else "")
            + f"{' + checkpointing' if tr.activation_checkpointing else ''} on {plan.world.size} rank(s)"
            + (f", pipeline stage {est.summary['peak_stage']} of {len(est.stages)} "
               f"({est.stages[est.summary['peak_stage']]['in_flight_micro_batches']} micro-batch(es) in flight)"
               if est.stages else ""))


def _shortfall(cfg: RunConfig, plan: Plan, est: Estimate) -> str:
    unit = "GPU" if est.device == "cuda" else "rank (host RAM / ranks per node)"
    parts = []
    if not est.fits_device:
        top = ", ".join(f"{name} {gib(v)}" for name, v in est.top(3))
        parts.append(f"{_describe(cfg, plan, est)} needs {gib(est.per_rank_peak_bytes)} (at most "
                     f"{gib(est.bound_bytes)}) per {unit} (peak in the {est.peak_phase} phase) but has "
                     f"{gib(est.device_capacity_bytes)}. "
                     f"Biggest: {top}.")
    if not est.fits_host:
        parts.append(f"Host RAM per node: needs {gib(est.host_bytes_per_node)}, has {gib(est.host_capacity_bytes)}.")
    return " ".join(parts)


def _ample_host(hw: Hardware) -> Hardware:
    """``hw`` with host RAM no config runs out of: to ask whether the GPUs alone could take the job."""
    return dataclasses.replace(hw, host_mem_bytes=1 << 60, host_available_bytes=0)


def gate(cfg: RunConfig, plan: Plan, hw: Hardware, mode: Optional[GateMode] = None, *,
         cal: Calibration = DEFAULT_CALIBRATION) -> GateDecision:
    """The memory gate before launch. ``mode`` defaults to ``cfg.gate``.

    fits → ok. Otherwise strict → refuse (the message names the top consumers, the capacity and
    Hydra overrides of a config that fits); warn → ok with that message as a warning; autofit → ok
    with the fastest config that fits (``cfg`` and ``changes``), or refuse if none does; off → ok,
    the estimate is only recorded.
    """
    mode = GateMode(mode if mode is not None else cfg.gate)
    if mode == GateMode.calibrate:  # the measurement happened before (zerorun.calibration); then strict
        mode = GateMode.strict
    est = estimate(cfg, plan, hw, cal=cal)
    if mode == GateMode.off:
        return GateDecision(True, mode, cfg, est, est, message="memory gate off: estimate recorded only.")
    low_ceiling = _ceiling_below_tensors(cfg, est)
    if low_ceiling:
        return GateDecision(False, mode, cfg, est, est, message=low_ceiling)
    if est.fits:
        unit = "GPU" if est.device == "cuda" else "rank"
        return GateDecision(True, mode, cfg, est, est,
                            message=f"fits: {gib(est.per_rank_peak_bytes)}, at most {gib(est.bound_bytes)}, of "
                                    f"{gib(est.device_capacity_bytes)} per {unit} (peak in the {est.peak_phase} phase).")
    found = autofit(cfg, plan, hw, cal=cal)
    shortfall = _shortfall(cfg, plan, est)
    if found is None:
        host_fix = (f"every rank builds the fp32 model ({gib(4 * est.params)}) on the host before DeepSpeed takes it, "
                    "and offloaded state lives there too: fewer ranks per node (launcher.nproc_per_node), more nodes, "
                    "or a host with more RAM (hardware.host_mem_gib when planning).")
        if est.fits_device:  # only host RAM is short: nothing on the GPU side helps
            fix = host_fix
        elif est.device == "cuda" and (gpu_side := autofit(cfg, plan, _ample_host(hw), cal=cal)) is not None:
            # a config fits the GPUs, and host RAM is what no config fits
            e = gpu_side.estimate
            fix = (f"{' '.join(c.override() for c in gpu_side.changes)} fits each GPU ({gib(e.per_rank_peak_bytes)}, "
                   f"at most {gib(e.bound_bytes)}) but needs {gib(e.host_bytes_per_node)} of host RAM per node, "
                   f"which has {gib(est.host_capacity_bytes)}: {host_fix}")
        else:
            fix = (f"no micro-batch, checkpointing, bucket, ZeRO stage or offload setting fits on {plan.world.size} "
                   "rank(s): add GPUs/nodes (launcher.nnodes, launcher.nproc_per_node), use larger GPUs, or a "
                   "shorter data.seq_len.")
            with_8bit = _with_8bit(cfg, plan, hw, cal)
            if with_8bit:
                fix += (f" With 8-bit optimizer states it fits: {' '.join(with_8bit)} (the numerics change "
                        "slightly; optimizer.autofit_8bit=true lets gate=autofit choose it).")
        msg = f"{shortfall} Fix: {fix}"
        return GateDecision(mode == GateMode.warn, mode, cfg, est, est, message=msg,
                            warning=msg if mode == GateMode.warn else None)
    new_cfg, new_est, changes = found.cfg, found.estimate, found.changes
    overrides = [c.override() for c in changes]
    if mode == GateMode.autofit:
        why = "; ".join(f"{c.override()} ({c.why})" for c in changes)
        msg = (f"{shortfall} autofit: {' '.join(overrides)} → {gib(new_est.per_rank_peak_bytes)}, at most "
               f"{gib(new_est.bound_bytes)}, of "
               f"{gib(new_est.device_capacity_bytes)}, predicted {found.step.seconds:.3g} s/step (within "
               f"{SPEED_TIE:.0%} of the fastest of {found.fitting} config(s) that fit). Why: {why}.")
        return GateDecision(True, mode, new_cfg, new_est, est, changes=changes, message=msg, suggestion=overrides,
                            step=found.step)
    msg = (f"{shortfall} A config that fits ({gib(new_est.per_rank_peak_bytes)}, at most {gib(new_est.bound_bytes)}): "
           f"{' '.join(overrides)} — "
           "add these overrides, or gate=autofit to apply them, or gate=warn to launch anyway.")
    alt = _with_8bit(cfg, plan, hw, cal)
    if alt and "optimizer=adamw8bit" in alt and alt != overrides:
        msg += f" Or with 8-bit optimizer states (the numerics change slightly): {' '.join(alt)}."
    if mode == GateMode.warn:
        return GateDecision(True, mode, cfg, est, est, message=msg, warning=msg, suggestion=overrides)
    return GateDecision(False, mode, cfg, est, est, message=msg, suggestion=overrides)


def _ceiling_below_tensors(cfg: RunConfig, est: Estimate) -> Optional[str]:
    """An explicit launcher.heap_limit_mib below the tensors a CPU rank holds at its peak: tcmalloc would fail the
    first step (train/heap_limit.py), and no smaller micro-batch is what the user asked for. The tensors are the
    floor: the heap also holds the interpreter's share, so a ceiling just above them can still be too low."""
    ceiling = cfg.launcher.heap_limit_mib
    if ceiling <= 0 or not est.device.startswith("cpu") or est.summary.get("allocator") != "tcmalloc":
        return None
    tensors = counted_bytes(est.components)
    if ceiling * 2**20 >= tensors:
        return None
    return (f"launcher.heap_limit_mib={ceiling} holds each CPU rank's tcmalloc heap under {ceiling} MiB, but its "
            f"tensors alone reach {tensors / 2**20:,.0f} MiB at the peak ({est.peak_phase}): the first step would "
            f"fail. Fix: launcher.heap_limit_mib={-(-int(1.1 * tensors) // 2**20)} (the tensors and 10%), -1 (each "
            "rank's share of host RAM) or 0 (no ceiling).")


def table_configs(cfg: RunConfig, accelerator: str = "cuda") -> List[Tuple[str, RunConfig]]:
    """The estimate table's rows: ``cfg`` at every layout of the rule table for its parallel mode, labelled; "¹"
    marks a row that takes the model's own loss where the composed config on ``accelerator`` ranks fuses it."""
    rows = []
    tp = f"TP {cfg.parallel.tp_size} · " if cfg.parallel.mode == ParallelMode.tp else ""
    for layout in layouts(cfg.parallel.mode, cfg.adapter.name):
        params = layout.params if layout.stage == 3 and layout.device != OffloadDevice.none else None
        z = dataclasses.replace(cfg.zero, stage=layout.stage)
        o = dataclasses.replace(cfg.offload, device=layout.device, params=params)
        row, unfused = dataclasses.replace(cfg, zero=z, offload=o), ""
        if fused_loss_on(cfg, accelerator) and not fused_loss_runs(cfg, layout.stage):  # ZeRO-3: the model's own
            row, unfused = dataclasses.replace(row, trainer=dataclasses.replace(cfg.trainer, fused_loss=False)), " ¹"
        rows.append((f"{tp}ZeRO-{layout.stage}  offload {layout.label}{unfused}", row))
    return rows


def tp_table_configs(cfg: RunConfig, world: World) -> List[Tuple[str, RunConfig]]:
    """The estimate table's tensor-parallel rows for a data-parallel ``cfg`` on several ranks: each tp_size the rules
    allow (a divisor of the world and of the key/value heads, a model AutoTP splits, no adapter or offload), at the
    composed ZeRO stage."""
    from ..config.rules import adapter_problems, tp_problems

    if cfg.parallel.mode != ParallelMode.dp or world.size < 2 or OffloadDevice(cfg.offload.device) != OffloadDevice.none:
        return []
    rows = []
    for tp in range(2, world.size + 1):
        par = dataclasses.replace(cfg.parallel, mode=ParallelMode.tp, tp_size=tp)
        if tp_problems(cfg.model, tp, world.size, OffloadDevice.none) \
                or adapter_problems(cfg.adapter.name, cfg.zero.stage, ParallelMode.tp):
            continue
        # The same global batch as the composed config (so the step times compare the same work): each of the
        # fewer data-parallel replicas accumulates more micro-batches.
        tr = cfg.trainer
        pinned = tr.global_batch_size or tr.micro_batch_size * world.size
        if pinned % (tr.micro_batch_size * (world.size // tp)):
            continue
        rows.append((f"TP {tp} × DP {world.size // tp} · ZeRO-{cfg.zero.stage}",
                     dataclasses.replace(cfg, parallel=par, trainer=dataclasses.replace(tr, global_batch_size=pinned))))
    return rows
