"""Fit the CPU profile's DeepSpeed-side terms (zerorun/speed.py CPU_RANK) to benchmarks/autofit_rank.py logs.

    python benchmarks/autofit_rank.py ... > rank.log
    python benchmarks/fit_speed_profile.py rank.log [more.log ...] [--fit-cases lm-tiny,lm-4x256,lm-states]

Reads every measured (case, config, s/step) of the logs (median over rounds and logs), grid-searches the
per-call collective latency, the collective bandwidth, the matmul efficiency and the activation bandwidth for
the least squared log error on the ``--fit-cases`` (the others are held out), and prints each config's
measured time next to the shipped and the fitted prediction, and per case the rank correlation and how far
the fitted model's favourite is from the measured best. Figures, not a test.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import autofit_rank as A  # noqa: E402

GRID = dict(latency=[0.18e-3, 0.5e-3, 1e-3, 2e-3, 4e-3], bandwidth_gib=[0.2, 0.3, 0.45, 0.7, 1.0, 1.43],
            efficiency=[0.7, 1.0, 1.3], activation=[0.7e9, 1.0e9, 1.5e9])


def measured(logs: List[str]) -> Dict[Tuple[str, str], float]:
    runs: Dict[Tuple[str, str], List[float]] = {}
    case = None
    for log in logs:
        for line in Path(log).read_text().splitlines():
            m = re.match(r"== (\S+):", line)
            if m:
                case = m.group(1)
                continue
            m = re.match(r"\s+round \d+: (.*): ([\d.]+) s/step", line)
            if m and case:
                runs.setdefault((case, m.group(1)), []).append(float(m.group(2)))
    return {k: statistics.median(v) for k, v in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--fit-cases", default="lm-tiny,lm-4x256,lm-states")
    a = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from zerorun import speed
    from zerorun.config import World, compose, make_plan

    points = []
    for (case, changes), secs in measured(a.logs).items():
        overrides, _ = A.CASES[case]
        cfg = compose([*overrides, *A.COMMON, *([] if changes == "(as given)" else changes.split())])
        points.append((case, changes, secs, cfg, make_plan(cfg, World(2, 1, "cpu"))))
    fit_cases = set(a.fit_cases.split(","))

    def profile(lat, gib, eff, act):
        return dataclasses.replace(speed.CPU_RANK, collective_latency_s=lat, collective_bytes_per_s=gib * 2**30,
                                   internode_bytes_per_s=gib * 2**30, efficiency=eff, activation_bytes_per_s=act)

    def loss(prof) -> float:
        return sum(math.log(speed.predict_step_time(cfg, plan, prof).seconds / secs) ** 2
                   for case, _, secs, cfg, plan in points if case in fit_cases)

    best = min(itertools.product(*GRID.values()), key=lambda p: loss(profile(*p)))
    fitted = profile(*best)
    print(f"fitted on {sorted(fit_cases)}: latency {best[0] * 1e3:.2f} ms, bandwidth {best[1]:.2f} GiB/s, "
          f"efficiency {best[2]:.2f}, activation bandwidth {best[3] / 1e9:.2f} GB/s")
    by_case: Dict[str, List[Tuple[float, float]]] = {}
    for case, changes, secs, cfg, plan in points:
        shipped = speed.predict_step_time(cfg, plan).seconds
        pred = speed.predict_step_time(cfg, plan, fitted).seconds
        by_case.setdefault(case, []).append((pred, secs))
        print(f"  {case:9s} measured {secs:6.3f}  shipped {shipped:6.3f}  fitted {pred:6.3f}  {changes[:80]}")
    for case, rows in by_case.items():
        pred, meas = [r[0] for r in rows], [r[1] for r in rows]
        favourite = min(rows)[1]
        print(f"{case:9s} {'(fitted)' if case in fit_cases else '(held out)':10s} Spearman "
              f"{A.spearman(pred, meas):.2f}; predicted fastest measured {favourite / min(meas) - 1:+.1%} vs best "
              f"({len(rows)} configs)")


if __name__ == "__main__":
    main()
