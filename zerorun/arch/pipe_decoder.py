"""Llama-class decoders (Llama, Qwen2, Mistral: family ``llama``) as DeepSpeed pipeline layers: thin wrappers
around transformers' own submodules, and the layer list of each causal-LM class (zerorun/pipeline/layers.py says
what travels between layers; pipe_classic.py holds GPT-2, BERT and RoBERTa the same way).

``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MistralForCausalLM`` (task causal_lm)::

    first-stage input: input_ids [B,T]  |  (input_ids,)  |  (input_ids, attention_mask)
    0  tied "embed" DecoderEmbeddingPipe (embed_tokens)  -> (hidden [B,T,H], mask [B,T] int64)
    1..n  DecoderLayerPipe, one per decoder layer        -> (hidden, mask)
    n+1  DecoderNormPipe (model.norm)                    -> hidden
    n+2  tied "embed" with forward_fn=tied_lm_head       -> logits [B,T,V] = hidden @ embed_tokens.weight.T
         (untied, tie_word_embeddings=false: LMHeadPipe (lm_head))
    loss_fn = causal_lm_loss(logits, labels)              (labels [B,T]: the input ids; shifted inside)

Rotary position embeddings are not carried between stages: every floating tensor that crosses a stage boundary
must get a gradient back (the engine asserts it), and cos/sin are constants of the positions. Each decoder layer
computes them with the model's own ``rotary_emb`` (one module, shared by the layers; its ``inv_freq`` is a
non-persistent buffer, so no weight moves) from positions 0..T-1, as the model's forward does without a cache:
a [1, T, head_dim] table per layer, the same numbers as the model's one table. The causal mask is rebuilt in each
layer from the int64 padding mask with the function the model's forward uses for that layer (the sliding-window
one for Mistral with ``sliding_window`` and Qwen2's sliding layers), given the padding mask itself, so with no
padding SDPA runs its ``is_causal`` path with K/V at their own heads, as the model does in training with its cache.
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..pipeline.layers import CAUSAL_LM, TIED_EMBED_KEY, HFPart, LMHeadPipe, transport_mask, unpack
from .pipe_classic import PipeRecipe


class DecoderEmbeddingPipe(HFPart):
    """The token embedding (``model.embed_tokens``); the tied module when the head is tied (``.weight``).

    In: input_ids | (input_ids,) | (input_ids, attention_mask). Out: (inputs_embeds, mask int64).
    """

    def __init__(self, embed_tokens: nn.Embedding, path: str):
        super().__init__([("embed_tokens", embed_tokens, path)])

    @property
    def weight(self) -> nn.Parameter:  # TiedLayerSpec(tied_weight_attr="weight") reads this with getattr
        return self.embed_tokens.weight

    def forward(self, inputs):
        input_ids, mask = unpack(inputs, 2)
        input_ids = input_ids.view(-1, input_ids.size(-1))
        return self.embed_tokens(input_ids), transport_mask(mask, input_ids)


def tied_lm_head(embed: DecoderEmbeddingPipe, inputs) -> torch.Tensor:
    """forward_fn of the tied LM head: logits = hidden @ embed_tokens.weight.T (HF's bias-free lm_head Linear)."""
    hidden = inputs if torch.is_tensor(inputs) else inputs[0]
    return F.linear(hidden, embed.weight)


def sliding_layer(layer: nn.Module, config) -> bool:
    """Whether the model's forward gives this layer the sliding-window mask: Qwen2 per layer type, Mistral (no
    layer types) whenever ``sliding_window`` is set, Llama never."""
    kind = getattr(layer, "attention_type", None)
    if kind is not None:
        return kind == "sliding_attention"
    return getattr(config, "sliding_window", None) is not None


class DecoderLayerPipe(HFPart):
    """One decoder layer (LlamaDecoderLayer, Qwen2DecoderLayer, MistralDecoderLayer) with its rotary table and
    mask rebuilt here (the module docstring says why they do not travel). ``rotary`` is the model's own
    ``rotary_emb``, registered under its HF path (it holds no persistent tensor: nothing to export)."""

    def __init__(self, layer: nn.Module, path: str, rotary: nn.Module, rotary_path: str, config, sliding: bool):
        super().__init__([("layer", layer, path), ("rotary", rotary, rotary_path)])
        self.config = config
        self.sliding = sliding

    def forward(self, inputs):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        hidden, mask = inputs
        cache_position = torch.arange(hidden.size(1), device=hidden.device)
        position_ids = cache_position.unsqueeze(0)
        make_mask = create_sliding_window_causal_mask if self.sliding else create_causal_mask
        # The padding mask is given (all ones when the batch has none), so no packed-sequence detection runs
        # and an all-ones mask is dropped in favour of SDPA's is_causal, as with the model's training cache.
        causal_mask = make_mask(config=self.config, input_embeds=hidden, attention_mask=mask,
                                cache_position=cache_position, past_key_values=None, position_ids=None)
        cos_sin = self.rotary(hidden, position_ids)
        out = self.layer(hidden, attention_mask=causal_mask, position_ids=position_ids, past_key_values=None,
                         use_cache=False, cache_position=cache_position, position_embeddings=cos_sin)
        return (out[0] if isinstance(out, tuple) else out), mask


class DecoderNormPipe(HFPart):
    """The final RMSNorm (``model.norm``); drops the mask: nothing after it needs one."""

    def __init__(self, norm: nn.Module, path: str):
        super().__init__([("norm", norm, path)])

    def forward(self, inputs):
        return self.norm(inputs if torch.is_tensor(inputs) else inputs[0])


def _decoder_layers(model: nn.Module, path, LayerSpec, TiedLayerSpec) -> list:
    inner, config = model.model, model.config
    tied = model.lm_head.weight is inner.embed_tokens.weight
    if tied:
        layers: list = [TiedLayerSpec(TIED_EMBED_KEY, DecoderEmbeddingPipe, inner.embed_tokens,
                                      path(inner.embed_tokens), tied_weight_attr="weight")]
    else:
        layers = [LayerSpec(DecoderEmbeddingPipe, inner.embed_tokens, path(inner.embed_tokens))]
    rotary = inner.rotary_emb
    layers += [LayerSpec(DecoderLayerPipe, layer, path(layer), rotary, path(rotary), config,
                         sliding_layer(layer, config))
               for layer in inner.layers[:config.num_hidden_layers]]
    layers.append(LayerSpec(DecoderNormPipe, inner.norm, path(inner.norm)))
    if tied:
        layers.append(TiedLayerSpec(TIED_EMBED_KEY, DecoderEmbeddingPipe, inner.embed_tokens, path(inner.embed_tokens),
                                    forward_fn=tied_lm_head, tied_weight_attr="weight"))
    else:
        layers.append(LayerSpec(LMHeadPipe, model.lm_head, path(model.lm_head)))
    return layers


PIPELINES: Dict[str, PipeRecipe] = {
    cls: PipeRecipe("llama", CAUSAL_LM, _decoder_layers, ("DecoderLayerPipe",))
    for cls in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
}
"""The Llama-class transformers classes zerorun.pipeline cuts, by class name."""
