"""A checkpoint's config.json → the model-file fields (config/schema.py ModelConfig) zerorun plans with."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

from .decoder import DECODER_TYPES, KV_HEADS_DEFAULT


class ArchitectureError(ValueError):
    """A config.json zerorun cannot plan (the message names the field and what would work)."""


def model_fields_from_config_json(path: str) -> Dict[str, Any]:
    """The model-file fields (config/schema.py ModelConfig) that a checkpoint's config.json describes: GPT-2,
    BERT/RoBERTa, or a Llama-class decoder (llama, qwen2, mistral). Raises ArchitectureError for anything else."""
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    try:
        d = json.loads(f.read_text())
    except OSError as e:
        raise ArchitectureError(f"{f}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise ArchitectureError(f"{f}: not JSON ({e})") from None
    if not isinstance(d, dict):
        raise ArchitectureError(f"{f}: not a JSON object")
    kind = d.get("model_type")

    def need(*keys):
        for k in keys:
            if isinstance(d.get(k), int) and not isinstance(d.get(k), bool) and d[k] > 0:
                return d[k]
        raise ArchitectureError(f"{f}: model_type {kind} needs a positive integer {keys[0]}")

    if kind == "gpt2":
        h = need("n_embd", "hidden_size")
        return dict(family="gpt2", model_type="gpt2", num_layers=need("n_layer", "num_hidden_layers"), hidden_size=h,
                    num_heads=need("n_head", "num_attention_heads"),
                    intermediate_size=d.get("n_inner") or 4 * h, vocab_size=need("vocab_size"),
                    max_positions=need("n_positions", "max_position_embeddings"),
                    dropout=float(d.get("resid_pdrop", 0.1)))
    if kind in ("bert", "roberta"):
        return dict(family=kind, model_type=kind, num_layers=need("num_hidden_layers"), hidden_size=need("hidden_size"),
                    num_heads=need("num_attention_heads"), intermediate_size=need("intermediate_size"),
                    vocab_size=need("vocab_size"), max_positions=need("max_position_embeddings"),
                    type_vocab_size=d.get("type_vocab_size") or 2, dropout=float(d.get("hidden_dropout_prob", 0.1)))
    if kind in DECODER_TYPES:
        h, a = need("hidden_size"), need("num_attention_heads")
        kv = d.get("num_key_value_heads") or KV_HEADS_DEFAULT[kind] or a
        return dict(family="llama", model_type=kind, num_layers=need("num_hidden_layers"), hidden_size=h,
                    num_heads=a, num_kv_heads=kv, head_dim=d.get("head_dim") or h // a,
                    intermediate_size=need("intermediate_size"), vocab_size=need("vocab_size"),
                    max_positions=need("max_position_embeddings"),
                    tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                    attention_bias=bool(d.get("attention_bias", False)), mlp_bias=bool(d.get("mlp_bias", False)),
                    dropout=float(d.get("attention_dropout", 0.0)))
    raise ArchitectureError(f"{f}: model_type {kind!r} is not one zerorun plans yet (gpt2, bert, roberta, "
                            f"{', '.join(DECODER_TYPES)}); pick a model file (+model=NAME) of a planned family")
