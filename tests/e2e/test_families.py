"""Architectures zerorun has no arithmetic for, trained from a directory holding only a config.json (issue 34): a
Gemma-3 decoder (sliding and full attention layers) with LoRA, and a ModernBERT classifier, full, whose export then
loads back with model.pretrained=true. Each plan is the traced one (estimate.json), and each rank's peak RSS stays
under the gate's bound. benchmarks/families.py runs every family, full and LoRA."""
import json

import pytest

from helpers import TORCHRUN, run_zerorun

pytestmark = pytest.mark.e2e

COMMON = ["launcher.nproc_per_node=2", "data.seq_len=64", "trainer.micro_batch_size=4", "trainer.lr=5e-3",
          "trainer.lr_schedule=constant", "trainer.warmup_steps=0", "trainer.eval_every=0", "trainer.save_every=0",
          "data.synthetic_docs=400", TORCHRUN]


def config_only(path, model_type, **fields):
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, **fields).save_pretrained(path)
    assert sorted(p.name for p in path.iterdir()) == ["config.json"]
    return path


def losses(run_dir):
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def within_bound(run_dir):
    est = json.loads((run_dir / "estimate.json").read_text())
    peaks = [r["peak_rss_bytes"] for r in json.loads((run_dir / "summary.json").read_text())["peak_memory"]]
    assert est["config"]["attention_kernel"] == "traced" and est["config"]["family"] in ("traced_decoder", "traced_encoder")
    assert max(peaks) <= est["per_rank_bound_bytes"], (peaks, est["per_rank_bound_bytes"])


def test_a_gemma3_with_lora_and_a_modernbert_classifier_from_config_json_alone(tmp_path, cache_dir):
    train_gemma3_lora(tmp_path, cache_dir)
    train_modernbert(tmp_path, cache_dir)


@pytest.mark.slow  # (the run above, then one more that loads its export)
def test_a_modernbert_export_loads_back_as_a_pretrained_model(tmp_path, cache_dir):
    export = train_modernbert(tmp_path, cache_dir)
    again = run_zerorun(["+model=hf", f"model.name_or_path={export}", "model.pretrained=true", "trainer.max_steps=1",
                         *COMMON], tmp_path / "bert-again", cache_dir)
    assert again.returncode == 0, again.stdout[-3000:]
    first = losses(tmp_path / "bert-again")[0]
    assert abs(first - losses(tmp_path / "bert-run")[-1]) < 0.5, (first, losses(tmp_path / "bert-run"))


def train_gemma3_lora(tmp_path, cache_dir):
    gemma = config_only(tmp_path / "gemma", "gemma3_text", hidden_size=64, intermediate_size=128,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        vocab_size=1024, max_position_embeddings=256, sliding_window=16)
    run = run_zerorun(["+model=hf", f"model.name_or_path={gemma}", "adapter=lora", "zero=stage2",
                       "trainer.max_steps=12", *COMMON], tmp_path / "gemma-run", cache_dir)
    assert run.returncode == 0, run.stdout[-3000:]
    seen = losses(tmp_path / "gemma-run")
    assert sum(seen[-3:]) < sum(seen[:3]), seen
    within_bound(tmp_path / "gemma-run")


def train_modernbert(tmp_path, cache_dir):
    """A ModernBERT classifier from its config.json alone, full fine-tune: its export dir."""
    bert = config_only(tmp_path / "modernbert", "modernbert", hidden_size=64, intermediate_size=128,
                       num_hidden_layers=3, num_attention_heads=4, vocab_size=1024, max_position_embeddings=256,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
                       global_attn_every_n_layers=2, local_attention=16)
    run = run_zerorun(["+model=hf", f"model.name_or_path={bert}", "trainer.max_steps=6", *COMMON],
                      tmp_path / "bert-run", cache_dir)
    assert run.returncode == 0, run.stdout[-3000:]
    within_bound(tmp_path / "bert-run")
    return tmp_path / "bert-run" / "export"
