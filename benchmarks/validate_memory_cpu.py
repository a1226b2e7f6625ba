"""CPU validation of zerorun.memory: the estimate next to what real tensors hold (figures, not a test).

    DS_ACCELERATOR=cpu python benchmarks/validate_memory_cpu.py [--quick] [--out measurements.json]

Runs the measurement matrix of benchmarks/memory_harness.py in this process (one thread: it can run next
to other jobs) and prints its tables and accuracy summary; tests/integration/test_memory_validation.py
runs the same matrix and holds the accuracy targets. What is measured and how: memory_harness.py's
docstring and docs/memory.md §8.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory_harness as MM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="no real-size models; offload at ZeRO-2 only")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--out", help="also write the raw measurements as JSON")
    args = ap.parse_args()
    MM.setup_process()
    t0 = time.perf_counter()
    data = MM.run_matrix(tiny=MM.TINY_MODELS, real=() if args.quick else MM.REAL_MODELS, dtypes=[MM.Dtype.fp32, MM.Dtype.bf16],
                         seqs=[64, 256], real_seqs=[64, 128], micro=args.micro, quick=args.quick,
                         log=lambda line: print(line, file=sys.stderr, flush=True))
    if args.out:
        Path(args.out).write_text(json.dumps(data, indent=1))
    print("\n".join(MM.report(data, time.perf_counter() - t0)[0]))


if __name__ == "__main__":
    main()
