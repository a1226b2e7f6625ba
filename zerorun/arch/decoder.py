"""The Llama-class decoder (Llama, Qwen2, Mistral): its architecture, read from a config.json or a model file,
and its arithmetic side by side: parameter tensors, what one layer saves for backward, FLOPs per token.

docs/research/hf-decoders-and-lora.md holds what each formula was checked against (transformers 4.57.6: models
built on the meta device, saved-tensor hooks on CPU). The modern decoder differs from GPT-2 where memory is
decided: RMSNorm (an fp32 copy of its input), a gated MLP (three projections, SwiGLU), grouped-query attention
(K/V heads ≠ query heads), rotary embeddings (cos/sin once per micro-batch), untied heads and 128k-150k
vocabularies (the logits term dominates).
"""
from __future__ import annotations

from dataclasses import dataclass
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
    tp: int = 1
    """Tensor-parallel ranks (DeepSpeed AutoTP) the projections are split over; the tensors and activations below are
    then one rank's (the first: an uneven split gives it the larger share). AutoTP applies transformers' tensor-parallel
    plan: q/k/v and gate/up by output rows (column-parallel), o/down by input columns (row-parallel, their biases
    whole), an untied LM head by vocabulary rows with its logits gathered whole; embeddings, norms and a tied head
    stay whole on every rank (research tp-qlora-allocators.md; measured on a tiny Llama, tests/unit/test_tp.py)."""

    # ---------------------------------------------------------------- one tensor-parallel rank's share
    @property
    def local_heads(self) -> int:
        """Query heads on one rank: AutoTP splits attention by whole key/value groups."""
        return self.heads * self.local_kv_heads // self.kv_heads

    @property
    def local_kv_heads(self) -> int:
        return -(-self.kv_heads // self.tp)

    @property
    def local_intermediate(self) -> int:
        return -(-self.intermediate // self.tp)

    @property
    def head_vocab(self) -> int:
        """Rows of the LM head on one rank (an untied head is split by vocabulary; a tied one stays whole)."""
        return self.vocab if self.tied else -(-self.vocab // self.tp)

    # ---------------------------------------------------------------- parameters (research §1)
    def layer_tensors(self) -> Tuple[int, ...]:
        """One decoder layer's parameter tensors (numel), in module order."""
        h, q, kv = self.hidden, self.local_heads * self.head_dim, self.local_kv_heads * self.head_dim
        attn = [h * q, *([q] if self.qkv_bias else []), h * kv, *([kv] if self.qkv_bias else []),
                h * kv, *([kv] if self.qkv_bias else []), q * h, *([h] if self.o_bias else [])]
        i = self.local_intermediate
        mlp = [h * i, *([i] if self.mlp_bias else []), h * i, *([i] if self.mlp_bias else []),
               i * h, *([h] if self.mlp_bias else [])]
        return (h, *attn, h, *mlp)  # input_layernorm, attention, post_attention_layernorm, gate/up/down

    def embedding_tensors(self) -> Tuple[int, ...]:
        return (self.vocab * self.hidden,)

    def head_tensors(self) -> Tuple[int, ...]:
        """The final norm, and the LM head when it is not tied to the embedding."""
        return (self.hidden,) if self.tied else (self.hidden, self.head_vocab * self.hidden)

    def total_params(self) -> int:
        return sum(self.embedding_tensors()) + self.layers * sum(self.layer_tensors()) + sum(self.head_tensors())

    # ---------------------------------------------------------------- activations (research §2)
    def saved_per_layer(self, b: int, s: int, e: int, masked: bool) -> List[Tuple[int, int]]:
        """(count, bytes) of the tensors one layer saves for backward with SDPA: RMSNorm's fp32 input, its rsqrt
        and normalized output (×2 norms), the projections' inputs, SwiGLU's four I-wide tensors, q, k, v, the
        attention output and its fp32 log-sum-exp. ``masked``: the materialized-mask path (no KV cache, i.e.
        checkpointing's recomputation, or padding): K and V repeated to every query head, and the mask in the
        compute dtype per layer."""
        t, h, i = b * s, self.hidden, self.local_intermediate
        return [(2, 4 * h * t), (2, 4 * t), (2, e * h * t), (2, e * h * t), (4, e * i * t),
                *self._attention_saved(b, s, e, masked)]

    def _attention_saved(self, b: int, s: int, e: int, masked: bool) -> List[Tuple[int, int]]:
        """What SDPA keeps whether or not the projections train: q and its output, k and v (at every query head on
        the masked path), the fp32 log-sum-exp, and on the masked path the mask in the compute dtype."""
        t, a, d = b * s, self.local_heads, self.head_dim
        kv = a if masked else self.local_kv_heads
        return [(2, e * a * d * t), (2, e * kv * d * t), (1, 4 * a * t), *([(1, e * s * t)] if masked else [])]

    def saved_per_layer_lora(self, b: int, s: int, e: int, masked: bool, targets, r: int, dropout: float,
                             mask_bytes: int) -> List[Tuple[int, int]]:
        """The same with the base frozen and LoRA on ``targets`` (research §3.5): frozen projections save no input
        and frozen norms no normalized output; each adapted module's lora_A saves its input once per distinct input
        tensor (q/k/v share the norm output, gate/up theirs; o_proj's is SDPA's saved output), or with dropout
        its own mask and dropout output; lora_B saves lora_A's output (r wide)."""
        t, h, i, a, d = b * s, self.hidden, self.local_intermediate, self.local_heads, self.head_dim
        out = [(2, 4 * h * t), (2, 4 * t), (3, e * i * t), *self._attention_saved(b, s, e, masked)]
        inputs = {"q_proj": ("attn", h), "k_proj": ("attn", h), "v_proj": ("attn", h), "o_proj": ("o", a * d),
                  "gate_proj": ("mlp", h), "up_proj": ("mlp", h), "down_proj": ("down", i)}
        used = [inputs[n] for n in targets if n in inputs]
        if dropout > 0:
            out += [(1, (mask_bytes + e) * width * t) for _, width in used]
        else:
            out += [(1, e * width * t) for key, width in sorted(set(used)) if key != "o"]
        return out + [(len(used), e * r * t)]

    def saved_rope(self, s: int, e: int) -> List[Tuple[int, int]]:
        """RoPE's cos and sin, [1, s, head_dim] in the compute dtype: the model computes them once per forward and
        every layer saves the same two; a pipeline layer computes its own (zerorun/arch/pipe_decoder.py)."""
        return [(2, e * s * self.head_dim)]

    def saved_outside_lora(self, b: int, s: int, e: int) -> List[Tuple[int, int]]:
        """Outside the layers with a frozen base: the final norm's fp32 input and rsqrt, RoPE's cos and sin."""
        t = b * s
        return [(1, 4 * self.hidden * t), (1, 4 * t), *self.saved_rope(s, e)]

    def saved_outside(self, b: int, s: int, e: int) -> List[Tuple[int, int]]:
        """Saved outside the layers: the final norm (as a layer's), the LM head's input, RoPE's cos and sin."""
        t, h = b * s, self.hidden
        return [(1, 4 * h * t), (1, 4 * t), (1, e * h * t), (1, e * h * t), *self.saved_rope(s, e)]

    def flops_per_token(self, seq: int) -> int:
        """Forward FLOPs per token (on one rank with ``tp``): 2 per weight multiply-add, plus attention's scores and
        values (causal)."""
        weights = self.layers * sum(self.layer_tensors()) + self.head_vocab * self.hidden
        return 2 * weights + 2 * self.layers * self.local_heads * self.head_dim * seq

    # ---------------------------------------------------------------- transformers
    def hf_config_kwargs(self) -> Dict[str, Any]:
        return dict(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                    num_hidden_layers=self.layers, num_attention_heads=self.heads,
                    num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                    max_position_embeddings=self.max_positions, tie_word_embeddings=self.tied,
                    **({"attention_bias": self.o_bias, "mlp_bias": self.mlp_bias}
                       if self.model_type == "llama" else {}))


def decoder_of(m, tp: int = 1) -> Decoder:
    """The decoder a ModelConfig (family=llama) describes; with ``tp`` > 1, one tensor-parallel rank's share of it."""
    kv = m.num_kv_heads or m.num_heads
    return Decoder(model_type=m.model_type or "llama", hidden=m.hidden_size, layers=m.num_layers,
                   heads=m.num_heads, kv_heads=kv, head_dim=m.head_dim or m.hidden_size // m.num_heads,
                   intermediate=m.intermediate_size, vocab=m.vocab_size, max_positions=m.max_positions,
                   tied=m.tie_word_embeddings,
                   # Qwen2's q/k/v biases are hard-coded; Mistral has none whatever attention_bias says
                   qkv_bias=m.model_type == "qwen2" or (m.model_type == "llama" and m.attention_bias),
                   o_bias=m.model_type == "llama" and m.attention_bias,
                   mlp_bias=m.model_type == "llama" and m.mlp_bias, tp=max(1, tp))
