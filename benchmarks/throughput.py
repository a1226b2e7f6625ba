"""zerorun's training speed against what users would otherwise run: the hand-written DeepSpeed loop and HF
Trainer + DeepSpeed, on the same model, shapes, ZeRO stage and ranks.

    python benchmarks/throughput.py [--spec gpt2-4x256|tiny-gpt2|tiny-bert] [--zero 2] [--offload none|cpu]
                                    [--pairs 5] [--steps 20] [--warmup 3] [--systems zerorun,loop,hf]
    python benchmarks/throughput.py --gpus 1 --spec gpt2 --dtype bf16 --steps 60 --warmup 10   # CUDA ranks
    python benchmarks/throughput.py --pairs 3 --steps 33 \
        --systems zerorun,zerorun@glibc,zerorun@glibc-mmap0,zerorun@jemalloc,zerorun@mimalloc,loop,hf   # allocators

The instrument is this script's own clock: every system prints (or, zerorun, appends to metrics.jsonl) one
line per optimizer step, and the time each line appears is taken here; tokens/s = tokens of the steps after
the warm-up / wall time between the warm-up's last line and the last step's. The machine is noisy (2 cores:
±15-40% between runs), so the systems alternate within each round and only the per-round ratios and their
medians mean anything. Figures, not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """A console script of this Python's environment, else the one on PATH (packages installed with --target)."""
    return str(BIN / name) if (BIN / name).exists() else (shutil.which(name) or str(BIN / name))

SPECS = {
    "gpt2-4x256": dict(task="causal_lm", base="tiny-gpt2", num_layers=4, hidden_size=256, num_heads=4,
                       intermediate_size=1024, vocab_size=8192, max_positions=256, seq_len=256, micro_batch=8),
    "tiny-gpt2": dict(task="causal_lm", base="tiny-gpt2", num_layers=2, hidden_size=128, num_heads=4,
                      intermediate_size=512, vocab_size=4096, max_positions=256, seq_len=256, micro_batch=8),
    # GPT-2 small (124M) at a GPU's shape: the CPU specs are launch-bound on a GPU.
    "gpt2": dict(task="causal_lm", base="gpt2", num_layers=12, hidden_size=768, num_heads=12,
                 intermediate_size=3072, vocab_size=50257, max_positions=1024, seq_len=512, micro_batch=16),
    "tiny-bert": dict(task="sequence_classification", base="tiny-bert", num_layers=2, hidden_size=128,
                      num_heads=2, intermediate_size=512, vocab_size=30522, max_positions=256, seq_len=128,
                      micro_batch=16),
}


def rank_env(gpus: int = 0) -> Dict[str, str]:
    if gpus:  # GPU ranks: the environment as the user has it, with an arch list DeepSpeed's JIT can parse
        from zerorun.ops import deepspeed_arch_list

        arch = {"TORCH_CUDA_ARCH_LIST": deepspeed_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
                } if os.environ.get("TORCH_CUDA_ARCH_LIST") else {}
        return {**os.environ, **arch, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    # Both baselines get what zerorun gives its ranks for threads (2 ranks on 2 cores); nothing else.
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


def zerorun_args(spec: Dict, run_dir: Path) -> List[str]:
    return [f"+model={spec['base']}", *(f"model.{k}={spec[k]}" for k in ("num_layers", "hidden_size", "num_heads",
                                                                           "intermediate_size", "vocab_size",
                                                                           "max_positions")),
            f"data.seq_len={spec['seq_len']}", f"trainer.micro_batch_size={spec['micro_batch']}",
            f"zero=stage{spec['zero']}", f"offload={spec['offload']}", f"precision={spec['dtype']}",
            f"trainer.max_steps={spec['steps']}", "trainer.grad_clip=0", "trainer.weight_decay=0",
            "trainer.lr_schedule=constant", "trainer.warmup_steps=0", "trainer.lr=2e-4", "trainer.export=false",
            "trainer.progress=false", f"launcher.nproc_per_node={spec['ranks']}", *spec.get("extra", []), f"hydra.run.dir={run_dir}"]


def step_times(cmd: List[str], env: Dict[str, str], metrics: Path = None, timeout: float = 1800,
               steps: int = 0) -> Dict[int, float]:
    """Run ``cmd``; the monotonic time each step's line appeared (stdout ``step N``, or a metrics.jsonl line).
    A non-zero exit after all ``steps`` were seen is reported, not fatal (the HF Trainer baseline sometimes
    aborts in gloo's teardown, "terminate called without an active exception", after its last step)."""
    seen: Dict[int, float] = {0: time.monotonic()}  # 0: the command started (start-up = seen[1] - seen[0])
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: List[str] = []
    done = threading.Event()

    def watch_metrics():
        while not done.is_set():
            if metrics is not None and metrics.is_file():
                for line in metrics.read_text().splitlines():
                    if line.strip():
                        try:
                            step = json.loads(line)["step"]
                        except ValueError:
                            continue  # a line being written
                        seen.setdefault(step, time.monotonic())
            time.sleep(0.01)

    watcher = threading.Thread(target=watch_metrics, daemon=True)
    watcher.start()
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        words = line.split()
        if metrics is None and len(words) >= 2 and words[0] == "step" and words[1].isdigit():
            seen.setdefault(int(words[1]), time.monotonic())
        if time.monotonic() > deadline:
            proc.kill()
    proc.wait()
    time.sleep(0.05)
    done.set()
    if proc.returncode != 0:
        if steps and max(seen) >= steps:
            print(f"  ({Path(cmd[0]).name} exited {proc.returncode} after its last step: {tail[-1].strip()})", flush=True)
        else:
            raise RuntimeError(f"{cmd[0]} exited {proc.returncode}:\n{''.join(tail)}")
    return seen


VARIANTS = {
    "tcmalloc": ["launcher.allocator=tcmalloc"], "jemalloc": ["launcher.allocator=jemalloc"],
    "mimalloc": ["launcher.allocator=mimalloc"],
    "glibc": ["launcher.allocator=glibc", "launcher.mmap_threshold_mib=1"],  # #25's default
    "glibc-mmap0": ["launcher.allocator=glibc", "launcher.mmap_threshold_mib=0"],
    "glibc-mmap32": ["launcher.allocator=glibc", "launcher.mmap_threshold_mib=32"],
    "fused-loss": ["trainer.fused_loss=true"],  # the head and loss a chunk of tokens at a time
    "stock-dropout": ["trainer.fast_dropout_masks=false"],  # PyTorch's serial CPU bernoulli_ for the masks
    "mkl-fast-mm": ["launcher.mkl_fast_mm=true"],  # MKL keeps its GEMM buffers (tcmalloc ranks free them per call)
    # GPU ranks: what zerorun sets that the hand-written loop does not (the suspects of its 0.89x on an H200)
    "fixed-segments": ["launcher.expandable_segments=false"],
    "ds-buckets": ["zero.reduce_bucket_size=500000000", "zero.allgather_bucket_size=500000000"],
}
"""``zerorun@NAME`` systems: zerorun with one setting pinned (its CPU ranks' allocator and glibc's mmap mode, the fused
loss, a GPU rank's allocator or buckets); ``zerorun`` alone runs its defaults."""


def run(system: str, spec: Dict) -> Tuple[float, float, float]:
    """Tokens/s of one run of ``system`` over the steps after the warm-up, its start-up: seconds from the
    command to the first step's line (zerorun: config, gate, data, run dir, launcher, ranks, model), and for
    zerorun the largest rank's peak RSS in MiB (the kernel's VmHWM, from summary.json; 0 for the baselines)."""
    with tempfile.TemporaryDirectory() as tmp:
        if system.split("@")[0] == "zerorun":
            run_dir = Path(tmp) / "run"
            extra = VARIANTS[system.split("@")[1]] if "@" in system else []
            seen = step_times([tool("zerorun"), *zerorun_args(spec, run_dir), *extra], dict(os.environ),
                              metrics=run_dir / "metrics.jsonl")
            summary = json.loads((run_dir / "summary.json").read_text())
            rss = max(r["peak_rss_bytes"] for r in summary["peak_memory"]) / 2**20
        else:
            rss = 0.0
            script = ROOT / "benchmarks" / "baselines" / ("handwritten_loop.py" if system == "loop" else
                                                          "hf_trainer_loop.py")
            port = str(29700 + os.getpid() % 200)
            seen = step_times([tool("deepspeed"), "--num_gpus", str(spec["ranks"]), "--master_port", port,
                               str(script), "--spec", json.dumps(spec)], rank_env(spec["gpus"]), steps=spec["steps"])
    w, n = spec["warmup"], spec["steps"]
    if w not in seen or n not in seen:
        raise RuntimeError(f"{system}: steps {w} and {n} not both seen ({sorted(seen)})")
    tokens = (n - w) * spec["micro_batch"] * spec["seq_len"] * spec["ranks"]
    return tokens / (seen[n] - seen[w]), seen[1] - seen[0], rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="gpt2-4x256", choices=sorted(SPECS))
    ap.add_argument("--zero", type=int, default=2)
    ap.add_argument("--offload", default="none", choices=["none", "cpu"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--pairs", type=int, default=5, help="rounds; each runs every system once, in rotated order")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--systems", default="zerorun,loop,hf",
                    help="zerorun (its defaults), zerorun@" + "|".join(VARIANTS) + ", loop, hf")
    ap.add_argument("--gpus", type=int, default=0, help="CUDA ranks (one per GPU); default 2 CPU ranks")
    ap.add_argument("--zerorun-args", default="", help="extra zerorun overrides (space-separated), to try a change")
    a = ap.parse_args()
    spec = {**SPECS[a.spec], "extra": a.zerorun_args.split(), "zero": a.zero, "offload": a.offload, "dtype": a.dtype, "steps": a.steps,
            "warmup": a.warmup, "gpus": a.gpus, "ranks": a.gpus or 2}
    systems = a.systems.split(",")
    results: Dict[str, List[float]] = {s: [] for s in systems}
    startup: Dict[str, List[float]] = {s: [] for s in systems}
    peak: Dict[str, List[float]] = {s: [] for s in systems}
    print(f"{a.spec} ZeRO-{a.zero} offload {a.offload} {a.dtype}, {f'{a.gpus} GPU' if a.gpus else '2 CPU'} ranks, micro-batch {spec['micro_batch']} × "
          f"seq {spec['seq_len']}, steps {a.warmup + 1}-{a.steps} timed", flush=True)
    for r in range(a.pairs):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for s in order:
            speed, start, rss = run(s, spec)
            results[s].append(speed)
            startup[s].append(start)
            peak[s].append(rss)
        print(f"round {r + 1}: " + ", ".join(f"{s} {results[s][-1]:,.0f}" for s in systems) + " tokens/s", flush=True)
    print()
    print(f"{'system':20s} {'median tokens/s':>16s} {'min':>8s} {'max':>8s} {'start-up s (median)':>20s} "
          f"{'peak RSS/rank MiB':>18s}")
    for s in systems:
        v = results[s]
        rss = f"{min(peak[s]):,.0f}-{max(peak[s]):,.0f}" if max(peak[s]) else "-"
        print(f"{s:20s} {statistics.median(v):16,.0f} {min(v):8,.0f} {max(v):8,.0f} "
              f"{statistics.median(startup[s]):20.1f} {rss:>18s}")
    for z in [s for s in systems if s.startswith("zerorun")]:
        for other in [s for s in systems if s != z and (s in ("loop", "hf") or z == "zerorun")]:
            ratios = [a / b for a, b in zip(results[z], results[other])]
            print(f"{z} / {other}: median {statistics.median(ratios):.2f}x (rounds: "
                  + ", ".join(f"{x:.2f}" for x in ratios) + ")")


if __name__ == "__main__":
    main()
