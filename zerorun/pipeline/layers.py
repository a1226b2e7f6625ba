"""Hugging Face models as DeepSpeed pipelines, with the same parameters, and back: the shared layer base.

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

Each model class's layer list and its wrappers live with its family (zerorun/arch/pipe_classic.py: GPT-2,
BERT, RoBERTa; zerorun/arch/pipe_decoder.py: Llama, Qwen2, Mistral); this module holds what every family shares: the tasks and their losses, the transport of
inputs and the padding mask, ``HFPart`` (a layer that names its parameters as the HF model does) and the
untied LM head.

Without an attention mask every layer uses an all-ones mask, which Hugging Face's mask functions
treat exactly as "no mask" (the causal/SDPA ``is_causal`` path for a decoder), so logits equal the HF
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
TIED_EMBED_KEY = "embed"
"""The key of a tied input/output embedding (DeepSpeed TiedLayerSpec): one module on the first and last stage."""


# ----------------------------------------------------------------------------------------------
# Tasks and losses


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


def loss_fn_for(task: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The ``loss_fn(outputs, labels)`` for a PipelineModule doing ``task`` (module.resolve_task's answer)."""
    name = getattr(task, "value", task)
    if name == CAUSAL_LM:
        return causal_lm_loss
    if name == SEQUENCE_CLASSIFICATION:
        return sequence_classification_loss
    raise ValueError(f"task={name}: no pipeline loss for it.")


# ----------------------------------------------------------------------------------------------
# Layers: thin wrappers around the Hugging Face model's own submodules


def unpack(inputs, n: int) -> List[Optional[torch.Tensor]]:
    """A tensor or a tuple/list of up to n tensors -> a list of n (missing ones None)."""
    items = [inputs] if torch.is_tensor(inputs) else list(inputs)
    if not 1 <= len(items) <= n or not all(torch.is_tensor(t) for t in items):
        raise ValueError(f"expected a tensor or a tuple of 1..{n} tensors, got {type(inputs).__name__} "
                         f"of {len(items)} items")
    return items + [None] * (n - len(items))


def transport_mask(mask: Optional[torch.Tensor], input_ids: torch.Tensor) -> torch.Tensor:
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


class LMHeadPipe(HFPart):
    """An untied LM head (``tie_word_embeddings=False``)."""

    def __init__(self, lm_head: nn.Module, path: str):
        super().__init__([("lm_head", lm_head, path)])

    def forward(self, inputs):
        return self.lm_head(inputs if torch.is_tensor(inputs) else inputs[0])
