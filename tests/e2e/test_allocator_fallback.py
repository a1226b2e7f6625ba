"""launcher.allocator in real runs: the fallback chain when tcmalloc (then jemalloc) is missing goes on with the next
allocator, says so in one line, and the figure printed, estimate.json and summary.json are that allocator's."""
import json

import pytest

from helpers import run_zerorun
from zerorun import allocators
from zerorun.config import Allocator

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ARGS = ["+model=tiny-gpt2", "launcher.nproc_per_node=1", "trainer.max_steps=2", "trainer.export=false",
        "data.seq_len=64", "trainer.progress=false", "trainer.save_every=0"]


def _run(tmp_path, cache_dir, name, dirs):
    rd = tmp_path / name
    proc = run_zerorun(ARGS, rd, cache_dir, env_extra={allocators.SEARCH_ENV: dirs, "LD_PRELOAD": ""})
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "allocator:" in line]
    summary = json.loads((rd / "summary.json").read_text())
    estimate = json.loads((rd / "estimate.json").read_text())
    return lines, summary, estimate


def test_without_tcmalloc_jemalloc_runs_and_without_either_glibc(tmp_path, cache_dir):
    jemalloc = allocators.find_library(Allocator.jemalloc)
    if not jemalloc:
        pytest.skip("libjemalloc2 is not installed here (make test's system-deps installs it)")
    only_jemalloc = tmp_path / "libs"
    only_jemalloc.mkdir()
    (only_jemalloc / "libjemalloc.so.2").symlink_to(jemalloc)
    empty = tmp_path / "none"
    empty.mkdir()

    lines, summary, estimate = _run(tmp_path, cache_dir, "jemalloc", str(only_jemalloc))
    assert len(lines) == 1 and "jemalloc" in lines[0] and "tcmalloc is not installed" in lines[0], lines
    assert summary["allocator"] == "jemalloc"  # read from the rank's own mappings: it really ran
    assert estimate["config"]["allocator"] == "jemalloc"

    lines, summary, estimate = _run(tmp_path, cache_dir, "glibc", str(empty))
    assert len(lines) == 1 and "allocator: glibc" in lines[0], lines
    assert "tcmalloc is not installed" in lines[0] and "apt-get install libtcmalloc-minimal4" in lines[0]
    assert summary["allocator"] == "glibc" and estimate["config"]["allocator"] == "glibc"
