"""Shared test helpers: composing configs in-process, the worlds and machines tests plan for, running
the real console script, and the checks every e2e run dir must pass."""
import json
import os
import subprocess
import sys
from pathlib import Path

from zerorun.config import ModelConfig, World, compose, make_plan
from zerorun.hardware import GIB, Hardware
from zerorun.ship_traces import model_files

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
BIN = Path(sys.executable).parent
MODEL_FILES = model_files()  # hf aside: a template read from config.json

CPU2 = World(nproc_per_node=2, nnodes=1, accelerator="cpu", fp16_ok=False)
GPU8 = World(nproc_per_node=8, nnodes=1, accelerator="cuda")
A100_8 = Hardware("cuda", 8, 40 * GIB, 512 * GIB, 1, 64)
CPU_HOST = Hardware("cpu", 0, 0, 16 * GIB, 1, 2, fp16_ok=False)


def composed(*overrides):
    """The RunConfig ``zerorun <overrides>`` runs (typo check, Hydra composition, typing)."""
    return compose(list(overrides))


def planned(*overrides, world=GPU8):
    cfg = composed(*overrides)
    return cfg, make_plan(cfg, world)


def repair_ladder(*overrides, world=CPU2, limit=12):
    """Every rung runtime_oom_repair climbs from ``overrides``, as (config, changes), until nothing is left."""
    from zerorun.memory import runtime_oom_repair

    cfg, plan = planned(*overrides, world=world)
    steps = []
    for _ in range(limit):
        repair = runtime_oom_repair(cfg, plan)
        if repair is None:
            break
        cfg, changes = repair
        plan = make_plan(cfg, world)
        steps.append((cfg, changes))
    return steps


def model_file(name: str) -> ModelConfig:
    from omegaconf import OmegaConf

    raw = OmegaConf.load(CONF / "model" / f"{name}.yaml")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw))


# ---------------------------------------------------------------------------------------------- processes


def base_env(cache_dir: Path) -> dict:
    # A developer's shell inside a Slurm job or on SageMaker would turn zerorun's platform detection on.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SM_", "SAGEMAKER_"))}
    env.update(ZERORUN_CACHE=str(cache_dir), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
    return env


TORCHRUN = "launcher=torchrun"
"""For runs whose subject is a training feature rather than the launcher: torchrun starts a job's ranks for ~5 CPU-s
less than the deepspeed CLI, whose runner and launch.py each import DeepSpeed (a 4-step tiny job: 18.9 against 24.2
CPU-s). The launcher's own tests (test_train, test_faults, test_multinode, test_platform_jobs, test_gpt2_verbatim,
test_user_install and the zero2_reference run) keep the default."""

ZERO2_RUN = ["launcher.nproc_per_node=2", "trainer.max_steps=8", "trainer.micro_batch_size=4", "data.seq_len=64",
             "trainer.warmup_steps=1", "trainer.lr=2e-3", "trainer.save_every=2", "trainer.progress=false",
             "trainer.export=false", "zero=stage2"]
"""The reference run several e2e modules compare with (the zero2_reference fixture runs it once a session)."""


def quiet(args):
    """``args`` without the end-of-run pictures unless a test asks for them (trainer.report): the sweep test
    checks them; every other run would spend ~1 s of matplotlib on a picture nobody looks at."""
    return [*args] if any(a.startswith("trainer.report=") for a in args) else [*args, "trainer.report=false"]


def run_zerorun(args, run_dir: Path, cache_dir: Path, *, timeout=1500, env_extra=None, cwd=None):
    """Run the real console script; returns the CompletedProcess (stdout+stderr merged)."""
    env = base_env(cache_dir)
    env.update(env_extra or {})
    cmd = [str(BIN / "zerorun"), *quiet(args), f"hydra.run.dir={run_dir}"]
    return subprocess.run(cmd, env=env, cwd=cwd or run_dir.parent, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout, start_new_session=True)


def run_killed_and_restarted(args, run_dir: Path, cache_dir: Path, *, rank: int, step: int):
    """``run_zerorun`` with rank ``rank`` killed after step ``step`` (ZERORUN_FAULT_KILL) and one restart allowed at
    once: the ranks come back from the last checkpoint within the same job."""
    return run_zerorun([*args, "trainer.max_restarts=1", "trainer.restart_backoff_s=0"], run_dir, cache_dir,
                       env_extra={"ZERORUN_FAULT_KILL": f"{rank}:{step}"})


SESSION_CACHE: list = []
"""The session's tokenized-data cache (conftest's cache_dir fixture puts it here when it is made)."""


def start_on_host(host, args, cwd: Path, cache_dir: Path, env_extra=None) -> subprocess.Popen:
    """``zerorun ARGS`` on a test host (tests/netns.py), as a user runs it on a node: its own data cache, seeded
    with a copy of what the session has made (tokenized data, this machine's process baseline), as a node that
    ran zerorun before would have it; a first run's tokenizing and baseline probe are the session's first job."""
    import shutil

    if SESSION_CACHE and not cache_dir.exists():
        shutil.copytree(SESSION_CACHE[0], cache_dir)
    env = {**base_env(cache_dir), **host.env(), **(env_extra or {})}
    return subprocess.Popen(host.argv([str(BIN / "zerorun"), *quiet(args)]), env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def read_metrics(run_dir: Path):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------- run-dir checks


def assert_run_dir_complete(run_dir, steps, ranks=2):
    for name in ("config.yaml", "plan.json", "ds_config.json", "command.sh", "prepared.json", "metrics.jsonl",
                 "summary.json"):
        assert (run_dir / name).is_file(), f"{name} missing from {run_dir}"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    for m in metrics:
        assert {"step", "loss", "lr", "tokens_per_s"} <= m.keys()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == steps
    assert 0 < summary["non_pad_fraction"] <= 1  # LM blocks: 1.0; classification: length-grouped batches
    assert len(summary["peak_memory"]) == ranks and all(p["peak_rss_bytes"] > 0 for p in summary["peak_memory"])
    # DeepSpeed's CPU all-reduce segments (~66 MB per rank, never unlinked by DeepSpeed) are gone.
    words = (run_dir / "command.sh").read_text().split()
    port = words[words.index("--master_port" if "--master_port" in words else "--master-port") + 1]
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*")), port
    ckpt = run_dir / "checkpoints"
    assert (ckpt / f"global_step{steps}" / "COMPLETE").is_file()
    assert (ckpt / "zerorun_latest").read_text().strip() == f"global_step{steps}"
    return metrics, summary


def assert_loss_falls(metrics, by=0.3):
    first, last = metrics[0]["loss"], min(m["loss"] for m in metrics[-2:])
    assert last < first - by, f"loss did not fall: {[round(m['loss'], 3) for m in metrics]}"


def load_export(run_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    probe = torch.load(run_dir / "export" / "probe.pt")
    dtype = getattr(torch, probe["dtype"])
    cls = AutoModelForCausalLM if probe["task"] == "causal_lm" else AutoModelForSequenceClassification
    return cls.from_pretrained(run_dir / "export", dtype=dtype).eval(), probe


def assert_export_matches_engine(run_dir):
    import torch

    model, probe = load_export(run_dir)
    with torch.no_grad():
        logits = model(**probe["inputs"]).logits.float()
    tol = 1e-5 if model.dtype == torch.float32 else 2e-2
    assert torch.allclose(logits, probe["logits"], atol=tol, rtol=0), (logits - probe["logits"]).abs().max()


def assert_model_states_match_estimate(summary):
    """The estimator's model-state components against the tensors DeepSpeed really holds on rank 0.
    Returns how many components were compared."""
    est, measured = summary["estimated_components"], summary["peak_memory"][0]["model_state_bytes"]
    pairs = [("parameters", "parameters"), ("fp32 master copies", "fp32_master"),
             ("optimizer states", "optimizer_states")]
    checked = 0
    for est_key, meas_key in pairs:
        if est_key == "parameters" and "NVMe param swap buffers (host)" in est:
            continue  # swapped partitions live in the swap buffers (their own term); only the small ones outside
        want = est.get(est_key) or est.get(f"{est_key} (host)")  # offloaded state is counted on the host
        if want and measured[meas_key]:
            assert abs(measured[meas_key] - want) <= 0.01 * want + 64, (est_key, est, measured)
            checked += 1
    return checked
