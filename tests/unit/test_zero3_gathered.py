"""ZeRO-3's gathered parameters (memory/buffers.py zero3_live_peak): DeepSpeed's prefetch fills
stage3_max_live_parameters, and its release rule keeps what the prefetch front or the reuse distance still needs."""
import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from helpers import model_file
from zerorun.memory.buffers import zero3_live_peak
from zerorun.memory.params import breakdown, model_key

THRESHOLD = 2560  # zerorun's default persistence threshold (10 × hidden) for hidden 256


def llama(layers=16, hidden=256, vocab=16000):
    """benchmarks/zero3_live.py's model: Llama-class, GQA 4:1, a tied head; 19.3M parameters at the defaults."""
    return dataclasses.replace(model_file("llama-3.2-1b"), name="llama-small", num_layers=layers, hidden_size=hidden,
                               num_heads=hidden // 32, num_kv_heads=max(1, hidden // 128), head_dim=32,
                               intermediate_size=4 * hidden, vocab_size=vocab, max_positions=512)


# Counted in real DeepSpeed 0.19.8 engines on 2 CPU ranks, the third step's peak over every module's forward hooks
# and every gradient's hook (`DS_ACCELERATOR=cpu python benchmarks/zero3_live.py`, benchmarks/results/zero3-live-*):
# (reuse distance, max live) → elements gathered.
@pytest.mark.parametrize("reuse, max_live, measured", [
    (0, 8_000_000, 11_960_320),  # the prefetch budget, overshot by the tied embedding the head fetches again
    (0, 3_000_000, 7_045_120),  # ... and a budget far below the model
    (1_000_000_000, 8_000_000, 19_300_352),  # the reuse distance spans the model: nothing is released
    (15_600_000, 8_000_000, 8_257_536),
    (8_000_000, 1_000_000_000, 19_300_352),  # the budget spans the model: the prefetch gathers all of it
    (0, 1_000_000_000, 19_300_352),  # ... whatever the reuse distance (a release-only replay said 4.1M)
    (15_600_000, 1_000_000_000, 19_300_352),
])
def test_the_replay_counts_what_deepspeed_holds_gathered(reuse, max_live, measured):
    assert zero3_live_peak(model_key(llama()), THRESHOLD, reuse, max_live) == measured


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 24), hidden=st.sampled_from([64, 128, 256]), vocab=st.integers(100, 30000),
       reuse=st.integers(0, 40_000_000), max_live=st.integers(1, 40_000_000))
def test_gathered_lies_between_the_budget_and_the_whole_model(layers, hidden, vocab, reuse, max_live):
    m = llama(layers, hidden, vocab)
    threshold = 10 * hidden
    whole = sum(set_of_tensors(m, threshold))
    live = zero3_live_peak(model_key(m), threshold, reuse, max_live)
    assert live <= whole
    assert live >= min(max_live, whole)  # the prefetch fills the budget from the first module on
    if max_live >= whole:
        assert live == whole


def set_of_tensors(m, threshold):
    """Every non-persistent tensor once (the tied head is the embedding)."""
    bd = breakdown(model_key(m))
    yield from (n for n in bd.embedding_tensors if n > threshold)
    for _ in range(bd.num_layers):
        yield from (n for n in bd.layer_tensors if n > threshold)
    yield from (n for n in bd.head_tensors if n > threshold)
