"""§4 Buffers of the backward pass: gradient buckets, ZeRO-3's gathered parameters, gradients in flight,
the tied-embedding and word-embedding gradient transients, ZeRO-0's all-reduce flatten.

docs/memory.md §4. Each term names the DeepSpeed 0.19.8 code that allocates it; the transients were
found by measuring real engines on CPU (benchmarks/memory_harness.py).
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Tuple

from ..config import Dtype, Plan, RunConfig
from .activations import DTYPE_BYTES
from .params import ParamBreakdown, breakdown
from .states import trainable_tensors

TIED_EMBEDDING_COPIES = 3
"""Tied input/output embedding: autograd sums the LM-head and embedding gradients, so old + new +
sum = 3·V·h elements live at the end of backward (§3.6, measured)."""

ZERO0_ALLREDUCE_ELEMENTS = 500_000_000
"""ZeRO-0 gradient all-reduce flattens grads into buckets of this many elements
(deepspeed/runtime/engine.py MEMORY_OPT_ALLREDUCE_SIZE; ``allreduce_bucket`` → ``self.flatten``)."""

FP64_NORM_BYTES = 8
"""With optimizer offload, ZeRO-1/2/3 take each gradient's norm as ``grad.to(float64).norm(2)`` in the
backward hook (deepspeed/runtime/zero/utils.py get_norm_dtype: fp64 wherever the device has it): a
transient 8 bytes per element of the largest gradient (measured on CPU)."""


@dataclass
class BackwardBuffers:
    """What the backward pass allocates beyond activations and model states, on one rank."""

    buffers: List[Tuple[str, float]]
    """ZeRO-3's gathered parameters: alive from forward to the end of backward."""
    ipg: List[Tuple[str, float]]
    """ZeRO-1/2's reduce buckets: allocated at the first gradient hook, freed at the end of every backward
    (stage_1_and_2.py setup_buckets / _release_ipg_buffers), so not alive at the loss or the step."""
    resident: List[Tuple[str, float]]
    """ZeRO-3's reduce bucket: allocated with the optimizer and kept (stage3.py ``bucket.buffer``)."""
    in_flight: List[Tuple[str, float]]
    """ZeRO-2/3: a layer gradient not yet copied into its bucket."""
    tied_pending: List[Tuple[str, float]]
    """A tied LM head's gradient, held by autograd until the embedding's gradient arrives."""
    at_loss: List[Tuple[str, float]] = field(default_factory=list)
    """Alive at a micro-batch's loss: a pipeline's ZeRO-1 reduce bucket (see ``backward_buffers``)."""
    notes: List[str] = field(default_factory=list)


def backward_buffers(cfg: RunConfig, plan: Plan, bd: ParamBreakdown, key: Tuple) -> BackwardBuffers:
    """``key``: the whole model's params.model_key (ZeRO-3 replays its module trace)."""
    z, stage = cfg.zero, cfg.zero.stage
    p = g = DTYPE_BYTES[Dtype(cfg.precision.dtype)]
    buffers: List[Tuple[str, float]] = []
    ipg: List[Tuple[str, float]] = []
    resident: List[Tuple[str, float]] = []
    notes: List[str] = []
    # allgather_bucket_size allocates nothing in 0.19.8: all_gather_into_tensor writes into the flat
    # 16-bit buffer in place (runtime/utils.py all_gather_dp_groups).
    at_loss: List[Tuple[str, float]] = []
    if stage in (1, 2) and z.contiguous_gradients:
        # setup_buckets(): one IPG bucket in the module dtype, a second one with overlap_comm
        ipg.append(("reduce buckets", plan.buckets.reduce_bucket_size * g * (2 if z.overlap_comm else 1)))
        if plan.pipeline:
            # The first gradient hook of a step allocates it (process_gradients → setup_buckets), and only the
            # step's reduce (PipelineEngine _exec_reduce_grads → reduce_gradients → _release_ipg_buffers) frees it:
            # every later micro-batch's forward and loss run next to it (measured on CPU: a 2-stage tiny Llama at
            # ZeRO-1, the last stage 7.5% under without it).
            at_loss = list(ipg)
    if stage == 3:
        if z.contiguous_gradients:
            resident.append(("reduce buckets", plan.buckets.reduce_bucket_size * g))  # stage3.py IPG buffer
        live = zero3_live_peak(key, plan.buckets.stage3_param_persistence_threshold, z.stage3_max_reuse_distance,
                               z.stage3_max_live_parameters)
        if plan.data_parallel_size == 1 and (not plan.offload_params or plan.world.accelerator == "cpu"):
            # One rank: DeepSpeed does not gather (partition_parameters.py _no_gather_coalesced: param.data =
            # ds_tensor.to(device), a copy only when the partition sits on the host and the rank on a GPU).
            live = 0
        buffers.append(("ZeRO-3 gathered params", live * p))
        if live:
            buffers.append(("ZeRO-3 prefetch bucket",
                            min(plan.buckets.stage3_prefetch_bucket_size, z.stage3_max_live_parameters) * p))
        if live > 0.5 * bd.total:
            notes.append(f"ZeRO-3 keeps {live / bd.total:.0%} of the parameters gathered between forward and backward "
                         f"(its prefetch fills zero.stage3_max_live_parameters={z.stage3_max_live_parameters:.0e}); "
                         "a smaller zero.stage3_max_live_parameters with a smaller zero.stage3_max_reuse_distance "
                         "trades this memory for more all-gathers.")
    # ZeRO-2/3: a layer parameter's grad exists until its hook copies it into the bucket. (The tied
    # embedding's grad is the separate "tied-embedding grad": autograd holds it until both uses are summed.)
    largest = bd.largest_trainable if bd.lora else max(bd.layer_tensors + bd.head_tensors)
    in_flight = [("gradient in flight", largest * g)] if stage >= 2 else []
    tied = [("tied-embedding grad (pending)", bd.tied_embedding * g)] if bd.tied_embedding and not bd.lora else []
    return BackwardBuffers(buffers, ipg, resident, in_flight, tied, at_loss=at_loss, notes=notes)


def reduced_before(arrivals: Iterable[int], bucket: int) -> bool:
    """Whether a ZeRO-1/2 bucket has been reduced by the time gradients of these sizes (backward order) reach
    their hooks: a bucket is reduced when the next gradient would overflow it (stage_1_and_2.py
    reduce_independent_p_g_buckets_and_remove_grads). Until then each gradient lives inside the bucket (the
    hook re-points param.grad into it) and the gradient partition, allocated by the first reduce
    (copy_grads_in_partition), does not exist yet."""
    held = 0
    for n in arrivals:
        if held and held + n > bucket:
            return True
        held += n
    return False


@dataclass(frozen=True)
class FirstReduce:
    """When ZeRO-1/2 first reduces a bucket in a backward pass, and so allocates its gradient partition."""

    before_embedding: bool
    """Before the word embedding's gradient reaches its hook. If so, the partition is counted from the
    start of backward (exact with small buckets, an upper bound when the first reduce comes a few layers
    in); if not, every other gradient sits in the bucket until the end of backward, where the partition
    appears next to the bucket (the "gradient reduce" phase)."""
    word_joins_bucket: bool
    """The word embedding's gradient fits in what is left of the bucket (no flush while it is alive)."""


def first_reduce(cfg: RunConfig, plan: Plan, bd: ParamBreakdown) -> FirstReduce:
    """Measured on CPU with buckets of hidden², larger than the model and in between
    (benchmarks/memory_harness.py --bucket). With accumulation, pipelines or non-contiguous gradients the
    early reduce is assumed (the layout validated there)."""
    if (cfg.zero.stage not in (1, 2) or not cfg.zero.contiguous_gradients or plan.grad_accum_steps > 1
            or plan.pipeline):
        return FirstReduce(True, False)
    bucket = plan.buckets.reduce_bucket_size
    others = list(bd.head_tensors) + list(bd.layer_tensors) * bd.num_layers
    return FirstReduce(before_embedding=reduced_before(others, bucket),
                       word_joins_bucket=sum(others) + bd.word_embedding <= bucket)


def embedding_grad_transient(cfg: RunConfig, plan: Plan, bd: ParamBreakdown, rank: int = 0) -> int:
    """End of backward, layer activations freed: the word embedding's dense gradient.

    Tied (GPT-2): LM-head grad + embedding grad + their sum (§3.6). Untied (BERT): the new grad before
    it is accumulated (measured: +V·h on top of the existing grads with gradient accumulation).
    ZeRO-0/1 without accumulation: the untied grad *is* param.grad (in "gradients"); ZeRO-2/3 hold it
    apart until it is copied into the partition. With optimizer offload DeepSpeed takes each gradient's
    norm in fp64 (stage_1_and_2.py set_norm_for_param_grad_in_gpu, stage3.py:
    ``.to(get_norm_dtype()).norm(2)``): +8 bytes per element, next to a clone of the gradient where it is
    larger than the reduce bucket (ZeRO-1/2 ``extra_large_param_to_reduce``; ZeRO-3 always), measured on
    CPU for ZeRO-1/2/3.
    """
    stage, g = cfg.zero.stage, DTYPE_BYTES[Dtype(cfg.precision.dtype)]
    word = bd.word_embedding
    if bd.tied_embedding:
        # ZeRO-3: the sum is formed in place of the LM-head gradient (2 copies): GPT-2 small ZeRO-3 fp32 with
        # checkpointing peaked at 2,030 MiB of live tensors, 3 copies said 2,146 and 2 copies 2,017 (loss phase).
        transient = (TIED_EMBEDDING_COPIES - (1 if stage == 3 else 0)) * word * g
    else:
        # ZeRO-3 reduces a gradient larger than the bucket through reduce_scatter_coalesced, which
        # flattens it into a second buffer (measured on CPU: 2·V·h·g).
        copies = 2 if stage == 3 and not plan.offload_optimizer else 1
        transient = copies * word * g if (stage >= 2 or plan.grad_accum_steps > 1) else 0
    if plan.offload_optimizer:
        # ZeRO-1 untied: the grad is in "gradients"; ZeRO-1/2: a gradient that fits is copied into the bucket
        cloned = stage == 3 or word > plan.buckets.reduce_bucket_size
        own = 0 if (stage == 1 and not bd.tied_embedding) or not cloned else word * g
        norm = embedding_norm_block(cfg, plan, bd, rank)
        # ZeRO-3's partition of the gradient is a view into reduce_scatter_coalesced's flat output
        # (coalesced_collectives.py: ``torch.cat`` of the padded partitions, on one rank too), alive beside param.grad
        # while the norm is taken
        # (stage3.py partition_grads; tiny BERT fp32 ZeRO-3 + CPU offload on one rank read -4.2% without it)
        partition = norm // FP64_NORM_BYTES * g if stage == 3 else 0
        transient = max(transient, own + partition + norm)
    return transient


def zero3_step_norm_block(cfg: RunConfig, plan: Plan, bd: ParamBreakdown) -> int:
    """ZeRO-3 with the optimizer on the device: the fp64 copy of the largest gradient partition the step takes the
    norm of, one at a time (stage3.py ``_get_norm_groups`` → ``get_grad_norm_direct`` over ``averaged_gradients``:
    ``g.to(get_norm_dtype()).norm(2)``); 0 elsewhere (ZeRO-1/2: ``zero_partition``'s slices; offload: the norms are
    taken in backward, ``embedding_norm_block``). Logged (bigalloc), tiny BERT, ZeRO-3, bf16, SGD, one rank: a
    29.8 MiB block (its 3.9 M-element word embedding × 8) at every step, which grew the heap at steps 1 and 2 with
    64-76 MiB free in smaller spans (the momentum took its span after step 1); the rank read -8.1% without it."""
    if cfg.zero.stage != 3 or plan.offload_optimizer:
        return 0
    return -(-bd.largest_trainable // max(1, plan.data_parallel_size)) * FP64_NORM_BYTES


def embedding_norm_block(cfg: RunConfig, plan: Plan, bd: ParamBreakdown, rank: int = 0) -> int:
    """With optimizer offload, the fp64 copy of the word embedding's gradient DeepSpeed takes its norm of (at the
    end of backward), of the slice this data-parallel ``rank``'s partition holds; 0 without offload. ZeRO-1/2
    flatten the parameters in order, the word embedding first, so rank 0 holds it (logged, MiniLM on 2 ranks: an
    86.6 MiB fp64 block on rank 0 only, its 11.36 M-element partition of the 11.72 M-element embedding; rank 1 read
    50-140 MiB lower). ZeRO-3 takes the norm of every rank's partition of the gradient (GPT-2 small fp32 + CPU
    offload on 2 ranks: the rank that does not export peaked 170 MiB below a whole-gradient fp64 norm)."""
    if not plan.offload_optimizer:
        return 0
    word, ranks = bd.word_embedding, max(1, plan.data_parallel_size)
    if cfg.zero.stage == 3:
        normed = -(-word // ranks)
    else:
        part = -(-bd.trainable // ranks)
        normed = max(0, min(word, (rank + 1) * part) - rank * part)
    return normed * FP64_NORM_BYTES


@dataclass(frozen=True)
class ZeroPartition:
    """What ZeRO-1/2 (stage_1_and_2.py) hold of one data-parallel rank's partition beyond its even share."""

    whole: int
    """Elements of every trainable tensor that overlaps the partition, counted whole: ``get_partition_info`` puts a
    tensor that straddles the partition's start in ``params_in_partition``, and ``copy_grads_in_partition`` sizes
    the gradient partition by their numel. Logged, MiniLM (its 11.72 M-element word embedding first) on 2 ranks:
    rank 0 allocated 44.7 MiB, rank 1 86.6 MiB (the whole model), against 43.3 MiB each as an even share."""
    largest_slice: int
    """Elements of the largest slice of one tensor inside the partition: the step takes each slice's norm as an fp64
    copy (``get_grad_norm_direct``: ``g.to(get_norm_dtype())``), one at a time (the same MiniLM: an 86.6 MiB fp64
    block on rank 0 at each step, its 11.36 M-element slice of the word embedding)."""


def partitioned_on_device(cfg: RunConfig, plan: Plan) -> bool:
    """ZeRO-1/2 with the optimizer on the device: where a rank's gradient partition and the step's norms follow
    ``zero_partition`` (with offload the partition is the host's fp32 buffer and the norms are taken in backward)."""
    return cfg.zero.stage in (1, 2) and not plan.offload_optimizer


def zero_partition(bd: ParamBreakdown, ranks: int, rank: int) -> ZeroPartition:
    """Data-parallel ``rank``'s ZeRO-1/2 partition of ``bd``'s trainable tensors (``partition_of``)."""
    return partition_of(trainable_tensors(bd), ranks, rank)


@functools.lru_cache(maxsize=256)
def partition_of(tensors: Tuple[int, ...], ranks: int, rank: int) -> ZeroPartition:
    """Data-parallel ``rank``'s partition of ``tensors`` (element counts) flattened in that order, the flat buffer
    padded to 2 × ``ranks`` elements (``flatten_dense_tensors_aligned``, nccl_start_alignment_factor 2)."""
    size = partition_size(tensors, ranks)
    lo, hi = rank * size, (rank + 1) * size
    whole = largest = start = 0
    for t in tensors:
        end = start + t
        if lo <= start < hi or start < lo < end:  # get_partition_info's two tests
            whole += t
            largest = max(largest, min(end, hi) - max(start, lo))
        start = end
    return ZeroPartition(whole, largest)


def partition_size(tensors: Tuple[int, ...], ranks: int) -> int:
    """Elements of each rank's ZeRO-1/2 partition: the flat buffer padded to 2 × ``ranks``, split evenly."""
    ranks = max(1, ranks)
    return -(-sum(tensors) // (2 * ranks)) * 2


@functools.lru_cache(maxsize=256)
def other_rank(bd: ParamBreakdown, ranks: int) -> int:
    """The data-parallel rank other than 0 whose ZeRO-1/2 gradient partition holds the most (``partition_of``'s
    ``whole``, every rank in one pass), the first of them on a tie; 1 on fewer than 3 ranks."""
    if ranks < 3:
        return 1
    tensors = trainable_tensors(bd)
    size = partition_size(tensors, ranks)
    held = [0] * (ranks + 1)  # a difference array: a tensor is whole in every partition it overlaps
    start = 0
    for t in tensors:
        if t:
            held[start // size] += t
            held[min(ranks, (start + t - 1) // size + 1)] -= t
        start += t
    whole, run = [], 0
    for d in held[:ranks]:
        run += d
        whole.append(run)
    return max(range(1, ranks), key=lambda r: (whole[r], -r))


def zero0_flatten_bytes(cfg: RunConfig, bd: ParamBreakdown) -> int:
    """engine.allreduce_bucket flattens grads in buckets of 5e8 elements before the all-reduce, on one
    rank too (engine.py allreduce_gradients has no world-size check; measured on CPU)."""
    return min(bd.trainable, ZERO0_ALLREDUCE_ELEMENTS + bd.largest_trainable) * DTYPE_BYTES[Dtype(cfg.precision.dtype)]


@functools.lru_cache(maxsize=256)
def zero3_live_peak(key: Tuple, threshold: int, reuse_distance: int, max_live: int = 1_000_000_000) -> int:
    """Peak elements of gathered (non-persistent) parameters during forward + backward under ZeRO-3, replaying
    DeepSpeed 0.19.8's coordinator (partitioned_param_coordinator.py) one parameter tensor at a time over the
    forward trace and its reverse (backward):

    - **Prefetch** (``fetch_sub_module``): once the trace is recorded, every fetch also gathers the next tensors of
      the trace while fewer than ``stage3_max_live_parameters`` elements are gathered (the last one may overshoot).
      Each fetch prefetches at least one tensor and a layer runs more modules (containers, norms, dropouts,
      activations) than it has large tensors, so the prefetch front runs ahead of the forward and fills the
      budget: the replay assumes it always does. Measured on 2 CPU ranks (a 16-layer Llama-class model of 19.3M
      parameters): every tensor gathered by mid-forward for any reuse distance while the budget exceeds the model,
      and at most the budget plus one tensor below it; on an H200, Llama-3.2-1B with its parameters offloaded
      kept 1.0e9 elements gathered (1.9 GiB), not the 0.5e9 a release-only replay predicts (docs/memory.md §8.7).
    - **Release** (``__params_to_release``): after its module runs, a tensor stays gathered if the prefetch front
      has already fetched it for a later use, or if it is used again within ``stage3_max_reuse_distance``
      elements of the modules that follow.

    Persistent tensors (at most ``threshold`` elements) are never gathered or released: counted elsewhere.
    """
    bd = breakdown(key)
    big = lambda ts, tag: [((tag, i), n) for i, n in enumerate(ts) if n > threshold]  # noqa: E731
    emb = big(bd.embedding_tensors, "emb")
    forward = emb + [((f"L{l}", i), n) for l in range(bd.num_layers) for (_, i), n in big(bd.layer_tensors, "L")]
    forward += big(bd.head_tensors, "head")
    if bd.tied_embedding:
        forward += [t for t in emb if t[1] == bd.tied_embedding][:1]  # the LM head reuses wte
    trace = forward + forward[::-1]
    uses: Dict[Tuple, List[int]] = {}
    for t, (tid, _) in enumerate(trace):
        uses.setdefault(tid, []).append(t)
    prefix = list(itertools.accumulate((n for _, n in trace), initial=0))
    gathered: Dict[Tuple, int] = {}
    fetched_for: Dict[Tuple, int] = {}
    total = peak = front = 0
    for t, (tid, _) in enumerate(trace):
        # the module's own tensor (unless the front already fetched it), then the prefetch while under the budget
        front = max(front, t)
        while front < len(trace) and (front == t or total < max_live):
            u, m = trace[front]
            fetched_for[u] = max(fetched_for.get(u, -1), front)
            if u not in gathered:
                gathered[u] = m
                total += m
            front += 1
        peak = max(peak, total)
        if fetched_for[tid] > t:
            continue  # the prefetch front already fetched it for a later use
        later = [u for u in uses[tid] if u > t]
        # reused within the distance: the elements of the modules between now and the next use
        if later and prefix[later[0]] - prefix[t + 1] < reuse_distance:
            continue
        total -= gathered.pop(tid)
    return peak
