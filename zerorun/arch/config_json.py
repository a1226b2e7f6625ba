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
        if p.is_dir() and not f.exists():
            raise ArchitectureError(f"{p}: no config.json in this directory. Fix: model.name_or_path=<the checkpoint "
                                    "directory that holds the model's config.json>.") from None
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
    if not isinstance(kind, str) or not kind:
        raise ArchitectureError(f"{f}: no model_type, so transformers cannot tell which architecture it describes")
    return traced_fields(kind, d, str(f))


def traced_fields(kind: str, d: Dict[str, Any], where: str) -> Dict[str, Any]:
    """Any other model_type transformers knows: planned from the model it builds (traced.py). The summary fields
    (layers, widths, vocabulary) come from transformers' own config class, defaults included. Cached with the
    traces: a model planned before is read back without importing torch."""
    from .traced import cached, clean_fields

    fields = clean_fields(d)
    return dict(cached("fields", {"model_type": kind, "fields": fields, "auto_map": bool(d.get("auto_map"))},
                       lambda: _traced_fields(kind, d, where)))


def _traced_fields(kind: str, d: Dict[str, Any], where: str) -> Dict[str, Any]:
    from .traced import TraceError, build_config, census, clean_fields, kinds_of, trace_point

    if d.get("auto_map"):
        raise ArchitectureError(f"{where}: model_type {kind!r} needs the checkpoint's own Python code (auto_map); "
                                "zerorun runs transformers' built-in architectures only")
    try:
        from transformers import CONFIG_MAPPING

        if kind not in CONFIG_MAPPING:
            raise ArchitectureError(f"{where}: model_type {kind!r} is not an architecture transformers "
                                    f"{_transformers_version()} knows. Fix: a newer transformers, or a model file "
                                    "(+model=NAME) of a known one.")
        fields = clean_fields(d)
        cfg = build_config(kind, fields)
        causal, classifier = kinds_of(kind)
        if not (causal or classifier):
            raise ArchitectureError(f"{where}: model_type {kind!r} has neither a causal-LM nor a sequence-"
                                    "classification class in transformers, the two tasks zerorun trains")
        task = "causal_lm" if causal else "sequence_classification"
        census(kind, fields, task)  # builds it (meta device) and finds its layers, or says why not
        trace_point(kind, fields, task, 2, layers=1, batch=1, seq=8, dtype="fp32", no_cache=False)  # and runs it
    except TraceError as e:
        raise ArchitectureError(f"{where}: {e}; zerorun plans a model from its own forward pass, so it trains "
                                "only what that pass can run") from None
    h, a = cfg.hidden_size, cfg.num_attention_heads
    inner = getattr(cfg, "intermediate_size", None) or 4 * h
    return dict(family="traced_decoder" if causal else "traced_encoder", model_type=kind, hf_config=fields,
                num_layers=cfg.num_hidden_layers, hidden_size=h, num_heads=a,
                num_kv_heads=getattr(cfg, "num_key_value_heads", None) or a,
                head_dim=getattr(cfg, "head_dim", None) or h // a, intermediate_size=inner,
                vocab_size=cfg.vocab_size, max_positions=getattr(cfg, "max_position_embeddings", None) or 512,
                tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
                dropout=float(getattr(cfg, "attention_dropout", 0.0) or 0.0))


def _transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "cls_token_id", "sep_token_id", "mask_token_id",
                 "decoder_start_token_id")


def micro_fields(d: Dict[str, Any], *, layers: int, hidden: int, heads: int, inner: int, vocab: int,
                 positions: int) -> Dict[str, Any]:
    """A config.json's fields at micro size, the same model_type and so the same code paths (what
    process_probe.py's micro rank builds): every width transformers reads by its standard name shrunk, grouped
    key/value heads kept grouped, per-layer patterns (Gemma's ``layer_types``) cut to the layers, token ids inside the
    smaller vocabulary. Experts keep their count (the router's code path), and fields of no standard name (rope
    scaling, soft caps, windows) stay as they are."""
    out = dict(d)
    for key, value in d.items():  # widths named after the hidden size (DeBERTa's pooler_hidden_size, embedding_size)
        if ("hidden" in key or key == "embedding_size") and value == d.get("hidden_size") and key != "hidden_size":
            out[key] = hidden
    kv = d.get("num_key_value_heads")
    out.update(hidden_size=hidden, num_hidden_layers=min(layers, d.get("num_hidden_layers") or layers),
               num_attention_heads=heads, intermediate_size=inner, vocab_size=vocab)
    if kv is not None:
        out["num_key_value_heads"] = 1 if kv < (d.get("num_attention_heads") or kv) else heads
    if d.get("head_dim") is not None:
        out["head_dim"] = hidden // heads
    if d.get("moe_intermediate_size") is not None:
        out["moe_intermediate_size"] = inner // 2
    if d.get("max_position_embeddings") is not None:
        out["max_position_embeddings"] = min(d["max_position_embeddings"], max(positions, 512))
    pattern = d.get("layer_types")
    if isinstance(pattern, list) and pattern:
        from .traced import cut_layer_types

        out["layer_types"] = cut_layer_types(pattern, out["num_hidden_layers"])
    for key in TOKEN_ID_KEYS:
        ids = d.get(key)
        if isinstance(ids, int) and not isinstance(ids, bool):
            out[key] = min(ids, vocab - 1)
        elif isinstance(ids, list):
            out[key] = [min(i, vocab - 1) if isinstance(i, int) else i for i in ids]
    return out
