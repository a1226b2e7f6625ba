"""A Llama-class decoder's saved activations and logits (the estimate's arithmetic, zerorun/arch.py) against what
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
