"""How far identical ranks of one job differ in resident memory: the floor any per-rank point estimate meets.

    python benchmarks/rank_pairs.py benchmarks/results/rss-random/seed-*.jsonl

For every stored job with ranks 0 and 1 of the same config (data parallel: same model, batch and estimate; no
pipeline, whose stages differ), the kernel's peak RSS of each after training ("trained": before rank 0 alone
exports), and |a − b| / max(a, b). Figures, not a test.
"""
import json
import statistics
import sys
from collections import defaultdict

MIB = 2**20


def main(files):
    jobs = defaultdict(dict)
    for f in files:
        for line in open(f):
            r = json.loads(line)
            if r.get("measured") and "parallel=pipeline" not in r["config"]:
                jobs[(f, r["config"])][r["rank"]] = r["by_point"].get("trained")
    pairs = sorted((abs(v[0] - v[1]) / max(v[0], v[1]), v[0], v[1], cfg) for (f, cfg), v in jobs.items()
                   if v.get(0) and v.get(1))
    if not pairs:
        sys.exit("no job with ranks 0 and 1 in these files")
    spread = [p[0] for p in pairs]
    print(f"{len(pairs)} pairs of identical ranks: median {100 * statistics.median(spread):.1f}%, 90th percentile "
          f"{100 * spread[int(0.9 * len(spread))]:.1f}%, largest {100 * spread[-1]:.1f}%")
    for s, a, b, cfg in pairs[-8:]:
        print(f"  {100 * s:5.1f}%  {a / MIB:6.0f} {b / MIB:6.0f} MiB  {cfg[:110]}")


if __name__ == "__main__":
    main(sys.argv[1:])
