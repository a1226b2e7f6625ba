"""Predicted time of one optimizer step: what autofit ranks the configs that fit by.

Pure arithmetic on the config, like the memory estimate. Seconds per optimizer step on one rank (the ranks
run in lock-step, so one rank's time is the step's):

  compute      6·N·tokens + attention 12·L·s·h·tokens FLOPs at the profile's matmul rate × its efficiency,
               plus the activation traffic of each micro-batch (what it saves for backward) at memory bandwidth
  recompute    activation checkpointing runs every layer's forward again (1/3 of the layers' compute)
  overhead     per micro-batch: Python, autograd hooks, kernel launches, per layer
  grad_comm    gradient reduction: ZeRO-0/1 once per step (all-reduce), ZeRO-2/3 every micro-batch; bytes at
               the collective bandwidth plus one latency per bucket (small buckets pay many latencies)
  param_comm   ZeRO-1/2: the updated partitions all-gathered once per step; ZeRO-3: gathered for every
               forward and backward (and recomputation) of every micro-batch
  offload      gradients to the host (ZeRO-3 and accumulating ZeRO-2: every micro-batch) and parameters back
               over the host link; parameter offload fetches the partition for every pass (from NVMe when
               there); NVMe: the optimizer states and gradients read and written each step
  optimizer    the optimizer's step over the rank's partition at its implementation's measured rate
  page_faults  CPU ranks: activations (again when recomputed) and weight gradients at or above the mmap
               threshold are page-faulted in anew every micro-batch (none with mmap off: all reused)
  bubble       pipeline: (stages - 1) idle micro-batch slots per step (1F1B)
  tp_comm      tensor parallelism (AutoTP): per layer and micro-batch, the two row-parallel outputs all-reduced in
               forward (again when recomputed) and the five column-parallel inputs' gradients in backward, each a
               whole b·s·h activation; an untied head's logits all-gathered; compute is the rank's share

Communication is not assumed to overlap compute (it partly does on GPUs with overlap_comm): the ranking
only needs the terms in proportion. Pipeline stages are taken as balanced (total / stages; the last stage's
LM head makes GPT-2's ~30% heavier). docs/speed.md has the derivation and the ranking benchmark.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict

from .config import Dtype, OffloadDevice, Plan, RunConfig, TaskName
from .allocators import heap_threshold_bytes
from .config.rules import MMAP_OFF_BYTES, OptimizerImpl
from .memory.activations import DTYPE_BYTES, activations
from .memory.buffers import ZERO0_ALLREDUCE_ELEMENTS
from .memory.params import ParamBreakdown, param_breakdown


@dataclass(frozen=True)
class SpeedProfile:
    """What one rank's hardware does per second. CPU: measured on the development machine
    (benchmarks/speed_terms.py; efficiency and bandwidth fitted to end-to-end runs); CUDA: public figures
    of an A100/H100-class node (no GPU measured yet)."""

    name: str
    matmul_flops: Dict[str, float]
    """Dense matmul FLOP/s of one rank by dtype."""
    efficiency: float
    """Fraction of that a transformer's matmuls reach in training (shapes, launch gaps)."""
    activation_bytes_per_s: float
    """Memory traffic of the elementwise ops, per byte of activations a micro-batch saves."""
    half_speed_tokens: int
    """Tokens per micro-batch at which the device reaches half its efficiency (small batches idle a GPU)."""
    overhead_per_layer_s: float
    """Per micro-batch and layer: Python, hooks, launches."""
    collective_latency_s: float
    collective_bytes_per_s: float
    """Bus bandwidth of a collective within a node."""
    internode_bytes_per_s: float
    reduce_scatter_factor: float
    """Bytes moved per byte of a reduce-scatter, relative to an all-gather: 1 with NCCL; 2 on gloo, which has
    no reduce-scatter (DeepSpeed all-reduces instead)."""
    host_link_bytes_per_s: float
    optimizer_params_per_s: Dict[OptimizerImpl, float]
    first_touch_bytes_per_s: float
    """CPU ranks: page-faulting freed memory in again (0: not a CPU profile)."""
    nvme_bytes_per_s: float


CPU_RANK = SpeedProfile(
    # benchmarks/speed_terms.py on the 2-core development machine (1 thread per rank): matmul fp32 96.6, bf16
    # 456 GFLOP/s; AdamW 573, DeepSpeedCPUAdam 1,681, bitsandbytes 8-bit 52, SGD 2,527 M params/s; first touch
    # 2.39 GiB/s; raw gloo all-reduce 179 µs + 1.43 GiB/s. Inside DeepSpeed a bucket costs more than the raw
    # collective (its hooks, copies and casts in Python): the per-call latency, collective bandwidth, matmul
    # efficiency and activation bandwidth are fitted (benchmarks/fit_speed_profile.py) to 24 configs measured by
    # benchmarks/autofit_rank.py (three GPT-2 shapes, fp32, ZeRO 0-3, offload, checkpointing, mmap threshold).
    name="cpu",
    matmul_flops={"fp32": 96.6e9, "bf16": 456e9, "fp16": 456e9},
    efficiency=1.0,
    activation_bytes_per_s=1.5e9,
    half_speed_tokens=0,
    overhead_per_layer_s=2e-3,
    collective_latency_s=2e-3,
    collective_bytes_per_s=0.45 * 2**30,
    internode_bytes_per_s=0.45 * 2**30,
    reduce_scatter_factor=2.0,
    host_link_bytes_per_s=8e9,
    optimizer_params_per_s={OptimizerImpl.torch_adamw: 573e6, OptimizerImpl.cpu_adam: 1681e6,
                            OptimizerImpl.bnb_adamw8bit: 52e6, OptimizerImpl.torch_sgd: 2527e6,
                            OptimizerImpl.fused_adam: 573e6},
    first_touch_bytes_per_s=2.39 * 2**30,
    nvme_bytes_per_s=1.5e9,
)

CUDA_GPU = SpeedProfile(
    # Public figures, A100/H100-class: dense bf16 ~312-989 TFLOP/s (fp32 without TF32 ~20-60), NVLink
    # all-reduce bus bandwidth ~150-370 GB/s, 100-400 Gb/s between nodes, pinned PCIe ~25 GB/s, DeepSpeed's
    # CPU Adam ~1 G params/s per rank (its threads), fused Adam memory-bound at ~32 B per parameter.
    name="cuda",
    matmul_flops={"fp32": 40e12, "bf16": 400e12, "fp16": 400e12},
    efficiency=0.5,
    activation_bytes_per_s=1.0e12,
    half_speed_tokens=256,
    overhead_per_layer_s=0.2e-3,
    collective_latency_s=30e-6,
    collective_bytes_per_s=150e9,
    internode_bytes_per_s=12.5e9,
    reduce_scatter_factor=1.0,
    host_link_bytes_per_s=20e9,
    optimizer_params_per_s={OptimizerImpl.fused_adam: 60e9, OptimizerImpl.cpu_adam: 1e9,
                            OptimizerImpl.bnb_adamw8bit: 60e9, OptimizerImpl.torch_sgd: 100e9,
                            OptimizerImpl.torch_adamw: 20e9},
    first_touch_bytes_per_s=0.0,
    nvme_bytes_per_s=3e9,
)


def profile_for(accelerator: str) -> SpeedProfile:
    return CPU_RANK if accelerator == "cpu" else CUDA_GPU


@dataclass(frozen=True)
class StepTime:
    terms: "OrderedDict[str, float]" = field(default_factory=OrderedDict)
    tokens_per_step: int = 0

    @property
    def seconds(self) -> float:
        return sum(self.terms.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> Dict[str, float]:
        return {"step_s": round(self.seconds, 6), "tokens_per_s": round(self.tokens_per_s, 1),
                "terms_s": {k: round(v, 6) for k, v in self.terms.items()}}


def _collective(bytes_: float, calls: int, bw: float, latency: float) -> float:
    """One sweep of a collective: bandwidth time plus one latency per call."""
    return bytes_ / bw + max(1, calls) * latency


def _tensors(bd: ParamBreakdown) -> tuple:
    """Every trained parameter tensor's element count, in module order: with LoRA only the adapters (and a
    classification head) get gradients, are reduced and stepped."""
    if bd.lora:
        return (*bd.adapter_tensors * bd.num_layers, *bd.trainable_head)
    return bd.tensors()


def reduce_calls(bd: ParamBreakdown, bucket: int, stages: int = 1) -> int:
    """Collectives of one gradient reduction in buckets of ``bucket`` elements: gradients are packed into a
    bucket until it is full, and one larger than the bucket goes alone (stage_1_and_2.py
    ``extra_large_param_to_reduce``), so GPT-2's or BERT's word embedding is one call, not V·h / bucket."""
    tensors = _tensors(bd)
    small = sum(t for t in tensors if t <= bucket)
    return max(1, (math.ceil(small / max(1, bucket)) + sum(1 for t in tensors if t > bucket)) // stages)


def predict_step_time(cfg: RunConfig, plan: Plan, profile: SpeedProfile = None) -> StepTime:
    """Seconds of one optimizer step of ``cfg`` as ``plan`` lays it out (see the module docstring)."""
    prof = profile or profile_for(plan.world.accelerator)
    m, dtype = cfg.model, Dtype(cfg.precision.dtype)
    b = DTYPE_BYTES[dtype]
    tp = plan.tensor_parallel
    bd = param_breakdown(m, plan.task, cfg.task.num_labels, cfg.adapter, tp)  # with tp: this rank's share
    stages = plan.pipeline_stages
    micro, accum, seq = plan.micro_batch_size, plan.grad_accum_steps, plan.seq_len
    tokens = micro * seq  # per micro-batch on this rank
    L, h = bd.num_layers, m.hidden_size
    lm_head = bd.tied_embedding if plan.task == TaskName.causal_lm else 0
    # Forward 2 FLOPs per weight and token, backward 2 for the input gradient and 2 for the weight's, which a
    # frozen weight (LoRA's base) skips; attention's scores and values 12·s·(heads × head width) per token (Gemma's
    # differs from the hidden size). A mixture of experts runs a token through top-k of them (active_fraction).
    width = m.num_heads * (m.head_dim or h // m.num_heads) // tp
    active = bd.per_layer * bd.active_fraction
    trained_layer = sum(bd.adapter_tensors) if bd.lora else active
    trained_head = sum(bd.trainable_head) if bd.lora else bd.head + lm_head
    layer_flops = (4 * active + 2 * trained_layer) * tokens + 12 * seq * width * tokens
    flops = (L * layer_flops + (4 * (bd.head + lm_head) + 2 * trained_head) * tokens) / stages
    rate = prof.matmul_flops[dtype.value] * prof.efficiency
    if prof.half_speed_tokens:
        rate *= tokens / (tokens + prof.half_speed_tokens)
    threshold = heap_threshold_bytes(cfg.launcher, plan.world.accelerator)
    full = activations(m, micro, seq, dtype, plan.world.accelerator, False, task=plan.task,
                       num_labels=cfg.task.num_labels, mmap_threshold=threshold, tp=tp)
    traffic = (full.outside_layers + L * full.per_layer + full.logits_loss) / stages
    per_micro: "OrderedDict[str, float]" = OrderedDict()
    per_micro["compute"] = flops / rate + traffic / prof.activation_bytes_per_s
    per_micro["recompute"] = ((L * layer_flops / 3) / rate + L * full.per_layer / 2 / prof.activation_bytes_per_s) \
        / stages if cfg.trainer.activation_checkpointing else 0.0
    per_micro["overhead"] = prof.overhead_per_layer_s * (L / stages + 2)
    if prof.first_touch_bytes_per_s and plan.world.accelerator == "cpu" and threshold < MMAP_OFF_BYTES:
        # (mmap off: every freed block is reused from the heap, nothing is faulted anew after the first step.)
        # Every activation above the threshold (a checkpointed forward still allocates them all, and the
        # recomputation makes each layer's again), and every weight gradient above it: autograd makes each
        # micro-batch's gradient anew before adding it to .grad or copying it into a bucket.
        faulted = max(0, full.saved + full.working_set + full.logits_loss - full.heap_churn)
        if cfg.trainer.activation_checkpointing:
            faulted += L * max(0, full.per_layer - full.small_per_layer)
        faulted += sum(t * b for t in _tensors(bd) if t * b >= threshold)
        per_micro["page_faults"] = faulted / stages / prof.first_touch_bytes_per_s
    terms: "OrderedDict[str, float]" = OrderedDict((k, v * accum) for k, v in per_micro.items())
    if plan.pipeline:
        slot = sum(per_micro.values())
        terms["bubble"] = (stages - 1) * slot
        # Each micro-batch's boundary activations go to the next stage and its gradient comes back.
        terms["pipe_p2p"] = accum * 2 * _collective(tokens * h * b, 1, prof.collective_bytes_per_s,
                                                    prof.collective_latency_s)
    if tp > 1:
        # Ring all-reduce moves 2(tp-1)/tp of the tensor; the groups are consecutive ranks (within a node).
        passes = 3 if cfg.trainer.activation_checkpointing else 2
        calls = L * (2 * (passes - 1) + 5)
        logits = tokens * m.vocab_size * b if not m.tie_word_embeddings else 0
        moved = 2 * (tp - 1) / tp * tokens * h * b * calls + (tp - 1) / tp * logits
        terms["tp_comm"] = accum * _collective(moved, calls + (1 if logits else 0), prof.collective_bytes_per_s,
                                               prof.collective_latency_s)
    terms.update(_communication(cfg, plan, prof, bd, b, accum))
    return StepTime(terms, tokens_per_step=plan.tokens_per_step)


def _communication(cfg: RunConfig, plan: Plan, prof: SpeedProfile, bd: ParamBreakdown, b: int, accum: int
                   ) -> "OrderedDict[str, float]":
    """ZeRO's collectives, offload transfers and the optimizer step for a rank's share of ``bd``."""
    out: "OrderedDict[str, float]" = OrderedDict()
    stages = plan.pipeline_stages
    n = bd.trainable // stages  # what is reduced, partitioned and stepped (LoRA: the adapters)
    dp, stage = plan.data_parallel_size, cfg.zero.stage
    bw = prof.internode_bytes_per_s if plan.world.nnodes > 1 else prof.collective_bytes_per_s
    lat, bk = prof.collective_latency_s, plan.buckets
    share = (dp - 1) / dp
    passes = 3 if cfg.trainer.activation_checkpointing else 2  # forward, backward (+ recomputation)
    if dp > 1:
        calls = reduce_calls(bd, bk.reduce_bucket_size, stages)
        if stage == 0:  # the engine all-reduces the accumulated gradients once per step, flattened in 5e8 elements
            out["grad_comm"] = _collective(2 * share * n * b, math.ceil(n / ZERO0_ALLREDUCE_ELEMENTS), bw, lat)
        elif stage == 1:  # ZeRO-1 reduces them once per step too, in reduce buckets
            out["grad_comm"] = _collective(2 * share * n * b, calls, bw, lat)
        else:  # ZeRO-2/3 reduce in backward, every micro-batch
            out["grad_comm"] = accum * _collective(share * n * b * prof.reduce_scatter_factor, calls, bw, lat)
        if stage in (1, 2):
            # One all_gather_into_tensor per parameter group whatever allgather_bucket_size says (torch >= 2 has
            # it on every backend: deepspeed/runtime/utils.py all_gather_dp_groups).
            out["param_comm"] = _collective(share * n * b, 1, bw, lat)
        elif stage == 3:
            threshold = bk.stage3_param_persistence_threshold
            whole = bd.total // stages  # ZeRO-3 partitions and gathers every parameter, frozen or not
            gathered = whole - min(whole, bd.persistent(threshold) // stages)
            # One all-gather per parameter tensor above the persistence threshold (its module's), per pass.
            fetches = sum(1 for t in bd.tensors() if t > threshold) // stages
            out["param_comm"] = accum * passes * _collective(share * gathered * b, fetches, bw, lat)
    part = n // dp if stage >= 1 else n
    if plan.offload_optimizer:
        link = prof.host_link_bytes_per_s
        nvme = OffloadDevice(cfg.offload.device) == OffloadDevice.nvme
        # fp32 gradients to the host: ZeRO-3 copies its partition every micro-batch; ZeRO-1/2 once per step, but
        # with accumulation ZeRO-2 moves the accumulated partition over and back every micro-batch
        # (stage_1_and_2.py async_accumulate_grad_in_cpu_via_gpu).
        moves = accum if stage == 3 else (2 * accum if stage == 2 and accum > 1 else 1)
        out["offload"] = moves * part * 4 / link
        if plan.offload_params:  # the partition is fetched for every pass, from NVMe when it lives there
            out["offload"] += accum * passes * part * b / (prof.nvme_bytes_per_s if nvme else link)
        else:  # the updated 16/32-bit parameters back to the device
            out["offload"] += part * b / link
        if nvme:  # fp32 master, Adam moments and gradients swapped in and out each step
            out["offload"] += 2 * part * 16 / prof.nvme_bytes_per_s
    out["optimizer"] = part / prof.optimizer_params_per_s[plan.optimizer]
    return out
