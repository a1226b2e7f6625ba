"""§5 The estimate: the phases of a training step, the peak over them, and what it is compared with.

docs/memory.md §5. Not one sum but the largest of the moments a step goes through:

    alloc_peak = max(init, loss, backward, embedding grad, all-reduce, optimizer step)
    device     = CUDA context + NCCL + (1 + margin) · alloc_peak        (CUDA ranks)
    device     = process runtime + alloc_peak + offloaded host state    (CPU ranks: the "device" is host RAM)

Each phase (phases.py) lists what is alive at that moment: model states (§2), activations (§3), backward
buffers (§4); a pipeline is estimated stage by stage (§6) and judged by its worst stage.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ..allocators import PRELOADED, small_block_threshold
from ..allocators import concrete as allocator_of
from ..config import Allocator, Dtype, Family, OffloadDevice, OptimizerImpl, Plan, RunConfig
from ..hardware import GIB, Hardware
from .bound import term_widths, upper_bound
from ..arch import layer_linears, lora_targets
from .activations import DTYPE_BYTES, Activations, activations, with_fused_loss
from .buffers import backward_buffers, embedding_norm_block, other_rank, partitioned_on_device, zero_partition
from .params import ParamBreakdown, model_key, param_breakdown
from .phases import Phase, step_phases
from .page_heap import page_heap_bytes, placement_bytes
from .priors import DEFAULT_CALIBRATION, OVERHEADS, PAGE_HEAP_TERM, RUNTIME_TERM, Calibration, correction_key, runtime_overhead_key
from .stages import pipeline_stages, stage_view
from .states import (DS_SUB_GROUP_SIZE, ModelStates, export_gather_bytes, export_pickle_blocks,
                     gradients_kept_after_step, host_step_bytes, model_states, param_swap_element_bytes, phase)


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass
class Estimate:
    """Per-rank peak memory of one configuration. All sizes in bytes.

    ``components`` is the breakdown of the winning phase (they sum to ``per_rank_peak_bytes``);
    ``phases`` holds every phase's breakdown. On CPU ranks the "device" is host RAM (``device`` says so)
    and the offloaded host state is part of each phase.
    """

    components: "OrderedDict[str, int]"
    per_rank_peak_bytes: int
    device_capacity_bytes: int
    host_bytes_per_node: int
    nvme_bytes: int
    fits: bool
    device: str = "cuda"
    peak_phase: str = ""
    phases: Dict[str, "OrderedDict[str, int]"] = field(default_factory=dict)
    host_components: "OrderedDict[str, int]" = field(default_factory=OrderedDict)
    """Host RAM of one rank (offloaded state, pinned buffers, the rank's process); per node = × ranks per node."""
    host_capacity_bytes: int = 0
    fits_device: bool = True
    fits_host: bool = True
    model_state_bytes: int = 0
    """Parameters + gradients + fp32 master + optimizer states held on the device per rank (§2.1)."""
    params: int = 0
    summary: Dict[str, Any] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    stages: List[Dict[str, Any]] = field(default_factory=list)
    """parallel=pipeline: each stage's layers, 1F1B depth, peak and breakdown (the estimate is the worst one)."""
    calibration: str = "prior"
    """"calibrated on this machine" when a measured correction applied, else "prior"."""
    bound_bytes: int = 0
    """At most this per rank: the point plus each term's uncertainty (bound.py); the gate decides on it."""
    bound_widths: Dict[str, int] = field(default_factory=dict)
    others_peak_bytes: int = 0
    """The ranks that do not write the export (all but global rank 0): their peak leaves out the export phase.
    0: the same as ``per_rank_peak_bytes`` (no export phase, or it is not the peak)."""
    others_bound_bytes: int = 0

    def others_json(self) -> Dict[str, int]:
        """The figures of the ranks that do not export, where they differ (estimate.json, per stage too)."""
        return ({"other_ranks_peak_bytes": self.others_peak_bytes, "other_ranks_bound_bytes": self.others_bound_bytes}
                if self.others_peak_bytes else {})

    def top(self, n: int = 3, *, overheads: bool = False) -> List[Tuple[str, int]]:
        """The n biggest consumers of the peak, largest first; the fixed overheads (context, NCCL,
        allocator margin, process runtime) only with ``overheads=True``."""
        items = [kv for kv in self.components.items() if overheads or kv[0] not in OVERHEADS]
        return sorted(items, key=lambda kv: -kv[1])[:n]

    def to_json(self) -> Dict[str, Any]:
        """What goes into the run dir's estimate.json."""
        return {
            "device": self.device,
            "per_rank_peak_bytes": self.per_rank_peak_bytes,
            "per_rank_peak_gib": round(self.per_rank_peak_bytes / GIB, 3),
            "per_rank_bound_bytes": self.bound_bytes,
            "per_rank_bound_gib": round(self.bound_bytes / GIB, 3),
            "bound_widths": dict(self.bound_widths),
            **self.others_json(),
            "device_capacity_bytes": self.device_capacity_bytes,
            "fits": self.fits,
            "fits_device": self.fits_device,
            "fits_host": self.fits_host,
            "peak_phase": self.peak_phase,
            "components": dict(self.components),
            "phases": {k: dict(v) for k, v in self.phases.items()},
            "host_bytes_per_node": self.host_bytes_per_node,
            "host_capacity_bytes": self.host_capacity_bytes,
            "host_components_per_rank": dict(self.host_components),
            "nvme_bytes": self.nvme_bytes,
            "model_state_bytes": self.model_state_bytes,
            "params": self.params,
            "config": dict(self.summary),
            "notes": list(self.notes),
            **({"pipeline_stages": list(self.stages)} if self.stages else {}),
            "calibration": {"source": "calibrated" if self.calibration.startswith("calibrated") else "prior",
                            "what": self.calibration,
                            "correction_bytes": self.components.get("measured correction (this machine)", 0)},
            "source": "zerorun.memory (docs/memory.md §1-§6)",
        }


def estimate(cfg: RunConfig, plan: Plan, hw: Hardware, *, cal: Calibration = DEFAULT_CALIBRATION) -> Estimate:
    """Per-rank peak memory of ``cfg`` as ``plan`` lays it out on ``hw``: phases, components, fits.

    Pure arithmetic on the config. With ``parallel=pipeline`` each stage is estimated with its own
    layers and 1F1B depth; the result is the stage with the highest peak, and ``stages`` lists them all.
    """
    labels, tp = cfg.task.num_labels, plan.tensor_parallel
    # With tensor parallelism (§3.10) every count below is one rank's share of each layer (arch/decoder.py Decoder.tp)
    bd = param_breakdown(cfg.model, plan.task, labels, cfg.adapter, tp)
    key = model_key(cfg.model, plan.task, labels, cfg.adapter, tp)
    lora = (lora_targets(cfg.model, cfg.adapter), cfg.adapter.r, cfg.adapter.dropout) if bd.lora else None
    act = activations(cfg.model, plan.micro_batch_size, plan.seq_len, Dtype(cfg.precision.dtype),
                      plan.world.accelerator, cfg.trainer.activation_checkpointing, task=plan.task, num_labels=labels,
                      mmap_threshold=small_block_threshold(cfg.launcher, plan.world.accelerator), lora=lora, tp=tp,
                      pipeline=plan.pipeline)
    if bd.quantized:  # each 4-bit layer dequantizes its weight into the compute dtype for forward and backward
        largest = max((i * o for shapes in layer_linears(cfg.model).values() for i, o in shapes), default=0)
        act = dataclasses.replace(act, working_set=act.working_set + largest * DTYPE_BYTES[Dtype(cfg.precision.dtype)])
    if plan.fused_loss:
        act = with_fused_loss(act, cfg.model, plan.micro_batch_size * plan.seq_len,
                              DTYPE_BYTES[Dtype(cfg.precision.dtype)], head_trains=not bd.lora,
                              accelerator=plan.world.accelerator)
    if tp > 1:
        whole = param_breakdown(cfg.model, plan.task, labels, cfg.adapter)
        est = rank_estimate(cfg, plan, hw, cal, bd, act, whole.total, key, tp_gathered=tp_gathered(whole, bd))
        return dataclasses.replace(est, params=whole.total, summary=dict(est.summary, params=whole.total,
                                                                         params_per_rank=bd.total))
    if not plan.pipeline:
        return rank_estimate(cfg, plan, hw, cal, bd, act, bd.total, key)
    stages = pipeline_stages(cfg, plan)
    last = len(stages) - 1
    views = [stage_view(cfg, bd, act, st, st.index == last) for st in stages]
    held = [view[0].total for view in views]  # each stage's own parameters, a tied head's copy included
    per_stage = [rank_estimate(cfg, plan, hw, cal, *views[i], bd.total, key,
                               exporter=i == 0,  # global rank 0 holds stage 0 and writes the export
                               other_stages=tuple(n for j, n in enumerate(held) if j != i))
                 for i in range(len(stages))]
    worst = max(range(len(stages)), key=lambda i: per_stage[i].per_rank_peak_bytes)
    est = per_stage[worst]
    world = plan.world
    # Ranks are laid out stage-major (PipeDataParallelTopology): on one node every stage's ranks share the
    # host; across nodes, count the heaviest stage on every rank of a node (an upper bound).
    if world.nnodes == 1:
        host_node = sum(e.host_bytes_per_node // max(1, world.nproc_per_node) * plan.data_parallel_size
                        for e in per_stage)
    else:
        host_node = max(e.host_bytes_per_node for e in per_stage)
    fits_host = est.host_capacity_bytes <= 0 or host_node <= est.host_capacity_bytes
    fits_device = all(e.fits_device for e in per_stage)
    summary = dict(est.summary, params=bd.total, pipeline_stages=len(stages), peak_stage=worst)
    notes = est.notes + [f"pipeline: stage {worst} of {len(stages)} has the highest peak ({gib(est.per_rank_peak_bytes)}"
                         f"; it holds {stages[worst].in_flight} micro-batch(es) in flight and "
                         f"{stages[worst].blocks} of {bd.num_layers} layers)."]
    return dataclasses.replace(
        est, host_bytes_per_node=int(host_node), fits_host=fits_host, fits_device=fits_device,
        fits=fits_host and fits_device, params=bd.total, summary=summary, notes=notes,
        stages=[dict(st.to_json(), per_rank_peak_bytes=e.per_rank_peak_bytes, per_rank_bound_bytes=e.bound_bytes,
                     **e.others_json(),
                     # stage-major ranks: each stage's first replica sends it to the export (rank 0 writes it)
                     exporting_rank=st.index * plan.data_parallel_size,
                     peak_phase=e.peak_phase,
                     model_state_bytes=e.model_state_bytes, components=dict(e.components), fits=e.fits_device,
                     phases={k: dict(v) for k, v in e.phases.items()})
                for st, e in zip(stages, per_stage)])


def tp_gathered(whole: ParamBreakdown, shard: ParamBreakdown) -> int:
    """Elements of the whole tensors that tensor parallelism split (those whose share differs from the whole)."""
    return sum(w for w, s in zip(whole.tensors(), shard.tensors()) if w != s)


def rank_estimate(cfg: RunConfig, plan: Plan, hw: Hardware, cal: Calibration, bd: ParamBreakdown,
                  act: Activations, built_params: int, key: Tuple, exporter: bool = True,
                  tp_gathered: int = 0, other_stages: Tuple[int, ...] = ()) -> Estimate:
    """One rank's estimate for the parameters in ``bd`` and the activations in ``act`` (the whole model,
    one pipeline stage, or one tensor-parallel share); ``built_params``: what build_model() makes on every rank
    first (the whole model); ``key``: the params.model_key of ``bd``; ``exporter``: this rank writes the final
    export; ``tp_gathered``: elements of the split tensors, gathered whole for the export; ``other_stages``: the
    parameters each other pipeline stage holds."""
    fp16 = hw.accelerator == "cuda" or hw.fp16_ok
    states = model_states(cfg, plan, bd, param_swap_element_bytes(Dtype(cfg.precision.dtype), fp16))
    bwd = backward_buffers(cfg, plan, bd, key)
    gathered = export_gather_bytes(cfg, plan, built_params, bd.total, exporter, tp_gathered, other_stages)
    # after training: the states (as the step left them), the model gathered for the export. ZeRO-3's parameters
    # are gathered again by evaluation's forward and stay so (stage3_max_reuse_distance): GPT-2 small fp32 + CPU
    # offload, rank 0 rose 253 MiB above its training peak while exporting.
    kept = states.device.items() if gradients_kept_after_step(cfg) else \
        [(k, v) for k, v in states.device.items() if k != "gradients"]
    export = phase([*kept, *bwd.buffers, *bwd.resident, ("pipeline buffers", act.pipe_buffers),
                    ("model gathered for export", gathered)]) if gathered else None
    phases = rank_phases(cfg, plan, cal, bd, act, states, bwd, built_params, export=export)
    est = against_capacity(cfg, plan, hw, cal, bd, act, states, phases, bwd.notes, built_params,
                           export_blocks=export_pickle_blocks(cfg, plan, bd.total, exporter, other_stages))
    # The other ranks: only global rank 0 exports, and under ZeRO-1/2 ranks differ in the tensors their partition
    # holds whole (buffers.zero_partition; other_rank: the largest of the others), and only rank 0 holds the word
    # embedding's gradient norm with offload (rank 1 holds what is left of it, the most any other rank holds).
    ranks = plan.data_parallel_size
    zero12 = partitioned_on_device(cfg, plan)
    other = other_rank(bd, ranks) if zero12 else 1
    differ = ranks > 1 and (embedding_norm_block(cfg, plan, bd, rank=other) != embedding_norm_block(cfg, plan, bd)
                            or zero12 and zero_partition(bd, ranks, other) != zero_partition(bd, ranks, 0))
    if est.peak_phase == "export" or differ:
        rest = rank_phases(cfg, plan, cal, bd, act, states, bwd, built_params, rank=other) if differ else \
            OrderedDict((k, v) for k, v in phases.items() if k != "export")
        rest_est = against_capacity(cfg, plan, hw, cal, bd, act, states, rest, [], built_params, rank=other)
        est = dataclasses.replace(est, others_peak_bytes=rest_est.per_rank_peak_bytes,
                                  others_bound_bytes=rest_est.bound_bytes)
    return est


def rank_phases(cfg: RunConfig, plan: Plan, cal: Calibration, bd: ParamBreakdown, act: Activations,
                states: ModelStates, bwd, built_params: int, rank: int = 0,
                export: Optional[Phase] = None) -> "OrderedDict[str, Phase]":
    """One data-parallel rank's phases: training's, then ``export`` where this rank writes it; on CPU ranks with
    the host's offloaded state in each (the device is host RAM) and the fp32 build as the first."""
    phases = step_phases(cfg, plan, bd, act, states, bwd, cal, rank)
    if export:
        phases["export"] = export
    if plan.world.accelerator == "cpu":
        host_steady = phase(states.host)
        for name in phases:
            phases[name] = phase([*phases[name].items(), *host_steady.items()])
        # build_model() makes fp32 weights; DeepSpeed casts them in place, one tensor at a time.
        phases["init"] = phase([("fp32 model as built", built_params * 4), ("buffers", bd.buffer_bytes)])
        phases.move_to_end("init", last=False)
    return phases


def _zero3_regather_heap(cfg: RunConfig, plan: Plan, bd: ParamBreakdown) -> int:
    """CPU ranks, ZeRO-3 in 16-bit with checkpointing: recomputation gathers every layer's parameters a
    second time in backward, and the heap keeps about one more copy of the 16-bit layers resident
    (measured on GPT-2 small: 208 MiB above live tensors, 162 MiB predicted; tiny GPT-2 2 MiB; §5.4). Not with
    the parameters offloaded: they are gathered from the host partition into the same buffers (measured on GPT-2
    small with CPU offload: the whole non-tensor residue 95 MiB, the process overhead alone)."""
    if cfg.zero.stage != 3 or Dtype(cfg.precision.dtype) == Dtype.fp32 or not cfg.trainer.activation_checkpointing \
            or plan.offload_params:
        return 0
    return bd.num_layers * bd.per_layer * DTYPE_BYTES[Dtype(cfg.precision.dtype)]


def against_capacity(cfg: RunConfig, plan: Plan, hw: Hardware, cal: Calibration, bd: ParamBreakdown,
                     act: Activations, states: ModelStates, phases: "OrderedDict[str, Phase]", notes: List[str],
                     built_params: int, rank: int = 0, export_blocks: Tuple[int, ...] = ()) -> Estimate:
    """The peak phase, the terms outside the allocator, and whether the rank (data-parallel ``rank``) and the
    node's host RAM fit; ``export_blocks``: the export's whole-stage blocks (states.export_pickle_blocks)."""
    m, tr, world = cfg.model, cfg.trainer, plan.world
    allocator = allocator_of(cfg.launcher, world.accelerator)
    host_steady = phase(states.host)
    peak_phase = max(phases, key=lambda k: sum(phases[k].values()))
    alloc_peak = sum(phases[peak_phase].values())
    comps = OrderedDict(sorted(phases[peak_phase].items(), key=lambda kv: -kv[1]))
    sub = states.partition if cfg.zero.stage < 3 else min(states.partition, DS_SUB_GROUP_SIZE)  # sub-groups: ZeRO-3
    host_step = host_step_bytes(cfg, plan, sub) if plan.offload_optimizer and world.accelerator == "cuda" else 0
    host_components = phase([*host_steady.items(), ("optimizer-step transient (host)", host_step),
                             ("process runtime", cal.cpu_process_bytes if world.accelerator == "cpu"
                              else cal.cuda_process_host_bytes)])
    placement, cache = 0, None
    kind = ""  # CPU ranks: the key a micro rank measured this kind of run's terms by
    if world.accelerator == "cpu":
        kind = runtime_overhead_key(cfg, hw, world.nproc_per_node)
        # What the kernel counts beyond live tensors (§5.4): the process itself, the heap that freed
        # small activations leave behind, and what training pages in.
        comps["process runtime"] = cal.cpu_process_bytes
        retained = int(cal.heap_retention * act.heap_churn)
        if allocator == Allocator.tcmalloc:  # its caches as measured for this kind, else at most their cap
            cache = cal.allocator_cache(kind)
            retained = cache if cache is not None else min(retained, cal.tcmalloc_thread_caches)
        comps["heap retention"] = retained + _zero3_regather_heap(cfg, plan, bd)
        if allocator in PRELOADED:
            # Freed spans stay in the allocator's page heap for reuse (what makes it fast); the blocks that find
            # none large enough grow it (page_heap.py, §5.4).
            comps[PAGE_HEAP_TERM] = page_heap_bytes(cfg, plan, act, phases, alloc_peak, states.partition,
                                                    bd.largest_trainable, built_params,
                                                    embedding_norm_block(cfg, plan, bd, rank), export_blocks)
            placement = placement_bytes(cfg, plan, act, phases, states.partition, bd.largest_trainable)
        # bitsandbytes' import pages in what the ZeRO optimizer's start-up does (measured on tiny GPT-2: +45 MiB
        # at "built" at ZeRO-0, +4 MiB at ZeRO-2 over AdamW), so it costs the same term once.
        zero_like = cfg.zero.stage >= 1 or plan.optimizer == OptimizerImpl.bnb_adamw8bit
        measured = cal.runtime_overhead(kind)
        comps[RUNTIME_TERM] = measured if measured is not None else \
            cal.cpu_overhead_bytes + (cal.cpu_zero_overhead_bytes if zero_like else 0)
        per_rank = sum(comps.values())
        capacity = hw.host_usable_bytes // max(1, world.nproc_per_node)
        device = "cpu (host RAM)"
    else:
        margin = allocator_margin(cfg, cal)
        comps["allocator margin"] = int(margin * alloc_peak)
        comps["CUDA context"] = cal.cuda_context_bytes
        if world.size > 1:
            comps["NCCL buffers"] = cal.nccl_bytes
        per_rank = sum(comps.values())
        capacity = hw.gpu_mem_bytes
        device = "cuda"
    correction = cal.correction(correction_key(cfg, plan, hw, cal.environment)) if cal.corrections else None
    if correction is not None:
        comps["measured correction (this machine)"] = correction  # may be negative: the prior was high
        per_rank += correction
    if world.accelerator == "cpu":
        host_node = per_rank * world.nproc_per_node
    else:
        # build_model() makes fp32 weights on the host on every rank before DeepSpeed takes them
        host_init = built_params * 4 + bd.buffer_bytes
        host_node = (max(sum(host_steady.values()) + host_step, host_init) + cal.cuda_process_host_bytes) \
            * world.nproc_per_node
    host_cap = hw.host_usable_bytes
    widths = term_widths(comps, accelerator=world.accelerator, process_measured=cal.process_measured,
                         mmap_threshold=small_block_threshold(cfg.launcher, world.accelerator),
                         allocator=allocator,
                         calibrated=correction is not None, placement=placement)
    bound = upper_bound(per_rank, widths)
    fits_device = capacity > 0 and bound <= capacity
    fits_host = host_cap <= 0 or host_node <= host_cap
    notes = list(notes)
    if cfg.data.seq_len > m.max_positions:
        notes.append(f"data.seq_len={cfg.data.seq_len} exceeds model.max_positions={m.max_positions}.")
    summary = {
        "model": m.name, "family": Family(m.family).value, "task": plan.task.value, "params": bd.total,
        "trainable_params": bd.trainable, "adapter": cfg.adapter.name.value,
        "zero_stage": cfg.zero.stage, "offload": OffloadDevice(cfg.offload.device).value,
        "offload_params": plan.offload_params, "precision": Dtype(cfg.precision.dtype).value,
        "micro_batch_size": tr.micro_batch_size, "seq_len": cfg.data.seq_len, "batch_seq_len": plan.seq_len,
        "activation_checkpointing": tr.activation_checkpointing, "grad_accum_steps": plan.grad_accum_steps,
        "global_batch_size": plan.global_batch_size, "data_parallel_size": max(1, plan.data_parallel_size),
        "ranks_per_node": world.nproc_per_node, "nodes": world.nnodes, "accelerator": world.accelerator,
        "allocator": allocator.value,
        **({"allocator_cache_bytes": cache} if cache is not None else {}),  # tcmalloc's caches, measured for the kind
        "attention_kernel": act.kernel, "buckets": plan.buckets.to_json(), "overlap_comm": cfg.zero.overlap_comm,
    }
    return Estimate(components=comps, per_rank_peak_bytes=int(per_rank), device_capacity_bytes=int(capacity),
                    host_bytes_per_node=int(host_node), nvme_bytes=int(states.nvme * world.nproc_per_node),
                    fits=fits_device and fits_host, device=device, peak_phase=peak_phase, phases=dict(phases),
                    host_components=host_components, host_capacity_bytes=int(host_cap), fits_device=fits_device,
                    fits_host=fits_host, model_state_bytes=int(states.model_state_bytes), params=bd.total,
                    summary=summary, notes=notes, bound_bytes=bound, bound_widths=widths,
                    calibration="calibrated on this machine" if correction is not None else
                    "prior; process baseline measured on this machine"
                    + (", and its runtime overhead" if cal.runtime_overhead(kind) is not None else "")
                    if cal.process_measured and world.accelerator == "cpu" else "prior")


def allocator_margin(cfg: RunConfig, cal: Calibration) -> float:
    """CUDA ranks: the caching allocator's margin over its peak, by whether it runs with expandable segments
    (zerorun sets them unless told not to, or unless the user's own PYTORCH_CUDA_ALLOC_CONF decides)."""
    import os

    own = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    expandable = "expandable_segments:True" in own if own is not None else cfg.launcher.expandable_segments
    return cal.allocator_margin_expandable if expandable else cal.allocator_margin
