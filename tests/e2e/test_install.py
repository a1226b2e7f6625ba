"""conf/ ships inside the wheel: a regular (non-editable) install works outside the checkout."""
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, base_env

pytestmark = pytest.mark.e2e


def test_wheel_install_finds_its_configs(tmp_path, cache_dir):
    dist, site = tmp_path / "dist", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(ROOT)], check=True, capture_output=True)
    wheel = next(dist.glob("zerorun-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = base_env(cache_dir)
    env["PYTHONPATH"] = str(site)  # the wheel's copy, ahead of the editable checkout
    where = subprocess.run([sys.executable, "-c", "import zerorun.conf as c; print(c.__file__)"], env=env,
                           cwd=outside, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(site), where
    run_dir = outside / "run"
    proc = subprocess.run([sys.executable, "-m", "zerorun.cli", "+model=gpt2-medium", "zero=stage3", "offload=cpu",
                           "dry_run=true", "hardware.host_mem_gib=64",  # the gate plans for a declared host, so
                           # what else runs on this one (a benchmark beside the suite) cannot refuse the dry run
                           f"hydra.run.dir={run_dir}"], env=env, cwd=outside,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "gpt2-medium" in (run_dir / "config.yaml").read_text()
    assert '"stage": 3' in (run_dir / "ds_config.json").read_text()
