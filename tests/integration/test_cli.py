"""The zerorun and zerorun-estimate commands in-process (cli.main(argv) -> exit code): every bad input is
one clear message and exit 2 with nothing written, and ranks never see Hydra's argv."""
import json
import shlex

import pytest

from zerorun import cli, estimate_cli

BAD = [
    # (id, overrides, text the message must contain)
    ("unknown-group-option", ["zero=stage5"], "Could not find 'zero/stage5'"),
    ("unknown-model", ["+model=gpt3"], "Could not find 'model/gpt3'"),
    ("key-typo", ["trainer.max_step=3"], "unknown key trainer.max_step (did you mean trainer.max_steps?)"),
    ("key-typo-appended", ["+trainer.max_step=3"], "max_step"),
    ("wrong-type", ["trainer.micro_batch_size=two"], "micro_batch_size"),
    ("bad-enum", ["data.format=parquet"], "data.format"),
    ("offload-with-zero0", ["offload=cpu"], "offload=cpu with zero.stage=0"),
    ("param-offload-below-stage3", ["zero=stage2", "offload=cpu", "offload.params=true"],
     "offload.params=true with zero.stage=2"),
    ("nvme-below-stage3", ["zero=stage2", "offload=nvme"], "offload=nvme with zero.stage=2"),
    ("nvme-unwritable-path", ["zero=stage3", "offload=nvme", "offload.nvme_path=/etc/hostname/nvme"],
     "offload.nvme_path=/etc/hostname/nvme: not a writable directory"),
    ("nvme-path-in-proc", ["zero=stage3", "offload=nvme", "offload.nvme_path=/proc/somewhere"],
     "offload.nvme_path=/proc/somewhere: not a writable directory"),
    ("batch-does-not-divide", ["trainer.micro_batch_size=4", "trainer.global_batch_size=12"],
     "trainer.global_batch_size=12 is not a multiple of micro_batch_size × data-parallel ranks = 4 × 2 = 8"),
    ("seq-len-beyond-positions", ["data.seq_len=512"], "data.seq_len=512 exceeds model.max_positions=256"),
    ("fp16-and-bf16", ["precision=fp16", "+deepspeed.bf16.enabled=true"], "fp16 and bf16 cannot both be enabled"),
    ("fp16-scale-power", ["precision=fp16", "precision.initial_scale_power=-3"], "precision.initial_scale_power=-3"),
    ("auto-left-in-overrides", ["+deepspeed.gradient_clipping=auto"], 'deepspeed.gradient_clipping="auto"'),
    ("pretrained-offline", ["+model=gpt2", "model.pretrained=true"], "model.pretrained=false"),
    ("missing-data-file", ["data.path=/nonexistent/file.txt"], "data.path=/nonexistent/file.txt: no such file"),
    ("gate-refusal", ["+model=gpt2-large", "data.seq_len=1024", "hardware.gpus_per_node=2", "hardware.gpu_mem_gib=16"],
     "memory: gpt2-large ZeRO-0 offload none fp32 micro 8 × seq 1024 on 2 rank(s) needs"),
    ("too-few-sequences", ["data.synthetic_docs=20", "data.seq_len=256", "trainer.micro_batch_size=64"],
     "training sequences are too few for one global batch of 128"),
]


@pytest.fixture
def zerorun(tmp_path, cache_dir, monkeypatch, capsys):
    monkeypatch.setenv("ZERORUN_CACHE", str(cache_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def run(*overrides, run_dir=None):
        run_dir = run_dir or tmp_path / "run"
        code = cli.main([*overrides, "launcher.nproc_per_node=2", f"hydra.run.dir={run_dir}"])
        captured = capsys.readouterr()
        return code, captured.out + captured.err, run_dir
    return run


@pytest.mark.parametrize("overrides,needle", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_exits_2_with_one_message_and_writes_nothing(zerorun, overrides, needle):
    code, out, run_dir = zerorun(*overrides)
    assert code == 2, out
    assert needle in out, out
    assert "Traceback" not in out and "nothing was launched" in out
    assert not (run_dir / "ds_config.json").exists()


def test_every_problem_is_reported_at_once(zerorun):
    code, out, _ = zerorun("offload=cpu", "data.seq_len=1000", "trainer.global_batch_size=7")
    assert code == 2 and "3 problems" in out
    for needle in ("offload=cpu with zero.stage=0", "data.seq_len=1000", "trainer.global_batch_size=7"):
        assert needle in out


def test_dry_run_writes_the_contract_and_ranks_get_only_the_run_dir(zerorun):
    code, out, run_dir = zerorun("trainer.max_steps=3", "zero=stage2", "trainer.lr=1e-3", "dry_run=true")
    assert code == 0, out
    for name in ("config.yaml", "plan.json", "ds_config.json", "estimate.json", "prepared.json", "command.sh"):
        assert (run_dir / name).is_file(), name
    argv = shlex.split((run_dir / "command.sh").read_text().splitlines()[-1])
    module = argv.index("zerorun.train")
    assert argv[module + 1:] == [str(run_dir.resolve())]  # the rank's whole argv: the run dir
    assert not [a for a in argv if "trainer." in a or "zero=" in a or "1e-3" in a]
    plan, ds = json.loads((run_dir / "plan.json").read_text()), json.loads((run_dir / "ds_config.json").read_text())
    assert (plan["micro_batch_size"], plan["grad_accum_steps"]) == (ds["train_micro_batch_size_per_gpu"],
                                                                   ds["gradient_accumulation_steps"])
    assert not (run_dir / "metrics.jsonl").exists()


def test_nvme_path_is_resolved_into_the_config(zerorun):
    code, out, run_dir = zerorun("zero=stage3", "offload=nvme", "dry_run=true")
    assert code == 0, out
    ds = json.loads((run_dir / "ds_config.json").read_text())
    path = ds["zero_optimization"]["offload_optimizer"]["nvme_path"]
    assert path == str(run_dir / "nvme_swap") and f"nvme_path: {path}" in (run_dir / "config.yaml").read_text()


def test_estimate_composes_and_checks_like_zerorun(capsys):
    assert estimate_cli.main(["trainer.max_step=3"]) == 2
    assert "did you mean trainer.max_steps?" in capsys.readouterr().err
    assert estimate_cli.main(["offload=cpu"]) == 2
    assert "offload=cpu with zero.stage=0" in capsys.readouterr().err
    assert estimate_cli.main(["+model=gpt2-xl", "hardware.gpus_per_node=8", "hardware.gpu_mem_gib=40"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-3  offload nvme (+params)" in out and "gpt2-xl" in out


@pytest.mark.parametrize("hps, words", [
    ({"trainer.lrr": "0.1"}, "unknown key trainer.lrr (did you mean trainer.lr?)"),
    ({"zero": '"stage5'}, "hyperparameter zero = '\"stage5' is not valid JSON"),
    ({"zero": '"stage5"'}, "Could not find 'zero/stage5'"),
])
def test_bad_sagemaker_hyperparameters_exit_2_with_the_failure_file(tmp_path, cache_dir, monkeypatch, capsys,
                                                                     hps, words):
    base = tmp_path / "ml"
    (base / "input" / "config").mkdir(parents=True)
    (base / "input" / "config" / "resourceconfig.json").write_text('{"current_host": "algo-1", "hosts": ["algo-1"]}')
    (base / "input" / "config" / "hyperparameters.json").write_text(json.dumps(hps))
    monkeypatch.setenv("SAGEMAKER_BASE_DIR", str(base))
    monkeypatch.setenv("ZERORUN_CACHE", str(cache_dir))
    code = cli.main(["train"])
    out = capsys.readouterr()
    assert code == 2 and words in out.err and "nothing was launched" in out.err, out.err
    assert words in (base / "output" / "failure").read_text()
    assert not (base / "output" / "data").exists()
