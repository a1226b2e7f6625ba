"""Corpus, packing, sampling and data errors."""
import numpy as np
import pytest

from zerorun.config import DataConfig, Family, ModelConfig
from zerorun.data import DataError, RankSampler, pack, prepare, read_labelled, read_lm_texts, synthetic_corpus, \
    too_few_sequences


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


@pytest.mark.heavy
def test_prepare_caches(tmp_path):
    data = DataConfig(cache_dir=str(tmp_path), synthetic_docs=200, seq_len=32)
    model = ModelConfig(name="t", family=Family.gpt2, num_layers=1, hidden_size=8, num_heads=2, intermediate_size=8, vocab_size=1000,
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


def test_labelled_rows_with_integer_and_named_labels(tmp_path):
    ints = tmp_path / "ints.jsonl"
    ints.write_text('{"text": "good", "label": 1}\n\n{"text": "bad", "label": "0"}\n{"text": "meh", "label": 2.0}\n')
    rows, names = read_labelled(str(ints), "auto", "text", "label", 3)
    assert rows == [("good", 1), ("bad", 0), ("meh", 2)] and names == ["0", "1", "2"]
    named = tmp_path / "named.csv"
    named.write_text("review,sentiment\nfine,pos\nawful,neg\nok,pos\n")
    rows, names = read_labelled(str(named), "auto", "review", "sentiment", 2)
    assert names == ["neg", "pos"] and rows == [("fine", 1), ("awful", 0), ("ok", 1)]  # sorted names → ids


@pytest.mark.parametrize("content,labels,needle", [
    ('{"text": "a", "label": 5}\n', 2, "ints.jsonl:1: label 5 is outside [0, 2) for task.num_labels=2"),
    ('{"text": "a", "label": "x"}\n{"text": "b", "label": "y"}\n{"text": "c", "label": "z"}\n', 2,
     "3 distinct labels (x, y, z) but task.num_labels=2. Fix: task.num_labels=3"),
    ('{"text": "a"}\n', 2, "ints.jsonl:1: no column 'label'"),
])
def test_labelled_errors_name_the_file_line_and_fix(tmp_path, content, labels, needle):
    p = tmp_path / "ints.jsonl"
    p.write_text(content)
    with pytest.raises(DataError) as e:
        read_labelled(str(p), "auto", "text", "label", labels)
    assert needle in str(e.value)


def test_plain_text_has_no_labels(tmp_path):
    p = tmp_path / "x.txt"
    p.write_text("hello\n")
    with pytest.raises(DataError, match="plain text has no labels"):
        read_labelled(str(p), "auto", "text", "label", 2)


def test_a_missing_data_file_is_a_data_error_not_a_traceback(tmp_path):
    model = ModelConfig(name="t", family=Family.gpt2, num_layers=1, hidden_size=8, num_heads=2, intermediate_size=8, vocab_size=1000,
                        max_positions=64)
    with pytest.raises(DataError, match="data.path=/nonexistent/file.txt: no such file"):
        prepare(DataConfig(path="/nonexistent/file.txt", cache_dir=str(tmp_path)), model, seed=0)
    with pytest.raises(DataError, match="data.val_path="):
        real = tmp_path / "train.txt"
        real.write_text("some text\n")
        prepare(DataConfig(path=str(real), val_path=str(tmp_path / "nope.txt"), cache_dir=str(tmp_path)), model, 0)


def test_too_few_sequences_is_one_rule_for_launcher_and_sampler():
    assert too_few_sequences(16, 16, "x") is None
    problem = too_few_sequences(5, 8, "2 ranks × micro-batch 4 × accumulation 1")
    assert problem.key == "trainer.global_batch_size" and "5 training sequences are too few" in str(problem)


def non_pad_fraction(sampler, lengths, steps):
    real = padded = 0
    for _ in range(steps):
        for _ in range(sampler.accum):
            ls = lengths[sampler.next_indices()]
            real, padded = real + ls.sum(), padded + ls.max() * len(ls)
    return real / padded


def long_tailed_lengths(n=6000, seed=0):
    """Review-like lengths: log-normal around ~60 tokens with a long tail, clipped to [4, 512]."""
    return np.clip(np.random.default_rng(seed).lognormal(4.1, 0.7, n), 4, 512).astype(np.int64)


def test_length_grouping_keeps_every_step_the_same_whatever_the_split_and_resumes():
    lengths = long_tailed_lengths(2000)
    # Global batch 16: 2 ranks × micro 8, or 2 ranks × micro 4 × accumulation 2.
    def step_sets(micro, accum, steps=30):
        ss = [RankSampler(2000, r, 2, micro, seed=3, accum=accum, lengths=lengths) for r in range(2)]
        return [sorted(np.concatenate([s.next_indices() for s in ss for _ in range(accum)]).tolist())
                for _ in range(steps)]
    assert step_sets(8, 1) == step_sets(4, 2)
    a = RankSampler(2000, 1, 2, 8, seed=3, lengths=lengths)
    full = [a.next_indices().tolist() for _ in range(200)]  # crosses an epoch (125 per epoch)
    b = RankSampler(2000, 1, 2, 8, seed=3, lengths=lengths)
    b.consumed = 77
    assert [b.next_indices().tolist() for _ in range(123)] == full[77:]
    # Every example once per epoch, as without grouping.
    ss = [RankSampler(2000, r, 2, 8, seed=3, lengths=lengths) for r in range(2)]
    epoch = np.concatenate([s.next_indices() for s in ss for _ in range(s.batches_per_epoch)])
    assert len(set(epoch.tolist())) == len(epoch) == 2000


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["long-tailed", "built-in sentiment"])
def test_length_grouping_makes_batches_at_least_97_percent_real_tokens(tmp_path, name):
    if name == "long-tailed":
        lengths = long_tailed_lengths()
    else:
        import dataclasses

        from helpers import composed
        from zerorun.data import open_split

        cfg = composed("+model=tiny-bert", "data.seq_len=128")
        data = dataclasses.replace(cfg.data, cache_dir=str(tmp_path))
        lengths = open_split(prepare(data, cfg.model, cfg.seed, "sequence_classification", 2), "train").lengths
    n = len(lengths)
    grouped = non_pad_fraction(RankSampler(n, 0, 2, 8, seed=1, lengths=lengths), lengths, 100)
    plain = non_pad_fraction(RankSampler(n, 0, 2, 8, seed=1), lengths, 100)
    print(f"{name}: non-pad fraction {plain:.3f} → {grouped:.3f} with length grouping "
          f"(pad to max 128: {np.minimum(lengths, 128).mean() / 128:.3f})")
    assert grouped >= 0.97 and grouped > plain
