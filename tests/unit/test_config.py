"""Composition, the rule table and the cross-group checks, in process."""
import dataclasses
import itertools

import pytest
import yaml

from helpers import CONF, CPU2, GPU8, composed
from zerorun.config import (ConfigError, Layout, ModelConfig, OffloadDevice, ParallelMode, UserError, World, check,
                            compose, global_batch, grad_accum_steps, layouts, unknown_override_keys)


@pytest.mark.heavy
def test_default_is_tiny_gpt2_and_plus_model_replaces_it():
    assert composed().model.name == "tiny-gpt2"
    cfg = composed("+model=gpt2", "zero=stage2", "offload=cpu")
    assert (cfg.model.name, cfg.model.num_layers, cfg.zero.stage, cfg.offload.device.value) == ("gpt2", 12, 2, "cpu")


def test_every_model_file_sets_every_architecture_key():
    # +model=X merges over tiny-gpt2's values, so a key missing from X would silently keep tiny's.
    required = {f.name for f in dataclasses.fields(ModelConfig)}
    for path in sorted((CONF / "model").glob("*.yaml")):
        keys = set(yaml.safe_load(path.read_text()))
        assert keys == required, f"{path.name}: missing {required - keys}, extra {keys - required}"


# DeepSpeed's own rules, written out as data (not re-derived): offload needs ZeRO >= 1, NVMe needs ZeRO-3
# (ZeRO-Infinity), parameters offload only at ZeRO-3; pipelines take ZeRO-0/1.
REFUSED_OFFLOAD = {(0, "cpu"), (0, "nvme"), (1, "nvme"), (2, "nvme")}


@pytest.mark.heavy
@pytest.mark.parametrize("stage,offload,precision", list(itertools.product(
    [0, 1, 2, 3], ["none", "cpu", "nvme"], ["fp32", "fp16", "bf16"])))
def test_offload_rules_refuse_exactly_deepspeeds_exclusions_and_say_why(stage, offload, precision):
    cfg = composed(f"zero=stage{stage}", f"offload={offload}", f"precision={precision}")
    problems = [str(p) for p in check(cfg, GPU8, libaio=True)]
    if (stage, offload) not in REFUSED_OFFLOAD:
        assert problems == []
        return
    assert problems and len(problems) == (2 if (stage, offload) == (0, "nvme") else 1), problems
    for p in problems:  # offload needs a partitioning stage; NVMe needs ZeRO-3 (both said at ZeRO-0)
        assert p.startswith(f"offload={offload} with zero.stage={stage}: ") and " Fix: " in p
        assert "zero=stage3" in p


@pytest.mark.heavy
def test_the_rule_table_lists_every_accepted_layout_once():
    none, cpu, nvme = OffloadDevice.none, OffloadDevice.cpu, OffloadDevice.nvme
    assert layouts(ParallelMode.dp) == [
        Layout(0, none, False), Layout(1, none, False), Layout(1, cpu, False), Layout(2, none, False),
        Layout(2, cpu, False), Layout(3, none, False), Layout(3, cpu, False), Layout(3, cpu, True),
        Layout(3, nvme, False), Layout(3, nvme, True)]
    assert layouts(ParallelMode.pipeline) == [Layout(0, none, False), Layout(1, none, False)]
    assert [lay.label for lay in layouts()[-4:]] == ["cpu (optimizer)", "cpu (+params)", "nvme (optimizer)",
                                                      "nvme (+params)"]
    for lay in layouts():  # every listed layout passes check as a config
        cfg = composed(f"zero=stage{lay.stage}", f"offload={lay.device.value}",
                       f"offload.params={'true' if lay.params else 'false'}")
        assert check(cfg, GPU8, libaio=True) == []


def test_problems_carry_key_value_and_fix():
    [p] = check(composed("trainer.micro_batch_size=4", "trainer.global_batch_size=100"), GPU8)
    assert isinstance(p, UserError)
    assert (p.key, p.value, p.fix) == ("trainer.global_batch_size", 100,
                                       "trainer.global_batch_size=96, or a micro_batch_size that divides it.")
    assert str(p) == ("trainer.global_batch_size=100 is not a multiple of micro_batch_size × data-parallel ranks "
                      "= 4 × 8 = 32. Fix: trainer.global_batch_size=96, or a micro_batch_size that divides it.")


@pytest.mark.heavy
def test_fp16_refused_on_cpu_without_support_and_its_other_knobs_reported_too():
    problems = [str(p) for p in check(composed("precision=fp16", "precision.initial_scale_power=-3"), CPU2)]
    assert len(problems) == 2, problems
    assert "precision=fp16 on cpu ranks" in problems[0] and "precision=bf16" in problems[0]
    assert problems[1].startswith("precision.initial_scale_power=-3: ") and "Fix: precision.initial_scale_power=16" \
        in problems[1]
    bad = check(composed("precision=fp16", "precision.loss_scale_window=0", "precision.hysteresis=0"), GPU8)
    assert [p.key for p in bad] == ["precision.loss_scale_window", "precision.hysteresis"]


def test_nvme_without_libaio():
    problems = [str(p) for p in check(composed("zero=stage3", "offload=nvme"), GPU8, libaio=False)]
    assert any("libaio" in p and "apt-get install libaio-dev" in p for p in problems)


@pytest.mark.heavy
@pytest.mark.parametrize("path", ["/proc/zerorun-nvme", "/etc/hostname/nvme"])
def test_nvme_path_is_checked_by_trying(path, tmp_path):
    """/proc passes a permission-bit test as root but refuses new directories; a path under a file too."""
    [p] = check(composed("zero=stage3", "offload=nvme", f"offload.nvme_path={path}"), GPU8, libaio=True)
    assert str(p).startswith(f"offload.nvme_path={path}: not a writable directory (") and p.key == "offload.nvme_path"
    fresh = tmp_path / "a" / "b"
    assert check(composed("zero=stage3", "offload=nvme", f"offload.nvme_path={fresh}"), GPU8, libaio=True) == []
    assert not (tmp_path / "a").exists()  # the probe cleans up what it made


def test_batch_must_divide_with_fix():
    problems = [str(p) for p in check(composed("trainer.micro_batch_size=4", "trainer.global_batch_size=100"), GPU8)]
    assert problems == ["trainer.global_batch_size=100 is not a multiple of micro_batch_size × data-parallel ranks "
                        "= 4 × 8 = 32. Fix: trainer.global_batch_size=96, or a micro_batch_size that divides it."]


@pytest.mark.heavy
def test_multi_node_checks():
    problems = [str(p) for p in check(composed("launcher.nnodes=2"), GPU8)]
    assert len(problems) == 2 and "without launcher.master_port" in problems[0] and "loopback" in problems[1]
    ok = ("launcher.nnodes=2", "launcher.master_addr=node0", "launcher.master_port=29500")
    assert check(composed("launcher=torchrun", *ok), GPU8) == []
    c10d = [str(p) for p in check(composed("launcher.rdzv=c10d", "launcher.min_nnodes=3"), GPU8)]
    assert len(c10d) == 2 and "launcher.rdzv=c10d is torchrun's" in c10d[0] and "min_nnodes=3" in c10d[1]
    assert check(composed("launcher=torchrun", *ok, "launcher.rdzv=c10d", "launcher.min_nnodes=1"), GPU8) == []
    # deepspeed node by node (--no_ssh, zerorun writes the hostfile) needs no hostfile either
    assert check(composed(*ok), GPU8) == []


def test_unknown_keys_are_found_with_suggestions():
    assert [str(p) for p in unknown_override_keys(["trainer.max_step=3", "zero=stage2", "+foo=1", "hydra.run.dir=x"])] \
        == ["unknown key trainer.max_step (did you mean trainer.max_steps?). Fix: correct the spelling."]
    assert unknown_override_keys(["deepspeed.anything=1", "trainer.max_steps=3"]) == []
    with pytest.raises(ConfigError, match="unknown key trainer.max_step"):
        composed("+trainer.max_step=3")  # added with '+': found in the composed tree by the same walker
    with pytest.raises(ConfigError, match=r"did you mean trainer.max_steps\?"):
        compose(["trainer.max_step=3"])  # zerorun-estimate and the tests compose through the same check


def test_a_key_of_another_group_is_named():
    """optimizer.lr is no key, but trainer.lr is: the one key of the schema with that last name is suggested."""
    assert [str(p) for p in unknown_override_keys(["optimizer.lr=0.1"])] \
        == ["unknown key optimizer.lr (did you mean trainer.lr?). Fix: correct the spelling."]
    hint = str(unknown_override_keys(["optimizer.nonsense=1"])[0])
    assert "optimizer has: name, momentum" in hint and "did you mean" not in hint


def test_a_suggestion_is_a_key_the_schema_has():
    """run.dir is close to dry_run, but dry_run is a bool with no keys: no "did you mean dry_run.dir"."""
    hint = str(unknown_override_keys(["run.dir=x"])[0])
    assert "did you mean" not in hint and "the config has: model," in hint
    assert "dry_run is a single value, not a group of keys" in str(unknown_override_keys(["dry_run.dir=x"])[0])
    assert unknown_override_keys(["model.hf_config.rope_theta=1e6"]) == []  # a free-form dict takes any key


@pytest.mark.heavy
@pytest.mark.parametrize("override, says", [
    ("data.seq_len=abc", "data.seq_len: Value 'abc' of type 'str' could not be converted to Integer. "
                         "Fix: data.seq_len=128 (the default) or another value of its type."),
    ("trainer.activation_checkpointing=maybe", "trainer.activation_checkpointing=false (the default)"),
    ("parallel.partition=balanced", "expected one of [parameters, uniform]. Fix: parallel.partition=parameters"),
])
def test_a_value_of_the_wrong_type_on_the_command_line_names_its_key_and_default(override, says):
    """Hydra's own answer was "Error merging override data.seq_len=abc": the key, but not what is wrong."""
    with pytest.raises(UserError) as e:
        compose(["+model=tiny-gpt2", override])
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.heavy
def test_enum_choices_are_refused_while_composing():
    with pytest.raises(UserError, match="parallel.partition"):
        composed("parallel=pipeline", "parallel.partition=balanced")
    with pytest.raises(UserError, match="data.format"):
        composed("data.format=parquet")


@pytest.mark.heavy
def test_pipeline_checks():
    two = World(nproc_per_node=2, nnodes=1, accelerator="cpu")
    assert check(composed("parallel=pipeline", "parallel.micro_batches=2"), two) == []
    problems = [str(p) for p in check(composed("parallel=pipeline", "zero=stage2"), two)]
    assert any("DeepSpeed refuses ZeRO-2 and ZeRO-3 with pipeline" in p for p in problems)
    problems = [str(p) for p in check(composed("parallel=pipeline", "parallel.stages=3", "parallel.micro_batches=3"),
                                      two)]
    assert any("parallel.stages=3 does not divide the world size 2" in p for p in problems)
    problems = [str(p) for p in check(composed("parallel=pipeline", "parallel.stages=4", "parallel.micro_batches=4"),
                                      World(nproc_per_node=4, nnodes=1, accelerator="cpu"))]
    assert any("exceeds the 2 transformer layers of tiny-gpt2" in p for p in problems)
    problems = [str(p) for p in check(composed("parallel=pipeline", "parallel.micro_batches=1"), two)]
    assert any("1 micro-batch(es) per step for 2 pipeline stages" in p for p in problems)


def test_pipeline_micro_batches_set_the_accumulation():
    cfg = composed("parallel=pipeline", "parallel.micro_batches=4", "trainer.micro_batch_size=2")
    four = World(nproc_per_node=4, nnodes=1, accelerator="cpu")  # 2 stages × 2 data-parallel replicas
    assert (global_batch(cfg, four), grad_accum_steps(cfg, four)) == (16, 4)
