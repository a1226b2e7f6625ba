"""How zerorun.pipeline cuts each family into layers, as the planner sees it: the layers' names and trainable
parameters (what DeepSpeed's PipelineModule weighs to partition them), and which of the model's tensors and
buffers a stage holding some of those layers builds (docs/memory.md §6). The modules that build the layers
(pipe_classic.py, pipe_decoder.py) import torch; this one does not, so planning reads it.

``bd`` is a memory.params.ParamBreakdown: embedding, layer and head tensors (numel each), the tied embedding's
elements, the module buffers' bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Dict, List, Tuple

TIED_HEADS = {"lm_head (tied wte)": "wte", "lm_head (tied embed_tokens)": "embed_tokens"}
"""A tied LM head's layer name → its word embedding's (DeepSpeed TiedLayerSpec: one module on both ends)."""
FIRST_LAYERS = ("wte", "embeddings", "embed_tokens")
"""The layer a first stage starts with (it reads the input ids)."""


@dataclass(frozen=True)
class StageParts:
    """What a stage builds beside its blocks."""

    embeddings: Tuple[int, ...]
    head: Tuple[int, ...]
    buffer_bytes: int


class Gpt2Layout:
    """pipe_classic.py's GPT-2: the word and the position table are two layers, ln_f (and an untied head) one,
    and every block holds its causal-mask buffer."""

    def layers(self, bd) -> List[Tuple[str, int]]:
        wte, wpe = bd.embedding_tensors
        head = [("ln_f", bd.head), ("lm_head (tied wte)", bd.tied_embedding)] if bd.tied_embedding else \
            [("ln_f + head", bd.head)]
        return [("wte", wte), ("wpe + dropout", wpe), *[("block", bd.per_layer)] * bd.num_layers, *head]

    def parts(self, bd, names: AbstractSet[str], blocks: int) -> StageParts:
        emb = tuple(t for t, n in zip(bd.embedding_tensors, ("wte", "wpe + dropout")) if n in names)
        head = bd.head_tensors if {"ln_f", "ln_f + head"} & names else ()
        return StageParts(emb, head, (bd.buffer_bytes // max(1, bd.num_layers)) * blocks)


class EncoderLayout:
    """pipe_classic.py's BERT/RoBERTa classifier: the embeddings one layer (with its position and type ids), the
    pooler and classifier one."""

    def layers(self, bd) -> List[Tuple[str, int]]:
        return [("embeddings", bd.embeddings), *[("block", bd.per_layer)] * bd.num_layers,
                ("classifier head", bd.head)]

    def parts(self, bd, names: AbstractSet[str], blocks: int) -> StageParts:
        first = "embeddings" in names
        return StageParts(bd.embedding_tensors if first else (),
                          bd.head_tensors if "classifier head" in names else (), bd.buffer_bytes if first else 0)


class DecoderLayout:
    """pipe_decoder.py's Llama-class decoder: embed_tokens, the decoder layers, the final norm and the LM head, each
    a layer of its own; the rotary table's inv_freq is one module every stage keeps (it holds no parameter)."""

    def layers(self, bd) -> List[Tuple[str, int]]:
        norm, *lm_head = bd.head_tensors
        head = [("lm_head (tied embed_tokens)", bd.tied_embedding)] if bd.tied_embedding else \
            [("lm_head", sum(lm_head))]
        return [("embed_tokens", bd.embeddings), *[("block", bd.per_layer)] * bd.num_layers, ("norm", norm), *head]

    def parts(self, bd, names: AbstractSet[str], blocks: int) -> StageParts:
        head = (bd.head_tensors[:1] if "norm" in names else ()) + (bd.head_tensors[1:] if "lm_head" in names else ())
        return StageParts(bd.embedding_tensors if "embed_tokens" in names else (), head, bd.buffer_bytes)


LAYOUTS: Dict[str, object] = {"gpt2": Gpt2Layout(), "encoder": EncoderLayout(), "decoder": DecoderLayout()}
"""By ``Traits.pipeline_layout``: a family zerorun.pipeline cuts names one of these."""
