"""Tensor parallelism through the real console script: a tiny Llama from its model file, parallel=tp
parallel.tp_size=2 (DeepSpeed AutoTP) on 2 CPU ranks, full fine-tune under ZeRO-1. The loss falls, each checkpoint
holds one model-states file per tensor-parallel rank, a run resumed from the mid-run checkpoint continues
bit-identically, the export gathers the shards into a checkpoint from_pretrained loads at full shapes (and its
logits are the engine's), and the per-rank memory estimate holds against the measured peak RSS. What AutoTP cannot
run is refused with exit 2 and one line, before anything starts."""
import json

import pytest

from helpers import (TORCHRUN, assert_export_matches_engine, assert_loss_falls, assert_run_dir_complete, read_metrics,
                     run_zerorun)

pytestmark = pytest.mark.e2e

BASE = ["+model=tiny-llama", "parallel=tp", "parallel.tp_size=2", "zero=stage1", "launcher.nproc_per_node=2",
        "data.seq_len=64", "trainer.micro_batch_size=4", "trainer.lr=2e-3", "trainer.save_every=6",
        "trainer.lr_schedule=constant", "trainer.warmup_steps=0",  # so 6 steps of 12 are the first 6 of 12
        "trainer.progress=false", TORCHRUN]


def losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


def test_tp_trains_resumes_bit_identically_and_exports_whole(tmp_path, cache_dir):
    import torch
    from transformers import AutoModelForCausalLM

    full = run_zerorun([*BASE, "trainer.max_steps=12"], tmp_path / "full", cache_dir)
    assert full.returncode == 0, full.stdout[-3000:]
    assert "2 rank(s) = tensor-parallel 2 × data-parallel 1" in full.stdout, full.stdout[-3000:]
    metrics, summary = assert_run_dir_complete(tmp_path / "full", 12)
    assert_loss_falls(metrics, by=0.5)
    # Both ranks of the group read the same batches: DeepSpeed checks the first one, the fingerprint counts each once.
    assert json.loads((tmp_path / "full" / "plan.json").read_text())["tensor_parallel"] == 2
    tag = tmp_path / "full" / "checkpoints" / "global_step12"
    assert sorted(p.name for p in tag.glob("mp_rank_*_model_states.pt")) == ["mp_rank_00_model_states.pt",
                                                                             "mp_rank_01_model_states.pt"]
    # The export: whole tensors under Hugging Face names, the logits the engine computed on the probe.
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "export")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (128, 128)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (64, 128)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (128, 352)
    assert shapes["lm_head.weight"] == (4096, 128) and shapes["model.embed_tokens.weight"] == (4096, 128)
    assert_export_matches_engine(tmp_path / "full")
    assert torch.isfinite(next(model.parameters())).all()
    # The memory estimate per rank against the peak RSS each rank measured.
    est = json.loads((tmp_path / "full" / "estimate.json").read_text())
    for rank in summary["peak_memory"]:
        assert rank["peak_rss_bytes"] <= est["per_rank_bound_bytes"], (rank, est["per_rank_bound_bytes"])
        assert abs(rank["peak_rss_bytes"] / est["per_rank_peak_bytes"] - 1) < 0.1, (rank, est["per_rank_peak_bytes"])

    # Half the run, then resumed from its step-6 checkpoint: the same losses, bit for bit, as the uninterrupted run.
    half = run_zerorun([*BASE, "trainer.max_steps=6", "trainer.export=false"], tmp_path / "half", cache_dir)
    assert half.returncode == 0, half.stdout[-3000:]
    resumed = run_zerorun([*BASE, "trainer.max_steps=12", f"trainer.resume_from={tmp_path / 'half'}"],
                          tmp_path / "resumed", cache_dir)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stdout[-3000:]
    seen, again = losses(tmp_path / "full"), losses(tmp_path / "resumed")
    assert min(again) == 7 and all(again[s] == seen[s] for s in again), (again, seen)
    assert [r["data_fingerprint"] for r in read_metrics(tmp_path / "resumed")] == \
        [r["data_fingerprint"] for r in read_metrics(tmp_path / "full")][6:]

    # Another tensor-parallel degree cannot load those shards: refused before launch, one line, exit 2.
    other = run_zerorun([*BASE[:2], "parallel.tp_size=1", *BASE[3:], "trainer.max_steps=12",
                         f"trainer.resume_from={tmp_path / 'half'}"], tmp_path / "other", cache_dir, timeout=300)
    assert other.returncode == 2 and "tensor-parallel checkpoints resume only on the layout" in other.stdout, \
        other.stdout[-3000:]


@pytest.mark.parametrize("overrides,needle", [
    (["+model=tiny-gpt2", "parallel=tp", "parallel.tp_size=2"], "DeepSpeed's AutoTP cannot shard gpt2 models"),
    (["+model=tiny-llama", "parallel=tp", "parallel.tp_size=2", "model.num_kv_heads=1"],
     "parallel.tp_size=2 exceeds the 1 key/value heads of tiny-llama"),
], ids=["gpt2", "tp-beyond-kv-heads"])
def test_what_autotp_cannot_split_exits_2_with_one_line(tmp_path, cache_dir, overrides, needle):
    proc = run_zerorun([*overrides, "launcher.nproc_per_node=2"], tmp_path / "run", cache_dir, timeout=300)
    assert proc.returncode == 2, proc.stdout
    errors = [line for line in proc.stdout.splitlines() if "error:" in line]
    assert len(errors) == 1 and needle in errors[0] and "Fix: " in errors[0], proc.stdout
    assert "Traceback" not in proc.stdout and not (tmp_path / "run" / "ds_config.json").exists()
