"""A corpus of hostile inputs, each run through the real ``zerorun`` in-process (cli.main): config values, paths,
platform environment, data files and run dirs. Every one must end the same way: exit 2, one error line that names
the key, variable or path, "nothing was launched", no traceback, and nothing written where the run would go."""
import os
from pathlib import Path

import pytest

from zerorun import cli

# (id, overrides, environment, text the error line must contain). {file}, {dir}, {empty_dir}, {tmp} are filled in.
VALUES = [
    ("lr-nan", ["trainer.lr=nan"], {}, "trainer.lr=nan"),
    ("lr-inf", ["trainer.lr=inf"], {}, "trainer.lr=inf"),
    ("lr-1e400", ["trainer.lr=1e400"], {}, "trainer.lr=inf"),
    ("lr-negative", ["trainer.lr=-1e-3"], {}, "trainer.lr=-0.001"),
    ("lr-zero", ["trainer.lr=0"], {}, "trainer.lr=0"),
    ("warmup-negative", ["trainer.warmup_steps=-1"], {}, "trainer.warmup_steps=-1"),
    ("max-steps-zero", ["trainer.max_steps=0"], {}, "trainer.max_steps=0"),
    ("max-steps-word", ["trainer.max_steps=abc"], {}, "trainer.max_steps"),
    ("micro-batch-zero", ["trainer.micro_batch_size=0"], {}, "trainer.micro_batch_size=0"),
    ("micro-batch-float", ["trainer.micro_batch_size=1.5"], {}, "trainer.micro_batch_size"),
    ("global-batch-zero", ["trainer.global_batch_size=0"], {}, "trainer.global_batch_size=0"),
    ("betas-one", ["trainer.adam_betas=[0.9,1.0]"], {}, "trainer.adam_betas"),
    ("betas-short", ["trainer.adam_betas=[0.9]"], {}, "trainer.adam_betas"),
    ("betas-nan", ["trainer.adam_betas=[nan,0.99]"], {}, "trainer.adam_betas"),
    ("weight-decay-negative", ["trainer.weight_decay=-0.1"], {}, "trainer.weight_decay=-0.1"),
    ("grad-clip-negative", ["trainer.grad_clip=-1"], {}, "trainer.grad_clip=-1"),
    ("min-lr-ratio-above-1", ["trainer.min_lr_ratio=1.5"], {}, "trainer.min_lr_ratio=1.5"),
    ("keep-last-zero", ["trainer.keep_last=0"], {}, "trainer.keep_last=0"),
    ("save-every-negative", ["trainer.save_every=-2"], {}, "trainer.save_every=-2"),
    ("eval-every-negative", ["trainer.eval_every=-1"], {}, "trainer.eval_every=-1"),
    ("oom-retries-negative", ["trainer.oom_retries=-1"], {}, "trainer.oom_retries=-1"),
    ("backoff-negative", ["trainer.restart_backoff_s=-3"], {}, "trainer.restart_backoff_s=-3"),
    ("collective-timeout-zero", ["trainer.collective_timeout_s=0"], {}, "trainer.collective_timeout_s=0"),
    ("momentum-one", ["optimizer=sgd", "optimizer.momentum=1.0"], {}, "optimizer.momentum=1.0"),
    ("momentum-negative", ["optimizer=sgd", "optimizer.momentum=-0.1"], {}, "optimizer.momentum=-0.1"),
    ("port-zero", ["launcher.master_port=0"], {}, "launcher.master_port=0"),
    ("port-too-big", ["launcher.master_port=70000"], {}, "launcher.master_port=70000"),
    ("nproc-zero", ["launcher.nproc_per_node=0"], {}, "launcher.nproc_per_node=0"),
    ("nnodes-zero", ["launcher.nnodes=0"], {}, "launcher.nnodes=0"),
    ("node-rank-negative", ["launcher.node_rank=-1"], {}, "launcher.node_rank=-1"),
    ("join-timeout-zero", ["launcher.join_timeout_s=0"], {}, "launcher.join_timeout_s=0"),
    ("master-addr-empty", ["launcher.master_addr=''"], {}, "launcher.master_addr"),
    ("seq-len-zero", ["data.seq_len=0"], {}, "data.seq_len=0"),
    ("val-fraction-one", ["data.val_fraction=1.0"], {}, "data.val_fraction=1.0"),
    ("val-fraction-nan", ["data.val_fraction=nan"], {}, "data.val_fraction=nan"),
    ("synthetic-docs-zero", ["data.synthetic_docs=0"], {}, "data.synthetic_docs=0"),
    ("tokenizer-vocab-tiny", ["data.tokenizer_vocab=10"], {}, "data.tokenizer_vocab=10"),
    ("text-column-empty", ["data.text_column=''"], {}, "data.text_column"),
    ("dropout-one", ["model.dropout=1.0"], {}, "model.dropout=1.0"),
    ("layers-zero", ["model.num_layers=0"], {}, "model.num_layers=0"),
    ("hidden-negative", ["model.hidden_size=-1"], {}, "model.hidden_size=-1"),
    ("seed-negative", ["seed=-1"], {}, "seed=-1"),
    ("seed-too-big", ["seed=4294967296"], {}, "seed=4294967296"),
    ("bucket-zero", ["zero=stage2", "zero.reduce_bucket_size=0"], {}, "zero.reduce_bucket_size=0"),
    ("gpu-mem-negative", ["hardware.gpus_per_node=1", "hardware.gpu_mem_gib=-1"], {}, "hardware.gpu_mem_gib=-1"),
    ("host-mem-nan", ["hardware.host_mem_gib=nan"], {}, "hardware.host_mem_gib=nan"),
    ("num-labels-zero", ["+model=tiny-bert", "task.num_labels=0"], {}, "task.num_labels=0"),
    ("stages-zero", ["parallel=pipeline", "parallel.stages=0"], {}, "parallel.stages=0"),
    ("mmap-too-big", ["launcher.mmap_threshold_mib=64"], {}, "launcher.mmap_threshold_mib=64"),
    ("huge-int", ["trainer.max_steps=100000000000000000000000"], {}, "trainer.max_steps"),
]
PATHS = [
    ("data-missing", ["data.path=/no/such/corpus.txt"], {}, "data.path=/no/such/corpus.txt: no such file"),
    ("data-is-dir", ["data.path={dir}"], {}, "is a directory, not a file"),
    ("val-missing", ["data.path={file}", "data.val_path=/no/such/val.jsonl"], {}, "data.val_path=/no/such/val.jsonl"),
    ("tokenizer-missing", ["data.tokenizer=/no/such/dir"], {}, "data.tokenizer=/no/such/dir: no such directory"),
    ("tokenizer-is-file", ["data.tokenizer={file}"], {}, "data.tokenizer="),
    ("tokenizer-bad-name", ["data.tokenizer='not a name!'"], {}, "neither a local directory nor a Hugging Face"),
    # A directory without a tokenizer (transformers raised AttributeError or asked for protobuf: issue 34).
    ("tokenizer-empty-dir", ["data.tokenizer={empty_dir}"], {}, "data.tokenizer={empty_dir}: holds no tokenizer"),
    ("tokenizer-config-only", ["data.tokenizer={config_dir}"], {}, "data.tokenizer={config_dir}: holds no tokenizer"),
    ("pretrained-without-tokenizer", ["+model=hf", "model.name_or_path={weights_dir}", "model.pretrained=true"], {},
     "data.tokenizer=auto with model.pretrained=true"),
    ("pretrained-without-weights", ["+model=hf", "model.name_or_path={config_dir}", "model.pretrained=true"], {},
     "a config.json but no weights"),
    ("resume-from-missing", ["trainer.resume_from=/no/such/run"], {}, "trainer.resume_from=/no/such/run"),
    ("resume-from-file", ["trainer.resume_from={file}"], {}, "is a file, not a run dir"),
    ("resume-from-empty", ["trainer.resume_from={empty_dir}"], {}, "no complete checkpoint was found there"),
    ("checkpoint-dir-proc", ["trainer.checkpoint_dir=/proc/zerorun"], {}, "trainer.checkpoint_dir=/proc/zerorun"),
    ("export-dir-under-file", ["trainer.export_dir={file}/export"], {}, "trainer.export_dir="),
    ("cache-dir-proc", ["data.cache_dir=/proc/zerorun-cache"], {}, "data.cache_dir=/proc/zerorun-cache"),
    ("nvme-path-is-file", ["zero=stage3", "offload=nvme", "offload.nvme_path={file}"], {}, "offload.nvme_path="),
    ("hostfile-missing", ["launcher.hostfile=/no/such/hostfile"], {}, "launcher.hostfile=/no/such/hostfile"),
    ("run-dir-proc", ["hydra.run.dir=/proc/zerorun-run"], {}, "hydra.run.dir=/proc/zerorun-run"),
    ("weights-missing", ["model.pretrained=true", "model.name_or_path=/no/such/model"], {},
     "model.name_or_path=/no/such/model"),
    ("used-run-dir", ["hydra.run.dir={used_run}"], {}, "trainer.resume=true"),
    # A named pipe blocks the first read until something writes to it: each file input is refused by its kind.
    ("data-fifo", ["data.path={fifo}"], {}, "data.path={fifo}: is a named pipe (FIFO), not a regular file"),
    ("val-fifo", ["data.path={file}", "data.val_path={fifo}"], {}, "data.val_path={fifo}: is a named pipe"),
    ("hostfile-fifo", ["launcher.hostfile={fifo}"], {}, "launcher.hostfile={fifo}: is a named pipe"),
    ("tokenizer-fifo", ["data.tokenizer={fifo}"], {}, "data.tokenizer={fifo}: is a named pipe"),
    ("resume-from-fifo", ["trainer.resume_from={fifo}"], {}, "trainer.resume_from={fifo}: is a named pipe"),
    ("checkpoint-dir-fifo", ["trainer.checkpoint_dir={fifo}"], {}, "trainer.checkpoint_dir={fifo}: not a writable"),
    ("data-char-device", ["data.path=/dev/zero"], {}, "data.path=/dev/zero: is a character device"),
    # ~user of a user this machine does not know (Path.expanduser raised "Could not determine home directory").
    ("val-unknown-user", ["data.path={file}", "data.val_path='~0'"], {}, "data.val_path=~0: names the home"),
    ("data-unknown-user", ["data.path='~nosuchuser/x'"], {}, "data.path=~nosuchuser/x: names the home"),
    ("export-unknown-user", ["trainer.export_dir='~nosuchuser/out'"], {}, "trainer.export_dir=~nosuchuser/out"),
    ("resume-and-overwrite", ["trainer.resume=true", "trainer.overwrite=true"], {}, "trainer.overwrite=true with"),
    ("resume-from-and-overwrite", ["trainer.resume_from={used_run}", "trainer.overwrite=true"], {},
     "trainer.overwrite=true with trainer.resume_from"),
    ("resume-from-another-model", ["trainer.resume_from={bert_run}"], {}, "another model"),
]
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_JOB_NAME": "t"}
SAGEMAKER = {"SM_TRAINING_ENV": "{}", "SAGEMAKER_BASE_DIR": "{tmp}/opt_ml", "SM_CURRENT_HOST": "algo-1"}
ENVIRONMENT = [
    ("slurm-nnodes-word", [], {**SLURM, "SLURM_NNODES": "abc"}, "SLURM_NNODES='abc'"),
    ("slurm-nodeid-word", [], {**SLURM, "SLURM_NNODES": "2", "SLURM_NODEID": "x"}, "SLURM_NODEID='x'"),
    ("slurm-nodeid-out-of-range", [], {**SLURM, "SLURM_NNODES": "2", "SLURM_NODEID": "5",
                                       "SLURM_JOB_NODELIST": "n[1-2]"}, "SLURM_NODEID='5'"),
    ("slurm-nodelist-range", [], {**SLURM, "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[a-b]"}, "SLURM_JOB_NODELIST"),
    ("slurm-restart-count", [], {**SLURM, "SLURM_RESTART_COUNT": "z"}, "SLURM_RESTART_COUNT='z'"),
    ("slurm-tasks-word", [], {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "x"}, "SLURM_STEP_TASKS_PER_NODE='x'"),
    ("slurm-two-tasks", [], {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2"}, "SLURM_STEP_TASKS_PER_NODE"),
    ("sagemaker-gpus-word", [], {**SAGEMAKER, "SM_NUM_GPUS": "two"}, "SM_NUM_GPUS='two'"),
    ("sagemaker-hosts-not-json", [], {**SAGEMAKER, "SM_HOSTS": "algo-1,algo-2"}, "SM_HOSTS"),
    ("sagemaker-hosts-not-list", [], {**SAGEMAKER, "SM_HOSTS": "7"}, "SM_HOSTS"),
    ("sagemaker-hps-list", [], {**SAGEMAKER, "SM_HPS": "[1,2]"}, "SM_HPS"),
    ("sagemaker-port", [], {**SAGEMAKER, "SM_HOSTS": '["algo-1","algo-2"]', "SM_MASTER_PORT": "99999"},
     "SM_MASTER_PORT='99999'"),
    ("sagemaker-ranks-started", [], {**SAGEMAKER, "RANK": "0"}, "distribution"),
    ("cache-env-is-file", [], {"ZERORUN_CACHE": "{file}"}, "ZERORUN_CACHE={file}"),
    ("cache-env-unknown-user", [], {"ZERORUN_CACHE": "~nosuchuser/cache"}, "ZERORUN_CACHE=~nosuchuser/cache"),
]
FILES = [
    ("data-empty", ["data.path={tmp}/empty.txt"], {}, "empty.txt"),
    ("data-bad-jsonl", ["+model=tiny-bert", "data.path={tmp}/bad.jsonl"], {}, "bad.jsonl:2"),
    ("data-csv-no-column", ["+model=tiny-bert", "data.path={tmp}/rows.csv"], {}, "rows.csv"),
    ("data-unknown-suffix", ["data.path={tmp}/data.parquet"], {}, "data.parquet"),
]
CASES = VALUES + PATHS + ENVIRONMENT + FILES


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)


@pytest.fixture
def places(tmp_path, monkeypatch, cache_dir):
    for k in list(os.environ):
        if k.startswith(("SLURM_", "SM_", "SAGEMAKER_")) or k in ("RANK", "LOCAL_RANK"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("ZERORUN_CACHE", str(cache_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file.txt").write_text("some text\n")
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "config_dir").mkdir()  # a checkpoint's config.json alone: no tokenizer, no weights
    (tmp_path / "config_dir" / "config.json").write_text(
        '{"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000, "n_positions": 128}')
    (tmp_path / "weights_dir").mkdir()  # config.json and weights, no tokenizer
    (tmp_path / "weights_dir" / "config.json").write_text((tmp_path / "config_dir" / "config.json").read_text())
    (tmp_path / "weights_dir" / "model.safetensors").write_bytes(b"")  # never read: the tokenizer check is first
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine", "label": 0}\n{"text": oops\n')
    (tmp_path / "rows.csv").write_text("review,stars\nnice,1\n")
    (tmp_path / "data.parquet").write_bytes(b"PAR1\x00\x01")
    os.mkfifo(tmp_path / "a_fifo")
    used = tmp_path / "used_run" / "checkpoints" / "global_step2"
    used.mkdir(parents=True)
    (used / "COMPLETE").write_text('{"step": 2, "files": {}}')
    return {"file": str(tmp_path / "a_file.txt"), "dir": str(tmp_path / "a_dir"),
            "empty_dir": str(tmp_path / "empty_dir"), "config_dir": str(tmp_path / "config_dir"),
            "weights_dir": str(tmp_path / "weights_dir"), "tmp": str(tmp_path), "used_run": str(tmp_path / "used_run"),
            "fifo": str(tmp_path / "a_fifo"), "bert_run": str(tmp_path / "bert_run")}


def make_bert_run(path):
    """A run dir of tiny-bert with a complete checkpoint: its config.yaml says which model saved it."""
    from omegaconf import OmegaConf

    from zerorun.config import compose, to_run_config

    tag = path / "checkpoints" / "global_step2"
    tag.mkdir(parents=True)
    (tag / "COMPLETE").write_text('{"step": 2, "files": {}}')
    (path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(to_run_config(compose(["+model=tiny-bert"])))))


def fill(text, places):
    for k, v in places.items():
        text = text.replace("{" + k + "}", v)
    return text


@pytest.mark.timeout(120)  # a file input opened before its kind is known (a FIFO) blocks forever
@pytest.mark.parametrize("overrides,env,needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_input_is_one_line_and_exit_2(places, monkeypatch, capsys, overrides, env, needle):
    for k, v in env.items():
        monkeypatch.setenv(k, fill(v, places))
    args = [fill(o, places) for o in overrides]
    if any("{bert_run}" in o for o in overrides):
        make_bert_run(Path(places["bert_run"]))
    run_dir = f"{places['tmp']}/run"
    if not any(a.startswith("hydra.run.dir=") for a in args):
        args.append(f"hydra.run.dir={run_dir}")
    code = cli.main(["launcher.nproc_per_node=2", *args, "dry_run=true"])
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == 2, text[-3000:]
    errors = [line for line in text.splitlines() if "error:" in line]
    assert len(errors) == 1, text[-3000:]
    assert fill(needle, places) in errors[0], text[-3000:]
    assert "Traceback" not in text and "HYDRA_FULL_ERROR" not in text and "nothing was launched" in text
    assert not os.path.exists(f"{run_dir}/ds_config.json")


def test_resume_with_nothing_to_resume_starts_fresh_and_says_so(places, capsys):
    """The requeue idiom: `trainer.resume=true` on every submission; the first finds nothing and starts at 0."""
    run_dir = f"{places['tmp']}/experiment/first"
    code = cli.main(["launcher.nproc_per_node=2", "trainer.resume=true", "name=fresh-experiment", "dry_run=true",
                     f"hydra.run.dir={run_dir}"])
    text = capsys.readouterr().err
    assert code == 0, text[-2000:]
    lines = [line for line in text.splitlines() if "no complete checkpoint" in line]
    assert len(lines) == 1 and "starting from step 0" in lines[0], text[-2000:]
    assert os.path.exists(f"{run_dir}/ds_config.json") and not os.path.exists(f"{run_dir}/resume.json")
