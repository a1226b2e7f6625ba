"""Hugging Face GPT-2 / BERT / RoBERTa models as DeepSpeed pipelines, with the same parameters, and back.

``pipeline_layers(model, task)`` cuts an already built Hugging Face model (``from_pretrained`` or
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

import functools
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

CAUSAL_LM = "causal_lm"
SEQUENCE_CLASSIFICATION = "sequence_classification"
PARTITION_METHODS = ("parameters", "uniform")
TIED_EMBED_KEY = "embed"
# Layer classes DeepSpeed may checkpoint (recompute in backward). The embedding layers are left
# out on purpose: with DeepSpeed's default (reentrant) checkpoint a segment whose inputs need no
# grad (token ids) is cut off from autograd, and the embeddings would never get gradients.
CHECKPOINTABLE_LAYERS = ["GPT2BlockPipe", "EncoderLayerPipe"]


# ----------------------------------------------------------------------------------------------
# Tasks and losses


def resolve_task(model: nn.Module, task: Any = None) -> str:
    """causal_lm or sequence_classification, from ``task`` (a TaskName, a string, None/auto: the model class)."""
    name = getattr(task, "value", task)
    if name in (None, "", "auto"):
        cls = type(model).__name__
        if cls.endswith("LMHeadModel") or cls.endswith("ForCausalLM"):
            return CAUSAL_LM
        if cls.endswith("ForSequenceClassification"):
            return SEQUENCE_CLASSIFICATION
        raise ValueError(f"cannot tell the task of a {cls}; pass task=causal_lm or task=sequence_classification.")
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


# ----------------------------------------------------------------------------------------------
# The layer list


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


# ----------------------------------------------------------------------------------------------
# Back to Hugging Face names


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

    Only data-parallel replica 0 of each stage sends its layers (the other replicas hold the same
    values); tensors travel as pickled CPU tensors through ``torch.distributed.gather_object``.
    """
    import torch.distributed as dist

    module = getattr(pipe_module, "module", pipe_module)  # an engine or the PipelineModule
    grid = getattr(module, "_grid", None)
    mine = stage_state_dict(module) if grid is None or grid.data_parallel_id == 0 else {}
    rank = dist.get_rank()
    gathered = [None] * dist.get_world_size() if rank == dst else None
    dist.gather_object(mine, gathered, dst=dst)
    if rank != dst:
        return None
    return merge_state_dicts(gathered, original_model)
