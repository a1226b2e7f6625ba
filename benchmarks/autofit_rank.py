"""Does autofit pick the fastest config that fits? Run the candidates and see where its choice ranks.

    python benchmarks/autofit_rank.py [--cases lm-tiny,lm-4x256,bert] [--runs 5] [--rounds 2] [--steps 8]

For each (model, memory budget) case: the gate's candidates are estimated against the declared budget
(hardware.host_mem_gib: 2 CPU ranks share it), autofit picks one by predicted step time (zerorun/speed.py),
and ``--runs`` of the configs that fit are launched for real: autofit's choice plus others spread evenly over
the predicted order (fastest, middle, slowest). Each runs ``--steps`` optimizer steps; the instrument is this
script's clock (when each metrics.jsonl line appears: steps after the warm-up / wall time), not zerorun's step
timer. Rounds rotate the order (the 2-core machine drifts ±15%); the median per config counts. Prints, per
case, predicted and measured s/step with both ranks, and autofit's choice against the measured best
(target: within 10%). Figures, not a test.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import BIN, step_times  # noqa: E402

COMMON = ["launcher.nproc_per_node=2", "launcher.mmap_threshold_mib=32", "trainer.progress=false",
          "trainer.export=false", "trainer.report=false", "trainer.save_every=0"]
CASES: Dict[str, Tuple[List[str], float]] = {
    # name: (overrides, hardware.host_mem_gib: the budget, tight enough that the config as given does not fit)
    "lm-tiny": (["+model=tiny-gpt2", "trainer.micro_batch_size=16", "data.seq_len=256"], 1.5),
    "lm-4x256": (["+model=tiny-gpt2", "model.num_layers=4", "model.hidden_size=256", "model.num_heads=4",
                  "model.intermediate_size=1024", "model.vocab_size=8192", "model.max_positions=256",
                  "trainer.micro_batch_size=8", "data.seq_len=256", "zero=stage1"], 1.5),
    "bert": (["+model=tiny-bert", "trainer.micro_batch_size=64", "data.seq_len=128",
              "data.group_by_length=false"], 1.3),
    # Model states matter here (29M parameters, short sequences): the fixed ladder kept ZeRO-0 and recomputed;
    # the step-time model takes ZeRO-1 instead.
    "lm-states": (["+model=tiny-gpt2", "model.num_layers=4", "model.hidden_size=512", "model.num_heads=8",
                   "model.intermediate_size=2048", "model.vocab_size=32000", "model.max_positions=256",
                   "trainer.micro_batch_size=8", "data.seq_len=128"], 2.2),
    # Held out: not among the runs the CPU profile's DeepSpeed terms were fitted to (bf16, 6 layers).
    "lm-bf16": (["+model=tiny-gpt2", "model.num_layers=6", "model.hidden_size=384", "model.num_heads=6",
                 "model.intermediate_size=1536", "model.vocab_size=16000", "model.max_positions=256",
                 "trainer.micro_batch_size=8", "data.seq_len=256", "precision=bf16"], 1.6),
}


def candidates(overrides: List[str], budget: float):
    """Every config the gate may choose that fits the budget, fastest predicted first; autofit's choice; and the
    fixed ladder's (the first that fits in the gate's candidate order: what autofit chose before it ranked by
    speed)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from zerorun.config import compose, make_plan, plan_world
    from zerorun.hardware import detect, resolve_hardware
    from zerorun.memory import estimate
    from zerorun.memory.gate import fastest, fitting_configs

    cfg = compose([*overrides, *COMMON, f"hardware.host_mem_gib={budget}"])
    hw = resolve_hardware(cfg.hardware, detect())
    plan = make_plan(cfg, plan_world(cfg, hw))
    assert not estimate(cfg, plan, hw).fits, "the budget must be too small for the config as given"
    in_ladder_order = fitting_configs(cfg, plan, hw)
    fits = [([c.override() for c in f.changes], f.step.seconds) for f in in_ladder_order]
    fits.sort(key=lambda f: f[1])
    choice = fastest(in_ladder_order)
    ladder = [c.override() for c in in_ladder_order[0].changes]
    return fits, [c.override() for c in choice.changes], ladder, plan.global_batch_size * plan.seq_len


def pick(fits, must, n: int):
    """The configs in ``must`` (autofit's and the ladder's choices) and others spread evenly over the predicted
    order, ``n`` in all."""
    out = [f for f in fits if f[0] in must]
    for i in range(n):
        f = fits[round(i * (len(fits) - 1) / max(1, n - 1))]
        if len(out) < n and f not in out:
            out.append(f)
    return sorted(out, key=lambda f: f[1])


def measure(overrides: List[str], changes: List[str], budget: float, steps: int, warmup: int) -> float:
    """Seconds per optimizer step, by this script's clock, over the steps after the warm-up."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [str(BIN / "zerorun"), *overrides, *COMMON, *changes, f"trainer.max_steps={steps}", "gate=off",
               f"hydra.run.dir={run_dir}"]
        seen = step_times(cmd, dict(os.environ), metrics=run_dir / "metrics.jsonl")
    return (seen[steps] - seen[warmup]) / (steps - warmup)


def ranks(values: List[float]) -> List[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0] * len(values)
    for r, i in enumerate(order):
        out[i] = r + 1
    return out


def spearman(a: List[float], b: List[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1)) if n > 1 else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--runs", type=int, default=5, help="configs run per case (autofit's choice among them)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    summary = []
    for name in a.cases.split(","):
        overrides, budget = CASES[name]
        fits, chosen, ladder, tokens = candidates(overrides, budget)
        runs = pick(fits, [chosen, ladder], a.runs)
        print(f"\n== {name}: {' '.join(overrides)}; budget hardware.host_mem_gib={budget} (2 CPU ranks); "
              f"{len(fits)} configs fit; {tokens} tokens/step", flush=True)
        times: Dict[int, List[float]] = {i: [] for i in range(len(runs))}
        for r in range(a.rounds):
            order = list(range(len(runs)))
            order = order[r % len(order):] + order[:r % len(order)] if r % 2 == 0 else order[::-1]
            for i in order:
                times[i].append(measure(overrides, runs[i][0], budget, a.steps, a.warmup))
                print(f"  round {r + 1}: {' '.join(runs[i][0]) or '(as given)'}: {times[i][-1]:.3f} s/step", flush=True)
        measured = [statistics.median(times[i]) for i in range(len(runs))]
        predicted = [f[1] for f in runs]
        mr, pr = ranks(measured), ranks(predicted)
        print(f"\n  {'config (changes)':72s} {'pred s':>7s} {'rank':>4s} {'meas s':>7s} {'rank':>4s}")
        for i, (changes, pred) in enumerate(runs):
            mark = ("  <- autofit" if changes == chosen else "") + ("  <- fixed ladder" if changes == ladder else "")
            print(f"  {' '.join(changes)[:72]:72s} {pred:7.3f} {pr[i]:4d} {measured[i]:7.3f} {mr[i]:4d}{mark}")
        c = next(i for i, f in enumerate(runs) if f[0] == chosen)
        lad = next(i for i, f in enumerate(runs) if f[0] == ladder)
        gap, lgap = measured[c] / min(measured) - 1, measured[lad] / min(measured) - 1
        rho = spearman(predicted, measured)
        print(f"  autofit's choice: measured rank {mr[c]} of {len(runs)}, {gap:+.1%} vs the measured best "
              f"(the fixed ladder's: {lgap:+.1%}); rank correlation (Spearman) {rho:.2f}", flush=True)
        summary.append((name, budget, len(fits), mr[c], len(runs), gap, lgap, rho))
    print(f"\n{'case':10s} {'budget GiB':>10s} {'fit':>4s} {'autofit rank':>13s} {'vs best':>8s} {'ladder vs best':>15s} "
          f"{'Spearman':>9s}")
    for name, budget, nfit, rank, n, gap, lgap, rho in summary:
        print(f"{name:10s} {budget:10.2f} {nfit:4d} {f'{rank} of {n}':>13s} {gap:+8.1%} {lgap:+15.1%} {rho:9.2f}")


if __name__ == "__main__":
    main()
