"""Back to Hugging Face names: the pipeline's parameters as the HF model's state dict, from one stage,
from all of them (gathered onto one rank), ready for ``load_state_dict`` and ``save_pretrained``."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, Iterable, List, Optional

import torch
import torch.nn as nn

from .layers import HFPart
from .module import SequentialPipe


def stage_state_dict(module: nn.Module, *, copy: bool = True) -> Dict[str, torch.Tensor]:
    """``{hf_name: tensor}`` for the pipeline layers ``module`` holds: a PipelineModule (this rank's
    stage only), a SequentialPipe, or a DeepSpeed engine wrapping one. A tied module appears once.
    copy=True returns detached CPU clones (safe to pickle, gather and keep)."""
    out: Dict[str, torch.Tensor] = {}
    seen = set()
    for sub in module.modules():
        if not isinstance(sub, HFPart) or id(sub) in seen:
            continue
        seen.add(id(sub))
        for name, value in sub.hf_state_dict().items():
            if name not in out:
                out[name] = value.detach().cpu().clone() if copy else value.detach()
    return out


def _storage_key(t: torch.Tensor):
    if t.device.type == "meta":  # no storage: every meta tensor has data_ptr 0 (release_other_stages)
        return ("meta", id(t))
    return (t.device, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def release_other_stages(original_model: nn.Module, pipe_module: nn.Module) -> int:
    """Move the HF model's parameters and buffers that this rank's stage does not use to the meta device;
    returns the bytes freed. Every rank builds the whole model and its stage wraps some of its
    submodules; the rest would otherwise stay alive (in fp32, on the host) for the whole run, only
    for the export, which needs the model's structure and not those weights."""
    mine = {id(p) for p in pipe_module.parameters()}
    freed = 0
    for module in original_model.modules():
        # A module's own tensors go when none of its parameters is used here: its direct ones, or (a module
        # holding only buffers, such as GPT-2's attention with its causal-mask buffer) those below it.
        params = list(module.parameters(recurse=False)) or list(module.parameters())
        if params and not any(id(p) in mine for p in params):
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            freed += sum(t.numel() * t.element_size() for t in own if t.device.type != "meta")
            module._apply(lambda t: t.to("meta"), recurse=False)
    return freed


def merge_state_dicts(dicts: Iterable[Mapping[str, torch.Tensor]], original_model: nn.Module) -> Dict[str, torch.Tensor]:
    """The full HF state dict from the per-stage dicts of ``stage_state_dict``.

    Keys come out in ``original_model.state_dict()`` order. A name the stages did not produce is
    filled when it is a tied alias in the HF model (same storage as a produced name, e.g.
    ``lm_head.weight`` of ``transformer.wte.weight``): it maps to the *same* tensor, so the weight is
    stored once. Raises ValueError when HF names are missing or unknown.
    """
    merged: Dict[str, torch.Tensor] = {}
    for d in dicts:
        for name, value in (d or {}).items():
            merged.setdefault(name, value)  # tied copies on several stages are equal; keep the first
    reference = original_model.state_dict(keep_vars=True)
    unknown = [k for k in merged if k not in reference]
    if unknown:
        raise ValueError(f"pipeline names not in {type(original_model).__name__}: {', '.join(unknown[:5])}")
    groups: Dict[Any, List[str]] = {}
    for name, t in reference.items():
        if t.numel():
            groups.setdefault(_storage_key(t), []).append(name)
    out: Dict[str, torch.Tensor] = {}
    missing = []
    for name, t in reference.items():
        if name in merged:
            out[name] = merged[name]
            continue
        source = next((n for n in groups.get(_storage_key(t), []) if n in merged), None) if t.numel() else None
        if source is None:
            missing.append(name)
        else:
            out[name] = merged[source]
    if missing:
        raise ValueError(f"{len(missing)} HF names not produced by any stage (e.g. {', '.join(missing[:5])}); "
                         "in a multi-stage run merge the dicts of every stage (gather_hf_state_dict).")
    return out


def export_state_dict(source: Any, original_model: nn.Module) -> Dict[str, torch.Tensor]:
    """The HF state dict of the pipeline's parameters, for ``original_model.load_state_dict`` and
    ``save_pretrained``.

    source: a module holding *all* pipeline layers (a one-stage PipelineModule, a SequentialPipe,
    an engine), the layer list of ``pipeline_layers``, one ``{hf_name: tensor}`` dict, or a list of
    the per-stage dicts gathered from every stage.
    """
    if isinstance(source, Mapping):
        dicts = [source]
    elif isinstance(source, (list, tuple)):
        if all(isinstance(d, Mapping) for d in source):
            dicts = list(source)
        else:
            dicts = [stage_state_dict(SequentialPipe(source))]
    elif isinstance(source, nn.Module):
        dicts = [stage_state_dict(source)]
    else:
        raise TypeError(f"export_state_dict: cannot read parameters from a {type(source).__name__}")
    return merge_state_dicts(dicts, original_model)


def gather_hf_state_dict(pipe_module: nn.Module, original_model: nn.Module, dst: int = 0) -> Optional[Dict[str, torch.Tensor]]:
    """Collective (every rank calls it): the full HF state dict on global rank ``dst``, None elsewhere.

    Only data-parallel replica 0 of each stage sends its layers (the other replicas hold the same values), one
    sender at a time, as pickled CPU tensors (``send_object_list``). ``dst`` keeps its own stage's tensors as they
    are, uncopied. What ``dst`` holds beyond its states is then one other stage at a time in transit plus what it
    has received: ``torch.distributed.gather_object`` held a clone and a pickle of its own stage, a receive buffer
    of world × the largest stage and every stage unpickled at once (measured on GPT-2 small bf16, 2 stages: the
    export raised rank 0's peak RSS 158 MiB above training's; memory.estimate counts the export phase).
    """
    import torch.distributed as dist

    module = getattr(pipe_module, "module", pipe_module)  # an engine or the PipelineModule
    grid = getattr(module, "_grid", None)
    sends = grid is None or grid.data_parallel_id == 0
    rank, world = dist.get_rank(), dist.get_world_size()
    senders = [None] * world
    dist.all_gather_object(senders, sends and rank != dst)  # who has a stage to send
    if rank != dst:
        if sends:
            dist.send_object_list([stage_state_dict(module)], dst=dst)
        return None
    dicts = [stage_state_dict(module, copy=False) if sends else {}]
    for src in (r for r, s in enumerate(senders) if s):
        box: List[Any] = [None]
        dist.recv_object_list(box, src=src)
        dicts.append(box[0])
    return merge_state_dicts(dicts, original_model)
