"""parallel=pipeline on 2 CPU ranks (2 stages) against parallel=dp with the same global batch: GPT-2, BERT and a
Llama-class decoder (tiny Llama: RMSNorm, SwiGLU, grouped-query attention, RoPE, an untied head)."""
import json
import sys

import pytest
import torch

from helpers import ROOT, TORCHRUN, assert_export_matches_engine, assert_run_dir_complete, read_metrics, run_zerorun

pytestmark = pytest.mark.e2e

# Dropout off: the two layouts draw different random masks, everything else is the same math.
COMMON = ["launcher.nproc_per_node=2", "trainer.max_steps=20", "trainer.micro_batch_size=2",
          "trainer.global_batch_size=8", "trainer.warmup_steps=1", "trainer.progress=false", "model.dropout=0",
          "data.seq_len=32", TORCHRUN]
MODELS = {
    "gpt2": ["trainer.lr=2e-3"],
    "bert": ["+model=tiny-bert", "trainer.lr=2e-4"],
    "llama": ["+model=tiny-llama", "trainer.lr=2e-3"],
}
# Same data per step and the same initial weights; what differs is the order of floating-point sums
# (dp all-reduces gradients of 2 ranks × 2 micro-batches, the pipeline accumulates 4 micro-batches), so the
# trajectories agree to float rounding: measured over 20 steps, max |Δloss| 4.8e-7 (GPT-2, tiny Llama) and 1.0e-7
# (tiny BERT), exported logits within 4e-7 of their scale. (Until every stage counted in the fp32 gradient norm,
# zerorun.pipeline.module.count_every_stage_in_the_gradient_norm, clipping used stage 0's norm alone and the
# runs drifted apart by 1.4e-2 (GPT-2), 2.7e-2 (BERT) and 1.7e-2 (Llama) in loss, the logits by up to 11%.)
LOSS_TOL = 1e-5    # every step: |Δloss|
LOGITS_TOL = 1e-5  # the exported logits: |Δ| / their largest magnitude


@pytest.mark.parametrize("model", ["gpt2", *(pytest.param(m, marks=pytest.mark.slow) for m in ("bert", "llama"))])
def test_pipeline_matches_data_parallel(tmp_path, cache_dir, model):
    runs = {}
    for layout in ("dp", "pipeline"):
        run_dir = tmp_path / layout
        proc = run_zerorun([*COMMON, *MODELS[model], f"parallel={layout}"], run_dir, cache_dir)
        assert proc.returncode == 0, proc.stdout[-4000:]
        assert_run_dir_complete(run_dir, 20)
        runs[layout] = run_dir
    ds = json.loads((runs["pipeline"] / "ds_config.json").read_text())
    assert ds["pipeline"]["stages"] == 2 and ds["gradient_accumulation_steps"] == 4 and ds["train_batch_size"] == 8
    dp, pp = read_metrics(runs["dp"]), read_metrics(runs["pipeline"])
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(dp, pp)]
    print(f"\n{model}: pipeline vs dp over 20 steps, max |Δloss| = {max(diffs):.2e}, "
          f"losses {dp[0]['loss']:.4f}→{dp[-1]['loss']:.4f} (dp) {pp[0]['loss']:.4f}→{pp[-1]['loss']:.4f} (pipeline)")
    assert max(diffs) < LOSS_TOL, diffs
    if model != "bert":  # tiny BERT from scratch on 2 labels barely moves in 20 steps; parity is the point
        assert pp[-1]["loss"] < pp[0]["loss"] - 1.0
    # The pipeline's export is a normal HF checkpoint: it reloads and reproduces the engine's logits,
    # and gives the same logits as the dp run's export.
    assert_export_matches_engine(runs["pipeline"])
    probe_dp = torch.load(runs["dp"] / "export" / "probe.pt")
    probe_pp = torch.load(runs["pipeline"] / "export" / "probe.pt")
    assert torch.equal(probe_dp["inputs"]["input_ids"], probe_pp["inputs"]["input_ids"])
    scale = probe_dp["logits"].abs().max()
    print(f"{model}: exported logits differ by at most {float((probe_dp['logits'] - probe_pp['logits']).abs().max() / scale):.2e}"
          " of their scale")
    assert torch.allclose(probe_dp["logits"], probe_pp["logits"], atol=float(LOGITS_TOL * scale), rtol=0)
    # Predictions: the same class, and the same next token wherever two candidates are not tied to float rounding.
    agree = (probe_dp["logits"].argmax(-1) == probe_pp["logits"].argmax(-1)).float().mean().item()
    print(f"{model}: exported predictions agree on {agree:.1%} of positions")
    assert agree == 1.0 if model == "bert" else agree >= 0.99, agree


@pytest.mark.slow  # one run per model; test_pipeline_decoder_runs.py holds each stage to its bound in `make test`
@pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-bert", "tiny-qwen2"])
def test_per_stage_estimate_matches_the_measured_stage(tmp_path, cache_dir, model):
    """Each stage's estimated peak against its rank's measured peak of live tensor bytes
    (ZERORUN_TRACK_MEMORY=1), 4 micro-batches per step so the first stage holds 2 in flight (BERT at 256
    tokens, where its second stage's training peak, not the whole-model build, is the larger). The issue's
    targets: within 10%, never more than 5% under; model states to the byte but Adam's step counters."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from memory_harness import pipeline_stage_rows

    data = []
    if model == "tiny-bert":  # rows longer than seq_len: padded batches reach it, as the estimate assumes
        rows = tmp_path / "long.jsonl"
        rows.write_text("".join(json.dumps({"text": " ".join(["pipeline stage memory"] * 100), "label": i % 2}) + "\n"
                                for i in range(64)))
        data = [f"data.path={rows}", "data.name=long"]
    run_dir = tmp_path / "run"
    proc = run_zerorun(["parallel=pipeline", "parallel.stages=2", "launcher.nproc_per_node=2", f"+model={model}",
                        "precision=bf16", "trainer.max_steps=2", "trainer.micro_batch_size=4",
                        "trainer.global_batch_size=16", f"data.seq_len={256 if model == 'tiny-bert' else 128}",
                        "trainer.progress=false",
                        "trainer.save_every=0", "trainer.eval_every=0", "trainer.export=false", *data],
                       run_dir, cache_dir, env_extra={"ZERORUN_TRACK_MEMORY": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = sorted(pipeline_stage_rows(run_dir), key=lambda r: r["stage"])
    assert [r["in_flight"] for r in rows] == [2, 1]
    for r in rows:
        err = (r["est"] - r["measured"]) / r["measured"]
        print(f"\n{model} stage {r['stage']} {r['layers']}: estimate {r['est'] / 2**20:.2f} MiB ({r['phase']}), "
              f"measured {r['measured'] / 2**20:.2f} MiB, error {err:+.1%}; model states {r['states_est']} "
              f"estimated, {r['states_measured']} measured")
        assert -0.05 <= err <= 0.10, r
        assert 0 <= r["states_measured"] - r["states_est"] <= 64, r  # Adam's per-tensor step counters


def test_pipeline_refuses_zero2(tmp_path, cache_dir):
    proc = run_zerorun(["parallel=pipeline", "zero=stage2", "launcher.nproc_per_node=2"], tmp_path / "run", cache_dir,
                       timeout=120)
    assert proc.returncode == 2
    assert "DeepSpeed refuses ZeRO-2 and ZeRO-3 with pipeline parallelism" in proc.stdout
