"""§6 Pipeline stages: which layers each stage holds, its 1F1B depth, and the pipeline engine's buffers.

docs/memory.md §6. ``parallel=pipeline`` cuts zerorun.pipeline's layer list the way DeepSpeed's
PipelineModule does (its partitioners, reimplemented here and tested against DeepSpeed's); each
stage is then estimated as a rank of its own (estimate.py), and the gate judges the worst one.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from ..arch.pipe_layout import FIRST_LAYERS, TIED_HEADS
from ..config import Dtype, Partition, Plan, RunConfig
from .activations import DTYPE_BYTES, LOSS_BYTES_PER_LOGIT, Activations
from .params import ParamBreakdown, param_breakdown


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
        """A tied embedding and LM head (GPT-2's, a tied Llama-class decoder's) on this one stage: one tensor,
        built once."""
        return any({word, head} <= set(self.layers) for head, word in TIED_HEADS.items())

    @property
    def buffers(self) -> int:
        """Pipe buffer slots (TrainSchedule.num_pipe_buffers): at least 2, even when 1 micro-batch is in flight."""
        return max(2, self.in_flight)

    def to_json(self) -> Dict[str, Any]:
        return {"stage": self.index, "layers": list(self.layers), "blocks": self.blocks, "params": self.params,
                "in_flight_micro_batches": self.in_flight}


def pipeline_layer_params(bd: ParamBreakdown) -> List[Tuple[str, int]]:
    """zerorun.pipeline.pipeline_layers as (name, trainable parameters) — what DeepSpeed's
    ``_count_layer_params`` weighs, the tied embedding counted at both of its uses (the family's layout:
    zerorun/arch/pipe_layout.py)."""
    return bd.arch.pipe_layout.layers(bd)


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


def pipeline_stages(cfg: RunConfig, plan: Plan) -> List[PipelineStage]:
    """The stages of ``parallel=pipeline``: layers, parameters and 1F1B depth of each."""
    bd = param_breakdown(cfg.model, plan.task, cfg.task.num_labels)
    layers = pipeline_layer_params(bd)
    S = max(1, cfg.parallel.stages)
    if Partition(cfg.parallel.partition) == Partition.uniform:
        bounds = partition_uniform(len(layers), S)
    else:
        bounds = partition_balanced([w for _, w in layers], S)
    micro = plan.grad_accum_steps
    stages = []
    for i in range(S):
        own = layers[bounds[i]:bounds[i + 1]]
        names = tuple(n for n, _ in own)
        stage = PipelineStage(i, names, sum(w for _, w in own), max(1, min(S - i, micro)))
        if stage.holds_both_tied_ends:
            stage = dataclasses.replace(stage, params=stage.params - bd.tied_embedding)
        stages.append(stage)
    return stages


def stage_view(cfg: RunConfig, bd: ParamBreakdown, act: Activations, st: PipelineStage,
                last: bool) -> Tuple[ParamBreakdown, Activations]:
    """The breakdown and activations of one pipeline stage, in the shape ``rank_estimate`` takes.

    Buffers of DeepSpeed's PipelineEngine (runtime/pipe/engine.py, measured on CPU): each of the stage's
    buffer slots keeps its last micro-batch's inputs (a clone of the received activations and the
    int64 mask) until the slot is reused, next to one persistent receive buffer; a non-last stage
    receives its output gradient into one more; and the last stage never frees its outputs
    (``_exec_backward_pass`` returns before ``pipe_buffers['outputs'][id] = None``), so the logits of
    every slot stay alive in the module dtype — twice the logits at 1 micro-batch in flight.
    """
    names = set(st.layers)
    first = bool(names & set(FIRST_LAYERS))
    both = st.holds_both_tied_ends
    head_copy = bd.tied_embedding if (names & set(TIED_HEADS) and not both) else 0
    parts = bd.arch.pipe_layout.parts(bd, names, st.blocks)  # the embeddings, head and buffers it builds
    view = ParamBreakdown(bd.arch, parts.embeddings, bd.layer_tensors, st.blocks,
                          parts.head + ((head_copy,) if head_copy else ()),
                          tied_embedding=bd.tied_embedding if both else 0, buffer_bytes=parts.buffer_bytes,
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
    # The pipeline's blocks run without a KV cache (pipe_classic.GPT2BlockPipe and pipe_decoder.DecoderLayerPipe:
    # use_cache=False); a Llama-class decoder's ``act`` is already the pipeline's (activations(pipeline=True)).
    stage_act = dataclasses.replace(act, per_layer=act.recompute_layer, outside_layers=outside,
                                    small_outside=act.small_outside if (first or last) else 0,
                                    outside_first=act.outside_first if first else 0, num_layers=st.blocks,
                                    logits_loss=act.logits_loss if last else 0, in_flight=st.in_flight,
                                    boundary=0 if last else act.checkpoint_per_layer, pipe_buffers=int(buffers))
    return view, stage_act

