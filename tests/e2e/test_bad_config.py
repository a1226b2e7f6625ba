"""The bad-config corpus: each case exits 2 with one clear message, and nothing is launched."""
import pytest

from conftest import run_zerorun

CASES = [
    # (id, overrides, text the message must contain)
    ("unknown-group-option", ["zero=stage5"], "Could not find 'zero/stage5'"),
    ("unknown-model", ["+model=gpt3"], "Could not find 'model/gpt3'"),
    ("key-typo", ["trainer.max_step=3"], "unknown key trainer.max_step (did you mean trainer.max_steps?)"),
    ("key-typo-appended", ["+trainer.max_step=3"], "max_step"),
    ("wrong-type", ["trainer.micro_batch_size=two"], "micro_batch_size"),
    ("offload-with-zero0", ["offload=cpu"], "offload=cpu with zero.stage=0"),
    ("param-offload-below-stage3", ["zero=stage2", "offload=cpu", "offload.params=true"],
     "offload.params=true with zero.stage=2"),
    ("nvme-below-stage3", ["zero=stage2", "offload=nvme"], "offload=nvme with zero.stage=2"),
    ("nvme-unwritable-path", ["zero=stage3", "offload=nvme", "offload.nvme_path=/etc/hostname/nvme"],
     "offload.nvme_path=/etc/hostname/nvme: not a writable directory"),
    ("batch-does-not-divide", ["trainer.micro_batch_size=4", "trainer.global_batch_size=12"],
     "trainer.global_batch_size=12 is not a multiple of micro_batch_size × data-parallel ranks = 4 × 2 = 8"),
    ("seq-len-beyond-positions", ["data.seq_len=512"], "data.seq_len=512 exceeds model.max_positions=256"),
    ("fp16-and-bf16", ["precision=fp16", "+deepspeed.bf16.enabled=true"], "fp16 and bf16 cannot both be enabled"),
    ("auto-left-in-overrides", ["+deepspeed.gradient_clipping=auto"], 'deepspeed.gradient_clipping="auto"'),
    ("pretrained-offline", ["+model=gpt2", "model.pretrained=true"], "model.pretrained=false"),
]


@pytest.mark.parametrize("overrides,needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_config_exits_2_with_message(tmp_path, cache_dir, overrides, needle):
    run_dir = tmp_path / "run"
    proc = run_zerorun([*overrides, "launcher.nproc_per_node=2"], run_dir, cache_dir, timeout=120)
    assert proc.returncode == 2, proc.stdout
    assert needle in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stdout, proc.stdout
    assert not (run_dir / "ds_config.json").exists()  # nothing rendered, nothing launched


def test_every_problem_is_reported_at_once(tmp_path, cache_dir):
    proc = run_zerorun(["offload=cpu", "data.seq_len=1000", "trainer.global_batch_size=7",
                        "launcher.nproc_per_node=2"], tmp_path / "run", cache_dir, timeout=120)
    assert proc.returncode == 2
    assert "3 problems" in proc.stdout
    for needle in ("offload=cpu with zero.stage=0", "data.seq_len=1000", "trainer.global_batch_size=7"):
        assert needle in proc.stdout
