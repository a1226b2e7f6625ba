"""Per-rank peak memory of a zerorun launch, before it launches: pure arithmetic, no torch.

The model follows /work/shared/research/memory.md (cited below as "§n"): model states from the
ZeRO paper partitioned per stage (§1.1) plus what DeepSpeed 0.19.8 really allocates (§1.3, read
again in the installed sources: paths are given next to each term); activations from Korthikanti
et al. Eq. 1 adjusted for what HF's default SDPA attention saves (§2.1–2.4, and the CPU
measurements of benchmarks/validate_memory_cpu.py); the logits/loss and tied-embedding transients
(§2.6, §2.7); and the peak taken over training *phases*, not as one sum (§0, §3):

    alloc_peak = max(init, loss, backward, embedding-grad, all-reduce, optimizer step)
    device     = CUDA context + NCCL + (1 + margin) · alloc_peak        (CUDA ranks)
    device     = process runtime + alloc_peak + offloaded host state    (CPU ranks: the "device" is host RAM)

What it models is what zerorun.train builds: an HF GPT2LMHeadModel (task causal_lm) or a
Bert/RobertaForSequenceClassification (task sequence_classification) with transformers' default
attention (sdpa), DeepSpeed's engine with AdamW (FusedAdam on CUDA, torch AdamW on CPU ranks,
DeepSpeedCPUAdam with offload), ZeRO buckets from ds_config.bucket_sizes(), random-init models built
whole on every rank (no zero.Init unless ZeRO-3 + pretrained).

With ``parallel=pipeline`` each stage is a rank of its own kind: its layers (DeepSpeed's partitioner,
reimplemented), its 1F1B depth of in-flight micro-batches and the pipeline engine's buffers; the
estimate is the worst stage (``pipeline_stages``, ``_stage_view``).

Entry points: count_params / param_breakdown, estimate, pipeline_stages, gate, autofit, resolve_hardware.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

from .config import (Dtype, Family, GateMode, HardwareConfig, ModelConfig, OffloadDevice, ParallelMode, RunConfig,
                     TaskName, World, data_parallel_size, global_batch, grad_accum_steps, resolved_task)
from .ds_config import bucket_sizes
from .hardware import GIB, Hardware

# ---------------------------------------------------------------------------------------------
# Constants. Each says where it comes from; the calibration ones are priors to refresh from GPU runs.

DTYPE_BYTES = {Dtype.fp32: 4, Dtype.fp16: 2, Dtype.bf16: 2}
"""Bytes per element of the module (parameters, gradients, activations) for each precision."""

MASTER_BYTES = 4
"""fp32 master copy per parameter (§1.1: the 4Ψ of K=12). DeepSpeed ZeRO-1/2/3 clone it even in
fp32 training (stage_1_and_2.py: ``weights_partition = ....clone().to(master dtype)``; stage3.py
``_create_fp32_partitions``: ``converted.clone()``), so it exists for every ZeRO stage ≥ 1."""

ADAM_STATE_BYTES = 8
"""Adam momentum + variance in fp32 per parameter (§1.1: the 8Ψ of K=12)."""

CUDA_MASK_BYTES = 1
"""Dropout mask element on CUDA: ``native_dropout`` returns bool (§2.1, §2.8). On CPU the mask is a
tensor of the compute dtype (§2.8, measured again by benchmarks/validate_memory_cpu.py)."""

LOSS_BYTES_PER_LOGIT = 12
"""Bytes per b·s·V logit element at the loss peak of HF's ForCausalLMLoss (§2.6): the fp32
log_softmax output saved for backward (4), the nll grad flowing into it (4) and log_softmax's grad
(4). §2.6 measured 14 with the model-output object alive and ~12 without; zerorun.train keeps only
``.loss``, so the 16-bit logits are gone by then. Forward holds less (16-bit logits 2 + fp32 upcast 4
+ log_softmax 4 = 10)."""

TIED_EMBEDDING_COPIES = 3
"""Tied input/output embedding: autograd sums the LM-head and embedding gradients, so old + new +
sum = 3·V·h elements live at the end of backward (§2.7, measured)."""

ZERO0_ALLREDUCE_ELEMENTS = 500_000_000
"""ZeRO-0 gradient all-reduce flattens grads into buckets of this many elements
(deepspeed/runtime/engine.py MEMORY_OPT_ALLREDUCE_SIZE; ``allreduce_bucket`` → ``self.flatten``)."""

DS_SUB_GROUP_SIZE = 1_000_000_000
"""ZeRO-3 ``sub_group_size`` default (deepspeed/runtime/zero/config.py); zerorun does not set it."""

NVME_PARAM_BUFFERS = (5, 100_000_000)
"""ZeRO-3 NVMe parameter swap: ``buffer_count`` × ``buffer_size`` elements of pinned host memory
(deepspeed/runtime/zero/offload_config.py defaults; partitioned_param_swapper.py allocates them)."""

NVME_OPTIMIZER_BUFFERS = 4
"""NVMe optimizer swap: ``buffer_count`` pinned fp32 buffers of the largest sub-group
(offload_config.py default 4; optimizer_utils.py SwapBufferManager)."""

FP64_NORM_BYTES = 8
"""With optimizer offload, ZeRO-1/2/3 take each gradient's norm as ``grad.to(float64).norm(2)`` in the
backward hook (deepspeed/runtime/zero/utils.py get_norm_dtype: fp64 wherever the device has it): a
transient 8 bytes per element of the largest gradient (measured on CPU)."""

LN_STAT_BYTES = 4
"""LayerNorm saves mean and rstd per token, fp32 on CUDA (2 per LN). Neglected by Eq. 1 (§2.1)."""


@dataclass(frozen=True)
class Calibration:
    """Terms outside the PyTorch allocator and other priors that a GPU "receipt" should refresh (§5, §7)."""

    cuda_context_bytes: int = GIB // 2
    """CUDA context + kernel images: 287 MB lazy / 667 MB eager loading, 781 MB, 1343 MB on older CUDA (§5)."""
    nccl_bytes: int = 1 * GIB
    """NCCL communicator buffers when more than one rank: ~0.2–2 GiB, more with more communicators (§3, §5)."""
    allocator_margin: float = 0.10
    """Caching-allocator fragmentation, reserved − allocated: 5–15% prior (§3, §5)."""
    cpu_process_bytes: int = GIB // 2
    """Host RSS of one rank's interpreter + torch + transformers + deepspeed before any tensor:
    0.41 GiB measured on this machine (torch 2.13 CPU); rounded up. Counted on CPU ranks (their
    device memory is host RAM) and in host RAM per node on CUDA ranks."""


DEFAULT_CALIBRATION = Calibration()
OVERHEADS = ("allocator margin", "CUDA context", "NCCL buffers", "process runtime")


# ---------------------------------------------------------------------------------------------
# Parameters


@dataclass(frozen=True)
class ParamBreakdown:
    """Parameter tensors of the model zerorun builds, by region (numel per tensor).

    ``total`` equals ``sum(p.numel() for p in model.parameters())`` of the transformers model
    (tied weights counted once, as DeepSpeed's ``data_ptr`` count does: §Notation).
    """

    family: Family
    embedding_tensors: Tuple[int, ...]
    layer_tensors: Tuple[int, ...]
    num_layers: int
    head_tensors: Tuple[int, ...]
    tied_embedding: int
    """Elements of the input embedding that the LM head reuses (0 when untied)."""
    buffer_bytes: int
    """Module buffers (GPT-2's per-layer causal mask, BERT's position/type ids)."""
    head_word: int = 0
    """Pipeline last stage: elements of its own copy of the tied LM head (tied across stages, not here)."""

    @property
    def word_embedding(self) -> int:
        """Elements of the V×h matrix on this rank whose dense gradient ends the backward pass (0: none)."""
        return self.tied_embedding or self.head_word or (self.embedding_tensors[0] if self.embedding_tensors else 0)

    @property
    def embeddings(self) -> int:
        return sum(self.embedding_tensors)

    @property
    def per_layer(self) -> int:
        return sum(self.layer_tensors)

    @property
    def head(self) -> int:
        return sum(self.head_tensors)

    @property
    def total(self) -> int:
        return self.embeddings + self.num_layers * self.per_layer + self.head

    @property
    def largest_tensor(self) -> int:
        return max(self.embedding_tensors + (self.layer_tensors if self.num_layers else ()) + self.head_tensors,
                   default=0)

    def persistent(self, threshold: int) -> int:
        """ZeRO-3 keeps parameters with numel ≤ threshold whole on every rank
        (parameter_offload.py ``mark_persistent_parameters``)."""
        small = lambda ts: sum(t for t in ts if t <= threshold)  # noqa: E731
        return small(self.embedding_tensors) + self.num_layers * small(self.layer_tensors) + small(self.head_tensors)

    def to_json(self) -> Dict[str, int]:
        return {"total": self.total, "embeddings": self.embeddings, "per_layer": self.per_layer,
                "num_layers": self.num_layers, "head": self.head, "tied_embedding": self.tied_embedding,
                "buffer_bytes": self.buffer_bytes}


def default_task(m: ModelConfig) -> TaskName:
    """The family's natural task, as config.resolved_task decides for task=auto."""
    return TaskName.causal_lm if Family(m.family) == Family.gpt2 else TaskName.sequence_classification


def _model_key(m: ModelConfig, task: Optional[TaskName] = None, num_labels: int = 2) -> Tuple:
    task = TaskName(task) if task not in (None, TaskName.auto) else default_task(m)
    return (Family(m.family), task, m.num_layers, m.hidden_size, m.num_heads, m.intermediate_size, m.vocab_size,
            m.max_positions, m.type_vocab_size, num_labels)


@functools.lru_cache(maxsize=256)
def _breakdown(key: Tuple) -> ParamBreakdown:
    family, task, L, h, _a, inner, V, P, T, labels = key
    inner = inner or 4 * h  # GPT2Config n_inner=None means 4h
    if family == Family.gpt2:
        # GPT2Model: wte, wpe; per block ln_1, c_attn (h×3h), c_proj, ln_2, c_fc (h×I), c_proj (I×h); ln_f.
        layer = (h, h, 3 * h * h, 3 * h, h * h, h, h, h, h * inner, inner, inner * h, h)
        # Buffers: per block a bool causal mask of max_positions² and a float scalar (modeling_gpt2.py).
        buffers = L * (P * P + 4)
        if task == TaskName.causal_lm:  # GPT2LMHeadModel: lm_head tied to wte (no new tensor)
            return ParamBreakdown(family, (V * h, P * h), layer, L, (h, h), tied_embedding=V * h, buffer_bytes=buffers)
        # GPT2ForSequenceClassification: score = Linear(h, num_labels, bias=False)
        return ParamBreakdown(family, (V * h, P * h), layer, L, (h, h, labels * h), tied_embedding=0,
                              buffer_bytes=buffers)
    if task != TaskName.sequence_classification:
        raise ValueError(f"{family.value} with task {task.value}: zerorun trains encoders for sequence classification "
                         "only (config.check refuses this combination).")
    # Bert/RobertaForSequenceClassification: word/position/token-type embeddings + LN; per layer q, k, v,
    # attention output dense + LN, intermediate dense, output dense + LN. BERT: pooler dense + classifier;
    # RoBERTa: no pooler, a classification head of dense (h×h) + out_proj.
    layer = (h * h, h, h * h, h, h * h, h, h * h, h, h, h, h * inner, inner, inner * h, h, h, h)
    head = (h * h, h, labels * h, labels)
    return ParamBreakdown(family, (V * h, P * h, T * h, h, h), layer, L, head, tied_embedding=0,
                          buffer_bytes=2 * P * 8)  # position_ids + token_type_ids buffers, int64


def param_breakdown(m: ModelConfig, task: Optional[TaskName] = None, num_labels: int = 2) -> ParamBreakdown:
    """Parameter tensors of ``m`` for ``task`` (None: the family's own) by region, exactly as transformers
    builds the model."""
    return _breakdown(_model_key(m, task, num_labels))


def count_params(m: ModelConfig, task: Optional[TaskName] = None, num_labels: int = 2) -> int:
    """Unique parameters (a tied LM head counted once) of the model zerorun builds for ``m`` and ``task``:
    GPT2LMHeadModel, Bert/RobertaForSequenceClassification (GPT2ForSequenceClassification too)."""
    return param_breakdown(m, task, num_labels).total


# ---------------------------------------------------------------------------------------------
# Activations


@dataclass(frozen=True)
class Activations:
    """Bytes of activations on one rank for one micro-batch (see ``activations``)."""

    kernel: str
    """Attention kernel assumed: sdpa-fused (flash / memory-efficient), sdpa-math (CPU fallback), eager."""
    per_layer: int
    """Saved for backward by one transformer layer, no recomputation."""
    recompute_layer: int
    """One layer's saved tensors while it is recomputed under checkpointing (no KV cache copies)."""
    checkpoint_per_layer: int
    """Kept per layer under full checkpointing: the layer input (§2.1 "2sbh" in 16-bit, §2.2)."""
    outside_layers: int
    """Embeddings and final LN / LM-head input / pooler, saved either way."""
    working_set: int
    """Activation gradients alive while one layer runs backward (not in Eq. 1; sized from the op graph)."""
    logits_loss: int
    """Logits + loss transient at the start of backward (§2.6)."""
    num_layers: int
    checkpointing: bool
    outside_first: int = 0
    """The part of ``outside_layers`` saved by the embeddings (a pipeline's first stage holds it)."""
    in_flight: int = 1
    """Micro-batches whose activations are alive at once (a pipeline stage's 1F1B depth; 1 without one)."""
    boundary: int = 0
    """Per in-flight micro-batch: the stage output a pipeline keeps for its backward (not on the last stage)."""
    pipe_buffers: int = 0
    """A pipeline stage's engine buffers that outlive the micro-batch (see ``_stage_view``)."""

    @property
    def saved(self) -> int:
        """Saved for backward at the end of forward (the activations term of the loss phase)."""
        per = self.checkpoint_per_layer if self.checkpointing else self.per_layer
        return self.in_flight * (self.outside_layers + self.num_layers * per + self.boundary)


def attention_kernel(accelerator: str, dropout: float) -> str:
    """What HF's default ``attn_implementation="sdpa"`` runs (transformers 4.57.6 picks sdpa for GPT-2 and BERT).

    CUDA: flash (16-bit) or memory-efficient (fp32) kernels; both support dropout and save q, k, v,
    out and an fp32 log-sum-exp, never the a·s² matrices (§2.3; flash_attn_interface saves
    ``q, k, v, out, softmax_lse, rng_state``). Not yet checked on a GPU (§7).
    CPU: the flash kernel has no dropout, so training with dropout > 0 falls back to the math path,
    which upcasts to fp32 and saves the s² tensors (§2.4 row "SDPA (dropout 0.1), CPU"; measured).
    """
    if accelerator == "cuda" or dropout == 0:
        return "sdpa-fused"
    return "sdpa-math"


def activations(m: ModelConfig, micro_batch: int, seq_len: int, dtype: Dtype, accelerator: str,
                checkpointing: bool, kernel: Optional[str] = None, task: Optional[TaskName] = None,
                num_labels: int = 2) -> Activations:
    """Activation bytes per rank for one micro-batch, by the template of Korthikanti Eq. 1 (§2.1).

    Eq. 1 counts, per layer, sbh·(34 + 5as/h) bytes = 16 "units" of s·b·h elements in 16-bit
    (LN inputs 2, QKV input 1, Q K V 3, projection input 1, fc1 input 1, GeLU input 4, fc2 input 4),
    2 one-byte dropout masks, and a·s²·b·(2 + 1 + 2) for softmax, its dropout mask and output.
    What HF's models actually save differs and is counted here op by op. benchmarks/validate_memory_cpu.py
    checks sdpa-math, and sdpa-fused in its CPU form (the CPU flash kernel, used when dropout = 0);
    the CUDA kernels and eager are not measured:

    - GPT-2's default ``gelu_new`` is a Python tanh formula that saves x, tanh(·), 0.5x, 1+tanh:
      4·I/h units instead of I/h (§2.4: +24·sbh at I = 4h in 16-bit).
    - GPT-2 builds a DynamicCache in training (use_cache defaults to true): K and V are ``torch.cat``
      copies, +2 units; with checkpointing HF turns the cache off.
    - sdpa-fused: q, k, v (+ fp32 log-sum-exp 4·a·s·b); the kernel output *is* the projection input
      (same storage), no s² terms, no attention-dropout mask (§2.3).
    - sdpa-math (CPU, dropout > 0): fp32 copies of q, k, v (12 bytes per sbh element) and fp32 softmax,
      dropout mask and dropout output: 12·a·s²·b (§2.4 measured 138·sbh at s=512, h=768: 42 + 12·8).
    - eager: Eq. 1's attention core (+ the KV-cache copies for GPT-2). Not zerorun's default.
    - dropout masks: 1 byte on CUDA, the compute dtype on CPU (§2.8); none when dropout = 0.
    - BERT and RoBERTa encoders are the same here (erf GeLU, no cache).
    """
    b, s, h, a, L = micro_batch, seq_len, m.hidden_size, m.num_heads, m.num_layers
    inner = m.intermediate_size or 4 * h
    e = DTYPE_BYTES[Dtype(dtype)]
    dropout = m.dropout > 0
    mask = (CUDA_MASK_BYTES if accelerator == "cuda" else e) if dropout else 0
    kernel = kernel or attention_kernel(accelerator, m.dropout)
    gpt2 = Family(m.family) == Family.gpt2
    lm = (TaskName(task) if task not in (None, TaskName.auto) else default_task(m)) == TaskName.causal_lm
    sbh, s2 = s * b * h, a * s * s * b
    r = inner / h  # MLP width in units of h

    gelu_units = 4 * r if gpt2 else r  # gelu_new saves 4 tensors of the MLP width; erf GeLU saves its input
    base_units = 4 + 1 + r + gelu_units  # LN1, LN2, QKV input, projection input; fc1 input; fc2 input; GeLU
    ln_stats = 2 * 2 * s * b * LN_STAT_BYTES

    def layer(cache: bool) -> int:
        kv_copies = 2 if (gpt2 and cache) else 0
        if kernel == "sdpa-fused":
            core = e * (3 + kv_copies) * sbh + 4 * a * s * b
        elif kernel == "sdpa-math":
            core = 12 * sbh + 12 * s2
        else:  # eager: softmax output, + its dropout mask and output when dropout is on
            core = e * (3 + kv_copies) * sbh + (e + ((e + mask) if dropout else 0)) * s2
        return int(e * base_units * sbh + core + 2 * mask * sbh + ln_stats)

    per_layer = layer(cache=not checkpointing)
    recompute = layer(cache=False)
    if gpt2:
        # embedding dropout mask; ln_f input + LM-head input (= ln_f output)
        first = mask * sbh
        outside = first + 2 * e * sbh + 2 * s * b * LN_STAT_BYTES
        if checkpointing:
            # Without the KV cache HF GPT-2 materializes a (b, 1, s, s) bool causal mask, which every
            # checkpoint keeps as an input (measured on CPU). On CUDA the explicit mask rules out flash:
            # the memory-efficient kernel saves it as an additive bias in the compute dtype (code-read,
            # not checked on a GPU), one layer at a time during recomputation.
            outside += b * s * s
            if kernel == "sdpa-fused" and accelerator == "cuda":
                recompute += b * s * s * e
        logits = LOSS_BYTES_PER_LOGIT * b * s * (m.vocab_size if lm else num_labels)
    else:
        # embedding LN input + its dropout mask; the pooler / classification head reads a view of the
        # last hidden states, which keeps the whole tensor
        first = e * sbh + mask * sbh + 2 * s * b * LN_STAT_BYTES
        outside = first + e * sbh
        if kernel == "sdpa-fused" and accelerator == "cuda":
            # A padding mask becomes one (b, 1, s, s) additive bias in the compute dtype, which CUDA's
            # memory-efficient kernel saves (CPU kernels do not: measured). Code-read, not checked on a
            # GPU; absent when a batch has no padding.
            outside += b * s * s * e
        logits = LOSS_BYTES_PER_LOGIT * b * num_labels
    # Backward of one layer: the residual-stream grad plus the MLP grads beyond what is saved: one I-wide
    # grad for erf GeLU (each node frees its saved input as it makes its grad), two through gelu_new's
    # chain of elementwise ops. In attention one s² grad beyond the saved ones. Sized from CPU
    # measurements (benchmarks/validate_memory_cpu.py "layer" column): two extra s² grads and two
    # I-wide grads for BERT overestimated by 5-25%.
    working = e * sbh + (2 if gpt2 else 1) * e * r * sbh
    if kernel == "sdpa-math":
        working = max(working, e * sbh + 4 * s2)
    elif kernel == "eager":
        working = max(working, e * sbh + e * s2)
    return Activations(kernel, per_layer, recompute, e * sbh, int(outside), int(working), int(logits), L,
                       checkpointing, outside_first=int(first))


# ---------------------------------------------------------------------------------------------
# Pipeline stages


@dataclass(frozen=True)
class PipelineStage:
    """What one pipeline stage holds: the layers DeepSpeed's PipelineModule gives it (zerorun.pipeline's
    layer list, partitioned as ``PipelineModule._partition_layers`` does) and its 1F1B depth."""

    index: int
    layers: Tuple[str, ...]
    """Names of the pipeline layers on this stage, in order (``block`` for each transformer layer)."""
    params: int
    """Parameters this stage builds (the tied embedding counts on the first and the last stage)."""
    in_flight: int
    """Micro-batches whose activations it holds at once: min(stages - index, micro-batches per step)
    (deepspeed/runtime/pipe/schedule.py TrainSchedule.num_pipe_buffers, without its floor of 2 buffers,
    which are empty references, not activations)."""

    @property
    def blocks(self) -> int:
        return self.layers.count("block")

    @property
    def holds_both_tied_ends(self) -> bool:
        """GPT-2's tied embedding and LM head on this one stage: one tensor, built once."""
        return {"wte", "lm_head (tied wte)"} <= set(self.layers)

    @property
    def buffers(self) -> int:
        """Pipe buffer slots (TrainSchedule.num_pipe_buffers): at least 2, even when 1 micro-batch is in flight."""
        return max(2, self.in_flight)

    def to_json(self) -> Dict[str, Any]:
        return {"stage": self.index, "layers": list(self.layers), "blocks": self.blocks, "params": self.params,
                "in_flight_micro_batches": self.in_flight}


def pipeline_layer_params(bd: ParamBreakdown) -> List[Tuple[str, int]]:
    """zerorun.pipeline.pipeline_layers as (name, trainable parameters) — what DeepSpeed's
    ``_count_layer_params`` weighs, the tied embedding counted at both of its uses."""
    if bd.family == Family.gpt2:
        wte, wpe = bd.embedding_tensors
        head = [("ln_f", bd.head), ("lm_head (tied wte)", bd.tied_embedding)] if bd.tied_embedding else \
            [("ln_f + head", bd.head)]
        return [("wte", wte), ("wpe + dropout", wpe), *[("block", bd.per_layer)] * bd.num_layers, *head]
    return [("embeddings", bd.embeddings), *[("block", bd.per_layer)] * bd.num_layers, ("classifier head", bd.head)]


def partition_uniform(num_items: int, num_parts: int) -> List[int]:
    """deepspeed.runtime.utils.partition_uniform: stage boundaries, the remainder to the first stages."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: List[int], num_parts: int) -> List[int]:
    """deepspeed.runtime.utils.partition_balanced (DeepSpeed 0.19.8), the same dynamic program and tie-breaks:
    contiguous parts minimising max(part) - min(part)."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = math.inf
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    pos = [[0] * (m + 1) for _ in range(n + 1)]
    dp_max[0][0] = cost[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                hi = max(dp_max[k][j - 1], prefix[i] - prefix[k])
                lo = min(dp_min[k][j - 1], prefix[i] - prefix[k])
                if cost[i][j] >= hi - lo:
                    cost[i][j], dp_max[i][j], dp_min[i][j], pos[i][j] = hi - lo, hi, lo, k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(pos[parts[-1]][j])
    return parts[::-1]


def pipeline_stages(cfg: RunConfig, world: World) -> List[PipelineStage]:
    """The stages of ``parallel=pipeline``: layers, parameters and 1F1B depth of each."""
    bd = param_breakdown(cfg.model, resolved_task(cfg), cfg.task.num_labels)
    layers = pipeline_layer_params(bd)
    S = max(1, cfg.parallel.stages)
    if cfg.parallel.partition == "uniform":
        bounds = partition_uniform(len(layers), S)
    else:
        bounds = partition_balanced([w for _, w in layers], S)
    micro = grad_accum_steps(cfg, world)
    stages = []
    for i in range(S):
        own = layers[bounds[i]:bounds[i + 1]]
        names = tuple(n for n, _ in own)
        stage = PipelineStage(i, names, sum(w for _, w in own), max(1, min(S - i, micro)))
        if stage.holds_both_tied_ends:
            stage = dataclasses.replace(stage, params=stage.params - bd.tied_embedding)
        stages.append(stage)
    return stages


def _stage_view(cfg: RunConfig, bd: ParamBreakdown, act: Activations, st: PipelineStage,
                last: bool) -> Tuple[ParamBreakdown, Activations]:
    """The breakdown and activations of one pipeline stage, in the shape ``_rank_estimate`` takes.

    Buffers of DeepSpeed's PipelineEngine (runtime/pipe/engine.py, measured on CPU): each of the stage's
    buffer slots keeps its last micro-batch's inputs (a clone of the received activations and the
    int64 mask) until the slot is reused, next to one persistent receive buffer; a non-last stage
    receives its output gradient into one more; and the last stage never frees its outputs
    (``_exec_backward_pass`` returns before ``pipe_buffers['outputs'][id] = None``), so the logits of
    every slot stay alive in the module dtype — twice the logits at 1 micro-batch in flight.
    """
    names = set(st.layers)
    first = "wte" in names or "embeddings" in names
    emb = tuple(t for t, n in zip(bd.embedding_tensors, ("wte", "wpe + dropout")) if n in names) \
        if bd.family == Family.gpt2 else (bd.embedding_tensors if first else ())
    both = st.holds_both_tied_ends
    head_copy = bd.tied_embedding if ("lm_head (tied wte)" in names and not both) else 0
    head = (bd.head_tensors if ({"ln_f", "ln_f + head", "classifier head"} & names) else ()) + \
        ((head_copy,) if head_copy else ())
    gpt2 = bd.family == Family.gpt2
    view = ParamBreakdown(bd.family, emb, bd.layer_tensors, st.blocks, head,
                          tied_embedding=bd.tied_embedding if both else 0,
                          buffer_bytes=(bd.buffer_bytes // max(1, bd.num_layers)) * st.blocks if gpt2
                          else (bd.buffer_bytes if first else 0),
                          head_word=head_copy)
    outside = (act.outside_first if first else 0) + ((act.outside_layers - act.outside_first) if last else 0)
    b, s_len = cfg.trainer.micro_batch_size, cfg.data.seq_len
    hidden, ids = act.checkpoint_per_layer, b * s_len * 8  # one micro-batch's activations; its int64 ids/mask
    if first:
        buffers = st.buffers * 2 * ids  # input ids and mask per slot
    else:  # slots not in flight still hold their last inputs; + the receive buffer
        buffers = (st.buffers - st.in_flight) * hidden + st.buffers * ids + (hidden + ids)
    if last:
        buffers += st.buffers * (act.logits_loss // LOSS_BYTES_PER_LOGIT) * DTYPE_BYTES[Dtype(cfg.precision.dtype)]
        buffers += st.buffers * ids  # labels
    else:
        buffers += hidden  # grad_layer: the output gradient received from the next stage
    # The pipeline's GPT-2 blocks run without the KV cache (zerorun.pipeline.GPT2BlockPipe: use_cache=False).
    stage_act = dataclasses.replace(act, per_layer=act.recompute_layer, outside_layers=outside,
                                    outside_first=act.outside_first if first else 0, num_layers=st.blocks,
                                    logits_loss=act.logits_loss if last else 0, in_flight=st.in_flight,
                                    boundary=0 if last else act.checkpoint_per_layer, pipe_buffers=int(buffers))
    return view, stage_act


# ---------------------------------------------------------------------------------------------
# ZeRO-3 gathered parameters


@functools.lru_cache(maxsize=256)
def _zero3_live_peak(key: Tuple, threshold: int, reuse_distance: int) -> int:
    """Peak elements of gathered (non-persistent) parameters during forward + backward under ZeRO-3.

    Replays DeepSpeed's release rule (partitioned_param_coordinator.py ``__params_to_release``): after a
    module runs, its parameters stay gathered if they are used again within ``stage3_max_reuse_distance``
    elements of the modules that follow in the trace. With the default 1e9 a model under ~0.5B
    parameters stays fully gathered after the first step (the "ZeRO-3 uses more than ZeRO-2" reports of
    §5). Granularity here is one transformer layer; DeepSpeed traces leaf modules.
    """
    bd = _breakdown(key)
    big = lambda ts, tag: tuple((tag, i, n) for i, n in enumerate(ts) if n > threshold)  # noqa: E731
    emb = big(bd.embedding_tensors, "emb")
    layers = [tuple((f"L{l}", i, n) for (_, i, n) in big(bd.layer_tensors, "L")) for l in range(bd.num_layers)]
    head = big(bd.head_tensors, "head")
    forward: List[Tuple] = [emb, *layers, head]
    if bd.tied_embedding:
        forward.append(tuple(t for t in emb if t[2] == bd.tied_embedding)[:1])  # LM head reuses wte
    trace = forward + forward[::-1]
    sizes = [sum(n for (_, _, n) in blk) for blk in trace]
    kept: Dict[Tuple[str, int], int] = {}
    peak = 0
    for t, blk in enumerate(trace):
        live = dict(kept)
        live.update({(tag, i): n for (tag, i, n) in blk})
        peak = max(peak, sum(live.values()))
        # Release this module's params unless reused within the distance (counted from the next module).
        reused = set()
        traversed = 0
        for u in range(t + 1, len(trace)):
            if traversed >= reuse_distance:
                break
            reused.update((tag, i) for (tag, i, _) in trace[u])
            traversed += sizes[u]
        kept = {k: n for k, n in live.items() if k not in {(tag, i) for (tag, i, _) in blk} or k in reused}
    return peak


# ---------------------------------------------------------------------------------------------
# The estimate


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
    """Parameters + gradients + fp32 master + optimizer states held on the device per rank (ZeRO §1.1)."""
    params: int = 0
    summary: Dict[str, Any] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    stages: List[Dict[str, Any]] = field(default_factory=list)
    """parallel=pipeline: each stage's layers, 1F1B depth, peak and breakdown (the estimate is the worst one)."""

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
            "source": "zerorun.memory (memory.md §0-§3); not yet calibrated on a GPU",
        }


def params_offloaded(cfg: RunConfig) -> bool:
    """Parameter offload is on: ZeRO-3 with an offload device and offload.params not false (None = yes)."""
    return cfg.zero.stage == 3 and cfg.offload.device != OffloadDevice.none and cfg.offload.params is not False


def _phase(items: Iterable[Tuple[str, float]]) -> "OrderedDict[str, int]":
    out: "OrderedDict[str, int]" = OrderedDict()
    for k, v in items:
        v = int(v)
        if v > 0:
            out[k] = out.get(k, 0) + v
    return out


def estimate(cfg: RunConfig, world: World, hw: Hardware, *, cal: Calibration = DEFAULT_CALIBRATION) -> Estimate:
    """Per-rank peak memory of ``cfg`` on ``world`` ranks of ``hw``: phases, components, fits.

    Pure: only arithmetic on the config. See the module docstring for the sources; each term below
    names the DeepSpeed code that allocates it. With ``parallel=pipeline`` each stage is estimated
    with its own layers and 1F1B depth; the result is the stage with the highest peak, and
    ``stages`` lists them all.
    """
    task, labels = resolved_task(cfg), cfg.task.num_labels
    bd = param_breakdown(cfg.model, task, labels)
    act = activations(cfg.model, cfg.trainer.micro_batch_size, cfg.data.seq_len, Dtype(cfg.precision.dtype),
                      world.accelerator, cfg.trainer.activation_checkpointing, task=task, num_labels=labels)
    if cfg.parallel.mode != ParallelMode.pipeline:
        return _rank_estimate(cfg, world, hw, cal, bd, act, bd.total)
    stages = pipeline_stages(cfg, world)
    per_stage = [_rank_estimate(cfg, world, hw, cal, *_stage_view(cfg, bd, act, st, st.index == len(stages) - 1),
                                bd.total)
                 for st in stages]
    worst = max(range(len(stages)), key=lambda i: per_stage[i].per_rank_peak_bytes)
    est = per_stage[worst]
    # Ranks are laid out stage-major (PipeDataParallelTopology): on one node every stage's ranks share the
    # host; across nodes, count the heaviest stage on every rank of a node (an upper bound).
    dp = data_parallel_size(cfg, world)
    if world.nnodes == 1:
        host_node = sum(e.host_bytes_per_node // max(1, world.nproc_per_node) * dp for e in per_stage)
    else:
        host_node = max(e.host_bytes_per_node for e in per_stage)
    fits_host = est.host_capacity_bytes <= 0 or host_node <= est.host_capacity_bytes
    fits_device = all(e.fits_device for e in per_stage)
    summary = dict(est.summary, params=bd.total, pipeline_stages=len(stages), peak_stage=worst)
    notes = est.notes + [f"pipeline: stage {worst} of {len(stages)} has the highest peak ({_gib(est.per_rank_peak_bytes)}"
                         f"; it holds {stages[worst].in_flight} micro-batch(es) in flight and "
                         f"{stages[worst].blocks} of {bd.num_layers} layers)."]
    return dataclasses.replace(
        est, host_bytes_per_node=int(host_node), fits_host=fits_host, fits_device=fits_device,
        fits=fits_host and fits_device, params=bd.total, summary=summary, notes=notes,
        stages=[dict(st.to_json(), per_rank_peak_bytes=e.per_rank_peak_bytes, peak_phase=e.peak_phase,
                     model_state_bytes=e.model_state_bytes, components=dict(e.components), fits=e.fits_device,
                     phases={k: dict(v) for k, v in e.phases.items()})
                for st, e in zip(stages, per_stage)])


def _rank_estimate(cfg: RunConfig, world: World, hw: Hardware, cal: Calibration, bd: ParamBreakdown,
                   act: Activations, built_params: int) -> Estimate:
    """One rank's estimate for the parameters in ``bd`` and the activations in ``act`` (the whole model,
    or one pipeline stage); ``built_params``: what build_model() makes on every rank first (the whole model)."""
    m, z, tr = cfg.model, cfg.zero, cfg.trainer
    dtype = Dtype(cfg.precision.dtype)
    accel = world.accelerator
    cpu_ranks = accel == "cpu"
    task = resolved_task(cfg)
    P = bd.total
    N = max(1, data_parallel_size(cfg, world))
    p = g = DTYPE_BYTES[dtype]  # 16-bit or fp32 module: params, grads and activations in that dtype
    mixed = dtype != Dtype.fp32
    stage = z.stage
    off = OffloadDevice(cfg.offload.device)
    off_opt = stage >= 1 and off != OffloadDevice.none
    off_param = params_offloaded(cfg)
    buckets = bucket_sizes(cfg)
    accum = grad_accum_steps(cfg, world)
    largest = bd.largest_tensor
    part = math.ceil(P / N)  # this rank's partition (DeepSpeed pads to equal partitions)
    notes: List[str] = []

    # ---- model states that live on the device through every phase (§1.1, §1.3)
    dev: List[Tuple[str, float]] = []
    host: List[Tuple[str, float]] = []  # per rank
    nvme = 0
    if stage < 3:
        dev.append(("parameters", P * p))
    else:
        persistent = bd.persistent(buckets["stage3_param_persistence_threshold"])
        # stage3.py: partitioned 16-bit flat buffer (on host with offload_param) + persistent params whole
        if off_param:
            host.append(("parameters (host)", part * p))
        else:
            dev.append(("parameters", part * p))
        dev.append(("persistent parameters", persistent * p))
    dev.append(("buffers", bd.buffer_bytes))

    if stage == 0 and dtype == Dtype.bf16 and cfg.parallel.mode == ParallelMode.pipeline:
        # A bf16 pipeline at ZeRO-0 gets BF16_Optimizer (engine.py _do_optimizer_sanity_check): the 16-bit
        # param.grad stay next to a flat accumulation buffer in grad_accum_dtype (bf16 by default), and the
        # fp32 master and Adam states are partitioned over the stage's data-parallel group (measured).
        dev.append(("gradients", 2 * P * g))
        dev += [("fp32 master copies", part * MASTER_BYTES), ("optimizer states", part * ADAM_STATE_BYTES)]
    elif stage == 0:
        dev.append(("gradients", P * g))
        if mixed:  # FP16_Optimizer / FP16_UnfusedOptimizer: fp32 master of every parameter
            dev.append(("fp32 master copies", P * MASTER_BYTES))
        dev.append(("optimizer states", P * ADAM_STATE_BYTES))
    elif stage in (1, 2):
        if stage == 1:
            # stage_1_and_2.py: param.grad full until the boundary reduce, + grads_in_partition
            dev.append(("gradients", P * g + (0 if off_opt else part * g)))
        elif not off_opt:
            dev.append(("gradients", part * g))  # grads_in_partition (``copy_grads_in_partition``)
        states = [("fp32 master copies", part * MASTER_BYTES), ("optimizer states", part * ADAM_STATE_BYTES)]
        if off_opt:
            # Offload: pinned fp32 master + fp32 grad partition + 16-bit staging; CPU Adam states.
            host += [(k + " (host)", v) for k, v in states]
            host.append(("fp32 gradients (host)", part * 4))
            host.append(("16-bit param staging (host)", part * p))
            host.append(("grad staging buffer (host)", largest * g))
            if accum > 1:
                host.append(("accumulated gradients (host)", part * g))
            dev.append(("offload staging buffer", largest * g))  # temp_grad_buffer_for_gpu_offload
        else:
            dev += states
    else:  # stage 3
        grad_buf = [("gradients", part * g)]  # grad_partitions_flat_buffer (on self.device)
        states = [("fp32 master copies", part * MASTER_BYTES), ("optimizer states", part * ADAM_STATE_BYTES)]
        if off_opt:
            # With offload the fp32 grad of each sub-group is a persistent pinned buffer
            # (stage3.py initialize_optimizer_states: subgroup_gradient_buffer); without, a step transient.
            fp32_grad = [("fp32 gradient buffer", part * 4)]
            host += [(k + " (host)", v) for k, v in grad_buf + fp32_grad + states]
            if off == OffloadDevice.nvme:
                # ZeRO-Infinity: fp32 param + m + v (+ grads) swap out; pinned swap buffers stay on host.
                nvme += part * (MASTER_BYTES + ADAM_STATE_BYTES + 4)
                host = [(k, v) for k, v in host if k not in ("fp32 master copies (host)", "optimizer states (host)")]
                host.append(("NVMe optimizer swap buffers (host)",
                             NVME_OPTIMIZER_BUFFERS * min(part, DS_SUB_GROUP_SIZE) * 4))
        else:
            dev += grad_buf + states
        if off_param and off == OffloadDevice.nvme:
            nvme += part * p
            host = [(k, v) for k, v in host if k != "parameters (host)"]
            count, size = NVME_PARAM_BUFFERS
            host.append(("NVMe param swap buffers (host)", count * size * p))
    persistent_dev = _phase(dev)

    model_state = sum(v for k, v in persistent_dev.items()
                      if k in ("parameters", "persistent parameters", "gradients", "fp32 master copies",
                               "optimizer states"))
    step_states = persistent_dev
    if stage == 1:
        # ZeRO-1 frees the full param.grad once they are copied into this rank's partition, or, with
        # offload, into the host fp32 buffer (measured).
        step_states = OrderedDict(persistent_dev)
        step_states.pop("gradients", None)
        if not off_opt:
            step_states["gradients"] = part * g
    # Gradients alive before this micro-step's backward: none on the first micro-step of an optimizer step
    # (DeepSpeed sets them to None at the step), so none at all without accumulation. ZeRO-3's flat
    # gradient partition is allocated once and stays; offloaded host buffers stay. ZeRO-2's partition is
    # allocated at the first bucket reduce, so it exists again by the time the last layer runs backward.
    if accum > 1 or stage == 3:
        fwd_states = bwd_states = persistent_dev
    else:
        fwd_states = _phase((k, v) for k, v in persistent_dev.items() if k != "gradients")
        bwd_states = _phase([*fwd_states.items(), ("gradients", part * g if stage == 2 and not off_opt else 0)])

    # ---- buffers of the backward pass (§1.3)
    bwd_buffers: List[Tuple[str, float]] = []
    # allgather_bucket_size allocates nothing in 0.19.8: all_gather_into_tensor writes into the flat
    # 16-bit buffer in place (runtime/utils.py all_gather_dp_groups).
    if stage in (1, 2) and z.contiguous_gradients:
        # setup_buckets(): one IPG bucket in the module dtype, a second one with overlap_comm
        bwd_buffers.append(("reduce buckets", buckets["reduce_bucket_size"] * g * (2 if z.overlap_comm else 1)))
    if stage == 3:
        if z.contiguous_gradients:
            bwd_buffers.append(("reduce buckets", buckets["reduce_bucket_size"] * g))  # stage3.py IPG buffer
        live = _zero3_live_peak(_model_key(m, task, cfg.task.num_labels), buckets["stage3_param_persistence_threshold"],
                                z.stage3_max_reuse_distance)
        if N == 1 and (not off_param or cpu_ranks):
            # One rank: DeepSpeed does not gather (partition_parameters.py _no_gather_coalesced: param.data =
            # ds_tensor.to(device), a copy only when the partition sits on the host and the rank on a GPU).
            live = 0
        bwd_buffers.append(("ZeRO-3 gathered params", live * p))
        if live:
            bwd_buffers.append(("ZeRO-3 prefetch bucket",
                                min(buckets["stage3_prefetch_bucket_size"], z.stage3_max_live_parameters) * p))
        if live > 0.5 * P:
            notes.append(f"ZeRO-3 keeps {live / P:.0%} of the parameters gathered between forward and backward "
                         f"(stage3_max_reuse_distance={z.stage3_max_reuse_distance:.0e}); a smaller reuse distance "
                         "trades this memory for more all-gathers.")
    # ZeRO-2/3: a layer parameter's grad exists until its hook copies it into the bucket. (The tied
    # embedding's grad is the separate "tied-embedding grad": autograd holds it until both uses are summed.)
    in_flight = [("gradient in flight", max(bd.layer_tensors + bd.head_tensors) * g)] if stage >= 2 else []
    # Tied LM head: after its backward, autograd holds the V×h grad until the embedding's grad arrives.
    tied_pending = [("tied-embedding grad (pending)", bd.tied_embedding * g)] if bd.tied_embedding else []

    # ---- phases (§0, §3): each a full list of what is alive at that moment
    acts = act.saved
    phases: "OrderedDict[str, OrderedDict[str, int]]" = OrderedDict()
    if stage == 3 and not m.pretrained:
        # zerorun.train builds random-init models whole (no zero.Init): the engine casts the module and
        # moves it to the device before ZeRO-3 partitions it (engine.py ``_configure_distributed_model``).
        phases["init"] = _phase([("whole model before partitioning", P * p), ("buffers", bd.buffer_bytes)])
    # Start of backward (log_softmax backward): every saved activation + the LM loss transient. The LM
    # head's weight grad comes only after this, when the logits grads are already freed (measured).
    phases["loss"] = _phase([*fwd_states.items(), ("activations", acts), ("logits + loss", act.logits_loss),
                             *bwd_buffers])
    # Backward through the last layer (recomputed under checkpointing): its grads' working set.
    layer_extra = [("activations", acts + (act.recompute_layer if act.checkpointing else 0)),
                   ("activation-grad working set", act.working_set)]
    phases["backward"] = _phase([*bwd_states.items(), *layer_extra, *tied_pending, *in_flight, *bwd_buffers])
    # End of backward, layer activations freed: the word embedding's dense grad. Tied (GPT-2): LM-head
    # grad + embedding grad + their sum (§2.7). Untied (BERT): the new grad before it is accumulated
    # (measured: +V·h on top of the existing grads with gradient accumulation).
    # ZeRO-0/1 without accumulation: the untied grad *is* param.grad (in "gradients"); ZeRO-2/3 hold it
    # apart until it is copied into the partition. With optimizer offload DeepSpeed clones a gradient
    # larger than the reduce bucket and takes its norm in fp64 (stage_1_and_2.py
    # set_norm_for_param_grad_in_gpu, stage3.py: ``.to(get_norm_dtype()).norm(2)``): +8 bytes per element
    # next to the (cloned) grad, measured on CPU for ZeRO-1/2/3.
    word = bd.word_embedding
    if bd.tied_embedding:
        emb_transient = TIED_EMBEDDING_COPIES * word * g
    else:
        # ZeRO-3 reduces a gradient larger than the bucket through reduce_scatter_coalesced, which
        # flattens it into a second buffer (measured on CPU: 2·V·h·g).
        copies = 2 if stage == 3 and not off_opt else 1
        emb_transient = copies * word * g if (stage >= 2 or accum > 1) else 0
    if off_opt:
        own = 0 if (stage == 1 and not bd.tied_embedding) else word * g  # ZeRO-1: the grad is in "gradients"
        emb_transient = max(emb_transient, own + word * FP64_NORM_BYTES)
    if word:
        # A pipeline's first stage still holds its other in-flight micro-batches here.
        others = act.saved - act.saved // act.in_flight
        phases["embedding grad"] = _phase([*persistent_dev.items(), ("activations", act.outside_layers + others),
                                           ("embedding grad transient", emb_transient), *bwd_buffers])
    if stage == 0:
        # engine.allreduce_bucket flattens grads in buckets of 5e8 elements before the all-reduce, on one
        # rank too (engine.py allreduce_gradients has no world-size check; measured on CPU).
        flat = min(P, ZERO0_ALLREDUCE_ELEMENTS + largest)
        phases["all-reduce"] = _phase([*persistent_dev.items(), ("all-reduce flatten buffer", flat * g)])
    phases["optimizer step"] = _phase([*step_states.items(),
                                       ("optimizer-step transient", _step_transient(cfg, world, bd, part))])
    if act.pipe_buffers:  # allocated by the first micro-batch, never freed
        for name in phases:
            if name != "init":
                phases[name] = _phase([*phases[name].items(), ("pipeline buffers", act.pipe_buffers)])

    # ---- host RAM per rank: the process, the model each rank builds in fp32 before DeepSpeed takes it
    host_steady = _phase(host)
    host_init = built_params * 4 + bd.buffer_bytes  # build_model() makes fp32 weights on the host on every rank
    if cpu_ranks:
        # The device is host RAM: offloaded state shares it, and the fp32 build is an init phase.
        for name in phases:
            phases[name] = _phase([*phases[name].items(), *host_steady.items()])
        # build_model() makes fp32 weights; DeepSpeed casts them in place, one tensor at a time.
        phases["init"] = _phase([("fp32 model as built", built_params * 4), ("buffers", bd.buffer_bytes)])
        phases.move_to_end("init", last=False)

    peak_phase = max(phases, key=lambda k: sum(phases[k].values()))
    alloc_peak = sum(phases[peak_phase].values())
    comps = OrderedDict(sorted(phases[peak_phase].items(), key=lambda kv: -kv[1]))
    if cpu_ranks:
        comps["process runtime"] = cal.cpu_process_bytes
        per_rank = alloc_peak + cal.cpu_process_bytes
        capacity = hw.host_mem_bytes // max(1, world.nproc_per_node)
        host_components = _phase([*host_steady.items(), ("process runtime", cal.cpu_process_bytes)])
        host_node = per_rank * world.nproc_per_node
        device = "cpu (host RAM)"
    else:
        margin = int(cal.allocator_margin * alloc_peak)
        comps["allocator margin"] = margin
        comps["CUDA context"] = cal.cuda_context_bytes
        if world.size > 1:
            comps["NCCL buffers"] = cal.nccl_bytes
        per_rank = sum(comps.values())
        capacity = hw.gpu_mem_bytes
        host_components = _phase([*host_steady.items(), ("process runtime", cal.cpu_process_bytes)])
        host_rank = max(sum(host_steady.values()), host_init) + cal.cpu_process_bytes
        host_node = host_rank * world.nproc_per_node
        device = "cuda"
    host_cap = hw.host_mem_bytes
    fits_device = capacity > 0 and per_rank <= capacity
    fits_host = host_cap <= 0 or host_node <= host_cap
    if cfg.data.seq_len > m.max_positions:
        notes.append(f"data.seq_len={cfg.data.seq_len} exceeds model.max_positions={m.max_positions}.")

    summary = {
        "model": m.name, "family": Family(m.family).value, "task": task.value, "params": P, "zero_stage": stage,
        "offload": off.value, "offload_params": off_param, "precision": dtype.value,
        "micro_batch_size": tr.micro_batch_size, "seq_len": cfg.data.seq_len,
        "activation_checkpointing": tr.activation_checkpointing, "grad_accum_steps": accum,
        "global_batch_size": global_batch(cfg, world), "data_parallel_size": N,
        "ranks_per_node": world.nproc_per_node, "nodes": world.nnodes, "accelerator": accel,
        "attention_kernel": act.kernel, "buckets": dict(buckets), "overlap_comm": z.overlap_comm,
    }
    return Estimate(components=comps, per_rank_peak_bytes=int(per_rank), device_capacity_bytes=int(capacity),
                    host_bytes_per_node=int(host_node), nvme_bytes=int(nvme * world.nproc_per_node),
                    fits=fits_device and fits_host, device=device, peak_phase=peak_phase, phases=dict(phases),
                    host_components=host_components, host_capacity_bytes=int(host_cap), fits_device=fits_device,
                    fits_host=fits_host, model_state_bytes=int(model_state), params=P, summary=summary,
                    notes=notes)


def _step_transient(cfg: RunConfig, world: World, bd: ParamBreakdown, part: int) -> int:
    """Device bytes the optimizer step adds on top of the persistent states (§1.3, §5 "optimizer-step transients").

    - ZeRO-0, 16-bit, FusedAdam (CUDA): FP16_Optimizer.step flattens ``p.grad.to(fp32)`` → 4Ψ list + 4Ψ
      flat (fused_optimizer.py). On CPU ranks (torch AdamW → FP16_UnfusedOptimizer) each fp32 param
      gets an fp32 grad, 4Ψ, then torch's for-loop AdamW temporaries.
    - ZeRO-1/2: flat 16-bit partition copy + its fp32 copy (stage_1_and_2.py step: ``flat_grad_partition
      .to(fp32)``; the fp32 copy of fp32 grads is a no-op), 6Ψ/N in 16-bit.
    - ZeRO-3 the same per sub-group (stage3.py ``_prepare_fp32_grad_for_sub_group``: ``flatten(...).to(fp32)``).
      With optimizer offload the step runs on the host into persistent pinned buffers.
    - torch AdamW (CPU ranks, no offload) is the for-loop implementation (foreach is CUDA-only): about two
      fp32 temporaries of the largest tensor it updates (``exp_avg_sq.sqrt() / bc2`` then ``.add_``).
      Under ZeRO-1/2/3 that tensor is this rank's flat partition. FusedAdam/DeepSpeedCPUAdam: none.
    - fp16: the overflow check upcasts one grad at a time, 4 bytes × the largest (§5 "loss scaler").
    """
    dtype = Dtype(cfg.precision.dtype)
    g = DTYPE_BYTES[dtype]
    P, stage = bd.total, cfg.zero.stage
    off_opt = stage >= 1 and cfg.offload.device != OffloadDevice.none
    torch_adam = world.accelerator == "cpu" and not off_opt
    overflow = 4 * min(bd.largest_tensor, part if stage >= 2 else bd.largest_tensor) if dtype == Dtype.fp16 else 0
    if stage == 0:
        if dtype == Dtype.fp32:
            return 2 * 4 * bd.largest_tensor if torch_adam else 0
        if torch_adam:
            return 4 * P + 2 * 4 * bd.largest_tensor
        return max(8 * P, overflow)
    if off_opt:
        return overflow
    sub = part if stage < 3 else min(part, DS_SUB_GROUP_SIZE)
    adam = 2 * 4 * sub if torch_adam else 0
    convert = sub * g + (sub * 4 if g != 4 else 0)
    # ZeRO-1/2 free the 16-bit grad partition once its fp32 copy exists (in fp32 the partition is the fp32
    # grad itself); ZeRO-3's flat gradient buffer stays (measured on CPU).
    fp32_grad = sub * 4 - (sub * g if stage < 3 else 0)
    return max(convert, fp32_grad + adam) + overflow


# ---------------------------------------------------------------------------------------------
# Hardware to plan for


def resolve_hardware(declared: HardwareConfig, detected: Optional[Hardware], *, host_mem_bytes: int = 0,
                     cpu_cores: int = 1) -> Hardware:
    """The machine to plan for: the declared ``hardware.*`` values over what ``detect()`` found.

    ``detected`` may be None when the GPU side is declared (see ``needs_detection``); host RAM and
    cores then come from the keyword arguments (hardware.host_memory_bytes() is cheap: no torch).
    Declaring GPU memory on a machine without GPUs plans for one GPU per node.
    """
    d = detected
    gpus = declared.gpus_per_node if declared.gpus_per_node is not None else (d.gpus_per_node if d else 0)
    mem = (int(declared.gpu_mem_gib * GIB) if declared.gpu_mem_gib is not None
           else (d.gpu_mem_bytes if d and d.accelerator == "cuda" else 0))
    if gpus == 0 and declared.gpus_per_node is None and declared.gpu_mem_gib is not None:
        gpus = 1
    host = (int(declared.host_mem_gib * GIB) if declared.host_mem_gib is not None
            else (d.host_mem_bytes if d else host_mem_bytes))
    nodes = declared.nodes if declared.nodes is not None else (d.nodes if d else 1)
    accel = "cuda" if gpus > 0 else "cpu"
    return Hardware(accelerator=accel, gpus_per_node=gpus, gpu_mem_bytes=mem if accel == "cuda" else 0,
                    host_mem_bytes=host, nodes=nodes, cpu_cores=d.cpu_cores if d else cpu_cores,
                    fp16_ok=True if accel == "cuda" else (d.fp16_ok if d else False))


def needs_detection(declared: HardwareConfig) -> bool:
    """Whether ``detect()`` must run (it may import torch): the GPU side is not fully declared.
    Host RAM alone never needs it (hardware.host_memory_bytes() reads sysconf)."""
    return not (declared.gpus_per_node == 0 or
                (declared.gpus_per_node is not None and declared.gpu_mem_gib is not None))


# ---------------------------------------------------------------------------------------------
# Gate and autofit


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

    @property
    def overrides(self) -> List[str]:
        return [c.override() for c in self.changes]


def _override(key: str, value: Any) -> str:
    if key == "zero.stage":
        return f"zero=stage{value}"
    if key == "offload.device":
        return f"offload={value.value if isinstance(value, OffloadDevice) else value}"
    if isinstance(value, bool):
        return f"{key}={'true' if value else 'false'}"
    if value is None:
        return f"{key}=null"
    return f"{key}={value}"


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True)
class _Knobs:
    micro: int
    ckpt: bool
    small_buckets: bool
    stage: int
    offload: OffloadDevice
    params: Optional[bool]


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
        for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"):
            if getattr(z, key) is not None:
                changes.append(Change(f"zero.{key}", getattr(z, key), None, "hidden²-sized buckets (HF's auto size)"))
        if z.overlap_comm:
            changes.append(Change("zero.overlap_comm", True, False, "overlap_comm doubles the reduce bucket"))
        new_z = dataclasses.replace(new_z, reduce_bucket_size=None, allgather_bucket_size=None,
                                    stage3_prefetch_bucket_size=None, overlap_comm=False)
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
    new_par = cfg.parallel
    if k.micro != tr.micro_batch_size and cfg.parallel.mode == ParallelMode.pipeline and cfg.parallel.micro_batches:
        accum = pinned_global // (k.micro * data_parallel_size(cfg, world))
        changes.append(Change("parallel.micro_batches", cfg.parallel.micro_batches, accum,
                              "the pipeline streams that many smaller micro-batches per step"))
        new_par = dataclasses.replace(new_par, micro_batches=accum)
    new = dataclasses.replace(cfg, trainer=new_tr, zero=new_z, offload=new_off, parallel=new_par)
    return new, changes


def _candidates(cfg: RunConfig, world: World, pinned_global: int) -> List[_Knobs]:
    """Every config autofit may choose, fastest first.

    Preference (least significant first): a smaller micro-batch with more accumulation, activation
    checkpointing, smaller buckets, a higher ZeRO stage, optimizer offload to CPU, parameter offload.
    A later knob is used only when no combination of the earlier ones fits, and then the earlier ones
    are tried again from the fastest (so ZeRO-2 without checkpointing beats ZeRO-2 with it).
    Nothing the user chose is undone (stage, offload, checkpointing only go up).
    """
    tr, z, off = cfg.trainer, cfg.zero, cfg.offload
    dp = data_parallel_size(cfg, world)
    per_rank = pinned_global // dp if pinned_global % dp == 0 else tr.micro_batch_size
    micros = sorted({d for d in range(1, tr.micro_batch_size + 1)
                     if per_rank % d == 0 and pinned_global % (d * dp) == 0} | {tr.micro_batch_size}, reverse=True)
    default = dataclasses.replace(z, reduce_bucket_size=None, allgather_bucket_size=None,
                                  stage3_prefetch_bucket_size=None, overlap_comm=False)
    shrinkable = bucket_sizes(dataclasses.replace(cfg, zero=default)) != bucket_sizes(cfg) or z.overlap_comm
    out = []
    # A pipeline takes ZeRO-0/1 only (DeepSpeed's rule), and autofit does not add offload to it.
    pipeline = cfg.parallel.mode == ParallelMode.pipeline
    for stage in range(z.stage, 2 if pipeline else 4):
        offloads: List[Tuple[int, OffloadDevice, Optional[bool]]] = []  # (tier, device, offload.params)
        if off.device == OffloadDevice.none:
            offloads.append((0, OffloadDevice.none, off.params))
            if stage >= 1 and not pipeline:
                offloads.append((1, OffloadDevice.cpu, False if stage == 3 else None))
            if stage == 3:
                offloads.append((2, OffloadDevice.cpu, True))
        elif stage == 0 or (off.device == OffloadDevice.nvme and stage < 3):
            continue  # the user's offload device needs a higher stage (config.check refuses these)
        elif stage < 3:
            offloads.append((1, off.device, off.params))
        else:
            offloads.append((1, off.device, False))
            offloads.append((2, off.device, off.params if off.params is not False else True))
        for rank, dev, params in offloads:
            if params and stage != 3:
                continue
            for small in ([False, True] if shrinkable else [False]):
                for ckpt in ([False, True] if not tr.activation_checkpointing else [True]):
                    for micro in micros:
                        key = (rank == 2, rank >= 1, stage, small, ckpt, -micro)
                        out.append((key, _Knobs(micro, ckpt, small, stage, dev, params)))
    out.sort(key=lambda kv: kv[0])
    return [k for _, k in out]


def autofit(cfg: RunConfig, world: World, hw: Hardware, *,
            cal: Calibration = DEFAULT_CALIBRATION) -> Optional[Tuple[RunConfig, Estimate, List[Change]]]:
    """The fastest config that fits (see ``_candidates`` for the order), its estimate and the changes;
    None if nothing zerorun can change fits. ``global_batch_size`` stays fixed (pinned to micro × ranks
    when it was unset)."""
    pinned = global_batch(cfg, world)
    for knobs in _candidates(cfg, world, pinned):
        new, changes = _apply(cfg, world, knobs, pinned)
        est = estimate(new, world, hw, cal=cal)
        if est.fits:
            return new, est, changes
    return None


def _describe(cfg: RunConfig, world: World, est: Estimate) -> str:
    tr = cfg.trainer
    off = "offload " + OffloadDevice(cfg.offload.device).value + (" (+params)" if params_offloaded(cfg) else "")
    return (f"{cfg.model.name} ZeRO-{cfg.zero.stage} {off} {Dtype(cfg.precision.dtype).value} "
            f"micro {tr.micro_batch_size} × seq {cfg.data.seq_len}"
            f"{' + checkpointing' if tr.activation_checkpointing else ''} on {world.size} rank(s)"
            + (f", pipeline stage {est.summary['peak_stage']} of {len(est.stages)} "
               f"({est.stages[est.summary['peak_stage']]['in_flight_micro_batches']} micro-batch(es) in flight)"
               if est.stages else ""))


def _shortfall(cfg: RunConfig, world: World, est: Estimate) -> str:
    unit = "GPU" if est.device == "cuda" else "rank (host RAM / ranks per node)"
    parts = []
    if not est.fits_device:
        top = ", ".join(f"{name} {_gib(v)}" for name, v in est.top(3))
        parts.append(f"{_describe(cfg, world, est)} needs {_gib(est.per_rank_peak_bytes)} per {unit} "
                     f"(peak in the {est.peak_phase} phase) but has {_gib(est.device_capacity_bytes)}. "
                     f"Biggest: {top}.")
    if not est.fits_host:
        parts.append(f"Host RAM per node: needs {_gib(est.host_bytes_per_node)}, has {_gib(est.host_capacity_bytes)}.")
    return " ".join(parts)


def gate(cfg: RunConfig, world: World, hw: Hardware, mode: Optional[GateMode] = None, *,
         cal: Calibration = DEFAULT_CALIBRATION) -> GateDecision:
    """The memory gate before launch. ``mode`` defaults to ``cfg.gate``.

    fits → ok. Otherwise strict → refuse (the message names the top consumers, the capacity and
    Hydra overrides of a config that fits); warn → ok with that message as a warning; autofit → ok
    with the fastest config that fits (``cfg`` and ``changes``), or refuse if none does; off → ok,
    the estimate is only recorded.
    """
    mode = GateMode(mode if mode is not None else cfg.gate)
    est = estimate(cfg, world, hw, cal=cal)
    if mode == GateMode.off:
        return GateDecision(True, mode, cfg, est, est, message="memory gate off: estimate recorded only.")
    if est.fits:
        unit = "GPU" if est.device == "cuda" else "rank"
        return GateDecision(True, mode, cfg, est, est,
                            message=f"fits: {_gib(est.per_rank_peak_bytes)} of {_gib(est.device_capacity_bytes)} "
                                    f"per {unit} (peak in the {est.peak_phase} phase).")
    found = autofit(cfg, world, hw, cal=cal)
    shortfall = _shortfall(cfg, world, est)
    if found is None:
        if est.fits_device:  # only host RAM is short: nothing on the GPU side helps
            fix = (f"every rank builds the fp32 model ({_gib(4 * est.params)}) on the host before DeepSpeed takes it, "
                   "and offloaded state lives there too: fewer ranks per node (launcher.nproc_per_node), more nodes, "
                   "or a host with more RAM (hardware.host_mem_gib when planning).")
        else:
            fix = (f"no micro-batch, checkpointing, bucket, ZeRO stage or offload setting fits on {world.size} "
                   "rank(s): add GPUs/nodes (launcher.nnodes, launcher.nproc_per_node), use larger GPUs, or a "
                   "shorter data.seq_len.")
        msg = f"{shortfall} Fix: {fix}"
        return GateDecision(mode == GateMode.warn, mode, cfg, est, est, message=msg,
                            warning=msg if mode == GateMode.warn else None)
    new_cfg, new_est, changes = found
    overrides = [c.override() for c in changes]
    if mode == GateMode.autofit:
        why = "; ".join(f"{c.override()} ({c.why})" for c in changes)
        msg = (f"{shortfall} autofit: {' '.join(overrides)} → {_gib(new_est.per_rank_peak_bytes)} of "
               f"{_gib(new_est.device_capacity_bytes)}. Why: {why}.")
        return GateDecision(True, mode, new_cfg, new_est, est, changes=changes, message=msg, suggestion=overrides)
    msg = (f"{shortfall} A config that fits ({_gib(new_est.per_rank_peak_bytes)}): {' '.join(overrides)} — "
           "add these overrides, or gate=autofit to apply them, or gate=warn to launch anyway.")
    if mode == GateMode.warn:
        return GateDecision(True, mode, cfg, est, est, message=msg, warning=msg, suggestion=overrides)
    return GateDecision(False, mode, cfg, est, est, message=msg, suggestion=overrides)


def table_configs(cfg: RunConfig) -> List[Tuple[str, RunConfig]]:
    """Every valid ZeRO stage × offload choice for ``cfg`` (estimate table rows), labelled. A pipeline
    takes ZeRO-0/1 only (DeepSpeed's rule); offload with a pipeline is not offered (untested)."""
    rows = []
    pipeline = cfg.parallel.mode == ParallelMode.pipeline
    for stage in range(2 if pipeline else 4):
        z = dataclasses.replace(cfg.zero, stage=stage)
        choices: List[Tuple[str, OffloadDevice, Optional[bool]]] = [("none", OffloadDevice.none, None)]
        if stage in (1, 2) and not pipeline:
            choices.append(("cpu", OffloadDevice.cpu, None))
        if stage == 3:
            choices += [("cpu (optimizer)", OffloadDevice.cpu, False), ("cpu (+params)", OffloadDevice.cpu, True),
                        ("nvme (optimizer)", OffloadDevice.nvme, False), ("nvme (+params)", OffloadDevice.nvme, True)]
        for label, dev, params in choices:
            o = dataclasses.replace(cfg.offload, device=dev, params=params)
            rows.append((f"ZeRO-{stage}  offload {label}", dataclasses.replace(cfg, zero=z, offload=o)))
    return rows
