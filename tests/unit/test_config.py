"""Composition and the cross-group checks, in process."""
import itertools
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_module

from zerorun.config import ConfigError, ModelConfig, World, check, register_schemas, to_run_config, \
    unknown_override_keys

CONF = Path(__file__).resolve().parents[2] / "conf"
CPU2 = World(nproc_per_node=2, nnodes=1, accelerator="cpu", fp16_ok=False)
GPU8 = World(nproc_per_node=8, nnodes=1, accelerator="cuda")


def composed(*overrides):
    register_schemas()
    with initialize_config_module("zerorun.conf", version_base=None):
        return to_run_config(compose("config", overrides=list(overrides)))


def test_default_is_tiny_gpt2_and_plus_model_replaces_it():
    assert composed().model.name == "tiny-gpt2"
    cfg = composed("+model=gpt2", "zero=stage2", "offload=cpu")
    assert (cfg.model.name, cfg.model.num_layers, cfg.zero.stage, cfg.offload.device.value) == ("gpt2", 12, 2, "cpu")


def test_every_model_file_sets_every_architecture_key():
    # +model=X merges over tiny-gpt2's values, so a key missing from X would silently keep tiny's.
    import dataclasses

    required = {f.name for f in dataclasses.fields(ModelConfig)}
    for path in sorted((CONF / "model").glob("*.yaml")):
        keys = set(yaml.safe_load(path.read_text()))
        assert keys == required, f"{path.name}: missing {required - keys}, extra {keys - required}"


@pytest.mark.parametrize("stage,offload,precision", list(itertools.product(
    ["stage0", "stage1", "stage2", "stage3"], ["none", "cpu", "nvme"], ["fp32", "fp16", "bf16"])))
def test_valid_combinations_pass_and_invalid_ones_say_why(stage, offload, precision):
    cfg = composed(f"zero={stage}", f"offload={offload}", f"precision={precision}")
    problems = check(cfg, GPU8, libaio=True)
    expected_bad = (offload != "none" and stage == "stage0") or (offload == "nvme" and stage != "stage3")
    assert bool(problems) == expected_bad, problems


def test_fp16_refused_on_cpu_without_support():
    problems = check(composed("precision=fp16"), CPU2)
    assert any("precision=fp16 on cpu ranks" in p and "precision=bf16" in p for p in problems)


def test_nvme_without_libaio():
    problems = check(composed("zero=stage3", "offload=nvme"), GPU8, libaio=False)
    assert any("libaio" in p and "apt-get install libaio-dev" in p for p in problems)


def test_batch_must_divide_with_fix():
    problems = check(composed("trainer.micro_batch_size=4", "trainer.global_batch_size=100"), GPU8)
    assert problems == ["trainer.global_batch_size=100 is not a multiple of micro_batch_size × data-parallel ranks "
                        "= 4 × 8 = 32. Fix: trainer.global_batch_size=96, or a micro_batch_size that divides it."]


def test_multi_node_checks():
    problems = check(composed("launcher.nnodes=2"), GPU8)
    assert sum("no launcher.hostfile" in p for p in problems) == 1
    assert sum("loopback" in p for p in problems) == 1
    assert check(composed("launcher=torchrun", "launcher.nnodes=2", "launcher.master_addr=node0"), GPU8) == []


def test_unknown_keys_are_found_with_suggestions():
    assert unknown_override_keys(["trainer.max_step=3", "zero=stage2", "+foo=1", "hydra.run.dir=x"]) == [
        "unknown key trainer.max_step (did you mean trainer.max_steps?). Fix: correct the spelling."]
    assert unknown_override_keys(["deepspeed.anything=1", "trainer.max_steps=3"]) == []
    with pytest.raises(ConfigError, match="unknown key trainer.max_step"):
        composed("+trainer.max_step=3")


def test_pipeline_checks():
    two = World(nproc_per_node=2, nnodes=1, accelerator="cpu")
    assert check(composed("parallel=pipeline", "parallel.micro_batches=2"), two) == []
    problems = check(composed("parallel=pipeline", "zero=stage2"), two)
    assert any("DeepSpeed refuses ZeRO-2 and ZeRO-3 with pipeline" in p for p in problems)
    problems = check(composed("parallel=pipeline", "parallel.stages=3", "parallel.micro_batches=3"), two)
    assert any("parallel.stages=3 does not divide the world size 2" in p for p in problems)
    problems = check(composed("parallel=pipeline", "parallel.stages=4", "parallel.micro_batches=4"),
                     World(nproc_per_node=4, nnodes=1, accelerator="cpu"))
    assert any("exceeds the 2 transformer layers of tiny-gpt2" in p for p in problems)
    problems = check(composed("parallel=pipeline", "parallel.micro_batches=1"), two)
    assert any("1 micro-batch(es) per step for 2 pipeline stages" in p for p in problems)


def test_pipeline_micro_batches_set_the_accumulation():
    from zerorun.config import global_batch, grad_accum_steps

    cfg = composed("parallel=pipeline", "parallel.micro_batches=4", "trainer.micro_batch_size=2")
    four = World(nproc_per_node=4, nnodes=1, accelerator="cpu")  # 2 stages × 2 data-parallel replicas
    assert (global_batch(cfg, four), grad_accum_steps(cfg, four)) == (16, 4)
