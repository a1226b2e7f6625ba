"""The usage line from the README, verbatim: `zerorun +model=gpt2 zero=stage2 offload=cpu`."""
import json

import pytest

from helpers import assert_export_matches_engine, assert_run_dir_complete, run_zerorun

pytestmark = pytest.mark.e2e

VERBATIM = ["+model=gpt2", "zero=stage2", "offload=cpu"]


def test_dry_run_renders_zero2_cpu_offload(tmp_path, cache_dir):
    run_dir = tmp_path / "dry"
    proc = run_zerorun([*VERBATIM, "dry_run=true"], run_dir, cache_dir, timeout=300)
    assert proc.returncode == 0, proc.stdout
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "dry run: nothing launched" in proc.stdout
    assert not (run_dir / "metrics.jsonl").exists()
    command = (run_dir / "command.sh").read_text()
    assert "--no_local_rank" in command and "zerorun.train" in command


def test_gpt2_trains_on_two_cpu_ranks(tmp_path, cache_dir):
    # Random init (no hub here), a few steps of short sequences: GPT-2 small's 124M parameters on 2 CPU ranks.
    run_dir = tmp_path / "gpt2"
    proc = run_zerorun([*VERBATIM, "trainer.max_steps=4", "data.seq_len=32", "trainer.micro_batch_size=2",
                        "trainer.warmup_steps=0", "trainer.lr=1e-3", "trainer.progress=false",
                        "data.val_fraction=0.01"],  # the end-of-run evaluation: 78 sequences of 124M-model forwards
                       run_dir, cache_dir, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    metrics, summary = assert_run_dir_complete(run_dir, 4)
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.5, [m["loss"] for m in metrics]
    assert summary["world_size"] == 2
    assert_export_matches_engine(run_dir)
