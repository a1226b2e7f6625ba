"""trainer.fused_loss: the chunked head and cross-entropy against the model's own loss, where the rules let it run,
what the gate counts for it, and how autofit and the OOM repair use it."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import CPU2, CPU_HOST, GPU8, composed, planned, repair_ladder
from zerorun.config import check
from zerorun.hardware import GIB, Hardware
from zerorun.memory import estimate
from zerorun.memory.activations import FUSED_MIN_CHUNK, fused_chunk_tokens
from zerorun.memory.ladder import Knobs, apply
from zerorun.train.fused_loss import IGNORE_INDEX, FusedLinearCrossEntropy, install

pytestmark = pytest.mark.unit


def _reference(h, w, b, labels, softcap):
    z = (h @ w.t() if b is None else h @ w.t() + b).float()
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z, labels, ignore_index=IGNORE_INDEX)


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 70), hidden=st.integers(1, 24), vocab=st.integers(2, 90), chunk=st.integers(1, 80),
       ignored=st.floats(0, 0.9), bias=st.booleans(), softcap=st.sampled_from([None, 3.0]),
       head_trains=st.booleans(), seed=st.integers(0, 2**16))
def test_the_chunked_loss_and_its_gradients_are_the_models_own(tokens, hidden, vocab, chunk, ignored, bias, softcap,
                                                               head_trains, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64).requires_grad_(head_trains)
    b = torch.randn(vocab, generator=g, dtype=torch.float64).requires_grad_(head_trains) if bias else None
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[torch.rand(tokens, generator=g) < ignored] = IGNORE_INDEX
    labels[0] = 0  # at least one token counts (HF's mean over none is NaN; the fused loss is 0)
    want = _reference(h, w, b, labels, softcap)
    want_grads = torch.autograd.grad(want * 3, [t for t in (h, w, b) if t is not None and t.requires_grad])
    got = FusedLinearCrossEntropy.apply(h, w, b, labels, chunk, softcap)
    got_grads = torch.autograd.grad(got * 3, [t for t in (h, w, b) if t is not None and t.requires_grad])
    # (the fused loss sums in fp32 and returns fp32, as HF's upcast logits do)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    for a, e in zip(got_grads, want_grads):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_one_chunks_blocks_exist_at_a_time_as_the_gate_counts_them(softcap):
    import json
    from types import SimpleNamespace

    from zerorun.memory.activations import Activations, with_fused_loss
    from zerorun.telemetry import live_bytes
    from zerorun.train.fused_loss import _chunked

    tokens, hidden, vocab = 1024, 16, 2000
    chunk = fused_chunk_tokens(tokens, hidden, vocab)
    assert chunk < tokens  # several chunks, so that "one at a time" is what is measured
    h = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, dtype=torch.bfloat16)  # a frozen head: no gradient of its own
    labels = torch.randint(0, vocab, (tokens,))
    with live_bytes() as tracker:
        _chunked(h, w, None, labels, chunk, softcap, grads=True)
    # the gate's loss transient for this head in bf16 on a CPU rank, the head frozen
    model = SimpleNamespace(vocab_size=vocab, hidden_size=hidden,
                            hf_config=json.dumps({"final_logit_softcapping": softcap} if softcap else {}))
    act = Activations("sdpa-fused", 0, 0, 0, 0, 0, 0, num_layers=1, checkpointing=False)
    counted = with_fused_loss(act, model, tokens, 2, head_trains=False, accelerator="cpu").logits_loss
    # the inputs (counted as the tracker first sees views of them), the hidden states' gradient, per-row vectors
    small = h.nbytes + w.nbytes + 2 * tokens * hidden + 64 * chunk * 4
    assert counted <= tracker.peak <= counted + small


def test_the_gpus_way_sums_the_heads_gradient_in_its_dtype_close_to_the_models_own():
    """On a GPU the head's gradient sums over chunks in bf16 (Liger-Kernel's choice), run here on CPU tensors."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(600, 64, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(3000, 64, generator=g) * 0.1).bfloat16().requires_grad_()
    labels = torch.randint(0, 3000, (600,), generator=g)
    want = torch.autograd.grad(_reference(h, w, None, labels, None), [h, w])
    got = torch.autograd.grad(FusedLinearCrossEntropy.apply(h, w, None, labels, 256, None, torch.bfloat16), [h, w])
    assert got[1].dtype == torch.bfloat16
    for a, e in zip(got, want):  # three bf16 roundings of the sum instead of one
        assert (a.float() - e.float()).norm() <= 0.02 * e.float().norm()


@given(tokens=st.integers(1, 1 << 16), hidden=st.integers(16, 8192), vocab=st.integers(2, 300_000))
def test_a_chunk_is_a_power_of_two_of_at_least_256_tokens_or_the_whole_micro_batch(tokens, hidden, vocab):
    c = fused_chunk_tokens(tokens, hidden, vocab)
    assert 1 <= c <= tokens
    assert c == tokens or (c >= FUSED_MIN_CHUNK and c & (c - 1) == 0)
    assert c == tokens or c * vocab <= max(FUSED_MIN_CHUNK * vocab, 2 * tokens * hidden + vocab)  # ~ one activation


@pytest.mark.parametrize("kind", ["gpt2", "llama", "gemma2", "gemma3_text"])
def test_an_installed_model_trains_and_evaluates_on_the_fused_loss(kind):
    import transformers as T

    cfg = {"gpt2": lambda: T.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300, n_positions=32,
                                        resid_pdrop=0, embd_pdrop=0, attn_pdrop=0),
           "llama": lambda: T.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                          intermediate_size=64, vocab_size=300, tie_word_embeddings=False),
           "gemma2": lambda: T.Gemma2Config(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                            num_key_value_heads=1, head_dim=16, intermediate_size=64,
                                            vocab_size=300),
           "gemma3_text": lambda: T.Gemma3TextConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                                     num_key_value_heads=1, head_dim=16, intermediate_size=64,
                                                     vocab_size=300)}[kind]()
    torch.manual_seed(0)
    own = T.AutoModelForCausalLM.from_config(cfg).train()
    fused = T.AutoModelForCausalLM.from_config(cfg).train()
    fused.load_state_dict(own.state_dict())
    install(fused)
    x = torch.randint(0, 300, (2, 24))
    labels = x.clone()
    labels[1, :6] = IGNORE_INDEX
    a, b = own(input_ids=x, labels=labels), fused(input_ids=x, labels=labels)
    assert b.logits is None  # what the fused loss saves
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-5)
    a.loss.backward()
    b.loss.backward()
    for (name, p), q in zip(own.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    fused.eval()
    own.eval()
    torch.testing.assert_close(fused(input_ids=x).logits, own(input_ids=x).logits)  # the probe: no labels
    with torch.no_grad():  # evaluation: the loss chunk by chunk, no logits either
        a, b = own(input_ids=x, labels=labels), fused(input_ids=x, labels=labels)
    assert b.logits is None
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides, says", [
    (("+model=tiny-bert",), "task=sequence_classification"),
    (("zero=stage3",), "zero=stage3"),
    (("parallel=pipeline", "parallel.micro_batches=2"), "parallel=pipeline"),
    (("+model=tiny-llama", "adapter=lora", "adapter.target_modules=[q_proj,lm_head]"), "lm_head"),
    (("+model=qwen3-30b-a3b", "+model.hf_config.output_router_logits=true"), "load-balancing loss"),
])
def test_the_fused_loss_is_refused_where_it_cannot_run(overrides, says):
    problems = [p for p in check(composed(*overrides, "trainer.fused_loss=true"), CPU2)
                if p.key == "trainer.fused_loss"]
    assert len(problems) == 1 and says in str(problems[0]) and "Fix:" in str(problems[0]), problems
    off = check(composed(*overrides, "trainer.fused_loss=false"), CPU2)
    assert not [p for p in off if p.key == "trainer.fused_loss"]


def test_the_gate_counts_one_chunk_and_the_heads_gradient_instead_of_the_logits():
    base = ("+model=llama-3.2-1b", "precision=bf16", "data.seq_len=2048", "zero=stage2")
    hw = Hardware("cuda", 8, 80 * GIB, 512 * GIB, 1, 64)
    own, fused = (estimate(*planned(*base, f"trainer.fused_loss={f}"), hw) for f in ("false", "true"))
    V, H, tokens = 128_256, 2048, 8 * 2048
    assert own.components["logits + loss"] == 12 * tokens * V  # three fp32 b·s·V blocks
    chunk = fused_chunk_tokens(tokens, H, V)
    # the untied head trains: its gradient in bf16 on a GPU (Liger-Kernel's), and one chunk's fp32 + bf16 logits
    assert fused.phases["loss"]["logits + loss"] == 2 * V * H + 6 * chunk * V
    cpu = estimate(*planned(*base, "trainer.fused_loss=true", world=CPU2), CPU_HOST)
    assert cpu.phases["loss"]["logits + loss"] == 4 * V * H + max(6 * chunk * V, 2 * V * H)  # fp32, then its cast
    assert own.per_rank_peak_bytes - fused.per_rank_peak_bytes > 10 * GIB
    lora = estimate(*planned(*base, "adapter=lora", "trainer.fused_loss=true"), hw)
    assert lora.phases["loss"]["logits + loss"] == 6 * chunk * V  # a frozen head has no gradient


def test_gemmas_soft_capped_logits_are_saved_by_its_own_loss_only():
    # Gemma-2's forward keeps the tanh of its final soft-capping, b·s·V in bf16: the fused loss never makes it
    base = ("+model=gemma-2-9b", "precision=bf16", "data.seq_len=1024", "trainer.micro_batch_size=2", "zero=stage2")
    hw = Hardware("cuda", 8, 80 * GIB, 512 * GIB, 1, 64)
    own, fused = (estimate(*planned(*base, f"trainer.fused_loss={f}"), hw) for f in ("false", "true"))
    saved = {"own": own.phases["loss"]["activations"], "fused": fused.phases["loss"]["activations"]}
    assert saved["own"] - saved["fused"] == 2 * 1024 * 256_000 * 2


def test_null_fuses_a_cpu_ranks_causal_lm_where_it_runs_and_leaves_gpus_to_autofit():
    from zerorun.config import make_plan

    assert composed().trainer.fused_loss is None  # the default
    assert make_plan(composed("+model=tiny-gpt2"), CPU2).fused_loss  # CPU ranks: on where it runs
    assert not make_plan(composed("+model=tiny-gpt2", "zero=stage3"), CPU2).fused_loss  # ...not at ZeRO-3
    assert not make_plan(composed("+model=tiny-bert"), CPU2).fused_loss  # a classifier
    assert not make_plan(composed("+model=tiny-gpt2", "trainer.fused_loss=false"), CPU2).fused_loss
    assert not make_plan(composed("+model=tiny-gpt2"), GPU8).fused_loss  # GPUs: not measured there yet
    assert make_plan(composed("+model=tiny-gpt2", "trainer.fused_loss=true"), GPU8).fused_loss


def test_autofit_turns_it_on_only_where_the_user_left_it_open_and_zero3_turns_it_off():
    for overrides in (("trainer.fused_loss=false",), ()):  # on GPUs, where null leaves it to autofit
        steps = repair_ladder("+model=tiny-gpt2", "trainer.micro_batch_size=1", *overrides, world=GPU8)
        keys = [c.key for _, changes in steps for c in changes]
        assert ("trainer.fused_loss" in keys) == (not overrides), keys
        if not overrides:  # the first rung (it costs nothing), then off again at ZeRO-3
            assert keys[0] == "trainer.fused_loss"
            assert [c.new for _, changes in steps for c in changes if c.key == "trainer.fused_loss"] == [True, False]
    cfg, plan = planned("+model=tiny-gpt2", "trainer.fused_loss=true", "zero=stage2", world=CPU2)
    new, changes = apply(cfg, CPU2, Knobs(8, False, False, 3, cfg.offload.device, None), plan.global_batch_size)
    assert new.trainer.fused_loss is False and not check(new, CPU2)
    assert [c.override() for c in changes if c.key == "trainer.fused_loss"] == ["trainer.fused_loss=false"]
    # CPU ranks with null: no change to say at any rung (each rung resolves it), and a classifier is never offered it
    for model in ("+model=tiny-gpt2", "+model=tiny-bert"):
        steps = repair_ladder(model, "trainer.micro_batch_size=1")
        assert steps and all(c.key != "trainer.fused_loss" for _, changes in steps for c in changes)
