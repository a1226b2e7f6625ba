import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One tokenized-data cache for the whole session: runs after the first reuse it."""
    return tmp_path_factory.mktemp("zerorun-cache")


def base_env(cache_dir: Path) -> dict:
    env = dict(os.environ)
    env.update(ZERORUN_CACHE=str(cache_dir), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
    return env


def run_zerorun(args, run_dir: Path, cache_dir: Path, *, timeout=1500, env_extra=None, cwd=None):
    """Run the real console script; returns the CompletedProcess (stdout+stderr merged)."""
    env = base_env(cache_dir)
    env.update(env_extra or {})
    cmd = [str(BIN / "zerorun"), *args, f"hydra.run.dir={run_dir}"]
    return subprocess.run(cmd, env=env, cwd=cwd or run_dir.parent, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout, start_new_session=True)


def read_metrics(run_dir: Path):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
