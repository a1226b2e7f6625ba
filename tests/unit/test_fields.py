"""Every schema field declares what it accepts, and the pre-launch phase holds to it for any value: drawn by
Hypothesis (right and wrong types, NaN, ±inf, zero, negatives, huge numbers, empty strings, missing paths, a
directory where a file belongs and the reverse), a config is either refused with zerorun's UserError naming the
key, or accepted, and then its DeepSpeed JSON passes DeepSpeed's own config parser and every optimizer and
scheduler hyperparameter is one torch's optimizer and DeepSpeed's schedulers take. Never any other exception."""
import copy
import dataclasses
import math
import os

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from helpers import CPU2, composed
from zerorun import platforms
from zerorun.config import RunConfig, UserError, check, make_plan
from zerorun.config.load import typing_error
from zerorun.config.fields import Bound, PathKind, Text, declared, field_problems, leaves

os.environ.setdefault("DS_ACCELERATOR", "cpu")
BASE = composed()
KEYS = [key for key, f, _ in leaves(BASE) if key not in ("deepspeed",)]
# CI replays the same examples (a green main stays green); a developer's run draws new ones each time.
SEEDED = bool(os.environ.get("CI"))
NUMERIC = ("int", "float", "Optional[int]", "Optional[float]", "List[float]")


def test_every_numeric_and_string_field_declares_its_constraint():
    undeclared = [key for key, f, _ in leaves(BASE)
                  if str(f.type) in NUMERIC + ("str",) and declared(f) is None]
    assert undeclared == [], f"declare a bound (fields.num), path (path_field) or text rule for: {undeclared}"


def test_a_bound_names_key_value_and_the_default_as_fix():
    [p] = field_problems(composed("trainer.warmup_steps=-1"))
    assert (p.key, p.value) == ("trainer.warmup_steps", -1)
    assert str(p) == "trainer.warmup_steps=-1: must be at least 0. Fix: trainer.warmup_steps=10 (the default)."
    assert Bound(ge=0, lt=1).problem(float("nan")) == "must be finite, in [0, 1)"
    assert Bound(gt=0).problem(10**40).startswith("is too large")
    assert Bound(ge=0, lt=1, length=2).problem([0.9]) == "must hold 2 numbers"


# ---------------------------------------------------------------------------------------------- generators

@pytest.fixture(scope="module")
def places(tmp_path_factory):
    root = tmp_path_factory.mktemp("places")
    (root / "a_file.txt").write_text("hello\n")
    (root / "a_dir").mkdir()
    return {"file": str(root / "a_file.txt"), "dir": str(root / "a_dir"), "missing": str(root / "missing" / "x"),
            "under_file": str(root / "a_file.txt" / "x")}


PLACES = ("file", "dir", "missing", "under_file")
NASTY_TEXT = ["", " ", "abc", "nan", "inf", "-inf", "-1", "0", "1e309", "1e-400", "[1,2]", "${oops}", "???", "null",
              "true", "über", "a b", "../..", "~", "owner/name", "--x"]
VALUES = st.one_of(
    st.integers(min_value=0, max_value=16), st.floats(min_value=0, max_value=1, exclude_max=True),  # often valid
    st.integers(min_value=-(10**20), max_value=10**20), st.sampled_from([0, 1, -1, 2**31, 2**63, 10**30, 65536]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1.0, 0.999999, 1e-12, 1e308]),
    st.booleans(), st.none(), st.sampled_from(NASTY_TEXT), st.text(max_size=8),
    st.sampled_from(PLACES).map(lambda p: ("place", p)),
    st.lists(st.one_of(st.floats(allow_nan=True), st.integers(-5, 5)), max_size=3),
)


TYPED = OmegaConf.structured(BASE)


def _typed_with(key, value):
    """The config with one leaf set as Hydra sets an override, through OmegaConf's typing (what to_run_config's
    merge does for every key), then the same conversion into a RunConfig; the leaf is put back afterwards, as a
    plain copy: a list node (trainer.adam_betas) is changed in place by a refused update."""
    old = OmegaConf.select(TYPED, key)
    old = OmegaConf.to_container(old) if OmegaConf.is_config(old) else old
    try:
        OmegaConf.update(TYPED, key, value, merge=False)
        return OmegaConf.to_object(TYPED)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 (OmegaConf's ValidationError and friends)
        raise typing_error(e) from None
    finally:
        OmegaConf.update(TYPED, key, old, merge=False)


@pytest.fixture(scope="module")
def deepspeed_parser():
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig


def _assert_launchable(cfg: RunConfig, parser):
    """What DeepSpeed and torch would meet at rank start: the rendered JSON through DeepSpeed's parser (at world
    size 1, the batch geometry per data-parallel rank), the optimizer's hyperparameters through torch's AdamW,
    the schedule through DeepSpeed's scheduler class."""
    import torch
    from deepspeed.runtime import lr_schedules

    from zerorun.ds_config import render

    plan = make_plan(cfg, CPU2)
    ds = render(cfg, plan)
    one_rank = {**ds, "train_batch_size": ds["train_batch_size"] // plan.data_parallel_size}
    parser(copy.deepcopy(one_rank))
    opt = ds["optimizer"]["params"]
    for name in ("lr", "eps", "weight_decay"):
        assert math.isfinite(opt[name]) and opt[name] >= 0, (name, opt)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"],
                                  weight_decay=opt["weight_decay"])
    sched = ds["scheduler"]
    for name, value in sched["params"].items():
        if isinstance(value, float):
            assert math.isfinite(value), (name, sched)
    getattr(lr_schedules, sched["type"])(optimizer, **sched["params"])
    assert all(math.isfinite(g["lr"]) and g["lr"] >= 0 for g in optimizer.param_groups)


@pytest.mark.heavy
@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=SEEDED, database=None)
@given(key=st.sampled_from(KEYS), value=VALUES, data=st.data())
def test_any_value_of_any_field_is_accepted_and_launchable_or_refused_naming_the_key(
        key, value, data, places, deepspeed_parser):
    if isinstance(value, tuple):
        value = places[value[1]]
    try:
        cfg = _typed_with(key, value)
        problems = check(cfg, CPU2, libaio=True)
    except UserError as e:  # typing (OmegaConf) or a declared bound: one error, naming the key
        assert key.split(".")[-1] in str(e) or key in str(e), (key, value, str(e))
        return
    if problems:
        assert all(isinstance(p, UserError) for p in problems)
        assert any(p.key == key or key in str(p) for p in problems) or _cross_field(problems), (key, value, problems)
        return
    event("accepted and launchable")
    _assert_launchable(cfg, deepspeed_parser)


def _cross_field(problems):
    """A value valid on its own can still break a rule between fields (seq_len > max_positions): then every
    problem must name a real key of the config (or a group, or the model), so the user knows what to change."""
    from zerorun.config import schema_problem

    return all(p.key and (p.key in ("model", "gate") or schema_problem(p.key) is None) for p in problems)


PLATFORM_VARS = ["SLURM_NNODES", "SLURM_STEP_NUM_NODES", "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE",
                 "SLURM_TASKS_PER_NODE", "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "SLURM_RESTART_COUNT",
                 "SLURM_JOB_ID", "SLURM_STEP_ID", "SM_NUM_GPUS", "SM_HOSTS", "SM_CURRENT_HOST", "SM_MASTER_PORT",
                 "SM_MASTER_ADDR", "SM_HPS", "SM_CHANNEL_TRAIN", "SM_NETWORK_INTERFACE_NAME"]
ENV_TEXT = st.one_of(st.sampled_from(NASTY_TEXT + ["2", "1", "0", "-3", "99999999999999999999", "abc", "n[1-x]",
                                                   "n[01-03]", '["algo-1","algo-2"]', "{", "2(x3)", "x(x2)"]),
                     st.text(max_size=6), st.integers(-5, 10**12).map(str))


@pytest.mark.heavy
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=SEEDED, database=None)
@given(platform=st.sampled_from(["slurm", "sagemaker"]),
       env=st.dictionaries(st.sampled_from(PLATFORM_VARS), ENV_TEXT, max_size=4))
def test_any_platform_variable_gives_a_platform_or_one_error_naming_it(platform, env, tmp_path_factory):
    base = tmp_path_factory.getbasetemp() / "sm"
    environ = {"SLURM_JOB_ID": "123", "SLURM_STEP_ID": "0"} if platform == "slurm" else \
        {"SM_TRAINING_ENV": "{}", "SAGEMAKER_BASE_DIR": str(base), "SM_CURRENT_HOST": "algo-1"}
    environ.update(env)
    if platform == "slurm":
        environ = {k: v for k, v in environ.items() if not k.startswith("SM_")}
    try:
        got = platforms.detect(environ, [])
    except UserError as e:
        assert e.key and "\n" not in str(e), (environ, e.key, str(e))  # one line naming what is wrong
        named = [e.key, *environ, "distribution", "hyperparameters", "resourceconfig.json"]
        assert any(n in str(e) for n in named), (environ, e.key, str(e))
        return
    if got is None:  # SLURM_JOB_ID drawn empty: not a Slurm job at all
        assert not environ.get("SLURM_JOB_ID"), environ
        return
    assert got.name == platform
    for o in got.overrides:
        assert "=" in o


def test_declared_kinds_cover_the_path_fields():
    kinds = {key: f.metadata["path"] for key, f, _ in leaves(BASE) if "path" in f.metadata}
    assert kinds["data.path"] == PathKind.file and kinds["trainer.resume_from"] == PathKind.resume
    assert kinds["trainer.checkpoint_dir"] == kinds["trainer.export_dir"] == kinds["data.cache_dir"] == PathKind.out_dir
    texts = [key for key, f, _ in leaves(BASE) if isinstance(declared(f), Text)]
    assert "launcher.master_addr" in texts and dataclasses.is_dataclass(BASE)


@pytest.mark.parametrize("key", ["trainer.checkpoint_dir", "data.path", "data.cache_dir", "trainer.resume_from"])
def test_a_path_with_a_nul_byte_is_refused_naming_the_key(key):
    # Found by the generator above: the filesystem calls raise ValueError, not OSError, on a NUL byte.
    problems = check(_typed_with(key, "a\x00b"), CPU2, libaio=True)
    assert any(p.key == key and "NUL byte" in str(p) for p in problems), problems
