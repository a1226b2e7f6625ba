"""GPT-2 and BERT/RoBERTa: their parameter tensors and transformers config, beside the traits that decide what
they save for backward (the activation template over them is memory/activations.py's, docs/memory.md §3).

Exact to the element against transformers' own models (tests build them on the meta device): GPT2LMHeadModel,
GPT2ForSequenceClassification, Bert/RobertaForSequenceClassification.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple


def gpt2_tensors(L: int, h: int, inner: int, V: int, P: int, task: str, labels: int):
    """(embedding, layer, head, tied elements, buffer bytes) of GPT2LMHeadModel / GPT2ForSequenceClassification."""
    # GPT2Model: wte, wpe; per block ln_1, c_attn (h×3h), c_proj, ln_2, c_fc (h×I), c_proj (I×h); ln_f.
    layer = (h, h, 3 * h * h, 3 * h, h * h, h, h, h, h * inner, inner, inner * h, h)
    buffers = L * (P * P + 4)  # per block a bool causal mask of max_positions² and a float scalar (modeling_gpt2.py)
    if task == "causal_lm":  # GPT2LMHeadModel: lm_head tied to wte (no new tensor)
        return (V * h, P * h), layer, (h, h), V * h, buffers
    return (V * h, P * h), layer, (h, h, labels * h), 0, buffers  # score = Linear(h, num_labels, bias=False)


def encoder_tensors(family: str, h: int, inner: int, V: int, P: int, T: int, task: str, labels: int):
    """Bert/RobertaForSequenceClassification: word/position/token-type embeddings + LN; per layer q, k, v, attention
    output dense + LN, intermediate dense, output dense + LN. BERT: pooler dense + classifier; RoBERTa: no pooler,
    a classification head of dense (h×h) + out_proj (the same shapes)."""
    if task != "sequence_classification":
        raise ValueError(f"{family} with task {task}: zerorun trains encoders for sequence classification only "
                         "(config.check refuses this combination).")
    layer = (h * h, h, h * h, h, h * h, h, h * h, h, h, h, h * inner, inner, inner * h, h, h, h)
    head = (h * h, h, labels * h, labels)
    return (V * h, P * h, T * h, h, h), layer, head, 0, 2 * P * 8  # position_ids + token_type_ids, int64


def hf_config_args(m, num_labels: int) -> Tuple[str, Dict[str, Any]]:
    """(model_type, kwargs) for transformers' AutoConfig.for_model."""
    fam = getattr(m.family, "value", m.family)
    if fam == "gpt2":
        return "gpt2", dict(vocab_size=m.vocab_size, n_positions=m.max_positions, n_embd=m.hidden_size,
                            n_layer=m.num_layers, n_head=m.num_heads, n_inner=m.intermediate_size,
                            resid_pdrop=m.dropout, embd_pdrop=m.dropout, attn_pdrop=m.dropout, num_labels=num_labels)
    return fam, dict(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                     num_attention_heads=m.num_heads, intermediate_size=m.intermediate_size,
                     max_position_embeddings=m.max_positions, type_vocab_size=m.type_vocab_size,
                     hidden_dropout_prob=m.dropout, attention_probs_dropout_prob=m.dropout, num_labels=num_labels)


def layer_linears(fam: str, h: int, i: int) -> Dict[str, List[Tuple[int, int]]]:
    """Each layer's projections by the module name peft matches (GPT-2's ``c_proj`` and BERT's ``dense`` name
    several modules of a layer; peft adapts all of them)."""
    if fam == "gpt2":
        return {"c_attn": [(h, 3 * h)], "c_proj": [(h, h), (i, h)], "c_fc": [(h, i)]}
    return {"query": [(h, h)], "key": [(h, h)], "value": [(h, h)], "dense": [(h, h), (h, i), (i, h)]}
