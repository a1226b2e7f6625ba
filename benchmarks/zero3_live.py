"""ZeRO-3's gathered parameters, counted in real DeepSpeed engines against zerorun's replay
(memory/buffers.py ``zero3_live_peak``), over settings of stage3_max_reuse_distance and stage3_max_live_parameters.

Two CPU ranks (gloo) train a 16-layer Llama-class model (hidden 256, GQA 8/2, a tied 16k vocabulary: 19.3M
parameters, the embedding 21% of them as in Llama-3.2-1B); every module's pre- and post-forward hook sums the
elements of the non-persistent parameters DeepSpeed holds gathered or in flight (``ds_status`` not
NOT_AVAILABLE), and every parameter's gradient hook in backward, on the third step (the trace is recorded on the
first two). Prints the measured peak, the count at
the loss and the replay's figure; tests/unit/test_zero3_gathered.py holds these figures.

    DS_ACCELERATOR=cpu python benchmarks/zero3_live.py                        # 7 settings, ~40 s each
    DS_ACCELERATOR=cpu python benchmarks/zero3_live.py --random 8 --seed S    # held out: random models and settings
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SETTINGS = [(0, 8e6), (1e9, 8e6), (0, 3e6), (15.6e6, 8e6), (8e6, 1e9), (0, 1e9), (15.6e6, 1e9)]
"""(stage3_max_reuse_distance, stage3_max_live_parameters): below, at and above the model's 19.3M elements."""


SPEC = {"family": "llama", "layers": 16, "hidden": 256, "vocab": 16000}


def model():
    """The model of SPEC: a Llama-class decoder (GQA 4:1, tied head) or GPT-2 (biases, learned positions)."""
    import memory_harness as MM

    f, L, h, v = SPEC["family"], SPEC["layers"], SPEC["hidden"], SPEC["vocab"]
    if f == "gpt2":
        return dataclasses.replace(MM.model_file("gpt2"), name=f"gpt2-{L}x{h}", num_layers=L, hidden_size=h,
                                   num_heads=h // 32, vocab_size=v, max_positions=128)
    return dataclasses.replace(MM.model_file("llama-3.2-1b"), name=f"llama-{L}x{h}", num_layers=L, hidden_size=h,
                               num_heads=h // 32, num_kv_heads=max(1, h // 128), head_dim=32, intermediate_size=4 * h,
                               vocab_size=v, max_positions=512)


def replay(reuse: float, max_live: float) -> int:
    from zerorun.config import World, make_plan
    from zerorun.memory import params as P
    from zerorun.memory.buffers import zero3_live_peak

    cfg = run_cfg(reuse, max_live)
    plan = make_plan(cfg, World(nproc_per_node=2, nnodes=1, accelerator="cpu"))
    return zero3_live_peak(P.model_key(cfg.model), plan.buckets.stage3_param_persistence_threshold, int(reuse),
                           int(max_live))


def run_cfg(reuse: float, max_live: float):
    import memory_harness as MM
    from zerorun.config import Dtype, OffloadDevice

    cfg = MM.run_cfg(model(), Dtype("bf16"), False, 64, 2, 3, OffloadDevice.none)
    cfg.zero.stage3_max_reuse_distance, cfg.zero.stage3_max_live_parameters = int(reuse), int(max_live)
    return cfg


def rank(reuse: float, max_live: float) -> None:
    """One rank of the 2-rank job (under torchrun): prints the step-3 figures on rank 0."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    import memory_harness as MM
    from zerorun.config import World, default_task, make_plan
    from zerorun.ds_config import render
    from zerorun.models import build_model

    cfg = run_cfg(reuse, max_live)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    ds = render(cfg, make_plan(cfg, World(nproc_per_node=2, nnodes=1, accelerator="cpu")))
    torch.manual_seed(0)
    net = build_model(cfg.model, default_task(cfg.model.family), 2)
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()), config=ds)
    params = list(engine.module.parameters())

    def gathered() -> int:
        return sum(p.ds_numel for p in params if not p.ds_persist and p.ds_status != ZeroParamStatus.NOT_AVAILABLE)

    peak = [0]

    def hook(*_):
        peak[0] = max(peak[0], gathered())

    for mod in engine.module.modules():
        mod.register_forward_pre_hook(hook)
        mod.register_forward_hook(hook)
    for p in params:  # backward: as each parameter's gradient arrives
        if p.requires_grad:
            p.register_hook(lambda grad: hook())
    inputs = MM.batch(cfg.model, 2, 64, device="cpu")
    for _ in range(3):
        peak[0] = 0
        loss = engine(**inputs).loss
        at_loss = gathered()
        engine.backward(loss)
        engine.step()
    if dist.get_rank() == 0:
        print(f"RESULT {peak[0]} {at_loss}", flush=True)
    dist.destroy_process_group()


def draws(n: int, seed: int):
    """Held-out cases: a family and shape, and both settings as fractions of that model's size."""
    import random

    from zerorun.memory import params as P

    rng = random.Random(seed)
    for _ in range(n):
        SPEC.update(family=rng.choice(["llama", "gpt2"]), layers=rng.randint(4, 24), hidden=rng.choice([128, 256, 384]),
                    vocab=rng.randint(2000, 30000))
        total = P.breakdown(P.model_key(model())).total
        yield dict(SPEC), int(rng.choice([0, rng.uniform(0, 1.5)]) * total), int(rng.uniform(0.1, 1.5) * total)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random", type=int, default=0, help="this many held-out draws instead of the fixed settings")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cases = list(draws(args.random, args.seed)) if args.random else [(dict(SPEC), r, m) for r, m in SETTINGS]
    print(f"{'model':>14} {'reuse distance':>15} {'max live':>10} | {'measured peak':>14} {'at the loss':>12} | "
          f"{'replay':>12}  error")
    for spec, reuse, max_live in cases:
        SPEC.update(spec)
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                              "--master_port", "29517", __file__, "--rank", str(reuse), str(max_live),
                              *map(str, spec.values())],
                             env=env, capture_output=True, text=True, timeout=600)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")), None)
        if line is None:
            sys.exit(f"the 2-rank job failed (exit code {out.returncode}):\n{out.stderr[-3000:]}")
        peak, at_loss = map(int, line.split()[1:])
        sim = replay(reuse, max_live)
        print(f"{model().name:>14} {reuse:>15.3g} {max_live:>10.3g} | {peak:>14,} {at_loss:>12,} | {sim:>12,}  "
              f"{100 * (sim - peak) / peak:+.1f}%", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        SPEC.update(family=sys.argv[4], layers=int(sys.argv[5]), hidden=int(sys.argv[6]), vocab=int(sys.argv[7]))
        rank(float(sys.argv[2]), float(sys.argv[3]))
    else:
        main()
