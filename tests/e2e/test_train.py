"""Real 2-rank DeepSpeed fine-tunes on CPU (gloo): every ZeRO stage, offload, precision and launcher.

Each run asserts that the loss falls, the run dir is complete, the rendered JSON is what was
asked for, and the exported Hugging Face model reproduces the engine's logits.
"""
import json
from pathlib import Path

import pytest
import torch

from conftest import read_metrics, run_zerorun

pytestmark = pytest.mark.e2e

# Small and quick: tiny-gpt2, short sequences, a high LR so 8 steps show a clear fall.
QUICK = ["launcher.nproc_per_node=2", "trainer.max_steps=8", "trainer.micro_batch_size=4", "data.seq_len=64",
         "trainer.warmup_steps=1", "trainer.lr=2e-3", "trainer.save_every=4", "trainer.progress=false"]


def _fp16_supported() -> bool:
    return bool(torch.cuda.is_available() or torch.ops.mkldnn._is_mkldnn_fp16_supported())


MATRIX = [
    pytest.param(["zero=stage0", "launcher=deepspeed"], id="zero0-fp32-deepspeed"),
    pytest.param(["zero=stage1", "launcher=torchrun"], id="zero1-fp32-torchrun"),
    pytest.param(["zero=stage2", "precision=bf16"], id="zero2-bf16-deepspeed"),
    pytest.param(["zero=stage3", "launcher=torchrun"], id="zero3-fp32-torchrun"),
    pytest.param(["zero=stage2", "offload=cpu"], id="zero2-offload-cpu"),
    pytest.param(["zero=stage3", "offload=cpu", "precision=bf16"], id="zero3-offload-cpu-params-bf16"),
    pytest.param(["zero=stage3", "offload=nvme"], id="zero3-offload-nvme"),
    pytest.param(["zero=stage2", "precision=fp16"], id="zero2-fp16-dynamic", marks=pytest.mark.skipif(
        not _fp16_supported(), reason="this CPU has no fp16 support (DeepSpeed's CPU accelerator needs "
                                      "AVX512-FP16/AMX); zerorun refuses precision=fp16 here with exit 2")),
]


def assert_run_dir_complete(run_dir, steps):
    for name in ("config.yaml", "ds_config.json", "command.sh", "prepared.json", "metrics.jsonl", "summary.json"):
        assert (run_dir / name).is_file(), f"{name} missing from {run_dir}"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    for m in metrics:
        assert {"step", "loss", "lr", "tokens_per_s"} <= m.keys()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == steps
    assert len(summary["peak_memory"]) == 2 and all(p["peak_rss_bytes"] > 0 for p in summary["peak_memory"])
    # DeepSpeed's CPU all-reduce segments (~66 MB per rank, never unlinked by DeepSpeed) are gone.
    words = (run_dir / "command.sh").read_text().split()
    port = words[words.index("--master_port" if "--master_port" in words else "--master-port") + 1]
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*")), port
    ckpt = run_dir / "checkpoints"
    assert (ckpt / f"global_step{steps}" / "COMPLETE").is_file()
    assert (ckpt / "zerorun_latest").read_text().strip() == f"global_step{steps}"
    return metrics, summary


def assert_loss_falls(metrics):
    first, last = metrics[0]["loss"], min(m["loss"] for m in metrics[-2:])
    assert last < first - 0.3, f"loss did not fall: {[round(m['loss'], 3) for m in metrics]}"


def assert_export_matches_engine(run_dir):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    probe = torch.load(run_dir / "export" / "probe.pt")
    dtype = getattr(torch, probe["dtype"])
    cls = AutoModelForCausalLM if probe["task"] == "causal_lm" else AutoModelForSequenceClassification
    model = cls.from_pretrained(run_dir / "export", dtype=dtype).eval()
    with torch.no_grad():
        logits = model(**probe["inputs"]).logits.float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(logits, probe["logits"], atol=tol, rtol=0), (logits - probe["logits"]).abs().max()


@pytest.mark.parametrize("overrides", MATRIX)
def test_two_rank_fine_tune(tmp_path, cache_dir, overrides):
    run_dir = tmp_path / "run"
    proc = run_zerorun([*QUICK, *overrides], run_dir, cache_dir)
    assert proc.returncode == 0, proc.stdout[-4000:]
    metrics, summary = assert_run_dir_complete(run_dir, 8)
    assert_loss_falls(metrics)
    ds = json.loads((run_dir / "ds_config.json").read_text())
    for ov in overrides:
        key, value = ov.split("=")
        if key == "zero":
            assert ds["zero_optimization"]["stage"] == int(value[-1])
        if key == "offload":
            assert ds["zero_optimization"]["offload_optimizer"]["device"] == value
            if ds["zero_optimization"]["stage"] == 3:
                assert ds["zero_optimization"]["offload_param"]["device"] == value
        if key == "precision" and value != "fp32":
            assert ds[value]["enabled"] is True
        if key == "launcher":
            assert (run_dir / "command.sh").read_text().split()[-1] == str(run_dir)
            assert f"/{value} " in (run_dir / "command.sh").read_text()
    assert_export_matches_engine(run_dir)
    assert_model_states_match_estimate(summary)


def assert_model_states_match_estimate(summary):
    """The estimator's model-state components against the tensors DeepSpeed really holds on rank 0."""
    est, measured = summary["estimated_components"], summary["peak_memory"][0]["model_state_bytes"]
    pairs = [("parameters", "parameters"), ("fp32 master copies", "fp32_master"),
             ("optimizer states", "optimizer_states")]
    checked = 0
    for est_key, meas_key in pairs:
        want = est.get(est_key) or est.get(f"{est_key} (host)")  # offloaded state is counted on the host
        if want and measured[meas_key]:
            assert abs(measured[meas_key] - want) <= 0.01 * want + 64, (est_key, est, measured)
            checked += 1
    # NVMe offload swaps optimizer state out of memory, so there may be nothing resident to compare.
    assert checked >= 1 or any("NVMe" in k for k in est), (est, measured)
