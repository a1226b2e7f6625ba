"""The run-dir contract: what the launcher writes is what a rank reads back."""
import dataclasses

import pytest
from omegaconf import OmegaConf

from helpers import CPU2, composed
from zerorun.config import make_plan
from zerorun.data import Prepared
from zerorun.ds_config import render
from zerorun.rundir import RunDir


@pytest.mark.heavy
def test_inputs_round_trip_and_config_agrees_with_the_json(tmp_path):
    cfg = composed("zero=stage3", "offload=nvme", "trainer.micro_batch_size=2", "trainer.global_batch_size=8")
    rd = RunDir(tmp_path / "run")
    cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, nvme_path=rd.default_nvme_path))
    plan = make_plan(cfg, CPU2)
    prepared = Prepared(task="causal_lm", train="t.npy", val="v.npy", tokenizer_dir="tok", vocab_size=10,
                        num_train=100, num_val=5, seq_len=64, cache_key="k")
    rd.write_inputs(config_yaml=OmegaConf.to_yaml(OmegaConf.structured(cfg)), plan=plan.to_json(),
                    ds_config=render(cfg, plan), estimate={"per_rank_peak_bytes": 1}, prepared=prepared.to_json(),
                    resume={"checkpoint_dir": "/c", "tag": "global_step2"})
    back, back_plan, ds = rd.read_config(), rd.read_plan(), rd.read_ds_config()
    assert back == cfg and back_plan == plan and rd.read_prepared() == prepared
    # One place for the NVMe path and the batch geometry: the files cannot disagree.
    assert back.offload.nvme_path == ds["zero_optimization"]["offload_optimizer"]["nvme_path"] == rd.default_nvme_path
    assert (back_plan.micro_batch_size, back_plan.grad_accum_steps) == (
        ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (2, 2)
    assert rd.read_resume() == {"checkpoint_dir": "/c", "tag": "global_step2"}
    rd.write_inputs(config_yaml="{}", plan={}, ds_config={}, estimate={}, prepared={}, resume=None)
    assert rd.read_resume() is None  # a fresh launch into the same dir does not resume by accident


def test_metrics_restart_keeps_only_the_steps_before_the_resume_point(tmp_path):
    rd = RunDir(tmp_path)
    rd.append_metrics([{"step": s, "loss": 1.0 / s} for s in range(1, 7)])
    rd.start_metrics(keep_through_step=4)
    rd.append_metrics([{"step": 5, "loss": 0.0}])
    assert [m["step"] for m in rd.read_metrics()] == [1, 2, 3, 4, 5]
    rd.start_metrics(keep_through_step=0)
    assert rd.read_metrics() == []
    assert rd.read_summary() is None
    rd.write_summary({"status": "completed"})
    assert rd.read_summary() == {"status": "completed"}
    rd.clear_outcome()
    assert rd.read_summary() is None
