"""Rendering: config → DeepSpeed JSON, checked by DeepSpeed's own config classes and golden files."""
import json
from pathlib import Path

import pytest

from helpers import CPU2, GPU8, composed
from zerorun.config import make_plan
from zerorun.ds_config import render as render_plan

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def render(cfg, world):
    return render_plan(cfg, make_plan(cfg, world))


def _walk(node, path=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{path}.{k}")
    else:
        yield path, node


CASES = {
    "gpt2_zero2_cpu": ["+model=gpt2", "zero=stage2", "offload=cpu"],
    "gpt2-xl_zero3_nvme_bf16": ["+model=gpt2-xl", "zero=stage3", "offload=nvme", "precision=bf16"],
    "gpt2-medium_zero1_fp16_static": ["+model=gpt2-medium", "zero=stage1", "precision=fp16",
                                      "precision.loss_scale=128", "trainer.global_batch_size=64"],
    "tiny-gpt2_zero0": [],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    ds = render(composed(*CASES[name], "offload.nvme_path=/local_nvme"), GPU8)
    golden = GOLDEN / f"ds_{name}.json"
    assert ds == json.loads(golden.read_text()), f"rendered JSON differs from {golden}"


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("world", [CPU2, GPU8], ids=["cpu2", "gpu8"])
def test_deepspeed_accepts_and_nothing_is_auto(name, world, monkeypatch):
    import deepspeed.runtime.config as ds_runtime_config
    from deepspeed.runtime.config import DeepSpeedConfig

    # No process group in a unit test: tell DeepSpeed's config the rank and world it would see.
    monkeypatch.setattr(ds_runtime_config.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_runtime_config.dist, "get_world_size", lambda *a, **k: world.size)

    ds = render(composed(*CASES[name], "offload.nvme_path=/tmp/nvme"), world)
    assert not [p for p, v in _walk(ds) if v == "auto"]
    parsed = DeepSpeedConfig(json.loads(json.dumps(ds)))
    assert parsed.train_batch_size == ds["train_batch_size"]
    assert parsed.zero_optimization_stage == ds["zero_optimization"]["stage"]
    assert parsed.train_batch_size == (parsed.train_micro_batch_size_per_gpu * parsed.gradient_accumulation_steps
                                       * world.size)


def test_zero2_cpu_offload_section():
    ds = render(composed("+model=gpt2", "zero=stage2", "offload=cpu"), CPU2)
    z = ds["zero_optimization"]
    assert z["stage"] == 2 and z["offload_optimizer"]["device"] == "cpu" and "offload_param" not in z
    # DDP's 25 MiB of fp32 gradients per bucket, not DeepSpeed's 5e8 elements (~1 GiB of buffer) nor
    # hidden² (HF's auto: ~150 collectives per micro-batch for GPT-2 small).
    assert z["reduce_bucket_size"] == z["allgather_bucket_size"] == 25 * 2**20 // 4
    assert "torch_adam" not in ds["optimizer"]["params"]  # offload uses DeepSpeed's CPU Adam


@pytest.mark.heavy
def test_zero3_offloads_params_too_unless_disabled():
    z = render(composed("zero=stage3", "offload=cpu"), CPU2)["zero_optimization"]
    assert z["offload_param"]["device"] == "cpu"
    z = render(composed("zero=stage3", "offload=cpu", "offload.params=false"), CPU2)["zero_optimization"]
    assert "offload_param" not in z and z["offload_optimizer"]["device"] == "cpu"


def test_fp16_loss_scaling_knobs_are_rendered():
    ds = render(composed("precision=fp16", "precision.loss_scale_window=50", "precision.hysteresis=1",
                         "precision.min_loss_scale=4", "precision.initial_scale_power=12"), GPU8)
    assert ds["fp16"] == {"enabled": True, "loss_scale": 0.0, "initial_scale_power": 12, "loss_scale_window": 50,
                          "hysteresis": 1, "min_loss_scale": 4.0}
    assert ds["bf16"] == {"enabled": False}


def test_gradient_accumulation_from_global_batch():
    ds = render(composed("trainer.micro_batch_size=4", "trainer.global_batch_size=64"), GPU8)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (64, 4, 2)


def test_deepspeed_overrides_merge():
    ds = render(composed("+deepspeed.activation_checkpointing.partition_activations=true"), GPU8)
    assert ds["activation_checkpointing"] == {"partition_activations": True}


@pytest.mark.heavy
@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_rendered_schedulers_construct_and_start_above_zero(schedule, warmup):
    """DeepSpeed builds the scheduler from the JSON; the first step's LR is > 0 and full LR is reached."""
    import torch
    from deepspeed.runtime import lr_schedules

    ds = render(composed(f"trainer.lr_schedule={schedule}", f"trainer.warmup_steps={warmup}",
                         "trainer.max_steps=10", "trainer.lr=0.1"), CPU2)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = getattr(lr_schedules, ds["scheduler"]["type"])(opt, **ds["scheduler"]["params"])
    if sched.last_batch_iteration < 0:
        sched.step()  # as zerorun.train primes it
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        sched.step()
    assert lrs[0] > 0
    # DeepSpeed's cosine starts decaying on the step after warmup, so its peak is just below lr.
    assert max(lrs) == pytest.approx(0.1, rel=0.05 if schedule == "cosine" else 1e-9)
    if warmup == 0:
        assert lrs[0] == pytest.approx(0.1)


@pytest.mark.heavy
def test_node_local_checkpoints_only_with_a_run_dir_per_node():
    from zerorun.config import World

    def ds(*over):
        cfg = composed("launcher.nnodes=2", "launcher.master_port=29999", *over)
        return render(cfg, World(nproc_per_node=2, nnodes=2, accelerator="cpu", fp16_ok=False))

    assert "checkpoint" not in ds()
    assert ds("launcher.shared_run_dir=false")["checkpoint"] == {"use_node_local_storage": True}
