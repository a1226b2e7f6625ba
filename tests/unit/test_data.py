"""Corpus, packing, sampling and data errors."""
import numpy as np
import pytest

from zerorun.config import DataConfig, ModelConfig
from zerorun.data import DataError, RankSampler, pack, prepare, read_lm_texts, synthetic_corpus


def test_synthetic_corpus_is_deterministic():
    assert synthetic_corpus(50, 1) == synthetic_corpus(50, 1)
    assert synthetic_corpus(50, 1) != synthetic_corpus(50, 2)


def test_pack_has_no_padding_and_separates_documents():
    blocks = pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], seq_len=4, eos_id=0)
    assert blocks.tolist() == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]]


def test_rank_sampler_shards_are_disjoint_and_cover_an_epoch():
    samplers = [RankSampler(40, r, 2, 4, seed=7) for r in range(2)]
    seen = [np.concatenate([s.next_indices() for _ in range(s.batches_per_epoch)]) for s in samplers]
    assert not set(seen[0]) & set(seen[1])
    assert len(set(seen[0]) | set(seen[1])) == 40


def test_rank_sampler_resumes_from_consumed():
    a = RankSampler(40, 0, 2, 4, seed=7)
    full = [a.next_indices().tolist() for _ in range(12)]  # crosses an epoch boundary
    b = RankSampler(40, 0, 2, 4, seed=7)
    b.consumed = 5
    assert [b.next_indices().tolist() for _ in range(7)] == full[5:]


def test_rank_sampler_refuses_too_little_data():
    with pytest.raises(DataError, match="too few for one global batch"):
        RankSampler(5, 0, 2, 4, seed=0)


def test_prepare_caches(tmp_path):
    data = DataConfig(cache_dir=str(tmp_path), synthetic_docs=200, seq_len=32)
    model = ModelConfig(name="t", num_layers=1, hidden_size=8, num_heads=2, intermediate_size=8, vocab_size=1000,
                        max_positions=64)
    first = prepare(data, model, seed=3)
    second = prepare(data, model, seed=3)
    assert not first.cached and second.cached
    assert first.train == second.train and np.load(first.train).shape[1] == 32
    assert first.vocab_size <= 1000


@pytest.mark.parametrize("name,content,needle", [
    ("empty.txt", "", "the file is empty"),
    ("bad.jsonl", '{"text": "ok"}\n{"text": \n', "bad.jsonl:2: not valid JSON"),
    ("nocol.jsonl", '{"text": "ok"}\n{"body": "x"}\n', "nocol.jsonl:2: no column 'text'"),
    ("nocol.csv", "body\nhello\n", "nocol.csv:2: no column 'text'"),
])
def test_malformed_files_name_file_and_line(tmp_path, name, content, needle):
    p = tmp_path / name
    p.write_text(content)
    with pytest.raises(DataError, match=needle.replace("(", r"\(")):
        read_lm_texts(str(p), "auto", "text")


def test_a_step_sees_the_same_sequences_however_it_is_split():
    """2 ranks × 2 micro-batches, 1 rank × 4 and 4 ranks × 1 draw the same global batch per step."""
    def step_set(world, accum):
        samplers = [RankSampler(64, r, world, 2, seed=3, accum=accum) for r in range(world)]
        return sorted(int(i) for s in samplers for _ in range(accum) for i in s.next_indices())

    assert step_set(2, 2) == step_set(1, 4) == step_set(4, 1)
