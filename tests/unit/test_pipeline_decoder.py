"""Llama-class decoders (Llama, Qwen2, Mistral) as pipeline layers (zerorun/arch/pipe_decoder.py), run in one
process against the transformers model, back to HF names, and what the estimator gives each of their stages."""
import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from helpers import CPU2, CPU_HOST, composed, model_file
from zerorun import memory as M
from zerorun.memory.activations import decoder_activations
from zerorun.arch import decoder_of
from zerorun.config import check, default_task, make_plan
from zerorun.pipeline import (SequentialPipe, causal_lm_loss, checkpointable_layers, export_state_dict,
                              merge_state_dicts, pipeline_layers, stage_state_dict)

ATOL = 1e-6

MODELS = {
    "llama": ("llama", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),  # q/k/v biases, the head tied to the embedding
    "mistral-sliding": ("mistral", {"sliding_window": 6}),  # a window shorter than the sequence
    "qwen2-sliding-layers": ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(kind: str, **extra):
    model_type, kw = MODELS[kind]
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                               **{**kw, **extra})
    model = AutoModelForCausalLM.from_config(cfg)
    model.config.loss_type = model.loss_type = "ForCausalLM"
    return model


def padded_batch(batch=3, width=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 256, (batch, width), generator=g)
    mask = torch.ones(batch, width, dtype=torch.long)
    mask[0, :4] = 0  # left-padded
    mask[1, width - 5:] = 0  # right-padded
    return ids, mask


def assert_close(a, b):
    assert a.shape == b.shape
    assert torch.equal(a, b) or torch.allclose(a, b, rtol=0, atol=ATOL), (a - b).abs().max()


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_pipeline_matches_the_hf_forward_and_loss(kind):
    model = tiny(kind).eval()
    pipe = SequentialPipe(pipeline_layers(model, "causal_lm")).eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        for inputs, kwargs in (((ids,), {}), (ids, {}), ((ids, mask), {"attention_mask": mask})):
            ref = model(input_ids=ids, labels=ids, **kwargs)
            logits = pipe(inputs)
            assert_close(logits, ref.logits)
            assert_close(causal_lm_loss(logits, ids), ref.loss)
        # the padding mask really travelled through the layers
        assert not torch.allclose(pipe((ids,)), pipe((ids, mask)))


@pytest.mark.parametrize("kind", ["llama", "qwen2-tied"])
def test_gradients_match_the_hf_backward(kind):
    """Train mode (the model keeps its KV cache, the pipeline none): the same gradients on every parameter, the
    tied embedding's from both of its uses."""
    model = tiny(kind).train()
    reference = copy.deepcopy(model)
    ids, _ = padded_batch()
    causal_lm_loss(SequentialPipe(pipeline_layers(model))(ids), ids).backward()
    reference(input_ids=ids, labels=ids).loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert p.grad is not None, name
        assert_close(p.grad, q.grad)


def test_layer_lists_tie_the_head_to_the_embedding_only_when_the_model_does():
    untied = [spec.typename.__name__ for spec in pipeline_layers(tiny("llama"))]
    assert untied == ["DecoderEmbeddingPipe", "DecoderLayerPipe", "DecoderLayerPipe", "DecoderNormPipe", "LMHeadPipe"]
    tied = pipeline_layers(tiny("qwen2-tied"))
    first, last = tied[0], tied[-1]
    assert type(first).__name__ == type(last).__name__ == "TiedLayerSpec"
    assert first.key == last.key == "embed" and last.forward_fn is not None and first.forward_fn is None
    embed = first.build()
    assert embed.weight is embed.embed_tokens.weight
    assert "DecoderLayerPipe" in checkpointable_layers()
    # Mistral's window applies to every layer; Qwen2's to the layers its config marks sliding; Llama's to none
    assert [s.build().sliding for s in pipeline_layers(tiny("mistral-sliding"))[1:3]] == [True, True]
    model = tiny("qwen2-sliding-layers")
    assert [s.build().sliding for s in pipeline_layers(model)[1:3]] == \
        [t == "sliding_attention" for t in model.config.layer_types]
    assert not any(s.build().sliding for s in pipeline_layers(tiny("llama"))[1:3])


def test_between_layers_travel_the_hidden_state_and_an_integer_mask():
    """No rotary table and no float mask cross a stage boundary: each would need a gradient back."""
    pipe = SequentialPipe(pipeline_layers(tiny("llama")))
    ids, mask = padded_batch()
    x = (ids, mask)
    for fn in pipe.forward_funcs[:-2]:
        x = fn(x)
        assert len(x) == 2 and x[0].is_floating_point() and x[1].dtype == torch.long and x[1].shape == ids.shape


def test_layers_wrap_the_models_own_parameters():
    model = tiny("qwen2-tied")
    pipe = SequentialPipe(pipeline_layers(model))
    assert {id(p) for p in pipe.parameters()} == {id(p) for p in model.parameters()}


@pytest.mark.parametrize("kind", ["llama", "qwen2-tied"])
def test_two_stages_merge_into_the_hf_checkpoint(kind, tmp_path):
    from deepspeed.runtime.utils import partition_uniform

    model = tiny(kind)
    layers = pipeline_layers(model)
    with torch.no_grad():  # trained weights, not the initial ones, must come back
        for p in SequentialPipe(layers).parameters():
            p.add_(0.5)
    parts = partition_uniform(num_items=len(layers), num_parts=2)
    stages = [stage_state_dict(SequentialPipe(layers[parts[s]:parts[s + 1]])) for s in range(2)]
    tied = model.config.tie_word_embeddings
    assert (set(stages[0]) & set(stages[1])) == ({"model.embed_tokens.weight"} if tied else set())
    assert not any("rotary" in k for st in stages for k in st)  # inv_freq is not persistent
    merged = merge_state_dicts(stages, model)
    ref = model.state_dict()
    assert list(merged) == list(ref) and all(torch.equal(merged[k], ref[k]) for k in ref)
    if tied:
        assert merged["lm_head.weight"] is merged["model.embed_tokens.weight"]
    torch.manual_seed(123)
    fresh = type(model)(model.config)
    fresh.load_state_dict(merged)
    fresh.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is type(model)
    assert all(torch.equal(v, ref[k]) for k, v in loaded.state_dict().items())
    assert list(export_state_dict(layers, model)) == list(ref)


# ---------------------------------------------------------------------------------------------- the estimator


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "llama-3.2-1b", "qwen2.5-0.5b", "mistral-7b"])
def test_stage_layer_weights_are_deepspeeds_count(name):
    """What partition=parameters balances: each layer spec's trainable parameters on a meta-device model, the tied
    embedding at both of its uses."""
    from zerorun.models import hf_config, model_class

    m = model_file(name)
    with torch.device("meta"):
        model = model_class(default_task(m.family)).from_config(hf_config(m))
    specs = pipeline_layers(model)
    counted = [sum(p.numel() for p in spec.build().parameters() if p.requires_grad) for spec in specs]
    layers = M.pipeline_layer_params(M.param_breakdown(m))
    assert [w for _, w in layers] == counted
    assert [n for n, _ in layers][-2:] == ["norm", "lm_head (tied embed_tokens)" if m.tie_word_embeddings else "lm_head"]


def test_a_pipeline_layer_saves_its_own_rope_table_and_no_mask():
    """The pipeline's layers take the unmasked SDPA path with or without checkpointing (no (b,1,s,s) mask kept,
    K/V at their own heads) and each saves its cos/sin, which the whole model saves once."""
    d, b, s, e = decoder_of(model_file("tiny-llama")), 4, 128, 2
    rope = 2 * e * s * d.head_dim
    plain = sum(n * x for n, x in d.saved_per_layer(b, s, e, False))
    for ckpt in (False, True):
        model = decoder_activations(d, b, s, e, "cpu", ckpt, 2, 0)
        pipe = decoder_activations(d, b, s, e, "cpu", ckpt, 2, 0, pipeline=True)
        assert pipe.per_layer == pipe.recompute_layer == plain + rope
        assert pipe.outside_layers == model.outside_layers - rope - (b * s * s if ckpt else 0)
        assert (pipe.checkpoint_per_layer, pipe.logits_loss) == (model.checkpoint_per_layer, model.logits_loss)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_each_stage_holds_its_own_layers(name):
    cfg = composed(f"+model={name}", "parallel=pipeline", "launcher.nproc_per_node=2", "trainer.micro_batch_size=4",
                   "trainer.global_batch_size=16", "data.seq_len=128", "precision=bf16")
    assert not check(cfg, CPU2, libaio=True, writable=lambda p: None)
    plan = make_plan(cfg, CPU2)
    bd = M.param_breakdown(cfg.model, plan.task)
    est = M.estimate(cfg, plan, CPU_HOST)
    first, last = est.stages
    tied = cfg.model.tie_word_embeddings
    assert first["layers"] == ["embed_tokens", "block"]
    assert last["layers"] == ["block", "norm", "lm_head (tied embed_tokens)" if tied else "lm_head"]
    assert first["params"] + last["params"] == bd.total + bd.tied_embedding
    assert [first["in_flight_micro_batches"], last["in_flight_micro_batches"]] == [2, 1]
    # the model states of each stage are its own parameters' (the same bytes per parameter on both)
    assert first["model_state_bytes"] * last["params"] == last["model_state_bytes"] * first["params"]
    # the logits and the loss only on the last stage, the embedding's dense gradient only on the first when untied
    assert "logits + loss" not in first["phases"]["loss"]
    assert last["phases"]["loss"]["logits + loss"] == 12 * 4 * 128 * cfg.model.vocab_size
    assert "embedding grad" in first["phases"] and ("embedding grad" in last["phases"]) == tied


def test_a_zero1_stage_holds_its_reduce_bucket_through_the_step():
    """PipelineEngine reduces once per step: the bucket the first gradient hook allocates is alive at every later
    micro-batch's loss, and the gradient partition only from the reduce (measured: the last stage read -7.5%
    without the bucket, the first +10.5% with the partition)."""
    cfg = composed("+model=tiny-llama", "parallel=pipeline", "launcher.nproc_per_node=2", "zero=stage1",
                   "trainer.micro_batch_size=2", "trainer.global_batch_size=8", "data.seq_len=512")
    plan = make_plan(cfg, CPU2)
    for st in M.estimate(cfg, plan, CPU_HOST).stages:
        loss, step = st["phases"]["loss"], st["phases"]["optimizer step"]
        assert loss["reduce buckets"] == plan.buckets.reduce_bucket_size * 4
        assert loss["gradients"] == 4 * st["params"] - (4 * M.param_breakdown(cfg.model).tied_embedding
                                                         if "lm_head (tied embed_tokens)" in st["layers"] else 0)
        assert "reduce buckets" not in step


def test_rules_let_a_llama_class_pipeline_run_and_still_refuse_a_traced_decoder(tmp_path):
    ok = composed("+model=tiny-llama", "parallel=pipeline", "launcher.nproc_per_node=2", "parallel.micro_batches=4")
    assert not [p for p in check(ok, CPU2, libaio=True, writable=lambda p: None) if p.key == "parallel.mode"]
    (tmp_path / "config.json").write_text(AutoConfig.for_model(
        "qwen3", vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16).to_json_string())
    traced = composed("+model=hf", f"model.name_or_path={tmp_path}", "parallel=pipeline", "launcher.nproc_per_node=2",
                      "parallel.micro_batches=4")
    [p] = [p for p in check(traced, CPU2, libaio=True, writable=lambda p: None) if p.key == "parallel.mode"]
    assert "llama" in str(p) and "parallel=dp" in p.fix
