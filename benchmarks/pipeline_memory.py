"""Per-stage memory of parallel=pipeline: zerorun's estimate against what each stage's rank measures.

Runs ``zerorun parallel=pipeline parallel.stages=2`` on 2 CPU ranks for each configuration below with
ZERORUN_TRACK_MEMORY=1 (every rank counts its live tensor bytes from before the model is built; see
zerorun.train), then prints, per stage, the estimate's allocator peak (process runtime excluded: it is
a calibration constant, not a tensor) next to the measured peak of live tensor bytes, and the model
states (parameters + fp32 master + optimizer states) DeepSpeed holds against the estimate's.
Not a test (a few minutes); tests/e2e/test_pipeline_parity.py checks one configuration.

    .venv/bin/python benchmarks/pipeline_memory.py            # tiny GPT-2 / BERT matrix
    .venv/bin/python benchmarks/pipeline_memory.py --real     # + GPT-2 small (124M), 2 stages
    .venv/bin/python benchmarks/pipeline_memory.py --decoders  # Llama-class decoders instead (tiny Llama, Qwen2)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from memory_harness import pipeline_stage_rows  # noqa: E402

BIN = Path(sys.executable).parent

COMMON = ["parallel=pipeline", "parallel.stages=2", "launcher.nproc_per_node=2", "trainer.max_steps=2",
          "trainer.progress=false", "trainer.save_every=0", "trainer.eval_every=0", "trainer.export=false",
          "gate=off"]


def long_texts(path: Path, rows: int = 400) -> Path:
    """Classification rows longer than any seq_len here: BERT batches are padded to their longest row,
    so the built-in sentiment set (short reviews) would never reach data.seq_len."""
    import random

    rng = random.Random(0)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    with path.open("w") as f:
        for i in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(600)), "label": i % 2}) + "\n")
    return path


WIDE = ["model.num_layers=4", "model.hidden_size=256", "model.intermediate_size=704"]
DECODERS = [  # zerorun/arch/pipe_decoder.py: tiny Llama (untied head), tiny Qwen2 (q/k/v biases, tied head)
    ["+model=tiny-llama", "precision=bf16", "trainer.micro_batch_size=4", "trainer.global_batch_size=16",
     "data.seq_len=128"],
    ["+model=tiny-llama", "precision=fp32", "trainer.activation_checkpointing=true", "trainer.micro_batch_size=4",
     "trainer.global_batch_size=16", "data.seq_len=128"],
    ["+model=tiny-qwen2", "precision=bf16", "trainer.micro_batch_size=4", "trainer.global_batch_size=16",
     "data.seq_len=128"],
    ["+model=tiny-llama", *WIDE, "precision=fp32", "trainer.micro_batch_size=4", "trainer.global_batch_size=16",
     "data.seq_len=256"],
    ["+model=tiny-qwen2", *WIDE, "precision=bf16", "trainer.activation_checkpointing=true",
     "trainer.micro_batch_size=4", "trainer.global_batch_size=16", "data.seq_len=256"],
    ["+model=tiny-llama", *WIDE, "zero=stage1", "precision=fp32", "trainer.activation_checkpointing=true",
     "trainer.micro_batch_size=2", "trainer.global_batch_size=8", "data.seq_len=512"],
    ["+model=tiny-qwen2", *WIDE, "zero=stage1", "precision=fp32", "trainer.micro_batch_size=4",
     "trainer.global_batch_size=16", "data.seq_len=256"],
]


def matrix(real: bool, texts: Path, decoders: bool = False) -> List[List[str]]:
    if decoders:
        return list(DECODERS)
    runs = []
    for model in ("tiny-gpt2", "tiny-bert"):
        for dtype in ("fp32", "bf16"):
            for ckpt in ("false", "true"):
                for micro_batches, seq in ((4, 128), (2, 256)):
                    data = [f"data.path={texts}", "data.name=long"] if model == "tiny-bert" else []
                    runs.append([f"+model={model}", f"precision={dtype}", f"trainer.activation_checkpointing={ckpt}",
                                 "trainer.micro_batch_size=4", f"trainer.global_batch_size={4 * micro_batches}",
                                 f"data.seq_len={seq}", *data])
    runs.append(["+model=tiny-gpt2", "zero=stage1", "precision=bf16", "trainer.micro_batch_size=4",
                 "trainer.global_batch_size=16", "data.seq_len=128"])
    if real:
        runs.append(["+model=gpt2", "precision=fp32", "trainer.micro_batch_size=1", "trainer.global_batch_size=2",
                     "data.seq_len=128", "trainer.max_steps=1"])
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", action="store_true", help="also GPT-2 small (124M parameters)")
    ap.add_argument("--decoders", action="store_true", help="Llama-class decoders (tiny Llama, tiny Qwen2) instead")
    ap.add_argument("--only", default="", help="run only configurations whose overrides contain this text")
    args = ap.parse_args()
    env = dict(os.environ, ZERORUN_TRACK_MEMORY="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    errors = []
    print(f"{'configuration':<78} {'stage':>5} {'in-flight':>9} {'estimate':>10} {'measured':>10} {'error':>7}"
          f"  {'states est/measured':>22}  peak phase")
    with tempfile.TemporaryDirectory() as tmp:
        texts = long_texts(Path(tmp) / "long.jsonl")
        for i, overrides in enumerate(matrix(args.real, texts, args.decoders)):
            if args.only and args.only not in " ".join(overrides):
                continue
            run_dir = Path(tmp) / f"run{i}"
            t0 = time.time()
            proc = subprocess.run([str(BIN / "zerorun"), *COMMON, *overrides, f"hydra.run.dir={run_dir}"],
                                  cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if proc.returncode != 0:
                log = Path(tempfile.gettempdir()) / f"pipeline_memory_failed_{i}.log"
                log.write_text(proc.stdout)
                print(f"{' '.join(overrides)}: FAILED (exit {proc.returncode}); full output in {log}\n"
                      f"{proc.stdout[-2000:]}")
                return 1
            for row in pipeline_stage_rows(run_dir):
                err = (row["est"] - row["measured"]) / row["measured"]
                errors.append(err)
                label = " ".join(o.split("=", 1)[1] if o.startswith(("+model", "precision")) else o.split(".")[-1]
                                 for o in overrides if not o.startswith("data.path") and "=long" not in o)
                label = label.replace("activation_checkpointing", "ckpt").replace("micro_batch_size", "micro")
                print(f"{label[:78]:<78} {row['stage']:>5} {row['in_flight']:>9} {row['est'] / 2**20:>8.2f}Mi"
                      f" {row['measured'] / 2**20:>8.2f}Mi {err:>+7.1%}  {row['states_est']:>10}/{row['states_measured']:<11}"
                      f"  {row['phase']}  ({time.time() - t0:.0f} s)", flush=True)
    absolute = [abs(e) for e in errors]
    print(f"\n{len(errors)} stages: median |error| {statistics.median(absolute):.1%}, worst {max(absolute):.1%}, "
          f"largest under-estimate {max([-e for e in errors] + [0]):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
