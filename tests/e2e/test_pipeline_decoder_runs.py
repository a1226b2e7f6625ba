"""A Llama-class decoder (tiny Qwen2: q/k/v biases, grouped-query attention, the LM head tied to the embedding)
cut into 2 pipeline stages on 2 CPU ranks: the loss falls, a run resumed from the mid-run checkpoint continues
bit-identically, the export is a checkpoint ``AutoModelForCausalLM.from_pretrained`` loads with the weights the
stages trained (the tied head one tensor again), and every rank stays within the gate's bound.
tests/e2e/test_pipeline_parity.py holds the tiny Llama's pipeline against parallel=dp."""
import json
import shutil

import pytest
import torch

from helpers import (TORCHRUN, assert_export_matches_engine, assert_loss_falls, assert_run_dir_complete, read_metrics,
                     run_zerorun)

pytestmark = pytest.mark.e2e

RUN = ["+model=tiny-qwen2", "parallel=pipeline", "parallel.stages=2", "launcher.nproc_per_node=2",
       "trainer.micro_batch_size=2", "trainer.global_batch_size=8", "data.seq_len=64", "trainer.max_steps=12",
       "trainer.save_every=6", "trainer.lr=3e-3", "trainer.warmup_steps=1", "trainer.progress=false", TORCHRUN]


def test_a_tied_qwen2_pipeline_trains_resumes_bit_identically_and_exports(tmp_path, cache_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    full = tmp_path / "full"
    proc = run_zerorun(RUN, full, cache_dir)
    assert proc.returncode == 0, proc.stdout[-4000:]
    metrics, summary = assert_run_dir_complete(full, 12)
    assert_loss_falls(metrics, by=1.0)
    ds = json.loads((full / "ds_config.json").read_text())
    assert ds["pipeline"]["stages"] == 2 and ds["gradient_accumulation_steps"] == 4
    est = json.loads((full / "estimate.json").read_text())
    assert [s["layers"] for s in est["pipeline_stages"]] == [["embed_tokens", "block"],
                                                             ["block", "norm", "lm_head (tied embed_tokens)"]]
    # Every rank's peak RSS within the gate's bound for its stage, and not far under its point estimate.
    rows = summary["memory_vs_estimate"]
    print(f"\nlosses {metrics[0]['loss']:.4f} → {metrics[-1]['loss']:.4f}; peak RSS vs the stage's estimate: "
          + ", ".join(f"rank {r['rank']} {r['measured_bytes'] / 2**20:.1f} MiB {100 * r['error']:+.1f}%" for r in rows))
    assert len(rows) == 2 and all(r["within_bound"] for r in rows), rows
    assert all(r["error"] >= -0.05 for r in rows), rows

    # The export: a normal checkpoint with the trained weights, the head tied to the embedding again.
    assert_export_matches_engine(full)
    model = AutoModelForCausalLM.from_pretrained(full / "export")
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    saved = load_file(full / "export" / "model.safetensors")
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v.to(loaded[k].dtype)) for k, v in saved.items()), "reloaded weights differ"
    assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0  # Qwen2's biases trained and came back

    # Resume from the step-6 checkpoint alone: steps 7-12 repeat the uninterrupted run's losses exactly.
    mid = tmp_path / "mid" / "checkpoints"
    mid.mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "global_step6", mid / "global_step6")
    (mid / "zerorun_latest").write_text("global_step6\n")
    resumed = run_zerorun([*RUN, f"trainer.resume_from={mid.parent}"], tmp_path / "resumed", cache_dir)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stdout[-4000:]
    want = {m["step"]: m["loss"] for m in metrics}
    got = {m["step"]: m["loss"] for m in read_metrics(tmp_path / "resumed")}
    assert sorted(got) == list(range(7, 13)), sorted(got)
    assert all(got[s] == want[s] for s in got), (got, want)
    again = load_file(tmp_path / "resumed" / "export" / "model.safetensors")
    assert all(torch.equal(again[k], saved[k]) for k in saved)  # the same final weights, bit for bit
