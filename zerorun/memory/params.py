"""§1 Parameters: the tensors of the model zerorun builds, by region, without building it.

docs/memory.md §1. The tensors themselves are each family's (zerorun/arch), exact to the element against
transformers' own models (tests build them on the meta device).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections import namedtuple
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..arch import Traits, census, layer_linears, lora_layer_tensors, param_tensors, traits
from ..config import ModelConfig, TaskName, default_task


@dataclass(frozen=True)
class ParamBreakdown:
    """Parameter tensors of the model zerorun builds, by region (numel per tensor).

    ``total`` equals ``sum(p.numel() for p in model.parameters())`` of the transformers model
    (tied weights counted once, as DeepSpeed's ``data_ptr`` count does: docs/memory.md §1).
    """

    arch: Traits
    """The family's traits (zerorun/arch): what pipeline layers and buffers it has."""
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
    adapter_tensors: Tuple[int, ...] = ()
    """adapter=lora: the LoRA tensors each layer gains (also in ``layer_tensors``); only they, and a
    classification head, train: the base model is frozen (no gradients, master copies or optimizer states)."""
    trainable_head: Tuple[int, ...] = ()
    irregular: int = 0
    """Elements the layers hold beyond num_layers × ``layer_tensors`` (a traced model whose first layer differs)."""
    quantized: int = 0
    """adapter=qlora: elements of the layers' linear weights stored in 4-bit NF4 (``QLORA_BYTES`` each)."""
    active_fraction: float = 1.0
    """The share of a layer's parameters one token runs through (MoE: top-k of the experts); compute, not memory."""

    @property
    def lora(self) -> bool:
        return bool(self.adapter_tensors)

    @property
    def trainable(self) -> int:
        """Parameters that get gradients, fp32 master copies and optimizer states."""
        return self.num_layers * sum(self.adapter_tensors) + sum(self.trainable_head) if self.lora else self.total

    @property
    def largest_trainable(self) -> int:
        return max(self.adapter_tensors + self.trainable_head, default=0) if self.lora else self.largest_tensor

    @property
    def word_embedding(self) -> int:
        """Elements of the V×h matrix on this rank whose dense gradient ends the backward pass (0: none)."""
        if self.lora:  # frozen: no gradient
            return 0
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
        return self.embeddings + self.num_layers * self.per_layer + self.irregular + self.head

    def tensors(self) -> Tuple[int, ...]:
        """Every parameter tensor's element count, in module order."""
        return (*self.embedding_tensors, *self.layer_tensors * self.num_layers, *self.head_tensors)

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



ARCH_FIELDS = ("family", "model_type", "num_layers", "hidden_size", "num_heads", "intermediate_size",
               "vocab_size", "max_positions", "type_vocab_size", "num_kv_heads", "head_dim", "tie_word_embeddings",
               "attention_bias", "mlp_bias", "hf_config")
Shape = namedtuple("Shape", ARCH_FIELDS)
"""The fields of a ModelConfig that zerorun/arch reads, frozen so that a parameter layout can be cached."""


def model_key(m: ModelConfig, task: Optional[TaskName] = None, num_labels: int = 2, adapter=None, tp: int = 1) -> Tuple:
    """What the parameter layout depends on (a hashable cache key); ``tp``: one tensor-parallel rank's share."""
    task = TaskName(task) if task not in (None, TaskName.auto) else default_task(m.family)
    lora = lora_layer_tensors(m, adapter) if adapter is not None and adapter.name.adapts else ()
    quantized = sum(i * o for shapes in layer_linears(m).values() for i, o in shapes) \
        if adapter is not None and adapter.name.value == "qlora" else 0  # every linear weight of a layer is 4-bit
    fields = [getattr(m, f) for f in ARCH_FIELDS]
    fields[-1] = json.dumps(m.hf_config, sort_keys=True)  # hashable; zerorun/arch reads it back
    return (Shape(*fields), task, num_labels, lora, quantized) + ((tp,) if tp > 1 else ())


@functools.lru_cache(maxsize=256)
def breakdown(key: Tuple) -> ParamBreakdown:
    """The parameter tensors for a model_key (zerorun/arch); with LoRA the adapters join each layer and only they
    (and a classification head, which peft trains too) are trainable; with tensor parallelism one rank's share."""
    shape, task, labels, lora, quantized_per_layer, *tp = key
    emb, layer, head, tied, buffers = param_tensors(shape, task.value, labels, *tp)
    c = census(shape, task.value, labels) if traits(shape).traced else None
    full = ParamBreakdown(traits(shape), emb, layer, shape.num_layers, head, tied_embedding=tied, buffer_bytes=buffers,
                          irregular=c.irregular if c else 0, active_fraction=c.expert_fraction if c else 1.0)
    if not lora:
        return full
    trainable_head = full.head_tensors if task == TaskName.sequence_classification else ()
    return dataclasses.replace(full, layer_tensors=full.layer_tensors + lora, adapter_tensors=lora,
                               trainable_head=trainable_head, quantized=shape.num_layers * quantized_per_layer)


def param_breakdown(m: ModelConfig, task: Optional[TaskName] = None, num_labels: int = 2,
                    adapter=None, tp: int = 1) -> ParamBreakdown:
    """Parameter tensors of ``m`` for ``task`` (None: the family's own) by region, exactly as transformers
    builds the model (with ``adapter``'s LoRA tensors, as peft adds them); with ``tp`` > 1 what one rank of a
    tensor-parallel group holds after DeepSpeed's AutoTP split it (arch/decoder.py ``Decoder.tp``)."""
    return breakdown(model_key(m, task, num_labels, adapter, tp))


def count_params(m: ModelConfig, task: Optional[TaskName] = None, num_labels: int = 2) -> int:
    """Unique parameters (a tied LM head counted once) of the model zerorun builds for ``m`` and ``task``:
    GPT2LMHeadModel, Bert/RobertaForSequenceClassification (GPT2ForSequenceClassification too)."""
    return param_breakdown(m, task, num_labels).total

