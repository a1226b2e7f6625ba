"""``python -m zerorun.ship_traces [--check] [NAME ...]``: trace every shipped model file at zerorun-estimate's
shapes, afresh, and write the results beside traced.py (traced.SHIPPED), so a user's first estimate of a 7-9B model
reads them instead of tracing for ~15 s.

Each model file is estimated as users ask most: on this machine's CPU ranks, and for one 24 GiB GPU (the
table's rows then trace that precision and micro-batch). Run it after a change to what a trace key holds, to the
tracing or to the pinned torch/transformers/peft; ``--check NAME ...`` (tests/integration/test_shipped_traces.py)
says when: it fails if any model file's estimate would trace, or if a fresh trace of NAME differs from the file.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence

GPU_24 = ["hardware.gpus_per_node=1", "hardware.gpu_mem_gib=24"]


def model_files() -> List[str]:
    """The shipped model files (+model=NAME), the config.json template (hf) aside."""
    import zerorun.conf

    return sorted(p.stem for p in (Path(zerorun.conf.__file__).parent / "model").glob("*.yaml") if p.stem != "hf")


def variants(name: str) -> List[List[str]]:
    return [[f"+model={name}"], [f"+model={name}", *GPU_24]]


def estimate_all(names: Sequence[str], use_shipped: bool, log=print) -> Dict[str, object]:
    """The cache entries zerorun-estimate writes for ``names`` (by file stem: kind-digest) into an empty cache:
    with ``use_shipped``, only what the shipped file lacks; without, everything, traced afresh."""
    from . import estimate_cli
    from . import arch
    from .arch import traced
    from .memory import buffers, params

    traced.USE_SHIPPED = use_shipped
    for memo in (traced._MEMO.clear, params.breakdown.cache_clear, buffers.zero3_live_peak.cache_clear,
                 arch._census.cache_clear, arch._saved_sizes.cache_clear):
        memo()  # what this process already holds in front of the cache, shipped entries included
    before = os.environ.get("ZERORUN_CACHE")
    try:
        with tempfile.TemporaryDirectory() as cache:
            os.environ["ZERORUN_CACHE"] = cache
            for name in names:
                t0 = time.perf_counter()
                for argv in variants(name):
                    out = io.StringIO()
                    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                        rc = estimate_cli.main(list(argv))
                    if rc != 0:
                        raise SystemExit(f"zerorun-estimate {' '.join(argv)} exited {rc}:\n{out.getvalue()}")
                log(f"{name}: {time.perf_counter() - t0:.1f} s")
            return {p.stem: json.loads(p.read_text()) for p in sorted(Path(cache, "traces").glob("*.json"))}
    finally:  # not a deleted folder for what this process does next
        if before is None:
            os.environ.pop("ZERORUN_CACHE", None)
        else:
            os.environ["ZERORUN_CACHE"] = before


def check(names: Sequence[str]) -> int:
    """1 when an estimate of a shipped model file would trace (a key the shipped file lacks: stale), or a fresh
    trace of ``names`` disagrees with what is shipped; else 0."""
    from .arch import traced

    missing = estimate_all(model_files(), use_shipped=True, log=lambda line: None)
    fresh = estimate_all(names, use_shipped=False, log=lambda line: None)
    shipped = traced._shipped()
    differ = sorted(k for k, v in fresh.items() if shipped.get(k) != v)
    print(f"not shipped: {len(missing)} {sorted(missing)[:5]}; traced afresh for {', '.join(names) or 'none'}: "
          f"{len(fresh)}, differing from the shipped: {len(differ)} {differ[:5]}")
    return 1 if missing or differ else 0


def main(argv: Sequence[str] = ()) -> int:
    from .arch import traced

    args = list(argv)
    if args[:1] == ["--check"]:
        return check(args[1:])
    names = args or model_files()
    entries = estimate_all(names, use_shipped=False)
    with open(traced.SHIPPED, "w") as f:
        json.dump(entries, f, sort_keys=True, separators=(",", ":"))
        f.write("\n")
    print(f"{len(entries)} entries for {len(names)} model files -> {traced.SHIPPED} "
          f"({os.path.getsize(traced.SHIPPED) / 1e3:.0f} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
