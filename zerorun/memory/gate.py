"""§7 The gate and autofit: refuse what will not fit, or apply the fastest config that does.

docs/memory.md §7. Autofit estimates every config it may choose (micro-batch, checkpointing, buckets, the
layouts of the rule table, 8-bit states, the mmap threshold) and of those that fit applies the one with the
lowest predicted step time (zerorun.speed); the estimate table shows the layouts side by side. The runtime
OOM repair instead walks a fixed ladder, one rung at a time.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from ..config import (AdapterName, Dtype, GateMode, OffloadDevice, OptimizerName, ParallelMode, Plan, RunConfig, UserError, World,
                      bucket_sizes, data_parallel_size, layouts, make_plan, params_offloaded,
                      small_bucket_sizes)
from ..allocators import concrete as allocator_of
from ..config.rules import CPU_MMAP_THRESHOLD, mmap_threshold_bytes
from ..config.schema import Allocator
from ..hardware import Hardware
from .. import speed  # a module reference: zerorun.speed imports this package's activations and params
from .estimate import Estimate, estimate, gib
from .priors import DEFAULT_CALIBRATION, Calibration


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    why: str

    def override(self) -> str:
        return _override(self.key, self.new)


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
class _Knobs:
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


def _apply(cfg: RunConfig, world: World, k: _Knobs, pinned_global: int) -> Tuple[RunConfig, List[Change]]:
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
    new_par = cfg.parallel
    if k.micro != tr.micro_batch_size and cfg.parallel.mode == ParallelMode.pipeline and cfg.parallel.micro_batches:
        accum = pinned_global // (k.micro * data_parallel_size(cfg, world))
        changes.append(Change("parallel.micro_batches", cfg.parallel.micro_batches, accum,
                              "the pipeline streams that many smaller micro-batches per step"))
        new_par = dataclasses.replace(new_par, micro_batches=accum)
    new = dataclasses.replace(cfg, trainer=new_tr, zero=new_z, offload=new_off, parallel=new_par, optimizer=new_opt,
                              launcher=new_la, adapter=new_ad)
    return new, changes


def _candidates(cfg: RunConfig, world: World, pinned_global: int) -> List[_Knobs]:
    """Every config autofit may choose, in the ladder's order (``_ladder_rank``): the smallest change first.

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
        and cfg.parallel.mode == ParallelMode.dp and _has_bitsandbytes()
    may_qlora = cfg.adapter.autofit_qlora and cfg.adapter.name == AdapterName.lora and _has_bitsandbytes() \
        and not cfg.adapter.merge
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
        for opt8 in ([False, True] if may_8bit and layout.device != OffloadDevice.nvme else [False]):
            for small in ([False, True] if shrinkable else [False]):
                for ckpt in ([False, True] if not tr.activation_checkpointing else [True]):
                    for low in ([False, True] if world.accelerator == "cpu" and _mmap_lowerable(cfg) else [False]):
                        for micro in micros:
                            out += [_Knobs(micro, ckpt, small, layout.stage, layout.device, params, opt8, low, q)
                                    for q in ([False, True] if may_qlora else [False])]
    return sorted(out, key=_ladder_rank)


def _ladder_rank(k: _Knobs) -> Tuple:
    """The ladder's order, smallest change first: parameter offload, then optimizer offload, 8-bit optimizer
    states, stage, small buckets, checkpointing, a low mmap threshold (CPU ranks) and a smaller micro-batch each
    weigh more than everything after them. The runtime OOM repair climbs it; autofit breaks ties with it."""
    tier = 0 if k.offload == OffloadDevice.none else (2 if params_offloaded(k.stage, k.offload, k.params) else 1)
    return (tier == 2, tier >= 1, k.qlora, k.opt8, k.stage, k.small_buckets, k.ckpt, k.low_mmap, -k.micro)


SPEED_TIE = 0.03
"""Predicted step times within 3% of the fastest count as a tie (the model resolves no finer), and the tie
goes to the earlier rung of the ladder: the smaller change (no offload, the user's stage, no recomputation)."""


def fitting_configs(cfg: RunConfig, plan: Plan, hw: Hardware, *, cal: Calibration = DEFAULT_CALIBRATION,
                    profile: Optional["speed.SpeedProfile"] = None) -> List["Fit"]:
    """Every config autofit may choose (``_candidates``) that fits, in the ladder's order, each with its
    estimate and predicted step time. ``global_batch_size`` stays fixed (pinned to micro × ranks when it was
    unset), so step times compare the same work."""
    pinned = plan.global_batch_size
    fits: List[Fit] = []
    for knobs in _candidates(cfg, plan.world, pinned):
        new, changes = _apply(cfg, plan.world, knobs, pinned)
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


def runtime_oom_repair(cfg: RunConfig, plan: Plan) -> Optional[Tuple[RunConfig, List[Change]]]:
    """After an out-of-memory error at runtime, the next config to try (None: nothing left): the
    micro-batch halved (to the largest size that keeps the global batch, so the data order is the same),
    and at micro-batch 1 the next rung of autofit's ladder that keeps micro-batch 1 (checkpointing,
    smaller buckets, a higher ZeRO stage, CPU offload, parameter offload)."""
    pinned = plan.global_batch_size
    # Never a change of optimizer at runtime: the relaunch resumes the checkpoint, whose states are AdamW's.
    knobs = [k for k in _candidates(cfg, plan.world, pinned) if not k.opt8]
    micro = cfg.trainer.micro_batch_size
    if micro > 1:
        smaller = sorted({k.micro for k in knobs if k.micro <= micro // 2}, reverse=True)
        if smaller:
            off = cfg.offload
            return _apply(cfg, plan.world, _Knobs(smaller[0], cfg.trainer.activation_checkpointing, False,
                                                  cfg.zero.stage, OffloadDevice(off.device), off.params), pinned)
    off = cfg.offload
    here = _ladder_rank(_Knobs(1, cfg.trainer.activation_checkpointing, False, cfg.zero.stage,
                              OffloadDevice(off.device), off.params))
    for k in knobs:  # the next rung down the ladder at micro-batch 1 that changes something
        if k.micro == 1 and _ladder_rank(k) > here:
            new, changes = _apply(cfg, plan.world, k, pinned)
            if changes:
                return new, changes
    return None


def _has_bitsandbytes() -> bool:
    import importlib.util

    return importlib.util.find_spec("bitsandbytes") is not None


def _with_8bit(cfg: RunConfig, plan: Plan, hw: Hardware, cal: Calibration) -> Optional[List[str]]:
    """The overrides of the fastest fit once adamw8bit is allowed, when the user did not allow it."""
    if cfg.optimizer.autofit_8bit or cfg.optimizer.name != OptimizerName.adamw or not _has_bitsandbytes():
        return None
    found = autofit(dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, autofit_8bit=True)),
                    plan, hw, cal=cal)
    return [c.override() for c in found.changes] if found else None


def _mmap_lowerable(cfg: RunConfig) -> bool:
    """Whether glibc at the memory-saving 1 MiB threshold would hold less resident than the config's allocator
    (tcmalloc, jemalloc, mimalloc) or glibc mode (0, 32 or auto)."""
    return allocator_of(cfg.launcher) != Allocator.glibc or \
        mmap_threshold_bytes(cfg.launcher.mmap_threshold_mib) > CPU_MMAP_THRESHOLD


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
    if est.fits:
        unit = "GPU" if est.device == "cuda" else "rank"
        return GateDecision(True, mode, cfg, est, est,
                            message=f"fits: {gib(est.per_rank_peak_bytes)}, at most {gib(est.bound_bytes)}, of "
                                    f"{gib(est.device_capacity_bytes)} per {unit} (peak in the {est.peak_phase} phase).")
    found = autofit(cfg, plan, hw, cal=cal)
    shortfall = _shortfall(cfg, plan, est)
    if found is None:
        if est.fits_device:  # only host RAM is short: nothing on the GPU side helps
            fix = (f"every rank builds the fp32 model ({gib(4 * est.params)}) on the host before DeepSpeed takes it, "
                   "and offloaded state lives there too: fewer ranks per node (launcher.nproc_per_node), more nodes, "
                   "or a host with more RAM (hardware.host_mem_gib when planning).")
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


def table_configs(cfg: RunConfig) -> List[Tuple[str, RunConfig]]:
    """The estimate table's rows: ``cfg`` at every layout of the rule table for its parallel mode, labelled."""
    rows = []
    tp = f"TP {cfg.parallel.tp_size} · " if cfg.parallel.mode == ParallelMode.tp else ""
    for layout in layouts(cfg.parallel.mode, cfg.adapter.name):
        params = layout.params if layout.stage == 3 and layout.device != OffloadDevice.none else None
        z = dataclasses.replace(cfg.zero, stage=layout.stage)
        o = dataclasses.replace(cfg.offload, device=layout.device, params=params)
        rows.append((f"{tp}ZeRO-{layout.stage}  offload {layout.label}", dataclasses.replace(cfg, zero=z, offload=o)))
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
