"""Hugging Face GPT-2 / BERT / RoBERTa models as DeepSpeed pipelines, with the same parameters, and back.

Layers for ``pipeline_layers(model, task)`` (module.py), which cuts an already built Hugging Face model (``from_pretrained`` or
``from_config``) into the flat list of layers a ``deepspeed.pipe.PipelineModule`` wants. The layers
*wrap the model's own submodules*: no weight is copied, so the pipeline trains exactly the tensors
the HF model holds, and pretrained weights need nothing beyond ``from_pretrained``.

What travels between layers (and so between pipeline stages)
-----------------------------------------------------------
DeepSpeed hands each layer the previous layer's output: a tensor or a tuple of tensors, never
``None``. Every floating tensor crossing a stage boundary is given ``requires_grad`` by the receiver
and must get a gradient back (the engine asserts it), so the attention mask travels as an
**int64** tensor: DeepSpeed skips non-floating tensors when it sends gradients, and ``[B, T]``
integers are cheaper to send than a ``[B, 1, T, T]`` float mask. Each transformer layer rebuilds the
4-D mask itself, with the same Hugging Face function and arguments as the model's own forward.

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

Without an attention mask every layer uses an all-ones mask, which Hugging Face's mask functions
treat exactly as "no mask" (the causal/SDPA ``is_causal`` path for GPT-2), so logits equal the HF
forward's bit for bit in eval mode.

Back to Hugging Face names
--------------------------
Each wrapper knows the HF path of the submodules it holds. ``stage_state_dict(pipe_module)`` gives
``{hf_name: tensor}`` for the layers *this rank* owns; ``merge_state_dicts`` / ``export_state_dict``
combine the dicts of all stages into the full HF state dict (tied weights: one tensor under all of
the HF names, e.g. ``lm_head.weight is transformer.wte.weight``), ready for
``model.load_state_dict(sd)`` and ``save_pretrained``. ``gather_hf_state_dict`` does the collective
gather onto one rank in a real multi-stage run.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

CAUSAL_LM = "causal_lm"
SEQUENCE_CLASSIFICATION = "sequence_classification"
TASK_OF_CLASS = {"GPT2LMHeadModel": CAUSAL_LM, "BertForSequenceClassification": SEQUENCE_CLASSIFICATION,
                 "RobertaForSequenceClassification": SEQUENCE_CLASSIFICATION}
"""The Hugging Face classes the pipeline cuts, and the task each one does."""


# ----------------------------------------------------------------------------------------------
# Tasks and losses


def resolve_task(model: nn.Module, task: Any = None) -> str:
    """causal_lm or sequence_classification, from ``task`` (a TaskName, a string, None/auto: the model class)."""
    name = getattr(task, "value", task)
    if name in (None, "", "auto"):
        cls = type(model).__name__
        if cls not in TASK_OF_CLASS:
            raise ValueError(f"{cls}: the pipeline supports {', '.join(TASK_OF_CLASS)}.")
        return TASK_OF_CLASS[cls]
    if name not in (CAUSAL_LM, SEQUENCE_CLASSIFICATION):
        raise ValueError(f"task={name}: the pipeline supports causal_lm and sequence_classification.")
    return name


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Hugging Face's ForCausalLMLoss: fp32 logits, labels shifted left by one (the last position
    predicts nothing), mean over the tokens whose label is not ``ignore_index``."""
    logits = logits.float()
    labels = F.pad(labels, (0, 1), value=ignore_index)
    shift_labels = labels[..., 1:].contiguous()
    logits = logits.view(-1, logits.size(-1))
    shift_labels = shift_labels.view(-1).to(logits.device)
    return F.cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction="mean")


def sequence_classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's single_label_classification loss: cross-entropy over num_labels, mean over the batch
    (in the logits' dtype, as BertForSequenceClassification computes it)."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1).to(logits.device))


def loss_fn_for(task: Any, model: Optional[nn.Module] = None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The ``loss_fn(outputs, labels)`` for a PipelineModule doing ``task``."""
    name = resolve_task(model, task) if model is not None else getattr(task, "value", task)
    if name == CAUSAL_LM:
        return causal_lm_loss
    if name == SEQUENCE_CLASSIFICATION:
        return sequence_classification_loss
    raise ValueError(f"task={name}: no pipeline loss for it.")


# ----------------------------------------------------------------------------------------------
# Layers: thin wrappers around the Hugging Face model's own submodules


def _unpack(inputs, n: int) -> List[Optional[torch.Tensor]]:
    """A tensor or a tuple/list of up to n tensors -> a list of n (missing ones None)."""
    items = [inputs] if torch.is_tensor(inputs) else list(inputs)
    if not 1 <= len(items) <= n or not all(torch.is_tensor(t) for t in items):
        raise ValueError(f"expected a tensor or a tuple of 1..{n} tensors, got {type(inputs).__name__} "
                         f"of {len(items)} items")
    return items + [None] * (n - len(items))


def _transport_mask(mask: Optional[torch.Tensor], input_ids: torch.Tensor) -> torch.Tensor:
    """The padding mask as it travels between layers: int64 [B, T] (all ones when none was given)."""
    if mask is None:
        return torch.ones_like(input_ids, dtype=torch.long)
    return mask.view(input_ids.size(0), -1).to(torch.long)


class HFPart(nn.Module):
    """A pipeline layer made of submodules of a Hugging Face model.

    ``hf_paths`` maps each child's name here to its module path in the HF model, so the layer can
    name its parameters the way the HF model does (``hf_state_dict``).
    """

    def __init__(self, parts: Sequence[Tuple[str, nn.Module, str]]):
        super().__init__()
        self.hf_paths: Dict[str, str] = {}
        for name, module, path in parts:
            self.add_module(name, module)
            self.hf_paths[name] = path

    def hf_state_dict(self) -> Dict[str, torch.Tensor]:
        out = {}
        for key, value in self.state_dict().items():
            child, _, rest = key.partition(".")
            path = self.hf_paths[child]
            out[f"{path}.{rest}" if path else rest] = value
        return out

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.hf_paths.items())


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
        input_ids, mask = _unpack(inputs, 2)
        input_ids = input_ids.view(-1, input_ids.size(-1))
        return self.wte(input_ids), _transport_mask(mask, input_ids)


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


class LMHeadPipe(HFPart):
    """An untied LM head (``tie_word_embeddings=False``)."""

    def __init__(self, lm_head: nn.Module, path: str):
        super().__init__([("lm_head", lm_head, path)])

    def forward(self, inputs):
        return self.lm_head(inputs if torch.is_tensor(inputs) else inputs[0])


class EncoderEmbeddingPipe(HFPart):
    """BERT/RoBERTa embeddings (word + position + token type, LayerNorm, dropout).

    In: input_ids | (input_ids, attention_mask) | (input_ids, attention_mask, token_type_ids).
    Out: (hidden, mask int64).
    """

    def __init__(self, embeddings: nn.Module, path: str):
        super().__init__([("embeddings", embeddings, path)])

    def forward(self, inputs):
        input_ids, mask, token_type_ids = _unpack(inputs, 3)
        hidden = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        return hidden, _transport_mask(mask, input_ids)


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

