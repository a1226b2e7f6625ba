"""Every large allocation of a CPU rank under tcmalloc, in order, with whether it grew the heap: the instrument
for the page-heap term that does not move what it measures (docs/memory.md §5.4).

The sampler thread (sitecustomize.py) perturbs placement: GPT-2 small, ZeRO-1, CPU offload, bf16, SGD,
checkpointing, micro 14 × 288, one rank peaked at 3,577 MiB with it and at 4,073 MiB without, three runs alike.
bigalloc.c is preloaded in front of tcmalloc and logs each allocation of at least BIGALLOC_MIN bytes (32 MiB) and
its free, with tcmalloc's heap size before and after, from the allocating thread, with no allocation of its own:
the same rank peaked at 4,073 MiB with it. Many logged events do move a rank: at BIGALLOC_MIN=8 MiB a MiniLM rank
(ZeRO-0, fp32, micro 4 × 352) read 861 MiB at its first step, twice, against 904 in two plain runs (likely the
page-heap lock each event's counters take; a free no longer scans the table unless its block is large, and that
did not change it). Keep the threshold at the blocks you study.

    python benchmarks/heap_sampler/bigalloc.py build                 # gcc, once (writes bigalloc.so beside it)
    LD_PRELOAD="$PWD/benchmarks/heap_sampler/bigalloc.so /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4" \\
        BIGALLOC_DIR=/tmp/big zerorun +model=gpt2 ...               # your LD_PRELOAD wins: the ranks get both
    python benchmarks/heap_sampler/bigalloc.py show /tmp/big/big-PID.log
"""
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MIB = 2**20


def build() -> Path:
    out = HERE / "bigalloc.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(out), str(HERE / "bigalloc.c"), "-ldl"], check=True)
    return out


def show(path: str, all_blocks: bool = False) -> None:
    """Allocations that grew the heap (and, with ``all_blocks``, every one), seconds from the first."""
    rows = [line.split() for line in open(path)]
    t0 = float(rows[0][1]) if rows else 0.0
    for op, t, size, ptr, _, h0, _, h1, _, free in rows:
        grew = int(h1) - int(h0)
        if all_blocks or (op != "F" and grew > 0):
            grown = f"  grew {grew / MIB:+.0f}" if grew > 0 else ""
            print(f"{'free ' if op == 'F' else 'alloc'} t {float(t) - t0:8.2f}  {int(size) / MIB:8.1f} MiB  "
                  f"heap {int(h0) / MIB:7.0f} -> {int(h1) / MIB:7.0f}{grown}  free spans {int(free) / MIB:.0f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["build"]:
        print(build())
    elif sys.argv[1:2] == ["show"]:
        show(sys.argv[2], "--all" in sys.argv)
    else:
        sys.exit(__doc__)
