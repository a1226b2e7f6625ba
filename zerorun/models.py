"""Hugging Face GPT-2 / BERT models from a model file: random init from the architecture, or
pretrained weights from a hub name or a local checkpoint directory."""
from __future__ import annotations

from .config import Family, ModelConfig


class ModelLoadError(RuntimeError):
    """Pretrained weights could not be loaded; the message says how to fix it offline."""


def hf_config(m: ModelConfig, vocab_size: int | None = None):
    """The transformers config for the architecture the model file describes."""
    vocab = vocab_size or m.vocab_size
    if m.family == Family.gpt2:
        from transformers import GPT2Config

        return GPT2Config(vocab_size=vocab, n_positions=m.max_positions, n_embd=m.hidden_size,
                          n_layer=m.num_layers, n_head=m.num_heads, n_inner=m.intermediate_size,
                          resid_pdrop=m.dropout, embd_pdrop=m.dropout, attn_pdrop=m.dropout)
    from transformers import BertConfig

    return BertConfig(vocab_size=vocab, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                      num_attention_heads=m.num_heads, intermediate_size=m.intermediate_size,
                      max_position_embeddings=m.max_positions, type_vocab_size=m.type_vocab_size,
                      hidden_dropout_prob=m.dropout, attention_probs_dropout_prob=m.dropout,
                      num_labels=m.num_labels)


def _model_class(m: ModelConfig):
    from transformers import BertForSequenceClassification, GPT2LMHeadModel

    return GPT2LMHeadModel if m.family == Family.gpt2 else BertForSequenceClassification


def build_model(m: ModelConfig):
    """The model to train. Random init is seeded by the caller (same weights on every rank)."""
    model = _build(m)
    # Name the loss explicitly: transformers warns on every forward when the config leaves it unset.
    model.config.loss_type = "ForCausalLM" if m.family == Family.gpt2 else "ForSequenceClassification"
    return model


def _build(m: ModelConfig):
    cls = _model_class(m)
    if not m.pretrained:
        return cls(hf_config(m))
    if not m.name_or_path:
        raise ModelLoadError(
            f"model.pretrained=true but model {m.name} names no weights. Fix: model.name_or_path=<hub name or "
            "local checkpoint dir>, or model.pretrained=false."
        )
    try:
        return cls.from_pretrained(m.name_or_path)
    except OSError as e:
        raise ModelLoadError(offline_hint(m.name_or_path, e)) from None


def offline_hint(name: str, err: Exception) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (
        f"could not load pretrained weights '{name}' ({first}). Without network access, download it once "
        f"elsewhere (`huggingface-cli download {name}`), copy the directory here and set "
        "model.name_or_path=/path/to/it; or train from random init with model.pretrained=false."
    )


def check_pretrained_available(m: ModelConfig) -> str | None:
    """Before launch: can the weights be found? None if yes, else the actionable message."""
    if not m.pretrained:
        return None
    if not m.name_or_path:
        return (f"model.pretrained=true but model {m.name} names no weights. Fix: model.name_or_path=<hub name or "
                "local checkpoint dir>, or model.pretrained=false.")
    import os

    if os.path.isdir(m.name_or_path):
        if not os.path.isfile(os.path.join(m.name_or_path, "config.json")):
            return f"model.name_or_path={m.name_or_path}: no config.json there, so it is not a Hugging Face checkpoint."
        return None
    try:
        from huggingface_hub import hf_hub_download

        hf_hub_download(m.name_or_path, "config.json")
        return None
    except Exception as e:  # offline, unknown repo, gated: all mean "not loadable"
        return offline_hint(m.name_or_path, e)
