"""ZeRO-1/2's partitions as DeepSpeed draws them (memory/buffers.py partition_of): each rank's gradient partition
holds every tensor that overlaps its share whole, and the step takes an fp64 norm of each slice inside it."""
import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import CPU2, CPU_HOST, composed
from zerorun.config import World, make_plan
from zerorun.memory import estimate
from zerorun.memory.buffers import FP64_NORM_BYTES, other_rank, partition_of, zero_partition
from zerorun.memory.page_heap import grown_at_step
from zerorun.memory.params import param_breakdown
from zerorun.memory.phases import GATHER_OUTPUT, GRADIENT_NORM

MIB = 2**20


@settings(max_examples=60, deadline=None)
@given(tensors=st.lists(st.integers(0, 5000), min_size=1, max_size=12), ranks=st.integers(1, 9))
def test_each_ranks_partition_is_deepspeeds(tensors, ranks):
    # (imported here: importing DeepSpeed sets up its loggers, which test_quiet.py checks zerorun does first)
    from deepspeed.runtime.utils import align_dense_tensors
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    # DeepSpeed's own partitioning (stage_1_and_2.py: the flat buffer padded by align_dense_tensors, then
    # get_partition_info) on meta tensors of those sizes
    meta = [torch.empty(n, device="meta") for n in tensors]
    flat = sum(t.numel() for t in align_dense_tensors(meta, 2 * ranks))
    size = flat // ranks
    for rank in range(ranks):
        inside, _, offset = DeepSpeedZeroOptimizer.get_partition_info(None, meta, size, rank)
        held = partition_of(tuple(tensors), ranks, rank)
        assert held.whole == sum(t.numel() for t in inside)
        # the slices of those tensors inside [lo, hi), whose fp64 copies the step takes norms of
        lo, hi, position, slices, starts = rank * size, (rank + 1) * size, 0, [], []
        for t in meta:
            if any(t is p for p in inside):
                slices.append(min(position + t.numel(), hi) - max(position, lo))
                starts.append(position)
            position += t.numel()
        assert held.largest_slice == max(slices, default=0)
        assert offset == max(0, lo - starts[0]) if starts else offset == 0  # the first one straddles from there


@settings(max_examples=100, deadline=None)
@given(word=st.integers(1, 10**6), layers=st.lists(st.integers(1, 10**5), max_size=30), ranks=st.integers(2, 12))
def test_the_other_rank_holds_the_largest_partition_of_the_others(word, layers, ranks):
    bd = _breakdown((word,), tuple(layers))
    whole = [zero_partition(bd, ranks, r).whole for r in range(1, ranks)]
    assert zero_partition(bd, ranks, other_rank(bd, ranks)).whole == max(whole)


def test_minilms_ranks_hold_the_embedding_and_the_whole_model():
    # Logged (ZeRO-2, fp32, 2 ranks): rank 0's gradient partition was 44.7 MiB (the 11.72 M-element word embedding,
    # which straddles the boundary), rank 1's 86.6 MiB (every tensor, the embedding's tail too), and the step took
    # an 86.6 MiB fp64 norm on rank 0 (its 11.36 M-element slice of the embedding)
    cfg = composed("+model=minilm", "zero=stage2", "precision=fp32", "launcher.nproc_per_node=2")
    bd = param_breakdown(cfg.model, adapter=cfg.adapter)
    first, second = zero_partition(bd, 2, 0), zero_partition(bd, 2, 1)
    assert round(first.whole * 4 / MIB, 1) == 44.7 and round(second.whole * 4 / MIB, 1) == 86.6
    assert round(first.largest_slice * FP64_NORM_BYTES / MIB, 1) == 86.6
    e = estimate(cfg, make_plan(cfg, CPU2), CPU_HOST)
    assert e.phases["gradient norm"][GRADIENT_NORM] == first.largest_slice * FP64_NORM_BYTES
    assert e.phases["optimizer step"]["gradients"] == first.whole * 4
    # gloo gathers the updated partitions into a flat output of the whole buffer (NCCL writes in place)
    assert e.phases["parameter all-gather"][GATHER_OUTPUT] >= bd.trainable * 4
    # the other rank's figure is its own: the whole model's gradients
    assert e.others_peak_bytes > e.per_rank_peak_bytes
    on_gpus = make_plan(cfg, World(nproc_per_node=2, nnodes=1, accelerator="cuda"))
    assert "parameter all-gather" not in estimate(cfg, on_gpus, CPU_HOST).phases


def test_offload_takes_its_norms_in_backward_not_at_the_step():
    cfg = composed("+model=minilm", "zero=stage2", "offload=cpu", "launcher.nproc_per_node=2")
    assert "gradient norm" not in estimate(cfg, make_plan(cfg, CPU2), CPU_HOST).phases


@pytest.mark.parametrize("spans, norm, blocks, grown", [
    ([30, 44, 44], 87, [43], 87),       # MiniLM rank 0: the norm grows the heap, its span then holds the step's block
    ([30, 44, 44], 87, [43] * 5, 87 + 43),  # what neither a freed span nor the norm's span holds grows it too
    ([300], 87, [43], 0),               # a freed span holds the norm: nothing grows
    ([30], 0, [43], 43),                # no norm block: the step's blocks alone
])
def test_the_steps_norm_block_grows_the_heap_only_where_no_freed_span_holds_it(spans, norm, blocks, grown):
    assert grown_at_step(spans, norm, blocks) == grown


@pytest.mark.parametrize("states, grown", [
    ([16.7], 2 * 29.8),         # tiny BERT (logged): the momentum took the norm's span, the next step grew it again
    ([7.0], 29.8),              # a state a freed layer span holds leaves the norm's span whole
    ([], 29.8),                 # no state (SGD without momentum): once
])
def test_a_state_that_takes_the_norms_span_grows_the_heap_by_the_norm_again(states, grown):
    spans, blocks = [25.5, 25.5, 7.5, 14.9], [16.7, 16.7]  # the layers' spans hold the step's two blocks
    assert grown_at_step(spans, 29.8, blocks, states) == pytest.approx(grown)


@pytest.mark.parametrize("ranks", [1, 2])
def test_zero3_takes_the_steps_norm_of_each_gradient_partition_in_fp64(ranks):
    # stage3.py get_grad_norm_direct over averaged_gradients: g.to(float64) of each partition, one at a time
    cfg = composed("+model=tiny-bert", "zero=stage3", "precision=bf16", f"launcher.nproc_per_node={ranks}")
    world = World(nproc_per_node=ranks, nnodes=1, accelerator="cpu", fp16_ok=False)
    e = estimate(cfg, make_plan(cfg, world), CPU_HOST)
    largest = param_breakdown(cfg.model).largest_trainable
    assert e.phases["gradient norm"][GRADIENT_NORM] == -(-largest // ranks) * FP64_NORM_BYTES
    offloaded = composed("+model=tiny-bert", "zero=stage3", "offload=cpu", f"launcher.nproc_per_node={ranks}")
    assert "gradient norm" not in estimate(offloaded, make_plan(offloaded, world), CPU_HOST).phases


def _breakdown(embedding, layer):
    """A ParamBreakdown of a word embedding and one layer (no head), for partitions of any shape."""
    return dataclasses.replace(_TINY, embedding_tensors=embedding, layer_tensors=layer, num_layers=1, head_tensors=())


_TINY = param_breakdown(composed("+model=tiny-gpt2").model)
