"""The traces zerorun ships for its model files (zerorun/arch/shipped_traces.json): current and true."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_no_shipped_model_file_estimate_traces_and_fresh_traces_equal_the_shipped(tmp_path):
    # One process: every model file's estimates with the shipped file (a key it lacks would be traced and written
    # to the cache: stale), then qwen3-8b's (a traced family: census, depths, traces) afresh, entry by entry.
    env = {**os.environ, "ZERORUN_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "zerorun.ship_traces", "--check", "qwen3-8b"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "not shipped: 0 " in out.stdout and "differing from the shipped: 0 " in out.stdout, out.stdout
    fresh = int(out.stdout.split("traced afresh for qwen3-8b: ")[1].split(",")[0])
    assert fresh >= 10, out.stdout  # its census, depths and traces were compared, not an empty set
