"""What a preloaded allocator (tcmalloc: the default on CPU ranks; jemalloc, mimalloc) keeps resident beyond the
bytes it holds at the peak (docs/memory.md §5.4).

Such an allocator keeps freed spans for reuse instead of returning them, and a block that finds no free span large
enough grows the heap. tcmalloc's own counters, sampled inside a rank (benchmarks/heap_sampler/), showed the two
moments that happens in a steady training step:

- the optimizer step's flat blocks (ZeRO's fp32 gradient partition, the optimizer's partition-sized temporaries,
  ZeRO-0's all-reduce buffer) are allocated right after backward freed the activations, whose spans are too small
  for them: GPT-2 small's heap grew by 2 × 475 MiB there while 1.2 GiB of it was free. So the heap holds the
  activation phases' peak and the step's flat blocks at once, but for those a freed span holds, placed best fit
  one by one: a layer's (MiniLM's attention scores hold its 45 MiB partition; without checkpointing one layer's
  saved tensors freed together, ``layer_span``: MiniLM at micro 6 x 272 read +28.9% before, -2.6% with it; under
  checkpointing one span, each layer's recomputation taking again what the last freed), a logits block's, the
  largest gradient's or the largest parameter's as built (MiniLM ZeRO-1 AdamW8bit: five 43 MiB blocks, one span);
- at the loss, the fp32 logits blocks (three of b·s·V) outgrow what the 16-bit logits freed: one more of them;
  and more where the optimizer took their spans: ZeRO-1/2/3 create the optimizer's states of the flat partition at
  the first step, after the first loss freed its logits blocks, and a state block no larger than one of them is
  placed in its span (best fit). The next loss finds that many fewer and grows the heap by one block for each
  (GPT-2 small, ZeRO-1 with offload, bf16, micro 6 × seq 304 on 2 ranks: Adam's two 237 MiB states took two of
  the 350 MiB spans, and the heap grew by 2 × 350 MiB at step 2: the rank read 10% over the one-block rule);
- under ZeRO the start-up's copies (the fp32 model as built, its 16-bit cast, DeepSpeed's flat 16-bit copy of
  what trains, the fp32 master and a transient of its size) take the heap higher than training's live bytes, and
  the forward splits their freed spans into activation-sized pieces: the first step's blocks larger than any freed
  block (the flat transient, the lazily created states) grow the heap on top of it (GPT-2 small ZeRO-1 bf16 SGD,
  one rank, micro 5 × 176: start-up 2,195 MiB with 1,342 live, then 3 × 475 MiB at the step; −19.0% before);
- at ZeRO-0 in 16-bit a client optimizer's wrapper (FP16_UnfusedOptimizer) runs a whole step at start-up: the heap
  holds the step's live bytes from there, and where the forward's activations and the 16-bit gradients leave none
  of the spans that step freed whole, the all-reduce buffer grows it (GPT-2 small, bf16, AdamW8bit, micro 13 × 112:
  +237 MiB with 1,028 free; −14.8% before);
- after training, a pipeline's export: its whole-stage pickles land on the heap training left, and each that no
  span still free holds grows it (GPT-2 small, 2 stages, fp32: one 309.5 MiB pickle per rank; −13.6% before).

Candidate rules were scored against 124 measured tcmalloc ranks (benchmarks/heap_sampler/page_heap_model.py);
this one replaced 15% of the peak: on those rows median |error| 4.0 → 2.6%, largest under-estimate 14.7 → 11.3%;
held out (seed 1795776381, 39 ranks) 2.3%, largest under 9.9%, the bound above all (docs/memory.md §5.4).
"""
from __future__ import annotations

from typing import List, Mapping, Sequence, Tuple

from ..config import Dtype, OptimizerImpl, Plan, RunConfig
from .activations import DTYPE_BYTES, LOSS_BYTES_PER_LOGIT, Activations
from .phases import GRADIENT_NORM
from .states import (DS_SUB_GROUP_SIZE, bf16_optimizer_pipeline, optimizer_state_bytes, optimizer_step_bytes,
                     optimizer_swapped, unfused_startup_step)

ACTIVATION_PHASES = ("loss", "backward", "embedding grad")
STEP_TRANSIENT = ("optimizer step", "optimizer-step transient")  # (phase, item): phases.py's step_phases names
ALL_REDUCE_BUFFER = ("all-reduce", "all-reduce flatten buffer")
NORM_BLOCK = ("gradient norm", GRADIENT_NORM)
GRADIENTS = "gradients"


def phase_item(phases: Mapping[str, Mapping[str, int]], where) -> int:
    """The bytes of one (phase, item) of the estimate's phases, 0 where the run has none."""
    return phases.get(where[0], {}).get(where[1], 0)


def fp32_logits_block(act: Activations) -> int:
    """One fp32 b·s·V block of the loss (LOSS_BYTES_PER_LOGIT counts three of them per logit); with the fused loss,
    its largest block (``Activations.loss_block``)."""
    return act.loss_block or act.logits_loss * 4 // LOSS_BYTES_PER_LOGIT


def largest_freed_block(cfg: RunConfig, plan: Plan, act: Activations, largest_trainable: int) -> int:
    """The largest single block the forward and backward free before the step: an fp32 b·s·V logits block, an
    MLP-wide activation, (attention on CPU's math path) an fp32 a·s² score block, or the gradient of the largest
    parameter, which ZeRO frees once it is in a bucket or the partition (MiniLM's word embeddings' 47 MB hold its
    45 MB partition on 2 ranks)."""
    mlp, scores = layer_blocks(cfg, plan, act)
    return max(fp32_logits_block(act), mlp, scores, largest_trainable * DTYPE_BYTES[Dtype(cfg.precision.dtype)])


def layer_blocks(cfg: RunConfig, plan: Plan, act: Activations) -> Tuple[int, int]:
    """(one MLP-wide activation, or a traced layer's largest block (``Activations.layer_block``: DeBERTa's fp32
    gather copies); one fp32 a·s² score block where attention materialises them (CPU's math path)): the largest
    blocks a layer frees; none in a pipeline stage of the embeddings alone."""
    m, b, s = cfg.model, cfg.trainer.micro_batch_size, plan.seq_len
    if act.num_layers == 0:
        return 0, 0
    mlp = max(b * s * m.intermediate_size * DTYPE_BYTES[Dtype(cfg.precision.dtype)], act.layer_block)
    return mlp, b * m.num_heads * s * s * 4 if act.kernel in ("sdpa-math", "eager") else 0


def norm_span_freed(cfg: RunConfig, plan: Plan, act: Activations) -> int:
    """The largest span free when the embedding gradient's norm is allocated, at the end of backward: an fp32
    logits block, an MLP-wide activation, one layer's saved tensors freed together (``layer_span``), or, where
    attention materialises them, a score block and its probabilities, allocated and freed side by side. Not the
    gradient of the largest parameter (``largest_freed_block``): the embedding's is freed after its norm."""
    return max(fp32_logits_block(act), layer_span_freed(cfg, plan, act))


def layer_span_freed(cfg: RunConfig, plan: Plan, act: Activations) -> int:
    """The largest span one layer's blocks leave free: an MLP-wide activation, its saved tensors freed together
    (``layer_span``), or a score block beside its probabilities, allocated and freed side by side."""
    mlp, scores = layer_blocks(cfg, plan, act)
    return max(mlp, 2 * scores, layer_span(act))


def freed_layer_spans(cfg: RunConfig, plan: Plan, act: Activations) -> List[int]:
    """The spans the layers' blocks leave free after backward: one per layer (``layer_span_freed``), each layer's
    forward having allocated its own; under checkpointing one, each layer's recomputation taking again the span
    the one before freed."""
    return [layer_span_freed(cfg, plan, act)] * (min(1, act.num_layers) if act.checkpointing else act.num_layers)


def layer_span(act: Activations) -> int:
    """The free span one layer's backward leaves: the tensors its forward saved were allocated one after another
    and are freed together, and at release rate 0 tcmalloc coalesces neighbouring free spans
    (allocators.TCMALLOC_ENV); the gradients the backward allocates meanwhile keep one layer's span from the next
    one's. None under checkpointing: each layer's recomputation allocates its tensors during the backward, among
    the gradients, and the next layer's recomputation takes them again (counting it let GPT-2 ranks to -18%)."""
    return act.per_layer if act.num_layers > 0 and not act.checkpointing else 0


def step_block(cfg: RunConfig, plan: Plan, partition: int, largest_trainable: int) -> int:
    """The size of one flat block of the optimizer step: this rank's fp32 partition (a ZeRO-3 sub-group), or under
    ZeRO-0 one tensor's fp32 gradient (BF16_Optimizer's pipeline path flattens the whole partition)."""
    if cfg.zero.stage >= 1 or bf16_optimizer_pipeline(cfg, plan):
        return 4 * min(partition, DS_SUB_GROUP_SIZE)
    return 4 * largest_trainable


def spans_at_step(cfg: RunConfig, plan: Plan, act: Activations, largest_trainable: int) -> List[int]:
    """The spans free when the optimizer step allocates its blocks, after backward: the loss's fp32 logits blocks,
    the layers' (``freed_layer_spans``), the largest parameter's gradient (ZeRO frees it once in a bucket or the
    partition) and, but at ZeRO-0 in fp32, the largest parameter as built in fp32, which start-up freed (ZeRO
    flattens or partitions the parameters, a 16-bit run casts them)."""
    built = 4 * largest_trainable if cfg.zero.stage >= 1 or Dtype(cfg.precision.dtype) != Dtype.fp32 else 0
    return [*[fp32_logits_block(act)] * act.loss_spans, *freed_layer_spans(cfg, plan, act),
            largest_trainable * DTYPE_BYTES[Dtype(cfg.precision.dtype)], built]


def step_blocks(cfg: RunConfig, plan: Plan, step: int, one_step: int, largest_trainable: int) -> List[int]:
    """The optimizer step's large blocks, each ``one_step`` bytes (``step_block``): under ZeRO (and BF16_Optimizer)
    its transient is flat blocks of the partition; at ZeRO-0 the optimizer's temporaries over the largest tensor,
    and in 16-bit that tensor's fp32 gradient (FP16_UnfusedOptimizer makes one per tensor; logged, GPT-2 small with
    AdamW8bit: six 147 MiB blocks, its word embedding's gradient and bitsandbytes' five)."""
    if not step or not one_step:
        return []
    if cfg.zero.stage >= 1 or bf16_optimizer_pipeline(cfg, plan):
        n = step // one_step
        if not n:
            return [step]
        rest = step - n * one_step  # the 16-bit partition's copy a 16-bit step upcasts
        return [one_step] * n + ([rest] if rest else [])
    n = optimizer_step_bytes(plan, largest_trainable) // one_step + (1 if unfused_startup_step(cfg, plan) else 0)
    return [one_step] * n


def grown_at_step(spans: List[int], norm: int, blocks: Sequence[int], states: Sequence[int] = ()) -> int:
    """What the optimizer step grows the heap by, its blocks placed in turn in the ``spans`` backward left: first
    ``norm``, the fp64 copy of the largest gradient slice (ZeRO-1/2) or partition (ZeRO-3) it takes the norm of
    (one at a time, freed before the rest), then the step's blocks (alive together, ``best_fit``). A block no free
    span holds grows the heap at its top, and once freed that top span holds the next (tcmalloc merges new pages
    with the free span beside them). Logged (bigalloc), MiniLM, ZeRO-2, fp32, SGD, checkpointing, 2 ranks: rank 0's
    86.6 MiB norm block grew the heap at every step (131 MiB free in smaller spans), then its span held the step's
    blocks. ``states``: the optimizer's states the first step creates (``lazy_state_blocks``), placed in what the
    step's blocks left; where one takes the norm's span the next step's norm grows the heap once more. Logged, tiny
    BERT, ZeRO-3, bf16, SGD, one rank: its 29.8 MiB norm grew the heap at steps 1 and 2, the 16.7 MiB momentum
    having taken the top span (the layers' 25.5 MiB spans held the step's two 16.7 MiB blocks)."""
    top = norm if norm > max(spans, default=0) else 0
    left, _, unplaced = place([*spans, top], blocks)
    again = top if top and len(spans) in place(left, states)[1] else 0
    return top + unplaced + again


def lazy_state_blocks(cfg: RunConfig, plan: Plan, partition: int) -> List[int]:
    """The flat blocks ZeRO's optimizer creates at its first step: its states of this rank's partition (neither
    stage_1_and_2.py's nor stage3.py's ``initialize_optimizer_states`` runs a step in DeepSpeed 0.19, and Adam, SGD
    and AdamW8bit create their states lazily), in a pipeline too, as does the BF16_Optimizer of a bf16 pipeline at
    ZeRO-0 (bf16_optimizer.py). Not where ZeRO-3 swaps them to NVMe: they pass through the swapper's buffers."""
    if (cfg.zero.stage == 0 and not bf16_optimizer_pipeline(cfg, plan)) or optimizer_swapped(cfg, plan):
        return []
    total = optimizer_state_bytes(cfg, plan, partition)  # SGD: one momentum buffer (or none); the others: two
    n = 1 if plan.optimizer == OptimizerImpl.torch_sgd else 2
    return [total // n] * n if total else []


def best_fit(spans: List[int], blocks: Sequence[int]) -> Tuple[List[int], int]:
    """Each block placed best fit in turn among the freed ``spans`` (what is left of a span stays free for the
    next): the indices of the spans a block took first, and the bytes no span held (what grows the heap)."""
    return place(spans, blocks)[1:]


def place(spans: List[int], blocks: Sequence[int]) -> Tuple[List[int], List[int], int]:
    """``best_fit``, with what is left of each span first."""
    left, taken, unplaced = list(spans), [], 0
    for b in blocks:
        if b <= 0:
            continue
        fits = [i for i, s in enumerate(left) if s >= b]
        if not fits:
            unplaced += b
            continue
        best = min(fits, key=lambda i: left[i])
        if left[best] == spans[best]:
            taken.append(best)
        left[best] -= b
    return left, taken, unplaced


def spans_taken(spans: List[int], state_blocks: List[int]) -> List[int]:
    """Which freed spans (their indices in ``spans``) the state blocks take, each placed best fit as it is
    created."""
    return best_fit(spans, state_blocks)[0]


def logits_spans_taken(block: int, state_blocks: List[int], count: int = 3) -> int:
    """How many of the loss's ``count`` freed fp32 logits spans of ``block`` bytes the state blocks take."""
    return len(spans_taken([block] * count, state_blocks))


def page_heap_bytes(cfg: RunConfig, plan: Plan, act: Activations, phases: Mapping[str, Mapping[str, int]],
                    alloc_peak: int, partition: int, largest_trainable: int, built_params: int,
                    norm_block: int = 0, export_blocks: Sequence[int] = ()) -> int:
    """Resident bytes beyond ``alloc_peak`` (the largest phase's live bytes): the heap that holds the activation
    phases' peak and, where no freed block can hold them, the step's flat blocks; or the loss phase and one more
    fp32 logits block for each logits span the optimizer's states took (at least one); or the activations' peak and
    ``norm_block`` (the fp64 copy the embedding gradient's norm is taken of on this rank,
    buffers.embedding_norm_block), twice where a state took its span, where no span the activations freed holds it;
    or, at ZeRO-1/2/3, the start-up's heap (``built_params``: the model build_model() makes first) under the
    step's; or, where FP16_UnfusedOptimizer steps at start-up, that step's heap (``unfused_startup_heap``). After
    training, the export (``export_blocks``: its whole-stage pickles) lands on the heap
    training left: a block no freed span holds grows it.
    """
    live = {name: sum(items.values()) for name, items in phases.items() if name != "export"}
    activation_peak = max((live[p] for p in ACTIVATION_PHASES if p in live), default=0)
    freed = max(largest_freed_block(cfg, plan, act, largest_trainable), layer_span(act))
    step, all_reduce = phase_item(phases, STEP_TRANSIENT), phase_item(phases, ALL_REDUCE_BUFFER)
    # The step's blocks, placed best fit in the spans backward left: those none holds grow the heap above the
    # activations' peak. Logged (bigalloc), MiniLM, ZeRO-1, fp32, AdamW8bit, micro 2 x 256, 2 ranks: the step's five
    # 43.3 MiB blocks found one 44.7 MiB span and grew the heap by the other four (-11.9% before, when one block
    # that fits the largest span meant all of them did).
    one_step = step_block(cfg, plan, partition, largest_trainable)
    # ZeRO-1/2's fp64 norm block comes first, placed like the step's blocks. The spans are each layer's, where
    # without checkpointing neighbouring layers' may coalesce further: GPT-2 small, ZeRO-1, one rank, micro 15 x 128,
    # logged its 294.5 MiB norm block fitting with 1,829 MiB free (this reads +6% more there); MiniLM, ZeRO-1, fp32,
    # micro 7 x 64 on 2 ranks, held out, read -18.7% without it (rank 0's 86.6 MiB norm, 96 MiB of activations).
    lazy = lazy_state_blocks(cfg, plan, partition)
    flat = max(grown_at_step(spans_at_step(cfg, plan, act, largest_trainable), phase_item(phases, NORM_BLOCK),
                             step_blocks(cfg, plan, step, one_step, largest_trainable), lazy),
               all_reduce if all_reduce > freed else 0)
    logits_block = fp32_logits_block(act)
    # The states are created at the first step, after the loss and the embedding's norm freed their blocks; the
    # next step finds those spans taken and grows the heap by each block again. The norm is allocated at the end
    # of backward, before anything the step frees: where no span the activations freed holds it, it grows the heap
    # above the activations' peak, and again at the next step where a state took its span. Logged (bigalloc), on
    # the rank that holds the word embedding: GPT-2 small, ZeRO-2, CPU offload, bf16, 2 ranks: one 237 MiB Adam
    # state took the 295 MiB fp64 norm's span and the heap grew by 295 MiB at step 2 (its twin grew by nothing);
    # MiniLM, ZeRO-1, CPU offload, micro 3 x 240 (fp32 and bf16, 1 and 2 ranks) and 14 x 256 (checkpointing): the
    # 87-89 MiB norm grew the heap at steps 1 and 2 with 200-330 MiB free in smaller spans, and at 11 x 336 it fit in
    # the span of two freed 57 MiB score blocks, never growing it.
    norm_block = norm_block if norm_block > norm_span_freed(cfg, plan, act) else 0
    spans = [logits_block] * act.loss_spans + [norm_block]
    taken = spans_taken(spans, lazy)
    grown = max(1, sum(i < act.loss_spans for i in taken))
    at_loss = live.get("loss", 0) + grown * logits_block if logits_block else 0
    at_norm = activation_peak + norm_block * (2 if act.loss_spans in taken else 1) if norm_block else 0
    after_startup = 0
    if lazy:  # ZeRO: the step's blocks larger than any freed one on top of the start-up's heap
        startup = startup_heap(cfg, plan, built_params, partition, largest_trainable)
        after_startup = startup + flat + sum(b for b in lazy if b > freed)
    if unfused_startup_step(cfg, plan):
        after_startup = unfused_startup_heap(phases, live, all_reduce)
    held = max(max(live.values(), default=0), activation_peak + flat, at_loss, at_norm, after_startup)
    # The export's pickles, after training: the spans still free then are the step's flat blocks (as many as its
    # transient holds), the largest gradient's, the loss's and each layer's largest (``layer_span_freed``, per layer).
    # Sampled (GPT-2 small, 2 stages, fp32): each rank's heap grew by one 309.5 MiB pickle, the other took the
    # 312.5 MiB span of the all-reduce buffer; rank 0 then held 39 MiB beyond its live bytes. MiniLM's 41 MiB
    # pickles (2 stages, micro 8 x 288) grew nothing: each layer freed a 32 MiB score block beside its probabilities.
    spans = [all_reduce, *[one_step] * max(1, step // max(1, one_step)), 4 * largest_trainable,
             *[logits_block] * act.loss_spans, *freed_layer_spans(cfg, plan, act)]
    exported = held + best_fit(spans, export_blocks)[1] if "export" in phases else 0
    return max(0, held - alloc_peak, exported - alloc_peak)


def unfused_startup_heap(phases: Mapping[str, Mapping[str, int]], live: Mapping[str, int], all_reduce: int) -> int:
    """The heap FP16_UnfusedOptimizer's start-up step leaves (states.unfused_startup_step), and the all-reduce
    buffer on top where the training step's blocks leave it no span. That step held what a training step holds
    (the 16-bit and fp32 gradients, the states, the step's temporaries) with no activation, so the heap is the
    step's live bytes, and what it frees (the gradients and the temporaries) is what training's blocks land in.
    The forward's activations, the backward's 16-bit gradients among them and then the all-reduce buffer need
    that room at once; where they need more, no freed span is left whole for the buffer and it grows the heap.
    Logged (bigalloc), GPT-2 small, bf16, AdamW8bit, micro 13 x 112, 2 ranks: 2,265 MiB at start-up (the step's
    live bytes: 2,414), then +237 MiB at the first all-reduce with 1,028 MiB free in smaller spans (activations
    1,032 MiB, gradients 237, buffer 237 against 1,447 freed); with checkpointing (micro 3 x 416, SGD, activations
    247 MiB) the buffer found its span (the heap grew 196 MiB at the first step, the rank read -2.0% without it)."""
    stepping, grads = live.get(STEP_TRANSIENT[0], 0), phase_item(phases, (STEP_TRANSIENT[0], GRADIENTS))
    static = stepping - phase_item(phases, STEP_TRANSIENT) - grads  # what training holds throughout
    activations = max((live[p] - static - phase_item(phases, (p, GRADIENTS)) for p in ACTIVATION_PHASES if p in live),
                      default=0)
    return stepping + (all_reduce if activations + grads + all_reduce > stepping - static else 0)


def placement_bytes(cfg: RunConfig, plan: Plan, act: Activations, phases: Mapping[str, Mapping[str, int]],
                    partition: int, largest_trainable: int) -> int:
    """What the page heap may hold beyond ``page_heap_bytes`` for where blocks land (a width of the bound, not of
    the point): two of a step's largest blocks (the step's flat block, ZeRO-0's all-reduce buffer, or the largest
    block forward and backward free). At release rate 0 (allocators.TCMALLOC_ENV) free spans coalesce, and what a
    rank holds beyond the term is large blocks whose spans smaller blocks cut first, in an order other threads
    decide: MiniLM, ZeRO-3, CPU offload, bf16, micro 15 x 512 on 2 ranks held one 180 MiB score block more on one
    rank than on the other (1,688 and 1,626 MiB; 1,782 in another run); MiniLM, ZeRO-1, CPU offload, fp32, micro
    3 x 240 on one rank grew by a 45 and an 89 MiB block at its second step (its flat partition is 87 MiB), and
    GPT-2 small at ZeRO-2 by its flat gradient block and a step block (2 x 475 MiB)."""
    stepping = STEP_TRANSIENT[0] in phases
    return 2 * max(step_block(cfg, plan, partition, largest_trainable) if stepping else 0,
                   phase_item(phases, ALL_REDUCE_BUFFER), largest_freed_block(cfg, plan, act, largest_trainable))


def startup_heap(cfg: RunConfig, plan: Plan, built_params: int, partition: int, largest_trainable: int) -> int:
    """The heap ZeRO's start-up leaves: the fp32 model as built, its 16-bit cast (engine.py), the flat copy of
    the 16-bit parameters that train and this rank's fp32 master with a transient of its size (stage_1_and_2.py
    ``flatten``, ``clone().to(fp32)``; stage3.py's flat 16-bit partition, fp32 partition and the gradient buffer
    of ``initialize_optimizer_states``), all alive or freed into spans the forward splits. Logged (bigalloc), GPT-2
    small, ZeRO-3, bf16: the heap grew by 1,822 MiB at start-up on one rank (this says 1,899) and by 1,110 on each
    of two, whose 119 MiB flat partition took the span the cast freed of the 147 MiB fp32 word embedding (1,187)."""
    built = 4 * built_params
    e = DTYPE_BYTES[Dtype(cfg.precision.dtype)]
    cast = built * e // 4 if e < 4 else 0
    # ZeRO-1/2 flatten every 16-bit parameter that trains before partitioning; ZeRO-3 only its own partition
    flat16 = partition * (1 if cfg.zero.stage == 3 else max(1, plan.data_parallel_size)) * e
    fits = cast > 0 and flat16 <= 4 * largest_trainable  # in the span of the largest fp32 parameter the cast freed
    return built + cast + (0 if fits else flat16) + 2 * 4 * partition
