"""A Llama-class decoder's saved activations and logits (the estimate's arithmetic, zerorun/arch/decoder.py) against what
autograd really saves in a transformers model built from config on CPU: tiny Llama (untied head, GQA 4/2) and tiny
Qwen2 (q/k/v biases, tied head) × fp32/bf16 × checkpointing off/on × seq 64/128. The instrument is the saved-tensor
hook (unique storages, parameters excluded; under checkpointing the live bytes at the end of forward), not the
estimator. ~10 s."""
import sys

import pytest

from helpers import ROOT
from zerorun.config import Dtype

sys.path.insert(0, str(ROOT / "benchmarks"))
import memory_harness as H  # noqa: E402


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_saved_activations_and_logits_of_a_llama_class_decoder(name):
    m = H.model_file(name)
    rows = H.measure_activations(m, (Dtype.fp32, Dtype.bf16), (False, True), (64, 128), 4, peaks=())
    assert len(rows) == 8
    bad = []
    for r in rows:
        e = H.estimate_activation_row(r, m)
        err = (e["activations"] - r["activations"]) / r["activations"]
        print(f"{name} {r['dtype']} ckpt={r['ckpt']} seq={r['seq']}: saved {r['activations']} estimated "
              f"{e['activations']} ({100 * err:+.1f}%), logits {r['logits']} vs {e['logits']}")
        if abs(err) > 0.02 or r["logits"] != e["logits"]:
            bad.append(f"{r['dtype']} ckpt={r['ckpt']} seq={r['seq']}: {100 * err:+.1f}%, logits {r['logits']} vs "
                       f"{e['logits']}")
    assert not bad, bad


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"],
                                     ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]])
def test_lora_activations_of_a_frozen_llama(targets):
    """With LoRA the frozen base saves less (no inputs of frozen projections, no normalized norm outputs, no LM-head
    input) and the adapters save their own inputs and rank-r outputs. Never under; over by what layer 0 does not
    save (nothing upstream of its first adapter needs a gradient), which the estimate does not subtract."""
    import torch

    from helpers import composed
    from zerorun import memory as M
    from zerorun.arch import lora_targets
    from zerorun.config import TaskName
    from zerorun.models import build_model, with_lora

    cfg = composed("+model=tiny-llama", "adapter=lora", f"adapter.target_modules=[{','.join(targets)}]")
    bad = []
    for dtype in (Dtype.fp32, Dtype.bf16):
        for ckpt in (False, True):
            torch.manual_seed(0)
            model = build_model(cfg.model, TaskName.causal_lm)
            if ckpt:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model = with_lora(model, cfg.model, cfg.adapter, TaskName.causal_lm).to(H.torch_dtype(dtype))
            inputs = H.batch(cfg.model, 4, 128)
            acts, logits, _ = H.saved_activations(model, inputs)
            if ckpt:
                acts = H.forward_live(model, inputs) - logits
            est = M.activations(cfg.model, 4, 128, dtype, "cpu", ckpt,
                                lora=(lora_targets(cfg.model, cfg.adapter), cfg.adapter.r, cfg.adapter.dropout)).saved
            err = (est - acts) / acts
            print(f"{len(targets)} targets {dtype.value} ckpt={ckpt}: saved {acts}, estimated {est} ({100 * err:+.1f}%)")
            if not -0.02 <= err <= 0.12:
                bad.append(f"{dtype.value} ckpt={ckpt}: {100 * err:+.1f}%")
    assert not bad, bad
