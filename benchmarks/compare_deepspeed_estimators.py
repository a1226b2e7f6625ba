"""zerorun's estimate next to DeepSpeed's own model-state estimators, and the estimator's latency.

    python benchmarks/compare_deepspeed_estimators.py

DeepSpeed's ``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs``
(deepspeed/runtime/zero/stage_1_and_2.py, stage3.py) are called with the parameter count directly (the
``_all_live`` variants need a real model and count a meta model as 0). They cover model states only
(memory.md §1.2): GPU = 2Ψ + 18Ψ/N (ZeRO-2), 4·largest layer + 18Ψ/N (ZeRO-3), no activations, buckets,
logits, context. zerorun's "model states" column is its optimizer-step phase without buffers (params,
grads, fp32 master, Adam states and the step's fp32 grad copy: DeepSpeed's "4 grads 32bit" term), plus
for ZeRO-3 the gathered parameters; "peak" is the whole per-GPU estimate at the shape shown.
zero_init=False: zerorun builds random-init models whole on every rank.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's import otherwise probes for CUDA
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import logging  # noqa: E402

from hydra import compose, initialize_config_module  # noqa: E402

from zerorun import memory as M  # noqa: E402
from zerorun.config import GateMode, World, make_plan, register_schemas, to_run_config  # noqa: E402
from zerorun.memory.buffers import zero3_live_peak  # noqa: E402
from zerorun.memory.params import breakdown  # noqa: E402
from zerorun.hardware import GIB, Hardware  # noqa: E402

MODELS = ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"]
GPUS, NODES = 8, 1
HW = Hardware("cuda", GPUS, 80 * GIB, 1024 * GIB, NODES, 64)
WORLD = World(nproc_per_node=GPUS, nnodes=NODES, accelerator="cuda")
SHAPE = ["precision=bf16", "trainer.micro_batch_size=8", "data.seq_len=1024"]
# (label, zerorun overrides, DeepSpeed estimator, cpu_offload, cpu_offload_params)
ROWS = [
    ("ZeRO-2", ["zero=stage2"], 2, False, False),
    ("ZeRO-2 + offload cpu", ["zero=stage2", "offload=cpu"], 2, True, False),
    ("ZeRO-3", ["zero=stage3"], 3, False, False),
    ("ZeRO-3 + offload opt", ["zero=stage3", "offload=cpu", "offload.params=false"], 3, True, False),
    ("ZeRO-3 + offload all", ["zero=stage3", "offload=cpu"], 3, True, True),
]
STATE_KEYS = ("parameters", "persistent parameters", "gradients", "fp32 master copies", "optimizer states",
              "optimizer-step transient", "offload staging buffer")


def composed(*overrides):
    with initialize_config_module("zerorun.conf", version_base=None):
        return to_run_config(compose("config", overrides=list(overrides)))


def gib(n: float) -> str:
    return f"{n / GIB:7.2f}"


def main() -> None:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    register_schemas()
    print(f"{GPUS} GPUs × {NODES} node, bf16, micro-batch 8 × seq 1024 "
          "(GiB; DeepSpeed's CPU figures include its 1.5× factor)")
    print(f"{'model':12s} {'config':22s} | {'DS GPU':>7s} {'zerorun states':>14s} {'zerorun peak':>12s} | "
          f"{'DS CPU/node':>11s} {'zerorun host/node':>17s}")
    print("-" * 106)
    for name in MODELS:
        base = composed(f"+model={name}", *SHAPE)
        P = M.count_params(base.model)
        largest = M.param_breakdown(base.model).largest_tensor  # wte: DeepSpeed's largest_layer_params here
        for label, extra, ds_stage, off, off_params in ROWS:
            cfg = composed(f"+model={name}", *SHAPE, *extra)
            e = M.estimate(cfg, make_plan(cfg, WORLD), HW)
            step = e.phases["optimizer step"]
            states = sum(v for k, v in step.items() if k in STATE_KEYS)
            if ds_stage == 3:
                states += e.phases["loss"].get("ZeRO-3 gathered params", 0)
                cpu, gpu, _ = estimate_zero3_model_states_mem_needs(P, largest, GPUS, NODES, cpu_offload=off,
                                                                    cpu_offload_params=off_params, zero_init=False)
            else:
                cpu, gpu = estimate_zero2_model_states_mem_needs(P, GPUS, NODES, cpu_offload=off)
            print(f"{name:12s} {label:22s} | {gib(gpu)} {gib(states):>14s} {gib(e.per_rank_peak_bytes):>12s} | "
                  f"{gib(cpu):>11s} {gib(e.host_bytes_per_node):>17s}")
        z3 = composed(f'+model={name}', *SHAPE, 'zero=stage3')
        print(f"{'':12s} ({P:,} params; peak of the ZeRO-3 row: {e.peak_phase} phase, top: "
              + ", ".join(f"{k} {v / GIB:.2f}" for k, v in M.estimate(z3, make_plan(z3, WORLD), HW).top(3)) + ")")
    print()

    # Latency: the pure estimator for gpt2-xl (config objects built beforehand; Hydra compose is separate).
    cfgs = [c for _, c in M.table_configs(composed("+model=gpt2-xl", *SHAPE))]
    zero3_live_peak.cache_clear()
    breakdown.cache_clear()
    t0 = time.perf_counter()
    M.estimate(cfgs[-1], make_plan(cfgs[-1], WORLD), HW)
    cold = time.perf_counter() - t0
    times = []
    for _ in range(50):
        for c in cfgs:
            t0 = time.perf_counter()
            M.estimate(c, make_plan(c, WORLD), HW)
            times.append(time.perf_counter() - t0)
    refused = composed("+model=gpt2-large", "zero=stage0", "precision=fp32", "data.seq_len=1024",
                       "trainer.micro_batch_size=8")
    small_gpus = Hardware("cuda", 8, 16 * GIB, 512 * GIB, 1, 64)
    t0 = time.perf_counter()
    for _ in range(20):
        decision = M.gate(refused, make_plan(refused, WORLD), small_gpus, GateMode.autofit)
    gate_t = (time.perf_counter() - t0) / 20
    t0 = time.perf_counter()
    for _ in range(5):
        composed("+model=gpt2-xl", *SHAPE)
    compose_t = (time.perf_counter() - t0) / 5
    print("estimator latency, gpt2-xl (1.56B), pure arithmetic:")
    print(f"  estimate(): median {1e6 * statistics.median(times):.0f} µs, max {1e6 * max(times):.0f} µs over "
          f"{len(times)} calls ({len(cfgs)} ZeRO × offload configs); first call with cold caches {1e3 * cold:.2f} ms")
    print(f"  full table of {len(cfgs)} configs: {1e3 * statistics.median(times) * len(cfgs):.1f} ms")
    print(f"  gate(autofit) on gpt2-large ZeRO-0 fp32 seq 1024 micro 8, 8 × 16 GiB: {1e3 * gate_t:.1f} ms "
          f"→ {' '.join(decision.overrides)}")
    print(f"  Hydra compose of one config (zerorun-estimate pays it once): {1e3 * compose_t:.0f} ms")


if __name__ == "__main__":
    main()
