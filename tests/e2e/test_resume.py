"""Kill a rank mid-run, resume from the last complete checkpoint, and match an uninterrupted run."""
import json

import pytest

from helpers import read_metrics, run_zerorun

pytestmark = pytest.mark.e2e

RUN = ["launcher.nproc_per_node=2", "trainer.max_steps=8", "trainer.micro_batch_size=4", "data.seq_len=64",
       "trainer.warmup_steps=1", "trainer.lr=2e-3", "trainer.save_every=2", "trainer.progress=false",
       "trainer.export=false", "zero=stage2"]


def test_killed_run_resumes_and_matches_uninterrupted(tmp_path, cache_dir):
    baseline = tmp_path / "baseline"
    assert run_zerorun(RUN, baseline, cache_dir).returncode == 0

    crashed = tmp_path / "crashed"
    # Rank 1 is SIGKILLed right after step 5; the last complete checkpoint is step 4.
    proc = run_zerorun(RUN, crashed, cache_dir, env_extra={"ZERORUN_FAULT_KILL": "1:5"})
    assert proc.returncode != 0, "a killed rank must fail the run"
    assert not (crashed / "summary.json").exists()
    assert (crashed / "checkpoints" / "zerorun_latest").read_text().strip() == "global_step4"

    proc = run_zerorun([*RUN, "trainer.resume=true"], crashed, cache_dir)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "resuming from" in proc.stdout
    summary = json.loads((crashed / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["resumed_from_step"] == 4

    want = {m["step"]: m for m in read_metrics(baseline)}
    got = read_metrics(crashed)
    assert [m["step"] for m in got] == list(range(1, 9)), "each step exactly once after resume"
    # Same topology, RNG and data position restored: the trajectory is bit-identical on CPU.
    for m in got:
        assert m["loss"] == want[m["step"]]["loss"], (m["step"], m["loss"], want[m["step"]]["loss"])
        assert m["lr"] == want[m["step"]]["lr"]


def test_resume_without_checkpoint_is_refused(tmp_path, cache_dir):
    proc = run_zerorun([*RUN, "trainer.resume=true", f"trainer.resume_from={tmp_path / 'nothing'}"],
                       tmp_path / "run", cache_dir, timeout=120)
    assert proc.returncode == 2
    assert "no complete checkpoint was found" in proc.stdout
