"""The Llama-class decoder (Llama, Qwen2, Mistral): its architecture, read from a config.json or a model file,
and its arithmetic side by side: parameter tensors, what one layer saves for backward, FLOPs per token.

docs/research/hf-decoders-and-lora.md holds what each formula was checked against (transformers 4.57.6: models
built on the meta device, saved-tensor hooks on CPU). The modern decoder differs from GPT-2 where memory is
decided: RMSNorm (an fp32 copy of its input), a gated MLP (three projections, SwiGLU), grouped-query attention
(K/V heads ≠ query heads), rotary embeddings (cos/sin once per micro-batch), untied heads and 128k-150k
vocabularies (the logits term dominates).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Tuple

DECODER_TYPES = ("llama", "qwen2", "mistral")
"""``model_type`` values of config.json this module plans (the transformers classes of the same names)."""
KV_HEADS_DEFAULT = {"llama": None, "qwen2": 32, "mistral": 8}
"""A config.json without num_key_value_heads: the class default (None: as many as query heads)."""


@dataclass(frozen=True)
class Decoder:
    """What a Llama-class decoder is made of: the fields of its config.json that decide memory and compute."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int
    tied: bool
    qkv_bias: bool
    """Qwen2 has q/k/v biases (hard-coded); Llama only with ``attention_bias`` (and then o_proj too)."""
    o_bias: bool = False
    mlp_bias: bool = False

    # ---------------------------------------------------------------- parameters (research §1)
    def layer_tensors(self) -> Tuple[int, ...]:
        """One decoder layer's parameter tensors (numel), in module order."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = [h * q, *([q] if self.qkv_bias else []), h * kv, *([kv] if self.qkv_bias else []),
                h * kv, *([kv] if self.qkv_bias else []), q * h, *([h] if self.o_bias else [])]
        i = self.intermediate
        mlp = [h * i, *([i] if self.mlp_bias else []), h * i, *([i] if self.mlp_bias else []),
               i * h, *([h] if self.mlp_bias else [])]
        return (h, *attn, h, *mlp)  # input_layernorm, attention, post_attention_layernorm, gate/up/down

    def embedding_tensors(self) -> Tuple[int, ...]:
        return (self.vocab * self.hidden,)

    def head_tensors(self) -> Tuple[int, ...]:
        """The final norm, and the LM head when it is not tied to the embedding."""
        return (self.hidden,) if self.tied else (self.hidden, self.vocab * self.hidden)

    def total_params(self) -> int:
        return sum(self.embedding_tensors()) + self.layers * sum(self.layer_tensors()) + sum(self.head_tensors())

    # ---------------------------------------------------------------- activations (research §2)
    def saved_per_layer(self, b: int, s: int, e: int, masked: bool) -> List[Tuple[int, int]]:
        """(count, bytes) of the tensors one layer saves for backward with SDPA: RMSNorm's fp32 input, its rsqrt
        and normalized output (×2 norms), the projections' inputs, SwiGLU's four I-wide tensors, q, k, v, the
        attention output and its fp32 log-sum-exp. ``masked``: the materialized-mask path (no KV cache, i.e.
        checkpointing's recomputation, or padding): K and V repeated to every query head, and the mask in the
        compute dtype per layer."""
        t, h, i = b * s, self.hidden, self.intermediate
        return [(2, 4 * h * t), (2, 4 * t), (2, e * h * t), (2, e * h * t), (4, e * i * t),
                *self._attention_saved(b, s, e, masked)]

    def _attention_saved(self, b: int, s: int, e: int, masked: bool) -> List[Tuple[int, int]]:
        """What SDPA keeps whether or not the projections train: q and its output, k and v (at every query head on
        the masked path), the fp32 log-sum-exp, and on the masked path the mask in the compute dtype."""
        t, a, d = b * s, self.heads, self.head_dim
        kv = a if masked else self.kv_heads
        return [(2, e * a * d * t), (2, e * kv * d * t), (1, 4 * a * t), *([(1, e * s * t)] if masked else [])]

    def saved_per_layer_lora(self, b: int, s: int, e: int, masked: bool, targets, r: int, dropout: float,
                             mask_bytes: int) -> List[Tuple[int, int]]:
        """The same with the base frozen and LoRA on ``targets`` (research §3.5): frozen projections save no input
        and frozen norms no normalized output; each adapted module's lora_A saves its input once per distinct input
        tensor (q/k/v share the norm output, gate/up theirs; o_proj's is SDPA's saved output), or with dropout
        its own mask and dropout output; lora_B saves lora_A's output (r wide)."""
        t, h, i, a, d = b * s, self.hidden, self.intermediate, self.heads, self.head_dim
        out = [(2, 4 * h * t), (2, 4 * t), (3, e * i * t), *self._attention_saved(b, s, e, masked)]
        inputs = {"q_proj": ("attn", h), "k_proj": ("attn", h), "v_proj": ("attn", h), "o_proj": ("o", a * d),
                  "gate_proj": ("mlp", h), "up_proj": ("mlp", h), "down_proj": ("down", i)}
        used = [inputs[n] for n in targets if n in inputs]
        if dropout > 0:
            out += [(1, (mask_bytes + e) * width * t) for _, width in used]
        else:
            out += [(1, e * width * t) for key, width in sorted(set(used)) if key != "o"]
        return out + [(len(used), e * r * t)]

    def saved_outside_lora(self, b: int, s: int, e: int) -> List[Tuple[int, int]]:
        """Outside the layers with a frozen base: the final norm's fp32 input and rsqrt, RoPE's cos and sin."""
        t = b * s
        return [(1, 4 * self.hidden * t), (1, 4 * t), (2, e * s * self.head_dim)]

    def saved_outside(self, b: int, s: int, e: int) -> List[Tuple[int, int]]:
        """Saved outside the layers: the final norm (as a layer's), the LM head's input, RoPE's cos and sin."""
        t, h = b * s, self.hidden
        return [(1, 4 * h * t), (1, 4 * t), (1, e * h * t), (1, e * h * t), (2, e * s * self.head_dim)]

    def flops_per_token(self, seq: int) -> int:
        """Forward FLOPs per token: 2 per weight multiply-add, plus attention's scores and values (causal)."""
        weights = self.layers * sum(self.layer_tensors()) + self.vocab * self.hidden
        return 2 * weights + 2 * self.layers * self.heads * self.head_dim * seq

    # ---------------------------------------------------------------- transformers
    def hf_config_kwargs(self) -> Dict[str, Any]:
        return dict(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                    num_hidden_layers=self.layers, num_attention_heads=self.heads,
                    num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                    max_position_embeddings=self.max_positions, tie_word_embeddings=self.tied,
                    **({"attention_bias": self.o_bias, "mlp_bias": self.mlp_bias}
                       if self.model_type == "llama" else {}))


def model_code(m) -> str:
    """The transformers module directory that builds a ModelConfig: the decoder's model_type for family=llama, else
    the family's own name (gpt2, bert, roberta)."""
    family = getattr(m.family, "value", m.family)
    return m.model_type if family == "llama" else family


def decoder_of(m) -> Decoder:
    """The decoder a ModelConfig (family=llama) describes."""
    kv = m.num_kv_heads or m.num_heads
    return Decoder(model_type=m.model_type or "llama", hidden=m.hidden_size, layers=m.num_layers,
                   heads=m.num_heads, kv_heads=kv, head_dim=m.head_dim or m.hidden_size // m.num_heads,
                   intermediate=m.intermediate_size, vocab=m.vocab_size, max_positions=m.max_positions,
                   tied=m.tie_word_embeddings,
                   # Qwen2's q/k/v biases are hard-coded; Mistral has none whatever attention_bias says
                   qkv_bias=m.model_type == "qwen2" or (m.model_type == "llama" and m.attention_bias),
                   o_bias=m.model_type == "llama" and m.attention_bias,
                   mlp_bias=m.model_type == "llama" and m.mlp_bias)


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


# ---------------------------------------------------------------- LoRA (peft)
LORA_DEFAULT_TARGETS = {"llama": ("q_proj", "v_proj"), "qwen2": ("q_proj", "v_proj"), "mistral": ("q_proj", "v_proj"),
                        "gpt2": ("c_attn",), "bert": ("query", "value"), "roberta": ("query", "value")}
"""peft's own defaults (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING) for ``adapter.target_modules: []``."""


def layer_linears(m) -> Dict[str, List[Tuple[int, int]]]:
    """Each transformer layer's projections by the module name peft matches: name → [(in, out), ...] (GPT-2's
    ``c_proj`` and BERT's ``dense`` name several modules of a layer; peft adapts all of them)."""
    h, i = m.hidden_size, m.intermediate_size or 4 * m.hidden_size
    fam = getattr(m.family, "value", m.family)
    if fam == "llama":
        d = decoder_of(m)
        q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
        return {"q_proj": [(h, q)], "k_proj": [(h, kv)], "v_proj": [(h, kv)], "o_proj": [(q, h)],
                "gate_proj": [(h, i)], "up_proj": [(h, i)], "down_proj": [(i, h)]}
    if fam == "gpt2":
        return {"c_attn": [(h, 3 * h)], "c_proj": [(h, h), (i, h)], "c_fc": [(h, i)]}
    return {"query": [(h, h)], "key": [(h, h)], "value": [(h, h)], "dense": [(h, h), (h, i), (i, h)]}


def lora_targets(m, adapter) -> Tuple[str, ...]:
    return tuple(adapter.target_modules) or LORA_DEFAULT_TARGETS[model_code(m)]


def adapted_shapes(m, targets) -> Tuple[Tuple[int, int], ...]:
    """The (in, out) of every module of one layer that LoRA on ``targets`` adapts."""
    linears = layer_linears(m)
    return tuple(shape for name in targets for shape in linears.get(name, []))


def lora_layer_tensors(m, adapter) -> Tuple[int, ...]:
    """The adapter tensors one layer gains: lora_A r×in and lora_B out×r per adapted module (numel)."""
    return tuple(n for fan_in, fan_out in adapted_shapes(m, lora_targets(m, adapter))
                 for n in (adapter.r * fan_in, fan_out * adapter.r))
