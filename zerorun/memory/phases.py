"""§5.1 The moments of one training step on the device, each the full list of what is alive then: the loss
(every saved activation and the LM loss transient), backward through the last layer, the word embedding's
gradient, the gradient reduce, ZeRO-0's all-reduce, the optimizer step (docs/memory.md §5.1). estimate.py takes
the peak over them and adds what lives outside the tensors."""
from __future__ import annotations

from collections import OrderedDict

from ..config import Dtype, Plan, RunConfig
from .activations import DTYPE_BYTES, Activations
from .buffers import (FP64_NORM_BYTES, embedding_grad_transient, first_reduce, partitioned_on_device,
                      zero0_flatten_bytes, zero3_step_norm_block, zero_partition)
from .params import ParamBreakdown
from .priors import Calibration
from .states import ModelStates, phase, step_transient

Phase = "OrderedDict[str, int]"
GRADIENT_NORM = "gradient norm transient (fp64)"
GATHER_OUTPUT = "all-gather output buffer (gloo)"


def step_phases(cfg: RunConfig, plan: Plan, bd: ParamBreakdown, act: Activations, states: ModelStates,
                bwd, cal: Calibration, rank: int = 0) -> "OrderedDict[str, Phase]":
    """The moments of one training step on the device, each the full list of what is alive then, on data-parallel
    ``rank`` (ranks differ in the tensors their ZeRO-1/2 partition holds whole, and so in its gradients and the
    largest norm the step takes, and in the share of the word embedding's gradient norm they take)."""
    stage, g = cfg.zero.stage, DTYPE_BYTES[Dtype(cfg.precision.dtype)]
    part, persistent = states.partition, states.device
    held = zero_partition(bd, plan.data_parallel_size, rank) if partitioned_on_device(cfg, plan) else None
    if held and cfg.zero.contiguous_gradients and "gradients" in persistent:
        # The gradient partition holds every tensor that overlaps this rank's share whole (zero_partition)
        persistent = OrderedDict(persistent)
        persistent["gradients"] += (held.whole - part) * g
        part_grads = held.whole
    else:
        part_grads = part
    step_states = persistent
    if stage == 1:
        # ZeRO-1 frees the full param.grad once they are copied into this rank's partition, or, with
        # offload, into the host fp32 buffer (measured).
        step_states = OrderedDict(persistent)
        step_states.pop("gradients", None)
        if not plan.offload_optimizer:
            step_states["gradients"] = part_grads * g
    # Gradients alive before this micro-step's backward: none on the first micro-step of an optimizer step
    # (DeepSpeed sets them to None at the step), so none at all without accumulation. ZeRO-3's flat
    # gradient partition is allocated once and stays; offloaded host buffers stay. ZeRO-2's partition is
    # allocated at the first bucket reduce, so it exists again by the time the last layer runs backward.
    # With a bucket that holds every gradient but the embeddings', that reduce comes at the end (FirstReduce).
    first = first_reduce(cfg, plan, bd)
    if plan.grad_accum_steps > 1 or stage == 3:
        fwd_states = bwd_states = persistent
    else:
        fwd_states = phase((k, v) for k, v in persistent.items() if k != "gradients")
        bwd_states = phase([*fwd_states.items(), ("gradients", part_grads * g if stage == 2 and first.before_embedding
                                                  and not plan.offload_optimizer else 0)])

    acts = act.saved
    phases: "OrderedDict[str, Phase]" = OrderedDict()
    if stage == 3 and not cfg.model.pretrained:
        # zerorun.train builds random-init models whole (no zero.Init): the engine casts the module and
        # moves it to the device before ZeRO-3 partitions it (engine.py ``_configure_distributed_model``).
        phases["init"] = phase([("whole model before partitioning", bd.total * g), ("buffers", bd.buffer_bytes)])
    # Start of backward (log_softmax backward): every saved activation + the LM loss transient. The LM
    # head's weight grad comes only after this, when the logits grads are already freed (measured).
    phases["loss"] = phase([*fwd_states.items(), ("activations", acts), ("logits + loss", act.logits_loss),
                            *bwd.buffers, *bwd.resident, *bwd.at_loss])
    # Backward through the last layer (recomputed under checkpointing): its grads' working set. A pipeline stage
    # with no transformer layer (the embeddings alone) has neither (measured: tiny BERT's stage 0 read +17%).
    blocks = act.num_layers > 0
    layer_extra = [("activations", acts + (act.recompute_layer if act.checkpointing and blocks else 0)),
                   ("activation-grad working set", act.working_set if blocks else 0)]
    phases["backward"] = phase([*bwd_states.items(), *layer_extra, *bwd.tied_pending, *bwd.in_flight,
                                *bwd.buffers, *bwd.ipg, *bwd.resident])
    if bd.word_embedding:
        # A pipeline's first stage still holds its other in-flight micro-batches here.
        others = act.saved - act.saved // act.in_flight
        emb_states, transient = _embedding_grad_states(cfg, plan, bd, persistent, part_grads), \
            embedding_grad_transient(cfg, plan, bd, rank)
        if not first.before_embedding:  # every other gradient is in the bucket; this one is still its own
            emb_states = phase((k, v) for k, v in emb_states.items() if k != "gradients")
            transient = max(transient, bd.word_embedding * g)
        phases["embedding grad"] = phase([*emb_states.items(), ("activations", act.outside_layers + others),
                                          ("embedding grad transient", transient),
                                          *bwd.buffers, *bwd.ipg, *bwd.resident])
    if not first.before_embedding:
        # End of backward: the first reduce allocates the gradient partition while the bucket still exists
        # (and the word embedding's gradient, if it did not fit in the bucket).
        phases["gradient reduce"] = phase([*step_states.items(), *bwd.ipg,
                                           ("embedding grad transient",
                                            0 if first.word_joins_bucket else bd.word_embedding * g)])
    if stage == 0:
        phases["all-reduce"] = phase([*persistent.items(), ("all-reduce flatten buffer", zero0_flatten_bytes(cfg, bd))])
    # The step first takes the norm of each gradient slice in the partition as an fp64 copy, one at a time.
    norm = held.largest_slice * FP64_NORM_BYTES if held else zero3_step_norm_block(cfg, plan, bd)
    if norm:
        phases["gradient norm"] = phase([*step_states.items(), *bwd.resident, (GRADIENT_NORM, norm)])
    phases["optimizer step"] = phase([*step_states.items(), *bwd.resident,
                                      ("optimizer-step transient", step_transient(cfg, plan, bd, part))])
    if stage in (1, 2) and plan.world.accelerator == "cpu" and plan.data_parallel_size > 1:
        # Then it gathers the updated 16-bit partitions into the flat buffer. gloo's allgather (what
        # all_gather_into_tensor runs on CPU ranks) gathers into a flat output of the whole buffer first and then
        # copies it in (ProcessGroupGloo ``newLikeFlat``); NCCL writes in place. Logged, MiniLM fp32 on 2 ranks:
        # an 86.6 MiB block at the end of every step on both ranks.
        kept = phase((k, v) for k, v in persistent.items() if k != "gradients")
        phases["parameter all-gather"] = phase([*kept.items(), *bwd.resident,
                                                (GATHER_OUTPUT, part * plan.data_parallel_size * g)])
    # Allocated by the first step and kept in every phase after the model is built: cuBLAS's workspaces (the
    # caching allocator holds them from the first matmul on), a pipeline's buffers (the first micro-batch's).
    kept = [("cuBLAS workspaces", cal.cublas_workspace_bytes)] if plan.world.accelerator == "cuda" else []
    if act.pipe_buffers:
        kept.append(("pipeline buffers", act.pipe_buffers))
    for name in phases:
        if kept and name != "init":
            phases[name] = phase([*phases[name].items(), *kept])
    return phases


def _embedding_grad_states(cfg: RunConfig, plan: Plan, bd: ParamBreakdown, persistent: "OrderedDict[str, int]",
                           part: int) -> "OrderedDict[str, int]":
    """The states alive when the word embedding's gradient is formed, at the end of backward. ZeRO-0/1 hold
    full gradients, but without accumulation the tied embedding's is still the transient's (§3.6), not yet
    in param.grad; ZeRO-1 on several ranks allocates its gradient partition only in the reduce that follows
    (measured on 2 CPU ranks: both were counted, 384 MiB too much for GPT-2 small in fp32)."""
    stage, g = cfg.zero.stage, DTYPE_BYTES[Dtype(cfg.precision.dtype)]
    if stage > 1 or "gradients" not in persistent:
        return persistent
    grads = persistent["gradients"]
    if plan.grad_accum_steps == 1 and bd.tied_embedding:
        grads -= bd.tied_embedding * g
    if stage == 1 and plan.data_parallel_size > 1 and not plan.offload_optimizer:
        grads -= part * g
    return phase([*((k, v) for k, v in persistent.items() if k != "gradients"), ("gradients", grads)])
