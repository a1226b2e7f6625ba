"""A preloaded allocator's page-heap term (memory/page_heap.py): the step's flat blocks need heap of their own only
where no freed activation block can hold them, and a loss peak needs one more fp32 logits block, or one for each
logits span the optimizer's lazily created states took."""
import dataclasses
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from helpers import CPU2, CPU_HOST, composed
from zerorun.config import World, make_plan
from zerorun.memory import estimate
from zerorun.memory.buffers import embedding_norm_block
from zerorun.memory.page_heap import (ACTIVATION_PHASES, freed_layer_spans, largest_freed_block, layer_blocks,
                                      layer_span, lazy_state_blocks, logits_spans_taken, norm_span_freed,
                                      placement_bytes, spans_at_step, spans_taken, startup_heap, step_block,
                                      step_blocks)
from zerorun.memory.params import param_breakdown
from zerorun.memory.phases import GRADIENT_NORM
from zerorun.memory.priors import PAGE_HEAP_TERM
from zerorun.memory.states import unfused_startup_step

CPU1 = World(nproc_per_node=1, nnodes=1, accelerator="cpu", fp16_ok=False)
MIB = 2**20


def term(*overrides, world=CPU1):
    # (the runs these cases come from took the model's own loss; the fused loss has no b·s·V blocks)
    cfg = composed(*overrides, "launcher.allocator=tcmalloc", "trainer.fused_loss=false")
    plan = make_plan(cfg, world)
    return cfg, plan, estimate(cfg, plan, CPU_HOST)


def test_gpt2s_flat_fp32_partition_needs_heap_of_its_own():
    # The run benchmarks/heap_sampler/ sampled: the heap grew by 2 x 475 MiB in the step (124 M x 4 bytes) while
    # every freed activation block was smaller (logits 4 x 5 x 208 x 50257 bytes = 199 MiB).
    cfg, plan, e = term("+model=gpt2", "zero=stage2", "precision=bf16", "data.seq_len=208",
                        "trainer.micro_batch_size=5", "optimizer=sgd")
    act = e.phases
    block = step_block(cfg, plan, e.params, e.params)
    assert round(block / MIB) == 475 and largest_freed_block(cfg, plan, _act(cfg, plan), _largest(cfg, plan)) < block
    step = act["optimizer step"]["optimizer-step transient"]
    activation_peak = max(sum(act[p].values()) for p in ("loss", "backward", "embedding grad"))
    alloc_peak = _alloc_peak(act)
    assert e.components[PAGE_HEAP_TERM] >= activation_peak + step - alloc_peak > 600 * MIB


def test_a_partition_a_freed_block_can_hold_adds_nothing_at_the_step():
    # MiniLM fp32 on 2 ranks: its 45 MB fp32 partition fits in one freed fp32 score block (14 x 12 x 368^2 x 4)
    # and in its word embeddings' freed gradient (47 MB).
    cfg, plan, e = term("+model=minilm", "zero=stage2", "precision=fp32", "data.seq_len=368",
                        "trainer.micro_batch_size=14", "launcher.nproc_per_node=2", world=CPU2)
    assert step_block(cfg, plan, e.params // 2, e.params) < largest_freed_block(cfg, plan, _act(cfg, plan), _largest(cfg, plan))
    assert e.components[PAGE_HEAP_TERM] < 0.02 * e.per_rank_peak_bytes  # was 15% of the peak: 13.7% over


def test_the_step_blocks_fit_in_one_layers_freed_activations():
    # Held-out (session 53, seed 1795881110): MiniLM, ZeRO-1, fp32, adamw8bit, micro 6 x 272, one rank, no
    # checkpointing: 1,374 MiB measured, 1,771 estimated (+28.9%) with the step's 87 MiB flat blocks on heap of their
    # own. Each layer's saved tensors (105 MiB) are freed together and coalesce at release rate 0: they hold them.
    overrides = ("+model=minilm", "zero=stage1", "precision=fp32", "optimizer=adamw8bit", "data.seq_len=272",
                 "trainer.micro_batch_size=6", "trainer.activation_checkpointing=false")
    cfg, plan, e = term(*overrides)
    act = _act(cfg, plan)
    assert step_block(cfg, plan, e.params, _largest(cfg, plan)) < layer_span(act) == act.per_layer
    assert e.components[PAGE_HEAP_TERM] == 0
    # under checkpointing each recomputed layer's tensors are allocated among the backward's gradients: no span
    cfg, plan, _ = term(*overrides[:-1], "trainer.activation_checkpointing=true")
    assert layer_span(_act(cfg, plan)) == 0


@pytest.mark.heavy
def test_states_created_at_the_first_step_take_the_logits_spans_they_fit():
    assert logits_spans_taken(350, [237, 237]) == 2  # one span each: neither fits what the other left
    assert logits_spans_taken(350, [100, 200]) == 1  # the second fits what the first left (best fit)
    assert logits_spans_taken(350, [475, 475]) == 0 and logits_spans_taken(0, [10]) == 0
    # The run benchmarks/heap_sampler/ sampled: GPT-2 small, ZeRO-1 with offload, bf16, micro 6 x seq 304 on 2 ranks.
    # Adam's two states of the 62 M partition (237 MiB each) took two of the loss's 350 MiB fp32 logits spans,
    # and at step 2 the heap grew by 2 x 350 MiB: the rank peaked at 3,734 MiB where the one-block rule said 3,362.
    world = World(nproc_per_node=2, nnodes=1, accelerator="cpu", fp16_ok=False)
    cfg, plan, e = term("+model=gpt2", "zero=stage1", "offload=cpu", "precision=bf16", "data.seq_len=304",
                        "trainer.micro_batch_size=6", "trainer.activation_checkpointing=true",
                        "launcher.nproc_per_node=2", world=world)
    block = e.phases["loss"]["logits + loss"] // 3
    part = -(-e.params // 2)
    assert round(block / MIB) == 350 and lazy_state_blocks(cfg, plan, part) == [4 * part] * 2
    alloc_peak = _alloc_peak(e.phases)
    assert e.components[PAGE_HEAP_TERM] == sum(e.phases["loss"].values()) + 2 * block - alloc_peak
    # ZeRO-3 creates them at the first step as well (stage3.py initialize_optimizer_states runs no step), except
    # where it swaps them to NVMe; SGD's 237 MiB momentum does not fit a 184 MiB span
    assert lazy_state_blocks(*_planned("+model=gpt2", "zero=stage3"), 10**8) == [4 * 10**8] * 2
    assert lazy_state_blocks(*_planned("+model=gpt2", "zero=stage3", "offload=nvme"), 10**8) == []
    cfg, plan, e = term("+model=gpt2", "zero=stage2", "offload=cpu", "precision=bf16", "data.seq_len=192",
                        "trainer.micro_batch_size=5", "optimizer=sgd", "launcher.nproc_per_node=2", world=world)
    assert logits_spans_taken(e.phases["loss"]["logits + loss"] // 3, lazy_state_blocks(cfg, plan, e.params // 2)) == 0


@pytest.mark.heavy
def test_the_embeddings_norm_regrows_its_span_at_the_next_step():
    # Held-out set 1795881701's worst under-estimate (-17.8%): GPT-2 small, ZeRO-2, CPU offload, bf16, AdamW,
    # checkpointing, micro 13 x 96, 2 ranks (fused loss, as runs take it). Logged (bigalloc): on rank 0, whose
    # partition holds the word embedding, the first step's fp64 norm of its gradient (295 MiB) grew the heap; one of
    # Adam's 237 MiB states took its span, and at step 2 the norm grew the heap by 295 MiB again (2,862 MiB against
    # rank 1's 2,505, which takes no such norm).
    assert spans_taken([147, 295], [237, 237]) == [1]  # the loss's fp32 head block is too small for a state
    assert spans_taken([239, 239, 239, 295], [237, 237]) == [0, 1]  # best fit: logits spans first
    cfg = composed("+model=gpt2", "zero=stage2", "offload=cpu", "precision=bf16", "data.seq_len=96",
                   "trainer.micro_batch_size=13", "trainer.activation_checkpointing=true",
                   "launcher.nproc_per_node=2", "launcher.allocator=tcmalloc")
    plan = make_plan(cfg, CPU2)
    e = estimate(cfg, plan, CPU_HOST)
    bd = param_breakdown(cfg.model, adapter=cfg.adapter)
    norm = embedding_norm_block(cfg, plan, bd)
    assert round(norm / MIB) == 294 and embedding_norm_block(cfg, plan, bd, rank=1) == 0
    assert _heap(e) == _activation_peak(e.phases) + 2 * norm
    # rank 1 takes no norm: the gate's figure is rank 0's, the other ranks' is lower (580 MiB: 2,393 against 2,946)
    assert e.others_peak_bytes <= e.per_rank_peak_bytes - norm
    # On one rank the 475 MiB states cannot take its span: once (held-out set 1795896679, micro 3 x 352, grew by
    # 368 MiB after its first step: 3,861 MiB against 3,491 estimated)
    cfg = composed("+model=gpt2", "zero=stage2", "offload=cpu", "precision=bf16", "data.seq_len=352",
                   "trainer.micro_batch_size=3", "trainer.activation_checkpointing=true", "launcher.allocator=tcmalloc")
    plan = make_plan(cfg, CPU1)
    e = estimate(cfg, plan, CPU_HOST)
    assert spans_taken([norm], lazy_state_blocks(cfg, plan, e.params)) == []
    assert _heap(e) == _activation_peak(e.phases) + norm
    # without offload there is no fp64 copy to take the norm of
    cfg = composed("+model=gpt2", "zero=stage2", "precision=bf16", "launcher.allocator=tcmalloc")
    assert embedding_norm_block(cfg, make_plan(cfg, CPU2), param_breakdown(cfg.model, adapter=cfg.adapter)) == 0


@pytest.mark.heavy
def test_the_norm_stacks_on_the_activations_peak_unless_a_freed_span_holds_it():
    # Logged (bigalloc), MiniLM, ZeRO-1, CPU offload, fp32, micro 3 x 240, one rank: at the end of each of the first
    # two backwards the 89.4 MiB fp64 norm grew the heap with 227-237 MiB free in smaller spans (and Adam's 86.6 MiB
    # states took the first one's span); the rank peaked at 1,531 MiB in 9 of 11 runs against 1,340 estimated.
    base = ("+model=minilm", "zero=stage1", "offload=cpu", "launcher.allocator=tcmalloc")
    cfg = composed(*base, "precision=fp32", "data.seq_len=240", "trainer.micro_batch_size=3")
    plan = make_plan(cfg, CPU1)
    e = estimate(cfg, plan, CPU_HOST)
    norm = embedding_norm_block(cfg, plan, param_breakdown(cfg.model, adapter=cfg.adapter))
    assert round(norm / MIB, 1) == 89.4 and norm > norm_span_freed(cfg, plan, _act(cfg, plan))
    assert _heap(e) == _activation_peak(e.phases) + 2 * norm
    # bf16, micro 11 x 336, checkpointing, 2 ranks: the 86.6 MiB norm fit in the span of a freed 56.8 MiB score
    # block and its probabilities, and the heap never grew for it
    cfg = composed(*base, "precision=bf16", "data.seq_len=336", "trainer.micro_batch_size=11",
                   "trainer.activation_checkpointing=true", "launcher.nproc_per_node=2")
    plan = make_plan(cfg, CPU2)
    bd = param_breakdown(cfg.model, adapter=cfg.adapter)
    assert round(embedding_norm_block(cfg, plan, bd) / MIB, 1) == 86.6  # rank 0's 11.36 M-element partition of it
    assert norm_span_freed(cfg, plan, _act(cfg, plan)) >= embedding_norm_block(cfg, plan, bd)


@given(ranks=st.integers(1, 16), word=st.integers(1, 10**8), rest=st.integers(0, 10**8),
       stage=st.sampled_from([1, 2, 3]))
def test_the_ranks_norm_slices_cover_the_embedding_once(ranks, word, rest, stage):
    # ZeRO-1/2: each rank takes the norm of the slice of the word embedding its partition holds (it is flattened
    # first); ZeRO-3: of its own partition of every parameter
    cfg = SimpleNamespace(zero=SimpleNamespace(stage=stage))
    plan = SimpleNamespace(offload_optimizer=True, data_parallel_size=ranks)
    bd = SimpleNamespace(word_embedding=word, trainable=word + rest)
    slices = [embedding_norm_block(cfg, plan, bd, rank=r) for r in range(ranks)]
    if stage == 3:
        assert len(set(slices)) == 1 and slices[0] == -(-word // ranks) * 8
    else:
        assert sum(slices) == word * 8 and slices[0] == max(slices)
        assert all(s <= -(-(word + rest) // ranks) * 8 for s in slices)


@pytest.mark.heavy
def test_zero3s_step_norm_grows_the_heap_twice_where_the_momentum_takes_its_span():
    # Held out (session 64, seed 1796683855): tiny BERT, ZeRO-3, bf16, SGD, micro 10 x 240, one rank, 675.5 MiB
    # measured, 620.9 estimated (-8.1%). Logged (bigalloc): its 29.8 MiB fp64 norm of the word embedding's gradient
    # grew the heap at steps 1 and 2 with 64-76 MiB free in smaller spans; the 16.7 MiB momentum took its span.
    cfg, plan, e = term("+model=tiny-bert", "zero=stage3", "precision=bf16", "optimizer=sgd", "data.seq_len=240",
                        "trainer.micro_batch_size=10", "trainer.activation_checkpointing=false")
    norm = e.phases["gradient norm"][GRADIENT_NORM]
    assert round(norm / MIB, 1) == 29.8
    assert e.components[PAGE_HEAP_TERM] == pytest.approx(2 * norm, rel=0.01)


@pytest.mark.heavy
def test_zero12_step_blocks_grow_the_heap_on_top_of_the_startup_copies():
    # Sampled (-19.0% before): GPT-2 small ZeRO-1 bf16 SGD, one rank, micro 5 x 176. Start-up: the fp32 model as built
    # (475 MiB), its bf16 cast and DeepSpeed's flat bf16 copy (237 each), the fp32 master and a transient (475 each):
    # the heap reached 2,195 MiB; the first step's three 475 MiB blocks came on top of it (3,619 MiB).
    cfg, plan, e = term("+model=gpt2", "zero=stage1", "precision=bf16", "optimizer=sgd", "data.seq_len=176",
                        "trainer.micro_batch_size=5", "trainer.activation_checkpointing=true")
    assert round(startup_heap(cfg, plan, e.params, e.params, _largest(cfg, plan)) / MIB) == 1899
    heap = _heap(e)
    # measured 3,619 MiB of heap (tcmalloc's generic.heap_size, ~120 of it before the model: the process baseline);
    # the step-on-activations rule said 2,562 (the rank read -19.0%), this one 3,086 (-4.7%)
    assert 3_000 * MIB < heap < 3_500 * MIB


def test_the_step_blocks_no_freed_span_holds_grow_the_heap_one_by_one():
    # Held-out set 1795934798: MiniLM, ZeRO-1, fp32, AdamW8bit, micro 2 x 256, 2 ranks read -8.2/-11.9%. Logged
    # (bigalloc): bitsandbytes' step made five 43.3 MiB blocks of the rank's partition; the first took the 44.7 MiB
    # span of the word embeddings' gradient, the other four grew the heap. One block fitting meant all did before.
    cfg = composed("+model=minilm", "zero=stage1", "precision=fp32", "optimizer=adamw8bit", "data.seq_len=256",
                   "trainer.micro_batch_size=2", "launcher.nproc_per_node=2", "launcher.allocator=tcmalloc")
    plan = make_plan(cfg, CPU2)
    e = estimate(cfg, plan, CPU_HOST)
    part, largest = -(-e.params // 2), _largest(cfg, plan)
    block = step_block(cfg, plan, part, largest)
    blocks = step_blocks(cfg, plan, e.phases["optimizer step"]["optimizer-step transient"], block, largest)
    assert len(blocks) == 5 and round(block / MIB, 1) == 43.3
    # Two spans hold one: the word embeddings' gradient and the fp32 embedding ZeRO-1's flatten freed at start-up
    # (on that run the forward had cut the second: the rank held one block more than this, +1.4/-2.7%).
    spans = spans_at_step(cfg, plan, _act(cfg, plan), largest)
    assert sum(s >= block for s in spans) == 2
    assert _heap(e) >= _activation_peak(e.phases) + 3 * block
    # Under checkpointing each layer's recomputation takes again the span the one before freed: one span in all.
    cfg = composed("+model=minilm", "trainer.activation_checkpointing=true", "launcher.allocator=tcmalloc")
    plan = make_plan(cfg, CPU1)
    act = _act(cfg, plan)
    assert len(freed_layer_spans(cfg, plan, act)) == 1
    assert len(freed_layer_spans(cfg, plan, dataclasses.replace(act, checkpointing=False))) == cfg.model.num_layers


def test_the_unfused_optimizers_startup_step_leaves_the_steps_heap():
    # Held-out set 1795934798's worst under-estimate (-14.8%, -12.8%): GPT-2 small, ZeRO-0, bf16, AdamW8bit, micro
    # 13 x 112, 2 ranks (the fused loss). FP16_UnfusedOptimizer ran a step on zero gradients at start-up. Logged
    # (bigalloc): 2,265 MiB of heap above the process at "built", +237 MiB at the first all-reduce (1,028 MiB free
    # in smaller spans) and three 147 MiB step blocks: 2,944 MiB.
    cfg = composed("+model=gpt2", "zero=stage0", "precision=bf16", "optimizer=adamw8bit", "data.seq_len=112",
                   "trainer.micro_batch_size=13", "launcher.nproc_per_node=2", "launcher.allocator=tcmalloc")
    plan = make_plan(cfg, CPU2)
    assert unfused_startup_step(cfg, plan)
    e = estimate(cfg, plan, CPU_HOST)
    stepping = sum(e.phases["optimizer step"].values())
    assert round(_heap(e) / MIB) == round((stepping + e.phases["all-reduce"]["all-reduce flatten buffer"]) / MIB)
    assert 2_600 * MIB < _heap(e) < 3_000 * MIB  # was 2,414: the step's live bytes alone
    # With checkpointing the activations leave the buffer its span: micro 3 x 416, SGD, the heap grew 196 MiB
    # at the first step (the rank read -2.0% on the step's live bytes, +7.5% with the buffer on top).
    cfg = composed("+model=gpt2", "zero=stage0", "precision=bf16", "optimizer=sgd", "data.seq_len=416",
                   "trainer.micro_batch_size=3", "trainer.activation_checkpointing=true",
                   "launcher.nproc_per_node=2", "launcher.allocator=tcmalloc")
    e = estimate(cfg, make_plan(cfg, CPU2), CPU_HOST)
    assert _heap(e) == sum(e.phases["optimizer step"].values())
    # fp32 and a bf16 pipeline (BF16_Optimizer) run no such step
    for overrides in (("precision=fp32",), ("precision=bf16", "parallel=pipeline")):
        cfg = composed("+model=gpt2", "zero=stage0", "optimizer=adamw8bit", *overrides, "launcher.nproc_per_node=2")
        assert not unfused_startup_step(cfg, make_plan(cfg, CPU2))


@pytest.mark.heavy
def test_zero3_step_blocks_grow_the_heap_on_top_of_its_startup_copies():
    # Held-out set 1795870857's worst under-estimate (-16.6%, twice): GPT-2 small, ZeRO-3, bf16, SGD, checkpointing,
    # micro 1 x 128, one rank. Logged (bigalloc): start-up grew the heap by 1,822 MiB (the fp32 model and its cast,
    # the flat bf16 partition, the fp32 partition and initialize_optimizer_states' gradient buffer), then the
    # first step by a 295 MiB fp64 norm and three 475 MiB blocks (the fp32 gradient, the step's transient and
    # SGD's momentum, created there): 3,677 MiB of heap, ~137 of it before the model.
    cfg, plan, e = term("+model=gpt2", "zero=stage3", "precision=bf16", "optimizer=sgd", "data.seq_len=128",
                        "trainer.micro_batch_size=1", "trainer.activation_checkpointing=true")
    assert round(startup_heap(cfg, plan, e.params, e.params, _largest(cfg, plan)) / MIB) == 1899
    assert 3_400 * MIB < _heap(e) < 3_800 * MIB  # was 2,559: -16.6%; 3,617 with the step's fp64 norm counted
    # On two ranks (adamw8bit, micro 1 x 112) each rank's heap grew by 1,110 MiB at start-up: its 119 MiB flat bf16
    # partition took the span the cast freed of the 147 MiB fp32 word embedding; 2,671 MiB of heap in all.
    cfg, plan, e = term("+model=gpt2", "zero=stage3", "precision=bf16", "optimizer=adamw8bit", "data.seq_len=112",
                        "trainer.micro_batch_size=1", "launcher.nproc_per_node=2", world=CPU2)
    part = -(-e.params // 2)
    assert round(startup_heap(cfg, plan, e.params, part, _largest(cfg, plan)) / MIB) == 1187  # 1,305 with the copy
    assert 2_400 * MIB < _heap(e) < 2_700 * MIB


def test_a_traced_layers_largest_block_is_a_freed_span_and_widens_the_placement():
    # Held-out set 1795915053: a LoRA DeBERTa-v2 whose c2p/p2c gathers make 24.75 MiB fp32 scratch blocks in CPU's
    # kernel (arch/traced.py) read 618.7 MiB through a bound of 616, which took a 3.1 MiB MLP block as the largest.
    import dataclasses

    cfg, plan, e = term("+model=minilm", "zero=stage1", "precision=bf16", "data.seq_len=128",
                        "trainer.micro_batch_size=2")
    act = _act(cfg, plan)
    big = 8 * largest_freed_block(cfg, plan, act, _largest(cfg, plan))
    traced = dataclasses.replace(act, layer_block=big)
    assert layer_blocks(cfg, plan, traced)[0] == big > layer_blocks(cfg, plan, act)[0]
    assert largest_freed_block(cfg, plan, traced, _largest(cfg, plan)) == big
    assert placement_bytes(cfg, plan, traced, e.phases, e.params, _largest(cfg, plan)) >= 2 * big


@pytest.mark.heavy
def test_a_pipeline_stage_of_the_embeddings_alone_frees_no_layer_blocks():
    # Held-out set 1795790665: MiniLM, 2-stage pipeline, ZeRO-1 fp32, micro 7 x 384. Stage 0 holds the embeddings
    # alone (a 45 MiB partition), yet the term took MiniLM's 47 MB attention-score block as freed there and counted
    # no heap: the rank read -16.8%, through its bound (911 MiB measured, bound 894). Sampled: tcmalloc's heap grew
    # by 45 MiB blocks at start-up and at the first step (Adam's two states, the step's transient) on top.
    cfg, plan, e = term("+model=minilm", "zero=stage1", "precision=fp32", "data.seq_len=384",
                        "trainer.micro_batch_size=7", "parallel=pipeline", "parallel.micro_batches=4",
                        "launcher.nproc_per_node=2", world=CPU2)
    stage0 = e.stages[0]
    assert stage0["blocks"] == 0
    part = stage0["model_state_bytes"]  # params + grads + master + Adam's two states, all one 45 MiB partition
    assert lazy_state_blocks(cfg, plan, 10**7) == [4 * 10**7] * 2  # the pipeline's ZeRO-1 creates them lazily too
    assert stage0["components"][PAGE_HEAP_TERM] > 0.25 * part
    # a bf16 pipeline at ZeRO-0 steps a flat partition with BF16_Optimizer, whose states are lazy as well
    assert lazy_state_blocks(*_planned("+model=tiny-gpt2", "parallel=pipeline", "precision=bf16"), 10**7) != []


@pytest.mark.heavy
def test_the_bound_leaves_room_for_two_misplaced_large_blocks():
    # GPT-2 small, ZeRO-1, bf16, SGD, checkpointing, micro 14 x 240 on one rank: 4,909 and 4,851 MiB in two runs at
    # tcmalloc's default release rate, 5,475 with the heap sampler's thread beside it (one more 644 MiB fp32 logits
    # block). The largest block of its step is that logits block (its flat fp32 partition is 475 MiB).
    overrides = ("+model=gpt2", "zero=stage1", "precision=bf16", "optimizer=sgd", "data.seq_len=240",
                 "trainer.micro_batch_size=14", "trainer.activation_checkpointing=true")
    cfg, plan, e = term(*overrides)
    block = e.phases["loss"]["logits + loss"] // 3
    assert round(block / MIB) == 644
    assert e.bound_widths["misplaced large blocks (tcmalloc)"] == 2 * block
    assert placement_bytes(cfg, plan, _act(cfg, plan), e.phases, e.params, 0) == 2 * block  # a width, not a term
    # a step whose flat fp32 partition is the largest block: one rank holds the whole 124 M parameters (475 MiB)
    small = term("+model=gpt2", "zero=stage1", "optimizer=sgd", "data.seq_len=64", "trainer.micro_batch_size=1")[2]
    assert round(small.bound_widths["misplaced large blocks (tcmalloc)"] / MIB) == round(2 * 474.7)
    glibc = estimate(*_planned(*overrides, "launcher.allocator=glibc"), CPU_HOST)
    assert not any("misplaced" in k for k in glibc.bound_widths)


def test_glibc_has_no_page_heap_term():
    e = estimate(*_planned("+model=gpt2", "zero=stage2", "launcher.allocator=glibc"), CPU_HOST)
    assert PAGE_HEAP_TERM not in e.components


# Shapes vary widely; the term stays within what its two rules can add.
@pytest.mark.heavy
@settings(max_examples=20, deadline=None, derandomize=True)
@given(model=st.sampled_from(["tiny-gpt2", "tiny-bert", "tiny-llama"]), stage=st.integers(0, 3),
       dtype=st.sampled_from(["fp32", "bf16"]), micro=st.integers(1, 16), seq=st.sampled_from([32, 128, 256]),
       ckpt=st.booleans(), optimizer=st.sampled_from(["adamw", "sgd", "adamw8bit"]))
def test_the_term_is_bounded_by_the_blocks_it_names(model, stage, dtype, micro, seq, ckpt, optimizer):
    cfg, plan, e = term(f"+model={model}", f"zero=stage{stage}", f"precision={dtype}", f"data.seq_len={seq}",
                        f"trainer.micro_batch_size={micro}", f"trainer.activation_checkpointing={str(ckpt).lower()}",
                        f"optimizer={optimizer}")
    ph = e.phases
    # (ZeRO-1/2's fp64 norm block comes first and may grow the heap by its own size: page_heap.grown_at_step)
    step = max(ph.get("optimizer step", {}).get("optimizer-step transient", 0)
               + ph.get("gradient norm", {}).get(GRADIENT_NORM, 0),
               ph.get("all-reduce", {}).get("all-reduce flatten buffer", 0))
    logits_block = ph.get("loss", {}).get("logits + loss", 0) // 3
    lazy = lazy_state_blocks(cfg, plan, e.params)
    taken = logits_spans_taken(logits_block, lazy)
    assert taken <= 2 and (taken == 0 or stage >= 1)
    alloc_peak = _alloc_peak(ph)
    after_startup = startup_heap(cfg, plan, e.params, e.params, 0) + step + sum(lazy) - alloc_peak if lazy else 0
    assert 0 <= e.components[PAGE_HEAP_TERM] <= max(step, max(1, taken) * logits_block, after_startup)


def _alloc_peak(phases):
    """The largest phase's live bytes (the export's gather is not training's)."""
    return max(sum(v.values()) for k, v in phases.items() if k != "export")


def _activation_peak(phases):
    """The live bytes of the largest activation phase (the loss, backward, the embedding's gradient)."""
    return max(sum(phases[p].values()) for p in ACTIVATION_PHASES if p in phases)


def _heap(e):
    """The heap the estimate says a rank holds: its largest phase's live bytes and the page-heap term."""
    return _alloc_peak(e.phases) + e.components[PAGE_HEAP_TERM]


def _planned(*overrides):
    cfg = composed(*overrides, "trainer.fused_loss=false")
    return cfg, make_plan(cfg, CPU1)


def _largest(cfg, plan):
    from zerorun.memory.params import param_breakdown

    return param_breakdown(cfg.model, plan.task).largest_trainable


def _act(cfg, plan):
    from zerorun.memory import activations

    return activations(cfg.model, cfg.trainer.micro_batch_size, plan.seq_len, cfg.precision.dtype, "cpu",
                       cfg.trainer.activation_checkpointing, task=plan.task)
