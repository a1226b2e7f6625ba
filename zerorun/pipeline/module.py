"""The layer list of a Hugging Face model and the DeepSpeed PipelineModule built from it (layers.py says what
travels between the layers; each family's wrappers and layer list are its ``PipeRecipe`` in zerorun/arch), plus
a one-process runner for tests."""
from __future__ import annotations

import functools
import importlib
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
import torch.nn as nn

from .layers import CAUSAL_LM, SEQUENCE_CLASSIFICATION, loss_fn_for

PARTITION_METHODS = ("parameters", "uniform")


def recipes() -> Dict[str, Any]:
    """Every transformers class the pipeline cuts, by class name: the ``PIPELINES`` of each module named in
    ``arch.PIPELINE_ADAPTERS`` (imported here, when a model is cut: planning never loads torch modules)."""
    from ..arch import PIPELINE_ADAPTERS

    out: Dict[str, Any] = {}
    for name in PIPELINE_ADAPTERS:
        out.update(importlib.import_module(name).PIPELINES)
    return out


def checkpointable_layers() -> List[str]:
    """Layer classes DeepSpeed may checkpoint (recompute in backward): each family's blocks, never its
    embeddings (with the reentrant checkpoint a segment whose inputs need no grad is cut off from autograd)."""
    return sorted({name for r in recipes().values() for name in r.checkpointable})


def _recipe(model: nn.Module):
    cls = type(model).__name__
    known = recipes()
    if cls not in known:
        raise ValueError(f"{cls}: the pipeline supports {', '.join(known)}.")
    return known[cls]


def resolve_task(model: Optional[nn.Module], task: Any = None) -> str:
    """causal_lm or sequence_classification, from ``task`` (a TaskName, a string, None/auto: the model class)."""
    name = getattr(task, "value", task)
    if name in (None, "", "auto"):
        return _recipe(model).task
    if name not in (CAUSAL_LM, SEQUENCE_CLASSIFICATION):
        raise ValueError(f"task={name}: the pipeline supports causal_lm and sequence_classification.")
    return name


def pipeline_layers(model: nn.Module, task: Any = None) -> list:
    """The DeepSpeed layer specs of ``model`` (a class with a recipe: ``recipes()``), wrapping its own submodules
    (no copy)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    recipe, task = _recipe(model), resolve_task(model, task)
    if task != recipe.task:
        what = "a causal LM" if recipe.task == CAUSAL_LM else "a classifier"
        raise ValueError(f"{type(model).__name__} is {what}; task={task} does not fit it.")
    paths = {id(m): name for name, m in model.named_modules()}
    return recipe.layers(model, lambda module: paths[id(module)], LayerSpec, TiedLayerSpec)


def build_pipeline_module(model: nn.Module, task: Any = None, num_stages: int = 1,
                          partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                          loss_fn: Optional[Callable] = None, *, topology=None,
                          dynamic_shape: Optional[bool] = None, **kwargs):
    """A ``deepspeed.pipe.PipelineModule`` over ``model``'s own parameters. Needs torch.distributed up
    (``deepspeed.init_distributed``) and LOCAL_RANK set; each rank builds only its stage's layers.

    partition_method: "parameters" (balance trainable parameters; the tied embedding counts on both
    ends) or "uniform" (same number of layers per stage).
    activation_checkpoint_interval: recompute every N consecutive transformer layers in backward
    (0: off); embeddings and heads are never checkpointed.
    dynamic_shape: let activation shapes change between micro-batches. None: on for
    sequence_classification (batches padded to their own longest row), off for causal_lm (fixed blocks).
    """
    from deepspeed.pipe import PipelineModule

    task = resolve_task(model, task)
    if partition_method not in PARTITION_METHODS and not str(partition_method).startswith("type:"):
        raise ValueError(f"partition_method={partition_method}: use one of {', '.join(PARTITION_METHODS)}.")
    if activation_checkpoint_interval < 0:
        raise ValueError(f"activation_checkpoint_interval={activation_checkpoint_interval}: must be >= 0.")
    layers = pipeline_layers(model, task)
    if num_stages is not None and not 1 <= num_stages <= len(layers):
        raise ValueError(f"num_stages={num_stages}: the model has {len(layers)} pipeline layers; "
                         f"use 1..{len(layers)} stages.")
    if dynamic_shape is None:
        dynamic_shape = task == SEQUENCE_CLASSIFICATION
    # no_grad: the constructor broadcasts the tied weights in place (multi-stage); with grad mode on
    # autograd records that c10d op on the Parameter and warns in the first backward.
    with torch.no_grad():
        module = PipelineModule(layers=layers, num_stages=num_stages, topology=topology,
                                loss_fn=loss_fn or loss_fn_for(task), partition_method=partition_method,
                                activation_checkpoint_interval=activation_checkpoint_interval,
                                checkpointable_layers=checkpointable_layers(), dynamic_shape=dynamic_shape,
                                **kwargs)
    count_every_stage_in_the_gradient_norm(module)
    return module


def count_every_stage_in_the_gradient_norm(module: nn.Module) -> None:
    """Mark this stage's parameters so gradient clipping counts them. With fp32 at ZeRO-0 the engine clips with
    ``deepspeed.runtime.utils.clip_grad_norm_``, which sums a parameter's norm only on model-parallel rank 0 or when
    ``is_model_parallel_parameter(p)``; a pipeline's model-parallel group is the replica's stages, so without the mark
    the norm was stage 0's alone and every other stage was clipped by it (measured: a 2-stage tiny Llama drifted 1.7e-2
    in loss from parallel=dp in 20 steps; with it, as one rank against two). The tied copy on a later stage
    (``ds_pipe_replicated``) stays unmarked: stage 0 counts it. The ZeRO and 16-bit optimizers count every stage
    already (their rank is the tensor-parallel one, 0 here), and the mark changes nothing for them."""
    for p in module.parameters():
        if not getattr(p, "ds_pipe_replicated", False):
            p.model_parallel = True


class SequentialPipe(nn.Module):
    """The layer list built and run in one process, as a one-stage PipelineModule would (no
    torch.distributed): tied specs are built once and reused, forward_fn applied to the tied module."""

    def __init__(self, layers: Iterable):
        from deepspeed.pipe import LayerSpec, TiedLayerSpec

        super().__init__()
        self.tied_modules = nn.ModuleDict()
        self.owned = nn.ModuleList()
        self.forward_funcs: List[Callable] = []
        for layer in layers:
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                module = self.tied_modules[layer.key]
                self.forward_funcs.append(module if layer.forward_fn is None
                                          else functools.partial(layer.forward_fn, module))
            elif isinstance(layer, LayerSpec):
                module = layer.build()
                self.owned.append(module)
                self.forward_funcs.append(module)
            elif isinstance(layer, nn.Module):
                self.owned.append(layer)
                self.forward_funcs.append(layer)
            else:
                self.forward_funcs.append(layer)

    def forward(self, inputs):
        x = inputs
        for fn in self.forward_funcs:
            x = fn(x)
        return x

