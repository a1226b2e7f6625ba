"""The optimizer group: what each choice renders, refuses, costs in the estimate, and when autofit may pick
8-bit states. The 8-bit state formula is checked against bitsandbytes' own tensors."""
import dataclasses
import importlib.util

import pytest

from helpers import A100_8, CPU2, GPU8, composed, planned
from zerorun.config import OptimizerImpl, World, check, make_plan
from zerorun.ds_config import render
from zerorun.memory import estimate, gate
from zerorun.memory.states import optimizer_state_bytes

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None


@pytest.mark.heavy
def test_each_optimizer_renders_what_deepspeed_needs():
    cfg, plan = planned("optimizer=adamw8bit", "zero=stage2", "offload=cpu")
    ds = render(cfg, plan)
    assert plan.optimizer == OptimizerImpl.bnb_adamw8bit and plan.optimizer.client
    assert "optimizer" not in ds and ds["zero_allow_untested_optimizer"] is True
    assert ds["zero_force_ds_cpu_optimizer"] is False  # it steps on the host's partitions itself
    cfg, plan = planned("optimizer=sgd", "zero=stage1")
    ds = render(cfg, plan)
    assert plan.optimizer == OptimizerImpl.torch_sgd and "zero_force_ds_cpu_optimizer" not in ds
    cfg, plan = planned("zero=stage2", "offload=cpu")
    assert render(cfg, plan)["optimizer"]["type"] == "AdamW" and plan.optimizer == OptimizerImpl.cpu_adam


@pytest.mark.parametrize("overrides, words", [
    (["optimizer=adamw8bit", "zero=stage3", "offload=nvme"], "optimizer=adamw8bit with offload=nvme"),
    (["optimizer=sgd", "parallel=pipeline", "+model=gpt2", "parallel.stages=2"], "optimizer=sgd with parallel=pipeline"),
    (["optimizer=adamw8bit", "+deepspeed.optimizer.type=Adam"], "deepspeed.optimizer with optimizer=adamw8bit"),
])
def test_what_deepspeed_cannot_run_is_refused_with_the_fix(overrides, words):
    cfg = composed(*overrides)
    problems = [str(p) for p in check(cfg, World(nproc_per_node=2, nnodes=1, accelerator="cpu", fp16_ok=False),
                                      libaio=True, writable=lambda p: None)]
    assert any(words in p and "Fix:" in p for p in problems), problems


def test_eight_bit_states_save_six_bytes_per_parameter_in_the_estimate():
    cfg, plan = planned("+model=gpt2-xl", "precision=bf16", "trainer.micro_batch_size=1", world=GPU8)
    base = estimate(cfg, plan, A100_8)
    c8 = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, name="adamw8bit"))
    e8 = estimate(c8, make_plan(c8, GPU8), A100_8)
    saved = base.components["optimizer states"] - e8.components["optimizer states"]
    assert saved == pytest.approx(6 * base.params, rel=0.01)  # 8 → ~2 bytes per parameter
    assert e8.per_rank_peak_bytes < base.per_rank_peak_bytes - 8 * 2**30


@pytest.mark.heavy
def test_autofit_switches_to_eight_bit_only_when_allowed():
    # One 16 GiB GPU: ZeRO cannot partition anything, so only CPU offload or 8-bit states fit GPT-2 large.
    one = World(nproc_per_node=1, nnodes=1, accelerator="cuda")
    cfg = composed("+model=gpt2-large", "precision=bf16", "trainer.micro_batch_size=1", "data.seq_len=256",
                   "gate=autofit")
    plan = make_plan(cfg, one)
    hw = dataclasses.replace(A100_8, gpus_per_node=1, gpu_mem_bytes=16 * 2**30)
    d = gate(cfg, plan, hw)
    assert d.ok and all(c.key != "optimizer.name" for c in d.changes) and "offload=cpu" in d.overrides, d.message
    allowed = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, autofit_8bit=True))
    d8 = gate(allowed, plan, hw)
    assert d8.ok and "optimizer=adamw8bit" in d8.overrides, d8.message
    assert not any(o.startswith("offload=") for o in d8.overrides)  # 8-bit states before offload
    strict = gate(dataclasses.replace(cfg, gate="strict"), plan, hw)
    assert not strict.ok and "Or with 8-bit optimizer states" in strict.message, strict.message


@pytest.mark.heavy
@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes not installed (pip install 'zerorun[8bit]')")
@pytest.mark.parametrize("numel", [476_928, 1_000_003, 4_095])
def test_eight_bit_state_formula_is_what_bitsandbytes_allocates(numel):
    import logging

    import torch

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    import bitsandbytes as bnb

    p = torch.nn.Parameter(torch.zeros(numel))
    opt = bnb.optim.AdamW8bit([p], min_8bit_size=4096)
    p.grad = torch.ones(numel)
    opt.step()
    seen = {}
    for t in opt.state[p].values():
        if torch.is_tensor(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    cfg, plan = planned("optimizer=adamw8bit", "zero=stage2", world=CPU2)
    assert optimizer_state_bytes(cfg, plan, numel) == sum(seen.values())


def test_runtime_oom_repair_never_switches_the_optimizer():
    from helpers import repair_ladder

    steps = repair_ladder("+model=tiny-gpt2", "trainer.micro_batch_size=1", "optimizer.autofit_8bit=true")
    assert steps  # the ladder has rungs to climb
    assert all(c.key != "optimizer.name" for _, changes in steps for c in changes)


@pytest.mark.heavy
def test_resuming_another_optimizers_states_is_refused(tmp_path):
    import json

    from zerorun import resume
    from zerorun.config import UserError
    from zerorun.rundir import RunDir

    tag = tmp_path / "checkpoints" / "global_step4"
    tag.mkdir(parents=True)
    (tag / "COMPLETE").write_text(json.dumps({"step": 4, "world": {"data_parallel": 2, "optimizer": "torch_adamw"},
                                              "zero_stage": 2}))
    cfg = composed("optimizer=adamw8bit", "zero=stage2")
    with pytest.raises(UserError, match="holds adamw optimizer states and this run uses bnb_adamw8bit") as e:
        resume.for_this_world(cfg, CPU2, tmp_path / "checkpoints", "global_step4", {}, RunDir(tmp_path))
    assert "optimizer=adamw" in str(e.value)
    same = composed("zero=stage2", "offload=cpu")  # DeepSpeed's CPU Adam: the same AdamW states
    assert resume.for_this_world(same, CPU2, tmp_path / "checkpoints", "global_step4", {"x": 1}, RunDir(tmp_path)) == \
        {"x": 1}


@pytest.mark.parametrize("value", [33, -1])
def test_mmap_threshold_out_of_range_is_refused(value):
    problems = [str(p) for p in check(composed(f"launcher.mmap_threshold_mib={value}"), CPU2, libaio=True,
                                      writable=lambda p: None)]
    assert any(f"launcher.mmap_threshold_mib={value}" in p for p in problems), problems
