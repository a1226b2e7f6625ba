"""The layer list of a Hugging Face GPT-2/BERT/RoBERTa model and the DeepSpeed PipelineModule built
from it (layers.py says what travels between the layers), plus a one-process runner for tests."""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, List, Optional

import torch
import torch.nn as nn

from .layers import (CAUSAL_LM, SEQUENCE_CLASSIFICATION, BertClassifierHeadPipe, EncoderEmbeddingPipe,
                     EncoderLayerPipe, GPT2BlockPipe, GPT2FinalNormPipe, GPT2PositionEmbeddingPipe,
                     GPT2TokenEmbeddingPipe, LMHeadPipe, RobertaClassifierHeadPipe, gpt2_lm_head, loss_fn_for,
                     resolve_task)

PARTITION_METHODS = ("parameters", "uniform")
TIED_EMBED_KEY = "embed"
# Layer classes DeepSpeed may checkpoint (recompute in backward). The embedding layers are left
# out on purpose: with DeepSpeed's default (reentrant) checkpoint a segment whose inputs need no
# grad (token ids) is cut off from autograd, and the embeddings would never get gradients.
CHECKPOINTABLE_LAYERS = ["GPT2BlockPipe", "EncoderLayerPipe"]


def pipeline_layers(model: nn.Module, task: Any = None) -> list:
    """The DeepSpeed layer specs of ``model`` (GPT2LMHeadModel, BertForSequenceClassification,
    RobertaForSequenceClassification), wrapping its own submodules (no copy)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    task = resolve_task(model, task)
    paths = {id(m): name for name, m in model.named_modules()}

    def path(module: nn.Module) -> str:
        return paths[id(module)]

    cls = type(model).__name__
    config = model.config
    if cls == "GPT2LMHeadModel":
        if task != CAUSAL_LM:
            raise ValueError(f"{cls} is a causal LM; task={task} does not fit it.")
        if config.add_cross_attention:
            raise ValueError("GPT-2 with cross-attention (add_cross_attention=True) is not supported in the pipeline.")
        tr = model.transformer
        tied = model.lm_head.weight is tr.wte.weight
        layers: list = []
        if tied:
            layers.append(TiedLayerSpec(TIED_EMBED_KEY, GPT2TokenEmbeddingPipe, tr.wte, path(tr.wte),
                                        tied_weight_attr="weight"))
        else:
            layers.append(LayerSpec(GPT2TokenEmbeddingPipe, tr.wte, path(tr.wte)))
        layers.append(LayerSpec(GPT2PositionEmbeddingPipe, tr.wpe, path(tr.wpe), tr.drop, path(tr.drop)))
        layers += [LayerSpec(GPT2BlockPipe, block, path(block), config) for block in tr.h]
        layers.append(LayerSpec(GPT2FinalNormPipe, tr.ln_f, path(tr.ln_f)))
        if tied:
            layers.append(TiedLayerSpec(TIED_EMBED_KEY, GPT2TokenEmbeddingPipe, tr.wte, path(tr.wte),
                                        forward_fn=gpt2_lm_head, tied_weight_attr="weight"))
        else:
            layers.append(LayerSpec(LMHeadPipe, model.lm_head, path(model.lm_head)))
        return layers

    if cls in ("BertForSequenceClassification", "RobertaForSequenceClassification"):
        if task != SEQUENCE_CLASSIFICATION:
            raise ValueError(f"{cls} is a classifier; task={task} does not fit it.")
        if config.is_decoder or config.add_cross_attention:
            raise ValueError(f"{cls} configured as a decoder is not supported in the pipeline.")
        if config.problem_type not in (None, "single_label_classification") or config.num_labels < 2:
            raise ValueError(f"{cls} with problem_type={config.problem_type}, num_labels={config.num_labels}: "
                             "the pipeline trains single-label classification (num_labels >= 2).")
        encoder_model = model.bert if cls.startswith("Bert") else model.roberta
        layers = [LayerSpec(EncoderEmbeddingPipe, encoder_model.embeddings, path(encoder_model.embeddings))]
        layers += [LayerSpec(EncoderLayerPipe, layer, path(layer), config) for layer in encoder_model.encoder.layer]
        if cls.startswith("Bert"):
            layers.append(LayerSpec(BertClassifierHeadPipe, encoder_model.pooler, path(encoder_model.pooler),
                                    model.dropout, path(model.dropout), model.classifier, path(model.classifier)))
        else:
            layers.append(LayerSpec(RobertaClassifierHeadPipe, model.classifier, path(model.classifier)))
        return layers

    raise ValueError(f"{cls}: the pipeline supports GPT2LMHeadModel, BertForSequenceClassification and "
                     "RobertaForSequenceClassification.")


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
        return PipelineModule(layers=layers, num_stages=num_stages, topology=topology,
                              loss_fn=loss_fn or loss_fn_for(task), partition_method=partition_method,
                              activation_checkpoint_interval=activation_checkpoint_interval,
                              checkpointable_layers=list(CHECKPOINTABLE_LAYERS), dynamic_shape=dynamic_shape,
                              **kwargs)


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

