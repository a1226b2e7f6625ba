"""zerorun as a user installs it (issues 34, 36): `pip install .` with no extras into a venv of its own, then a real
2-rank job from a directory that holds only a config.json, written by transformers' own config class.

What the test extras hide shows here: tensorboard brings protobuf to the dev venv, so a dependency a user needs can
be missing from pyproject's `dependencies` while every other test passes. The venv is made once per dependency list
(pyproject's `dependencies` and the Python version: ZERORUN_USER_VENV_FRESH=1 makes it anew), with torch installed
first and pinned as the Makefile does; zerorun itself is reinstalled from this checkout's files every time. The
job loads no JIT-compiled DeepSpeed op (CPU ranks skip the shm comm op), so none is built, by zerorun's launch path
or by a rank: torch's JIT build files hold the absolute paths of the venv's torch and DeepSpeed, so another venv's
built ops would recompile (87 s on 2 cores: measured), never load as they are.
`make test-user-install` runs this module alone, with a Llama-type config.json too (ZERORUN_USER_INSTALL_ALL=1).
"""
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT_DIR = Path(os.environ.get("ZERORUN_USER_VENV_ROOT", "~/.cache/zerorun/user-install")).expanduser()
CONFIGS = {
    "gpt2": ("GPT2Config", dict(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128)),
    "llama": ("LlamaConfig", dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=128, vocab_size=1000, max_position_embeddings=128)),
}
STEPS = 4


def dependencies():
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def pip(venv: Path, *args, timeout=1200):
    return subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q", *args],
                          check=True, capture_output=True, text=True, timeout=timeout, env=user_env())


def user_env(venv: Path = None) -> dict:
    """A user's shell: nothing of the dev checkout (PYTHONPATH, the dev venv) on any path."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "TORCH_EXTENSIONS_DIR", "DS_ACCELERATOR")
           and not k.startswith(("SLURM_", "SM_", "SAGEMAKER_"))}
    if venv is not None:
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(venv)
    return env


def source_copy(dest: Path) -> Path:
    """This checkout's files as a clone has them (tracked, and new files not ignored), so the install builds from
    what would be committed, and writes no build/ or egg-info into the checkout."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file() and not src.is_symlink():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


@contextlib.contextmanager
def locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory):
    """(venv, seconds its install took, whether it was made anew)."""
    torch_pin = next(d for d in dependencies() if d.replace(" ", "").startswith("torch=="))
    key = hashlib.sha256(json.dumps([sys.version_info[:2], dependencies()]).encode()).hexdigest()[:12]
    venv = ROOT_DIR / f"py{sys.version_info[0]}{sys.version_info[1]}-{key}"
    t0 = time.perf_counter()
    with locked(ROOT_DIR / "lock"):
        fresh = os.environ.get("ZERORUN_USER_VENV_FRESH") == "1" or not (venv / ".complete").is_file()
        if fresh:
            for old in ROOT_DIR.glob("py*-*"):  # this one, or one for a dependency list of the past (1.6 GB each)
                shutil.rmtree(old, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=user_env())
            pip(venv, "install", torch_pin)  # first and pinned, as the Makefile does: else pip takes CUDA torch
        src = source_copy(tmp_path_factory.mktemp("src"))
        pip(venv, "install", str(src))  # no extras: what `pip install zerorun` gives a user
        (venv / ".complete").write_text(json.dumps(dependencies()))
        for extra in ("pytest", "tensorboard", "hypothesis"):  # test extras stay out
            assert not (venv / "bin" / extra).exists() and not list(
                (venv / "lib").glob(f"python*/site-packages/{extra}")), f"{extra} is in the user's venv"
    return venv, time.perf_counter() - t0, fresh


def config_only_dir(path: Path, model: str) -> Path:
    import transformers

    cls, kwargs = CONFIGS[model]
    getattr(transformers, cls)(**kwargs).save_pretrained(str(path))
    assert sorted(p.name for p in path.iterdir()) == ["config.json"]
    return path


def shm_op(venv: Path) -> Path:
    """Where the user venv's ranks would build DeepSpeed's shm comm op (zerorun.launcher.extensions_dir there)."""
    key = hashlib.sha1(str(venv).encode()).hexdigest()[:10]
    return Path("~/.cache/zerorun/torch_extensions").expanduser() / key / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"


ALL = os.environ.get("ZERORUN_USER_INSTALL_ALL") == "1"


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("model", [
    "gpt2",
    # ~1 min more: `make test-user-install` runs it; `make test` runs the GPT-2 job, the same install and code path.
    pytest.param("llama", marks=pytest.mark.skipif(not ALL, reason="make test-user-install runs the Llama job")),
])
def test_a_config_json_alone_trains_in_a_users_install(user_venv, tmp_path, model):
    venv, install_s, fresh = user_venv
    ckpt = config_only_dir(tmp_path / f"tiny-{model}", model)
    work, run_dir = tmp_path / "work", tmp_path / "work" / "run"
    work.mkdir()
    env = {**user_env(venv), "ZERORUN_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    op_before = shm_op(venv).stat().st_mtime if shm_op(venv).is_file() else None
    t0 = time.perf_counter()
    proc = subprocess.run([str(venv / "bin" / "zerorun"), "+model=hf", f"model.name_or_path={ckpt}",
                           f"trainer.max_steps={STEPS}", "trainer.warmup_steps=1", "trainer.lr=3e-3",
                           "launcher.nproc_per_node=2", f"hydra.run.dir={run_dir}"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=1500)
    job_s = time.perf_counter() - t0
    text = proc.stdout + proc.stderr
    print("".join(ln + "\n" for ln in text.splitlines() if ln.startswith("zerorun:")))
    print(f"\nuser install: venv {'made' if fresh else 'reused'} + zerorun installed in {install_s:.0f} s; "
          f"{model} job {job_s:.0f} s (exit {proc.returncode})")
    assert proc.returncode == 0, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    metrics = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert summary["final_loss"] < summary["first_loss"], summary
    prepared = json.loads((run_dir / "prepared.json").read_text())
    assert prepared["vocab_size"] <= 1000  # a tokenizer sized to the model's vocabulary, made here
    # No op to build: CPU ranks skip DeepSpeed's shm comm op (train.trainer.init_distributed), so nothing is
    # compiled before the ranks start and no rank compiles it (a venv that built it before keeps it untouched).
    assert re.findall(r"building DeepSpeed's (\S+) op", text) == [], text[-4000:]
    if op_before:
        assert shm_op(venv).stat().st_mtime == op_before, "a rank rebuilt the shm comm op"
    else:
        assert not shm_op(venv).exists(), "a rank compiled the shm comm op"
