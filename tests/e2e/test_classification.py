"""BERT-family sequence classification on 2 CPU ranks, and LM fine-tunes on a user's own files."""
import json

import pytest

from helpers import (TORCHRUN, assert_export_matches_engine, assert_run_dir_complete, load_export, read_metrics,
                     run_zerorun)

pytestmark = pytest.mark.e2e

QUICK = ["launcher.nproc_per_node=2", "trainer.progress=false", "trainer.warmup_steps=1", TORCHRUN]


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow  # (two runs; test_bert_classification trains the pretrained MiniLM in `make test`)
def test_pretrained_minilm_beats_random_init(tmp_path, cache_dir):
    """The real pretrained MiniLM vs the same architecture from random init: same data, steps, LR."""
    common = [*QUICK, "+model=minilm", "zero=stage2", "trainer.max_steps=30", "trainer.lr=5e-5",
              "trainer.micro_batch_size=16", "data.seq_len=32", "trainer.warmup_steps=3", "trainer.export=false"]
    pretrained, scratch = tmp_path / "pretrained", tmp_path / "scratch"
    assert run_zerorun(common, pretrained, cache_dir).returncode == 0
    assert run_zerorun([*common, "model.pretrained=false"], scratch, cache_dir).returncode == 0
    acc_pre, acc_rand = summary(pretrained)["val_accuracy"], summary(scratch)["val_accuracy"]
    print(f"\nMiniLM-L6 on the sentiment set, 30 steps ZeRO-2: validation accuracy pretrained {acc_pre:.3f}, "
          f"random init {acc_rand:.3f} (chance 0.5; validation adjectives never occur in training)")
    assert acc_pre >= 0.8
    assert acc_pre > acc_rand + 0.2
    # Length-grouped batches: almost no padding in what trained (summary.json reports it for both tasks).
    assert summary(pretrained)["non_pad_fraction"] >= 0.97, summary(pretrained)["non_pad_fraction"]


@pytest.mark.parametrize("overrides", [
    pytest.param(["zero=stage1"], id="zero1", marks=pytest.mark.slow),
    pytest.param(["zero=stage2", "precision=bf16"], id="zero2-bf16", marks=pytest.mark.slow),
    pytest.param(["zero=stage3", "offload=cpu"], id="zero3-param-offload"),
])
def test_bert_classification(tmp_path, cache_dir, overrides):
    run_dir = tmp_path / "run"
    # The pretrained MiniLM (BERT architecture): its loss falls within a few steps, unlike a
    # from-scratch tiny BERT whose first steps on 2-class data are mostly noise.
    proc = run_zerorun([*QUICK, "+model=minilm", "trainer.max_steps=10", "trainer.lr=1e-4", "trainer.save_every=5",
                        "trainer.micro_batch_size=16", "data.seq_len=32", *overrides], run_dir, cache_dir)
    assert proc.returncode == 0, proc.stdout[-4000:]
    metrics, s = assert_run_dir_complete(run_dir, 10)
    losses = [m["loss"] for m in metrics]
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.05, losses
    # The reported accuracy is the exported model's on the validation split, recomputed here from scratch.
    acc, n = export_accuracy(run_dir)
    slack = 0 if "precision=bf16" not in overrides else 0.01  # bf16 logits may flip a near-tie
    assert abs(s["val_accuracy"] - acc) <= slack + 0.5 / n, (s["val_accuracy"], acc, n)
    assert 0 < s["val_f1"] <= 1 and s["val_loss"] > 0
    ds = json.loads((run_dir / "ds_config.json").read_text())
    if "offload=cpu" in overrides:
        assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert_export_matches_engine(run_dir)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(run_dir / "export").vocab_size == 30522


def export_accuracy(run_dir):
    """Accuracy of the exported model on the prepared validation split, in batches of 64."""
    import torch

    from zerorun.rundir import RunDir
    from zerorun.data import open_split

    model, _ = load_export(run_dir)
    val = open_split(RunDir(run_dir).read_prepared(), "val")
    correct = 0
    with torch.no_grad():
        for start in range(0, len(val), 64):
            b = {k: torch.from_numpy(v) for k, v in val.batch(list(range(start, min(start + 64, len(val))))).items()}
            labels = b.pop("labels")
            correct += int((model(**b).logits.argmax(-1) == labels).sum())
    return correct / len(val), len(val)


def _corpus(n):
    from zerorun.data import synthetic_corpus

    return synthetic_corpus(n, seed=11)


@pytest.mark.parametrize("fmt", ["jsonl", pytest.param("txt", marks=pytest.mark.slow)])
def test_gpt2_lm_on_user_files_reports_perplexity(tmp_path, cache_dir, fmt):
    docs = _corpus(400)
    path = tmp_path / f"corpus.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
        extra = ["data.text_column=body"]
    else:
        path.write_text("\n\n".join(docs))
        extra = []
    run_dir = tmp_path / "run"
    proc = run_zerorun([*QUICK, f"data.path={path}", "data.seq_len=64", "trainer.max_steps=6", "trainer.lr=2e-3",
                        "trainer.micro_batch_size=4", "trainer.eval_every=3", *extra], run_dir, cache_dir)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert f"data: {path}" in proc.stdout
    s = summary(run_dir)
    assert s["val_perplexity"] > 1 and abs(s["val_perplexity"] - __import__("math").exp(s["val_loss"])) < 1e-6 * s["val_perplexity"]
    assert "val_perplexity" in read_metrics(run_dir)[2]  # eval_every=3 puts it on step 3's line


MALFORMED = [
    ("bad.jsonl", '{"text": "fine", "label": 1}\n{"text": "broken", "label": \n', [],
     "bad.jsonl:2: not valid JSON"),
    ("nocol.jsonl", '{"text": "fine", "label": 1}\n{"review": "x", "label": 0}\n', [],
     "nocol.jsonl:2: no column 'text'"),
    ("range.csv", "text,label\ngood,1\nbad,0\nodd,7\n", [], "range.csv:4: label 7 is outside [0, 2)"),
    ("empty.jsonl", "", [], "empty.jsonl: the file is empty"),
    ("nolabel.csv", "text,score\ngood,1\n", [], "nolabel.csv:2: no column 'label'"),
]


@pytest.mark.parametrize("name,content,extra,needle", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_data_exits_2_naming_file_and_line(tmp_path, cache_dir, name, content, extra, needle):
    path = tmp_path / name
    path.write_text(content)
    proc = run_zerorun([*QUICK, "+model=tiny-bert", f"data.path={path}", *extra], tmp_path / "run", cache_dir,
                       timeout=180)
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert needle in proc.stdout and str(tmp_path) in proc.stdout, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout
    assert not (tmp_path / "run" / "ds_config.json").exists()
