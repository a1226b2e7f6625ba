"""Any architecture transformers builds, planned from the model itself (zerorun/arch/traced.py): the census against
the real model's parameters, the shape-only trace against what a real CPU forward saves, LoRA targets checked."""
import warnings

import pytest
import torch

from helpers import GPU8, composed
from zerorun.arch import lora_target_problems, trace_modes, traced
from zerorun.config import check

pytestmark = pytest.mark.unit

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=300, max_position_embeddings=256)
ENCODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, vocab_size=300,
               max_position_embeddings=256)
TYPES = {  # one tiny config per family the issue names; a new family is one line here and nothing else
    "qwen3": TINY, "gemma2": TINY, "gemma3_text": dict(TINY, num_hidden_layers=7, sliding_window=16),
    "phi3": dict(TINY, pad_token_id=0), "mixtral": dict(TINY, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "modernbert": dict(ENCODER, pad_token_id=0, global_attn_every_n_layers=2, local_attention=16),
    "deberta-v2": dict(ENCODER, relative_attention=True, position_buckets=32, pos_att_type=["p2c", "c2p"],
                       type_vocab_size=0, position_biased_input=False),
    "llama": dict(TINY, tie_word_embeddings=True),
}


def task_of(model_type):
    return "sequence_classification" if model_type in ("modernbert", "deberta-v2") else "causal_lm"


def real_model(model_type, fields, task, layers=None, dtype=torch.float32):
    cfg = traced.build_config(model_type, fields, 2, layers)
    torch.manual_seed(0)
    return traced.model_class(task).from_config(cfg).to(dtype).train()


def real_saved(model, batch, seq, task, no_cache):
    """Unique storages a real CPU forward saves for backward, parameters aside (what the trace counts)."""
    params = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    sizes = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            sizes.setdefault(st.data_ptr(), st.nbytes())
        return t

    kwargs = {"use_cache": False} if no_cache and task == "causal_lm" else {}
    if task != "causal_lm":
        kwargs["attention_mask"] = torch.ones(batch, seq, dtype=torch.long)
    ids = torch.randint(0, 300, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(input_ids=ids, **kwargs)
    return sum(sizes.values())


@pytest.mark.parametrize("model_type", sorted(TYPES))
def test_census_equals_the_parameters_transformers_builds(model_type):
    fields, task = TYPES[model_type], task_of(model_type)
    model = real_model(model_type, fields, task)
    c = traced.census(model_type, fields, task)
    assert c.total == sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    assert c.tied == (emb.numel() if out is not None and out.weight is emb else 0)
    assert c.linears and all(shapes for shapes in c.linears.values())


@pytest.mark.parametrize("model_type", sorted(TYPES))
@pytest.mark.parametrize("dtype, no_cache", [("fp32", False), ("bf16", True)])
def test_the_shape_only_trace_saves_what_a_real_forward_saves(model_type, dtype, no_cache):
    fields, task = TYPES[model_type], task_of(model_type)
    shallow, deep = traced.depths(model_type, fields)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    for layers in (shallow, deep):
        for batch in (1, 2):
            point = traced.trace_point(model_type, fields, task, 2, layers, batch, 32, dtype, no_cache)
            real = real_saved(real_model(model_type, fields, task, layers, torch_dtype), batch, 32, task, no_cache)
            assert sum(point.sizes) == real, (layers, batch)


def test_bytes_are_linear_in_the_micro_batch_so_two_traces_give_any_other():
    fields = TYPES["qwen3"]
    per3, out3, kept3, _, largest3, transient3 = traced.saved_sizes("qwen3", fields, "causal_lm", 2, 3, 32, "fp32",
                                                                    True)
    real3 = [traced.trace_point("qwen3", fields, "causal_lm", 2, n, 3, 32, "fp32", True) for n in (1, 2)]
    assert (per3, out3) == traced.split_layers(*real3)
    assert sorted(kept3) == sorted(real3[0].kept)
    assert (largest3, transient3) == (real3[0].largest, real3[0].transient) and largest3 > 0
    logits3 = traced.saved_sizes("gemma2", TYPES["gemma2"], "causal_lm", 2, 3, 32, "fp32", True).logits
    assert logits3 == traced.trace_point("gemma2", TYPES["gemma2"], "causal_lm", 2, 1, 3, 32, "fp32", True).logits


def test_what_the_forward_saves_on_the_logits_is_told_apart_for_the_fused_loss():
    b, s, V, e = 2, 32, TINY["vocab_size"], 2
    for model_type in ("gemma2", "qwen3"):  # Gemma-2's final soft-capping keeps its tanh of the logits; Qwen3 nothing
        point = traced.trace_point(model_type, TYPES[model_type], "causal_lm", 2, 1, b, s, "bf16", False)
        assert point.logits == ((b * s * V * e,) if model_type == "gemma2" else ())
    model = real_model("gemma2", TYPES["gemma2"], "causal_lm", 1, torch.bfloat16)
    capped = real_saved(model, b, s, "causal_lm", False)
    model.config.final_logit_softcapping = None
    assert capped - real_saved(model, b, s, "causal_lm", False) == b * s * V * e


def test_gemma_traces_one_layer_of_each_attention_kind():
    assert traced.depths("gemma3_text", TYPES["gemma3_text"]) == (2, 3)  # sliding and full
    assert traced.depths("phi3", TYPES["phi3"]) == (1, 2)  # no per-layer pattern


def test_checkpointing_keeps_the_materialised_mask_a_layer_is_given():
    kept = traced.saved_sizes("llama", TYPES["llama"], "causal_lm", 2, 2, 32, "fp32", True).kept
    assert 2 * 32 * 32 in kept  # the (b, 1, s, s) bool mask every checkpoint keeps


@pytest.mark.parametrize("model_type", ["deberta-v2", "qwen3", "mixtral"])
def test_a_layers_largest_block_and_transient_are_a_real_forwards(model_type):
    """The shape-only trace's largest block and transient of a layer's forward equal those of a real bf16 CPU forward
    watched the same way, and DeBERTa's (whose gathers make fp32 scratch copies of b·h·s² in the kernel) is that
    scratch: 4 bytes per element of the gathered scores."""
    fields, task, b, s = TYPES[model_type], task_of(model_type), 2, 48
    point = traced.trace_point(model_type, fields, task, 2, 1, b, s, "bf16", True)
    model = real_model(model_type, fields, task, 1, torch.bfloat16)
    watch = trace_modes.layer_blocks_mode(frozenset(t.untyped_storage()._cdata for t in [*model.parameters(),
                                                                               *model.buffers()]))
    for layer in traced._layer_list(model, 1)[1]:
        layer.register_forward_pre_hook(watch.enter)
        layer.register_forward_hook(watch.leave)
    kwargs = {"use_cache": False} if task == "causal_lm" else {"attention_mask": torch.ones(b, s, dtype=torch.long)}
    with watch, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(input_ids=torch.randint(0, 300, (b, s)), **kwargs)
    assert (point.largest, point.transient) == (watch.largest, watch.transient)
    assert point.transient > 0
    if model_type == "deberta-v2":
        assert point.largest == 4 * b * ENCODER["num_attention_heads"] * s * s


@pytest.mark.parametrize("model_type", ["gemma2", "llama"])
def test_every_mask_a_real_forward_gives_its_layers_is_kept_at_every_batch(model_type):
    # Gemma-2's masks die with its body and its soft-capped logits used to take their address: the trace lost them
    fields, seq = TYPES[model_type], 32
    for batch in (1, 2, 3):
        model, masks = real_model(model_type, fields, "causal_lm", None, torch.float32), {}
        layers = traced._layer_list(model, model.config.num_hidden_layers)[1]
        hook = lambda mod, args, kw: masks.update(  # noqa: E731
            {t.data_ptr(): t.nbytes for t in kw.values() if isinstance(t, torch.Tensor) and t.dtype == torch.bool})
        for layer in layers:
            layer.register_forward_pre_hook(hook, with_kwargs=True)
        real_saved(model, batch, seq, "causal_lm", True)
        point = traced.trace_point(model_type, fields, "causal_lm", 2, len(layers), batch, seq, "fp32", True)
        assert masks and sorted(n for n in point.kept if n == batch * seq * seq) == sorted(masks.values()), batch


def test_moe_plans_every_expert_and_a_balanced_share_of_tokens():
    c = traced.census("mixtral", TYPES["mixtral"], "causal_lm")
    assert len(c.linears["w1"]) == 4  # every expert's projections are there to adapt or count
    assert 0 < c.expert_fraction < 1


def test_an_unknown_lora_target_is_refused_naming_the_valid_ones(tmp_path):
    cfg = composed("+model=qwen3-8b", "adapter=lora", "adapter.target_modules=[nonexistent_proj]")
    [(what, fix, key, value)] = lora_target_problems(cfg.model, cfg.adapter)
    assert "nonexistent_proj" in what and "q_proj" in fix and key == "adapter.target_modules"
    assert any("nonexistent_proj" in p.what and p.key == "adapter.target_modules" for p in check(cfg, GPU8))


def test_phi3_gets_lora_targets_although_peft_has_no_default():
    cfg = composed("+model=phi-3-mini", "adapter=lora")
    assert lora_target_problems(cfg.model, cfg.adapter) == []


def test_peft_defaults_read_from_its_source_are_the_ones_it_imports():
    """The planner reads peft's LoRA defaults from its source (no ``import peft`` in the CLI); they must be the
    table peft itself uses."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as imported

    from zerorun.arch import peft_lora_defaults

    assert peft_lora_defaults() == {k: tuple(v) for k, v in imported.items()}
    assert peft_lora_defaults()["llama"] == ("q_proj", "v_proj")


@pytest.mark.parametrize("name, total", [("qwen3-8b", 8_190_735_360), ("gemma-2-9b", 9_241_705_984),
                                         ("gemma-3-1b", 999_885_952), ("phi-3-mini", 3_821_079_552),
                                         ("mixtral-8x7b", 46_702_792_704), ("qwen3-30b-a3b", 30_532_122_624)])
def test_the_shipped_files_have_the_published_sizes(name, total):
    from zerorun.arch import count_params

    assert count_params(composed(f"+model={name}").model) == total


def test_the_in_process_memo_answers_by_the_config_json_fields():
    """zerorun.arch's memo in front of the trace cache (a gate asks for the same traces hundreds of times): the
    same fields give the same answer object, any changed field a fresh one that equals the trace's own."""
    import json
    from types import SimpleNamespace

    from zerorun import arch

    small = SimpleNamespace(model_type="llama", hf_config=json.dumps(TYPES["llama"]))
    wider = SimpleNamespace(model_type="llama", hf_config=json.dumps(dict(TYPES["llama"], intermediate_size=256)))
    assert arch.census(small, "causal_lm") is arch.census(small, "causal_lm")
    assert arch.census(wider, "causal_lm").total == traced.census("llama", json.loads(wider.hf_config),
                                                                  "causal_lm").total
    assert arch.census(wider, "causal_lm").total > arch.census(small, "causal_lm").total
    args = ("causal_lm", 2, 3, 32, "fp32", True)
    assert arch.saved_sizes(wider, *args) == traced.saved_sizes("llama", json.loads(wider.hf_config), *args)
    assert arch.saved_sizes(wider, *args) != arch.saved_sizes(small, *args)
