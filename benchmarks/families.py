"""Every family the issue on architectures names, trained from a config.json alone on 2 CPU ranks, full and LoRA.

    python benchmarks/families.py [--types qwen3,gemma2,...] [--steps 8] [--pretrained]

For each model type: a tiny config written by transformers' own config class into an empty directory (no
tokenizer), then `zerorun +model=hf model.name_or_path=DIR` (the built-in synthetic data, a tokenizer sized to
the vocabulary). Printed per run: the exit code a scheduler reads, the first and last loss, the peak RSS of the
busiest rank (VmHWM, summary.json) against the gate's figure and bound (estimate.json), and the wall time.
``--pretrained``: the full run's export is loaded back with ``model.pretrained=true`` from the same directory
layout a user has (config.json + weights, no tokenizer). Figures, not a test (tests/e2e/test_families.py runs two).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "unit"), str(ROOT / "tests")]  # test_traced imports tests/helpers.py
from test_traced import TYPES  # noqa: E402  the tiny configs the unit tests check the trace on

BIN = Path(sys.executable).parent
MIB = 2**20


def write_config(model_type: str, out: Path) -> Path:
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, **dict(TYPES[model_type], vocab_size=2048)).save_pretrained(out)
    return out


def run(overrides, run_dir: Path, steps: int):
    cmd = [str(BIN / "zerorun"), *overrides, f"trainer.max_steps={steps}", "trainer.eval_every=0", "trainer.progress=false",
           "trainer.warmup_steps=1", "trainer.save_every=0", "data.synthetic_docs=1000", "data.seq_len=128",
           "trainer.micro_batch_size=4", "launcher.nproc_per_node=2", f"hydra.run.dir={run_dir}"]
    t0 = time.time()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    wall = time.time() - t0
    if proc.returncode != 0:
        return proc.returncode, wall, None, proc.stdout.strip().splitlines()[-1:] or [""]
    summary = json.loads((run_dir / "summary.json").read_text())
    est = json.loads((run_dir / "estimate.json").read_text())
    peak = max(r["peak_rss_bytes"] for r in summary["peak_memory"])
    return 0, wall, (summary["first_loss"], summary["final_loss"], peak, est["per_rank_peak_bytes"],
                     est.get("per_rank_bound_bytes")), []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(sorted(TYPES)))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pretrained", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="zerorun-families-"))
    print(f"{'type':12s} {'run':10s} {'exit':>4s} {'loss first→last':>17s} {'peak RSS':>9s} {'gate':>9s} {'error':>7s} "
          f"{'bound':>9s} {'wall':>6s}  (MiB)")
    for kind in args.types.split(","):
        src = write_config(kind, work / kind)
        runs = [("full", []), ("lora", ["adapter=lora", "zero=stage2"])]
        for name, extra in runs:
            run_dir = work / f"{kind}-{name}"
            code, wall, fig, tail = run(["+model=hf", f"model.name_or_path={src}", *extra], run_dir, args.steps)
            if fig is None:
                print(f"{kind:12s} {name:10s} {code:4d} {tail[0][:90]}")
                continue
            first, last, peak, point, bound = fig
            print(f"{kind:12s} {name:10s} {code:4d} {first:8.3f}→{last:<8.3f} {peak / MIB:9.1f} {point / MIB:9.1f} "
                  f"{100 * (point - peak) / peak:+6.1f}% {(bound or 0) / MIB:9.1f} {wall:5.0f}s", flush=True)
            if name == "full" and args.pretrained:
                export = next((run_dir / "export").glob("**/config.json"), None)
                if export is None:
                    print(f"{kind:12s} {'pretrained':10s} no export in {run_dir}")
                    continue
                code, wall, fig, tail = run(["+model=hf", f"model.name_or_path={export.parent}",
                                             "model.pretrained=true"], work / f"{kind}-pre", 2)
                print(f"{kind:12s} {'pretrained':10s} {code:4d} " + (f"{fig[0]:8.3f}→{fig[1]:<8.3f}" if fig else tail[0][:90]),
                      flush=True)


if __name__ == "__main__":
    main()
