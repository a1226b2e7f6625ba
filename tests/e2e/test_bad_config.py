"""Bad input through the real console script: the exit code a scheduler reads is 2 and nothing starts.
(The whole bad-input corpus runs in-process in tests/integration/test_cli.py.)"""
import pytest

from helpers import run_zerorun

CASES = [
    ("unknown-group-option", ["zero=stage5"], "Could not find 'zero/stage5'"),
    ("key-typo", ["trainer.max_step=3"], "unknown key trainer.max_step (did you mean trainer.max_steps?)"),
    ("offload-with-zero0", ["offload=cpu"], "offload=cpu with zero.stage=0"),
    ("sweep-with-unknown-option", ["-m", "zero=stage1,stage9"], "Could not find 'zero/stage9'"),
]


@pytest.mark.parametrize("overrides,needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_config_exits_2_with_message(tmp_path, cache_dir, overrides, needle):
    run_dir = tmp_path / "run"
    proc = run_zerorun([*overrides, "launcher.nproc_per_node=2"], run_dir, cache_dir, timeout=120)
    assert proc.returncode == 2, proc.stdout
    assert needle in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stdout, proc.stdout
    assert not (run_dir / "ds_config.json").exists()  # nothing rendered, nothing launched
