"""SageMaker and Slurm contracts → overrides (zerorun.platforms), and bad platform input → one clear error."""
import json

import pytest

from zerorun import platforms
from zerorun.config import UserError


def sagemaker_base(tmp_path, hosts=("algo-1", "algo-2"), current="algo-2", hps=None, channels=("train",)):
    base = tmp_path / "ml"
    (base / "input" / "config").mkdir(parents=True)
    (base / "input" / "config" / "resourceconfig.json").write_text(json.dumps(
        {"current_host": current, "hosts": list(hosts), "network_interface_name": "eth7"}))
    (base / "input" / "config" / "hyperparameters.json").write_text(json.dumps(
        {k: json.dumps(v) for k, v in (hps or {}).items()}))
    for c in channels:
        (base / "input" / "data" / c).mkdir(parents=True)
        (base / "input" / "data" / c / f"{c}.txt").write_text("some text\n")
    (base / "checkpoints").mkdir()
    return base


def test_sagemaker_topology_outputs_channels_and_hyperparameters(tmp_path):
    base = sagemaker_base(tmp_path, hps={"zero": "stage3", "trainer.lr": 1e-4, "model": "gpt2-tiny",
                                         "trainer.export": True, "sagemaker_program": "x.py",
                                         "overrides": "offload=cpu trainer.max_steps=7"})
    p = platforms.detect({"SAGEMAKER_BASE_DIR": str(base)}, ["train", "--trainer.seed", "3", "data.seq_len=64"])
    o = p.overrides
    assert p.name == "sagemaker" and p.node_rank == 1
    for want in ("launcher=torchrun", "launcher.nnodes=2", "launcher.node_rank=1", "launcher.master_addr=algo-1",
                 "launcher.master_port=7777", "launcher.shared_run_dir=false", f"trainer.export_dir={base}/model",
                 f"hydra.run.dir={base}/output/data/run", f"trainer.checkpoint_dir={base}/checkpoints/node1",
                 f"data.path={base}/input/data/train/train.txt", "zero=stage3", "trainer.lr=0.0001", "+model=gpt2-tiny",
                 "trainer.export=true", "offload=cpu", "trainer.max_steps=7", "trainer.seed=3"):
        assert want in o, want
    assert not any("sagemaker_program" in x for x in o) and "trainer.resume=true" not in o
    assert p.env == {"NCCL_SOCKET_IFNAME": "eth7", "GLOO_SOCKET_IFNAME": "eth7"}
    assert "data.seq_len=64" in o and "train" not in o  # Hydra words kept; a BYO container's `train` dropped
    # the user's own value for a key wins over the platform's
    p = platforms.detect({"SAGEMAKER_BASE_DIR": str(base)}, ["launcher.master_port=1234"])
    assert "launcher.master_port=7777" not in p.overrides and "launcher.master_port=1234" in p.overrides


def test_a_restarted_sagemaker_job_resumes_from_its_checkpoints(tmp_path):
    base = sagemaker_base(tmp_path, hosts=("algo-1",), current="algo-1")
    (base / "checkpoints" / "global_step4").mkdir(parents=True)
    (base / "checkpoints" / "global_step4" / "COMPLETE").write_text("{}")
    p = platforms.detect({"SAGEMAKER_BASE_DIR": str(base)}, [])
    assert "trainer.resume=true" in p.overrides and f"trainer.checkpoint_dir={base}/checkpoints" in p.overrides
    assert not any(o.startswith("launcher.nnodes") for o in p.overrides)  # one instance: one node


@pytest.mark.parametrize("case, words", [
    ("two files in a channel", "channel train holds 2 files (a.txt, train.txt)"),
    ("empty channel", "holds no file at its top level"),
    ("current host missing", "the current host 'algo-9' is not in the host list"),
    ("bad json", "hyperparameter zero = '[stage3' is not valid JSON"),
    ("bad key", "hyperparameter 'rm -rf' is not a config key"),
    ("ranks started", "SageMaker started the ranks already (RANK is set"),
])
def test_bad_sagemaker_input_is_one_clear_error(tmp_path, case, words):
    base = sagemaker_base(tmp_path, current="algo-9" if case == "current host missing" else "algo-1")
    if case == "two files in a channel":
        (base / "input" / "data" / "train" / "a.txt").write_text("x")
    if case == "empty channel":
        (base / "input" / "data" / "train" / "train.txt").unlink()
    if case == "bad json":
        (base / "input" / "config" / "hyperparameters.json").write_text(json.dumps({"zero": "[stage3"}))
    if case == "bad key":
        (base / "input" / "config" / "hyperparameters.json").write_text(json.dumps({"rm -rf": "1"}))
    env = {"SAGEMAKER_BASE_DIR": str(base), **({"RANK": "0"} if case == "ranks started" else {})}
    with pytest.raises(UserError) as e:
        platforms.detect(env, [])
    assert words in str(e.value) and "Fix:" in str(e.value)
    assert platforms.failure_file(env) == base / "output" / "failure"


def test_hyperparameter_values_in_hydra_grammar():
    assert platforms.hp_overrides({"a.b": "x y", "c": [1, 2], "d": None, "e": False, "f": "it's"}) == [
        "a.b='x y'", "c=[1,2]", "d=null", "e=false", "f='it\\'s'"]


def test_slurm_nodelists_expand_in_order():
    assert platforms.expand_nodelist("gpu[01-03,07],cpu5,n[8-10]x") == [
        "gpu01", "gpu02", "gpu03", "gpu07", "cpu5", "n8x", "n9x", "n10x"]


def slurm_env(tmp_path, **over):
    return {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "ft", "SLURM_STEP_ID": "0", "SLURM_NODEID": "1",
            "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
            "SLURM_SUBMIT_DIR": str(tmp_path), **over}


def test_slurm_one_task_per_node_derives_the_rendezvous_and_a_per_job_run_dir(tmp_path):
    p = platforms.detect(slurm_env(tmp_path), [])
    run = tmp_path / "zerorun-runs" / "ft-4242-0"
    assert p.overrides == [f"hydra.run.dir={run}", "launcher=torchrun", "launcher.nnodes=2", "launcher.node_rank=1",
                           "launcher.master_addr=node07", f"launcher.master_port={20000 + 4242}"]
    assert p.requeue == ["scontrol", "requeue", "4242"]
    (run / "checkpoints" / "global_step2").mkdir(parents=True)
    (run / "checkpoints" / "global_step2" / "COMPLETE").write_text("{}")
    # only a requeued job resumes by itself; a second `srun zerorun` in the allocation gets its own run dir
    assert "trainer.resume=true" not in platforms.detect(slurm_env(tmp_path), []).overrides
    assert "trainer.resume=true" in platforms.detect(slurm_env(tmp_path, SLURM_RESTART_COUNT="1"), []).overrides
    assert f"hydra.run.dir={tmp_path / 'zerorun-runs' / 'ft-4242-1'}" in platforms.detect(
        slurm_env(tmp_path, SLURM_STEP_ID="1"), []).overrides
    # the batch script itself (no srun step) is one node's job
    assert platforms.detect(slurm_env(tmp_path, SLURM_STEP_ID=""), []).overrides == [
        f"hydra.run.dir={tmp_path / 'zerorun-runs' / 'ft-4242-batch'}"]


def test_slurm_one_task_per_gpu_is_refused_not_run_as_g_squared_ranks(tmp_path):
    with pytest.raises(UserError, match="Slurm started 8 tasks on this node"):
        platforms.detect(slurm_env(tmp_path, SLURM_STEP_TASKS_PER_NODE="8(x2)"), [])
