"""GPT-2, BERT and RoBERTa as DeepSpeed pipeline layers: thin wrappers around transformers' own submodules, and
the layer list of each model class (zerorun/pipeline/layers.py says what travels between layers).

The one arch module that imports torch, transformers and zerorun (the pipeline's generic layer base): planning
never loads it; zerorun.pipeline reads ``PIPELINES`` when it cuts a built model. A family with pipeline layers
adds its wrappers and a ``PipeRecipe`` here (or in a sibling named in ``arch.PIPELINE_ADAPTERS``).

GPT-2 (``GPT2LMHeadModel``, task causal_lm)::

    first-stage input: input_ids [B,T]  |  (input_ids,)  |  (input_ids, attention_mask)
    0  tied "embed"  GPT2TokenEmbeddingPipe (wte)    -> (inputs_embeds [B,T,H] float, mask [B,T] int64)
    1  GPT2PositionEmbeddingPipe (wpe + drop)        -> (hidden, mask)
    2..n+1  GPT2BlockPipe, one per GPT2Block         -> (hidden, mask)
    n+2  GPT2FinalNormPipe (ln_f)                    -> hidden
    n+3  tied "embed" with forward_fn=gpt2_lm_head   -> logits [B,T,V] = hidden @ wte.weight.T
    loss_fn = causal_lm_loss(logits, labels)          (labels [B,T]: the input ids; shifted inside)

    Only ``wte`` is in the tied module (its ``.weight`` is ``wte.weight``), so the last stage holds
    no stale copy of ``wpe``. A model with untied embeddings gets a plain ``LMHeadPipe`` instead.

BERT / RoBERTa (``BertForSequenceClassification`` / ``RobertaForSequenceClassification``)::

    first-stage input: input_ids  |  (input_ids, attention_mask)  |  (input_ids, attention_mask, token_type_ids)
    0  EncoderEmbeddingPipe (embeddings)             -> (hidden, mask int64)
    1..n  EncoderLayerPipe, one per BertLayer        -> (hidden, mask)
    n+1  BertClassifierHeadPipe (pooler, dropout, classifier) | RobertaClassifierHeadPipe (classifier)
                                                      -> logits [B, num_labels]
    loss_fn = sequence_classification_loss(logits, labels)   (labels [B] int64)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..pipeline.layers import (CAUSAL_LM, SEQUENCE_CLASSIFICATION, TIED_EMBED_KEY, HFPart, LMHeadPipe, transport_mask,
                               unpack)


@dataclass(frozen=True)
class PipeRecipe:
    """How zerorun.pipeline cuts one transformers model class."""

    family: str
    task: str
    """The task the class does (causal_lm or sequence_classification)."""
    layers: Callable
    """(model, path, LayerSpec, TiedLayerSpec) -> the layer specs; ``path(module)`` is its name in the model."""
    checkpointable: Tuple[str, ...]
    """Layer classes DeepSpeed may recompute in backward (never the embeddings: with the reentrant checkpoint a
    segment whose inputs need no grad, token ids, is cut off from autograd)."""


class GPT2TokenEmbeddingPipe(HFPart):
    """GPT-2 token embedding (``wte``); the tied module, ``.weight`` is ``wte.weight``.

    In: input_ids | (input_ids,) | (input_ids, attention_mask). Out: (inputs_embeds, mask int64).
    """

    def __init__(self, wte: nn.Embedding, path: str):
        super().__init__([("wte", wte, path)])

    @property
    def weight(self) -> nn.Parameter:  # TiedLayerSpec(tied_weight_attr="weight") reads this with getattr
        return self.wte.weight

    def forward(self, inputs):
        input_ids, mask = unpack(inputs, 2)
        input_ids = input_ids.view(-1, input_ids.size(-1))
        return self.wte(input_ids), transport_mask(mask, input_ids)


def gpt2_lm_head(embed: GPT2TokenEmbeddingPipe, inputs) -> torch.Tensor:
    """forward_fn of the tied LM head: logits = hidden @ wte.weight.T (as HF's bias-free lm_head Linear)."""
    hidden = inputs if torch.is_tensor(inputs) else inputs[0]
    return F.linear(hidden, embed.weight)


class GPT2PositionEmbeddingPipe(HFPart):
    """Adds GPT-2 position embeddings (positions 0..T-1, as GPT2Model without a cache) and embedding dropout."""

    def __init__(self, wpe: nn.Embedding, wpe_path: str, drop: nn.Module, drop_path: str):
        super().__init__([("wpe", wpe, wpe_path), ("drop", drop, drop_path)])

    def forward(self, inputs):
        embeds, mask = inputs
        position_ids = torch.arange(embeds.size(1), device=embeds.device).unsqueeze(0)
        hidden = embeds + self.wpe(position_ids).to(embeds.device)
        return self.drop(hidden), mask


class GPT2BlockPipe(HFPart):
    """One GPT2Block. Builds the 4-D causal(+padding) mask from the carried int mask with
    ``create_causal_mask``, as GPT2Model does in its default (use_cache) forward: no packed-sequence
    detection, and with SDPA and no padding the mask is dropped in favour of ``is_causal``."""

    def __init__(self, block: nn.Module, path: str, config):
        super().__init__([("block", block, path)])
        self.config = config

    def forward(self, inputs):
        from transformers.masking_utils import create_causal_mask

        hidden, mask = inputs
        cache_position = torch.arange(hidden.size(1), device=hidden.device)
        causal_mask = create_causal_mask(config=self.config, input_embeds=hidden, attention_mask=mask,
                                         cache_position=cache_position, past_key_values=None, position_ids=None)
        out = self.block(hidden, None, cache_position, causal_mask, None, None,
                         encoder_attention_mask=None, use_cache=False, output_attentions=False)
        return out[0], mask


class GPT2FinalNormPipe(HFPart):
    """The final LayerNorm (``ln_f``); drops the mask: nothing after it needs one."""

    def __init__(self, ln_f: nn.Module, path: str):
        super().__init__([("ln_f", ln_f, path)])

    def forward(self, inputs):
        hidden = inputs if torch.is_tensor(inputs) else inputs[0]
        return self.ln_f(hidden)


class EncoderEmbeddingPipe(HFPart):
    """BERT/RoBERTa embeddings (word + position + token type, LayerNorm, dropout).

    In: input_ids | (input_ids, attention_mask) | (input_ids, attention_mask, token_type_ids).
    Out: (hidden, mask int64).
    """

    def __init__(self, embeddings: nn.Module, path: str):
        super().__init__([("embeddings", embeddings, path)])

    def forward(self, inputs):
        input_ids, mask, token_type_ids = unpack(inputs, 3)
        hidden = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        return hidden, transport_mask(mask, input_ids)


class EncoderLayerPipe(HFPart):
    """One BertLayer/RobertaLayer; builds the extended attention mask as BertModel.forward does."""

    def __init__(self, layer: nn.Module, path: str, config):
        super().__init__([("layer", layer, path)])
        self.sdpa_masks = (config._attn_implementation == "sdpa"
                           and getattr(config, "position_embedding_type", "absolute") == "absolute"
                           and not config.output_attentions)

    def forward(self, inputs):
        from transformers.modeling_attn_mask_utils import _prepare_4d_attention_mask_for_sdpa

        hidden, mask = inputs
        if self.sdpa_masks:
            extended = _prepare_4d_attention_mask_for_sdpa(mask, hidden.dtype, tgt_len=hidden.size(1))
        else:  # PreTrainedModel.get_extended_attention_mask, in the model's parameter dtype
            dtype = next(self.layer.parameters()).dtype
            extended = mask[:, None, None, :].to(dtype=dtype)
            extended = (1.0 - extended) * torch.finfo(dtype).min
        out = self.layer(hidden, extended, None, None, encoder_attention_mask=None, past_key_values=None,
                         output_attentions=False, cache_position=None)
        return out[0], mask


class BertClassifierHeadPipe(HFPart):
    """BertForSequenceClassification's head: pooler (first token, dense, tanh), dropout, classifier."""

    def __init__(self, pooler: nn.Module, pooler_path: str, dropout: nn.Module, dropout_path: str,
                 classifier: nn.Module, classifier_path: str):
        super().__init__([("pooler", pooler, pooler_path), ("dropout", dropout, dropout_path),
                          ("classifier", classifier, classifier_path)])

    def forward(self, inputs):
        hidden = inputs if torch.is_tensor(inputs) else inputs[0]
        return self.classifier(self.dropout(self.pooler(hidden)))


class RobertaClassifierHeadPipe(HFPart):
    """RobertaForSequenceClassification's head (RobertaClassificationHead on the first token)."""

    def __init__(self, classifier: nn.Module, path: str):
        super().__init__([("classifier", classifier, path)])

    def forward(self, inputs):
        return self.classifier(inputs if torch.is_tensor(inputs) else inputs[0])


def _gpt2_layers(model: nn.Module, path, LayerSpec, TiedLayerSpec) -> list:
    if model.config.add_cross_attention:
        raise ValueError("GPT-2 with cross-attention (add_cross_attention=True) is not supported in the pipeline.")
    tr = model.transformer
    tied = model.lm_head.weight is tr.wte.weight
    if tied:
        layers: list = [TiedLayerSpec(TIED_EMBED_KEY, GPT2TokenEmbeddingPipe, tr.wte, path(tr.wte),
                                      tied_weight_attr="weight")]
    else:
        layers = [LayerSpec(GPT2TokenEmbeddingPipe, tr.wte, path(tr.wte))]
    layers.append(LayerSpec(GPT2PositionEmbeddingPipe, tr.wpe, path(tr.wpe), tr.drop, path(tr.drop)))
    layers += [LayerSpec(GPT2BlockPipe, block, path(block), model.config) for block in tr.h]
    layers.append(LayerSpec(GPT2FinalNormPipe, tr.ln_f, path(tr.ln_f)))
    if tied:
        layers.append(TiedLayerSpec(TIED_EMBED_KEY, GPT2TokenEmbeddingPipe, tr.wte, path(tr.wte),
                                    forward_fn=gpt2_lm_head, tied_weight_attr="weight"))
    else:
        layers.append(LayerSpec(LMHeadPipe, model.lm_head, path(model.lm_head)))
    return layers


def _encoder_classifier_layers(model: nn.Module, path, LayerSpec, TiedLayerSpec) -> list:
    cls, config = type(model).__name__, model.config
    if config.is_decoder or config.add_cross_attention:
        raise ValueError(f"{cls} configured as a decoder is not supported in the pipeline.")
    if config.problem_type not in (None, "single_label_classification") or config.num_labels < 2:
        raise ValueError(f"{cls} with problem_type={config.problem_type}, num_labels={config.num_labels}: "
                         "the pipeline trains single-label classification (num_labels >= 2).")
    bert = hasattr(model, "bert")
    encoder = model.bert if bert else model.roberta
    layers = [LayerSpec(EncoderEmbeddingPipe, encoder.embeddings, path(encoder.embeddings))]
    layers += [LayerSpec(EncoderLayerPipe, layer, path(layer), config) for layer in encoder.encoder.layer]
    if bert:
        layers.append(LayerSpec(BertClassifierHeadPipe, encoder.pooler, path(encoder.pooler),
                                model.dropout, path(model.dropout), model.classifier, path(model.classifier)))
    else:
        layers.append(LayerSpec(RobertaClassifierHeadPipe, model.classifier, path(model.classifier)))
    return layers


PIPELINES: Dict[str, PipeRecipe] = {
    "GPT2LMHeadModel": PipeRecipe("gpt2", CAUSAL_LM, _gpt2_layers, ("GPT2BlockPipe",)),
    "BertForSequenceClassification": PipeRecipe("bert", SEQUENCE_CLASSIFICATION, _encoder_classifier_layers,
                                                ("EncoderLayerPipe",)),
    "RobertaForSequenceClassification": PipeRecipe("roberta", SEQUENCE_CLASSIFICATION, _encoder_classifier_layers,
                                                   ("EncoderLayerPipe",)),
}
"""The transformers classes zerorun.pipeline cuts, by class name."""
