"""parallel=tp (DeepSpeed AutoTP): the rules and their one-line refusals, the plan and the DeepSpeed JSON, and the
estimator's arithmetic of one tensor-parallel rank's share, held against what DeepSpeed 0.19.8 did on 2 CPU ranks
(shapes printed from the engine's module, live tensor bytes from ZERORUN_TRACK_MEMORY=1)."""
import json

import pytest

from helpers import CPU2, CPU_HOST, GPU8, composed, planned
from zerorun.arch import decoder_of
from zerorun.config import World, check, make_plan
from zerorun.ds_config import render
from zerorun.memory import estimate, param_breakdown, tp_table_configs

TP2 = ("+model=tiny-llama", "parallel=tp", "parallel.tp_size=2")


def problems(*overrides, world=CPU2):
    return check(composed(*overrides), world, libaio=True, writable=lambda path: None)


def one_line(p):
    return "\n" not in str(p) and " Fix: " in str(p)


# ---------------------------------------------------------------------------------------------- rules


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_llama_on_two_ranks_passes_at_every_zero_stage(stage):
    # ZeRO-3 too: DeepSpeed 0.19.8 trains AutoTP under ZeRO-3 and gathers both dimensions for the export (tried).
    assert problems(*TP2, f"zero=stage{stage}") == []


@pytest.mark.heavy
def test_gpt2_is_refused_because_autotp_rejects_it():
    [p] = problems("+model=tiny-gpt2", "parallel=tp", "parallel.tp_size=2")
    assert p.key == "parallel.mode" and "AutoTP cannot shard gpt2" in p.what and "parallel=dp" in p.fix and one_line(p)


def test_an_encoder_is_refused_naming_the_families_that_train():
    [p] = problems("+model=tiny-bert", "parallel=tp", "parallel.tp_size=2")
    assert p.key == "parallel.mode" and "Llama-class" in p.what and one_line(p)


def test_tp_beyond_the_key_value_heads_is_refused_with_the_sizes_that_fit():
    [p] = problems(*TP2[:2], "parallel.tp_size=4", world=World(4, 1, "cpu", False))  # tiny-llama: 2 KV heads
    assert p.key == "parallel.tp_size" and p.value == 4 and "exceeds the 2 key/value heads" in p.what
    assert "parallel.tp_size in {2}," in p.fix and "parallel=dp" in p.fix and one_line(p)


def test_tp_that_does_not_divide_the_key_value_heads_is_refused():
    [p] = problems(*TP2[:2], "parallel.tp_size=3", "model.num_kv_heads=4", world=World(6, 1, "cpu", False))
    assert p.key == "parallel.tp_size" and "does not divide the 4 key/value heads" in p.what
    assert "{2, 4}" in p.fix and one_line(p)


def test_tp_that_does_not_divide_the_world_is_refused():
    [p] = problems(*TP2, world=World(3, 1, "cpu", False))
    assert p.key == "parallel.tp_size" and "world size 3" in p.what and one_line(p)


def test_lora_with_tp_is_refused_because_deepspeed_fails_on_it():
    # Tried: peft LoRA on q/v under AutoTP, ZeRO-1, 2 ranks: KeyError in stage_1_and_2.py _create_param_mapping.
    [p] = problems(*TP2, "adapter=lora")
    assert p.key == "adapter.name" and "parallel=tp" in p.what and "parallel=dp" in p.fix and one_line(p)


def test_offload_with_tp_is_refused():
    [p] = problems(*TP2, "zero=stage2", "offload=cpu")
    assert p.key == "offload.device" and one_line(p)


def test_tp_size_without_parallel_tp_is_refused_not_ignored():
    [p] = problems("+model=tiny-llama", "parallel.tp_size=2")
    assert p.key == "parallel.tp_size" and "parallel=tp parallel.tp_size=2" in p.fix


def test_the_global_batch_counts_data_parallel_ranks_only():
    [p] = problems(*TP2, "trainer.micro_batch_size=4", "trainer.global_batch_size=6", world=World(4, 1, "cpu", False))
    assert p.key == "trainer.global_batch_size" and "4 × 2 = 8" in p.what  # 4 ranks = TP 2 × DP 2


# ---------------------------------------------------------------------------------------------- plan and JSON


@pytest.mark.heavy
def test_plan_and_deepspeed_json(monkeypatch):
    import deepspeed.runtime.config as ds_runtime_config
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg, plan = planned(*TP2, "zero=stage1", "trainer.micro_batch_size=4", world=GPU8)
    assert (plan.tensor_parallel, plan.data_parallel_size, plan.global_batch_size) == (2, 4, 16)
    ds = render(cfg, plan)
    assert ds["tensor_parallel"] == {"autotp_size": 2}
    # DeepSpeed checks train_batch_size against all 8 ranks when the engine starts and against the 4 data-parallel
    # ones in ZeRO-3's zero.Init: it is left for DeepSpeed to derive from micro-batch × accumulation.
    assert "train_batch_size" not in ds and ds["train_micro_batch_size_per_gpu"] == 4
    monkeypatch.setattr(ds_runtime_config.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_runtime_config.dist, "get_world_size", lambda *a, **k: 8)
    parsed = DeepSpeedConfig(json.loads(json.dumps(ds)))
    assert parsed.tensor_parallel_config.autotp_size == 2 and parsed.gradient_accumulation_steps == 1
    assert "tensor_parallel" not in render(*planned("+model=tiny-llama", world=GPU8))


# ---------------------------------------------------------------------------------------------- arithmetic

# What the engine's module held on rank 0 of 2 (tiny-llama, autotp_size 2, DeepSpeed 0.19.8): q/k/v and gate/up
# LinearLayer shards by output rows, o/down LinearAllreduce by input columns, the untied lm_head a LinearLayer of
# half the vocabulary; embeddings and norms whole. 1,417,856 parameters became 971,392 per rank.
MEASURED_SHAPES = {"q": (64, 128), "k": (32, 128), "v": (32, 128), "o": (128, 64), "gate": (176, 128),
                   "up": (176, 128), "down": (128, 176)}


@pytest.mark.heavy
def test_one_ranks_share_is_what_autotp_left_on_it():
    m = composed(*TP2).model
    n = {k: a * b for k, (a, b) in MEASURED_SHAPES.items()}
    assert decoder_of(m, 2).layer_tensors() == (128, n["q"], n["k"], n["v"], n["o"], 128, n["gate"], n["up"], n["down"])
    assert decoder_of(m, 2).head_tensors() == (128, 2048 * 128)
    assert param_breakdown(m).total == 1_417_856 and param_breakdown(m, tp=2).total == 971_392
    # A tied head stays whole (measured: lm_head a plain 4096 × 128 Linear); embeddings are never split.
    tied = composed(*TP2, "model.tie_word_embeddings=true").model
    assert decoder_of(tied, 2).head_tensors() == (128,)
    assert param_breakdown(tied, tp=2).embeddings == param_breakdown(tied).embeddings == 4096 * 128


def test_biases_follow_their_weights():
    # Column-parallel biases split with their rows; a row-parallel layer's bias is added after the all-reduce, whole.
    m = composed(*TP2, "model.attention_bias=true", "model.mlp_bias=true").model
    d, whole = decoder_of(m, 2), decoder_of(m)
    q, kv, i = 4 * 32, 2 * 32, 352
    assert whole.layer_tensors()[1:9] == (128 * q, q, 128 * kv, kv, 128 * kv, kv, q * 128, 128)
    assert d.layer_tensors()[1:9] == (128 * q // 2, q // 2, 128 * kv // 2, kv // 2, 128 * kv // 2, kv // 2,
                                      q // 2 * 128, 128)
    assert d.layer_tensors()[-6:] == (128 * i // 2, i // 2, 128 * i // 2, i // 2, i // 2 * 128, 128)


MEDIUM = ("model.hidden_size=512", "model.num_layers=4", "model.num_heads=8", "model.num_kv_heads=4",
          "model.intermediate_size=1408", "model.vocab_size=16000", "data.seq_len=128", "trainer.micro_batch_size=4")


def test_the_step_peak_matches_the_live_tensors_measured():
    # ZERORUN_TRACK_MEMORY=1, tiny-llama widened (28,185,088 parameters), TP 2 on 2 CPU ranks, ZeRO-1 fp32: the training
    # loop's live tensor peak was 509,352,092 bytes on both ranks (3 steps; the optimizer step).
    cfg, plan = planned(*TP2, *MEDIUM, "zero=stage1", "trainer.export=false", world=CPU2)
    est = estimate(cfg, plan, CPU_HOST)
    step_peak = max(sum(v.values()) for k, v in est.phases.items() if k != "init")
    assert abs(step_peak / 509_352_092 - 1) < 0.02, step_peak
    assert est.params == 28_185_088 and est.summary["params_per_rank"] == param_breakdown(cfg.model, tp=2).total


@pytest.mark.heavy
def test_tp_divides_the_split_states_and_activations_and_keeps_the_rest():
    dp_cfg, dp_plan = planned("+model=tiny-llama", *MEDIUM, "zero=stage0", "trainer.fused_loss=false",  # as TP's
                              world=World(1, 1, "cpu", False))
    tp_cfg, tp_plan = planned(*TP2, *MEDIUM, "zero=stage0", world=CPU2)
    one, two = estimate(dp_cfg, dp_plan, CPU_HOST), estimate(tp_cfg, tp_plan, CPU_HOST)
    whole, share = param_breakdown(dp_cfg.model), param_breakdown(tp_cfg.model, tp=2)
    split = whole.total - whole.embeddings - whole.num_layers * 2 * 512 - 512  # all but embeddings and norms
    assert share.total == whole.total - split // 2
    assert two.phases["loss"]["parameters"] == 4 * share.total
    a1, a2 = one.phases["loss"]["activations"], two.phases["loss"]["activations"]
    assert a2 < a1 and a2 > a1 / 2  # head- and MLP-wide tensors halve, hidden-wide ones (norms, residual) do not
    # The logits are gathered whole before the loss, plus the rank's slice of their gradient.
    t, v = 4 * 128, 16000
    assert two.phases["loss"]["logits + loss"] == one.phases["loss"]["logits + loss"] + 4 * t * v // 2


@pytest.mark.heavy
def test_the_estimate_table_has_tp_rows_where_they_apply():
    cfg = composed("+model=llama-3.2-1b", "zero=stage1")  # 8 key/value heads
    rows = tp_table_configs(cfg, GPU8)
    assert [label for label, _ in rows] == ["TP 2 × DP 4 · ZeRO-1", "TP 4 × DP 2 · ZeRO-1", "TP 8 × DP 1 · ZeRO-1"]
    for _, c in rows:  # the composed config's global batch, so the rows' step times compare the same work
        assert make_plan(c, GPU8).global_batch_size == make_plan(cfg, GPU8).global_batch_size
        assert check(c, GPU8, libaio=True, writable=lambda path: None) == []
    assert tp_table_configs(composed("+model=gpt2"), GPU8) == []
    assert tp_table_configs(cfg, World(1, 1, "cuda")) == []


def test_the_speed_model_counts_the_tensor_parallel_all_reduces():
    from zerorun.speed import predict_step_time

    cfg, plan = planned("+model=llama-3.2-1b", "parallel=tp", "parallel.tp_size=2", world=GPU8)
    step = predict_step_time(cfg, plan)
    assert step.terms["tp_comm"] > 0


def test_one_key_value_head_leaves_only_data_parallelism():
    [p] = problems(*TP2, "model.num_kv_heads=1")
    assert p.fix == "parallel=dp with zero=stage3." and one_line(p)
