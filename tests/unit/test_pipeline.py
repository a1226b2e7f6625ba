"""zerorun.pipeline: HF models as DeepSpeed pipeline layers, run in one process, and back to HF names.

The layer list runs in this process (as a one-stage PipelineModule would) without torch.distributed;
tests/integration/test_pipeline_engine.py builds a real PipelineModule + engine.
"""
import copy
from pathlib import Path

import pytest
import torch
from transformers import (BertConfig, BertForSequenceClassification, GPT2Config, GPT2ForSequenceClassification,
                          GPT2LMHeadModel, RobertaConfig, RobertaForSequenceClassification)

from zerorun.config import TaskName
from zerorun.pipeline import (SequentialPipe, checkpointable_layers, build_pipeline_module, causal_lm_loss,
                              export_state_dict, merge_state_dicts, pipeline_layers, sequence_classification_loss,
                              stage_state_dict)

ROOT = Path(__file__).resolve().parents[2]
ATOL = 1e-6


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared; these models are tiny
    yield
    torch.set_num_threads(before)


def tiny_gpt2(impl="sdpa", dropout=0.1, **kw):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=dropout,
                     embd_pdrop=dropout, attn_pdrop=dropout, attn_implementation=impl, **kw)
    model = GPT2LMHeadModel(cfg)
    model.config.loss_type = "ForCausalLM"
    return model


def tiny_bert(impl="sdpa", num_labels=3, dropout=0.1, cls=BertForSequenceClassification, config_cls=BertConfig,
              **kw):
    torch.manual_seed(0)
    cfg = config_cls(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64, num_labels=num_labels,
                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, attn_implementation=impl, **kw)
    model = cls(cfg)
    model.config.loss_type = "ForSequenceClassification"
    return model


def padded_batch(batch=4, width=16, seed=1):
    """Random ids with a right-padded row, a left-padded row and two full rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 256, (batch, width), generator=g)
    mask = torch.ones(batch, width, dtype=torch.long)
    mask[0, width - 6:] = 0
    mask[1, :3] = 0
    ids[mask == 0] = 0
    return ids, mask


def assert_close(a, b):
    assert a.shape == b.shape
    assert torch.equal(a, b) or torch.allclose(a, b, rtol=0, atol=ATOL), (a - b).abs().max()


# ---------------------------------------------------------------------------------------------
# Forward parity


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_gpt2_pipeline_matches_hf_forward(impl):
    model = tiny_gpt2(impl).eval()
    pipe = SequentialPipe(pipeline_layers(model, TaskName.causal_lm)).eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        for inputs, kwargs in (((ids,), {}), (ids, {}), ((ids, mask), {"attention_mask": mask})):
            ref = model(input_ids=ids, labels=ids, **kwargs)
            logits = pipe(inputs)
            assert_close(logits, ref.logits)
            assert_close(causal_lm_loss(logits, ids), ref.loss)


def test_gpt2_loss_ignores_minus_100_like_hf():
    model = tiny_gpt2().eval()
    pipe = SequentialPipe(pipeline_layers(model, "causal_lm")).eval()
    ids, _ = padded_batch()
    labels = ids.clone()
    labels[0, 5:] = -100
    with torch.no_grad():
        ref = model(input_ids=ids, labels=labels)
        assert_close(causal_lm_loss(pipe(ids), labels), ref.loss)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_bert_pipeline_matches_hf_forward(impl):
    model = tiny_bert(impl).eval()
    pipe = SequentialPipe(pipeline_layers(model, TaskName.sequence_classification)).eval()
    ids, mask = padded_batch()
    labels = torch.tensor([0, 2, 1, 2])
    token_types = torch.zeros_like(ids)
    token_types[:, 8:] = 1
    with torch.no_grad():
        for inputs, kwargs in (((ids,), {}), ((ids, mask), {"attention_mask": mask}),
                               ((ids, mask, token_types), {"attention_mask": mask, "token_type_ids": token_types})):
            ref = model(input_ids=ids, labels=labels, **kwargs)
            logits = pipe(inputs)
            assert_close(logits, ref.logits)
            assert_close(sequence_classification_loss(logits, labels), ref.loss)
        # padding really changes the result, so the mask did travel through the layers
        assert not torch.allclose(pipe((ids,)), pipe((ids, mask)))


def test_roberta_pipeline_matches_hf_forward():
    model = tiny_bert(cls=RobertaForSequenceClassification, config_cls=RobertaConfig, num_labels=2,
                      pad_token_id=1).eval()
    pipe = SequentialPipe(pipeline_layers(model, "auto")).eval()
    ids, mask = padded_batch(width=12)
    ids[mask == 0] = 1
    labels = torch.tensor([0, 1, 1, 0])
    with torch.no_grad():
        for inputs, kwargs in (((ids,), {}), ((ids, mask), {"attention_mask": mask})):
            ref = model(input_ids=ids, labels=labels, **kwargs)
            logits = pipe(inputs)
            assert_close(logits, ref.logits)
            assert_close(sequence_classification_loss(logits, labels), ref.loss)


def test_untied_gpt2_gets_its_own_head():
    model = tiny_gpt2(tie_word_embeddings=False).eval()
    assert model.lm_head.weight is not model.transformer.wte.weight
    layers = pipeline_layers(model, "causal_lm")
    assert type(layers[-1]).__name__ == "LayerSpec" and layers[-1].typename.__name__ == "LMHeadPipe"
    ids, _ = padded_batch()
    with torch.no_grad():
        assert_close(SequentialPipe(layers).eval()(ids), model(input_ids=ids).logits)
    sd = export_state_dict(layers, model)
    assert list(sd) == list(model.state_dict())
    assert sd["lm_head.weight"] is not sd["transformer.wte.weight"]


def test_gradients_match_hf_backward():
    """Train mode without dropout: the pipeline's backward reaches the same parameters with the same
    gradients (tied embedding: token lookup + LM head)."""
    model = tiny_gpt2(dropout=0.0).train()
    reference = copy.deepcopy(model)
    ids, _ = padded_batch()
    causal_lm_loss(SequentialPipe(pipeline_layers(model, "causal_lm"))(ids), ids).backward()
    reference(input_ids=ids, labels=ids).loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert p.grad is not None, name
        assert_close(p.grad, q.grad)


# ---------------------------------------------------------------------------------------------
# What travels between layers (between stages in a multi-stage run)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_activations_between_layers_are_tensors_with_an_integer_mask(family):
    """DeepSpeed sends each layer's output as a tensor or tuple of tensors; every floating one must get a
    gradient back, so the only floating tensor is the hidden state and the mask is int64."""
    model = (tiny_gpt2() if family == "gpt2" else tiny_bert()).eval()
    pipe = SequentialPipe(pipeline_layers(model))
    ids, mask = padded_batch()
    x = (ids, mask)
    for fn in pipe.forward_funcs[:-1]:
        x = fn(x)
        items = [x] if torch.is_tensor(x) else list(x)
        assert all(torch.is_tensor(t) for t in items)
        assert items[0].is_floating_point()
        assert all(t.dtype == torch.long and t.shape == ids.shape for t in items[1:])


def test_layer_lists_and_checkpointable_classes():
    gpt2 = pipeline_layers(tiny_gpt2())
    names = [spec.typename.__name__ for spec in gpt2]
    assert names == ["GPT2TokenEmbeddingPipe", "GPT2PositionEmbeddingPipe", "GPT2BlockPipe", "GPT2BlockPipe",
                     "GPT2FinalNormPipe", "GPT2TokenEmbeddingPipe"]
    first, last = gpt2[0], gpt2[-1]
    assert first.key == last.key == "embed" and first.tied_weight_attr == last.tied_weight_attr == ["weight"]
    embed = first.build()
    assert embed.weight is embed.wte.weight  # tied_weight_attr is read with a plain getattr
    assert last.forward_fn is not None and first.forward_fn is None
    bert = [spec.typename.__name__ for spec in pipeline_layers(tiny_bert())]
    assert bert == ["EncoderEmbeddingPipe", "EncoderLayerPipe", "EncoderLayerPipe", "BertClassifierHeadPipe"]
    assert set(checkpointable_layers()) == {"GPT2BlockPipe", "EncoderLayerPipe", "DecoderLayerPipe"}


def test_every_stage_counts_in_the_fp32_gradient_norm():
    """DeepSpeed's fp32 clip_grad_norm_ counts a parameter on a later stage only if it is marked model-parallel;
    the tied copy DeepSpeed marks replicated is left to the first stage."""
    from deepspeed.runtime.utils import is_model_parallel_parameter

    from zerorun.pipeline.module import count_every_stage_in_the_gradient_norm

    pipe = SequentialPipe(pipeline_layers(tiny_gpt2()))
    replicated = pipe.tied_modules["embed"].weight
    replicated.ds_pipe_replicated = True
    count_every_stage_in_the_gradient_norm(pipe)
    assert not is_model_parallel_parameter(replicated)
    assert all(is_model_parallel_parameter(p) for p in pipe.parameters() if p is not replicated)


def test_layers_wrap_the_models_own_parameters():
    model = tiny_gpt2()
    pipe = SequentialPipe(pipeline_layers(model))
    assert {id(p) for p in pipe.parameters()} == {id(p) for p in model.parameters()}


def test_refuses_unsupported_models_and_arguments():
    with pytest.raises(ValueError, match="supports GPT2LMHeadModel"):
        pipeline_layers(GPT2ForSequenceClassification(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))
    with pytest.raises(ValueError, match="does not fit"):
        pipeline_layers(tiny_gpt2(), "sequence_classification")
    with pytest.raises(ValueError, match="partition_method"):
        build_pipeline_module(tiny_gpt2(), "causal_lm", num_stages=1, partition_method="balanced")
    with pytest.raises(ValueError, match="num_stages"):
        build_pipeline_module(tiny_gpt2(), "causal_lm", num_stages=7)


# ---------------------------------------------------------------------------------------------
# Back to Hugging Face names


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_export_reproduces_the_hf_state_dict(family, tmp_path):
    model = tiny_gpt2() if family == "gpt2" else tiny_bert()
    layers = pipeline_layers(model)
    sd = export_state_dict(layers, model)
    ref = model.state_dict()
    assert list(sd) == list(ref)
    for name in ref:
        assert torch.equal(sd[name], ref[name]), name
    if family == "gpt2":  # the tied weight once: one tensor under both HF names
        assert sd["lm_head.weight"] is sd["transformer.wte.weight"]
        assert sum(1 for m in SequentialPipe(layers).modules() if type(m).__name__ == "GPT2TokenEmbeddingPipe") == 1

    # Into a differently initialised model, then through save_pretrained / from_pretrained.
    torch.manual_seed(123)
    fresh = type(model)(model.config)
    assert not torch.equal(fresh.state_dict()[next(iter(ref))], ref[next(iter(ref))])
    fresh.load_state_dict(sd)
    fresh.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, ref[name]), name


def test_export_follows_training_of_the_pipeline():
    model = tiny_gpt2(dropout=0.0)
    pipe = SequentialPipe(pipeline_layers(model))
    with torch.no_grad():
        for p in pipe.parameters():
            p.add_(1.0)
    sd = export_state_dict(pipe, model)
    assert torch.equal(sd["transformer.h.1.mlp.c_fc.bias"], model.transformer.h[1].mlp.c_fc.bias)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_per_stage_dicts_merge_into_the_hf_state_dict(family):
    """A two-stage split, as DeepSpeed partitions it: each stage names only its own layers; the tied
    embedding is on both; the merge gives every HF name exactly once."""
    from deepspeed.runtime.utils import partition_uniform

    model = tiny_gpt2() if family == "gpt2" else tiny_bert()
    layers = pipeline_layers(model)
    parts = partition_uniform(num_items=len(layers), num_parts=2)
    stages = [stage_state_dict(SequentialPipe(layers[parts[s]:parts[s + 1]])) for s in range(2)]
    assert (set(stages[0]) & set(stages[1])) <= {"transformer.wte.weight"}
    if family == "gpt2":
        assert "transformer.wte.weight" in stages[0] and "transformer.wte.weight" in stages[1]
        assert "lm_head.weight" not in stages[0] and "lm_head.weight" not in stages[1]
    merged = merge_state_dicts(stages, model)
    ref = model.state_dict()
    assert list(merged) == list(ref)
    assert all(torch.equal(merged[k], ref[k]) for k in ref)
    with pytest.raises(ValueError, match="not produced by any stage"):
        merge_state_dicts(stages[:1], model)
    with pytest.raises(ValueError, match="not in"):
        merge_state_dicts([{**stages[0], "bogus.weight": torch.zeros(1)}, stages[1]], model)


# ---------------------------------------------------------------------------------------------
# A real one-process PipelineModule and engine (gloo, world size 1), in a subprocess
