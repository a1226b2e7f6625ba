"""The memory gate in front of every launch: refuse, autofit (global batch kept), and sweeps."""
import json
from pathlib import Path

import pytest

from helpers import BIN, TORCHRUN, base_env, read_metrics, run_zerorun

pytestmark = pytest.mark.e2e

# A declared GPU cluster this CPU machine is not: the gate plans for it, the ranks still run here.
TWO_16GIB_GPUS = ["hardware.gpus_per_node=2", "hardware.gpu_mem_gib=16"]
# Small enough that tiny-gpt2 at micro-batch 8 × 256 tokens does not fit, but micro-batch 4 does. The gate
# decides on the bound: 2.7 GiB of the point is what a GPU rank holds outside its tensors (1.68 GiB measured on
# an H100, NCCL's 1 GiB prior), whose widths (0.5 and 1 GiB) take the bound to ~4 GiB: micro 8 at most 4.06 GiB,
# micro 4 3.98.
TWO_SMALL_GPUS = ["hardware.gpus_per_node=2", "hardware.gpu_mem_gib=4.03", "data.seq_len=256"]


def test_strict_gate_refuses_gpt2_large_on_16gib(tmp_path, cache_dir):
    proc = run_zerorun(["+model=gpt2-large", "zero=stage0", "precision=fp32", "data.seq_len=1024",
                        *TWO_16GIB_GPUS], tmp_path / "run", cache_dir, timeout=180)
    assert proc.returncode == 2, proc.stdout[-3000:]
    out = proc.stdout
    assert "needs" in out and "per GPU" in out and "has 16.00 GiB" in out
    assert "Biggest: activations" in out and "optimizer states" in out  # the top consumers, by name
    assert "A config that fits" in out and "trainer.micro_batch_size=" in out and "gate=autofit" in out
    assert not (tmp_path / "run" / "ds_config.json").exists()


def test_autofit_launches_a_config_that_fits_and_keeps_the_global_batch(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    proc = run_zerorun(["gate=autofit", *TWO_SMALL_GPUS, "launcher.nproc_per_node=2", TORCHRUN, "trainer.max_steps=3",
                        "trainer.progress=false", "trainer.export=false"], run_dir, cache_dir)
    assert proc.returncode == 0, proc.stdout[-3000:]
    # What the library's autofit decides for the same overrides (the fastest predicted config that fits) is
    # what the launch printed and ran.
    from zerorun.config import compose, make_plan, plan_world
    from zerorun.hardware import resolve_hardware
    from zerorun.memory import autofit

    cfg = compose(["gate=autofit", *TWO_SMALL_GPUS, "launcher.nproc_per_node=2"])
    hw = resolve_hardware(cfg.hardware, None)
    fit = autofit(cfg, make_plan(cfg, plan_world(cfg, hw)), hw)
    overrides = " ".join(c.override() for c in fit.changes)
    assert f"autofit: {overrides} →" in proc.stdout and fit.changes
    micro = fit.cfg.trainer.micro_batch_size
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == \
        (micro, 16 // (2 * micro), 16)  # the global batch stays (micro 8 × 2 ranks), whatever autofit changed
    est = json.loads((run_dir / "estimate.json").read_text())
    assert est["gate"]["mode"] == "autofit" and est["fits"] is True
    assert {c["key"] for c in est["gate"]["changes"]} == {c.key for c in fit.changes}
    assert est["per_rank_bound_bytes"] <= est["device_capacity_bytes"] < est["gate"]["original_bound_bytes"]
    # The step-time prediction for the launched plan (here 2 CPU ranks) is recorded whole: its terms add up to it.
    # How close it comes to the measured speed is a benchmark's figure, not this test's (benchmarks/autofit_rank.py
    # and fit_speed_profile.py, docs/speed.md): a timed step depends on whatever else the machine runs, and `make
    # test` runs two jobs at once (seen: 4.9x slower than predicted beside another 2-rank job, 1.9x alone).
    predicted = est["predicted_step"]
    assert predicted["step_s"] > 0 and predicted["tokens_per_s"] > 0
    assert predicted["step_s"] == pytest.approx(sum(predicted["terms_s"].values()), rel=1e-3)
    measured = sorted(m["tokens_per_s"] for m in read_metrics(run_dir)[1:])
    print(f"\npredicted {predicted['tokens_per_s']:.0f} tokens/s, measured {measured}")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["estimated_peak_bytes"] == est["per_rank_peak_bytes"]
    assert len(read_metrics(run_dir)) == 3


@pytest.mark.slow
def test_sweep_skips_points_that_do_not_fit_and_ends_with_a_table_naming_the_fastest(tmp_path, cache_dir):
    import csv
    import re
    import subprocess

    sweep_dir = tmp_path / "sweep"
    proc = subprocess.run([str(BIN / "zerorun"), "-m", "trainer.micro_batch_size=8,4,2,1", *TWO_SMALL_GPUS,
                           "launcher.nproc_per_node=2", "trainer.max_steps=3", "trainer.progress=false",
                           "trainer.export=false", f"hydra.sweep.dir={sweep_dir}"],
                          env=base_env(cache_dir), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert re.search(r"sweep point 0 \([^)]*trainer.micro_batch_size=8[^)]*\): skipped, does not fit", proc.stdout)
    assert re.search(r"sweep point 3 \([^)]*trainer.micro_batch_size=1[^)]*\): completed", proc.stdout)
    assert "sweep: 4 points: completed 3, memory 1" in proc.stdout
    points = sorted(p for p in sweep_dir.iterdir() if p.is_dir())
    assert not (points[0] / "ds_config.json").exists()
    # The table: every point, the finished ones by throughput, numbers as their run dirs have them.
    rows = list(csv.DictReader((sweep_dir / "sweep_summary.csv").open()))
    assert len(rows) == 4 and [r["status"] for r in rows] == ["completed"] * 3 + ["memory"]
    assert "memory:" in rows[3]["why"] and rows[3]["point"] == "0"
    speeds = [float(r["tokens_per_s"]) for r in rows[:3]]
    assert speeds == sorted(speeds, reverse=True)
    for r in rows[:3]:
        summary = json.loads((Path(r["run_dir"]) / "summary.json").read_text())
        assert float(r["tokens_per_s"]) == summary["tokens_per_s"] and float(r["final_loss"]) == summary["final_loss"]
        assert float(r["measured_peak_gib"]) == round(max(p["peak_rss_bytes"] for p in summary["peak_memory"]) / 2**30, 3)
    md = (sweep_dir / "sweep_summary.md").read_text()
    best = rows[0]
    assert f"Fastest: point {best['point']}" in md and f"trainer.micro_batch_size={best['overrides'].split('micro_batch_size=')[1].split()[0]}" in md
    assert f"the fastest point is {best['point']}" in proc.stdout
    # The pictures: the sweep's and each finished point's, valid PNGs of a sensible size, drawn from the
    # numbers above (report.*_data is what the plots draw).
    from matplotlib.image import imread

    from zerorun import report

    assert (sweep_dir / "sweep.png").is_file()
    drawn = {d["point"]: d for d in report.sweep_data(sweep_dir)}
    for r in rows:
        assert drawn[int(r["point"])]["tokens_per_s"] == float(r["tokens_per_s"] or 0)
    for r in rows[:3]:
        run = Path(r["run_dir"])
        for png in ("training.png", "memory.png"):
            h, w = imread(run / png).shape[:2]
            assert 300 <= h <= 2000 and 400 <= w <= 3000, (png, h, w)
        summary = json.loads((run / "summary.json").read_text())
        estimate = json.loads((run / "estimate.json").read_text())
        mem = report.memory_data(estimate, summary)
        assert mem["measured"] == [p["peak_rss_bytes"] for p in summary["peak_memory"]]
        assert sum(mem["bars"][estimate["peak_phase"]].values()) == estimate["per_rank_peak_bytes"]
        assert report.training_data(read_metrics(run))["loss"] == [m["loss"] for m in read_metrics(run)]
    h, w = imread(sweep_dir / "sweep.png").shape[:2]
    assert 300 <= h <= 2000 and 400 <= w <= 3000
